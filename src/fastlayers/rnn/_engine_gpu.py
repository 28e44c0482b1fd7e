"""The recurrent engine on the GPU: LSTM / GRU with cell options, Triton step kernels, cuBLAS GEMMs.

Legend: T time, B batch, F input features, H hidden size, G gates (4H LSTM, 3H GRU), P output
size (proj_size, or H), D directions, L layers.

Same math and signatures as the CPU engine (:mod:`._engine`), another layout: the CPU engine packs
the valid rows, this one keeps the padded batch and takes the lengths as data. Per layer, all
directions at once:

* the input projection of every (t, b) for every direction is one GEMM, x (T*B, F) @ W_ih^T
  (F, D*G), before the time loop; its gradients dX and dW_ih are one GEMM each after the backward
  loop (the gradient rows of padding positions are zero);
* per step s: one recurrent product (D, B, P) @ (D, P, G) (a Triton GEMM,
  :mod:`fastlayers._triton.step_matmul`) and one Triton kernel
  (:mod:`fastlayers._triton.lstm` / ``gru``) that runs, for each (direction, sequence), time
  t = s (forward) or T - 1 - s (reverse) where t < len_b, and otherwise leaves the state as it is
  and writes zeros at time t (the reverse direction waits out the padding first, so no address
  depends on the lengths); with a projection, one more GEMM and kernel;
* the backward runs the step kernels and the recurrent product in reverse (that product in S
  partial sums over slices of G, which the next step kernel adds); dW_hh (dW_hr) is one GEMM
  after the loop, the LayerNorm and peephole parameter gradients are sums over the per-row
  products the kernels wrote (deterministic: no atomics).

Grid of the step kernels (decided from the static facts of ``benchmarks/gpu_static.py``, Triton 3.6,
sm_90a; to be measured on the GPU): one 4-warp program per (direction, sequence), i.e. 64 programs
at the seed shape (D=2, B=32) on the H100's 132 SMs. Kept because (1) the LayerNorms need the
statistics of a whole row (4H pre-activations, H cell values): splitting a row over programs would
need a cross-program reduction per step (a second launch or atomics plus a grid barrier); (2) the
kernels are small next to the step's recurrent GEMM: 40-64 registers at H=256 without spills, six
reductions (one per LayerNorm statistic) and 11-17 barriers per step kernel, every step compiled
once (the step index is not specialised); (3) B*D programs fill the GPU from B=64 on (D=2).
Measured on the H100 (2026-11-24, eager LN-LSTM fwd+bwd under the profiler): step kernels 3.1 ms
(forward) + 3.7 ms (backward) of 18.6 ms device time, the recurrent products 7.2 ms. Not measured
yet: H=1024 (105-146 registers, no spills) and small B, where 8 warps per program, or rows split
over 2-4 programs for the kernels without LayerNorm, are the candidates.

Nothing in the time loop depends on the lengths' values or on T on the host: the step s is
device data of every launch (:mod:`fastlayers._triton._cell`), so a chunk of steps is captured
once in a CUDA graph and replayed for any lengths and any T (:mod:`._graphs`; the plain modules'
dispatch asks :func:`replays`). With lengths the loops run up to the longest sequence only (the
output's rows after it are zeros). The GEMMs outside the loop are torch's (cuBLAS); all follow
torch's precision flags: float32 GEMMs use TF32 only where
``torch.backends.cuda.matmul.allow_tf32`` allows it. Precision (:mod:`fastlayers._precision`):
float32 and float64 run in their dtype; bfloat16 / float16, and float32 under
``torch.autocast("cuda")``, take low-precision GEMM operands with float32 accumulation, and keep
the cell state, gates and LayerNorm statistics in float32.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _precision, _twice
from . import _graphs
from ._graphs import TIME
from ._common import as_dtype, drawn_masks, in_dtypes, input_bias
from ._engine_reference import layer_reference, recorded_layer_backward
from ._options import CellOptions

EPS = 1e-5


def lstm_engine_gpu(input: Tensor, hx: tuple[Tensor, Tensor], layers: list[list[dict[str, Tensor]]],
                    lengths: Tensor | None, options: CellOptions, *, dropout: float = 0.0, training: bool = False,
                    masks: list[dict[str, Tensor]] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """As :func:`fastlayers.rnn._engine.lstm_engine` (same arguments, results and masks), on the
    Triton backend (CUDA tensors; CPU tensors under Triton's interpreter). Also takes, for one
    layer, an input per direction: (D, T, B, F), direction d reading its own as it would the
    layer's (the reverse one from each sequence's last valid row back); its gradient is then
    (D, T, B, F), and such a call does not differentiate twice (RuntimeError)."""
    return _engine("LSTM", input, hx, layers, lengths, options, dropout, training, masks)


def gru_engine_gpu(input: Tensor, hx: tuple[Tensor], layers: list[list[dict[str, Tensor]]], lengths: Tensor | None,
                   options: CellOptions, *, dropout: float = 0.0, training: bool = False,
                   masks: list[dict[str, Tensor]] | None = None) -> tuple[Tensor, tuple[Tensor]]:
    """As :func:`fastlayers.rnn._engine.gru_engine`, on the Triton backend."""
    return _engine("GRU", input, hx, layers, lengths, options, dropout, training, masks)


# plain-call signature -> (_graphs.generation, longest T) for which every loop of such a call replays
_READY: "OrderedDict[tuple, tuple[int, int]]" = OrderedDict()
_READY_KEYS = 256
_UNREADY: set[tuple] = set()  # signatures whose capture failed: cuDNN from then on


def replays(module, input: Tensor) -> bool:
    """Whether every time loop of this call of the plain ``module`` (a fastlayers LSTM / GRU without
    cell options) replays captured graphs (:mod:`._graphs`), so that the engine can serve it
    without a capture. When not (the first call of a batch size, dtype, device or grad mode, a T
    longer than the captured buffers hold, or entries dropped since), the loops are captured now
    for the next such call, by a capture-only run of the engine on one step (its results unused;
    a failure warns), and False is returned: this call is cuDNN's. A call of at most
    ``_graphs.EAGER_STEPS`` steps is cuDNN's too (the engine would run its loops eagerly).

    input: (T, B, F), or (B, T, F) if ``module.batch_first``, or unbatched (T, F); on a device
    where :func:`._graphs.enabled`. Raises nothing (a failed capture warns)."""
    x = input if input.dim() == 3 else input.unsqueeze(0 if module.batch_first else 1)
    if module.batch_first:
        x = x.transpose(0, 1)
    steps, batch, features = x.shape
    if steps <= _graphs.EAGER_STEPS:  # the engine's loops would run eagerly: torch's kernels serve it
        return False
    grad = torch.is_grad_enabled() and (input.requires_grad or any(w.requires_grad for w in module._flat_weights))
    sig = (module.mode, batch, features, module.hidden_size, getattr(module, "proj_size", 0), module.num_layers,
           module.bidirectional, module.bias, _precision.dtypes(input), input.device, grad)
    ready = _READY.get(sig)
    if ready is not None and ready[0] == _graphs.generation and steps <= ready[1]:
        _READY.move_to_end(sig)
        return True
    if sig not in _UNREADY:
        _prepare(module, x, steps, grad, sig)
    return False


def _prepare(module, x: Tensor, steps: int, grad: bool, sig: tuple) -> None:
    """Capture the loops of a plain call of up to ``steps`` steps like x (T, B, F): the engine on
    one step of zeros with :func:`._graphs.preparing`, through its backward when ``grad``."""
    batch, features = x.shape[1:]
    dirs = 2 if module.bidirectional else 1
    engine = lstm_engine_gpu if module.mode == "LSTM" else gru_engine_gpu
    failed = _graphs.stats["failed"]
    try:
        with _graphs.preparing(steps) as claimed, torch.set_grad_enabled(grad):
            dummy = x.new_zeros(1, batch, features, requires_grad=grad and x.requires_grad)
            states = tuple(x.new_zeros(module.num_layers * dirs, batch, size) for size in module._state_sizes())
            out, final = engine(dummy, states, module._layer_parameters(), None, module.options, dropout=0.0,
                                training=module.training)
            if grad:
                inputs = [w for w in module._flat_weights if w.requires_grad] + ([dummy] if dummy.requires_grad else [])
                total = out.float().sum() + sum(f.float().sum() for f in final)
                torch.autograd.grad(total, inputs, allow_unused=True)
    except Exception as e:  # a failing speed path falls back, it does not fail the call
        warnings.warn(f"fastlayers: capturing the time loops of a plain {module.mode} failed ({type(e).__name__}: "
                      f"{e}); such calls stay on torch's kernels", RuntimeWarning, stacklevel=4)
        _UNREADY.add(sig)
        return
    if _graphs.stats["failed"] != failed or not claimed:
        _UNREADY.add(sig)
        return
    _READY[sig] = (_graphs.generation, min(claimed))
    while len(_READY) > _READY_KEYS:
        _READY.popitem(last=False)


def _engine(cell, input, hx, layers, lengths, options, dropout, training, masks):
    # input (T, B, F), or (D, T, B, F) for one layer whose directions read inputs of their own
    # (direction d's row (t, b) read as the layer's row (t, b) would be: the reverse direction runs
    # t from len_b - 1 down to 0; what _remat runs a segment's directions with, in one call)
    steps, batch = input.shape[-3:-1]
    dirs = len(layers[0])
    if input.dim() == 4 and (len(layers) != 1 or input.size(0) != dirs):
        raise ValueError(f"input: a (D, T, B, F) input is for one layer of D = {dirs} directions, got shape "
                         f"{tuple(input.shape)} for {len(layers)} layer(s)")
    gates = 4 if cell == "LSTM" else 3
    hidden = layers[0][0]["weight_hh"].size(0) // gates
    out_size = layers[0][0]["weight_hr"].size(0) if "weight_hr" in layers[0][0] else hidden
    dev = input.device
    # lengths (validated, CPU int64) are data of the kernels; the loops run up to the longest one
    # only (the steps after every sequence's end change nothing), and a batch of equal lengths
    # needs none (the kernels then take all T)
    lens, longest = None, steps
    if lengths is not None:
        longest = int(lengths.max())
        if not bool((lengths == longest).all()):
            lens = lengths.to(dev, non_blocking=True)
    z_h, z_c = options.zoneout
    ln, peep = options.layer_norm, options.peephole
    finals: list[list[Tensor]] = [[] for _ in hx]
    x = input[..., :longest, :, :]
    if lens is not None:  # padding is never read: zeros there keep NaN / inf out of dW_ih = dpre^T x
        x = x.masked_fill((torch.arange(longest, device=dev).unsqueeze(1) >= lens).unsqueeze(2), 0)
    for li, dir_params in enumerate(layers):
        stack = lambda name, use=True: _stack([p[name] for p in dir_params]) if use else None  # noqa: E731
        has_bias, bias = input_bias(cell, dir_params, stack)
        m = (masks[li] if masks is not None else None) or {}
        # drawn in the layout of given masks: (D, B, P); zoneout (D, T, B, width), original time and
        # batch order, as the kernels read them
        m = {**m, **drawn_masks(cell, options, training, m, (dirs, batch, out_size), (dirs, steps, batch), hidden,
                                out_size, x)}
        rmask = m.get("recurrent")
        zmasks = [m[key][:, :longest] if key in m else None for key in ("zoneout_c", "zoneout_h")]
        k = slice(li * dirs, (li + 1) * dirs)
        if cell == "LSTM":
            consts = (options.cell_clip or 0.0, 0.0 if training else z_c, 0.0 if training else z_h,
                      options.proj_clip or 0.0)
            y, *last = LSTMLayer.apply(
                x, stack("weight_ih"), stack("ln_ih_weight", ln), bias, hx[0][k], hx[1][k], stack("weight_hh"),
                stack("ln_hh_weight", ln), stack("ln_cell_weight", ln), stack("ln_cell_bias", ln),
                stack("weight_peephole", peep), stack("weight_hr", "weight_hr" in dir_params[0]),
                rmask, zmasks[0], zmasks[1], lens, consts)
        else:
            y, *last = GRULayer.apply(x, stack("weight_ih"), stack("ln_ih_weight", ln), bias, hx[0][k],
                                      stack("weight_hh"), stack("bias_hh", has_bias), stack("ln_hh_weight", ln), rmask,
                                      zmasks[1], lens, (0.0 if training else z_h,))
        x = y
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
        for acc, s in zip(finals, last):
            acc.append(s)
    if longest < steps:  # the rows after every sequence's end: zeros, as the packed path's output
        x = F.pad(x, (0, 0, 0, 0, 0, steps - longest))
    return x, tuple(torch.cat(f) if len(f) > 1 else f[0] for f in finals)


def _stack(tensors: list[Tensor]) -> Tensor:
    """The directions' parameters stacked (D, ...): one direction's is a view (no copy)."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _project_input(mm: _precision.Products, x: Tensor, w_ih: Tensor, bias: Tensor | None) -> Tensor:
    """x (T, B, F) @ W_ih^T for every direction, one GEMM: (T, B, D, G) in mm.acc, + bias if given.
    x (D, T, B, F), each direction's own input: one batched GEMM, then laid out as (T, B, D, G)."""
    steps, batch, features = x.shape[-3:]
    dirs, gsize, _ = w_ih.shape
    if x.dim() == 4:
        xp = mm.bmm(x.reshape(dirs, steps * batch, features), w_ih.transpose(1, 2))  # (D, T*B, G)
        if bias is not None:
            xp += bias.unsqueeze(1).to(xp.dtype)
        return xp.view(dirs, steps, batch, gsize).permute(1, 2, 0, 3).contiguous()
    xp = mm.matmul(x.reshape(steps * batch, features), w_ih.reshape(dirs * gsize, features).t())
    if bias is not None:
        xp += bias.reshape(1, dirs * gsize).to(xp.dtype)
    return xp.view(steps, batch, dirs, gsize)


def _input_grads(mm, dpre: Tensor, x: Tensor, w_ih: Tensor, need_x: bool, need_w: bool):
    """dX (T, B, F) and dW_ih (D, G, F) from dpre (T, B, D, G): one GEMM each. With x (D, T, B, F)
    (each direction's own input): dX (D, T, B, F), batched GEMMs."""
    steps, batch, dirs, gsize = dpre.shape
    if x.dim() == 4:
        per_dir = dpre.permute(2, 0, 1, 3).reshape(dirs, steps * batch, gsize)
        d_x = mm.bmm(per_dir, w_ih).view(dirs, steps, batch, -1) if need_x else None
        d_w = mm.bmm(per_dir.transpose(1, 2), x.reshape(dirs, steps * batch, -1)) if need_w else None
        return d_x, d_w
    flat = dpre.view(steps * batch, dirs * gsize)
    d_x = mm.matmul(flat, w_ih.reshape(dirs * gsize, -1)).view(steps, batch, -1) if need_x else None
    d_w = mm.matmul(flat.t(), x.reshape(steps * batch, -1)).view(dirs, gsize, -1) if need_w else None
    return d_x, d_w


def _outer(mm, a: Tensor, b: Tensor) -> Tensor:
    """sum over (T, B) of a^T b per direction: a (D, T, B, X), b (D, T, B, Y) -> (D, X, Y)."""
    dirs = a.size(0)
    return mm.bmm(a.reshape(dirs, -1, a.size(-1)).transpose(1, 2), b.reshape(dirs, -1, b.size(-1)))


def _slices(w: Tensor) -> int:
    """S: the partial sums a step's recurrent product a @ w (w (D, K, N), prepared) is split into
    (:mod:`fastlayers._triton.step_matmul`)."""
    from .._triton import step_matmul

    return step_matmul.slices(w.size(1))


def _product(mm, w: Tensor) -> Callable[[Tensor, tuple[Tensor, int], Tensor], Tensor]:
    """A time loop's product with the prepared ``w`` (D, K, N): ``product(a, at, out)`` -> out
    (S, D, B, N) or (D, B, N), the S partial sums of step clock[0] + j of a (D, TC, B, K), at =
    (clock, j) (:mod:`fastlayers._triton.step_matmul`; a mixed-precision call rounds a to its low
    dtype, as :meth:`fastlayers._precision.Products.bmm_prepared`)."""
    from .._triton import step_matmul

    low = mm.low if mm.mixed and w.dtype == mm.acc else None
    return lambda a, at, out: step_matmul.matmul(a, w, out, at, low)


def _tf32() -> bool:
    """Whether float32 step products use TF32 (read when a loop is captured: part of its key)."""
    return torch.backends.cuda.matmul.allow_tf32


def _lengths(lengths: Tensor | None, steps: int, batch: int, like: Tensor) -> Tensor:
    """The lengths as the kernels read them: (B,) int64 on like's device, all T when None."""
    if lengths is not None:
        return lengths
    return _graphs.constant(("lengths", steps, batch, like.device),
                            lambda: torch.full((batch,), steps, dtype=torch.int64, device=like.device), like.device)


def _numbers(kernels, consts: tuple, like: Tensor) -> Tensor:
    """``kernels.scalars(consts, EPS)`` as a tensor in like's dtype and device, a :func:`._graphs.constant`."""
    return _graphs.constant(("numbers", kernels.__name__, consts, like.dtype, like.device),
                            lambda: _graphs.values(kernels.scalars(consts, EPS), like.dtype, like.device), like.device)


def _result(loop: _graphs.Loop, t: Tensor, dtype: torch.dtype) -> Tensor:
    """A result of the loops in ``dtype``: a copy where the loop's buffers are an entry's (the next
    call replays into the same memory), else the buffer itself when already in ``dtype``."""
    if loop.captured:
        return t.to(dtype, copy=True)
    return t if t.dtype == dtype else t.to(dtype)


def _rows_sum(t: Tensor | None) -> Tensor | None:
    """Sum of per-row products (D, T, B, X) over the rows: (D, X)."""
    return None if t is None else t.sum((1, 2))


class LSTMLayer(torch.autograd.Function):
    """One LSTM layer, all directions, padded layout with lengths as data.

    Inputs: x (T, B, F); w_ih (D, G, F); gx (D, G) | None input LayerNorm gain; bias (D, G) | None
    (b_ih + b_hh); h0 (D, B, P), c0 (D, B, H); w_hh (D, G, P); gh (D, G) | None; gc, bc (D, H) |
    None; peep (D, 3H) | None (i, f, o); w_hr (D, P, H) | None; rmask (D, B, P) | None (scaled);
    zc (D, T, B, H), zh (D, T, B, P) | None zoneout keep-masks in original order; lengths (B,) int64
    on x's device | None (all T); consts (cell_clip or 0, z_c, z_h, proj_clip or 0). Returns
    y (T, B, D*P) (zeros at padding), h_n (D, B, P), c_n (D, B, H). The time loops run on the
    buffers of a :class:`._graphs.Loop` (captured chunks replayed, or eagerly), kept on ``ctx.loop``
    for the backward.
    """

    @staticmethod
    def forward(ctx, x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, lengths, consts):
        from .._triton import lstm as kernels

        ctx.dtypes = [t.dtype if t is not None else None for t in (x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep,
                                                                    w_hr)]
        originals = (x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, lengths)  # see backward
        mm = _precision.Products.of(x)  # read the autocast state before switching it off
        with torch.autocast(x.device.type, enabled=False):
            acc = mm.acc
            steps, batch = x.shape[-3:-1]
            dirs, gsize, _ = w_ih.shape
            hidden, out_size = gsize // 4, h0.size(2)
            _, zc_const, _, pclip = consts
            ln, proj = gx is not None, w_hr is not None
            gx, bias, gh, gc, bc, peep, rmask, zc, zh = (as_dtype(t, acc) for t in (gx, bias, gh, gc, bc, peep, rmask, zc,
                                                                               zh))
            xp = _project_input(mm, x, w_ih, None if ln else bias)  # with LayerNorm the kernel adds the bias
            step = (dirs, TIME, batch)
            ins = dict(xp=xp, bias=bias, gx=gx, h=h0.to(acc, copy=True), c=c0.to(acc, copy=True),
                       w_t=mm.operand(w_hh.transpose(1, 2)).contiguous(),
                       w_hr_t=mm.operand(w_hr.transpose(1, 2)).contiguous() if proj else None,
                       gh=gh, gc=gc, bc=bc, peep=peep, rmask=rmask, zc=zc, zh=zh,
                       lengths=_lengths(lengths, steps, batch, x), numbers=_numbers(kernels, consts, xp))
            outs = dict(
                gates=(*step, gsize), c1=(*step, hidden), hd=(*step, out_size),
                chist=(*step, hidden) if zc is not None or zc_const else None,
                xstat=(*step, 2) if ln else None, rhat=(*step, gsize) if ln else None, rrstd=step if ln else None,
                cstat=(*step, 2) if ln else None, y1=(*step, hidden) if proj else None,
                keep=(*step, out_size) if proj and pclip else None, y=(TIME, batch, dirs, out_size),
                r=(dirs, batch, gsize), hp=(dirs, batch, out_size) if proj else None)
            loop = _graphs.open(ctx, ("LSTM", consts, mm.low, _tf32()), steps, ins, outs, _TIMED)
            loop.run("forward", loop.st, _lstm_forward_prologue,
                     lambda st, js: _lstm_forward_steps(kernels, mm, st, consts, js))
            st = loop.st
        ctx.save_for_backward(*originals, x, w_ih, c0 if c0.dtype == acc else c0.to(acc), w_hh, w_hr)
        ctx.loop, ctx.mm, ctx.consts, ctx.has_bias = loop, mm, consts, bias is not None
        # captured: the state and output are copies (the next call replays into the same memory)
        return (_result(loop, st["y"][:steps].view(steps, batch, dirs * out_size), mm.low),
                _result(loop, st["h"], mm.low), _result(loop, st["c"], mm.low))

    @staticmethod
    def backward(ctx, dy, dh_n, dc_n):
        from .._triton import lstm as kernels

        if _twice.recording():  # create_graph: a differentiable recomputation instead of the kernels
            return _recorded_backward("LSTM", ctx, (dy, dh_n, dc_n))
        x, w_ih, c0, w_hh, w_hr = ctx.saved_tensors[16:]
        loop, mm, need = ctx.loop, ctx.mm, ctx.needs_input_grad
        fwd = loop.st
        steps = loop.steps
        dirs, gsize, _ = w_ih.shape
        batch, hidden, out_size = c0.size(1), gsize // 4, w_hh.size(2)
        ln, proj = fwd["gx"] is not None, w_hr is not None
        like = fwd["numbers"]
        acc = like.dtype
        with torch.autocast(like.device.type, enabled=False):
            dy = (dy.to(acc).contiguous() if dy is not None else like.new_zeros(steps, batch, dirs * out_size)
                  ).view(steps, batch, dirs, out_size)
            dh = dh_n.to(acc, copy=True).contiguous() if dh_n is not None else like.new_zeros(dirs, batch, out_size)
            dc = dc_n.to(acc, copy=True).contiguous() if dc_n is not None else like.new_zeros(dirs, batch, hidden)
            step = (dirs, TIME, batch)
            w = mm.operand(w_hh)
            ins = dict(dy=dy, dh=dh, dc=dc, c0=c0, w_hh=w, w_hr=mm.operand(w_hr) if proj else None)
            outs = dict(
                dpre=(TIME, batch, dirs, gsize), dr=(*step, gsize),
                pgx=(*step, gsize) if ln and need[2] else None, pb=(*step, gsize) if ln and ctx.has_bias and need[3]
                else None, pgh=(*step, gsize) if ln and need[7] else None,
                pgc=(*step, hidden) if ln and (need[8] or need[9]) else None,
                pbc=(*step, hidden) if ln and (need[8] or need[9]) else None,
                ppeep=(*step, 3 * hidden) if fwd["peep"] is not None and need[10] else None,
                dhp=(*step, out_size) if proj else None, g=(_slices(w), dirs, batch, out_size),
                dy1=(dirs, batch, hidden) if proj else None, dhk=(dirs, batch, hidden) if proj else None)
            st = loop.add(ins, outs, {"dy": 0})
            loop.run("backward", st, _lstm_backward_prologue,
                     lambda st, js: _lstm_backward_steps(kernels, mm, st, ctx.consts, js), reverse=True)
            g = st["g"].sum(0)
            dh = st["dh"] + (g * st["rmask"] if st["rmask"] is not None else g)
            dc = st["dc"].clone()
            cut = loop.cut(st)
            d_x, d_w_ih = _input_grads(mm, cut["dpre"], x, w_ih, need[0], need[1])
            d_bias = None
            if ctx.has_bias and need[3]:
                d_bias = _rows_sum(cut["pb"]) if ln else cut["dpre"].sum((0, 1))
            d_w_hh = _outer(mm, cut["dr"], cut["hd"]) if need[6] else None
            d_w_hr = _outer(mm, cut["dhp"], cut["y1"]) if proj and need[11] else None
            out = (d_x, d_w_ih, _rows_sum(cut["pgx"]), d_bias, dh if need[4] else None, dc if need[5] else None,
                   d_w_hh, _rows_sum(cut["pgh"]), _rows_sum(cut["pgc"]) if need[8] else None,
                   _rows_sum(cut["pbc"]) if need[9] else None, _rows_sum(cut["ppeep"]), d_w_hr)
        _graphs.backward_done(ctx)
        return (*in_dtypes(out, ctx.dtypes), None, None, None, None, None)


_TIMED = {"xp": 0, "zc": 1, "zh": 1}  # the time dimension of the layers' inputs with one


def _lstm_forward_prologue(st: dict) -> None:
    st["hd"][:, 0] = st["h"] * st["rmask"] if st["rmask"] is not None else st["h"]


def _lstm_forward_steps(kernels, mm, st: dict, consts, js) -> None:
    """Steps clock[0] + j, j in ``js``, of the forward time loop, on the tensors of ``st`` only (so
    that they can be captured and replayed)."""
    proj, hd, lengths, clock = st["w_hr_t"] is not None, st["hd"], st["lengths"], st["clock"]
    product = _product(mm, st["w_t"])
    project = _product(mm, st["w_hr_t"]) if proj else None
    for j in js:
        at = (clock, j)
        product(hd, at, st["r"])
        kernels.step_forward(at, lengths, st["xp"], st["bias"], st["gx"], st["r"], None if proj else st["h"], st["c"],
                             None if proj else st["rmask"], st["gh"], st["gc"], st["bc"], st["peep"], st["zc"],
                             None if proj else st["zh"], None if proj else st["y"], None if proj else hd, st, consts,
                             st["numbers"])
        if proj:
            project(st["y1"], at, st["hp"])
            kernels.project(at, lengths, st["hp"], st["h"], st["rmask"], st["zh"], st["keep"], st["y"], hd,
                            st["numbers"])


def _lstm_backward_prologue(st: dict) -> None:
    st["g"].zero_()  # the recurrent part of the gradient before the loop's first step
    if st["dhk"] is not None:
        st["dhk"].zero_()


def _lstm_backward_steps(kernels, mm, st: dict, consts, js) -> None:
    """Steps clock[0] + j, j in ``js`` (clock[0] counting down), of the backward time loop on the
    tensors of ``st`` only; leaves dh, dc as the gradients of h_0, c_0 but for the recurrent part
    of the first step, g (added after the loop)."""
    proj, lengths, dh, rmask, clock = st["w_hr"] is not None, st["lengths"], st["dh"], st["rmask"], st["clock"]
    product = _product(mm, st["w_hh"])
    back_project = _product(mm, st["w_hr"]) if proj else None
    for j in js:
        at = (clock, j)
        if proj:  # back through the projection first; the kernel's own h gradient stays 0
            kernels.project_backward(at, lengths, st["dy"], dh, st["g"], rmask, st["zh"], st["keep"], st["dhp"],
                                     st["numbers"])
            back_project(st["dhp"], at, st["dy1"])
            kernels.step_backward(at, lengths, st["dy1"], st["dhk"], st["dc"], st["g"], None, st["c0"], st["xp"],
                                  st["gx"], st["gh"], st["gc"], st["bc"], st["peep"], st["zc"], None, st, st, consts,
                                  st["numbers"])
        else:
            kernels.step_backward(at, lengths, st["dy"], dh, st["dc"], st["g"], rmask, st["c0"], st["xp"], st["gx"],
                                  st["gh"], st["gc"], st["bc"], st["peep"], st["zc"], st["zh"], st, st, consts,
                                  st["numbers"])
        product(st["dr"], at, st["g"])


class GRULayer(torch.autograd.Function):
    """One GRU layer, all directions, padded layout with lengths as data.

    Inputs: x (T, B, F); w_ih (D, G, F); gx (D, G) | None; b_ih (D, G) | None; h0 (D, B, H); w_hh
    (D, G, H); b_hh (D, G) | None; gh (D, G) | None; rmask (D, B, H) | None; zh (D, T, B, H) |
    None; lengths (B,) | None; consts (z_h,). Returns y (T, B, D*H), h_n (D, B, H). Loops as
    :class:`LSTMLayer`'s.
    """

    @staticmethod
    def forward(ctx, x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, lengths, consts):
        from .._triton import gru as kernels

        ctx.dtypes = [t.dtype if t is not None else None for t in (x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh)]
        originals = (x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, lengths)  # see backward
        mm = _precision.Products.of(x)
        with torch.autocast(x.device.type, enabled=False):
            acc = mm.acc
            steps, batch = x.shape[-3:-1]
            dirs, gsize, _ = w_ih.shape
            hidden = gsize // 3
            ln = gx is not None
            gx, b_ih, b_hh, gh, rmask, zh = (as_dtype(t, acc) for t in (gx, b_ih, b_hh, gh, rmask, zh))
            xp = _project_input(mm, x, w_ih, None if ln else b_ih)
            step = (dirs, TIME, batch)
            ins = dict(xp=xp, b_ih=b_ih, gx=gx, h=h0.to(acc, copy=True),
                       w_t=mm.operand(w_hh.transpose(1, 2)).contiguous(), b_hh=b_hh, gh=gh, rmask=rmask, zh=zh, lengths=_lengths(lengths, steps, batch, x),
                       numbers=_numbers(kernels, consts[0], xp))
            outs = dict(gates=(*step, gsize), hbn=(*step, hidden), hist=(*step, hidden), hd=(*step, hidden),
                        xstat=(*step, 2) if ln else None, rhat=(*step, gsize) if ln else None,
                        rrstd=step if ln else None, y=(TIME, batch, dirs, hidden), r=(dirs, batch, gsize))
            loop = _graphs.open(ctx, ("GRU", mm.low, _tf32()), steps, ins, outs, _TIMED)
            loop.run("forward", loop.st, _gru_forward_prologue, lambda st, js: _gru_forward_steps(kernels, mm, st, js))
            st = loop.st
        ctx.save_for_backward(*originals, x, w_ih, w_hh)
        ctx.loop, ctx.mm, ctx.has_bias, ctx.consts = loop, mm, (b_ih is not None, b_hh is not None), consts
        return (_result(loop, st["y"][:steps].view(steps, batch, dirs * hidden), mm.low),
                _result(loop, st["h"], mm.low))

    @staticmethod
    def backward(ctx, dy, dh_n):
        from .._triton import gru as kernels

        if _twice.recording():  # create_graph: a differentiable recomputation instead of the kernels
            return _recorded_backward("GRU", ctx, (dy, dh_n))
        x, w_ih, w_hh = ctx.saved_tensors[11:]
        loop, mm, need = ctx.loop, ctx.mm, ctx.needs_input_grad
        fwd = loop.st
        steps = loop.steps
        dirs, gsize, _ = w_ih.shape
        batch, hidden = fwd["h"].size(1), gsize // 3
        ln = fwd["gx"] is not None
        like = fwd["numbers"]
        acc = like.dtype
        with torch.autocast(like.device.type, enabled=False):
            dy = (dy.to(acc).contiguous() if dy is not None else like.new_zeros(steps, batch, dirs * hidden)
                  ).view(steps, batch, dirs, hidden)
            dh = dh_n.to(acc, copy=True).contiguous() if dh_n is not None else like.new_zeros(dirs, batch, hidden)
            step = (dirs, TIME, batch, gsize)
            w = mm.operand(w_hh)
            outs = dict(dpre=(TIME, batch, dirs, gsize), dr=step,
                        dhb=step if ln and ctx.has_bias[1] and need[6] else None,
                        pgx=step if ln and need[2] else None,
                        pb=step if ln and ctx.has_bias[0] and need[3] else None,
                        pgh=step if ln and need[7] else None, g=(_slices(w), dirs, batch, hidden))
            st = loop.add(dict(dy=dy, dh=dh, w_hh=w), outs, {"dy": 0})
            loop.run("backward", st, _gru_backward_prologue, lambda st, js: _gru_backward_steps(kernels, mm, st, js),
                     reverse=True)
            g = st["g"].sum(0)
            dh = st["dh"] + (g * st["rmask"] if st["rmask"] is not None else g)
            cut = loop.cut(st)
            d_x, d_w_ih = _input_grads(mm, cut["dpre"], x, w_ih, need[0], need[1])
            d_b_ih = (_rows_sum(cut["pb"]) if ln else cut["dpre"].sum((0, 1))) if ctx.has_bias[0] and need[3] \
                else None
            d_w_hh = _outer(mm, cut["dr"], cut["hd"]) if need[5] else None
            d_b_hh = (_rows_sum(cut["dhb"]) if ln else _rows_sum(cut["dr"])) if ctx.has_bias[1] and need[6] \
                else None
            out = (d_x, d_w_ih, _rows_sum(cut["pgx"]), d_b_ih, dh if need[4] else None, d_w_hh, d_b_hh,
                   _rows_sum(cut["pgh"]))
        _graphs.backward_done(ctx)
        return (*in_dtypes(out, ctx.dtypes), None, None, None, None)


def _gru_forward_prologue(st: dict) -> None:
    st["hd"][:, 0] = st["h"] * st["rmask"] if st["rmask"] is not None else st["h"]


def _gru_forward_steps(kernels, mm, st: dict, js) -> None:
    hd, clock = st["hd"], st["clock"]
    product = _product(mm, st["w_t"])
    for j in js:
        at = (clock, j)
        product(hd, at, st["r"])
        kernels.step_forward(at, st["lengths"], st["xp"], st["b_ih"], st["gx"], st["r"], st["h"], st["rmask"],
                             st["b_hh"], st["gh"], st["zh"], st["y"], hd, st, st["numbers"])


def _gru_backward_prologue(st: dict) -> None:
    st["g"].zero_()


def _gru_backward_steps(kernels, mm, st: dict, js) -> None:
    clock = st["clock"]
    product = _product(mm, st["w_hh"])
    for j in js:
        at = (clock, j)
        kernels.step_backward(at, st["lengths"], st["dy"], st["dh"], st["g"], st["rmask"], st["xp"], st["gx"],
                              st["gh"], st["zh"], st, st, st["numbers"])
        product(st["dr"], at, st["g"])


def _recorded_backward(cell: str, ctx, grads: tuple) -> tuple[Tensor | None, ...]:
    """The backward of a layer while it is being recorded (create_graph): the vector-Jacobian product
    of :func:`~._engine_reference.layer_reference` (padded layout, lengths as data) on the saved
    inputs (:mod:`fastlayers._twice`)."""
    count = 15 if cell == "LSTM" else 10
    inputs, lengths = ctx.saved_tensors[:count], ctx.saved_tensors[count]
    if inputs[0].dim() == 4:
        raise RuntimeError(f"fastlayers: a {cell} layer run with per-direction inputs (checkpoint_every's segments) "
                           "cannot differentiate twice; the layer's second derivatives recompute it whole instead")

    def layout(x, params, states, options, masks):
        return layer_reference(cell, x, params, states, lengths, options, masks)

    return (*recorded_layer_backward(cell, ctx, grads, inputs, layout), None, None)
