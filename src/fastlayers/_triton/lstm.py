"""LSTM step kernels in Triton (forward, backward, projection), mirroring ``_native/lstm.c``.

One program per (direction d, sequence b); the hidden units of the four gates i, f, g, o are four
blocks of lanes. Layouts, the step as device data and the meaning of "active" are in
:mod:`._cell`. Per step the caller runs the recurrent GEMM r = hd[:, s] @ W_hh^T
(:mod:`.step_matmul`), then one of these kernels.

Forward, one active row (the equations of ``_native/lstm.c``: haste's LayerNormLSTM, diagonal
peepholes, cell clip, zoneout):
  x = LN(xp; gx) + bias (with layer_norm; else xp, bias included)  a = LN(r; gh) (else r)
  i, f, g = sig(x+a + p*c0), sig(.), tanh(.)   c1 = clip(f c0 + i g)   o = sig(x+a + p_o c1)
  h1 = o tanh(LN(c1; gc, bc))   c = zc c0 + (1-zc) c1   h = zh h0 + (1-zh) h1
  y[t] = h; hd[:, s+1] = h * rmask.
With a projection the kernel stops at h1 (into y1) and :func:`project` finishes the step after the
GEMM h1 @ W_hr^T (proj_clip, zoneout of h, output, next recurrent input).

Backward, one active row: the chain rule of the above, writing the gradient of xp (time layout)
and of r (step layout), updating dh, dc in place, and adding the row's terms of the LayerNorm and
peephole parameter gradients to its sums over the steps (state layout, one program per row: no
atomics; summed over the rows after the loop). Sums in
float32 (float64 for float64 buffers).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._cell import (add_blocks, add_row, block, carried, finish_h, input_norm, lanes, load_blocks, locate,
                    neighbour, norm_backward, norm_backward_terms, norm_stats, parts, parts_stride, present_or,
                    recurrent_norm, sigmoid, step_of, store_blocks, tanh, zero_unless)
from ._launch import launch


# the step (j) and the buffers' time capacity (TC) are never specialised: one compile per
# configuration, whatever the chunk, the step offset or the loop's length
@triton.jit(do_not_specialize=["j", "TC"])
def _forward_kernel(clock, j, TC, B, D, H, lengths, starts, xp, bias, gx, r, h, c, rmask, gh, gc, bc, peep, zc, zh,
                    y, hd, gates, c1, chist, xstat, rhat, rrstd, cstat, y1, scalars,
                    LN: tl.constexpr, PEEP: tl.constexpr, HAS_BIAS: tl.constexpr,
                    CLIP: tl.constexpr, ZC_MASK: tl.constexpr, ZH_MASK: tl.constexpr, RMASK: tl.constexpr,
                    PROJ: tl.constexpr, SAVE_CHIST: tl.constexpr, VARLEN: tl.constexpr, F64: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    s, T = step_of(clock, j)
    if (s < 0) | (s >= T):
        return
    d, b, active, t, step, state, trow, mrow, own = locate(s, T, TC, B, lengths, starts, VARLEN)
    clip, zc_const, zh_const, _, eps = _scalars(scalars, acc_t)
    G = 4 * H
    k = tl.arange(0, BLOCK_H)
    km = k < H
    x0, x1, x2, x3 = load_blocks(xp + (trow * D + d) * G, H, k, km, acc_t, 4)
    x0, x1, x2, x3 = zero_unless(active, x0, x1, x2, x3)
    r0, r1, r2, r3 = load_blocks(r + state * G, H, k, km, acc_t, 4)
    if LN:
        x0, x1, x2, x3 = input_norm(x0, x1, x2, x3, gx + d * G, bias + d * G, xstat, step, own, H, k, km, eps,
                                    acc_t, HAS_BIAS, 4)
        r0, r1, r2, r3 = recurrent_norm(r0, r1, r2, r3, gh + d * G, rhat, rrstd, step, own, H, k, km, eps, acc_t,
                                        4)
    c0 = tl.load(c + state * H + k, mask=km, other=0.0).to(acc_t)
    sm = lanes(km, own)  # the lanes of the step-layout rows this program writes
    if SAVE_CHIST:
        tl.store(chist + step * H + k, c0, mask=sm)
    p0, p1, p3 = x0 + r0, x1 + r1, x3 + r3
    if PEEP:
        pd = peep + d * 3 * H
        p0 += tl.load(pd + k, mask=km, other=0.0) * c0
        p1 += tl.load(pd + H + k, mask=km, other=0.0) * c0
    i, f, g = sigmoid(p0), sigmoid(p1), tanh(x2 + r2)
    cn = f * c0 + i * g
    if CLIP:
        cn = tl.where(cn > clip, clip, tl.where(cn < -clip, -clip, cn))
    if PEEP:
        p3 += tl.load(pd + 2 * H + k, mask=km, other=0.0) * cn
    o = sigmoid(p3)
    store_blocks(gates + step * G, H, k, sm, i, f, g, o, 4)
    # a row that does not run keeps its cell state: the backward reads the state before a step as
    # the step before's c1 (the reverse direction's first step comes after its padding steps)
    tl.store(c1 + step * H + k, tl.where(active, cn, c0), mask=sm)
    nc = cn
    if LN:
        mc, sc = norm_stats(cn, cn, cn, cn, km, H, eps, 1)
        tl.store(cstat + 2 * step, mc, mask=own)
        tl.store(cstat + 2 * step + 1, sc, mask=own)
        nc = tl.load(gc + d * H + k, mask=km, other=0.0) * ((cn - mc) * sc) + tl.load(bc + d * H + k, mask=km,
                                                                                        other=0.0)
    h1 = o * tanh(nc)
    kc = zc_const
    if ZC_MASK:
        kc = tl.load(zc + mrow * H + k, mask=km, other=0.0).to(acc_t)
    cz = kc * c0 + (1 - kc) * cn
    if not ZC_MASK:  # (no zoneout: cn itself, as finish_h's h)
        cz = tl.where(kc == 0, cn, cz)
    tl.store(c + state * H + k, cz, mask=tl.where(active, km, False))
    if PROJ:
        tl.store(y1 + step * H + k, h1, mask=sm)
    else:
        finish_h(s, T, B, D, H, b, d, t, active, k, km, h1, h, rmask, zh, zh_const, y, hd, step, trow, mrow, own,
                 lengths, starts, ZH_MASK, RMASK, VARLEN, acc_t)


@triton.jit
def _scalars(scalars, acc_t: tl.constexpr):
    """(cell_clip, z_c, z_h, proj_clip, eps) from the float tensor :func:`scalars` made (a tensor:
    float arguments of a kernel are float32, and these must be exact in float64)."""
    return (tl.load(scalars).to(acc_t), tl.load(scalars + 1).to(acc_t), tl.load(scalars + 2).to(acc_t),
            tl.load(scalars + 3).to(acc_t), tl.load(scalars + 4).to(acc_t))


@triton.jit(do_not_specialize=["j", "TC"])
def _project_kernel(clock, j, TC, B, D, P, lengths, starts, hp, h, rmask, zh, keep, y, hd, scalars,
                    PCLIP: tl.constexpr, ZH_MASK: tl.constexpr, RMASK: tl.constexpr, VARLEN: tl.constexpr,
                    F64: tl.constexpr, BLOCK_P: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    s, T = step_of(clock, j)
    if (s < 0) | (s >= T):
        return
    d, b, active, t, step, state, trow, mrow, own = locate(s, T, TC, B, lengths, starts, VARLEN)
    k = tl.arange(0, BLOCK_P)
    km = k < P
    _, _, zh_const, pclip, _ = _scalars(scalars, acc_t)
    v = tl.load(hp + state * P + k, mask=km, other=0.0).to(acc_t)
    if PCLIP:
        tl.store(keep + step * P + k, tl.where(tl.abs(v) <= pclip, 1.0, 0.0), mask=lanes(km, own))
        v = tl.where(v > pclip, pclip, tl.where(v < -pclip, -pclip, v))
    finish_h(s, T, B, D, P, b, d, t, active, k, km, v, h, rmask, zh, zh_const, y, hd, step, trow, mrow, own, lengths,
             starts, ZH_MASK, RMASK, VARLEN, acc_t)


@triton.jit(do_not_specialize=["j", "TC"])
def _project_backward_kernel(clock, j, TC, B, D, P, lengths, starts, dy, dh, g, g_parts, rmask, zh, keep, dhp,
                             scalars, G_PARTS: tl.constexpr, PCLIP: tl.constexpr, ZH_MASK: tl.constexpr,
                             RMASK: tl.constexpr, VARLEN: tl.constexpr, F64: tl.constexpr, BLOCK_P: tl.constexpr):
    """Back through y = h, zoneout of h and proj_clip: dhp[:, s] = grad of h1 @ W_hr^T (0 when
    not active); dh (+ the recurrent part g * rmask of the step after) becomes zh * its total."""
    acc_t = tl.float64 if F64 else tl.float32
    s, T = step_of(clock, j)
    if (s < 0) | (s >= T):
        return
    d, b, active, t, step, state, trow, mrow, own = locate(s, T, TC, B, lengths, starts, VARLEN)
    k = tl.arange(0, BLOCK_P)
    km = k < P
    _, _, zh_const, _, _ = _scalars(scalars, acc_t)
    dhv = carried(dh, g, g_parts, rmask, state, P, k, km, G_PARTS, RMASK, acc_t)
    dyv = tl.load(dy + (trow * D + d) * P + k, mask=km, other=0.0).to(acc_t)
    dtot = dhv + tl.where(active, dyv, 0.0)
    kh = zh_const
    if ZH_MASK:
        kh = tl.load(zh + mrow * P + k, mask=km, other=0.0).to(acc_t)
    ghp = (1 - kh) * dtot
    if PCLIP:
        ghp = ghp * tl.load(keep + step * P + k, mask=km, other=0.0)
    tl.store(dhp + step * P + k, tl.where(active, ghp, 0.0), mask=lanes(km, own))
    tl.store(dh + state * P + k, tl.where(active, kh * dtot, dhv), mask=km)


@triton.jit(do_not_specialize=["j", "TC"])
def _backward_kernel(clock, j, TC, B, D, H, lengths, starts, dy, dh, dc, g, g_parts, rmask, gates, c1, c0, chist, xp,
                     xstat, gx, rhat, rrstd, cstat, gh, gc, bc, peep, zc, zh, dpre, dr, pgx, pb, pgh, pgc, pbc, ppeep,
                     scalars, LN: tl.constexpr, PEEP: tl.constexpr, CLIP: tl.constexpr,
                     ZC_MASK: tl.constexpr, ZH_MASK: tl.constexpr, G_PARTS: tl.constexpr, RMASK: tl.constexpr,
                     DY_STEP: tl.constexpr, SAVE_CHIST: tl.constexpr, NEED_GX: tl.constexpr, NEED_B: tl.constexpr,
                     NEED_GH: tl.constexpr, NEED_GC: tl.constexpr, NEED_PEEP: tl.constexpr, VARLEN: tl.constexpr,
                     F64: tl.constexpr, BLOCK_H: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    s, T = step_of(clock, j)
    if (s < 0) | (s >= T):
        return
    d, b, active, t, step, state, trow, mrow, own = locate(s, T, TC, B, lengths, starts, VARLEN)
    G = 4 * H
    k = tl.arange(0, BLOCK_H)
    km = k < H
    clip, zc_const, zh_const, _, _ = _scalars(scalars, acc_t)
    if DY_STEP:  # with a projection, zoneout of h is behind it (project_backward)
        zh_const = 0.0
    if DY_STEP:  # with a projection, project_backward added the recurrent part g to dh
        dhv = tl.load(dh + state * H + k, mask=km, other=0.0).to(acc_t)
    else:
        dhv = carried(dh, g, g_parts, rmask, state, H, k, km, G_PARTS, RMASK, acc_t)
    dcv = tl.load(dc + state * H + k, mask=km, other=0.0).to(acc_t)
    if DY_STEP:
        dyv = tl.load(dy + state * H + k, mask=km, other=0.0).to(acc_t)
    else:
        dyv = tl.load(dy + (trow * D + d) * H + k, mask=km, other=0.0).to(acc_t)
        dyv = tl.where(active, dyv, 0.0)
    kh = zh_const
    if ZH_MASK:
        kh = tl.load(zh + mrow * H + k, mask=km, other=0.0).to(acc_t)
    kc = zc_const
    if ZC_MASK:
        kc = tl.load(zc + mrow * H + k, mask=km, other=0.0).to(acc_t)
    gr = gates + step * G
    i = tl.load(gr + k, mask=km, other=0.0)
    f = tl.load(gr + H + k, mask=km, other=0.0)
    gg = tl.load(gr + 2 * H + k, mask=km, other=0.0)
    o = tl.load(gr + 3 * H + k, mask=km, other=0.0)
    cn = tl.load(c1 + step * H + k, mask=km, other=0.0)
    if SAVE_CHIST:
        cb = tl.load(chist + step * H + k, mask=km, other=0.0)
    else:  # the cell state before step s: the step before's c1, or c_0
        before, there = neighbour(s, T, B, d, b, t, step, lengths, starts, False, VARLEN)
        cb = tl.load(c1 + before * H + k, mask=lanes(km, there), other=0.0) + \
            tl.load(c0 + state * H + k, mask=lanes(km, there == 0), other=0.0)
    dhout = dyv + dhv
    dh1 = (1 - kh) * dhout
    if LN:
        mc = tl.load(cstat + 2 * step)
        sc = tl.load(cstat + 2 * step + 1)
        chat = (cn - mc) * sc
        gcd = tl.load(gc + d * H + k, mask=km, other=0.0)
        th = tanh(gcd * chat + tl.load(bc + d * H + k, mask=km, other=0.0))
    else:
        th = tanh(cn)
    do = dh1 * th * o * (1 - o)
    dn = dh1 * o * (1 - th * th)
    if LN:
        dhat = dn * gcd
        m1, m2 = norm_backward_terms(dhat, dhat, dhat, dhat, chat, chat, chat, chat, km, H, 1)
        dc1 = sc * (dhat - m1 - chat * m2)
        if NEED_GC:
            add_row(pgc + state * H, k, km, tl.where(active, dn * chat, 0.0))
            add_row(pbc + state * H, k, km, tl.where(active, dn, 0.0))
    else:
        dc1 = dn
    dc1 += (1 - kc) * dcv
    if PEEP:
        pd = peep + d * 3 * H
        dc1 += do * tl.load(pd + 2 * H + k, mask=km, other=0.0)
    if CLIP:
        v = f * cb + i * gg
        dc1 = tl.where((v > clip) | (v < -clip), 0.0, dc1)
    di = dc1 * gg * i * (1 - i)
    df = dc1 * cb * f * (1 - f)
    dg = dc1 * i * (1 - gg * gg)
    dc0 = dc1 * f + kc * dcv
    if PEEP:
        dc0 += di * tl.load(pd + k, mask=km, other=0.0) + df * tl.load(pd + H + k, mask=km, other=0.0)
        if NEED_PEEP:
            pdo = tl.where(active, do * cn, 0.0)
            add_blocks(ppeep + state * 3 * H, H, k, km, tl.where(active, di * cb, 0.0), tl.where(active, df * cb, 0.0),
                       pdo, pdo, 3)
    tl.store(dh + state * H + k, tl.where(active, kh * dhout, dhv), mask=km)
    tl.store(dc + state * H + k, tl.where(active, dc0, dcv), mask=km)
    di = tl.where(active, di, 0.0)
    df = tl.where(active, df, 0.0)
    dg = tl.where(active, dg, 0.0)
    do = tl.where(active, do, 0.0)
    xrow = (trow * D + d) * G
    sm = lanes(km, own)
    if LN:
        # through a = gh * r-hat: the gradient of r
        q0, q1, q2, q3 = load_blocks(rhat + step * G, H, k, km, acc_t, 4)
        v0, v1, v2, v3 = norm_backward(di, df, dg, do, gh + d * G, q0, q1, q2, q3, tl.load(rrstd + step), H, k, km,
                                       acc_t, 4)
        store_blocks(dr + step * G, H, k, sm, v0, v1, v2, v3, 4)
        if NEED_GH:
            add_blocks(pgh + state * G, H, k, km, di * q0, df * q1, dg * q2, do * q3, 4)
        # through x = gx * x-hat + bias: the gradient of xp (zero for a row that is not active: its
        # upstream gradients are zero and its x-hat is read as zeros)
        mx = tl.load(xstat + 2 * step)
        sx = tl.load(xstat + 2 * step + 1)
        q0, q1, q2, q3 = load_blocks(xp + xrow, H, k, km, acc_t, 4)
        q0, q1, q2, q3 = zero_unless(active, q0, q1, q2, q3)
        q0, q1, q2, q3 = (q0 - mx) * sx, (q1 - mx) * sx, (q2 - mx) * sx, (q3 - mx) * sx
        v0, v1, v2, v3 = norm_backward(di, df, dg, do, gx + d * G, q0, q1, q2, q3, sx, H, k, km, acc_t, 4)
        store_blocks(dpre + xrow, H, k, sm, v0, v1, v2, v3, 4)
        if NEED_GX:
            add_blocks(pgx + state * G, H, k, km, di * q0, df * q1, dg * q2, do * q3, 4)
        if NEED_B:
            add_blocks(pb + state * G, H, k, km, di, df, dg, do, 4)
    else:
        store_blocks(dr + step * G, H, k, sm, di, df, dg, do, 4)
        store_blocks(dpre + xrow, H, k, sm, di, df, dg, do, 4)


def scalars(consts: tuple[float, float, float, float], eps: float) -> list[float]:
    """The kernels' float constants, to pass as a tensor in the buffers' dtype (``scalars``):
    [cell_clip, z_c, z_h, proj_clip, eps]; consts = (cell_clip or 0, z_c, z_h, proj_clip or 0)."""
    return [*consts, eps]


def step_forward(at: tuple[Tensor, int], lengths: Tensor, xp: Tensor, bias, gx, r: Tensor, h, c: Tensor, rmask, gh,
                 gc, bc, peep, zc, zh, y, hd, buf: dict, consts: tuple[float, float, float, float],
                 numbers: Tensor, starts: Tensor | None = None) -> None:
    """Step s = clock[0] + j of every direction, at = (clock, j) (see :mod:`._cell` and the module
    docstring). lengths (B,) int64; xp (TC, B, D, 4H); r, c (D, B, 4H / H) and, without a
    projection, h (D, B, H); y (TC, B, D, H); hd (D, TC, B, H) (h, y, hd: None with a
    projection); buf: the step-layout buffers ``gates``, ``c1``, ``chist``, ``xstat``, ``rhat``,
    ``rrstd``, ``cstat``, ``y1`` (D, TC, B, ...; None where unused); consts (cell_clip or 0, z_c, z_h,
    proj_clip or 0), the z used without masks, and ``numbers`` the same as :func:`scalars`. With
    ``starts`` (B,) int64, the first value row of each sequence: the varlen layout (:mod:`._cell`),
    xp (TC, D, 4H), y (TC, D, H), hd and buf (D, TC, ...), masks (D, TC, H), TC the row capacity."""
    dirs, batch, hidden = c.shape
    ln = gx is not None
    clock, j = at
    launch(_forward_kernel, (dirs * batch,), (
        clock, j, buf["gates"].size(1), batch, dirs, hidden, lengths, present_or(starts, lengths), xp,
        present_or(bias, xp), present_or(gx, xp), r,
        present_or(h, c), c, present_or(rmask, c), present_or(gh, xp), present_or(gc, xp), present_or(bc, xp),
        present_or(peep, xp), present_or(zc, xp), present_or(zh, xp), present_or(y, xp), present_or(hd, xp),
        buf["gates"], buf["c1"],
        *(present_or(buf.get(n), xp) for n in ("chist", "xstat", "rhat", "rrstd", "cstat", "y1")), numbers),
        {"LN": ln, "PEEP": peep is not None, "HAS_BIAS": bias is not None and ln, "CLIP": consts[0] > 0,
         "ZC_MASK": zc is not None, "ZH_MASK": zh is not None, "RMASK": rmask is not None,
         "PROJ": buf.get("y1") is not None, "SAVE_CHIST": buf.get("chist") is not None, "VARLEN": starts is not None,
         "F64": c.dtype.itemsize == 8, "BLOCK_H": block(hidden)})


def project(at: tuple[Tensor, int], lengths: Tensor, hp: Tensor, h: Tensor, rmask, zh, keep, y: Tensor, hd: Tensor,
            numbers: Tensor, starts: Tensor | None = None) -> None:
    """Finish step s = clock[0] + j with a projection: hp = h1 @ W_hr^T (D, B, P), state h
    (D, B, P); y (TC, B, D, P), hd (D, TC, B, P); keep (D, TC, B, P) | None (no proj_clip) records
    |hp| <= proj_clip for the backward; ``starts``: the varlen layout, as :func:`step_forward`."""
    dirs, batch, size = h.shape
    clock, j = at
    launch(_project_kernel, (dirs * batch,), (
        clock, j, hd.size(1), batch, dirs, size, lengths, present_or(starts, lengths), hp, h, present_or(rmask, hp),
        present_or(zh, hp), present_or(keep, hp), y, hd, numbers),
        {"PCLIP": keep is not None, "ZH_MASK": zh is not None, "RMASK": rmask is not None, "VARLEN": starts is not None,
         "F64": h.dtype.itemsize == 8, "BLOCK_P": block(size)})


def project_backward(at: tuple[Tensor, int], lengths: Tensor, dy: Tensor, dh: Tensor, g: Tensor, rmask, zh, keep,
                     dhp: Tensor, numbers: Tensor, starts: Tensor | None = None) -> None:
    """Back through :func:`project` at step s = clock[0] + j: dy (TC, B, D, P), dhp (D, TC, B, P),
    dh (D, B, P) in place, g (S, D, B, P) the recurrent GEMM's partial sums of the step after
    (zeros before the loop's first step); ``starts``: the varlen layout, as :func:`step_forward`."""
    dirs, batch, size = dh.shape
    clock, j = at
    launch(_project_backward_kernel, (dirs * batch,), (
        clock, j, dhp.size(1), batch, dirs, size, lengths, present_or(starts, lengths), dy, dh, g, parts_stride(g),
        present_or(rmask, dh), present_or(zh, dh), present_or(keep, dh), dhp, numbers),
        {"G_PARTS": parts(g), "PCLIP": keep is not None, "ZH_MASK": zh is not None, "RMASK": rmask is not None,
         "VARLEN": starts is not None, "F64": dh.dtype.itemsize == 8, "BLOCK_P": block(size)})


def step_backward(at: tuple[Tensor, int], lengths: Tensor, dy: Tensor, dh: Tensor, dc: Tensor, g: Tensor, rmask,
                  c0, xp, gx, gh, gc, bc, peep, zc, zh, buf: dict, grads: dict, consts, numbers: Tensor,
                  starts: Tensor | None = None, projected: bool | None = None) -> None:
    """Back through step s = clock[0] + j: dy the output gradient (TC, B, D, H), or with a
    projection the gradient of h1 at this step (D, B, H); dh, dc (D, B, H) in place; g (S, D, B, H)
    as in :func:`project_backward` (with a projection unused: that kernel adds it); xp
    (TC, B, D, 4H) with layer_norm (else None). grads: ``dpre`` (TC, B, D, 4H), ``dr``
    (D, TC, B, 4H), and the parameter gradients' per-row sums over the steps, added to in place
    (zeros before the loop): ``pgx``, ``pb``, ``pgh`` (D, B, 4H), ``pgc``, ``pbc`` (D, B, H),
    ``ppeep`` (D, B, 3H), None where not needed. ``starts``: the varlen layout, as :func:`step_forward`
    (dy (TC, D, H)); ``projected``: whether dy is the gradient of h1 (default: whether dy is 3-D,
    which the varlen layout's time layout is too: its caller says)."""
    dirs, batch, hidden = dc.shape
    dy_step = dy.dim() == 3 if projected is None else projected
    clock, j = at
    launch(_backward_kernel, (dirs * batch,), (
        clock, j, buf["gates"].size(1), batch, dirs, hidden, lengths, present_or(starts, lengths), dy, dh, dc, g,
        parts_stride(g),
        present_or(rmask, dc), buf["gates"], buf["c1"], c0, present_or(buf.get("chist"), dc), present_or(xp, dc),
        present_or(buf.get("xstat"), dc), present_or(gx, dc), present_or(buf.get("rhat"), dc),
        present_or(buf.get("rrstd"), dc), present_or(buf.get("cstat"), dc), present_or(gh, dc), present_or(gc, dc),
        present_or(bc, dc), present_or(peep, dc), present_or(zc, dc), present_or(zh, dc), grads["dpre"], grads["dr"],
        *(present_or(grads.get(n), dc) for n in ("pgx", "pb", "pgh", "pgc", "pbc", "ppeep")), numbers),
        {"LN": gx is not None, "PEEP": peep is not None, "CLIP": consts[0] > 0, "ZC_MASK": zc is not None,
         "ZH_MASK": zh is not None and not dy_step, "G_PARTS": parts(g), "RMASK": rmask is not None, "DY_STEP": dy_step,
         "SAVE_CHIST": buf.get("chist") is not None, "NEED_GX": grads.get("pgx") is not None,
         "NEED_B": grads.get("pb") is not None, "NEED_GH": grads.get("pgh") is not None,
         "NEED_GC": grads.get("pgc") is not None, "NEED_PEEP": grads.get("ppeep") is not None,
         "VARLEN": starts is not None, "F64": dc.dtype.itemsize == 8, "BLOCK_H": block(hidden)})
