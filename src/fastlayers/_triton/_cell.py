"""Step math shared by the recurrent Triton kernels (:mod:`.lstm`, :mod:`.gru`): activations,
row addressing in the engine's layouts, and LayerNorm over a row split into gate blocks.

Layouts (see :mod:`fastlayers.rnn._engine_gpu`): D directions, T steps, B batch, X features.

* time layout (T, B, D, X): the input projection, its gradient, the layer output;
* step layout (D, T, B, X): what one step of every direction writes, one (D, B, X) block per
  step; the recurrent input and every buffer the backward reads;
* state (D, B, X); original-order masks (D, T, B, X), indexed by time.

Step s of direction d runs time t = s (forward) or len_b - 1 - s (reverse) of sequence b, and only
while s < len_b; a row that is not active writes zeros at time s (a padding position of both
directions) and leaves its state as it is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sigmoid(v):
    return 1 / (1 + tl.exp(-v))


@triton.jit
def tanh(v):
    # 1 - 2 / (e^{2v} + 1): saturates to +-1 without inf / inf
    return 1 - 2 / (tl.exp(2 * v) + 1)


@triton.jit
def row_time(s, b, d, T, lengths, HAS_LENGTHS: tl.constexpr):
    """(active, t): whether step s of direction d runs for sequence b, and the time it reads
    (s for a row that is not active: its padding position)."""
    length = T
    if HAS_LENGTHS:
        length = tl.load(lengths + b)
    active = s < length
    t = tl.where(d == 0, s, length - 1 - s)
    return active, tl.where(active, t, s)


@triton.jit
def norm_stats(a0, a1, a2, a3, km, n, eps, BLOCKS: tl.constexpr):
    """Mean and 1/sqrt(var + eps) of the ``n`` valid entries of up to four blocks (lanes km)."""
    total = tl.sum(tl.where(km, a0, 0.0), axis=0)
    if BLOCKS > 1:
        total += tl.sum(tl.where(km, a1, 0.0), axis=0)
    if BLOCKS > 2:
        total += tl.sum(tl.where(km, a2, 0.0), axis=0)
    if BLOCKS > 3:
        total += tl.sum(tl.where(km, a3, 0.0), axis=0)
    mean = total / n
    e0 = tl.where(km, a0 - mean, 0.0)
    var = tl.sum(e0 * e0, axis=0)
    if BLOCKS > 1:
        e1 = tl.where(km, a1 - mean, 0.0)
        var += tl.sum(e1 * e1, axis=0)
    if BLOCKS > 2:
        e2 = tl.where(km, a2 - mean, 0.0)
        var += tl.sum(e2 * e2, axis=0)
    if BLOCKS > 3:
        e3 = tl.where(km, a3 - mean, 0.0)
        var += tl.sum(e3 * e3, axis=0)
    return mean, 1 / tl.sqrt(var / n + eps)


@triton.jit
def norm_backward_terms(g0, g1, g2, g3, x0, x1, x2, x3, km, n, BLOCKS: tl.constexpr):
    """mean(g) and mean(g * x-hat) over the valid entries of the blocks, for the LayerNorm
    backward dx = rstd * (g - mean(g) - x-hat * mean(g * x-hat)), g = upstream * gain."""
    s = tl.sum(tl.where(km, g0, 0.0), axis=0)
    p = tl.sum(tl.where(km, g0 * x0, 0.0), axis=0)
    if BLOCKS > 1:
        s += tl.sum(tl.where(km, g1, 0.0), axis=0)
        p += tl.sum(tl.where(km, g1 * x1, 0.0), axis=0)
    if BLOCKS > 2:
        s += tl.sum(tl.where(km, g2, 0.0), axis=0)
        p += tl.sum(tl.where(km, g2 * x2, 0.0), axis=0)
    if BLOCKS > 3:
        s += tl.sum(tl.where(km, g3, 0.0), axis=0)
        p += tl.sum(tl.where(km, g3 * x3, 0.0), axis=0)
    return s / n, p / n


@triton.jit
def store_blocks(ptr, H, k, km, v0, v1, v2, v3, BLOCKS: tl.constexpr):
    """Store the first BLOCKS (3 or 4) gate blocks of a row at ptr (block j at ptr + j * H)."""
    tl.store(ptr + k, v0, mask=km)
    tl.store(ptr + H + k, v1, mask=km)
    tl.store(ptr + 2 * H + k, v2, mask=km)
    if BLOCKS > 3:
        tl.store(ptr + 3 * H + k, v3, mask=km)


@triton.jit
def finish_h(s, T, B, D, P, b, d, t, active, k, km, h1, h, rmask, zh, zh_const, y, hd,
             ZH_MASK: tl.constexpr, RMASK: tl.constexpr, acc_t: tl.constexpr):
    """h = zh h0 + (1-zh) h1 for an active row (else h0 kept); y[t] = h (0 when not active);
    hd[:, s+1] = h * rmask."""
    state = d * B + b
    h0 = tl.load(h + state * P + k, mask=km, other=0.0).to(acc_t)
    kh = zh_const
    if ZH_MASK:
        kh = tl.load(zh + ((d * T + t) * B + b) * P + k, mask=km, other=0.0).to(acc_t)
    hn = tl.where(active, kh * h0 + (1 - kh) * h1, h0)
    tl.store(h + state * P + k, hn, mask=km)
    tl.store(y + ((t * B + b) * D + d) * P + k, tl.where(active, hn, 0.0), mask=km)
    if RMASK:
        hn = hn * tl.load(rmask + state * P + k, mask=km, other=0.0)
    tl.store(hd + ((d * T + s + 1) * B + b) * P + k, hn, mask=km & (s + 1 < T))


@triton.jit
def carried(dh, g, rmask, state, P, k, km, HAS_G: tl.constexpr, RMASK: tl.constexpr, acc_t: tl.constexpr):
    """The gradient of the state after this step: dh plus the recurrent GEMM's part of the step
    after it, g * rmask."""
    dhv = tl.load(dh + state * P + k, mask=km, other=0.0).to(acc_t)
    if HAS_G:
        gv = tl.load(g + state * P + k, mask=km, other=0.0).to(acc_t)
        if RMASK:
            gv = gv * tl.load(rmask + state * P + k, mask=km, other=0.0)
        dhv += gv
    return dhv


def present_or(t, fallback):
    """A pointer argument for an absent buffer (its flag keeps the kernel from touching it)."""
    return t if t is not None else fallback


def block(hidden: int) -> int:
    """Lanes per gate block: the hidden size rounded up to a power of two."""
    return triton.next_power_of_2(hidden)
