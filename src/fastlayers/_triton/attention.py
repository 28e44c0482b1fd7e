"""Masked attention pooling in Triton: dot / scaled-dot scores, softmax over valid steps, context.

Legend: B batch, T time, Dk key (= query) features, Dv value features. One program per sequence
b; time goes in chunks of ``BLOCK_T`` steps, so any T fits:

forward, per b:  s_t = scale * <q_b, k_bt> (t < len_b; -inf after), an online softmax over the
chunks (running max m, sum l and weighted sum of values), then the weights w_t = exp(s_t - m) / l
written in a second pass (the raw scores wait in the weights' buffer);
backward, per b, given dc (grad of the context) and dw_ext (grad of the weights):
g_t = <dc, v_bt> + dw_ext_t, ds_t = w_t (g_t - sum_t' w_t' g_t'), dq = scale sum_t ds_t k_t,
dk_t = scale ds_t q, dv_t = w_t dc.

Sums in float32 (float64 for float64 tensors); each output element written by one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from . import next_power_of_2
from ._launch import launch

BLOCK_T = 64
# The backward holds a (time x Dv) tile of the values and of their gradient: at 64 x 128 on 4 warps it
# needed 255 registers and spilled (sm_90a, Triton 3.6: 92/84 B float32, 360/352 B bfloat16, 812/892 B
# float64); 32 x 128 on 8 warps uses 177 / 202 / 252 registers without spills
# (benchmarks/gpu_static.py). One program per sequence: the grid (B) is what fills the GPU.
BACKWARD_BLOCK_T, BACKWARD_WARPS = 32, 8


@triton.jit
def _scale(DK, SCALED: tl.constexpr, acc_t: tl.constexpr):
    """1 / sqrt(DK) (SCALED; 1 otherwise), correctly rounded in float64 then cast to ``acc_t``: the
    float32 value the wrappers once passed as a float argument, and the exact float64 one (a float
    argument of a compiled kernel is float32)."""
    if SCALED:
        return (1.0 / tl.sqrt(DK.to(tl.float64))).to(acc_t)  # (float64 sqrt and division: IEEE-rounded)
    else:
        return tl.full([], 1.0, acc_t)


@triton.jit
def _forward_kernel(q, k, v, lengths, ctx, w, T, DK, DV,
                    SCALED: tl.constexpr, HAS_LENGTHS: tl.constexpr, F64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr,
                    BLOCK_DV: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    scale = _scale(DK, SCALED, acc_t)
    b = tl.program_id(0).to(tl.int64)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    qv = tl.load(q + b * DK + dk, mask=dk < DK, other=0.0).to(acc_t)
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths + b).to(tl.int32)
    m = tl.full([1], float("-inf"), acc_t)
    total = tl.zeros([1], dtype=acc_t)
    acc = tl.zeros([BLOCK_DV], dtype=acc_t)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        valid = t < n
        kt = tl.load(k + (b * T + t[:, None]) * DK + dk[None, :], mask=(t[:, None] < T) & (dk[None, :] < DK),
                     other=0.0).to(acc_t)
        s = tl.sum(kt * qv[None, :], axis=1) * scale
        s = tl.where(valid, s, float("-inf"))
        tl.store(w + b * T + t, s.to(w.dtype.element_ty), mask=t < T)  # raw scores, normalised below
        m_new = tl.maximum(m, tl.max(s, axis=0))
        # while every score so far is -inf (a block of -inf keys first): subtract 0, not -inf (the
        # difference of two -inf is NaN, which would stay in acc and total for good)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.where(valid, tl.exp(s - m_safe), 0.0)
        rescale = tl.exp(m - m_safe)
        vt = tl.load(v + (b * T + t[:, None]) * DV + dv[None, :], mask=valid[:, None] & (dv[None, :] < DV),
                     other=0.0).to(acc_t)
        acc = acc * rescale + tl.sum(e[:, None] * vt, axis=0)
        total = total * rescale + tl.sum(e, axis=0)
        m = m_new
    tl.store(ctx + b * DV + dv, (acc / total).to(ctx.dtype.element_ty), mask=dv < DV)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        s = tl.load(w + b * T + t, mask=t < T, other=float("-inf")).to(acc_t)
        weight = tl.where(t < n, tl.exp(s - m) / total, 0.0)
        tl.store(w + b * T + t, weight.to(w.dtype.element_ty), mask=t < T)


@triton.jit
def _weights_and_upstream(w, v, dw_ext, dc, b, t, n, dv, T, DV, HAS_DW: tl.constexpr, F64: tl.constexpr):
    """For the steps t of sequence b: the weights w_t and g_t = <dc, v_bt> (+ dw_ext_t); both 0 at
    the padded steps t >= n, which are not read (as the forward reads no padded value)."""
    acc_t = tl.float64 if F64 else tl.float32
    valid = t < n
    wt = tl.load(w + b * T + t, mask=valid, other=0.0).to(acc_t)
    vt = tl.load(v + (b * T + t[:, None]) * DV + dv[None, :], mask=valid[:, None] & (dv[None, :] < DV),
                 other=0.0).to(acc_t)
    g = tl.sum(vt * dc[None, :], axis=1)
    if HAS_DW:
        g += tl.load(dw_ext + b * T + t, mask=valid, other=0.0).to(acc_t)
    return wt, g


@triton.jit
def _backward_kernel(q, k, v, w, lengths, dctx, dw_ext, dq, dk_out, dv_out, T, DK, DV,
                     SCALED: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_DW: tl.constexpr, NEED_DV: tl.constexpr,
                     F64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    scale = _scale(DK, SCALED, acc_t)
    b = tl.program_id(0).to(tl.int64)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    qv = tl.load(q + b * DK + dk, mask=dk < DK, other=0.0).to(acc_t)
    dc = tl.load(dctx + b * DV + dv, mask=dv < DV, other=0.0).to(acc_t)
    n = T
    if HAS_LENGTHS:
        n = tl.load(lengths + b).to(tl.int32)
    centre = tl.zeros([1], dtype=acc_t)  # sum_t w_t g_t
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        wt, g = _weights_and_upstream(w, v, dw_ext, dc, b, t, n, dv, T, DV, HAS_DW, F64)
        centre += tl.sum(wt * g, axis=0)
    dqv = tl.zeros([BLOCK_DK], dtype=acc_t)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        wt, g = _weights_and_upstream(w, v, dw_ext, dc, b, t, n, dv, T, DV, HAS_DW, F64)
        ds = wt * (g - centre) * scale  # (0 at the padded steps, whose keys are not read: exact 0 gradients there)
        kt = tl.load(k + (b * T + t[:, None]) * DK + dk[None, :], mask=(t[:, None] < n) & (dk[None, :] < DK),
                     other=0.0).to(acc_t)
        dqv += tl.sum(ds[:, None] * kt, axis=0)
        tl.store(dk_out + (b * T + t[:, None]) * DK + dk[None, :], (ds[:, None] * qv[None, :]).to(dk_out.dtype.element_ty),
                 mask=(t[:, None] < T) & (dk[None, :] < DK))
        if NEED_DV:
            tl.store(dv_out + (b * T + t[:, None]) * DV + dv[None, :], (wt[:, None] * dc[None, :]).to(dv_out.dtype.element_ty),
                     mask=(t[:, None] < T) & (dv[None, :] < DV))
    tl.store(dq + b * DK + dk, dqv.to(dq.dtype.element_ty), mask=dk < DK)


def _blocks(dk: int, dv: int, block_t: int = BLOCK_T) -> dict[str, int]:
    return {"BLOCK_T": block_t, "BLOCK_DK": next_power_of_2(dk), "BLOCK_DV": next_power_of_2(dv)}


def forward(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None, scaled: bool,
            out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(context (B, Dv) in ``out_dtype``, weights (B, T) in float32 / float64); q (B, Dk), k (B, T, Dk),
    v (B, T, Dv) contiguous; lengths (B,) int64 on q's device, contiguous, or None; ``scaled``: scores
    times 1 / sqrt(Dk) (scaled dot) or not (dot)."""
    batch, steps, d_k = k.shape
    d_v = v.size(2)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    ctx = q.new_empty(batch, d_v, dtype=out_dtype)
    w = q.new_empty(batch, steps, dtype=acc)  # float32 scores and weights; cast at the end
    launch(_forward_kernel, (batch,), (q, k, v, lengths if lengths is not None else q, ctx, w, steps, d_k, d_v),
           {"SCALED": scaled and d_k > 1, "HAS_LENGTHS": lengths is not None, "F64": acc == torch.float64,
            **_blocks(d_k, d_v)})
    return ctx, w


def backward(q: Tensor, k: Tensor, v: Tensor, w: Tensor, dctx: Tensor, dw: Tensor | None, scaled: bool,
             need_dv: bool, lengths: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dq, dk, dv or None) in the dtypes of q, k, v; w the forward's weights (B, T); ``lengths`` as
    :func:`forward`'s (the padded steps are read by neither pass)."""
    batch, steps, d_k = k.shape
    d_v = v.size(2)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = q.new_empty(q.shape, dtype=acc)
    dk = k.new_empty(k.shape, dtype=acc)
    dv = v.new_empty(v.shape, dtype=acc) if need_dv else None
    launch(_backward_kernel, (batch,), (q, k, v, w, lengths if lengths is not None else q, dctx,
                                        dw if dw is not None else w, dq, dk, dv if dv is not None else dk, steps, d_k,
                                        d_v),
           {"SCALED": scaled and d_k > 1, "HAS_LENGTHS": lengths is not None, "HAS_DW": dw is not None,
            "NEED_DV": need_dv, "F64": acc == torch.float64,
            **_blocks(d_k, d_v, BACKWARD_BLOCK_T)}, num_warps=BACKWARD_WARPS)
    return dq.to(q.dtype), dk.to(k.dtype), (dv.to(v.dtype) if dv is not None else None)
