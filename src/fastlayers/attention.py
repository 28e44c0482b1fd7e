"""Masked attention pooling over a padded batch: scores, softmax over valid steps, context vector.

Legend: B batch, T time (padded), Dq query features, Dk key features, Dv value features,
A attention size (additive score).

Scores (one per step):
  * ``"dot"``:         e_bt = <q_b, k_bt>                      (Luong et al. 2015, requires Dq == Dk)
  * ``"scaled_dot"``:  e_bt = <q_b, k_bt> / sqrt(Dk)           (Vaswani et al. 2017)
  * ``"additive"``:    e_bt = v . tanh(W_q q_b + W_k k_bt + b) (Bahdanau et al. 2015, eq. 6 and App. A.1.2)
Weights: alpha_b = softmax over t < len_b of e_bt; alpha_bt = 0 exactly for t >= len_b.
Context: c_b = sum_t alpha_bt v_bt.

Everything runs as batched matmuls on the 3-D tensors (no per-step or per-column slicing), so
autograd's backward costs a small multiple of the forward (seed 001's per-column-view cliff).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import _precision, _twice
from ._backend import select
from ._jit import TRITON, NotScriptable, refuse_trace
from ._checks import as_lengths, check_floating, check_rank, check_same_dtype_device, check_shape, check_tensor

SCORES = ("dot", "scaled_dot", "additive")


def _check(query: Tensor, keys: Tensor, values: Tensor) -> None:
    if (type(query) is Tensor and type(keys) is Tensor and type(values) is Tensor and query.dim() == 2
            and keys.dim() == 3 and values.dim() == 3 and query.is_floating_point()
            and query.dtype == keys.dtype == values.dtype and query.device == keys.device == values.device
            and keys.size(0) == query.size(0) and values.shape[:2] == keys.shape[:2] and keys.size(1) >= 1):
        return  # the common valid call, in a few operations; anything else gets the checks below
    for name, t in (("query", query), ("keys", keys), ("values", values)):
        check_tensor(name, t)
        check_floating(name, t)
    check_rank("query", query, (2,), "(B, Dq)")
    check_rank("keys", keys, (3,), "(B, T, Dk)")
    check_rank("values", values, (3,), "(B, T, Dv)")
    check_same_dtype_device("keys", keys, "query", query)
    check_same_dtype_device("values", values, "query", query)
    if keys.size(0) != query.size(0):
        raise ValueError(f"keys: expected batch size {query.size(0)} (that of query), got {keys.size(0)}")
    if values.shape[:2] != keys.shape[:2]:
        raise ValueError(f"values: expected (B, T) = {tuple(keys.shape[:2])} (that of keys), got {tuple(values.shape[:2])}")
    if keys.size(1) < 1:
        raise ValueError("keys: expected at least one time step, got T = 0")


def attention_pool(
    query: Tensor,
    keys: Tensor,
    values: Tensor | None = None,
    lengths: Tensor | list[int] | None = None,
    *,
    score: str = "dot",
    additive: tuple[Tensor, Tensor, Tensor, Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention pooling of ``values`` over time, weighted by the scores of ``query`` against ``keys``.

    Args:
        query: (B, Dq) float tensor.
        keys: (B, T, Dk), same dtype and device.
        values: (B, T, Dv); default ``keys``.
        lengths: optional (B,) integer tensor (any device) or list of ints, 1 <= len_b <= T:
            steps t >= len_b get weight exactly 0. Default: every step is valid.
        score: ``"dot"`` (Dq == Dk), ``"scaled_dot"`` (Dq == Dk) or ``"additive"``.
        additive: for ``score="additive"``: ``(weight_query (A, Dq), weight_key (A, Dk), v (A,),
            bias (A,) or None)``; :class:`AttentionPooling` owns these.

    Returns:
        ``(context, weights)``: context (B, Dv), weights (B, T) summing to 1 over valid steps.

    Raises:
        TypeError: non-tensor or integer inputs, float lengths, mismatched dtypes.
        ValueError: wrong ranks or sizes, unknown score, lengths out of [1, T] or of the wrong size,
            missing additive parameters.

    Low precision (bf16/fp16 inputs, or float32 under ``torch.autocast``): the score and context
    products take low-precision operands and sum in float32; tanh, masking and softmax run in
    float32; context and weights are returned in the low dtype (see :mod:`fastlayers._precision`).

    Non-finite input: a NaN or inf in ``query`` or in ``keys`` at a valid step makes that
    sequence's weights and context NaN; keys at padded steps (t >= len_b) are masked out and
    have no effect. Values at padded steps get an exact 0 weight, and 0 * NaN = NaN (as
    torch.bmm), so keep them finite (an LSTM with ``lengths`` writes zeros there). Large scores
    (keys of size 1e4) stay finite: the softmax subtracts each row's maximum.
    """
    values = keys if values is None else values
    _check(query, keys, values)
    which = select("attention", query)
    if score not in SCORES:
        raise ValueError(f"score: expected one of {SCORES}, got {score!r}")
    if which == "triton" and score != "additive":  # one fused kernel per pass (additive: the torch ops)
        _check_dot(query, keys, score)
        batch, steps = keys.shape[:2]
        scale = 1 / math.sqrt(keys.size(2)) if score == "scaled_dot" else 1.0
        lens = as_lengths(lengths, batch, steps).to(keys.device) if lengths is not None else None
        refuse_trace("fastlayers.attention_pool on the Triton backend", TRITON)
        return _AttentionTriton.apply(query, keys, values, lens, scale)
    return attention_pool_reference(query, keys, values, lengths, score=score, additive=additive)


def attention_pool_reference(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    lengths: Tensor | list[int] | None = None,
    *,
    score: str = "dot",
    additive: tuple[Tensor, Tensor, Tensor, Tensor | None] | None = None,
) -> tuple[Tensor, Tensor]:
    """The plain-PyTorch twin of :func:`attention_pool` (inputs checked by it; same arguments, with
    ``values`` given): batched matmuls and a softmax, any device and dtype. It is what the CPU and
    the reference backend run, and what the Triton kernels' double backward differentiates."""
    batch, steps = keys.shape[:2]
    if score != "additive" and query.dtype in _ONE_DTYPE and not torch.is_autocast_enabled(query.device.type):
        return _dot_one_dtype(query, keys, values, lengths, score == "scaled_dot")
    mm = _precision.Products.of(query)
    if score == "additive":
        if additive is None:
            raise ValueError("additive: expected (weight_query, weight_key, v, bias) for score='additive', got None")
        w_q, w_k, v, bias = additive
        size = v.size(0)
        check_shape("additive weight_query", w_q, (size, query.size(1)), "(A, Dq)")
        check_shape("additive weight_key", w_k, (size, keys.size(2)), "(A, Dk)")
        hidden = mm.matmul(keys, w_k.T) + mm.matmul(query, w_q.T).unsqueeze(1)  # (B, T, A)
        if bias is not None:
            hidden = hidden + bias.to(mm.acc)
        scores = mm.matmul(torch.tanh(hidden), v)  # (B, T)
    else:
        _check_dot(query, keys, score)
        scores = mm.matmul(keys, query.unsqueeze(2)).squeeze(2)  # (B, T)
        if score == "scaled_dot":
            scores = scores * (1 / math.sqrt(keys.size(2)))
    weights = torch.softmax(_masked(scores, lengths, batch, steps), dim=1)
    context = mm.matmul(weights.unsqueeze(1), values).squeeze(1)
    if mm.mixed:  # scores, softmax and the weights in float32; results in the low dtype
        return context.to(mm.low), weights.to(mm.low)
    return context, weights


_ONE_DTYPE = (torch.float32, torch.float64)


def _check_dot(query: Tensor, keys: Tensor, score: str) -> None:
    if query.size(1) != keys.size(2):
        raise ValueError(f"keys: expected feature size Dk = {query.size(1)} (query's Dq) for score={score!r}, got "
                         f"{keys.size(2)}")


def _masked(scores: Tensor, lengths: Tensor | list[int] | None, batch: int, steps: int) -> Tensor:
    """scores (B, T) with -inf at the steps t >= len_b (lengths validated)."""
    if lengths is None:
        return scores
    lens = as_lengths(lengths, batch, steps).to(scores.device)
    return scores.masked_fill(torch.arange(steps, device=scores.device) >= lens.unsqueeze(1), float("-inf"))


def _dot_one_dtype(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor | list[int] | None,
                   scaled: bool) -> tuple[Tensor, Tensor]:
    """The dot / scaled-dot score in one dtype (float32 or float64) without autocast: the products are
    torch.bmm itself (what torch.matmul runs for these 3-D operands), with none of the mixed-precision
    bookkeeping, the fixed cost that dominates small calls."""
    _check_dot(query, keys, "scaled_dot" if scaled else "dot")
    scores = torch.bmm(keys, query.unsqueeze(2)).squeeze(2)  # (B, T)
    if scaled:
        scores = scores * (1 / math.sqrt(keys.size(2)))
    weights = torch.softmax(_masked(scores, lengths, keys.size(0), keys.size(1)), dim=1)
    return torch.bmm(weights.unsqueeze(1), values).squeeze(1), weights


class _AttentionTriton(torch.autograd.Function):
    """Dot / scaled-dot attention pooling through the Triton kernels (``fastlayers._triton.attention``):
    CUDA tensors, or CPU tensors under Triton's interpreter. Low precision as the torch path:
    operands rounded to the low dtype, float32 scores, softmax and sums, results in the low dtype."""

    @staticmethod
    def forward(ctx, query, keys, values, lengths, scale):
        from ._triton import attention as kernels

        low = _precision.dtypes(query)[0]  # operands rounded to it, float32 sums, results in it
        q, k, v = (t.to(low).contiguous() for t in (query, keys, values))
        context, weights = kernels.forward(q, k, v, lengths, scale, low)
        ctx.save_for_backward(q, k, v, weights, query, keys, values, lengths)  # the weights in float32 (float64)
        ctx.scale, ctx.dtypes, ctx.low = scale, (query.dtype, keys.dtype, values.dtype), low
        return context, weights.to(low)

    @staticmethod
    def backward(ctx, d_context, d_weights):
        from ._triton import attention as kernels

        if _twice.recording():  # create_graph: the torch ops' gradient, differentiable again
            return _AttentionTriton._recorded(ctx, d_context, d_weights)
        q, k, v, weights = ctx.saved_tensors[:4]
        need = ctx.needs_input_grad
        d_context = d_context.contiguous() if d_context is not None else q.new_zeros(q.size(0), v.size(2))
        dq, dk, dv = kernels.backward(q, k, v, weights, d_context,
                                      d_weights.contiguous() if d_weights is not None else None, ctx.scale, need[2])
        grads = (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None)
        return (*(g if g is None else g.to(d) for g, d in zip(grads, ctx.dtypes)), None, None)

    @staticmethod
    def _recorded(ctx, d_context, d_weights):
        query, keys, values, lengths = ctx.saved_tensors[4:]
        low = ctx.low

        def reference(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            with torch.autocast(q.device.type, dtype=low, enabled=low in _precision.LOW and q.dtype != low):
                return attention_pool_reference(q, k, v, lengths, score="dot" if ctx.scale == 1.0 else "scaled_dot")

        grads = _twice.recorded_vjp(reference, (query, keys, values), (d_context, d_weights), ctx.needs_input_grad[:3])
        return (*grads, None, None)


class AttentionPooling(NotScriptable, nn.Module):
    """Module form of :func:`attention_pool`; owns the additive score's parameters.

    Args:
        query_size: Dq. key_size: Dk (default Dq).
        score: ``"dot"``, ``"scaled_dot"`` or ``"additive"``.
        attention_size: A, hidden size of the additive score (default Dk); additive only.
        bias: additive score has a bias b in tanh(W_q q + W_k k + b).

    Forward: ``(query (B, Dq), keys (B, T, Dk), values (B, T, Dv) = keys, lengths=None)`` ->
    ``(context (B, Dv), weights (B, T))``; non-finite input as :func:`attention_pool`.
    Initialisation (``reset_parameters()``): W_q uniform(+-1/sqrt(Dq)), W_k and b
    uniform(+-1/sqrt(Dk)), v uniform(+-1/sqrt(A)), as nn.Linear's fan-in rule.
    """

    def __init__(self, query_size: int, key_size: int | None = None, score: str = "dot",
                 attention_size: int | None = None, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score: expected one of {SCORES}, got {score!r}")
        key_size = query_size if key_size is None else key_size
        for name, value in (("query_size", query_size), ("key_size", key_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if score != "additive" and query_size != key_size:
            raise ValueError(f"key_size: expected {query_size} (= query_size) for score={score!r}, got {key_size}")
        self.query_size, self.key_size, self.score = query_size, key_size, score
        kw = {"device": device, "dtype": dtype}
        if score == "additive":
            size = attention_size or key_size
            self.weight_query = nn.Parameter(torch.empty(size, query_size, **kw))
            self.weight_key = nn.Parameter(torch.empty(size, key_size, **kw))
            self.v = nn.Parameter(torch.empty(size, **kw))
            self.bias = nn.Parameter(torch.empty(size, **kw)) if bias else None
            self.reset_parameters()
        elif attention_size is not None:
            raise ValueError(f"attention_size: expected None for score={score!r} (additive only), got {attention_size}")

    def reset_parameters(self) -> None:
        if self.score != "additive":
            return
        for p, fan_in in ((self.weight_query, self.query_size), (self.weight_key, self.key_size),
                          (self.v, self.v.numel()), (self.bias, self.key_size)):
            if p is not None:
                nn.init.uniform_(p, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, query: Tensor, keys: Tensor, values: Tensor | None = None,
                lengths: Tensor | list[int] | None = None) -> tuple[Tensor, Tensor]:
        additive = (self.weight_query, self.weight_key, self.v, self.bias) if self.score == "additive" else None
        return attention_pool(query, keys, values, lengths, score=self.score, additive=additive)

    def extra_repr(self) -> str:
        return f"query_size={self.query_size}, key_size={self.key_size}, score={self.score!r}"
