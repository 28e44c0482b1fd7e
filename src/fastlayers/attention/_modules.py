"""Attention pooling's public half: :func:`attention_pool` (validation, then the backend choice:
the Triton kernels for dot scores on CUDA, the CPU binding's own backwards on CPU, else the
plain-PyTorch twin) and :class:`AttentionPooling`.

Legend and formulas: :mod:`fastlayers.attention`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .._core import jagged
from .._core.backend import select
from .._core import precision, twice
from .._core.checks import as_lengths, check_floating, check_rank, check_same_dtype_device, check_tensor, is_int
from .._core.jit import TRITON, VARLEN, NotScriptable, refuse_trace
from . import _cpu as cpu
from ._gpu import AttentionTriton
from ._reference import (SCORES, additive_parameters, attention_pool_reference, attention_pool_varlen_reference,
                         check_dot, padded_steps, score_scale)


def _check(query: Tensor, keys: Tensor, values: Tensor, varlen: bool = False) -> None:
    """query (B, Dq), keys (B, T, Dk) and values (B, T, Dv) floating, in one dtype and device; with
    ``varlen`` keys and values are (N, D) rows (their ranks and row counts checked by the caller)."""
    if (not varlen and type(query) is Tensor and type(keys) is Tensor and type(values) is Tensor
            and query.dim() == 2 and keys.dim() == 3 and values.dim() == 3 and query.is_floating_point()
            and query.dtype == keys.dtype == values.dtype and query.device == keys.device == values.device
            and keys.size(0) == query.size(0) and values.shape[:2] == keys.shape[:2] and keys.size(1) >= 1):
        return  # the common valid call, in a few operations; anything else gets the checks below
    for name, t in (("query", query), ("keys", keys), ("values", values)):
        check_tensor(name, t)
        check_floating(name, t)
    check_rank("query", query, (2,), "(B, Dq)")
    if not varlen:
        check_rank("keys", keys, (3,), "(B, T, Dk)")
        check_rank("values", values, (3,), "(B, T, Dv)")
    check_same_dtype_device("keys", keys, "query", query)
    check_same_dtype_device("values", values, "query", query)
    if varlen:
        return
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
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention pooling of ``values`` over time, weighted by the scores of ``query`` against ``keys``.

    ``weights = softmax_t(score(query, keys_t))`` over the valid steps, ``context = sum_t weights_t
    * values_t``. Scores: dot ``q . k_t`` and scaled dot ``q . k_t / sqrt(Dk)`` (Luong et al. 2015;
    Vaswani et al. 2017), additive ``v . tanh(W_q q + W_k k_t + b)`` (Bahdanau et al. 2015). Legend:
    B batch, T time, Dq / Dk / Dv query, key, value sizes, A the additive score's size.

    Args:
        query: (B, Dq) float tensor.
        keys: (B, T, Dk), same dtype and device.
        values: (B, T, Dv); default ``keys``.
        lengths: optional (B,) integer tensor (any device), integer NumPy array or list of ints,
            1 <= len_b <= T: steps t >= len_b get weight exactly 0. Default: every step is valid.
        score: ``"dot"`` (Dq == Dk), ``"scaled_dot"`` (Dq == Dk) or ``"additive"``.
        additive: for ``score="additive"``: ``(weight_query (A, Dq), weight_key (A, Dk), v (A,),
            bias (A,) or None)``; :class:`AttentionPooling` owns these.

        cu_seqlens, max_seqlen: the varlen form without padding: ``keys`` (N, Dk) and ``values``
            (N, Dv) hold the B sequences one after another, ``cu_seqlens`` (B+1,) int32 / int64 their
            offsets (0, ..., N); the weights come back as (N,) in that layout. Jagged NestedTensor
            ``keys`` / ``values`` (B, j, D) run the same way (weights a jagged (B, j)).

    Returns:
        ``(context, weights)``: context (B, Dv), weights (B, T) summing to 1 over valid steps.

    Raises:
        TypeError: non-tensor or integer inputs, float lengths, mismatched dtypes (the additive
            parameters' too, outside autocast), an ``additive`` that is not a sequence (tuple or
            list) of 4 tensors (bias or None).
        ValueError: wrong ranks or sizes (the additive parameters' against A = weight_query's
            rows and the query's and keys' sizes), unknown score, lengths out of [1, T] or of the
            wrong size, missing additive parameters, or ``additive`` given for another score;
            varlen: ``max_seqlen`` without ``cu_seqlens``, ``lengths`` with ``cu_seqlens`` or a
            NestedTensor, a ``cu_seqlens`` that does not start at 0, increase and end at N (these
            and the lengths' bounds are RuntimeErrors too), dense ``values`` with jagged ``keys``.
            TypeError too: ``cu_seqlens`` not an int32 / int64 tensor, ``max_seqlen`` not an int.

    Low precision (bf16/fp16 inputs, or float32 under ``torch.autocast``): the score and context
    products take low-precision operands and sum in float32; tanh, masking and softmax run in
    float32; context and weights are returned in the low dtype (see :mod:`fastlayers._core.precision`).
    Under autocast, bf16 / fp16 keys and values (an autocast layer's output) with a float32 query
    (a learned one) run as that float32 call.

    Non-finite input: a NaN in ``query`` or in ``keys`` at a valid step makes that sequence's
    weights and context NaN, and so does an inf that makes a score +inf or NaN (one that makes it
    -inf gives that step weight 0, as torch.softmax). Padded steps (t >= len_b) get an exact 0
    weight (their scores are masked); finite keys and values there, however large (1e38 in
    float32), get an exact 0 gradient and change no other result or gradient. The products still
    read them: a NaN or inf value at a padded step reaches the context (0 * NaN = NaN, as in
    torch.bmm); a NaN or inf key there, or with the additive score one whose projection W_k k
    overflows, reaches the gradients (the query's; with the additive score also the score
    parameters' and that key's own). The Triton kernels (dot and scaled dot) read no padded step
    in either pass, so there such values reach nothing. Keep padded steps finite and of a
    moderate size (an LSTM with ``lengths`` writes zeros there).
    Large scores (keys of size 1e4) stay finite: the softmax subtracts each row's maximum.
    """
    if twice.grad_mode_in_inference_mode():  # (nothing is recorded there: no autograd Function either)
        with torch.no_grad():
            return attention_pool(query, keys, values, lengths, score=score, additive=additive, cu_seqlens=cu_seqlens,
                                  max_seqlen=max_seqlen)
    if isinstance(query, Tensor) and precision.autocasting(query.device.type):  # an autocast layer's bf16 keys
        keys, values = (precision.autocast_operand(t, query.dtype) for t in (keys, values))  # for a float32 query
    if isinstance(keys, Tensor) and keys.is_nested:
        return _nested(query, keys, values, lengths, cu_seqlens, max_seqlen, score, additive)
    if cu_seqlens is not None:
        return _varlen(query, keys, values, lengths, cu_seqlens, max_seqlen, score, additive)
    if max_seqlen is not None:
        raise ValueError("max_seqlen: expected None without cu_seqlens")
    values = keys if values is None else values
    _check(query, keys, values)
    which = select("attention", query)
    if score not in SCORES:
        raise ValueError(f"score: expected one of {SCORES}, got {score!r}")
    _check_additive_none(score, additive)
    params = additive_parameters(additive, query, keys) if score == "additive" else None
    if which == "triton" and params is None or which == "cpu" and cpu.serves(query, keys, values, params):
        batch, steps = keys.shape[:2]
        lens = as_lengths(lengths, batch, steps) if lengths is not None else None
        scale = score_scale(keys.size(2)) if score == "scaled_dot" else 1.0
        if params is None:
            check_dot(query, keys, score)
        if which == "cpu":
            return cpu.pool(query, keys, values, padded_steps(lens, steps) if lens is not None else None, lens, scale,
                            params)
        refuse_trace("fastlayers.attention_pool on the Triton backend", TRITON)  # one fused kernel per pass
        return AttentionTriton.apply(query, keys, values, lens if lens is None else lens.to(keys.device),
                                     score == "scaled_dot")
    return attention_pool_reference(query, keys, values, lengths, score=score, additive=additive)


def _check_additive_none(score: str, additive: object) -> None:
    if score != "additive" and additive is not None:
        raise ValueError(f"additive: expected None for score={score!r} (the additive score's parameters), got "
                         f"{type(additive).__name__}")


def _varlen(query, keys, values, lengths, cu_seqlens, max_seqlen, score, additive) -> tuple[Tensor, Tensor]:
    """keys (N, Dk), values (N, Dv) or None, cu_seqlens (B+1,) -> context (B, Dv), weights (N,): the
    padded call with lengths between one index_copy and one index_select (exact)."""
    if lengths is not None:
        raise ValueError("lengths: expected None with cu_seqlens (the varlen form carries its lengths)")
    for name, t in (("keys", keys), ("values", values)):
        if t is not None:
            check_tensor(name, t)  # (TypeError for anything else, as the padded call's)
            if t.dim() != 2:
                raise ValueError(f"{name}: expected a 2-D tensor (N, D) with cu_seqlens (the sequences one after "
                                 f"another), got shape {tuple(t.shape)}")
    if values is not None and values.size(0) != keys.size(0):
        raise ValueError(f"values: expected {keys.size(0)} rows (as keys), got {values.size(0)}")
    refuse_trace("fastlayers.attention_pool's varlen form", VARLEN)
    if torch.compiler.is_compiling():  # traced: segment operations, no host read, no graph break
        return _traced_varlen(query, keys, keys if values is None else values, cu_seqlens, max_seqlen, score,
                              additive)
    plan = jagged.varlen(cu_seqlens, keys.size(0), keys.device, batch_first=True, max_seqlen=max_seqlen)
    if isinstance(query, Tensor) and query.dim() == 2 and query.size(0) != plan.batch:
        raise ValueError(f"query: expected batch size {plan.batch} (cu_seqlens' length - 1), got {query.size(0)}")
    padded_values = jagged.pad(values, plan, batch_first=True) if values is not None else None
    context, weights = attention_pool(query, jagged.pad(keys, plan, batch_first=True), padded_values, plan.lengths,
                                      score=score, additive=additive)
    return context, jagged.unpad(weights, plan)


def _traced_varlen(query, keys, values, cu_seqlens, max_seqlen, score, additive) -> tuple[Tensor, Tensor]:
    """The varlen form while torch.compile or torch.export traces: the checks that read no value
    (cu_seqlens' form, the tensors' ranks, dtypes and sizes) and assertions on its values that the
    compiled or exported program runs, then the segment operations of
    :func:`attention_pool_varlen_reference` (any backend)."""
    jagged.check_form(cu_seqlens, keys.device)
    jagged.assert_values(cu_seqlens, keys.size(0))
    if max_seqlen is not None:
        jagged.check_max_seqlen(max_seqlen, cu_seqlens)
    if score not in SCORES:
        raise ValueError(f"score: expected one of {SCORES}, got {score!r}")
    _check_additive_none(score, additive)
    _check(query, keys, values, varlen=True)
    if query.size(0) != cu_seqlens.size(0) - 1:
        raise ValueError(f"query: expected batch size {cu_seqlens.size(0) - 1} (cu_seqlens' length - 1), got "
                         f"{query.size(0)}")
    return attention_pool_varlen_reference(query, keys, values, cu_seqlens, score=score, additive=additive)


def _nested(query, keys, values, lengths, cu_seqlens, max_seqlen, score, additive) -> tuple[Tensor, Tensor]:
    """keys (and values) jagged (B, j, D) -> context (B, Dv), weights jagged (B, j)."""
    if cu_seqlens is not None or lengths is not None:
        raise ValueError("cu_seqlens, lengths: expected None for NestedTensor keys (they carry their offsets)")
    key_values, offsets = jagged.unwrap("keys", keys)
    value_values = None
    if values is not None:
        if not (isinstance(values, Tensor) and values.is_nested):
            raise ValueError("values: expected a jagged NestedTensor like keys (or None), got a dense tensor")
        value_values, value_offsets = jagged.unwrap("values", values)
        if value_offsets.shape != offsets.shape or not bool((value_offsets.cpu() == offsets.cpu()).all()):
            raise ValueError("values: expected the same offsets (sequence lengths) as keys")
    context, weights = _varlen(query, key_values, value_values, None, offsets, max_seqlen, score, additive)
    return context, jagged.rewrap(weights, offsets)


class AttentionPooling(NotScriptable, nn.Module):
    """Module form of :func:`attention_pool`; owns the additive score's parameters (Bahdanau et
    al. 2015: ``weight_query`` (A, Dq), ``weight_key`` (A, Dk), ``v`` (A,), ``bias`` (A,)), created
    with ``device`` / ``dtype`` as torch.nn modules are; dot and scaled dot have none. ValueError for
    an unknown score or sizes that do not fit it (dot scores need Dq == Dk).

    Args:
        query_size: Dq. key_size: Dk (default Dq).
        score: ``"dot"``, ``"scaled_dot"`` or ``"additive"``.
        attention_size: A, hidden size of the additive score (default Dk); additive only.
        bias: additive score has a bias b in tanh(W_q q + W_k k + b).

    Forward: ``(query (B, Dq), keys (B, T, Dk), values (B, T, Dv) = keys, lengths=None)`` ->
    ``(context (B, Dv), weights (B, T))`` (B batch, T time steps; also the varlen and jagged forms of
    :func:`attention_pool`); dtypes, errors and non-finite input as :func:`attention_pool`.
    Initialisation (``reset_parameters()``): W_q uniform(+-1/sqrt(Dq)), W_k and b
    uniform(+-1/sqrt(Dk)), v uniform(+-1/sqrt(A)), as nn.Linear's fan-in rule.
    """

    def __init__(self, query_size: int, key_size: int | None = None, score: str = "dot",
                 attention_size: int | None = None, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score: expected one of {SCORES}, got {score!r}")
        key_size = query_size if key_size is None else key_size
        for name, value in (("query_size", query_size), ("key_size", key_size), ("attention_size", attention_size)):
            if (value is not None or name != "attention_size") and (not is_int(value) or value < 1):
                raise ValueError(f"{name}: expected a positive int{' or None' if name == 'attention_size' else ''}, "
                                 f"got {value!r}")
        query_size, key_size = int(query_size), int(key_size)  # (NumPy's integers: as nn.Linear takes them)
        attention_size = None if attention_size is None else int(attention_size)
        if score != "additive" and query_size != key_size:
            raise ValueError(f"key_size: expected {query_size} (= query_size) for score={score!r}, got {key_size}")
        self.query_size, self.key_size, self.score = query_size, key_size, score
        kw = {"device": device, "dtype": dtype}
        if score == "additive":
            size = key_size if attention_size is None else attention_size
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
                lengths: Tensor | list[int] | None = None, *, cu_seqlens: Tensor | None = None,
                max_seqlen: int | None = None) -> tuple[Tensor, Tensor]:
        """:func:`attention_pool` with this module's score (and its parameters): query (B, Dq),
        keys (B, T, Dk), values (B, T, Dv) (default keys), lengths (B,) or None ->
        ``(context (B, Dv), weights (B, T))``; the varlen form (``cu_seqlens``) and jagged
        NestedTensors as :func:`attention_pool`; errors as :func:`attention_pool`."""
        additive = (self.weight_query, self.weight_key, self.v, self.bias) if self.score == "additive" else None
        return attention_pool(query, keys, values, lengths, score=self.score, additive=additive,
                              cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

    def extra_repr(self) -> str:
        extra = f"query_size={self.query_size}, key_size={self.key_size}, score={self.score!r}"
        if self.score == "additive":
            extra += f", attention_size={self.weight_query.size(0)}" + ("" if self.bias is not None else ", bias=False")
        return extra
