"""The autograd Functions of the engine's time loop, binding the C step kernels (``_native``).

Legend: D directions, N packed rows of one direction (the valid (t, b), step after step; step
t's rows are the active prefix of the length-sorted batch), B batch, H hidden size, G gates.
Each Function runs, per step, one batched recurrent GEMM (both directions) and one fused C
pointwise kernel; its backward runs the kernel's backward and the recurrent GEMM in reverse and
computes the recurrent weight gradient (and LayerNorm / peephole parameter gradients) as large
reductions after the loop. The time loops run in one C call each (``lstm_forward_loop``,
``lstm_backward_loop``, ``gru_*_loop``: the step products on ``_native/gemm.h``'s kernel, no
return to Python or torch between steps; with bf16 products too, the loops rounding the step
products' operands to bf16: :func:`_rounds_bf16`, and multiplying them on the CPU's bf16
dot-product instructions where it has them, ``_native/gemm_bf16.h``) unless a projection or fp16
products need torch ops between the steps; then the loops below drive the step kernels from
Python. The large products (input projection, input gradient, weight gradients) run on
``_native/matmul.c`` where :func:`_own` (float32 / float64) or :func:`own_bf16` (bf16) chooses it,
else on torch's BLAS. The two Functions share this file's helpers (the kernels' signatures, the
buffers' step addresses, the low-precision copies), hence one file of about 700 lines.
"""

from __future__ import annotations

import ctypes
import itertools

import torch
from torch import Tensor
from .. import _native
from .._core import pool, precision as _precision, twice
from .._native import address
from ._common import as_dtype, in_dtypes
from ._reference import packed_layer_reference, recorded_layer_backward

EPS = 1e-5
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
P = ctypes.c_void_p
I64, INT = ctypes.c_int64, ctypes.c_int


def _typed(name: str, signatures) -> ctypes.CDLL | None:
    """The native library holding the kernels of ``name``, their argtypes declared (signatures(real)
    -> {function stem: argtypes}, :func:`fastlayers._native.declare`); None where it is unavailable."""
    lib = _native.load(name)
    return _native.declare(lib, name, signatures) if lib is not None else None


def _lstm_lib():
    return _typed("lstm", lambda real: {
        "lstm_step_forward": [I64] * 6 + [P] * 4 + [P] * 4 + [P] * 5 + [P] * 3 + [P] * 4 + [real, real] + [P, P, real, real]
        + [INT],
        "lstm_step_backward": [I64] * 5 + [P] * 4 + [I64] + [P] * 3 + [P] * 5 + [P] * 4 + [real] + [P, P, real, real]
        + [P] * 3 + [P] * 6 + [INT],
        "lstm_forward_loop": [I64] * 3 + [P] + [I64] * 2 + [P] * 3 + [P] * 7 + [P] * 8 + [P] * 4 + [real, real] + [P, P]
        + [real, real, INT, INT, INT],
        "lstm_backward_loop": [I64] * 3 + [P] + [I64] * 2 + [P] * 4 + [P] * 5 + [P] * 4 + [P] * 5 + [P] * 4 + [real]
        + [P, P, real, real] + [P] * 5 + [P] * 6 + [INT, INT]})


def _gru_lib():
    return _typed("gru", lambda real: {
        "gru_step_forward": [I64] * 6 + [P] * 4 + [P] * 4 + [P] * 7 + [P, real, P, real, INT],
        "gru_step_backward": [I64] * 5 + [P] * 5 + [P] * 3 + [P] * 4 + [real] + [P] * 6 + [INT],
        "gru_forward_loop": [I64] * 3 + [P] + [I64] * 2 + [P] * 3 + [P] * 7 + [P] * 7 + [P, real, P, real, INT, INT,
                                                                                          INT],
        "gru_backward_loop": [I64] * 3 + [P] + [I64] * 2 + [P] * 4 + [P] * 5 + [P] * 5 + [P] * 4 + [real] + [P] * 9
        + [INT, INT, INT]})


def _matmul_lib():
    return _typed("matmul", lambda real: {"fl_matmul": [I64] * 4 + [P, P, P, INT, P, P, P, P, INT],
                                          "fl_matmul_sum": [I64] * 4 + [P, I64, P, P, INT, P, P, P, P, INT],
                                          "fl_matmul_sum_scratch": [I64, I64, I64, P],
                                          "fl_matmul_tn": [I64] * 4 + [P] * 5 + [INT],
                                          "fl_matmul_tn_scratch": [I64, I64, P]})


def _own(mm: _precision.Products, rows: int, *tensors: Tensor | None) -> bool:
    """Whether a large product of these operands, ``rows`` rows per direction, runs on
    ``_native/matmul.c`` (the choice for this CPU and size, :func:`fastlayers._native.own_products`):
    products in float32 / float64, every operand of that dtype and contiguous."""
    if mm.mixed or mm.acc not in _SUFFIX or not _native.own_products(rows):
        return False
    return all(t is None or (t.dtype == mm.acc and t.is_contiguous()) for t in tensors)


def own_bf16(mm: _precision.Products, rows: int) -> bool:
    """Whether a large product in bf16 (bf16 operands, float32 sums), ``rows`` rows per direction,
    runs on ``_native/matmul.c``'s VDPBF16PS kernel with its float32 result written in place
    (:func:`fastlayers._native.bf16_large_products`: no AMX, the library's kernels at that size),
    instead of torch's bf16 GEMM, whose bf16 result is then converted; outside torch.compile."""
    return (mm.lowered and mm.low == torch.bfloat16 and mm.acc == torch.float32
            and not torch.compiler.is_compiling() and _native.bf16_large_products(rows))


def _native_matmul_bf16(a: Tensor, w: Tensor, trans: bool, bias: Tensor | None, out: Tensor) -> Tensor:
    """out[d] = a[d] @ (w[d]^T if trans else w[d]) (+ bias[d] on every row) on matmul.c's
    ``fl_matmul_bf16`` (:func:`own_bf16`): a (D, M, K) as bf16 (converted here where it is not),
    w (D, N, K) or (D, K, N) in float32 (rounded to bf16 as the kernel packs it) or bf16, bias (D,
    N), out (D, M, N) float32."""
    lib = _native.library()
    a = a.to(torch.bfloat16).contiguous()
    w = (w if w.dtype in (torch.float32, torch.bfloat16) else w.float()).contiguous()
    bias = bias.to(torch.float32).contiguous() if bias is not None else None
    dirs, rows, k = a.shape
    n, threads = out.size(2), torch.get_num_threads()
    packed = pool.empty((dirs * -(-n // 32) * -(-k // 2) * 64,), torch.bfloat16, a)
    scratch = pool.empty((threads * lib.fl_matmul_bf16_scratch(k),), torch.bfloat16, a)
    lib.fl_matmul_bf16(dirs, rows, k, n, a.data_ptr(), None, w.data_ptr(), int(w.dtype == torch.bfloat16), int(trans),
                       address(bias), out.data_ptr(), packed.data_ptr(), scratch.data_ptr(), threads)
    return out


def reads_rows(mm: _precision.Products, src: Tensor, x: Tensor, w_ih: Tensor, bias: Tensor | None) -> bool:
    """Whether a layer's Function reads its packed rows from the padded input ``x`` (R, F) through
    the index ``src`` (D, N) itself: where :func:`_own` puts its products on matmul.c (the
    projection gathers the rows block by block in cache, dX adds every direction's rows into the
    padded rows, dW_ih packs them; no (D, N, F) copy made or saved), outside torch.compile."""
    return not torch.compiler.is_compiling() and _own(mm, src.size(1), x, w_ih, bias)


def _native_matmul(a: Tensor, w: Tensor, trans: bool, bias: Tensor | None, out: Tensor,
                   src: Tensor | None = None) -> Tensor:
    """out[d] = a[d] @ (w[d]^T if trans else w[d]) (+ bias[d] on every row) on matmul.c's kernel:
    a (D, M, K), w (D, N, K) or (D, K, N), bias (D, N), out (D, M, N), all contiguous, one dtype;
    with ``src`` (D, M) int64, a (R, K) and row i of a[d] is row src[d, i] of a."""
    dirs, rows = src.shape if src is not None else a.shape[:2]
    k, n, threads = a.size(-1), out.size(2), torch.get_num_threads()
    # the packed weight from the block cache (as every per-call buffer of MiBs here: a fresh one costs its
    # pages' first touch on every call, about 0.2 ms per MB (_core/pool.py), as much as a short call's product)
    packed = pool.empty(_packed_weight(k, n, dirs), out.dtype, out)
    # (gathered rows: fl_matmul_scratch_rows() of them per thread)
    scratch = pool.empty((threads * _native.library().fl_matmul_scratch_rows() * k,), a.dtype, a) \
        if src is not None else None
    getattr(_matmul_lib(), f"fl_matmul_{_SUFFIX[out.dtype]}")(
        dirs, rows, k, n, a.data_ptr(), address(src), w.data_ptr(), int(trans), address(bias), out.data_ptr(),
        packed.data_ptr(), address(scratch), threads)
    return out


def _project(mm: _precision.Products, xs: Tensor, w_ih: Tensor, bias: Tensor | None, xp: Tensor,
             src: Tensor | None = None) -> None:
    """The input projection into ``xp``: xp[d] = xs[d] W_ih[d]^T (+ bias[d] on every row);
    (D, N, F) x (D, G, F) -> (D, N, G); with ``src`` (:func:`reads_rows`) xs is the padded (R, F)
    and xs[d] its rows src[d]."""
    if src is not None:
        _native_matmul(xs, w_ih, True, bias, xp, src)
    elif _own(mm, xs.size(1), xs, w_ih, bias, xp):
        _native_matmul(xs, w_ih, True, bias, xp)
    elif own_bf16(mm, xs.size(1)):
        _native_matmul_bf16(xs, w_ih, True, bias, xp)
    elif bias is not None:
        mm.baddbmm(bias.unsqueeze(1), xs, w_ih.transpose(1, 2), out=xp)
    else:
        mm.bmm(xs, w_ih.transpose(1, 2), out=xp)


def _input_grad(mm: _precision.Products, dpre: Tensor, w_ih: Tensor, dtype: torch.dtype, src: Tensor | None = None,
                num_rows: int = 0) -> Tensor:
    """dX[d] = dpre[d] W_ih[d]: (D, N, G) x (D, G, F) -> (D, N, F) in ``dtype``; with ``src``
    (:func:`reads_rows`) the padded input's gradient (num_rows, F): each row the sum of the rows of
    every direction that read it (zero where none did), one product on matmul.c (fl_matmul_sum)."""
    if src is not None:
        return _input_grad_rows(dpre, w_ih, src, num_rows).to(dtype)
    if own_bf16(mm, dpre.size(1)):
        out = pool.empty((*dpre.shape[:2], w_ih.size(2)), torch.float32, dpre)
        return _native_matmul_bf16(dpre, w_ih, False, None, out).to(dtype)
    if not _own(mm, dpre.size(1), dpre, w_ih):
        return mm.bmm(dpre, w_ih, dtype=dtype)
    return _native_matmul(dpre, w_ih, False, None, pool.empty((*dpre.shape[:2], w_ih.size(2)), dpre.dtype, dpre)
                          ).to(dtype)


def _weight_grad(mm: _precision.Products, p: Tensor, q: Tensor, dtype: torch.dtype, src: Tensor | None = None) -> Tensor:
    """dW[d] = p[d]^T q[d] summed over all packed rows: (D, N, G) x (D, N, F) -> (D, G, F) in
    ``dtype``, on matmul.c's transposed product where :func:`_own` chooses it, else torch's bmm; with
    ``src`` (:func:`reads_rows`) q is the padded (R, F) and q[d] its rows src[d]."""
    if src is None and mm.low == torch.float16 and not mm.native:
        # float16's range: a gate gradient beyond 65504 (the step after a zero state, through the
        # recurrent LayerNorm's 1 / std) would round to inf and meet h = 0 there (NaN); the gradient
        # multiplies unrounded in float32, as the reference's autograd multiplies it
        with torch.autocast(p.device.type, enabled=False):
            return torch.bmm(p.transpose(1, 2).to(mm.acc), mm.operand(q)).to(dtype)
    if src is None and not _own(mm, p.size(1), p, q):
        return mm.bmm(p.transpose(1, 2), q, dtype=dtype)
    dirs, rows, m = p.shape
    n, threads = q.size(-1), torch.get_num_threads()
    lib, suffix = _matmul_lib(), _SUFFIX[p.dtype]
    values = ctypes.c_int64()
    getattr(lib, f"fl_matmul_tn_scratch_{suffix}")(n, threads, ctypes.addressof(values))
    out = pool.empty((dirs, m, n), p.dtype, p)
    scratch = pool.empty((values.value,), p.dtype, p)
    getattr(lib, f"fl_matmul_tn_{suffix}")(dirs, m, n, rows, p.data_ptr(), q.data_ptr(), address(src),
                                           out.data_ptr(), scratch.data_ptr(), threads)
    return out.to(dtype)


def _input_grad_rows(dpre: Tensor, w_ih: Tensor, src: Tensor, num_rows: int) -> Tensor:
    """:func:`_input_grad` with ``src``: dX (num_rows, F) from the block cache. The rows run in the
    first direction's packed order (src[0]: every valid row once); direction d's packed row for each
    is found through the inverse of src[d]."""
    dirs, rows = src.shape
    crows = src[0].contiguous()
    if dirs == 1:
        arows = torch.arange(rows, device=src.device).unsqueeze(0)
    else:
        inverse = torch.empty((dirs, num_rows), dtype=torch.int64, device=src.device)
        inverse.scatter_(1, src, torch.arange(rows, device=src.device).expand(dirs, rows))
        arows = inverse.gather(1, crows.expand(dirs, rows)).contiguous()
    f, threads = w_ih.size(2), torch.get_num_threads()
    dx = pool.empty((num_rows, f), dpre.dtype, dpre)
    if rows < num_rows:  # the padded rows no direction reads
        unread = torch.ones(num_rows, dtype=torch.bool, device=src.device)
        unread[crows] = False
        dx[unread] = 0
    lib, suffix, values = _matmul_lib(), _SUFFIX[dpre.dtype], ctypes.c_int64()
    getattr(lib, f"fl_matmul_sum_scratch_{suffix}")(w_ih.size(1), f, threads, ctypes.addressof(values))
    scratch = pool.empty((values.value,), dpre.dtype, dpre)
    packed = pool.empty(_packed_weight(w_ih.size(1), f, dirs), dpre.dtype, dpre)
    getattr(lib, f"fl_matmul_sum_{suffix}")(dirs, rows, w_ih.size(1), f, dpre.data_ptr(), rows, arows.data_ptr(),
                                            w_ih.data_ptr(), 0, dx.data_ptr(), crows.data_ptr(), packed.data_ptr(),
                                            scratch.data_ptr(), threads)
    return dx


def _rounds_bf16(mm: _precision.Products) -> bool:
    """Whether the time loops (forward and backward) run in C with their step products' operands
    rounded to bfloat16 (float32 values and sums): bf16 products with a float32 accumulator. fp16
    keeps the per-step torch GEMM (the C loops round to bf16 only)."""
    return mm.mixed and mm.low == torch.bfloat16 and mm.acc == torch.float32


#: whether the C time loops may run their bf16 step products on the CPU's bf16 dot-product
#: instructions (AVX512-BF16, checked in C; ``_native/gemm_bf16.h``) rather than in float32 on the
#: bf16-rounded values: the same products, summed in another order (tests compare the two)
BF16_DOT = True


def _low(round_bf16: bool) -> int:
    """The C time loops' ``low`` flag: 0 float32; 1 operands rounded to bf16, float32 products;
    2 the same with the products in bf16 where the CPU has the instructions (:data:`BF16_DOT`)."""
    return 0 if not round_bf16 else 2 if BF16_DOT else 1


def _first_input(hd: Tensor, h: Tensor, rmask: Tensor | None, first: int, round_bf16: bool) -> None:
    """The first step's recurrent input into hd's first rows: h0 (* rmask), rounded to bfloat16 with
    ``round_bf16`` (the C loops write the later steps' so)."""
    hd[:, :first] = h * rmask if rmask is not None else h
    if round_bf16:
        hd[:, :first] = hd[:, :first].to(torch.bfloat16)


def _step_weight(mm: _precision.Products, w_hh: Tensor, round_bf16: bool) -> Tensor:
    """W_hh as the C time loops take it: contiguous, in mm.acc; with ``round_bf16`` its values
    rounded to bfloat16."""
    return (w_hh.to(torch.bfloat16).to(mm.acc) if round_bf16 else mm.operand(w_hh)).contiguous()


def _packed_weight(k: int, n: int, dirs: int) -> tuple[int]:
    """Work space of the C time loops' packed step weight (gemm.h): D * K * N rounded up to 32."""
    return (dirs * k * -(-n // 32) * 32,)


def _active_array(active: tuple[int, ...]):
    """The active-prefix sizes as the C time loops read them (int64_t[T])."""
    return (I64 * len(active))(*active)


def _offsets(active: tuple[int, ...]) -> tuple[int, ...]:
    """First packed row of every step and the total: (0, n_0, n_0 + n_1, ..., N)."""
    return (0, *itertools.accumulate(active))


def _steps(buf: Tensor | None, offsets: tuple[int, ...]) -> list[int | None]:
    """Addresses of (d=0, first row of step t) of a contiguous [D, N, ...] packed buffer, every t."""
    if buf is None:
        return [None] * len(offsets)
    row = buf.stride(1) * buf.element_size()
    return [buf.data_ptr() + o * row for o in offsets]


def _low_copies(mm: _precision.Products, ctx, xs: Tensor, hd: tuple[int, ...]) -> dict:
    """Forward buffers for the low-precision copies of GEMM operands the backward reads again, when
    the products run in hardware bf16/fp16 (pooled calls only): the packed input (unless it is low
    already) and the recurrent inputs, converted once each instead of once per GEMM."""
    if not mm.lowered or _operator(ctx):
        return {}
    return {"xs_low": (tuple(xs.shape), mm.low) if xs.dtype != mm.low else None, "hd_low": (hd, mm.low)}


def _low_grads(mm: _precision.Products, shape: tuple[int, ...], separate: bool) -> dict:
    """Backward work space for the low-precision copies of the gate gradients: ``dr_low`` (filled
    step by step for the recurrent GEMM, reused by dW_hh) and ``dpre_low`` when dpre is another
    buffer (converted once for dX and dW_ih)."""
    if not mm.lowered:
        return {"dr_low": None, "dpre_low": None}
    return {"dr_low": (shape, mm.low), "dpre_low": (shape, mm.low) if separate else None}


def _into(low: Tensor | None, t: Tensor, offset: int | None = None) -> Tensor:
    """``t`` as a GEMM operand: copied into the low-precision buffer ``low`` (at packed row
    ``offset`` of dim 1 when given) where there is one, else ``t`` itself (the GEMM converts it)."""
    if low is None:
        return t
    part = low if offset is None else low[:, offset:offset + t.size(1)]
    return part.copy_(t)


def _copied(g: Tensor | None, acc: torch.dtype, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Work-space shape for an upstream gradient that needs a copy (another dtype, or not contiguous)."""
    return shape if g is not None and (g.dtype != acc or not g.is_contiguous()) else None


def _acc_grad(g: Tensor | None, space: Tensor | None, like: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The upstream gradient ``g`` contiguous in the accumulator dtype: itself, copied into the pooled
    ``space``, or zeros where autograd passed None."""
    if g is None:
        return like.new_zeros(shape)
    return g if space is None else space.copy_(g)


def _operator(ctx) -> bool:
    """Whether the Function runs inside an operator (``_ops_compile``: its buffers fresh tensors, the
    forward's outputs and the backward's inputs, every one of them kept and none written over)."""
    return getattr(ctx, "fresh", False)


def _keeps_gates(ctx, in_c: bool, gx: Tensor | None, gh: Tensor | None) -> bool:
    """Whether a layer's forward keeps its gates (LSTM; the GRU's gates and hbn). With both LayerNorms
    the C time loops keep none: the backward recomputes each row's from the projection and rhat, which
    it keeps anyway (one (D, N, G) buffer fewer, as many values to compute again as the forward's gate
    pass). The operators return every buffer (:func:`_operator`)."""
    return _operator(ctx) or not (in_c and gx is not None and gh is not None)


def _frees(ctx) -> bool:
    """Whether the saved buffers die with this backward: the graph is freed (no retain_graph /
    create_graph) and the Function is not an operator's, whose buffers are its inputs, declared
    unmutated. Then the backward gives them back to the pool, and the C time loop writes its
    gradients over those it has read: dpre over the gates (or, where it recomputes them, over the
    projection, the gate gradients of a step in dz) and dr over rhat, each row read before it is
    written (two (D, N, G) buffers fewer)."""
    return not _operator(ctx) and pool.graph_freed_after_this_backward()


def _either(low: Tensor | None, t: Tensor) -> Tensor:
    """The low-precision copy where one was made, else ``t``."""
    return t if low is None else low


class LSTMRecurrence(torch.autograd.Function):
    """One layer, all directions, on packed rows: the input projection and the time loop.

    Inputs: xs (D, N, F_l) the packed input rows; w_ih (D, G, F_l); gx (D, G) | None input
    LayerNorm gain (then the kernel normalises W_ih x and adds the bias after it); bias (D, G) |
    None (b_ih + b_hh); h0 (D, B, P), c0 (D, B, H); w_hh (D, G, P); gh (D, G) | None recurrent
    LayerNorm gain; gc, bc (D, H) | None cell LayerNorm gain, bias; peep (D, 3H) | None; w_hr
    (D, P, H) | None projection (P = H without); rmask (D, B, P) | None recurrent-dropout mask
    (scaled); zc (D, N, H), zh (D, N, P) | None zoneout keep-masks; active: tuple of the T
    active-prefix sizes (sum N); consts: (cell_clip or 0, z_c, z_h, proj_clip or 0) (the z are
    used where the masks are None); src (D, N) int64 | None: where given (:func:`reads_rows`), xs is
    the padded input's rows (R, F_l) and xs[d] its rows src[d] (the projection and dW_ih read them
    there, dX comes back as (R, F_l)). Returns y (D, N, P), h_n (D, B, P), c_n (D, B, H).

    The input projection is one batched GEMM before the loop, its gradients (dX, dW_ih) two after
    the backward loop, dW_hh (and dW_hr) one each. Saved per packed row, in buffers from
    :mod:`fastlayers._core.pool` (given back when the backward frees the graph): the projection, gates,
    c1, LayerNorm statistics (and the normalised recurrent product) and the recurrent input; the
    cell state before each step only with cell zoneout (otherwise it is the previous step's c1,
    or c0). With both LayerNorms and the C time loops, no gates: the backward loop recomputes them
    from the projection and the normalised recurrent product. A backward that frees the graph
    writes dpre and dr over saved buffers it has read (the gates or the projection, and the
    normalised recurrent product). Without a projection the C kernel does the whole step. With
    one, the kernel stops at h1 = o * tanh(.) (no zoneout, no recurrent input) and the projection,
    proj_clip, zoneout of h and the next recurrent input are torch ops on the step's rows.
    """

    @staticmethod
    def forward(ctx, xs, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, active, consts,
                src=None):
        ctx.dtypes = [t.dtype if t is not None else None for t in (xs, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep,
                                                                    w_hr)]
        mm = _precision.Products.of(xs)  # GEMM operands in mm.low, the rest in mm.acc (read autocast first)
        with torch.autocast(xs.device.type, enabled=False):
            return LSTMRecurrence._forward(ctx, mm, xs, w_ih, gx, bias, h0, c0,
                                           w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, active, consts, src)

    @staticmethod
    def _forward(ctx, mm, xs, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, active, consts,
                 src=None):
        acc = mm.acc
        originals = (xs, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh)  # for the backward
        dirs, rows = src.shape if src is not None else xs.shape[:2]
        gsize = w_ih.size(1)
        hidden = gsize // 4
        batch, out_size = h0.shape[1:]
        clip, zc_const, zh_const, pclip = consts
        fwd = getattr(_lstm_lib(), f"lstm_step_forward_{_SUFFIX[acc]}")
        threads = torch.get_num_threads()
        proj, first = w_hr is not None, active[0]  # first == B: every sequence runs step 0
        gx, bias, gh, gc, bc, peep, rmask, zc, zh = (as_dtype(t, acc) for t in (gx, bias, gh, gc, bc, peep, rmask, zc, zh))
        c0 = as_dtype(c0, acc)
        h, c = h0.to(acc, copy=True).contiguous(), c0.clone()
        # one C call runs the whole time loop (lstm.c's lstm_forward_loop, its own step products) unless
        # a projection or fp16 products need torch between the steps; with bf16 operands the loop writes
        # each step's recurrent input rounded to bf16 and multiplies it by W_hh rounded to bf16, in
        # float32: the products of bf16 operands summed in float32, the mixed-precision rule
        # (:mod:`fastlayers._core.precision`), without a torch GEMM and a Python step per time step
        round_bf16 = _rounds_bf16(mm)
        in_c = not proj and (not mm.mixed or round_bf16)
        kept_gates = _keeps_gates(ctx, in_c, gx, gh)
        # every row of these gets written; the cell state before each step needs its own copy only
        # when zoneout mixes in c0 (otherwise it is the previous step's c1)
        slab, buf = pool.views(dict(
            xp=(dirs, rows, gsize) if gx is not None else None, gates=(dirs, rows, gsize) if kept_gates else None,
            c1=(dirs, rows, hidden),
            hd=(dirs, rows, out_size), xstat=(dirs, rows, 2) if gx is not None else None,
            rhat=(dirs, rows, gsize) if gh is not None else None, rrstd=(dirs, rows) if gh is not None else None,
            cstat=(dirs, rows, 2) if gc is not None else None,
            chist=(dirs, rows, hidden) if zc is not None or zc_const else None, y1=(dirs, rows, hidden) if proj else None,
            **_low_copies(mm, ctx, xs, hd=(dirs, rows, out_size))),
            acc, xs.device, fresh=_operator(ctx))
        # the forward's own work space: the recurrent product; the projection is saved with the input
        # LayerNorm (its backward reads it), else written into the gates' rows, which the kernel turns
        # into the gates in place; without kept gates, a row of them per thread
        tmp_slab, tmp = pool.views(dict(r=(dirs * first * gsize,), y=(dirs, rows, out_size) if mm.mixed else None,
                                         wp=_packed_weight(out_size, gsize, dirs) if in_c else None,
                                         gw=None if kept_gates else (threads * gsize,)), acc, xs.device)
        xp, r = (buf["xp"] if gx is not None else buf["gates"]), tmp["r"]
        # the output in acc; with a low output dtype only the converted copy leaves (the float32 one is pooled)
        y = tmp["y"] if mm.mixed else pool.empty((dirs, rows, out_size), acc, xs)
        xs_op = _into(buf.get("xs_low"), xs)
        # with LayerNorm the kernel normalises W_ih x, then adds the bias
        _project(mm, xs_op, w_ih, bias if gx is None else None, xp, src)
        # with a projection the kernel writes h1 into y1 and keeps scratch state hk
        y1, hk = (buf["y1"], h.new_zeros(dirs, batch, hidden)) if proj else (y, h)
        keep = torch.empty(dirs, rows, out_size, dtype=torch.bool, device=xs.device) if proj and pclip else None
        hd, hd_low = buf["hd"], buf.get("hd_low")
        _first_input(hd, h, rmask, first, round_bf16)
        # torch's step products take the weights transposed and contiguous (one copy per call): a
        # transposed view as the GEMM's right operand took 3.3x as long on an AMD Zen 5 (issue 62), 1.07x
        # on Zen 3 (354 / 330 us); lstm.c's loop packs W_hh as it is
        w_t = None if in_c else mm.operand(w_hh.transpose(1, 2)).contiguous()
        w_hr_t = mm.operand(w_hr.transpose(1, 2)).contiguous() if proj else None
        offsets = _offsets(active)
        if in_c:
            w_hh = _step_weight(mm, w_hh, round_bf16)
            getattr(_lstm_lib(), f"lstm_forward_loop_{_SUFFIX[acc]}")(
                dirs, batch, len(active), _active_array(active), hidden, rows, w_hh.data_ptr(), tmp["wp"].data_ptr(),
                r.data_ptr(), xp.data_ptr(), address(buf["xstat"]), address(gx), address(bias), c.data_ptr(),
                h.data_ptr(), address(rmask), y.data_ptr(), (buf["gates"] if kept_gates else tmp["gw"]).data_ptr(),
                buf["c1"].data_ptr(), address(buf["chist"]), hd.data_ptr(), address(buf["rhat"]), address(buf["rrstd"]),
                address(buf["cstat"]), address(gh), address(gc), address(bc), address(peep), clip, EPS, address(zc),
                address(zh), zc_const, zh_const, 1 if kept_gates else 2, _low(round_bf16), threads)
            if hd_low is not None:  # the backward's dW_hh operand (exact: hd holds bf16 values)
                hd_low.copy_(hd)
        P_ = {} if in_c else {k: _steps(v, offsets) for k, v in {**buf, "xp": xp, "y1": y1, "zc": zc, "zh": zh}.items()}
        fixed = (address(gh), address(gc), address(bc), address(peep), clip, EPS)
        last = len(active) - 1
        for t, n in enumerate(active if not in_c else ()):
            o = offsets[t]
            rt = mm.bmm_prepared(_into(hd_low, hd[:, o:o + n], o), w_t,
                                 out=r[:dirs * n * gsize].view(dirs, n, gsize))  # contiguous
            n_next = active[t + 1] if t < last else 0
            fwd(dirs, batch, n, n_next, hidden, rows, P_["xp"][t], P_["xstat"][t], address(gx), address(bias),
                rt.data_ptr(), c.data_ptr(), hk.data_ptr(), None if proj else address(rmask), P_["y1"][t],
                P_["gates"][t], P_["c1"][t], P_["chist"][t], None if proj or t == last else P_["hd"][t + 1],
                P_["rhat"][t], P_["rrstd"][t], P_["cstat"][t], *fixed, P_["zc"][t], None if proj else P_["zh"][t],
                zc_const, 0.0 if proj else zh_const, threads)
            if proj:
                hp = mm.bmm_prepared(y1[:, o:o + n], w_hr_t)  # (D, n, P)
                if keep is not None:
                    keep[:, o:o + n] = hp.abs() <= pclip
                    hp.clamp_(-pclip, pclip)
                kh = zh[:, o:o + n] if zh is not None else zh_const
                h[:, :n] = hp if isinstance(kh, float) and kh == 0 else kh * h[:, :n] + (1 - kh) * hp
                y[:, o:o + n] = h[:, :n]
                if t < last:
                    nxt = h[:, :n_next] * rmask[:, :n_next] if rmask is not None else h[:, :n_next]
                    hd[:, o + n:o + n + n_next] = nxt
        y = y.to(mm.low)
        pool.give(tmp_slab)
        ctx.save_for_backward(*originals, keep)
        ctx.buf, ctx.release, ctx.mm, ctx.src = buf, pool.hold(ctx, slab), mm, src
        ctx.active, ctx.offsets, ctx.consts, ctx.batch = active, offsets, consts, batch
        ctx.has_bias = bias is not None
        # outputs in the low precision (mm.low: the input's dtype unless mixed), as torch's RNNs under autocast;
        # the final states so too, but in acc for checkpoint_every's segments (precision.states_in_acc)
        return y, h.to(_precision.state_dtype(mm)), c.to(_precision.state_dtype(mm))

    @staticmethod
    def backward(ctx, dy, dh_n, dc_n):
        if twice.recording(dy, dh_n, dc_n):  # create_graph: a differentiable recomputation instead of the kernels
            return _recorded_backward("LSTM", ctx, (dy, dh_n, dc_n))
        xs, w_ih, gx, bias, _, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, keep = ctx.saved_tensors
        buf, mm = ctx.buf, ctx.mm
        gates, hd, y1 = buf["gates"], buf["hd"], buf["y1"]  # (gates None: the C loop recomputes them)
        c1 = buf["c1"]
        dirs, rows, hidden = c1.shape
        gsize, batch, out_size = 4 * hidden, ctx.batch, hd.size(2)
        clip, zc_const, zh_const, pclip = ctx.consts
        proj = w_hr is not None
        bwd = getattr(_lstm_lib(), f"lstm_step_backward_{_SUFFIX[c1.dtype]}")
        threads = torch.get_num_threads()
        need = ctx.needs_input_grad
        acc = c1.dtype
        gx, bias, c0, gh, gc, bc, peep, rmask, zc, zh = (as_dtype(t, acc)
                                                          for t in (gx, bias, c0, gh, gc, bc, peep, rmask, zc, zh))
        dh = dh_n.to(acc, copy=True).contiguous() if dh_n is not None else c1.new_zeros(dirs, batch, out_size)
        dc = dc_n.to(acc, copy=True).contiguous() if dc_n is not None else c1.new_zeros(dirs, batch, hidden)
        # with a projection: the kernel's output gradient is d h1 (dy1), its own state gradient stays 0
        # bf16 operands (as the forward's): the C loop rounds dr, its own buffer then, for the step products
        round_bf16 = _rounds_bf16(mm)
        separate_dr = gh is not None or gx is not None or round_bf16
        in_c = not proj and (not mm.mixed or round_bf16)  # the whole loop in one C call (lstm_backward_loop)
        frees = _frees(ctx)
        over = in_c and frees  # (gradients written over saved buffers: _frees)
        over_dr = over and gh is not None
        slab, tmp = pool.views(dict(
            dpre=None if over else (dirs, rows, gsize), dr=(dirs, rows, gsize) if separate_dr and not over_dr else None,
            gs=(threads * gsize,) if over or gates is None else None,
            dz=(dirs * batch * gsize,) if gates is None else None,
            wp=_packed_weight(gsize, out_size, dirs) if in_c else None,
            dn=(dirs, batch, hidden), g=(dirs * ctx.active[0] * out_size,), dy1=(dirs, rows, hidden) if proj else None,
            dhp=(dirs, rows, out_size) if proj else None, **_low_grads(mm, (dirs, rows, gsize), separate_dr),
            dy=_copied(dy, acc, (dirs, rows, out_size))), acc, c1.device)
        dy = _acc_grad(dy, tmp["dy"], c1, (dirs, rows, out_size))
        dpre = tmp["dpre"] if not over else gates if gates is not None else buf["xp"]
        dn, g = tmp["dn"], tmp["g"]
        dr = buf["rhat"] if over_dr else dpre if tmp["dr"] is None else tmp["dr"]
        dr_low = tmp["dr_low"]
        # the kernel sums the bias gradient next to the input gain's (acc_b needs acc_gx)
        acc_gx = c1.new_zeros(dirs, gsize) if gx is not None and (need[2] or need[3]) else None
        acc_b = c1.new_zeros(dirs, gsize) if acc_gx is not None and ctx.has_bias and need[3] else None
        acc_gh = c1.new_zeros(dirs, gsize) if gh is not None and need[7] else None
        acc_gc = c1.new_zeros(dirs, hidden) if gc is not None and (need[8] or need[9]) else None
        acc_bc = c1.new_zeros(dirs, hidden) if acc_gc is not None else None
        acc_peep = c1.new_zeros(dirs, 3 * hidden) if peep is not None and need[10] else None
        dy1, dhp = (tmp["dy1"], tmp["dhp"]) if proj else (dy, None)
        dhk = c1.new_zeros(dirs, batch, hidden) if proj else dh
        offsets = ctx.offsets
        P_ = {} if in_c else {k: _steps(v, offsets)  # (per-step addresses: the Python loop only)
                              for k, v in {**buf, "dy1": dy1, "zc": zc, "zh": zh, "dpre": dpre, "dr": dr}.items()}
        fixed = (address(dn), address(acc_gx), address(acc_b), address(acc_gh), address(acc_gc), address(acc_bc),
                 address(acc_peep), threads)
        w_hh_p = mm.operand(w_hh)
        w_hr_p = mm.operand(w_hr) if proj else None
        if in_c:
            w_c = _step_weight(mm, w_hh, round_bf16)
            getattr(_lstm_lib(), f"lstm_backward_loop_{_SUFFIX[acc]}")(
                dirs, batch, len(ctx.active), _active_array(ctx.active), hidden, rows, w_c.data_ptr(),
                tmp["wp"].data_ptr(), g.data_ptr(), address(rmask), dy.data_ptr(), dh.data_ptr(), dc.data_ptr(),
                address(buf["chist"]), c0.data_ptr(), address(buf["xp"]), address(buf["xstat"]), address(gx),
                address(bias), address(gates), c1.data_ptr(), address(buf["rhat"]), address(buf["rrstd"]),
                address(buf["cstat"]), address(gh), address(gc), address(bc), address(peep), clip, address(zc),
                address(zh), zc_const, zh_const, dpre.data_ptr(), dr.data_ptr(), dn.data_ptr(), address(tmp["gs"]),
                address(tmp["dz"]), *fixed[1:-1],
                _low(round_bf16), threads)
            if dr_low is not None:  # dW_hh's operand (exact: dr holds bf16 values)
                dr_low.copy_(dr)
        for t in range(len(ctx.active) - 1, -1, -1) if not in_c else ():
            n, o = ctx.active[t], offsets[t]
            if proj:  # back through y = h, zoneout of h, proj_clip and the projection
                dtot = dy[:, o:o + n] + dh[:, :n]
                kh = zh[:, o:o + n] if zh is not None else zh_const
                if isinstance(kh, float) and kh == 0:
                    g_hp, dh[:, :n] = dtot, 0
                else:
                    g_hp, dh[:, :n] = (1 - kh) * dtot, kh * dtot
                if keep is not None:
                    g_hp = g_hp * keep[:, o:o + n]
                dhp[:, o:o + n] = g_hp
                dy1[:, o:o + n] = mm.bmm_prepared(g_hp, w_hr_p)
            # the cell state before step t: its saved copy, the previous step's c1, or c0
            c_before, c_stride = ((P_["chist"][t], rows) if buf["chist"] is not None else
                                  (P_["c1"][t - 1], rows) if t > 0 else (c0.data_ptr(), batch))
            bwd(dirs, batch, n, hidden, rows, P_["dy1"][t], dhk.data_ptr(), dc.data_ptr(), c_before, c_stride,
                P_["xp"][t], P_["xstat"][t], address(gx), P_["gates"][t], P_["c1"][t], P_["rhat"][t], P_["rrstd"][t],
                P_["cstat"][t], address(gh), address(gc), address(bc), address(peep), clip, P_["zc"][t],
                None if proj else P_["zh"][t], zc_const, 0.0 if proj else zh_const, P_["dpre"][t], P_["dr"][t],
                *fixed)
            gn = mm.bmm_prepared(_into(dr_low, dr[:, o:o + n], o), w_hh_p,
                                 out=g[:dirs * n * out_size].view(dirs, n, out_size))
            if rmask is not None:
                gn.mul_(rmask[:, :n])
            dh[:, :n] += gn
        # one GEMM each over all packed rows: dX[d] = dpre[d] W_ih[d], dW_ih[d] = dpre[d]^T X[d],
        # dW_hh[d] = dr[d]^T hd[d], dW_hr[d] = dhp[d]^T y1[d]
        dp_op = _into(tmp["dpre_low"], dpre) if separate_dr else _either(dr_low, dpre)  # (dr_low: dpre's copy)
        d_xs = _input_grad(mm, dp_op, w_ih, ctx.dtypes[0], ctx.src, xs.size(0)) if need[0] else None
        d_w_ih = _weight_grad(mm, dp_op, _either(buf.get("xs_low"), xs), ctx.dtypes[1], ctx.src) if need[1] else None
        d_bias = (acc_b if gx is not None else dpre.sum(1)) if ctx.has_bias and need[3] else None
        d_w_hh = _weight_grad(mm, _either(dr_low, dr), _either(buf.get("hd_low"), hd), mm.acc) if need[6] else None
        d_w_hr = mm.bmm(dhp.transpose(1, 2), y1) if proj and need[11] else None
        pool.give(slab)
        if frees:
            ctx.release()
            del ctx.buf
        grads = (d_xs, d_w_ih, acc_gx if need[2] else None, d_bias, dh if need[4] else None, dc if need[5] else None,
                 d_w_hh, acc_gh, acc_gc if need[8] else None, acc_bc if need[9] else None, acc_peep, d_w_hr)
        return (*in_dtypes(grads, ctx.dtypes), None, None, None, None, None, None)


class GRURecurrence(torch.autograd.Function):
    """One GRU layer, all directions, on packed rows (``_native/gru.c``): input projection and
    time loop, as :class:`LSTMRecurrence`.

    Inputs: xs (D, N, F_l); w_ih (D, G=3H, F_l); gx (D, G) | None input LayerNorm gain (then the
    kernel normalises W_ih x and adds b_ih after it); b_ih (D, G) | None; h0 (D, B, H); w_hh
    (D, G, H); b_hh (D, G) | None (added after the recurrent LayerNorm, inside r * (.) for the n
    gate, as torch.nn.GRU); gh (D, G) | None recurrent LayerNorm gain; rmask (D, B, H) | None;
    zh (D, N, H) | None zoneout keep-mask; active: the T active-prefix sizes; consts: (z_h,) used
    where the mask is None; src as :class:`LSTMRecurrence`'s. Returns y (D, N, H), h_n (D, B, H).
    """

    @staticmethod
    def forward(ctx, xs, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, active, consts, src=None):
        ctx.dtypes = [t.dtype if t is not None else None for t in (xs, w_ih, gx, b_ih, h0, w_hh, b_hh, gh)]
        mm = _precision.Products.of(xs)  # GEMM operands in mm.low, the rest in mm.acc (read autocast first)
        with torch.autocast(xs.device.type, enabled=False):
            return GRURecurrence._forward(ctx, mm, xs, w_ih, gx, b_ih, h0, w_hh,
                                          b_hh, gh, rmask, zh, active, consts, src)

    @staticmethod
    def _forward(ctx, mm, xs, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, active, consts, src=None):
        acc = mm.acc
        originals = (xs, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh)  # for the backward
        dirs, rows = src.shape if src is not None else xs.shape[:2]
        gsize = w_ih.size(1)
        hidden, batch, first = gsize // 3, h0.size(1), active[0]
        (zh_const,) = consts
        fwd = getattr(_gru_lib(), f"gru_step_forward_{_SUFFIX[acc]}")
        threads = torch.get_num_threads()
        gx, b_ih, b_hh, gh, rmask, zh = (as_dtype(t, acc) for t in (gx, b_ih, b_hh, gh, rmask, zh))
        h = h0.to(acc, copy=True).contiguous()
        round_bf16 = _rounds_bf16(mm)  # as the LSTM's
        in_c = not mm.mixed or round_bf16  # the whole time loop in one C call (gru_forward_loop), as the LSTM's
        kept_gates = _keeps_gates(ctx, in_c, gx, gh)  # (and hbn)
        slab, buf = pool.views(dict(  # every row of these gets written
            xp=(dirs, rows, gsize) if gx is not None else None, gates=(dirs, rows, gsize) if kept_gates else None,
            hbn=(dirs, rows, hidden) if kept_gates else None,
            hist=(dirs, rows, hidden), hd=(dirs, rows, hidden), xstat=(dirs, rows, 2) if gx is not None else None,
            rhat=(dirs, rows, gsize) if gh is not None else None, rrstd=(dirs, rows) if gh is not None else None,
            **_low_copies(mm, ctx, xs, hd=(dirs, rows, hidden))),
            acc, xs.device, fresh=_operator(ctx))
        # the forward's own work space (the projection is saved for the input LayerNorm's backward, else
        # written into the gates' rows, as the LSTM's; without kept gates, a row of them and of hbn per thread)
        tmp_slab, tmp = pool.views(dict(r=(dirs * first * gsize,), y=(dirs, rows, hidden) if mm.mixed else None,
                                         wp=_packed_weight(hidden, gsize, dirs) if in_c else None,
                                         gw=None if kept_gates else (threads * (gsize + hidden),)), acc, xs.device)
        y = tmp["y"] if mm.mixed else pool.empty((dirs, rows, hidden), acc, xs)  # as in LSTMRecurrence
        xp, r, hd, hd_low = (buf["xp"] if gx is not None else buf["gates"]), tmp["r"], buf["hd"], buf.get("hd_low")
        xs_op = _into(buf.get("xs_low"), xs)
        _project(mm, xs_op, w_ih, b_ih if gx is None else None, xp, src)  # (with LayerNorm: b_ih after it, in the kernel)
        _first_input(hd, h, rmask, first, round_bf16)
        w_t = None if in_c else mm.operand(w_hh.transpose(1, 2)).contiguous()  # (as the LSTM's)
        offsets = _offsets(active)
        if in_c:
            w_hh = _step_weight(mm, w_hh, round_bf16)
            getattr(_gru_lib(), f"gru_forward_loop_{_SUFFIX[acc]}")(
                dirs, batch, len(active), _active_array(active), hidden, rows, w_hh.data_ptr(), tmp["wp"].data_ptr(),
                r.data_ptr(), xp.data_ptr(), address(buf["xstat"]), address(gx), address(b_ih), h.data_ptr(),
                address(rmask), address(b_hh), y.data_ptr(), (buf["gates"] if kept_gates else tmp["gw"]).data_ptr(),
                (buf["hbn"] if kept_gates else tmp["gw"]).data_ptr(), buf["hist"].data_ptr(), hd.data_ptr(),
                address(buf["rhat"]), address(buf["rrstd"]), address(gh), EPS, address(zh), zh_const,
                1 if kept_gates else 2, _low(round_bf16), threads)
            if hd_low is not None:  # as the LSTM's
                hd_low.copy_(hd)
        P_ = {} if in_c else {k: _steps(v, offsets) for k, v in {**buf, "xp": xp, "y": y, "zh": zh}.items()}
        last = len(active) - 1
        for t, n in enumerate(active if not in_c else ()):
            o = offsets[t]
            rt = mm.bmm_prepared(_into(hd_low, hd[:, o:o + n], o), w_t,
                                 out=r[:dirs * n * gsize].view(dirs, n, gsize))  # contiguous
            fwd(dirs, batch, n, active[t + 1] if t < last else 0, hidden, rows, P_["xp"][t], P_["xstat"][t],
                address(gx), address(b_ih), rt.data_ptr(), h.data_ptr(), address(rmask), address(b_hh), P_["y"][t],
                P_["gates"][t], P_["hbn"][t], P_["hist"][t], P_["hd"][t + 1] if t < last else None, P_["rhat"][t],
                P_["rrstd"][t], address(gh), EPS, P_["zh"][t], zh_const, threads)
        y = y.to(mm.low)
        pool.give(tmp_slab)
        ctx.save_for_backward(*originals)
        ctx.buf, ctx.release, ctx.mm, ctx.src = buf, pool.hold(ctx, slab), mm, src
        ctx.active, ctx.offsets, ctx.consts, ctx.batch = active, offsets, consts, batch
        ctx.has_bias = (b_ih is not None, b_hh is not None)
        return y, h.to(_precision.state_dtype(mm))

    @staticmethod
    def backward(ctx, dy, dh_n):
        if twice.recording(dy, dh_n):  # create_graph: a differentiable recomputation instead of the kernels
            return _recorded_backward("GRU", ctx, (dy, dh_n))
        xs, w_ih, gx, b_ih, _, w_hh, b_hh, gh, rmask, zh = ctx.saved_tensors
        buf, mm = ctx.buf, ctx.mm
        gates, hd = buf["gates"], buf["hd"]  # (gates None: the C loop recomputes them)
        dirs, rows, hidden = hd.shape
        gsize, batch = 3 * hidden, ctx.batch
        (zh_const,) = ctx.consts
        bwd = getattr(_gru_lib(), f"gru_step_backward_{_SUFFIX[hd.dtype]}")
        threads = torch.get_num_threads()
        need = ctx.needs_input_grad
        acc = hd.dtype
        gx, b_ih, b_hh, gh, rmask, zh = (as_dtype(t, acc) for t in (gx, b_ih, b_hh, gh, rmask, zh))
        dh = dh_n.to(acc, copy=True).contiguous() if dh_n is not None else hd.new_zeros(dirs, batch, hidden)
        round_bf16 = _rounds_bf16(mm)  # as the LSTM's: dr its own buffer, rounded in the C loop
        in_c = not mm.mixed or round_bf16  # the whole loop in one C call (gru_backward_loop), as the forward's
        frees = _frees(ctx)
        over = in_c and frees  # (gradients written over saved buffers: _frees)
        over_dr = over and gh is not None
        # with the recurrent LayerNorm, dr is LNh's backward of dhb, and dhb is needed after the loop only for
        # b_hh's gradient, which the C loop sums: it holds one step's rows there
        step_dhb = in_c and gh is not None
        slab, tmp = pool.views(dict(dpre=None if over else (dirs, rows, gsize),
                                     dhb=(dirs * batch * gsize,) if step_dhb else (dirs, rows, gsize),
                                     dr=(dirs, rows, gsize) if (gh is not None or round_bf16) and not over_dr else None,
                                     gs=(threads * (gsize + hidden),) if over or gates is None else None,
                                     dz=(dirs * batch * gsize,) if gates is None else None,
                                     wp=_packed_weight(gsize, hidden, dirs) if in_c else None,
                                     g=(dirs * ctx.active[0] * hidden,), **_low_grads(mm, (dirs, rows, gsize), True),
                                     dy=_copied(dy, acc, (dirs, rows, hidden))), acc, hd.device)
        dy = _acc_grad(dy, tmp["dy"], hd, (dirs, rows, hidden))
        dpre = tmp["dpre"] if not over else gates if gates is not None else buf["xp"]
        dhb, g = tmp["dhb"], tmp["g"]
        dr = buf["rhat"] if over_dr else dhb if tmp["dr"] is None else tmp["dr"]
        dr_low = tmp["dr_low"]
        acc_gx = hd.new_zeros(dirs, gsize) if gx is not None and (need[2] or need[3]) else None
        acc_b = hd.new_zeros(dirs, gsize) if acc_gx is not None and ctx.has_bias[0] and need[3] else None
        acc_gh = hd.new_zeros(dirs, gsize) if gh is not None and need[7] else None
        acc_bhh = hd.new_zeros(dirs, gsize) if step_dhb and ctx.has_bias[1] and need[6] else None
        offsets = ctx.offsets
        P_ = {} if in_c else {k: _steps(v, offsets)  # (per-step addresses: the Python loop only)
                              for k, v in {**buf, "dy": dy, "zh": zh, "dpre": dpre, "dhb": dhb, "dr": dr}.items()}
        w_hh_p = mm.operand(w_hh)
        if in_c:
            w_c = _step_weight(mm, w_hh, round_bf16)
            getattr(_gru_lib(), f"gru_backward_loop_{_SUFFIX[acc]}")(
                dirs, batch, len(ctx.active), _active_array(ctx.active), hidden, rows, w_c.data_ptr(),
                tmp["wp"].data_ptr(), g.data_ptr(), address(rmask), dy.data_ptr(), dh.data_ptr(), buf["hist"].data_ptr(),
                address(gates), address(buf["hbn"]), address(buf["xp"]), address(buf["xstat"]), address(gx),
                address(b_ih), address(b_hh), address(buf["rhat"]), address(buf["rrstd"]), address(gh), address(zh),
                zh_const, dpre.data_ptr(), dhb.data_ptr(), dr.data_ptr(), address(tmp["gs"]), address(tmp["dz"]),
                address(acc_gx), address(acc_b), address(acc_gh), address(acc_bhh), int(step_dhb), _low(round_bf16),
                threads)
            if dr_low is not None:  # as the LSTM's
                dr_low.copy_(dr)
        for t in range(len(ctx.active) - 1, -1, -1) if not in_c else ():
            n, o = ctx.active[t], offsets[t]
            bwd(dirs, batch, n, hidden, rows, P_["dy"][t], dh.data_ptr(), P_["hist"][t], P_["gates"][t], P_["hbn"][t],
                P_["xp"][t], P_["xstat"][t], address(gx), P_["rhat"][t], P_["rrstd"][t], address(gh), P_["zh"][t],
                zh_const, P_["dpre"][t], P_["dhb"][t], P_["dr"][t], address(acc_gx), address(acc_b), address(acc_gh),
                threads)
            gn = mm.bmm_prepared(_into(dr_low, dr[:, o:o + n], o), w_hh_p,
                                 out=g[:dirs * n * hidden].view(dirs, n, hidden))
            if rmask is not None:
                gn.mul_(rmask[:, :n])
            dh[:, :n] += gn
        # one GEMM each over all packed rows: dX, dW_ih, dW_hh = dr^T hd
        dp_op = _into(tmp["dpre_low"], dpre)
        d_xs = _input_grad(mm, dp_op, w_ih, ctx.dtypes[0], ctx.src, xs.size(0)) if need[0] else None
        d_w_ih = _weight_grad(mm, dp_op, _either(buf.get("xs_low"), xs), ctx.dtypes[1], ctx.src) if need[1] else None
        d_b_ih = (acc_b if gx is not None else dpre.sum(1)) if ctx.has_bias[0] and need[3] else None
        d_w_hh = _weight_grad(mm, _either(dr_low, dr), _either(buf.get("hd_low"), hd), mm.acc) if need[5] else None
        d_b_hh = (acc_bhh if step_dhb else dhb.sum(1)) if ctx.has_bias[1] and need[6] else None
        pool.give(slab)
        if frees:
            ctx.release()
            del ctx.buf
        grads = (d_xs, d_w_ih, acc_gx if need[2] else None, d_b_ih, dh if need[4] else None, d_w_hh, d_b_hh, acc_gh)
        return (*in_dtypes(grads, ctx.dtypes), None, None, None, None, None)


def _recorded_backward(cell: str, ctx, grads: tuple) -> tuple[Tensor | None, ...]:
    """The backward of a layer while it is being recorded (create_graph): the vector-Jacobian product
    of :func:`~._reference.packed_layer_reference` on the saved inputs (:mod:`fastlayers._core.twice`)."""
    inputs = ctx.saved_tensors[:15 if cell == "LSTM" else 10]
    src = getattr(ctx, "src", None)

    def layout(xs, params, states, options, masks):
        if src is not None:  # the padded input's rows of every direction (differentiably)
            xs = xs.index_select(0, src.flatten()).view(*src.shape, xs.size(-1))
        return packed_layer_reference(cell, xs, params, states, ctx.active, options, masks)

    return (*recorded_layer_backward(cell, ctx, grads, inputs, layout), None, None, None)
