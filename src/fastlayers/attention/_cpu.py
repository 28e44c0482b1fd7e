"""Attention pooling's CPU binding: float32 / float64 calls on torch's own products with backwards
of their own, :class:`AttentionCPU` (dot and scaled-dot scores) and :class:`AdditiveCPU` (the
additive score); :func:`pool` picks one, or runs the forward alone when nothing needs a gradient.

Legend: B batch, T time, D key features, Dq query features, Dv value features, A attention size.

The dot forward is the twin's (:func:`~fastlayers.attention._reference.dot_pool`). Autograd's
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

The additive score e = v . tanh(W_k k_t + W_q q + b) (Bahdanau et al. 2015) keeps H = tanh(...)
(B, T, A) from its forward, as autograd does, and computes its float32 tanh as 2 sigmoid(2x) - 1
(the C kernels' ``fl_tanh_f32`` formula: torch.tanh took 1.3 ms on a (128, 256, 32) float32
tensor on these cores, this 0.35 ms, within 2e-7 of it); its backward, with dH = dS v (1 - H^2):
dv = H^T dS, dK = dH W_k, dW_k = dH^T K, and through the query's projection p = sum_t dH:
dq = p W_q, dW_q = p^T q, db = sum_b p.

A recorded backward (``create_graph``) differentiates the twin instead (:mod:`fastlayers._core.twice`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import twice
from ._reference import attention_pool_reference, dot_pool, softmax_pool

Additive = tuple[Tensor, Tensor, Tensor, Tensor | None]


def pool(query: Tensor, keys: Tensor, values: Tensor, pad: Tensor | None, lengths: Tensor | None, scale: float,
         additive: Additive | None) -> tuple[Tensor, Tensor]:
    """(context (B, Dv), weights (B, T)) for inputs that :func:`serves` (lengths validated, ``pad``
    (B, T) bool from them or None; ``additive`` the checked parameters for the additive score, else
    None and ``scale`` 1 (dot) or 1/sqrt(D)): an autograd Function where a gradient is wanted."""
    tensors = (query, keys, values) + (tuple(p for p in additive if p is not None) if additive else ())
    record = twice.graph_recorded() and any(t.requires_grad for t in tensors)
    if additive is None:
        return AttentionCPU.apply(query, keys, values, pad, lengths, scale) if record else \
            dot_pool(query, keys, values, pad, scale)
    if record:
        return AdditiveCPU.apply(query, keys, values, *additive, pad, lengths)
    return additive_pool(query, keys, values, *additive, pad)[:2]


def serves(query: Tensor, keys: Tensor, values: Tensor, additive: Additive | None) -> bool:
    """Plain CPU tensors in one dtype, float32 / float64, outside autocast (the additive parameters
    too); not while torch.compile, torch.export or torch.jit.trace records (they record the twin's
    ops) nor under a torch.func transform (an autograd.Function needs ``setup_context`` there, which
    costs every call an ``inspect.signature``, 40-50 us)."""
    if not (query.dtype in (torch.float32, torch.float64) and query.device.type == "cpu" and type(keys) is Tensor
            and type(values) is Tensor and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not torch._C._are_functorch_transforms_active()):
        return False
    return additive is None or all(p is None or (isinstance(p, Tensor) and p.dtype == query.dtype
                                                 and p.device == query.device) for p in additive)


def _tanh_(h: Tensor) -> Tensor:
    """tanh in place: float32 as 2 sigmoid(2h) - 1 (see the module docstring), float64 torch's."""
    if h.dtype == torch.float32:
        return h.mul_(2.0).sigmoid_().mul_(2.0).sub_(1.0)
    return h.tanh_()


def additive_pool(query: Tensor, keys: Tensor, values: Tensor, w_q: Tensor, w_k: Tensor, v: Tensor,
                  bias: Tensor | None, pad: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(context (B, Dv), weights (B, T), H (B, T, A)) of the additive score: H = tanh(K W_k^T + q
    W_q^T + b) in one batched product over the broadcast query projection."""
    batch, steps = keys.shape[:2]
    projected = torch.addmm(bias, query, w_q.T) if bias is not None else query @ w_q.T  # (B, A)
    hidden = _tanh_(torch.baddbmm(projected.unsqueeze(1), keys, w_k.T.expand(batch, -1, -1)))  # (B, T, A)
    scores = (hidden.view(batch * steps, v.size(0)) @ v).view(batch, steps)
    return (*softmax_pool(scores, values, pad), hidden)


def _score_grad(weights: Tensor, values: Tensor, d_context: Tensor | None, d_weights: Tensor | None,
                pad: Tensor | None) -> Tensor | None:
    """dS (B, T), the gradient of the scores (softmax's backward; exactly 0 at the padded steps, as
    the twin's masked_fill), or None when neither output has a gradient."""
    g = d_weights
    if d_context is not None:
        g = torch.bmm(d_context.unsqueeze(1), values.transpose(1, 2)).squeeze(1)
        g = g if d_weights is None else g.add_(d_weights)
    if g is None:
        return None
    if pad is not None:  # (a padded step's dC . v_t, inf for a finite 1e38 there, would reach the sum as 0 * inf)
        g = g.masked_fill(pad, 0.0)
    ds = weights * (g - (weights * g).sum(1, keepdim=True))
    return ds.masked_fill_(pad, 0.0) if pad is not None else ds


def _values_grad(weights: Tensor, d_context: Tensor | None) -> Tensor | None:
    """dV (B, T, Dv) = w^T dC as a broadcast (None without a context gradient)."""
    return weights.unsqueeze(2) * d_context.unsqueeze(1) if d_context is not None else None


class AttentionCPU(torch.autograd.Function):
    """(context (B, Dv), weights (B, T)) of query (B, D), keys (B, T, D), values (B, T, Dv), one
    floating dtype; ``pad`` (B, T) bool marks the padded steps (None: none), ``lengths`` the
    validated (B,) lengths behind it (for a recorded backward); ``scale`` 1 (dot) or 1/sqrt(D)."""

    @staticmethod
    def forward(ctx, query: Tensor, keys: Tensor, values: Tensor, pad: Tensor | None, lengths: Tensor | None,
                scale: float) -> tuple[Tensor, Tensor]:
        context, weights = dot_pool(query, keys, values, pad, scale)
        if not any(ctx.needs_input_grad[:2]):  # the weights depend on query and keys only (as the twin's)
            ctx.mark_non_differentiable(weights)
        ctx.save_for_backward(query, keys, values, weights)
        ctx.pad, ctx.lengths, ctx.scale = pad, lengths, scale
        ctx.set_materialize_grads(False)
        return context, weights

    @staticmethod
    def backward(ctx, d_context: Tensor | None, d_weights: Tensor | None):
        query, keys, values, weights = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        if twice.recording(d_context, d_weights):  # create_graph: the twin's gradient, differentiable again
            def reference(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
                return attention_pool_reference(q, k, v, ctx.lengths, score="dot" if ctx.scale == 1.0 else "scaled_dot")

            grads = twice.recorded_vjp(reference, (query, keys, values), (d_context, d_weights), (need_q, need_k, need_v))
            return (*grads, None, None, None)
        dq = dk = None
        ds = _score_grad(weights, values, d_context, d_weights, ctx.pad) if need_q or need_k else None
        if ds is not None:
            if ctx.scale != 1.0:
                ds = ds.mul_(ctx.scale)
            dq = torch.bmm(ds.unsqueeze(1), keys).squeeze(1) if need_q else None
            dk = ds.unsqueeze(2) * query.unsqueeze(1) if need_k else None
        return dq, dk, _values_grad(weights, d_context) if need_v else None, None, None, None


class AdditiveCPU(torch.autograd.Function):
    """(context (B, Dv), weights (B, T)) of the additive score: query (B, Dq), keys (B, T, D), values
    (B, T, Dv), weight_query (A, Dq), weight_key (A, D), v (A,), bias (A,) or None, one floating
    dtype; ``pad`` and ``lengths`` as :class:`AttentionCPU`."""

    @staticmethod
    def forward(ctx, query: Tensor, keys: Tensor, values: Tensor, w_q: Tensor, w_k: Tensor, v: Tensor,
                bias: Tensor | None, pad: Tensor | None, lengths: Tensor | None) -> tuple[Tensor, Tensor]:
        context, weights, hidden = additive_pool(query, keys, values, w_q, w_k, v, bias, pad)
        if not any(ctx.needs_input_grad[:2] + ctx.needs_input_grad[3:7]):  # (all but the values: as the twin's)
            ctx.mark_non_differentiable(weights)
        ctx.save_for_backward(query, keys, values, w_q, w_k, v, bias, weights, hidden)
        ctx.pad, ctx.lengths = pad, lengths
        ctx.set_materialize_grads(False)
        return context, weights

    @staticmethod
    def backward(ctx, d_context: Tensor | None, d_weights: Tensor | None):
        query, keys, values, w_q, w_k, v, bias, weights, hidden = ctx.saved_tensors
        need = ctx.needs_input_grad[:7]  # query, keys, values, weight_query, weight_key, v, bias
        if twice.recording(d_context, d_weights):  # create_graph: the twin's gradient, differentiable again
            def reference(q, k, vals, wq, wk, vv, b):
                return attention_pool_reference(q, k, vals, ctx.lengths, score="additive", additive=(wq, wk, vv, b))

            grads = twice.recorded_vjp(reference, (query, keys, values, w_q, w_k, v, bias), (d_context, d_weights),
                                       need)
            return (*grads, None, None)
        grads: list[Tensor | None] = [None] * 7
        grads[2] = _values_grad(weights, d_context) if need[2] else None
        ds = _score_grad(weights, values, d_context, d_weights, ctx.pad) if any(need[:2] + need[3:]) else None
        if ds is None:
            return (*grads, None, None)
        batch, steps, size = hidden.shape
        rows = hidden.view(batch * steps, size)  # (B*T, A)
        if need[5]:
            grads[5] = rows.T @ ds.reshape(-1)
        if need[0] or need[1] or need[3] or need[4] or need[6]:
            dh = hidden.square().neg_().add_(1.0).mul_(v).mul_(ds.unsqueeze(2))  # (B, T, A): dS v (1 - H^2)
            dh_rows = dh.view(batch * steps, size)
            if need[1]:
                grads[1] = (dh_rows @ w_k).view(batch, steps, keys.size(2))
            if need[4]:
                grads[4] = dh_rows.T @ keys.reshape(batch * steps, keys.size(2))
            if need[0] or need[3] or need[6]:
                projected = dh.sum(1)  # (B, A): the gradient of the query's projection
                grads[0] = projected @ w_q if need[0] else None
                grads[3] = projected.T @ query if need[3] else None
                grads[6] = projected.sum(0) if need[6] else None
        return (*grads, None, None)
