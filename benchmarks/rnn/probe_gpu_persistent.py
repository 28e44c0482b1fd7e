"""Issue 67, deliverable 1, a probe before the engine changes: what a grid barrier costs on this GPU
in Triton, and how many microseconds a step of a persistent LSTM forward takes, whose programs
keep their slice of W_hh across all steps and meet at one grid barrier per step (instead of the
engine's two launches per step, a recurrent-product kernel and a step kernel).

Barrier: N programs (one per SM at most, so all are resident) each add 1 to a counter (release,
GPU scope) after a CTA barrier, then poll it (acquire) until it reaches (s + 1) * N; the time of
STEPS barriers over STEPS. A poll that runs past LIMIT iterations gives up and sets a flag (never a
hang; the flag fails the script).

Persistent forward (plain LSTM, no options, both directions, no lengths): program (d, p) owns
U = H / P hidden units of direction d, i.e. the 4 U gate columns of W_hh[d]; per step it reads the
whole previous h of its direction (B x H, bypassing L1), multiplies it by its (H x 4U) slice (IEEE
float32; one row with TF32, to see what the FMA product costs), adds the input projection (one cuBLAS GEMM before the loop), runs the cell on
its (B x U) state held in registers, writes h, loads the next step's input projection, and meets the
other P - 1 programs of its direction at the barrier. "coop": launched with Triton's
launch_cooperative_grid (co-residency guaranteed by the driver). Checked against torch.nn.LSTM (cuDNN, TF32 off) with the same weights, timed
beside its forward.

Row-wise persistent forward (issue 67, deliverable 2, small hidden sizes; the same LSTM): one
program per direction and sequence runs all T steps with no barrier at all, since the rows of a
batch never meet; the product h (H,) x W_hh's four (H x H) gate blocks as broadcast-multiply-sums
in registers (W_hh held across steps or reloaded from L1 each step; for H > 64 in k chunks of 16,
h passed through a scratch row), the cell in registers. What it is for: cuDNN's persistent kernels
take 1.1-1.6 us per step forward at H <= 64 where the engine's two launches per step take 5-6 us;
this says whether a kernel of ours reaches them before the engine gets one (forward and backward).
Each shape twice: torch.nn.LSTM's plain cell, then fastlayers' LayerNorm cell (the bar's layer,
checked against fastlayers.LSTM(layer_norm=True) with its LayerNorm parameters moved off 1 / 0, and
timed against cuDNN's plain forward, the engine's own time beside it). Compiled for sm_90a without a
GPU (2026-11-27, Triton 3.6, 4 warps), registers: plain H = 32 64-78, H = 64 224-255, H = 128 in
chunks of 16 134, no spill (whole, H = 128 spills 11 KB); LayerNorm H = 32 103-128, H = 64 in chunks
of 16 or 32 168, H = 128 in chunks of 16 239, no spill (whole, H = 64 spills 360-428 bytes).
Then fwd+bwd of the plain cell the same way: the forward saving the gates' activations and c, a
backward kernel per direction and sequence (last step first, the state gradient carried back
through W_hh as broadcast-multiply-sums, in j chunks past H = 64), writing the gates'
pre-activation gradients, and the weights', the bias' and the input's gradients as GEMMs after
(as the engine); checked against cuDNN's autograd (output, input and every weight gradient),
timed against cuDNN's fwd+bwd. Registers (sm_90a, 4 warps): backward 56-72 whole at H = 32 and in
chunks of 16 up to H = 128 (64 there), the saving forward 54-128 in chunks; no spill.

    python benchmarks/rnn/probe_gpu_persistent.py [--device cuda]
    TRITON_INTERPRET=1 python benchmarks/rnn/probe_gpu_persistent.py --device cpu   # P = 1: math only
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

import fastlayers

from fastlayers._triton._cell import sigmoid, tanh  # the step kernels' own
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing.py
from timing import Timer  # noqa: E402  (CUDA events on the GPU, perf_counter elsewhere)

LIMIT = 1 << 22  # polls before a barrier gives up


@triton.jit
def _grid_barrier(counter, target, flag, LIMIT: tl.constexpr):
    tl.debug_barrier()  # every thread's stores of this step are issued before the release
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    cur = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    n = 0
    while (cur < target) & (n < LIMIT):
        cur = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
        n += 1
    if n >= LIMIT:
        tl.atomic_max(flag, 1)
    tl.debug_barrier()


@triton.jit
def _barrier_kernel(counter, flag, steps, LIMIT: tl.constexpr):
    n = tl.num_programs(0)
    for s in range(steps):
        _grid_barrier(counter, (s + 1) * n, flag, LIMIT)


@triton.jit
def _persistent_lstm_forward(xp, w, hbuf, y, counter, flag, T, B, H, P,
                             LIMIT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, U: tl.constexpr,
                             BK: tl.constexpr, PRECISION: tl.constexpr):
    # xp (T, B, D, 4H) input projection with both biases; w (D, 4H, H) W_hh; hbuf (D, 2, B, H) zeros;
    # y (T, B, D * H); counter (D,) int32 zeros; program (d, p) owns units [p U, p U + U); the product
    # runs over K in chunks of BK (the slice of W_hh is re-read each step: 16 U KiB, from L1 / L2)
    pid = tl.program_id(0)
    d = pid // P
    p = pid % P
    G = 4 * H
    rb = tl.arange(0, BLOCK_B)
    bm = rb < B
    rkc = tl.arange(0, BK)
    # column n = u * 4 + g of the slice is row g H + p U + u of W_hh[d]
    rn = tl.arange(0, 4 * U)
    rows = (rn % 4) * H + p * U + rn // 4
    wbase = w + d * G * H + rows[None, :] * H
    ru = p * U + tl.arange(0, U)
    c = tl.zeros([BLOCK_B, U], dtype=tl.float32)
    t = tl.where(d == 0, 0, T - 1)
    x = tl.load(xp + ((t * B + rb[:, None]) * 2 + d) * G + rows[None, :], mask=bm[:, None], other=0.0)
    for s in range(T):
        t = tl.where(d == 0, s, T - 1 - s)
        hrow = hbuf + ((d * 2 + s % 2) * B + rb[:, None]) * H
        acc = x
        for k0 in range(0, BLOCK_H, BK):
            km = k0 + rkc < H
            hk = tl.load(hrow + k0 + rkc[None, :], mask=bm[:, None] & km[None, :], other=0.0, cache_modifier=".cg")
            wk = tl.load(wbase + k0 + rkc[:, None], mask=km[:, None], other=0.0)
            acc = tl.dot(hk, wk, acc, input_precision=PRECISION)  # (B, 4U), columns u * 4 + g
        a = tl.reshape(acc, (BLOCK_B, U, 2, 2))
        a_even, a_odd = tl.split(a)  # g = 0, 2 and g = 1, 3
        ai, ag = tl.split(a_even)
        af, ao = tl.split(a_odd)
        c = sigmoid(af) * c + sigmoid(ai) * tanh(ag)
        h = sigmoid(ao) * tanh(c)
        tl.store(hbuf + ((d * 2 + (s + 1) % 2) * B + rb[:, None]) * H + ru[None, :], h, mask=bm[:, None])
        tl.store(y + (t * B + rb[:, None]) * (2 * H) + d * H + ru[None, :], h, mask=bm[:, None])
        tn = tl.where(d == 0, s + 1, T - 2 - s)  # the next step's input projection, before the wait
        x = tl.load(xp + ((tn * B + rb[:, None]) * 2 + d) * G + rows[None, :], mask=bm[:, None] & (s + 1 < T),
                    other=0.0)
        _grid_barrier(counter + d, (s + 1) * P, flag, LIMIT)


@triton.jit
def _ln4(a, b, c, d, gain, j, jm, H, eps):
    """LayerNorm over the 4H values a | b | c | d of one row (each (BLOCK_H,), zero past H), times the
    gain's four blocks (gain: a pointer to 4H floats), the biased variance, as the engine."""
    mean = (tl.sum(a, 0) + tl.sum(b, 0) + tl.sum(c, 0) + tl.sum(d, 0)) / (4 * H)
    a, b = tl.where(jm, a - mean, 0.0), tl.where(jm, b - mean, 0.0)
    c, d = tl.where(jm, c - mean, 0.0), tl.where(jm, d - mean, 0.0)
    r = 1 / tl.sqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0) + tl.sum(c * c, 0) + tl.sum(d * d, 0)) / (4 * H) + eps)
    return (a * r * tl.load(gain + j, mask=jm, other=0.0), b * r * tl.load(gain + H + j, mask=jm, other=0.0),
            c * r * tl.load(gain + 2 * H + j, mask=jm, other=0.0), d * r * tl.load(gain + 3 * H + j, mask=jm, other=0.0))


@triton.jit
def _rowwise_lstm_forward(xp, w, hs, y, bias, gx, gh, gc, bc, acts, cs, T, B, H, eps, BLOCK_H: tl.constexpr,
                          BK: tl.constexpr, HOLD_W: tl.constexpr, LN: tl.constexpr, SAVE: tl.constexpr):
    # one program per (direction, sequence), all T steps, no barrier between programs (the rows of
    # a batch never meet): xp (T, B, D, 4H) input projection with both biases; w (D, 4H, H) W_hh;
    # y (T, B, D * H); hs (D * B, BLOCK_H) scratch. The recurrent product of one row, h (H,) times
    # W_hh's four (H x H) gate blocks, as broadcast-multiply-sums in registers (no tl.dot: its
    # operands would be staged through shared memory every step). BK == BLOCK_H: the whole product
    # at once, with HOLD_W the blocks loaded once before the loop (registers), else every step
    # (from L1 / L2); BK < BLOCK_H: over k in chunks of BK, h written to the row's scratch and read
    # back a chunk at a time (registers for BK x H per gate instead of H x H). LN: fastlayers'
    # LayerNorm LSTM (xp without the biases): LN(W_ih x) gx + LN(W_hh h) gh + b, and h = o tanh(LN(c) gc + bc).
    # SAVE (plain cell): the gates' activations (T, B, D, 4H) and c (T, B, D, H) for the backward
    pid = tl.program_id(0)
    d = pid // B
    b = pid % B
    G = 4 * H
    j = tl.arange(0, BLOCK_H)  # the product's output unit
    jm = j < H
    h = tl.zeros([BLOCK_H], dtype=tl.float32)
    c = tl.zeros([BLOCK_H], dtype=tl.float32)
    if BK == BLOCK_H:
        k = tl.arange(0, BLOCK_H)  # its reduction index (h's unit)
        wm = (k < H)[:, None] & jm[None, :]
        wd = w + d * G * H + j[None, :] * H + k[:, None]  # [k, j] of gate block 0: W_hh[d, j, k]
        wi = tl.load(wd, mask=wm, other=0.0)
        wf = tl.load(wd + H * H, mask=wm, other=0.0)
        wg = tl.load(wd + 2 * H * H, mask=wm, other=0.0)
        wo = tl.load(wd + 3 * H * H, mask=wm, other=0.0)
    for s in range(T):
        t = tl.where(d == 0, s, T - 1 - s)
        row = xp + ((t * B + b) * 2 + d) * G + j
        xi = tl.load(row, mask=jm, other=0.0)
        xf = tl.load(row + H, mask=jm, other=0.0)
        xg = tl.load(row + 2 * H, mask=jm, other=0.0)
        xo = tl.load(row + 3 * H, mask=jm, other=0.0)
        if LN:  # the recurrent product gets its own LayerNorm: accumulate it apart
            ai = tl.zeros([BLOCK_H], dtype=tl.float32)
            af = tl.zeros([BLOCK_H], dtype=tl.float32)
            ag = tl.zeros([BLOCK_H], dtype=tl.float32)
            ao = tl.zeros([BLOCK_H], dtype=tl.float32)
        else:
            ai, af, ag, ao = xi, xf, xg, xo
        if BK == BLOCK_H:
            if not HOLD_W:
                wi = tl.load(wd, mask=wm, other=0.0)
                wf = tl.load(wd + H * H, mask=wm, other=0.0)
                wg = tl.load(wd + 2 * H * H, mask=wm, other=0.0)
                wo = tl.load(wd + 3 * H * H, mask=wm, other=0.0)
            hk = h[:, None]  # the previous h indexed by k (the compiler moves it between the layouts)
            ai += tl.sum(hk * wi, axis=0)
            af += tl.sum(hk * wf, axis=0)
            ag += tl.sum(hk * wg, axis=0)
            ao += tl.sum(hk * wo, axis=0)
        else:
            tl.store(hs + pid * BLOCK_H + j, h)
            tl.debug_barrier()  # the row's h stored by every thread before any reads it back
            for k0 in range(0, BLOCK_H, BK):
                k = k0 + tl.arange(0, BK)
                wm = (k < H)[:, None] & jm[None, :]
                wd = w + d * G * H + j[None, :] * H + k[:, None]
                hk = tl.load(hs + pid * BLOCK_H + k)[:, None]
                ai += tl.sum(hk * tl.load(wd, mask=wm, other=0.0), axis=0)
                af += tl.sum(hk * tl.load(wd + H * H, mask=wm, other=0.0), axis=0)
                ag += tl.sum(hk * tl.load(wd + 2 * H * H, mask=wm, other=0.0), axis=0)
                ao += tl.sum(hk * tl.load(wd + 3 * H * H, mask=wm, other=0.0), axis=0)
            tl.debug_barrier()  # every read of this step's h done before the next step overwrites it
        if LN:
            xi, xf, xg, xo = _ln4(xi, xf, xg, xo, gx + d * G, j, jm, H, eps)
            ai, af, ag, ao = _ln4(ai, af, ag, ao, gh + d * G, j, jm, H, eps)
            bd = bias + d * G + j
            ai += xi + tl.load(bd, mask=jm, other=0.0)
            af += xf + tl.load(bd + H, mask=jm, other=0.0)
            ag += xg + tl.load(bd + 2 * H, mask=jm, other=0.0)
            ao += xo + tl.load(bd + 3 * H, mask=jm, other=0.0)
        gi, gf, gg, go = sigmoid(ai), sigmoid(af), tanh(ag), sigmoid(ao)
        c = tl.where(jm, gf * c + gi * gg, 0.0)
        if SAVE:
            at = acts + ((t * B + b) * 2 + d) * G + j
            tl.store(at, gi, mask=jm)
            tl.store(at + H, gf, mask=jm)
            tl.store(at + 2 * H, gg, mask=jm)
            tl.store(at + 3 * H, go, mask=jm)
            tl.store(cs + ((t * B + b) * 2 + d) * H + j, c, mask=jm)
        n = c
        if LN:
            mc = tl.sum(c, 0) / H
            dc = tl.where(jm, c - mc, 0.0)
            n = dc / tl.sqrt(tl.sum(dc * dc, 0) / H + eps) * tl.load(gc + d * H + j, mask=jm, other=0.0) + \
                tl.load(bc + d * H + j, mask=jm, other=0.0)
        h = tl.where(jm, go * tanh(n), 0.0)
        tl.store(y + (t * B + b) * (2 * H) + d * H + j, h, mask=jm)


@triton.jit
def _rowwise_lstm_backward(dy, w, acts, cs, dpre, hs, T, B, H, BLOCK_H: tl.constexpr, BK: tl.constexpr):
    # the plain cell's backward through time for one (direction, sequence) per program, last step
    # first: dy (T, B, D * H) the output's gradient; acts / cs the forward's saved gates and c;
    # writes dpre (T, B, D, 4H), the gates' pre-activation gradients (the weights', the bias' and the
    # input's gradients are GEMMs over it afterwards, as the engine's); the state gradient carried
    # back through W_hh as broadcast-multiply-sums (dh[k] = sum_j dpre[j] W_hh[j, k]), in j chunks of
    # BK through hs (D * B, 4 * BLOCK_H) when BK < BLOCK_H
    pid = tl.program_id(0)
    d = pid // B
    b = pid % B
    G = 4 * H
    j = tl.arange(0, BLOCK_H)
    jm = j < H
    dh_c = tl.zeros([BLOCK_H], dtype=tl.float32)
    dc_c = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in range(T):
        r = T - 1 - s  # the direction's own step, last first
        t = tl.where(d == 0, r, T - 1 - r)
        tp = tl.where(d == 0, r - 1, T - r)  # the time of the step before it
        row = (t * B + b) * 2 + d
        at = acts + row * G + j
        gi = tl.load(at, mask=jm, other=0.0)
        gf = tl.load(at + H, mask=jm, other=0.0)
        gg = tl.load(at + 2 * H, mask=jm, other=0.0)
        go = tl.load(at + 3 * H, mask=jm, other=0.0)
        ct = tl.load(cs + row * H + j, mask=jm, other=0.0)
        cp = tl.load(cs + ((tp * B + b) * 2 + d) * H + j, mask=jm & (r > 0), other=0.0)
        dh = tl.load(dy + (t * B + b) * (2 * H) + d * H + j, mask=jm, other=0.0) + dh_c
        tc = tanh(ct)
        dc = dc_c + dh * go * (1 - tc * tc)
        pi = tl.where(jm, dc * gg * gi * (1 - gi), 0.0)
        pf = tl.where(jm, dc * cp * gf * (1 - gf), 0.0)
        pg = tl.where(jm, dc * gi * (1 - gg * gg), 0.0)
        po = tl.where(jm, dh * tc * go * (1 - go), 0.0)
        dc_c = dc * gf
        out = dpre + row * G + j
        tl.store(out, pi, mask=jm)
        tl.store(out + H, pf, mask=jm)
        tl.store(out + 2 * H, pg, mask=jm)
        tl.store(out + 3 * H, po, mask=jm)
        k = tl.arange(0, BLOCK_H)
        km = k < H
        if BK == BLOCK_H:
            wm = jm[:, None] & km[None, :]
            wd = w + d * G * H + j[:, None] * H + k[None, :]  # [j, k] of gate block 0: W_hh[d, j, k]
            dh_c = tl.sum(pi[:, None] * tl.load(wd, mask=wm, other=0.0), axis=0) + \
                tl.sum(pf[:, None] * tl.load(wd + H * H, mask=wm, other=0.0), axis=0) + \
                tl.sum(pg[:, None] * tl.load(wd + 2 * H * H, mask=wm, other=0.0), axis=0) + \
                tl.sum(po[:, None] * tl.load(wd + 3 * H * H, mask=wm, other=0.0), axis=0)
        else:
            sp = hs + pid * 4 * BLOCK_H + j
            tl.store(sp, pi)
            tl.store(sp + BLOCK_H, pf)
            tl.store(sp + 2 * BLOCK_H, pg)
            tl.store(sp + 3 * BLOCK_H, po)
            tl.debug_barrier()  # the row's dpre stored by every thread before any reads it back
            dh_c = tl.zeros([BLOCK_H], dtype=tl.float32)
            for j0 in range(0, BLOCK_H, BK):
                jj = j0 + tl.arange(0, BK)
                wm = (jj < H)[:, None] & km[None, :]
                wd = w + d * G * H + jj[:, None] * H + k[None, :]
                sq = hs + pid * 4 * BLOCK_H + jj
                dh_c += tl.sum(tl.load(sq)[:, None] * tl.load(wd, mask=wm, other=0.0), axis=0)
                dh_c += tl.sum(tl.load(sq + BLOCK_H)[:, None] * tl.load(wd + H * H, mask=wm, other=0.0), axis=0)
                dh_c += tl.sum(tl.load(sq + 2 * BLOCK_H)[:, None] * tl.load(wd + 2 * H * H, mask=wm, other=0.0), axis=0)
                dh_c += tl.sum(tl.load(sq + 3 * BLOCK_H)[:, None] * tl.load(wd + 3 * H * H, mask=wm, other=0.0), axis=0)
            tl.debug_barrier()  # every read of this step's dpre done before the next step overwrites it


def rowwise_train(x, lstm, dy, warps, bk=None):
    """torch.nn.LSTM(bidirectional=True, bias=True) forward and backward from zero states with
    :func:`_rowwise_lstm_forward` (saving) and :func:`_rowwise_lstm_backward`, the rest as GEMMs:
    returns (y, dx, [dW_ih, dW_hh, db] per direction) for the output gradient dy."""
    steps, batch, _ = x.shape
    hidden = lstm.hidden_size
    block = triton.next_power_of_2(hidden)

    def both(name):
        return torch.stack([getattr(lstm, f"{name}_l0"), getattr(lstm, f"{name}_l0_reverse")]).contiguous()

    w_ih, w_hh, bias = both("weight_ih"), both("weight_hh"), both("bias_ih") + both("bias_hh")
    xp = (torch.einsum("tbf,dgf->tbdg", x, w_ih) + bias).contiguous()
    y = x.new_empty(steps, batch, 2 * hidden)
    hs = x.new_empty(2 * batch, 4 * block)
    acts = x.new_empty(steps, batch, 2, 4 * hidden)
    cs = x.new_empty(steps, batch, 2, hidden)
    _rowwise_lstm_forward[(2 * batch,)](xp, w_hh, hs, y, bias, bias, bias, bias, bias, acts, cs, steps, batch, hidden,
                                        1e-5, BLOCK_H=block, BK=bk or block, HOLD_W=False, LN=False, SAVE=True,
                                        num_warps=warps)
    dpre = torch.empty_like(acts)
    _rowwise_lstm_backward[(2 * batch,)](dy.contiguous(), w_hh, acts, cs, dpre, hs, steps, batch, hidden,
                                         BLOCK_H=block, BK=bk or block, num_warps=warps)
    dx = torch.einsum("tbdg,dgf->tbf", dpre, w_ih)
    zero = y.new_zeros(1, batch, hidden)
    hprev = [torch.cat([zero, y[:-1, :, :hidden]]), torch.cat([y[1:, :, hidden:], zero])]  # each direction's h before
    grads = [[torch.einsum("tbg,tbf->gf", dpre[:, :, di], x), torch.einsum("tbg,tbk->gk", dpre[:, :, di], hprev[di]),
              dpre[:, :, di].sum((0, 1))] for di in range(2)]
    return y, dx, grads


def rowwise_forward(x, lstm, warps, hold, bk=None):
    """A bidirectional LSTM's forward from zero states by :func:`_rowwise_lstm_forward` (``bk``: the
    product's k chunk, default all of H), output y only: torch.nn.LSTM (bias=True), or
    fastlayers.LSTM(layer_norm=True) (its LayerNorm parameters read when it has them)."""
    steps, batch, _ = x.shape
    hidden = lstm.hidden_size
    block = triton.next_power_of_2(hidden)
    ln = hasattr(lstm, "ln_ih_weight_l0")

    def both(name):
        return torch.stack([getattr(lstm, f"{name}_l0"), getattr(lstm, f"{name}_l0_reverse")]).contiguous()

    bias = both("bias_ih") + both("bias_hh")
    xp = torch.einsum("tbf,dgf->tbdg", x, both("weight_ih"))
    xp = (xp if ln else xp + bias).contiguous()
    y = x.new_empty(steps, batch, 2 * hidden)
    hs = x.new_empty(2 * batch, block)
    gains = [both(n) for n in ("ln_ih_weight", "ln_hh_weight", "ln_cell_weight", "ln_cell_bias")] if ln else [bias] * 4
    _rowwise_lstm_forward[(2 * batch,)](xp, both("weight_hh"), hs, y, bias, *gains, y, y, steps, batch, hidden, 1e-5,
                                        BLOCK_H=block, BK=bk or block, HOLD_W=hold, LN=ln, SAVE=False, num_warps=warps)
    return y


def persistent_forward(x, lstm, units, warps, cooperative=False, precision="ieee"):
    """torch.nn.LSTM(bidirectional=True, bias=True) forward from zero states, output y only."""
    steps, batch, _ = x.shape
    hidden = lstm.hidden_size
    w_ih = torch.stack([lstm.weight_ih_l0, lstm.weight_ih_l0_reverse])  # (D, G, F)
    bias = torch.stack([lstm.bias_ih_l0 + lstm.bias_hh_l0, lstm.bias_ih_l0_reverse + lstm.bias_hh_l0_reverse])
    w_hh = torch.stack([lstm.weight_hh_l0, lstm.weight_hh_l0_reverse]).contiguous()
    xp = (torch.einsum("tbf,dgf->tbdg", x, w_ih) + bias).contiguous()
    hbuf = x.new_zeros(2, 2, batch, hidden)
    y = x.new_empty(steps, batch, 2 * hidden)
    counter = torch.zeros(2, dtype=torch.int32, device=x.device)
    flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    programs = hidden // units
    _persistent_lstm_forward[(2 * programs,)](xp, w_hh, hbuf, y, counter, flag, steps, batch, hidden, programs,
                                             LIMIT=LIMIT, BLOCK_B=max(16, triton.next_power_of_2(batch)),
                                             BLOCK_H=max(16, triton.next_power_of_2(hidden)), U=units,
                                             BK=min(32, max(16, triton.next_power_of_2(hidden))), PRECISION=precision, num_warps=warps,
                                             **({"launch_cooperative_grid": True} if cooperative else {}))
    return y, flag


def timed(device, fn, repeats=20, warmup=3):
    """Median ms of ``repeats`` calls after ``warmup``."""
    timer = Timer(device)
    for _ in range(warmup):
        fn()
    return statistics.median(timer(fn) for _ in range(repeats))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="the seed shape's first configuration only (for ncu)")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gpu = device.type == "cuda"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if gpu else 1
    bad = 0
    print(f"# {torch.cuda.get_device_name(device) if gpu else 'CPU (interpreter: times mean nothing)'}; "
          f"torch {torch.__version__}; triton {triton.__version__}; {sms} SMs")
    print("| grid barrier: programs | warps | us per barrier |\n|---:|---:|---:|")
    for n in ((2, 16, 64, 128, sms) if gpu and not args.quick else (1,)):
        for warps in (4, 8):
            steps = 2000 if gpu else 3
            counter = torch.zeros(1, dtype=torch.int32, device=device)
            flag = torch.zeros(1, dtype=torch.int32, device=device)

            def run():
                counter.zero_()
                _barrier_kernel[(n,)](counter, flag, steps, LIMIT=LIMIT, num_warps=warps)
            ms = timed(device, run, repeats=5)
            bad += int(flag.item() != 0)
            print(f"| {n} | {warps} | {ms * 1e3 / steps:.2f} |", flush=True)
    shapes = [(800, 32, 512, 256), (800, 8, 128, 128), (800, 32, 64, 64)] if gpu else [(5, 3, 4, 16)]
    shapes = shapes[:1] if args.quick else shapes
    print("\n| persistent LSTM fwd: T, B, F, H | units / program | programs | warps | max abs diff vs cuDNN | "
          "ours ms | cuDNN fwd ms | ours us/step | ratio |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for steps, batch, features, hidden in shapes:
        torch.manual_seed(0)
        lstm = torch.nn.LSTM(features, hidden, bidirectional=True, device=device)
        x = torch.randn(steps, batch, features, device=device)
        with torch.no_grad():
            want = lstm(x)[0]
            base = timed(device, lambda: lstm(x))
            for units, warps, coop, prec in (((4, 4, False, "ieee"), (4, 8, False, "ieee"), (8, 8, False, "ieee"),
                                              (4, 4, True, "ieee"), (4, 4, False, "tf32")) if gpu
                                             else ((16, 4, False, "ieee"),))[:1 if args.quick else None]:
                if hidden // units * 2 > sms and gpu:
                    continue
                try:
                    got, flag = persistent_forward(x, lstm, units, warps, coop, prec)
                except Exception as e:  # (the cooperative launch option, where this Triton lacks it)
                    print(f"| {steps}, {batch}, {features}, {hidden} | {units} | cooperative launch failed: "
                          f"{type(e).__name__}: {str(e)[:200]} |")
                    continue
                err = (got - want).abs().max().item()
                ok = flag.item() == 0 and err < (1e-4 if prec == "ieee" else 1e-2)
                bad += not ok
                ms = timed(device, lambda: persistent_forward(x, lstm, units, warps, coop, prec))
                print(f"| {steps}, {batch}, {features}, {hidden} | {units}{' coop' if coop else ''}"
                      f"{' tf32' if prec == 'tf32' else ''} | "
                      f"{2 * hidden // units} | {warps} | "
                      f"{err:.1e}{'' if ok else ' FAIL'} | {ms:.2f} | {base:.2f} | {ms * 1e3 / steps:.2f} | "
                      f"{ms / base:.2f} |", flush=True)
    reps = (20, 3) if gpu else (1, 0)  # the row-wise rows' timed calls and warm-ups (the interpreter: math only)
    rowwise = [(800, 8, 32, 32), (800, 32, 32, 32), (800, 128, 32, 32), (800, 8, 64, 64), (800, 32, 64, 64),
               (800, 128, 64, 64), (800, 8, 128, 128), (800, 32, 128, 128)] if gpu else [(4, 2, 3, 12)]
    print("\n| row-wise persistent LSTM fwd (one program per direction and sequence): T, B, F, H | W_hh | warps | "
          "max abs diff vs the layer | ours ms | cuDNN fwd ms | ours us/step | ratio to cuDNN |\n|---|---|---:|---:|---:|---:|---:|---:|")
    for (steps, batch, features, hidden), ln in itertools.product(rowwise[:1] if args.quick else rowwise, (False, True)):
        torch.manual_seed(0)
        cudnn = torch.nn.LSTM(features, hidden, bidirectional=True, device=device)
        lstm = cudnn
        x = torch.randn(steps, batch, features, device=device)
        with torch.no_grad():
            base = timed(device, lambda: cudnn(x))
            if ln:  # as constructed, its LayerNorm gains are 1 and biases 0: moved off them for the check
                lstm = fastlayers.LSTM(features, hidden, bidirectional=True, layer_norm=True, device=device)
                for name, p in lstm.named_parameters():
                    if name.startswith("ln_"):
                        p.add_(0.1 * torch.randn_like(p))
                engine = timed(device, lambda: lstm(x), *reps)
                print(f"| {steps}, {batch}, {features}, {hidden} LayerNorm | fastlayers.LSTM(layer_norm=True) "
                      f"as it runs | | | {engine:.2f} | {base:.2f} | {engine * 1e3 / steps:.2f} | "
                      f"{engine / base:.2f} |", flush=True)
            want = lstm(x)[0]
            configs = ((True, 4, None), (False, 4, None), (False, 8, None), (False, 4, 16), (False, 8, 16)) if gpu \
                else (((False, 4, 8),) if ln else ((True, 4, None),))  # the interpreter: each path once
            for hold, warps, bk in configs:
                if hidden > 64 and bk is None:  # 4 H^2 floats in registers: up to H = 64 (spills beyond)
                    continue
                got = rowwise_forward(x, lstm, warps, hold, bk)
                err = (got - want).abs().max().item()
                ok = err < 1e-4
                bad += not ok
                ms = timed(device, lambda: rowwise_forward(x, lstm, warps, hold, bk), *reps)
                print(f"| {steps}, {batch}, {features}, {hidden}{' LayerNorm' if ln else ''} | "
                      f"{'held' if hold else 'reloaded'}"
                      f"{f' in k chunks of {bk}' if bk else ''} | {warps} | "
                      f"{err:.1e}{'' if ok else ' FAIL'} | {ms:.2f} | {base:.2f} | {ms * 1e3 / steps:.2f} | "
                      f"{ms / base:.2f} |", flush=True)
    print("\n| row-wise persistent LSTM fwd+bwd (plain cell; the weights' and the input's gradients by GEMMs after): "
          "T, B, F, H | warps | k / j chunk | max rel diff vs cuDNN (y, dx, dW) | ours ms | cuDNN fwd+bwd ms | "
          "ours us/step | ratio |\n|---|---:|---|---:|---:|---:|---:|---:|")
    for steps, batch, features, hidden in rowwise[:1] if args.quick else rowwise:
        torch.manual_seed(0)
        lstm = torch.nn.LSTM(features, hidden, bidirectional=True, device=device)
        x = torch.randn(steps, batch, features, device=device)
        dy = torch.randn(steps, batch, 2 * hidden, device=device)
        xg = x.clone().requires_grad_()

        def cudnn_train():
            lstm.zero_grad(set_to_none=True)
            xg.grad = None
            lstm(xg)[0].backward(dy)

        cudnn_train()
        want = [lstm(xg)[0].detach(), xg.grad] + [getattr(lstm, f"{n}_l0{sfx}").grad for sfx in ("", "_reverse")
                                                   for n in ("weight_ih", "weight_hh", "bias_ih")]
        base = timed(device, cudnn_train, *reps)
        with torch.no_grad():
            for warps, bk in (((4, None), (8, None), (4, 16), (8, 16)) if gpu else ((4, None), (4, 8))):
                if hidden > 64 and bk is None:
                    continue
                y, dx, grads = rowwise_train(x, lstm, dy, warps, bk)
                got = [y, dx] + [g for per in grads for g in per]
                err = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(got, want))
                ok = err < 1e-4
                bad += not ok
                ms = timed(device, lambda: rowwise_train(x, lstm, dy, warps, bk), *reps)
                print(f"| {steps}, {batch}, {features}, {hidden} | {warps} | {bk or 'whole'} | "
                      f"{err:.1e}{'' if ok else ' FAIL'} | {ms:.2f} | {base:.2f} | {ms * 1e3 / steps:.2f} | "
                      f"{ms / base:.2f} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
