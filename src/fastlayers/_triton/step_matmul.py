"""The recurrent product of one time step in Triton: out[j, d] = a[d] @ b[d] over the j-th slice of K.

Legend: D directions, M rows (the batch), K the product's inner size, N columns, S slices of K.
a (D, M, K) and b (D, K, N) with unit stride along their last dimension (a is a step of a
(D, T, B, K) buffer: any other strides); out (S, D, M, N) contiguous, or (D, M, N) when S = 1.
The S partial products are summed by the step kernel that reads them (:func:`._cell.carried`), in
a fixed order: no atomics, results do not depend on scheduling.

Why not cuBLAS (H100, torch 2.11, fp32, 800 steps in one CUDA graph, D=2, M=32, 2026-11-24,
``benchmarks/bench_gpu_step_matmul.py``): the backward's product (K = 4H = 1024, N = H = 256) took
29.8 us per step under torch.bmm (its 16 output tiles each walk K = 1024), 23.2 us here in one
slice and 4.1 us in 8; the forward's (K = 256, N = 1024) 8.9 us under torch.bmm, 6.8 us here with
b contiguous. The seed's LayerNorm-LSTM fwd+bwd (CUDA graphs) took 34.7 / 23.4 / 21.9 / 21.5 ms
with 1024 / 256 / 128 / 64 elements of K per slice (GRU 28.8 / 21.1 / 19.6 / 19.7): 64 and 128
within 2%, 128 kept (half the partial sums for the step kernels to add).

Precision: float32 operands multiply in IEEE float32 (TF32 where
``torch.backends.cuda.matmul.allow_tf32`` allows it, as torch.bmm); bfloat16 / float16 ``b``
takes ``a`` rounded to its dtype; sums in float32, written in ``out``'s dtype.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 64
# inner size per slice (the backward's product: 8 slices at the seed's LSTM, 6 at its GRU)
K_PER_SLICE = 128


@triton.jit
def _kernel(a, b, c, M, N, K, k_slice, s_ad, s_am, s_bd, s_bk, s_cs, s_cd, s_cm,
            SLICES: tl.constexpr, PRECISION: tl.constexpr, ROUND_A: tl.constexpr, WIDEN: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    d = (tl.program_id(2) // SLICES).to(tl.int64)
    j = tl.program_id(2) % SLICES
    rk = tl.arange(0, BK)
    start = j * k_slice
    end = tl.minimum(start + k_slice, K)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(start, end, BK):
        ks = k + rk
        at = tl.load(a + d * s_ad + rm[:, None] * s_am + ks[None, :], mask=(rm[:, None] < M) & (ks[None, :] < end),
                     other=0.0)
        bt = tl.load(b + d * s_bd + ks[:, None] * s_bk + rn[None, :], mask=(ks[:, None] < end) & (rn[None, :] < N),
                     other=0.0)
        if ROUND_A:
            at = at.to(bt.dtype)
        if WIDEN:  # low-precision operands multiplied in float32: exact products, the same sums
            at, bt = at.to(tl.float32), bt.to(tl.float32)
        acc += tl.dot(at, bt, input_precision=PRECISION)
    tl.store(c + j * s_cs + d * s_cd + rm[:, None] * s_cm + rn[None, :], acc.to(c.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # as Triton decided when _kernel was made


def supported(b: Tensor, mixed: bool) -> bool:
    """Whether :func:`matmul` takes this prepared ``b``: float32 without mixed precision, or a
    bfloat16 / float16 ``b`` (mixed precision with a hardware low-precision product)."""
    if b.dtype == torch.float32:
        return not mixed
    return b.dtype in (torch.bfloat16, torch.float16)


def slices(k: int) -> int:
    """How many slices of K a product of inner size ``k`` is split into (S)."""
    return triton.cdiv(k, K_PER_SLICE)


def matmul(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """out (S, D, M, N) [or (D, M, N)] = the S partial products of a (D, M, K) @ b (D, K, N)."""
    dirs, rows, inner = a.shape
    cols = b.size(2)
    parts = out if out.dim() == 4 else out.unsqueeze(0)
    count = parts.size(0)
    assert a.stride(2) == 1 and b.stride(2) == 1 and parts.is_contiguous() and parts.shape[1:] == (dirs, rows, cols)
    k_slice = triton.cdiv(triton.cdiv(inner, count), BLOCK_K) * BLOCK_K
    # Triton 3.6's interpreter multiplies bfloat16 tiles wrongly (1e11 off at K=128): under it
    # low-precision operands are widened to float32 first
    widen = b.dtype != torch.float32 and _INTERPRETED
    if b.dtype == torch.float32 or widen:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    else:
        precision = None
    grid = (triton.cdiv(cols, BLOCK_N), triton.cdiv(rows, BLOCK_M), dirs * count)
    _kernel[grid](a, b, parts, rows, cols, inner, k_slice, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                  parts.stride(0), parts.stride(1), parts.stride(2), SLICES=count, PRECISION=precision,
                  ROUND_A=a.dtype != b.dtype, WIDEN=widen, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=4, num_stages=2)
    return out
