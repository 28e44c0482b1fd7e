"""Locally connected 2-D layer in Triton: forward, input gradient, weight and bias gradients.

Legend and layout as ``_native/local.c``: B batch, C in channels, O out channels, H x W input,
Hp x Wp padded input, KH x KW kernel, OH x OW output, stride (sh, sw), dilation (dh, dw); x [B, C,
Hp, Wp] for the gradient kernels (the forward takes x [B, C, H, W] and pads by masking), w [O, C,
KH, KW, OH, OW], bias [O, OH, OW], y [B, O, OH, OW], all contiguous.

    y[b,o,i,j] = bias[o,i,j] + sum_{c,p,q} w[o,c,p,q,i,j] * x[b,c,i*sh+p*dh,j*sw+q*dw]

Every kernel takes a block of output (or input) positions and sums in float32 (float64 for
float64 tensors) whatever the storage dtype; each output element is written by one program, in a
fixed order (no atomics), so results do not depend on scheduling:

* forward: one program per (group of output channels, chunk of sequences, tile of output
  positions) sums an [OG, CB, positions] block: each input tap loaded once for the group's
  channels, each weight once for the chunk's sequences, zero padding by masking (no padded copy of
  the input); :func:`forward_config` sizes the block;
* input gradient: a gather: one program per (block of Hp*Wp input positions, input channel,
  sequence) sums w * dy over the (o, p, q) whose output position reads that input;
* weight gradient: one program per (block of OH*OW positions, output channel, filter pair
  (c, p, q)) sums dy * x over the batch; one more pair index per channel sums dy (the bias).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import cdiv, next_power_of_2
from ._launch import launch

BLOCK = 256  # positions per program of the gradient kernels


@triton.jit
def _forward_kernel(x, w, bias, y, B, C, H, W, O, OH, OW, sh, sw, dh, dw, ph, pw,
                    KH: tl.constexpr, KW: tl.constexpr, PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
                    F64: tl.constexpr, CB: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, OG: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    # one program: OG output channels x CB sequences x a tile of BH x BW output positions, summed in
    # an [OG, CB, BH*BW] block. Each input tap is loaded once for the OG channels, each weight once
    # for the CB sequences. The chunk of sequences varies fastest over the programs, so the
    # programs that read the same weights run together (L2); zero padding is a mask (PAD).
    chunks = tl.cdiv(B, CB)
    groups = tl.cdiv(O, OG)
    pid = tl.program_id(0)
    tile = pid // (chunks * groups)
    tiles_w = tl.cdiv(OW, BW)
    r = tl.arange(0, BH * BW)
    i = (tile // tiles_w) * BH + r // BW  # [BH*BW] output row, column
    j = (tile % tiles_w) * BW + r % BW
    inside = (i < OH) & (j < OW)
    ohw = OH * OW
    pos = i * OW + j
    o = ((pid // chunks) % groups) * OG + tl.arange(0, OG)  # [OG]
    seq = (pid % chunks) * CB + tl.arange(0, CB)  # [CB]
    o_ok = (o < O)[:, None, None]
    s_ok = (seq < B)[None, :, None]
    o64 = o.to(tl.int64)[:, None, None]
    w_mask = o_ok & inside[None, None, :]  # [OG, 1, P]
    wo = w + o64 * C * KH * KW * ohw + pos[None, None, :]  # [OG, 1, P] each channel's filters
    xs = x + seq.to(tl.int64)[None, :, None] * C * H * W  # [1, CB, 1] each sequence's input
    acc = tl.zeros([OG, CB, BH * BW], dtype=acc_t)
    if HAS_BIAS:
        acc += tl.load(bias + o64 * ohw + pos[None, None, :], mask=w_mask, other=0.0).to(acc_t)
    for c in range(C):
        for p in tl.static_range(KH):
            row = i * sh + p * dh - ph  # the unpadded input's row
            ok_row = inside
            if PAD:
                ok_row = ok_row & (row >= 0) & (row < H)
            for q in tl.static_range(KW):
                col = j * sw + q * dw - pw
                ok = ok_row
                if PAD:
                    ok = ok & (col >= 0) & (col < W)
                wv = tl.load(wo + ((c * KH + p) * KW + q) * ohw, mask=w_mask, other=0.0)
                xv = tl.load(xs + c * H * W + (row * W + col)[None, None, :], mask=s_ok & ok[None, None, :], other=0.0)
                acc += wv.to(acc_t) * xv.to(acc_t)
    out = y + (seq.to(tl.int64)[None, :, None] * O + o64) * ohw + pos[None, None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=o_ok & s_ok & inside[None, None, :])


@triton.jit
def _input_grad_kernel(dy, w, dx, C, Hp, Wp, O, OH, OW, sh, sw, dh, dw,
                       KH: tl.constexpr, KW: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    # one grid axis (CUDA's y and z stop at 65535): block of positions fastest, then channel, then sequence
    pid = tl.program_id(0).to(tl.int64)
    blocks = tl.cdiv(Hp * Wp, BLOCK)
    offs = (pid % blocks) * BLOCK + tl.arange(0, BLOCK)
    c = (pid // blocks) % C
    b = pid // blocks // C
    inside = offs < Hp * Wp
    h = offs // Wp
    col = offs % Wp
    acc = tl.zeros([BLOCK], dtype=acc_t)
    for o in range(O):
        for p in tl.static_range(KH):
            for q in tl.static_range(KW):
                hi = h - p * dh
                wi = col - q * dw
                ok = inside & (hi >= 0) & (wi >= 0)
                ok = ok & (hi % sh == 0) & (wi % sw == 0)
                i = hi // sh
                j = wi // sw
                ok = ok & (i < OH) & (j < OW)
                wv = tl.load(w + ((((o * C + c) * KH + p) * KW + q) * OH + i) * OW + j, mask=ok, other=0.0)
                gv = tl.load(dy + ((b * O + o) * OH + i) * OW + j, mask=ok, other=0.0)
                acc += wv.to(acc_t) * gv.to(acc_t)
    tl.store(dx + (b * C + c) * Hp * Wp + offs, acc.to(dx.dtype.element_ty), mask=inside)


@triton.jit
def _param_grad_kernel(dy, x, dwt, db, B, C, Hp, Wp, O, OH, OW, sh, sw, dh, dw,
                       KH: tl.constexpr, KW: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    # one grid axis (CUDA's y and z stop at 65535): block of positions fastest, then output channel,
    # then k: the filter pair (c, p, q), or C*KH*KW: the bias
    pid = tl.program_id(0).to(tl.int64)
    ohw = OH * OW
    blocks = tl.cdiv(ohw, BLOCK)
    offs = (pid % blocks) * BLOCK + tl.arange(0, BLOCK)
    o = (pid // blocks) % O
    k = pid // blocks // O
    inside = offs < ohw
    i = offs // OW
    j = offs % OW
    acc = tl.zeros([BLOCK], dtype=acc_t)
    if k == C * KH * KW:
        for b in range(B):
            acc += tl.load(dy + (b * O + o) * ohw + offs, mask=inside, other=0.0).to(acc_t)
        tl.store(db + o * ohw + offs, acc.to(db.dtype.element_ty), mask=inside)
    else:
        c = k // (KH * KW)
        p = (k // KW) % KH
        q = k % KW
        for b in range(B):
            gv = tl.load(dy + (b * O + o) * ohw + offs, mask=inside, other=0.0)
            xv = tl.load(x + ((b * C + c) * Hp + i * sh + p * dh) * Wp + j * sw + q * dw, mask=inside, other=0.0)
            acc += gv.to(acc_t) * xv.to(acc_t)
        tl.store(dwt + (o * C * KH * KW + k) * ohw + offs, acc.to(dwt.dtype.element_ty), mask=inside)


# the forward's block (bench_gpu_local.py --sweep measures others): CB sequences x BH x BW positions
# x OG output channels per program, num_warps; None: forward_config's
FORWARD_CONFIG: tuple[int, int, int, int, int] | None = None
BLOCK_ELEMENTS = 8192  # OG x CB x positions summed per program where the rows allow
_CONFIGS: dict[tuple[int, ...], tuple[int, int, int, int, int]] = {}
_MAX_CONFIGS = 256  # shapes remembered; the cache starts over past it


def forward_config(batch: int, out_ch: int, oh: int, ow: int, taps: int) -> tuple[int, int, int, int, int]:
    """(CB, BH, BW, OG, num_warps) of the forward for a kernel of ``taps`` = KH*KW taps: up to 16
    output channels, up to 16 sequences, rows of up to 64 columns (contiguous loads), and for
    kernels of more than one tap as many rows as BLOCK_ELEMENTS sums allow (at least one: the taps
    of neighbouring rows read the same input rows, from L1); 4 warps. On the H200 (bench_gpu_local.py
    --sweep, 2026-11-26) these were the fastest blocks measured at the four shapes of the benchmark,
    though the larger ones spill registers (gpu_static.py): 8 warps, which do not, took 94 against
    63 us at 32x4x256^2 3x3 -> 2."""
    if FORWARD_CONFIG is not None:
        return FORWARD_CONFIG
    key = (batch, out_ch, oh, ow, taps)
    config = _CONFIGS.get(key)
    if config is None:
        og = min(next_power_of_2(out_ch), 16)
        cb = min(next_power_of_2(batch), 16)
        bw = min(next_power_of_2(ow), 64)
        bh = min(next_power_of_2(oh), max(1, BLOCK_ELEMENTS // (og * cb * bw))) if taps > 1 else 1
        if len(_CONFIGS) >= _MAX_CONFIGS:
            _CONFIGS.clear()
        config = _CONFIGS.setdefault(key, (cb, bh, bw, og, 4))
    return config


def forward(x: Tensor, w: Tensor, bias: Tensor | None, stride: tuple[int, int], padding: tuple[int, int],
            dilation: tuple[int, int], out_dtype: torch.dtype) -> Tensor:
    """y [B, O, OH, OW] in ``out_dtype`` from the (unpadded) input x [B, C, H, W], zero padding
    ``padding``, and w (any floating dtypes, contiguous)."""
    batch, chans, height, width = x.shape
    out_ch, _, kh, kw, oh, ow = w.shape
    y = x.new_empty(batch, out_ch, oh, ow, dtype=out_dtype)
    cb, bh, bw, og, warps = forward_config(batch, out_ch, oh, ow, kh * kw)
    grid = (cdiv(batch, cb) * cdiv(oh, bh) * cdiv(ow, bw) * cdiv(out_ch, og),)
    launch(_forward_kernel, grid, (x, w, bias if bias is not None else w, y, batch, chans, height, width, out_ch, oh,
                                   ow, stride[0], stride[1], dilation[0], dilation[1], padding[0], padding[1]),
           {"KH": kh, "KW": kw, "PAD": bool(padding[0] or padding[1]), "HAS_BIAS": bias is not None,
            "F64": x.dtype == torch.float64, "CB": cb, "BH": bh, "BW": bw, "OG": og}, num_warps=warps)
    return y


def input_grad(dy: Tensor, w: Tensor, padded_shape: tuple[int, ...], stride: tuple[int, int],
               dilation: tuple[int, int], out_dtype: torch.dtype) -> Tensor:
    """d x_padded [B, C, Hp, Wp] in ``out_dtype``."""
    batch, chans, hp, wp = padded_shape
    out_ch, _, kh, kw, oh, ow = w.shape
    dx = dy.new_empty(batch, chans, hp, wp, dtype=out_dtype)
    grid = (cdiv(hp * wp, BLOCK) * chans * batch,)
    launch(_input_grad_kernel, grid, (dy, w, dx, chans, hp, wp, out_ch, oh, ow, stride[0], stride[1], dilation[0],
                                      dilation[1]), {"KH": kh, "KW": kw, "F64": dy.dtype == torch.float64, "BLOCK": BLOCK})
    return dx


def param_grads(dy: Tensor, x: Tensor, w_shape: tuple[int, ...], stride: tuple[int, int], dilation: tuple[int, int],
                out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(d w [O, C, KH, KW, OH, OW], d bias [O, OH, OW]) in ``out_dtype`` from dy and the padded x."""
    batch, chans, hp, wp = x.shape
    out_ch, _, kh, kw, oh, ow = w_shape
    dwt = dy.new_empty(w_shape, dtype=out_dtype)
    db = dy.new_empty(out_ch, oh, ow, dtype=out_dtype)
    grid = (cdiv(oh * ow, BLOCK) * out_ch * (chans * kh * kw + 1),)
    launch(_param_grad_kernel, grid, (dy, x, dwt, db, batch, chans, hp, wp, out_ch, oh, ow, stride[0], stride[1],
                                      dilation[0], dilation[1]),
           {"KH": kh, "KW": kw, "F64": dy.dtype == torch.float64, "BLOCK": BLOCK})
    return dwt, db
