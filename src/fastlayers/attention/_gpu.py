"""Attention pooling's Triton kernels (``fastlayers._triton.attention``) bound for autograd:
:class:`AttentionTriton`, dot and scaled-dot scores, CUDA tensors or CPU tensors under Triton's
interpreter. Low precision as the twin: operands rounded to the low dtype, float32 scores, softmax
and sums, results in the low dtype; the double backward differentiates
:func:`~fastlayers.attention._reference.attention_pool_reference`.

Legend: B batch, T time, D features.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import precision, twice
from ._reference import attention_pool_reference


class AttentionTriton(torch.autograd.Function):
    """Dot / scaled-dot attention pooling through the Triton kernels (``fastlayers._triton.attention``):
    CUDA tensors, or CPU tensors under Triton's interpreter. Low precision as the torch path:
    operands rounded to the low dtype, float32 scores, softmax and sums, results in the low dtype."""

    @staticmethod
    def forward(ctx, query, keys, values, lengths, scaled: bool):
        from .._triton import attention as kernels

        low = precision.dtypes(query)[0]  # operands rounded to it, float32 sums, results in it
        q, k, v = (t.to(low).contiguous() for t in (query, keys, values))
        context, weights = kernels.forward(q, k, v, lengths, scaled, low)
        ctx.save_for_backward(q, k, v, weights, query, keys, values, lengths)  # the weights in float32 (float64)
        ctx.scaled, ctx.dtypes, ctx.low = scaled, (query.dtype, keys.dtype, values.dtype), low
        out = weights.to(low)
        if not any(ctx.needs_input_grad[:2]):  # the weights depend on query and keys only (as the twin's)
            ctx.mark_non_differentiable(out)
        return context, out

    @staticmethod
    def backward(ctx, d_context, d_weights):
        from .._triton import attention as kernels

        if twice.recording(d_context, d_weights):  # create_graph: the torch ops' gradient, differentiable again
            return AttentionTriton._recorded(ctx, d_context, d_weights)
        q, k, v, weights = ctx.saved_tensors[:4]
        lengths = ctx.saved_tensors[7]
        need = ctx.needs_input_grad
        d_context = d_context.contiguous() if d_context is not None else q.new_zeros(q.size(0), v.size(2))
        dq, dk, dv = kernels.backward(q, k, v, weights, d_context,
                                      d_weights.contiguous() if d_weights is not None else None, ctx.scaled, need[2],
                                      lengths)
        grads = (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None)
        return (*(g if g is None else g.to(d) for g, d in zip(grads, ctx.dtypes)), None, None)

    @staticmethod
    def _recorded(ctx, d_context, d_weights):
        query, keys, values, lengths = ctx.saved_tensors[4:]
        low = ctx.low

        def reference(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            with torch.autocast(q.device.type, dtype=low, enabled=low in precision.LOW and q.dtype != low):
                return attention_pool_reference(q, k, v, lengths, score="scaled_dot" if ctx.scaled else "dot")

        grads = twice.recorded_vjp(reference, (query, keys, values), (d_context, d_weights), ctx.needs_input_grad[:3])
        return (*grads, None, None)
