"""The engine's moves between the padded layout and its packed rows, as autograd Functions whose
per-call tensors come from the CPU block cache (:func:`fastlayers._core.pool.empty`).

Legend: R rows of the padded (T*B, X) layout, K rows picked (D*N: every direction's packed rows).
``index_select`` / ``index_copy`` would do the same, but their outputs and gradients are fresh
torch allocations, a first touch of every page on every call (at the seed shape about 250 MB of the
420 MB per call, benchmarks/rnn/probe_page_faults.py); these take the cache's blocks. Under
``create_graph``, or with gradients batched by autograd's vmap (``is_grads_batched``), the backwards
run differentiable torch ops without ``out=`` (a second derivative goes through them as through
index ops; ``out=`` variants have no batching rule).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import pool, twice


class GatherRows(torch.autograd.Function):
    """out (K, X) = x[index] for x (R, X) and index (K,) int64. Backward: dx (R, X) = the sum of the
    rows of the gradient picked for each row of x (index_add); ``covers``: the first R entries of
    ``index`` are a permutation of the R rows (as for every plan's first direction without lengths),
    so dx needs no zero fill (those rows are copied, the rest added)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, covers: bool) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows, ctx.covers = x.size(0), covers
        return torch.index_select(x, 0, index, out=pool.empty((index.numel(), x.size(1)), x.dtype, x))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        if twice.recording(grad):  # create_graph or a batched gradient: differentiable torch ops
            return grad.new_zeros(ctx.rows, grad.size(1)).index_add(0, index, grad), None, None
        r = ctx.rows
        dx = pool.empty((r, grad.size(1)), grad.dtype, grad)
        if ctx.covers:
            dx.index_copy_(0, index[:r], grad[:r])
            return dx.index_add_(0, index[r:], grad[r:]), None, None
        return dx.zero_().index_add_(0, index, grad), None, None


class ScatterRows(torch.autograd.Function):
    """out (R, X): row index[k] = y[k] for y (K, X), index (K,) int64 of distinct rows; the other
    rows zero, unless ``full`` (index covers every row: no zero fill). Backward: grad[index]."""

    @staticmethod
    def forward(ctx, y: Tensor, index: Tensor, rows: int, full: bool) -> Tensor:
        ctx.save_for_backward(index)
        out = pool.empty((rows, y.size(1)), y.dtype, y)
        if not full:
            out.zero_()
        return out.index_copy_(0, index, y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        if twice.recording(grad):
            return grad.index_select(0, index), None, None, None
        out = pool.empty((index.numel(), grad.size(1)), grad.dtype, grad)
        return torch.index_select(grad, 0, index, out=out), None, None, None


def gather(x: Tensor, index: Tensor, covers: bool) -> Tensor:
    """x[index] (:class:`GatherRows`; plain ``index_select`` while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return x.index_select(0, index)
    return GatherRows.apply(x, index, covers)


def scatter(y: Tensor, index: Tensor, rows: int, full: bool) -> Tensor:
    """(rows, X) holding y's rows at ``index``, zeros elsewhere (:class:`ScatterRows`; plain
    ``index_copy`` while torch.compile traces)."""
    if torch.compiler.is_compiling():
        return (y.new_empty if full else y.new_zeros)(rows, y.size(1)).index_copy(0, index, y)
    return ScatterRows.apply(y, index, rows, full)
