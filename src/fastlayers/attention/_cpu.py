"""Attention pooling's CPU binding: :class:`AttentionCPU`, dot and scaled-dot scores in float32 /
float64, a hand-written backward over torch's own products.

Legend: B batch, T time, D key features, Dv value features.

The forward is the twin's (:func:`~fastlayers.attention._reference.dot_pool`). Autograd's
backward of its two products takes each rank-1 gradient, dK = dS^T q and dV = w^T dC, as a
batched product with an inner size of 1, the slowest form torch.bmm has on CPU (torch.profiler at
the seed shape, B = 128, T = 256, D = 32, Dv = 100, AMD EPYC Zen 4: 1.1 ms for dK and 2.9 ms for
dV of a 3.2 ms / 6.4 ms fwd+bwd call without / with the values' gradient). Here they are
broadcast products, one pass over their output each, and the row products stay on torch.bmm:

    g  = dC @ V^T + dW                (B, T)   the gradient of the weights
    dS = w * (g - sum_t w g)          (B, T)   softmax's backward, zero at the padded steps
    dq = scale * dS @ K               (B, D)
    dK = scale * dS^T q               (B, T, D)
    dV = w^T dC                       (B, T, Dv)

A recorded backward (``create_graph``) differentiates the twin instead (:mod:`fastlayers._core.twice`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import twice
from ._reference import attention_pool_reference, dot_pool


class AttentionCPU(torch.autograd.Function):
    """(context (B, Dv), weights (B, T)) of query (B, D), keys (B, T, D), values (B, T, Dv), one
    floating dtype; ``pad`` (B, T) bool marks the padded steps (None: none), ``lengths`` the
    validated (B,) lengths behind it (for a recorded backward); ``scale`` 1 (dot) or 1/sqrt(D).
    Under torch.func transforms the caller runs the twin: a ``setup_context`` would cost every call
    an ``inspect.signature`` (40-50 us, a tenth of the seed shape's forward)."""

    @staticmethod
    def forward(ctx, query: Tensor, keys: Tensor, values: Tensor, pad: Tensor | None, lengths: Tensor | None,
                scale: float) -> tuple[Tensor, Tensor]:
        context, weights = dot_pool(query, keys, values, pad, scale)
        ctx.save_for_backward(query, keys, values, weights)
        ctx.pad, ctx.lengths, ctx.scale = pad, lengths, scale
        ctx.set_materialize_grads(False)
        return context, weights

    @staticmethod
    def backward(ctx, d_context: Tensor | None, d_weights: Tensor | None):
        query, keys, values, weights = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        if twice.recording():  # create_graph: the twin's gradient, differentiable again
            def reference(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
                return attention_pool_reference(q, k, v, ctx.lengths, score="dot" if ctx.scale == 1.0 else "scaled_dot")

            grads = twice.recorded_vjp(reference, (query, keys, values), (d_context, d_weights), (need_q, need_k, need_v))
            return (*grads, None, None, None)
        dq = dk = dv = None
        if need_q or need_k:
            g = d_weights
            if d_context is not None:
                g = torch.bmm(d_context.unsqueeze(1), values.transpose(1, 2)).squeeze(1)
                g = g if d_weights is None else g.add_(d_weights)
            if g is not None:
                ds = weights * (g - (weights * g).sum(1, keepdim=True))
                if ctx.pad is not None:  # as the twin's masked_fill: exactly 0 whatever g holds there
                    ds = ds.masked_fill_(ctx.pad, 0.0)
                if ctx.scale != 1.0:
                    ds = ds.mul_(ctx.scale)
                dq = torch.bmm(ds.unsqueeze(1), keys).squeeze(1) if need_q else None
                dk = ds.unsqueeze(2) * query.unsqueeze(1) if need_k else None
        if need_v and d_context is not None:
            dv = weights.unsqueeze(2) * d_context.unsqueeze(1)
        return dq, dk, dv, None, None, None
