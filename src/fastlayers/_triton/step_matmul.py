"""The recurrent product of one time step in Triton: out[j, d] = a[d] @ b[d] over the j-th slice of K.

Legend: D directions, M rows (the batch), K the product's inner size, N columns, S slices of K,
TC the time capacity of a step-layout buffer.
a: one step of a (D, TC, M, K) buffer, chosen by device data: the step s = clock[0] + j
(``at=(clock, j)``, as the step kernels read it, :mod:`._cell`), and nothing is written when s is
outside [0, clock[1]) (so a captured chunk of steps replays for any step offset and loop length);
b (D, K, N); both with unit stride along their last dimension (any other strides); out
(S, D, M, N) contiguous, or (D, M, N) when S = 1. The S partial products are summed by the step
kernel that reads them (:func:`._cell.carried`), in a fixed order: no atomics, results do not
depend on scheduling.

Why not cuBLAS (H100, torch 2.11, fp32, 800 steps in one CUDA graph, D=2, M=32, 2026-11-24,
``benchmarks/rnn/bench_gpu_step_matmul.py``): the backward's product (K = 4H = 1024, N = H = 256) took
29.8 us per step under torch.bmm (its 16 output tiles each walk K = 1024), 23.2 us here in one
slice and 4.1 us in 8; the forward's (K = 256, N = 1024) 8.9 us under torch.bmm, 6.8 us here with
b contiguous. The seed's LayerNorm-LSTM fwd+bwd (CUDA graphs) took 34.7 / 23.4 / 21.9 / 21.5 ms
with 1024 / 256 / 128 / 64 elements of K per slice (GRU 28.8 / 21.1 / 19.6 / 19.7): 64 and 128
within 2%, 128 kept (half the partial sums for the step kernels to add). And a cuBLAS call cannot
take its operand's address from device data.

Precision: float32 operands multiply in IEEE float32 (TF32 where
``torch.backends.cuda.matmul.allow_tf32`` allows it, as torch.bmm); float64 in float64;
bfloat16 / float16 ``b`` takes ``a`` rounded to its dtype; a float32 ``b`` of a mixed-precision
call (``low`` given: the low dtype's values held in float32, on a CPU without that GEMM) takes
``a`` rounded to ``low``; sums in float32 (float64 for float64), written in ``out``'s dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from . import cdiv, interpreting
from ._launch import launch

BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 64
# inner size per slice (the backward's product: 8 slices at the seed's LSTM, 6 at its GRU)
K_PER_SLICE = 128


@triton.jit(do_not_specialize=["j"])
def _kernel(a, b, c, clock, j, lengths, starts, M, N, K, k_slice, s_ad, s_at, s_am, s_bd, s_bk, s_cs, s_cd, s_cm,
            SLICES: tl.constexpr, PRECISION: tl.constexpr, A_DTYPE: tl.constexpr, WIDEN: tl.constexpr,
            VARLEN: tl.constexpr, F64: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    s = tl.load(clock).to(tl.int64) + j
    steps = tl.load(clock + 1)
    if (s < 0) | (s >= steps):
        return
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    d = (tl.program_id(2) // SLICES).to(tl.int64)
    js = tl.program_id(2) % SLICES
    rows = rm < M
    if VARLEN:  # row m of a at step s: the value row starts[m] + t of its time t, where t < len_m
        t = tl.where(d == 0, s, steps - 1 - s)
        rows = rows & (t < tl.load(lengths + rm, mask=rm < M, other=0))
        am = tl.load(starts + rm, mask=rows, other=0) + t
    else:
        a += s * s_at
        am = rm
    rk = tl.arange(0, BK)
    start = js * k_slice
    end = tl.minimum(start + k_slice, K)
    acc = tl.zeros([BM, BN], dtype=tl.float64 if F64 else tl.float32)
    for k in range(start, end, BK):
        ks = k + rk
        at = tl.load(a + d * s_ad + am[:, None] * s_am + ks[None, :], mask=rows[:, None] & (ks[None, :] < end),
                     other=0.0)
        bt = tl.load(b + d * s_bd + ks[:, None] * s_bk + rn[None, :], mask=(ks[:, None] < end) & (rn[None, :] < N),
                     other=0.0)
        if A_DTYPE is not None:
            at = at.to(A_DTYPE)
        if WIDEN:  # low-precision operands multiplied in float32: exact products, the same sums
            at, bt = at.to(tl.float32), bt.to(tl.float32)
        acc += tl.dot(at, bt, input_precision=PRECISION)
    tl.store(c + js * s_cs + d * s_cd + rm[:, None] * s_cm + rn[None, :], acc.to(c.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_INTERPRETED = interpreting()  # as Triton decided when _kernel was made


def slices(k: int) -> int:
    """How many slices of K a product of inner size ``k`` is split into (S)."""
    return cdiv(k, K_PER_SLICE)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def matmul(a: Tensor, b: Tensor, out: Tensor, at: tuple[Tensor, int], low: torch.dtype | None = None,
           rows: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """out (S, D, M, N) [or (D, M, N)] = the S partial products of a[:, s] @ b (D, K, N), a (D, TC,
    M, K), s = clock[0] + j for ``at = (clock, j)`` (out untouched when s is outside [0, clock[1])).
    ``low``: the low dtype of a mixed-precision call whose ``b`` is float32 (``a`` is rounded to
    it). ``rows = (lengths, starts)``, (M,) int64 each: the varlen layout (:mod:`._cell`), a (D, TC,
    K) with row m of step s at starts[m] + t (t = s forward, T - 1 - s reverse), zero where t >=
    lengths[m]. Raises AssertionError on layouts other than the above."""
    clock, j = at
    if rows is None:
        dirs, _, count_m, inner = a.shape
        lengths = starts = clock
        strides = a.stride(0), a.stride(1), a.stride(2)  # direction, step, row
    else:
        (dirs, _, inner), (lengths, starts) = a.shape, rows
        count_m = lengths.numel()
        strides = a.stride(0), 0, a.stride(1)
    cols = b.size(2)
    parts = out if out.dim() == 4 else out.unsqueeze(0)
    count = parts.size(0)
    # (a dimension of size 1 has no stride to speak of: torch calls a (D, K, 1) view with stride K
    # there contiguous, and so does the kernel, which reads index 0 of it only)
    assert (a.stride(-1) == 1 or inner == 1) and (b.stride(2) == 1 or cols == 1) and parts.is_contiguous() and \
        parts.shape[1:] == (dirs, count_m, cols)
    k_slice = cdiv(cdiv(inner, count), BLOCK_K) * BLOCK_K
    # Triton 3.6's interpreter multiplies bfloat16 tiles wrongly (1e11 off at K=128): under it
    # low-precision operands are widened to float32 first
    if b.dtype in _TL:
        a_dtype, widen = _TL[b.dtype], _INTERPRETED
    else:
        a_dtype, widen = (_TL[low], True) if low in _TL and b.dtype == torch.float32 else (None, False)
    if b.dtype == torch.float64:
        precision = "ieee"
    elif b.dtype == torch.float32 or widen:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        precision = None
    grid = (cdiv(cols, BLOCK_N), cdiv(count_m, BLOCK_M), dirs * count)
    launch(_kernel, grid, (
        a, b, parts, clock, j, lengths, starts, count_m, cols, inner, k_slice, *strides, b.stride(0),
        b.stride(1), parts.stride(0), parts.stride(1), parts.stride(2)),
        {"SLICES": count, "PRECISION": precision, "A_DTYPE": a_dtype if a.dtype != b.dtype or low is not None else None,
         "WIDEN": widen, "VARLEN": rows is not None, "F64": b.dtype == torch.float64, "BM": BLOCK_M, "BN": BLOCK_N,
         "BK": BLOCK_K},
        num_warps=4, num_stages=2)
    return out
