"""GRU step kernels in Triton (forward, backward), mirroring ``_native/gru.c``.

One program per (direction d, sequence b), the gates r, z, n as three blocks of lanes; layouts,
the step as device data and "active" as in :mod:`._cell`. Forward, one active row (torch.nn.GRU; haste's LayerNormGRU):
  x = LN(xp; gx) + b_ih (with layer_norm; else xp, b_ih included)   hb = LN(r; gh) (else r) + b_hh
  rg = sig(x_r + hb_r)   zg = sig(x_z + hb_z)   ng = tanh(x_n + rg hb_n)
  h1 = (1 - zg) ng + zg h0   h = zh h0 + (1-zh) h1   y[t] = h; hd[:, s+1] = h * rmask.
Saved (step layout): gates (rg, zg, ng), hb_n, h0, the LayerNorm statistics and r-hat.
Backward: the chain rule; gradients of xp (time layout), of r (step layout) and of hb (for b_hh),
and each row's sums over the steps of the LayerNorm gains' and biases' gradient terms (added to in
place by the row's own program: no atomics).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ._cell import (add_blocks, block, carried, finish_h, input_norm, lanes, load_blocks, locate, norm_backward,
                    parts, parts_stride, present_or, recurrent_norm, sigmoid, step_of, store_blocks, tanh, zero_unless)
from ._launch import launch


@triton.jit(do_not_specialize=["j", "TC"])  # one compile per configuration (see .lstm)
def _forward_kernel(clock, j, TC, B, D, H, lengths, starts, xp, b_ih, gx, r, h, rmask, b_hh, gh, zh,
                    y, hd, gates, hbn, hist, xstat, rhat, rrstd, scalars,
                    LN: tl.constexpr, HAS_BIH: tl.constexpr, HAS_BHH: tl.constexpr, ZH_MASK: tl.constexpr,
                    RMASK: tl.constexpr, VARLEN: tl.constexpr, F64: tl.constexpr, BLOCK_H: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    s, T = step_of(clock, j)
    if (s < 0) | (s >= T):
        return
    d, b, active, t, step, state, trow, mrow, own = locate(s, T, TC, B, lengths, starts, VARLEN)
    zh_const, eps = tl.load(scalars).to(acc_t), tl.load(scalars + 1).to(acc_t)  # exact in float64
    G = 3 * H
    k = tl.arange(0, BLOCK_H)
    km = k < H
    x0, x1, x2, _ = load_blocks(xp + (trow * D + d) * G, H, k, km, acc_t, 3)
    x0, x1, x2, _ = zero_unless(active, x0, x1, x2, x2)
    r0, r1, r2, _ = load_blocks(r + state * G, H, k, km, acc_t, 3)
    if LN:
        x0, x1, x2, _ = input_norm(x0, x1, x2, x2, gx + d * G, b_ih + d * G, xstat, step, own, H, k, km, eps, acc_t,
                                   HAS_BIH, 3)
        r0, r1, r2, _ = recurrent_norm(r0, r1, r2, r2, gh + d * G, rhat, rrstd, step, own, H, k, km, eps, acc_t, 3)
    if HAS_BHH:
        b0, b1, b2, _ = load_blocks(b_hh + d * G, H, k, km, acc_t, 3)
        r0, r1, r2 = r0 + b0, r1 + b1, r2 + b2
    rg = sigmoid(x0 + r0)
    zg = sigmoid(x1 + r1)
    ng = tanh(x2 + rg * r2)
    h0 = tl.load(h + state * H + k, mask=km, other=0.0).to(acc_t)
    sm = lanes(km, own)  # the lanes of the step-layout rows this program writes
    store_blocks(gates + step * G, H, k, sm, rg, zg, ng, ng, 3)
    tl.store(hbn + step * H + k, r2, mask=sm)
    tl.store(hist + step * H + k, h0, mask=sm)
    h1 = (1 - zg) * ng + zg * h0
    finish_h(s, T, B, D, H, b, d, t, active, k, km, h1, h, rmask, zh, zh_const, y, hd, step, trow, mrow, own, lengths,
             starts, ZH_MASK, RMASK, VARLEN, acc_t)


@triton.jit(do_not_specialize=["j", "TC"])
def _backward_kernel(clock, j, TC, B, D, H, lengths, starts, dy, dh, g, g_parts, rmask, gates, hbn, hist, xp, xstat,
                     gx, rhat, rrstd, gh, zh, dpre, dr, dhb, pgx, pb, pgh, scalars,
                     LN: tl.constexpr, ZH_MASK: tl.constexpr, G_PARTS: tl.constexpr,
                     RMASK: tl.constexpr, NEED_HB: tl.constexpr, NEED_GX: tl.constexpr, NEED_B: tl.constexpr,
                     NEED_GH: tl.constexpr, VARLEN: tl.constexpr, F64: tl.constexpr, BLOCK_H: tl.constexpr):
    acc_t = tl.float64 if F64 else tl.float32
    s, T = step_of(clock, j)
    if (s < 0) | (s >= T):
        return
    d, b, active, t, step, state, trow, mrow, own = locate(s, T, TC, B, lengths, starts, VARLEN)
    zh_const = tl.load(scalars).to(acc_t)  # exact in float64 (LayerNorm's backward reads the saved 1/std, not eps)
    G = 3 * H
    k = tl.arange(0, BLOCK_H)
    km = k < H
    dhv = carried(dh, g, g_parts, rmask, state, H, k, km, G_PARTS, RMASK, acc_t)
    dyv = tl.load(dy + (trow * D + d) * H + k, mask=km, other=0.0).to(acc_t)
    dyv = tl.where(active, dyv, 0.0)
    kh = zh_const
    if ZH_MASK:
        kh = tl.load(zh + mrow * H + k, mask=km, other=0.0).to(acc_t)
    gr = gates + step * G
    rg = tl.load(gr + k, mask=km, other=0.0)
    zg = tl.load(gr + H + k, mask=km, other=0.0)
    ng = tl.load(gr + 2 * H + k, mask=km, other=0.0)
    hb2 = tl.load(hbn + step * H + k, mask=km, other=0.0)
    h0 = tl.load(hist + step * H + k, mask=km, other=0.0)
    dhout = dyv + dhv
    dh1 = (1 - kh) * dhout
    tl.store(dh + state * H + k, tl.where(active, kh * dhout + dh1 * zg, dhv), mask=km)
    dn = tl.where(active, dh1 * (1 - zg) * (1 - ng * ng), 0.0)
    dz = tl.where(active, dh1 * (h0 - ng) * zg * (1 - zg), 0.0)
    drg = tl.where(active, dn * hb2 * rg * (1 - rg), 0.0)
    dhn = dn * rg  # the gradient of hb_n
    xrow = (trow * D + d) * G
    sm = lanes(km, own)
    if LN:
        if NEED_HB:
            add_blocks(dhb + state * G, H, k, km, drg, dz, dhn, dhn, 3)
        q0, q1, q2, _ = load_blocks(rhat + step * G, H, k, km, acc_t, 3)
        v0, v1, v2, _ = norm_backward(drg, dz, dhn, dhn, gh + d * G, q0, q1, q2, q2, tl.load(rrstd + step), H, k, km,
                                      acc_t, 3)
        store_blocks(dr + step * G, H, k, sm, v0, v1, v2, v2, 3)
        if NEED_GH:
            add_blocks(pgh + state * G, H, k, km, drg * q0, dz * q1, dhn * q2, dhn, 3)
        mx = tl.load(xstat + 2 * step)
        sx = tl.load(xstat + 2 * step + 1)
        q0, q1, q2, _ = load_blocks(xp + xrow, H, k, km, acc_t, 3)
        q0, q1, q2, _ = zero_unless(active, q0, q1, q2, q2)
        q0, q1, q2 = (q0 - mx) * sx, (q1 - mx) * sx, (q2 - mx) * sx
        v0, v1, v2, _ = norm_backward(drg, dz, dn, dn, gx + d * G, q0, q1, q2, q2, sx, H, k, km, acc_t, 3)
        store_blocks(dpre + xrow, H, k, sm, v0, v1, v2, v2, 3)
        if NEED_GX:
            add_blocks(pgx + state * G, H, k, km, drg * q0, dz * q1, dn * q2, dn, 3)
        if NEED_B:
            add_blocks(pb + state * G, H, k, km, drg, dz, dn, dn, 3)
    else:
        store_blocks(dr + step * G, H, k, sm, drg, dz, dhn, dhn, 3)
        store_blocks(dpre + xrow, H, k, sm, drg, dz, dn, dn, 3)


def scalars(zh_const: float, eps: float) -> list[float]:
    """The kernels' float constants [z_h, eps], to pass as a tensor in the buffers' dtype."""
    return [zh_const, eps]


def step_forward(at: tuple[Tensor, int], lengths: Tensor, xp: Tensor, b_ih, gx, r: Tensor, h: Tensor, rmask, b_hh, gh,
                 zh, y: Tensor, hd: Tensor, buf: dict, numbers: Tensor, starts: Tensor | None = None) -> None:
    """Step s = clock[0] + j of every direction, at = (clock, j) (see :mod:`._cell`): lengths (B,)
    int64; xp (TC, B, D, 3H) (b_ih included unless gx is given), r (D, B, 3H), h (D, B, H) in
    place, y (TC, B, D, H), hd (D, TC, B, H); buf: step-layout ``gates``, ``hbn``, ``hist``,
    ``xstat``, ``rhat``, ``rrstd`` (the last three with layer_norm); numbers from :func:`scalars`.
    With ``starts`` (B,) int64: the varlen layout (:mod:`._cell`; as :func:`.lstm.step_forward`)."""
    dirs, batch, hidden = h.shape
    ln = gx is not None
    clock, j = at
    launch(_forward_kernel, (dirs * batch,), (
        clock, j, hd.size(1), batch, dirs, hidden, lengths, present_or(starts, lengths), xp, present_or(b_ih, xp),
        present_or(gx, xp), r, h,
        present_or(rmask, h), present_or(b_hh, xp), present_or(gh, xp), present_or(zh, xp), y, hd, buf["gates"],
        buf["hbn"], buf["hist"], *(present_or(buf.get(n), xp) for n in ("xstat", "rhat", "rrstd")), numbers),
        {"LN": ln, "HAS_BIH": b_ih is not None and ln, "HAS_BHH": b_hh is not None, "ZH_MASK": zh is not None,
         "RMASK": rmask is not None, "VARLEN": starts is not None, "F64": h.dtype.itemsize == 8,
         "BLOCK_H": block(hidden)})


def step_backward(at: tuple[Tensor, int], lengths: Tensor, dy: Tensor, dh: Tensor, g: Tensor, rmask, xp, gx, gh, zh,
                  buf: dict, grads: dict, numbers: Tensor, starts: Tensor | None = None) -> None:
    """Back through step s = clock[0] + j: dy (TC, B, D, H); dh (D, B, H) in place; g (S, D, B, H)
    the recurrent GEMM's partial sums of the step after (zeros before the loop's first step); xp
    with layer_norm (else None). grads: ``dpre`` (TC, B, D, 3H), ``dr`` (D, TC, B, 3H), and, where
    needed, per-row sums over the steps added to in place (zeros before the loop), (D, B, 3H):
    ``dhb`` (the gradient of hb, for b_hh with layer_norm), ``pgx``, ``pb``, ``pgh``. ``starts``: the
    varlen layout, as :func:`step_forward`."""
    dirs, batch, hidden = dh.shape
    clock, j = at
    launch(_backward_kernel, (dirs * batch,), (
        clock, j, buf["gates"].size(1), batch, dirs, hidden, lengths, present_or(starts, lengths), dy, dh, g,
        parts_stride(g), present_or(rmask, dh),
        buf["gates"], buf["hbn"], buf["hist"], present_or(xp, dh), present_or(buf.get("xstat"), dh), present_or(gx, dh),
        present_or(buf.get("rhat"), dh), present_or(buf.get("rrstd"), dh), present_or(gh, dh), present_or(zh, dh),
        grads["dpre"], grads["dr"], *(present_or(grads.get(n), dh) for n in ("dhb", "pgx", "pb", "pgh")), numbers),
        {"LN": gx is not None, "ZH_MASK": zh is not None, "G_PARTS": parts(g), "RMASK": rmask is not None,
         "NEED_HB": grads.get("dhb") is not None, "NEED_GX": grads.get("pgx") is not None,
         "NEED_B": grads.get("pb") is not None, "NEED_GH": grads.get("pgh") is not None, "VARLEN": starts is not None,
         "F64": dh.dtype.itemsize == 8, "BLOCK_H": block(hidden)})
