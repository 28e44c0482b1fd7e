"""Attention pooling's plain-PyTorch twin, :func:`attention_pool_reference`: the reference backend's
path (and the CPU backend's where its binding does not run), the tests' oracle, and what the CPU
binding's and the Triton kernels' double backwards differentiate; :func:`dot_pool`, the forward
that the CPU binding shares.

Legend and formulas: :mod:`fastlayers.attention` (B batch, T time, Dq / Dk / Dv features, A
attention size).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .._core import precision
from .._core.checks import DeviceError, ShapeError, as_lengths, check_same_dtype_device, check_shape, check_tensor

SCORES = ("dot", "scaled_dot", "additive")
_ONE_DTYPE = (torch.float32, torch.float64)


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
    ``values`` given): batched matmuls and a softmax, any device and dtype. It is what the reference
    backend runs, and what the CPU binding's and the Triton kernels' double backwards differentiate."""
    batch, steps = keys.shape[:2]
    if score != "additive" and query.dtype in _ONE_DTYPE and not precision.autocasting(query.device.type):
        return _dot_one_dtype(query, keys, values, lengths, score == "scaled_dot")
    mm = precision.Products.of(query)
    pad = pad_mask(lengths, batch, steps, keys.device)
    if score == "additive":
        scores = _additive_scores(mm, query, keys, additive, lambda projected: projected.unsqueeze(1))  # (B, T)
    else:
        check_dot(query, keys, score)
        scores = mm.matmul(query.unsqueeze(1), keys.transpose(1, 2)).squeeze(1)  # (B, T), as dot_pool
        if score == "scaled_dot":
            scores = scores * score_scale(keys.size(2))
    weights = _padded_zero(torch.softmax(scores if pad is None else scores.masked_fill(pad, float("-inf")), dim=1),
                           pad)
    context = mm.matmul(weights.unsqueeze(1), values).squeeze(1)
    if mm.mixed:  # scores, softmax and the weights in float32; results in the low dtype
        return context.to(mm.low), weights.to(mm.low)
    return context, weights


def attention_pool_varlen_reference(query: Tensor, keys: Tensor, values: Tensor, cu_seqlens: Tensor, *,
                                    score: str = "dot",
                                    additive: tuple[Tensor, Tensor, Tensor, Tensor | None] | None = None
                                    ) -> tuple[Tensor, Tensor]:
    """The varlen form with segment operations: query (B, Dq), keys (N, Dk), values (N, Dv),
    cu_seqlens (B+1,) (validated, or read by nothing that needs it valid) -> (context (B, Dv),
    weights (N,)). No padded tensor and no host read of the lengths: every shape follows from N and
    B, so torch.compile and torch.export trace it (issue 66). The same values as the padded call
    with lengths up to the order of the sums (float64: 1e-15 here)."""
    rows, batch = keys.size(0), cu_seqlens.size(0) - 1
    offsets = cu_seqlens.to(device=keys.device, dtype=torch.int64)
    seq = torch.searchsorted(offsets[1:], torch.arange(rows, device=keys.device), right=True)  # (N,) sequence of a row
    mm = precision.Products.of(query)
    # the products' operands rounded to the low dtype, as the padded call's matmuls round them
    operand = (lambda t: t.to(mm.low).to(mm.acc)) if mm.mixed else (lambda t: t.to(mm.acc))  # noqa: E731
    if score == "additive":
        scores = _additive_scores(mm, query, keys, additive, lambda projected: projected.index_select(0, seq))  # (N,)
    else:
        check_dot(query, keys, score)
        scores = (operand(keys) * operand(query).index_select(0, seq)).sum(1)  # (N,)
        if score == "scaled_dot":
            scores = scores * score_scale(keys.size(1))
    scores = scores.to(mm.acc)
    top = scores.new_full((batch,), float("-inf")).scatter_reduce(0, seq, scores.detach(), "amax")
    e = torch.exp(scores - top.index_select(0, seq))
    weights = e / e.new_zeros(batch).index_add(0, seq, e).index_select(0, seq)
    context = values.new_zeros(batch, values.size(1), dtype=mm.acc).index_add(
        0, seq, operand(weights).unsqueeze(1) * operand(values))
    if mm.mixed:  # as attention_pool_reference: the results in the low dtype
        return context.to(mm.low), weights.to(mm.low)
    return context, weights


def _additive_scores(mm: precision.Products, query: Tensor, keys: Tensor,
                     additive: tuple[Tensor, Tensor, Tensor, Tensor | None] | None, spread) -> Tensor:
    """The additive score v . tanh(W_k k + W_q q + b) of keys (..., Dk): ``spread`` places the query
    projection (B, A) beside the keys' (over the time steps, or over the varlen rows)."""
    w_q, w_k, v, bias = additive_parameters(additive, query, keys)
    hidden = mm.matmul(keys, w_k.T) + spread(mm.matmul(query, w_q.T))
    if bias is not None:
        hidden = hidden + bias.to(mm.acc)
    return mm.matmul(torch.tanh(hidden), v)


def additive_parameters(additive: tuple[Tensor, Tensor, Tensor, Tensor | None] | None, query: Tensor,
                        keys: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The additive score's ``(weight_query (A, Dq), weight_key (A, Dk), v (A,), bias (A,) or None)``,
    checked: tensors (bias or None), A from weight_query, each shape against it and against query
    (B, Dq) and keys (..., Dk) (the query's or keys' size named where it is theirs that differs),
    query's device, and query's dtype outside autocast (as nn.Linear's weights)."""
    if additive is None:
        raise ValueError("additive: expected (weight_query, weight_key, v, bias) for score='additive', got None")
    if not isinstance(additive, (tuple, list)) or len(additive) != 4:
        got = f"{type(additive).__name__} of {len(additive)}" if isinstance(additive, (tuple, list)) else \
            type(additive).__name__
        raise TypeError(f"additive: expected a tuple (weight_query, weight_key, v, bias or None), got a {got}")
    w_q, w_k, v, bias = additive
    named = [("additive weight_query", w_q), ("additive weight_key", w_k), ("additive v", v)]
    named += [("additive bias", bias)] if bias is not None else []
    for name, t in named:
        check_tensor(name, t)
    for name, t, legend in (("additive weight_query", w_q, "(A, Dq)"), ("additive weight_key", w_k, "(A, Dk)")):
        if t.dim() != 2:
            raise ShapeError(f"{name}: expected a 2-D tensor {legend}, got shape {tuple(t.shape)}")
    size = w_q.size(0)
    if query.size(1) != w_q.size(1):
        raise ShapeError(f"query: expected feature size Dq = {w_q.size(1)} (additive weight_query's (A, Dq)), got "
                         f"{query.size(1)}")
    if keys.size(-1) != w_k.size(1):
        raise ShapeError(f"keys: expected feature size Dk = {w_k.size(1)} (additive weight_key's (A, Dk)), got "
                         f"{keys.size(-1)}")
    check_shape("additive weight_key", w_k, (size, keys.size(-1)), "(A, Dk)")
    check_shape("additive v", v, (size,), "(A,)")
    if bias is not None:
        check_shape("additive bias", bias, (size,), "(A,)")
    autocast = precision.autocasting(query.device.type)  # (under autocast the products take its dtype)
    for name, t in named:
        if not autocast:
            check_same_dtype_device(name, t, "query", query)
        elif t.device != query.device:
            raise DeviceError(f"{name}: expected device {query.device} (that of query), got {t.device}")
    return w_q, w_k, v, bias


def score_scale(size: int) -> float:
    """The scaled-dot score's 1 / sqrt(Dk) (1 for Dk = 0, where every score is 0 whatever the scale)."""
    return 1 / math.sqrt(size) if size > 0 else 1.0


def check_dot(query: Tensor, keys: Tensor, score: str) -> None:
    """Dk (keys' last dimension: (B, T, Dk) or the varlen form's (N, Dk)) equal to query's Dq."""
    if query.size(1) != keys.size(-1):
        raise ValueError(f"keys: expected feature size Dk = {query.size(1)} (query's Dq) for score={score!r}, got "
                         f"{keys.size(-1)}")


def pad_mask(lengths: Tensor | list[int] | None, batch: int, steps: int, device: torch.device) -> Tensor | None:
    """(B, T) bool, True at the padded steps t >= len_b (lengths validated); None without lengths."""
    if lengths is None:
        return None
    return padded_steps(as_lengths(lengths, batch, steps).to(device), steps)


def padded_steps(lens: Tensor, steps: int) -> Tensor:
    """(B, T) bool, True at t >= lens[b], for validated lengths (B,) int64 on the scores' device."""
    return torch.arange(steps, device=lens.device) >= lens.unsqueeze(1)


def _padded_zero(weights: Tensor, pad: Tensor | None) -> Tensor:
    """The softmax's weights (B, T), the same values (0 at the padded steps, or NaN on a row that
    a NaN score makes NaN), with a recorded backward that gives the padded steps a gradient of
    exactly 0: the gradient a padded step's values send there (dC . v_t, inf for a finite 1e38)
    would reach every step through softmax's row sum as 0 * inf."""
    recorded = weights.requires_grad or torch.jit.is_tracing()  # (a trace's graph is the same with and without grad)
    return torch.where(pad, weights.detach(), weights) if pad is not None and recorded else weights


def dot_pool(query: Tensor, keys: Tensor, values: Tensor, pad: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """(context (B, Dv), weights (B, T)): softmax_t(scale * q . k_t) over the valid steps, one dtype;
    query (B, D), keys (B, T, D), values (B, T, Dv), pad (B, T) bool (True: a padded step) or None.
    The score product is (B, 1, D) @ (B, D, T): with the keys as the right operand, torch.bmm is one
    batched row product (the keys read once, in place), where keys @ query (a (B, T, 1) result)
    took about 6x as long at the attention seed shape (AMD EPYC Zen 4, torch 2.13's CPU build)."""
    scores = torch.bmm(query.unsqueeze(1), keys.transpose(1, 2)).squeeze(1)  # (B, T), a fresh tensor
    if scale != 1.0:  # (in place but in a torch.jit.trace: its graph, run again with grad, refused the in-place
        scores = scores * scale if torch.jit.is_tracing() else scores.mul_(scale)  # op on the product's view)
    return softmax_pool(scores, values, pad)


def softmax_pool(scores: Tensor, values: Tensor, pad: Tensor | None) -> tuple[Tensor, Tensor]:
    """(context (B, Dv), weights (B, T)) from scores (B, T) (a fresh tensor: masked in place) and
    values (B, T, Dv): the softmax over the steps that ``pad`` (B, T) bool or None leaves valid."""
    if pad is not None:  # (in place, but in a torch.jit.trace: see dot_pool)
        fill = scores.masked_fill if torch.jit.is_tracing() else scores.masked_fill_
        scores = fill(pad, float("-inf"))
    weights = _padded_zero(torch.softmax(scores, dim=1), pad)
    return torch.bmm(weights.unsqueeze(1), values).squeeze(1), weights


def _dot_one_dtype(query: Tensor, keys: Tensor, values: Tensor, lengths: Tensor | list[int] | None,
                   scaled: bool) -> tuple[Tensor, Tensor]:
    """The dot / scaled-dot score in one dtype (float32 or float64) without autocast: the products are
    torch.bmm itself, with none of the mixed-precision bookkeeping, the fixed cost that dominates
    small calls."""
    check_dot(query, keys, "scaled_dot" if scaled else "dot")
    return dot_pool(query, keys, values, pad_mask(lengths, keys.size(0), keys.size(1), keys.device),
                    score_scale(keys.size(2)) if scaled else 1.0)
