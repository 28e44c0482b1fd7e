"""Step math shared by the recurrent Triton kernels (:mod:`.lstm`, :mod:`.gru`): activations,
row addressing in the engine's layouts, and LayerNorm over a row split into gate blocks.

Layouts (see :mod:`fastlayers.rnn._gpu`): D directions, TC the buffers' time capacity (the
loop's length T or more: a captured loop's buffers are sized by the longest T it served), B
batch, X features.

* time layout (TC, B, D, X): the input projection, its gradient, the layer output;
* step layout (D, TC, B, X): what one step of every direction writes, one (D, B, X) block per
  step; the recurrent input and every buffer the backward reads;
* state (D, B, X); original-order masks (D, TC, B, X), indexed by time.

Varlen (the kernels' ``VARLEN``, issue 66): the value rows themselves, N = the sum of the lengths,
sequence b's time t at row starts[b] + t, TC the buffers' row capacity (N or more): time layout
(TC, D, X), step layout and masks (D, TC, X); no row for a padding position (:func:`locate`).

The step a launch runs is device data: s = clock[0] + j, with j an argument of the launch and
the int32 tensor ``clock`` = [first step, T] written by the driver (:mod:`fastlayers.rnn._gpu_graphs`),
so one captured chunk of launches replays for any step offset and any T. A launch whose s is
outside [0, T) does nothing (the last chunk of a loop whose T is not a multiple of the chunk).

Step s of direction d is at time t = s (forward) or T - 1 - s (reverse) of sequence b, and runs
it only where t < len_b: the forward direction runs its first len_b steps, the reverse one waits
out the padding (T - len_b steps) and then runs times len_b - 1 .. 0, exactly as on the packed
sequence. A row that is not active writes zeros at time t (a padding position) and leaves its state
as it is. So every address a step reads or writes is known without the lengths: they only decide
which rows run, and the load of len_b does not delay the step's other loads. The lengths are
always data (all T when the call has none): one kernel serves calls with and without them.
"""

from __future__ import annotations

import triton
import triton.language as tl
from . import next_power_of_2


@triton.jit
def sigmoid(v):
    return 1 / (1 + tl.exp(-v))


@triton.jit
def tanh(v):
    # 1 - 2 / (e^{2v} + 1): saturates to +-1 without inf / inf; near 0 that difference cancels (its
    # error is about one ulp of 1, huge against a small tanh), so there the odd Taylor series to v^11
    # (truncation below 2e-10 relative at |v| = 0.25; float64: used below 1e-3 only)
    v2 = v * v
    p = -1382.0 / 155925.0
    p = p * v2 + 62.0 / 2835.0
    p = p * v2 - 17.0 / 315.0
    p = p * v2 + 2.0 / 15.0
    p = p * v2 - 1.0 / 3.0
    if v.dtype == tl.float64:
        near = 1e-3
    else:
        near = 0.25
    return tl.where(tl.abs(v) < near, v + v * v2 * p, 1 - 2 / (tl.exp(2 * v) + 1))


@triton.jit
def step_of(clock, j):
    """(s, T): the step of this launch, clock[0] + j, and the loop's length clock[1]."""
    return tl.load(clock).to(tl.int64) + j, tl.load(clock + 1).to(tl.int64)


@triton.jit
def locate(s, T, TC, B, lengths, starts, VARLEN: tl.constexpr):
    """The row of this program (one per (direction d, sequence b)) at step s of a loop of T steps
    in buffers of time capacity TC: (d, b, active, t, step, state, trow, mrow, own): whether step s
    runs for it (t < len_b), its time t (a padding position where it does not run), its row in the
    step layout, in the state, in the time layout (``trow * D + d``) and in the original-order masks,
    and ``own``: whether the row's step-layout and time-layout positions are its own to write.

    Padded layout: step row (d * TC + s) * B + b, time row t * B + b, mask row (d * TC + t) * B + b;
    every row writes its positions (a row that does not run writes its padding position). Varlen
    layout (``VARLEN``: TC is the buffers' row capacity, ``starts`` (B,) the first value row of each
    sequence): the rows of sequence b are its own value rows, starts[b] + t, in every layout (step
    row d * TC + starts[b] + t); a row that does not run has no position: it reads its sequence's
    last one (in bounds) and writes nothing (``own`` false). Only ``active`` reads the lengths in
    the padded layout."""
    pid = tl.program_id(0).to(tl.int64)
    d, b = pid // B, pid % B
    t = tl.where(d == 0, s, T - 1 - s)
    n = tl.load(lengths + b)
    active = t < n
    step, trow, mrow = (d * TC + s) * B + b, t * B + b, (d * TC + t) * B + b
    own = t == t  # true (a comparison the compiler folds; an int1 constant is no mask to Triton 3.9's interpreter)
    if VARLEN:
        trow = tl.load(starts + b) + tl.minimum(t, n - 1)
        step = d * TC + trow
        mrow = step
        own = active
    return d, b, active, t, step, d * B + b, trow, mrow, own


@triton.jit
def lanes(km, cond):
    """The lanes km where the scalar ``cond`` holds (tl.where: Triton 3.9's interpreter makes
    ``lanes & scalar`` an int32 mask, which its stores refuse)."""
    return tl.where(cond, km, False)


@triton.jit
def neighbour(s, T, B, d, b, t, step, lengths, starts, LATER: tl.constexpr, VARLEN: tl.constexpr):
    """The step-layout row of the same row's step after this one (``LATER``: the next step of the
    loop) or before it, and whether it exists. Padded: step s + 1 (s - 1), one (D, B) block on, for
    s + 1 < T (s > 0). Varlen: the sequence's time t + 1 (t - 1) for the forward direction, t - 1
    (t + 1) for the reverse one, where that time is within its length."""
    if LATER:
        row, there = step + B, s + 1 < T
    else:
        row, there = step - B, s > 0
    if VARLEN:
        n = tl.load(lengths + b)
        if LATER:
            u = tl.where(d == 0, t + 1, t - 1)
        else:
            u = tl.where(d == 0, t - 1, t + 1)
        row = step - tl.minimum(t, n - 1) + u
        there = (u >= 0) & (u < n)
    return row, there


@triton.jit
def _blocks_sum(a0, a1, a2, a3, km, BLOCKS: tl.constexpr):
    """The valid lanes of the first BLOCKS blocks summed elementwise (one block: the reductions
    below then take one tl.sum per statistic instead of one per block)."""
    v = a0
    if BLOCKS > 1:
        v += a1
    if BLOCKS > 2:
        v += a2
    if BLOCKS > 3:
        v += a3
    return tl.where(km, v, 0.0)


@triton.jit
def norm_stats(a0, a1, a2, a3, km, n, eps, BLOCKS: tl.constexpr):
    """Mean and 1/sqrt(var + eps) of the ``n`` valid entries of up to four blocks (lanes km), the
    C engine's corrected two-pass statistics (fastmath.h, Chan, Golub and LeVeque 1983): the first
    reduction's mean m, then s1 = sum(a - m) and s2 = sum((a - m)^2): mean m + s1 / n, variance
    (s2 - s1^2 / n) / n. The correction makes a constant row's mean its value, so its LayerNorm is
    exactly 0 as torch's is (sum / n alone left a residue that the next LayerNorm, rstd 1 /
    sqrt(eps) on a near-constant row, multiplied by ~300: a cell row clipped whole)."""
    m = tl.sum(_blocks_sum(a0, a1, a2, a3, km, BLOCKS), axis=0) / n
    e0, e1, e2, e3 = a0 - m, a1 - m, a2 - m, a3 - m
    s1 = tl.sum(_blocks_sum(e0, e1, e2, e3, km, BLOCKS), axis=0)
    s2 = tl.sum(_blocks_sum(e0 * e0, e1 * e1, e2 * e2, e3 * e3, km, BLOCKS), axis=0)
    var = (s2 - s1 * s1 / n) / n
    var = tl.where(var < 0, 0.0, var)  # (rounding below 0: 0; the NaN of an overflowed sum stays NaN: maximum drops it)
    return m + s1 / n, 1 / tl.sqrt(var + eps)


@triton.jit
def norm_backward_terms(g0, g1, g2, g3, x0, x1, x2, x3, km, n, BLOCKS: tl.constexpr):
    """mean(g) and mean(g * x-hat) over the valid entries of the blocks, for the LayerNorm
    backward dx = rstd * (g - mean(g) - x-hat * mean(g * x-hat)), g = upstream * gain; one
    reduction each."""
    s = tl.sum(_blocks_sum(g0, g1, g2, g3, km, BLOCKS), axis=0)
    p = tl.sum(_blocks_sum(g0 * x0, g1 * x1, g2 * x2, g3 * x3, km, BLOCKS), axis=0)
    return s / n, p / n


@triton.jit
def load_blocks(ptr, H, k, mask, acc_t: tl.constexpr, BLOCKS: tl.constexpr):
    """The first BLOCKS (3 or 4) gate blocks of a row at ptr (block j at ptr + j * H) in acc_t; with
    three, the fourth value returned is the third again."""
    v0 = tl.load(ptr + k, mask=mask, other=0.0).to(acc_t)
    v1 = tl.load(ptr + H + k, mask=mask, other=0.0).to(acc_t)
    v2 = tl.load(ptr + 2 * H + k, mask=mask, other=0.0).to(acc_t)
    v3 = v2
    if BLOCKS > 3:
        v3 = tl.load(ptr + 3 * H + k, mask=mask, other=0.0).to(acc_t)
    return v0, v1, v2, v3


@triton.jit
def zero_unless(active, v0, v1, v2, v3):
    """The blocks of a row loaded at its (padding) position, zero where the row does not run: its
    loads wait for no lengths, and its values stay those of a masked load."""
    return tl.where(active, v0, 0.0), tl.where(active, v1, 0.0), tl.where(active, v2, 0.0), tl.where(active, v3, 0.0)


@triton.jit
def input_norm(x0, x1, x2, x3, gain, bias, xstat, step, own, H, k, km, eps, acc_t: tl.constexpr,
               HAS_BIAS: tl.constexpr, BLOCKS: tl.constexpr):
    """gain * x-hat (+ bias) over the gate blocks of the input projection, x-hat = (x - mean) * rstd
    over all of them; (mean, rstd) stored at xstat[step] where the row owns it (:func:`locate`)."""
    mx, sx = norm_stats(x0, x1, x2, x3, km, BLOCKS * H, eps, BLOCKS)
    tl.store(xstat + 2 * step, mx, mask=own)
    tl.store(xstat + 2 * step + 1, sx, mask=own)
    g0, g1, g2, g3 = load_blocks(gain, H, k, km, acc_t, BLOCKS)
    x0, x1, x2, x3 = g0 * ((x0 - mx) * sx), g1 * ((x1 - mx) * sx), g2 * ((x2 - mx) * sx), g3 * ((x3 - mx) * sx)
    if HAS_BIAS:
        b0, b1, b2, b3 = load_blocks(bias, H, k, km, acc_t, BLOCKS)
        x0, x1, x2, x3 = x0 + b0, x1 + b1, x2 + b2, x3 + b3
    return x0, x1, x2, x3


@triton.jit
def recurrent_norm(r0, r1, r2, r3, gain, rhat, rrstd, step, own, H, k, km, eps, acc_t: tl.constexpr,
                   BLOCKS: tl.constexpr):
    """gain * r-hat over the gate blocks of the recurrent product; r-hat and rstd stored at step
    where the row owns it."""
    mr, sr = norm_stats(r0, r1, r2, r3, km, BLOCKS * H, eps, BLOCKS)
    tl.store(rrstd + step, sr, mask=own)
    r0, r1, r2, r3 = (r0 - mr) * sr, (r1 - mr) * sr, (r2 - mr) * sr, (r3 - mr) * sr
    store_blocks(rhat + step * BLOCKS * H, H, k, lanes(km, own), r0, r1, r2, r3, BLOCKS)
    g0, g1, g2, g3 = load_blocks(gain, H, k, km, acc_t, BLOCKS)
    return r0 * g0, r1 * g1, r2 * g2, r3 * g3


@triton.jit
def norm_backward(e0, e1, e2, e3, gain, q0, q1, q2, q3, rstd, H, k, km, acc_t: tl.constexpr, BLOCKS: tl.constexpr):
    """Back through gain * v-hat, v-hat = q = (v - mean) * rstd over the blocks: the gradient of v
    from the gradient e of the output."""
    g0, g1, g2, g3 = load_blocks(gain, H, k, km, acc_t, BLOCKS)
    a0, a1, a2, a3 = e0 * g0, e1 * g1, e2 * g2, e3 * g3
    m1, m2 = norm_backward_terms(a0, a1, a2, a3, q0, q1, q2, q3, km, BLOCKS * H, BLOCKS)
    return (rstd * (a0 - m1 - q0 * m2), rstd * (a1 - m1 - q1 * m2), rstd * (a2 - m1 - q2 * m2),
            rstd * (a3 - m1 - q3 * m2))


@triton.jit
def store_blocks(ptr, H, k, km, v0, v1, v2, v3, BLOCKS: tl.constexpr):
    """Store the first BLOCKS (3 or 4) gate blocks of a row at ptr (block j at ptr + j * H)."""
    tl.store(ptr + k, v0, mask=km)
    tl.store(ptr + H + k, v1, mask=km)
    tl.store(ptr + 2 * H + k, v2, mask=km)
    if BLOCKS > 3:
        tl.store(ptr + 3 * H + k, v3, mask=km)


@triton.jit
def add_blocks(ptr, H, k, km, v0, v1, v2, v3, BLOCKS: tl.constexpr):
    """Add v0..v3 to the first BLOCKS (3 or 4) gate blocks of a row at ptr (block j at ptr + j * H),
    in place: a parameter gradient's per-row sum over the steps. One program owns the row and
    the steps run one launch after another, so the sum needs no atomics and is the same every run."""
    add_row(ptr, k, km, v0)
    add_row(ptr + H, k, km, v1)
    add_row(ptr + 2 * H, k, km, v2)
    if BLOCKS > 3:
        add_row(ptr + 3 * H, k, km, v3)


@triton.jit
def add_row(ptr, k, km, v):
    """ptr[k] += v over the lanes km (a one-block row, as :func:`add_blocks`)."""
    tl.store(ptr + k, tl.load(ptr + k, mask=km, other=0.0) + v, mask=km)


@triton.jit
def finish_h(s, T, B, D, P, b, d, t, active, k, km, h1, h, rmask, zh, zh_const, y, hd, step, trow, mrow, own,
             lengths, starts, ZH_MASK: tl.constexpr, RMASK: tl.constexpr, VARLEN: tl.constexpr, acc_t: tl.constexpr):
    """h = zh h0 + (1-zh) h1 for an active row (else h0 kept); y[t] = h (0 when not active);
    hd at the step after = h * rmask (varlen: only where the row runs and has a step after)."""
    state = d * B + b
    h0 = tl.load(h + state * P + k, mask=km, other=0.0).to(acc_t)
    kh = zh_const
    if ZH_MASK:
        kh = tl.load(zh + mrow * P + k, mask=km, other=0.0).to(acc_t)
    hn = kh * h0 + (1 - kh) * h1
    if not ZH_MASK:  # (no zoneout: h1 itself, as the C engine skips the blend; 0 * inf would be NaN)
        hn = tl.where(kh == 0, h1, hn)
    hn = tl.where(active, hn, h0)
    tl.store(h + state * P + k, hn, mask=km)
    tl.store(y + (trow * D + d) * P + k, tl.where(active, hn, 0.0), mask=lanes(km, own))
    if RMASK:
        hn = hn * tl.load(rmask + state * P + k, mask=km, other=0.0)
    nxt, there = neighbour(s, T, B, d, b, t, step, lengths, starts, True, VARLEN)
    tl.store(hd + nxt * P + k, hn, mask=lanes(lanes(km, there), own))


@triton.jit
def carried(dh, g, g_parts, rmask, state, P, k, km, G_PARTS: tl.constexpr, RMASK: tl.constexpr,
            acc_t: tl.constexpr):
    """The gradient of the state after this step: dh plus the recurrent GEMM's part of the step
    after it, g * rmask; g (G_PARTS, D, B, P) holds that product's partial sums over slices of its
    inner size (:mod:`.step_matmul`), ``g_parts`` apart, summed here in order (zeros before the
    loop's first step)."""
    dhv = tl.load(dh + state * P + k, mask=km, other=0.0).to(acc_t)
    gv = tl.load(g + state * P + k, mask=km, other=0.0).to(acc_t)
    for j in tl.static_range(1, G_PARTS):
        gv += tl.load(g + j * g_parts + state * P + k, mask=km, other=0.0).to(acc_t)
    if RMASK:
        gv = gv * tl.load(rmask + state * P + k, mask=km, other=0.0)
    return dhv + gv


def present_or(t, fallback):
    """A pointer argument for an absent buffer (its flag keeps the kernel from touching it)."""
    return t if t is not None else fallback


def block(hidden: int) -> int:
    """Lanes per gate block: the hidden size rounded up to a power of two."""
    return next_power_of_2(hidden)


def parts(g) -> int:
    """How many partial sums a recurrent-product buffer g (S, D, B, P) holds."""
    return g.size(0)


def parts_stride(g) -> int:
    """Elements between g's partial sums."""
    return g[0].numel()
