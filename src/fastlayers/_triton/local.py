"""Locally connected 2-D layer in Triton: forward, input gradient, weight and bias gradients.

Legend and layout as ``_native/local.c``: B batch, C in channels, O out channels, Hp x Wp padded
input, KH x KW kernel, OH x OW output, stride (sh, sw), dilation (dh, dw); x [B, C, Hp, Wp], w
[O, C, KH, KW, OH, OW], bias [O, OH, OW], y [B, O, OH, OW], all contiguous.

    y[b,o,i,j] = bias[o,i,j] + sum_{c,p,q} w[o,c,p,q,i,j] * x[b,c,i*sh+p*dh,j*sw+q*dw]

Every kernel takes a block of output (or input) positions and sums in float32 (float64 for
float64 tensors) whatever the storage dtype; each output element is written by one program, in a
fixed order (no atomics), so results do not depend on scheduling:

* forward: one program per (block of BLOCK / OB OH*OW positions, block of OB output channels
  (:func:`out_block`), batch chunk); the C*KH*KW (filter, input) pairs are summed for each sequence of the chunk, every
  input value loaded once for the channels of the block;
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

BLOCK = 256
BATCH_CHUNK = 8
# output channels per forward program (at most), for 1x1 kernels: the first H100 run (one channel
# per program) read x once per output channel, 2.17x the copy floor at 1024x4x256^2 1x1 -> 2;
# bench_gpu_local.py measures 1 against this (H100, 2026-11-24: 1.036 vs 1.051 ms forward there)
OUT_BLOCK = 4
# ... and for kernels of more than one tap, where the sums, not the input reads, bound the forward
# (H100, 2026-11-24, bench_gpu_local.py): 4 channels per program took 2.588 ms against one's 1.189
# at 64x16x64^2 3x3 -> 32, 2 took 0.586 against 0.532 at 32x4x256^2 3x3 -> 2
OUT_BLOCK_TAPS = 1


@triton.jit
def _forward_kernel(x, w, bias, y, B, C, Hp, Wp, O, OH, OW, sh, sw, dh, dw,
                    KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr, F64: tl.constexpr,
                    BLOCK: tl.constexpr, CHUNK: tl.constexpr, OB: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    # the input row is loaded as an [OB, BLOCK] tile with the same address in every row (one memory
    # transaction, cached): a [BLOCK] load broadcast over the rows compiled to a layout conversion
    # through shared memory with barriers (gpu_static.py, sm_90a)
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK))[None, :]
    o = (tl.program_id(1).to(tl.int64) * OB + tl.arange(0, OB))[:, None]  # OB channels: x read once for all
    ohw = OH * OW
    inside = offs < ohw
    tile = (o < O) & inside
    row0 = o * 0  # [OB, 1] zeros: x's addresses as an [OB, BLOCK] tile (the rows share them)
    i = offs // OW
    j = offs % OW
    base = tl.zeros([OB, BLOCK], dtype=acc_t)
    if HAS_BIAS:
        base += tl.load(bias + o * ohw + offs, mask=tile, other=0.0).to(acc_t)
    for n in range(CHUNK):
        b = tl.program_id(2).to(tl.int64) * CHUNK + n
        if b < B:
            acc = base
            for c in range(C):
                for p in tl.static_range(KH):
                    for q in tl.static_range(KW):
                        xv = tl.load(x + ((b * C + c) * Hp + i * sh + p * dh) * Wp + j * sw + q * dw + row0,
                                     mask=tile, other=0.0)
                        wv = tl.load(w + (((o * C + c) * KH + p) * KW + q) * ohw + offs, mask=tile, other=0.0)
                        acc += wv.to(acc_t) * xv.to(acc_t)
            tl.store(y + (b * O + o) * ohw + offs, acc.to(y.dtype.element_ty), mask=tile)


@triton.jit
def _input_grad_kernel(dy, w, dx, C, Hp, Wp, O, OH, OW, sh, sw, dh, dw,
                       KH: tl.constexpr, KW: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
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
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    o = tl.program_id(1).to(tl.int64)
    k = tl.program_id(2).to(tl.int64)  # filter pair (c, p, q), or C*KH*KW: the bias
    ohw = OH * OW
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


def forward(x: Tensor, w: Tensor, bias: Tensor | None, stride: tuple[int, int], dilation: tuple[int, int],
            out_dtype: torch.dtype) -> Tensor:
    """y [B, O, OH, OW] in ``out_dtype`` from the padded input x and w (any floating dtypes)."""
    batch, chans, hp, wp = x.shape
    out_ch, _, kh, kw, oh, ow = w.shape
    y = x.new_empty(batch, out_ch, oh, ow, dtype=out_dtype)
    ob = out_block(out_ch, kh * kw)
    block = BLOCK // ob  # a tile of BLOCK elements, as one channel per program had
    grid = (triton.cdiv(oh * ow, block), triton.cdiv(out_ch, ob), triton.cdiv(batch, BATCH_CHUNK))
    _forward_kernel[grid](x, w, bias if bias is not None else w, y, batch, chans, hp, wp, out_ch, oh, ow, stride[0],
                          stride[1], dilation[0], dilation[1], KH=kh, KW=kw, HAS_BIAS=bias is not None,
                          F64=x.dtype == torch.float64, BLOCK=block, CHUNK=BATCH_CHUNK, OB=ob)
    return y


def out_block(out_ch: int, taps: int) -> int:
    """Output channels per forward program for a kernel of ``taps`` = KH*KW taps: all of them up to
    OUT_BLOCK (1x1) or OUT_BLOCK_TAPS (larger kernels), rounded up to a power of two, so that each
    program reads its input positions once for every channel it writes instead of once per
    channel. 1 gives the one-channel-per-program kernel."""
    return min(triton.next_power_of_2(out_ch), OUT_BLOCK if taps == 1 else OUT_BLOCK_TAPS)


def input_grad(dy: Tensor, w: Tensor, padded_shape: tuple[int, ...], stride: tuple[int, int],
               dilation: tuple[int, int], out_dtype: torch.dtype) -> Tensor:
    """d x_padded [B, C, Hp, Wp] in ``out_dtype``."""
    batch, chans, hp, wp = padded_shape
    out_ch, _, kh, kw, oh, ow = w.shape
    dx = dy.new_empty(batch, chans, hp, wp, dtype=out_dtype)
    grid = (triton.cdiv(hp * wp, BLOCK), chans, batch)
    _input_grad_kernel[grid](dy, w, dx, chans, hp, wp, out_ch, oh, ow, stride[0], stride[1], dilation[0], dilation[1],
                             KH=kh, KW=kw, F64=dy.dtype == torch.float64, BLOCK=BLOCK)
    return dx


def param_grads(dy: Tensor, x: Tensor, w_shape: tuple[int, ...], stride: tuple[int, int], dilation: tuple[int, int],
                out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(d w [O, C, KH, KW, OH, OW], d bias [O, OH, OW]) in ``out_dtype`` from dy and the padded x."""
    batch, chans, hp, wp = x.shape
    out_ch, _, kh, kw, oh, ow = w_shape
    dwt = dy.new_empty(w_shape, dtype=out_dtype)
    db = dy.new_empty(out_ch, oh, ow, dtype=out_dtype)
    grid = (triton.cdiv(oh * ow, BLOCK), out_ch, chans * kh * kw + 1)
    _param_grad_kernel[grid](dy, x, dwt, db, batch, chans, hp, wp, out_ch, oh, ow, stride[0], stride[1], dilation[0],
                             dilation[1], KH=kh, KW=kw, F64=dy.dtype == torch.float64, BLOCK=BLOCK)
    return dwt, db
