"""The autograd Functions of the engine's time loop, binding the C step kernels (``_native``).

Legend: D directions, N packed rows of one direction (the valid (t, b), step after step; step
t's rows are the active prefix of the length-sorted batch), B batch, H hidden size, G gates.
Each Function runs, per step, one batched recurrent GEMM (both directions) and one fused C
pointwise kernel; its backward runs the kernel's backward and the recurrent GEMM in reverse and
computes the recurrent weight gradient (and LayerNorm / peephole parameter gradients) as large
reductions after the loop.
"""

from __future__ import annotations

import ctypes
import itertools

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _native
from .._native import address

EPS = 1e-5
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
P = ctypes.c_void_p
I64, INT = ctypes.c_int64, ctypes.c_int


def _typed(name: str, signatures) -> ctypes.CDLL | None:
    """Load library ``name`` and set argtypes once; signatures(real) -> {function stem: argtypes}."""
    lib = _native.load(name)
    if lib is not None and not getattr(lib, "_fastlayers_typed", False):
        for suffix, real in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
            for stem, argtypes in signatures(real).items():
                f = getattr(lib, f"{stem}_{suffix}")
                f.argtypes, f.restype = argtypes, None
        lib._fastlayers_typed = True
    return lib


def _lstm_lib():
    return _typed("lstm", lambda real: {
        "lstm_step_forward": [I64] * 6 + [P] * 5 + [P] * 6 + [P] * 4 + [P] * 4 + [real, real] + [P, P, real, real] + [INT],
        "lstm_step_backward": [I64] * 5 + [P] * 3 + [P] * 4 + [P] * 4 + [P, P, P, real] + [P, P, real, real] + [P] * 7
        + [INT]})


def _gru_lib():
    return _typed("gru", lambda real: {
        "gru_step_forward": [I64] * 6 + [P] * 5 + [P] * 7 + [P, real, P, real, INT],
        "gru_step_backward": [I64] * 5 + [P] * 5 + [P] * 3 + [P, real] + [P] * 4 + [INT]})


def _offsets(active: tuple[int, ...]) -> tuple[int, ...]:
    """First packed row of every step and the total: (0, n_0, n_0 + n_1, ..., N)."""
    return (0, *itertools.accumulate(active))


def _steps(buf: Tensor | None, offsets: tuple[int, ...]) -> list[int | None]:
    """Addresses of (d=0, first row of step t) of a contiguous [D, N, ...] packed buffer, every t."""
    if buf is None:
        return [None] * len(offsets)
    row = buf.stride(1) * buf.element_size()
    return [buf.data_ptr() + o * row for o in offsets]


class LSTMRecurrence(torch.autograd.Function):
    """The time loop of one layer, all directions, on packed rows.

    Inputs: xp (D, N, G) input pre-activations incl. bias; h0 (D, B, P), c0 (D, B, H);
    w_hh (D, G, P); gh (D, G) | None recurrent LayerNorm gain; gc, bc (D, H) | None cell
    LayerNorm gain, bias; peep (D, 3H) | None; w_hr (D, P, H) | None projection (P = H without);
    rmask (D, B, P) | None recurrent-dropout mask (scaled); zc (D, N, H), zh (D, N, P) | None
    zoneout keep-masks; active: tuple of the T active-prefix sizes (sum N);
    consts: (cell_clip or 0, z_c, z_h, proj_clip or 0) (the z are used where the masks are None).
    Returns y (D, N, P), h_n (D, B, P), c_n (D, B, H).

    Without a projection the C kernel does the whole step. With one, the kernel stops at
    h1 = o * tanh(.) (no zoneout, no recurrent input) and the projection, proj_clip, zoneout of h
    and the next recurrent input are torch ops on the step's rows; the backward mirrors them and
    computes dW_hr as one GEMM after the loop.
    """

    @staticmethod
    def forward(ctx, xp, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, active, consts):
        dirs, rows, gsize = xp.shape
        hidden = gsize // 4
        batch, out_size = h0.shape[1:]
        clip, zc_const, zh_const, pclip = consts
        fwd = getattr(_lstm_lib(), f"lstm_step_forward_{_SUFFIX[xp.dtype]}")
        threads = torch.get_num_threads()
        xp = xp.contiguous()
        h, c = h0.contiguous().clone(), c0.contiguous().clone()
        e = lambda *s: xp.new_empty(dirs, rows, *s)  # noqa: E731  (every row gets written)
        y, gates, c1, th, chist, hd = e(out_size), e(gsize), e(hidden), e(hidden), e(hidden), e(out_size)
        rhat, rrstd = (e(gsize), e()) if gh is not None else (None, None)
        chat, crstd = (e(hidden), e()) if gc is not None else (None, None)
        rmask = rmask.contiguous() if rmask is not None else None
        zc = zc.contiguous() if zc is not None else None
        zh = zh.contiguous() if zh is not None else None
        proj = w_hr is not None
        # with a projection the kernel writes h1 into y1 and keeps scratch state hk
        y1, hk = (e(hidden), xp.new_zeros(dirs, batch, hidden)) if proj else (y, h)
        keep = torch.empty(dirs, rows, out_size, dtype=torch.bool, device=xp.device) if proj and pclip else None
        first = active[0]  # == B: every sequence runs step 0
        hd[:, :first] = h * rmask if rmask is not None else h
        w_t = w_hh.transpose(1, 2)
        offsets = _offsets(active)
        P_ = {k: _steps(v, offsets) for k, v in dict(xp=xp, y1=y1, gates=gates, c1=c1, th=th, chist=chist, hd=hd,
                                                      rhat=rhat, rrstd=rrstd, chat=chat, crstd=crstd, zc=zc,
                                                      zh=zh).items()}
        fixed = (address(gh), address(gc), address(bc), address(peep), clip, EPS)
        last = len(active) - 1
        for t, n in enumerate(active):
            o = offsets[t]
            r = torch.bmm(hd[:, o:o + n], w_t)  # (D, n, G) contiguous
            n_next = active[t + 1] if t < last else 0
            fwd(dirs, batch, n, n_next, hidden, rows, P_["xp"][t], r.data_ptr(), c.data_ptr(), hk.data_ptr(),
                None if proj else address(rmask), P_["y1"][t], P_["gates"][t], P_["c1"][t], P_["th"][t],
                P_["chist"][t], None if proj or t == last else P_["hd"][t + 1], P_["rhat"][t], P_["rrstd"][t],
                P_["chat"][t], P_["crstd"][t], *fixed, P_["zc"][t], None if proj else P_["zh"][t], zc_const,
                0.0 if proj else zh_const, threads)
            if proj:
                hp = torch.bmm(y1[:, o:o + n], w_hr.transpose(1, 2))  # (D, n, P)
                if keep is not None:
                    keep[:, o:o + n] = hp.abs() <= pclip
                    hp.clamp_(-pclip, pclip)
                kh = zh[:, o:o + n] if zh is not None else zh_const
                h[:, :n] = hp if isinstance(kh, float) and kh == 0 else kh * h[:, :n] + (1 - kh) * hp
                y[:, o:o + n] = h[:, :n]
                if t < last:
                    nxt = h[:, :n_next] * rmask[:, :n_next] if rmask is not None else h[:, :n_next]
                    hd[:, o + n:o + n + n_next] = nxt
        ctx.save_for_backward(w_hh, gh, gc, peep, w_hr, rmask, zc, zh, gates, c1, th, chist, hd, rhat, rrstd, chat,
                              crstd, y1 if proj else None, keep)
        ctx.active, ctx.offsets, ctx.consts, ctx.batch = active, offsets, consts, batch
        return y, h, c

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dh_n, dc_n):
        (w_hh, gh, gc, peep, w_hr, rmask, zc, zh, gates, c1, th, chist, hd, rhat, rrstd, chat, crstd, y1,
         keep) = ctx.saved_tensors
        dirs, rows, gsize = gates.shape
        hidden, batch, out_size = gsize // 4, ctx.batch, hd.size(2)
        clip, zc_const, zh_const, pclip = ctx.consts
        proj = w_hr is not None
        bwd = getattr(_lstm_lib(), f"lstm_step_backward_{_SUFFIX[gates.dtype]}")
        threads = torch.get_num_threads()
        need = ctx.needs_input_grad
        dy = dy.contiguous() if dy is not None else gates.new_zeros(dirs, rows, out_size)
        dh = dh_n.contiguous().clone() if dh_n is not None else gates.new_zeros(dirs, batch, out_size)
        dc = dc_n.contiguous().clone() if dc_n is not None else gates.new_zeros(dirs, batch, hidden)
        dpre = gates.new_empty(dirs, rows, gsize)
        dr = dpre if gh is None else gates.new_empty(dirs, rows, gsize)
        dn = gates.new_empty(dirs, batch, hidden)
        acc_gh = gates.new_zeros(dirs, gsize) if gh is not None and need[4] else None
        acc_gc = gates.new_zeros(dirs, hidden) if gc is not None and (need[5] or need[6]) else None
        acc_bc = gates.new_zeros(dirs, hidden) if acc_gc is not None else None
        acc_peep = gates.new_zeros(dirs, 3 * hidden) if peep is not None and need[7] else None
        # with a projection: the kernel's output gradient is d h1 (dy1), its own state gradient stays 0
        dy1, dhk, dhp = ((gates.new_empty(dirs, rows, hidden), gates.new_zeros(dirs, batch, hidden),
                          gates.new_empty(dirs, rows, out_size)) if proj else (dy, dh, None))
        offsets = ctx.offsets
        P_ = {k: _steps(v, offsets) for k, v in dict(dy1=dy1, chist=chist, gates=gates, c1=c1, th=th, rhat=rhat,
                                                      rrstd=rrstd, chat=chat, crstd=crstd, zc=zc, zh=zh, dpre=dpre,
                                                      dr=dr).items()}
        fixed = (address(dn), address(acc_gh), address(acc_gc), address(acc_bc), address(acc_peep), threads)
        for t in range(len(ctx.active) - 1, -1, -1):
            n, o = ctx.active[t], offsets[t]
            if proj:  # back through y = h, zoneout of h, proj_clip and the projection
                dtot = dy[:, o:o + n] + dh[:, :n]
                kh = zh[:, o:o + n] if zh is not None else zh_const
                if isinstance(kh, float) and kh == 0:
                    g_hp, dh[:, :n] = dtot, 0
                else:
                    g_hp, dh[:, :n] = (1 - kh) * dtot, kh * dtot
                if keep is not None:
                    g_hp = g_hp * keep[:, o:o + n]
                dhp[:, o:o + n] = g_hp
                dy1[:, o:o + n] = torch.bmm(g_hp, w_hr)
            bwd(dirs, batch, n, hidden, rows, P_["dy1"][t], dhk.data_ptr(), dc.data_ptr(), P_["chist"][t],
                P_["gates"][t], P_["c1"][t], P_["th"][t], P_["rhat"][t], P_["rrstd"][t], P_["chat"][t], P_["crstd"][t],
                address(gh), address(gc), address(peep), clip, P_["zc"][t], None if proj else P_["zh"][t], zc_const,
                0.0 if proj else zh_const, P_["dpre"][t], P_["dr"][t], *fixed)
            g = torch.bmm(dr[:, o:o + n], w_hh)  # (D, n, P)
            if rmask is not None:
                g.mul_(rmask[:, :n])
            dh[:, :n] += g
        # one GEMM each over all packed rows: dW_hh[d] = dr[d]^T hd[d], dW_hr[d] = dhp[d]^T y1[d]
        d_w_hh = torch.bmm(dr.transpose(1, 2), hd) if need[3] else None
        d_w_hr = torch.bmm(dhp.transpose(1, 2), y1) if proj and need[8] else None
        return (dpre if need[0] else None, dh if need[1] else None, dc if need[2] else None, d_w_hh, acc_gh,
                acc_gc if need[5] else None, acc_bc if need[6] else None, acc_peep, d_w_hr, None, None, None, None,
                None)




class GRURecurrence(torch.autograd.Function):
    """The GRU time loop of one layer, all directions, on packed rows (``_native/gru.c``).

    Inputs: xp (D, N, G=3H) input pre-activations incl. b_ih (LayerNorm applied); h0 (D, B, H);
    w_hh (D, G, H); b_hh (D, G) | None (added after the recurrent LayerNorm, inside r * (.) for
    the n gate, as torch.nn.GRU); gh (D, G) | None recurrent LayerNorm gain; rmask (D, B, H) |
    None; zh (D, N, H) | None zoneout keep-mask; active: the T active-prefix sizes; consts:
    (z_h,) used where the mask is None. Returns y (D, N, H), h_n (D, B, H).
    """

    @staticmethod
    def forward(ctx, xp, h0, w_hh, b_hh, gh, rmask, zh, active, consts):
        dirs, rows, gsize = xp.shape
        hidden, batch = gsize // 3, h0.size(1)
        (zh_const,) = consts
        fwd = getattr(_gru_lib(), f"gru_step_forward_{_SUFFIX[xp.dtype]}")
        threads = torch.get_num_threads()
        xp = xp.contiguous()
        h = h0.contiguous().clone()
        e = lambda *s: xp.new_empty(dirs, rows, *s)  # noqa: E731  (every row gets written)
        y, gates, hbn, hist, hd = e(hidden), e(gsize), e(hidden), e(hidden), e(hidden)
        rhat, rrstd = (e(gsize), e()) if gh is not None else (None, None)
        rmask = rmask.contiguous() if rmask is not None else None
        zh = zh.contiguous() if zh is not None else None
        b_hh = b_hh.contiguous() if b_hh is not None else None
        hd[:, :active[0]] = h * rmask if rmask is not None else h
        w_t = w_hh.transpose(1, 2)
        offsets = _offsets(active)
        P_ = {k: _steps(v, offsets) for k, v in dict(xp=xp, y=y, gates=gates, hbn=hbn, hist=hist, hd=hd, rhat=rhat,
                                                      rrstd=rrstd, zh=zh).items()}
        last = len(active) - 1
        for t, n in enumerate(active):
            o = offsets[t]
            r = torch.bmm(hd[:, o:o + n], w_t)  # (D, n, G) contiguous
            fwd(dirs, batch, n, active[t + 1] if t < last else 0, hidden, rows, P_["xp"][t], r.data_ptr(), h.data_ptr(),
                address(rmask), address(b_hh), P_["y"][t], P_["gates"][t], P_["hbn"][t], P_["hist"][t],
                P_["hd"][t + 1] if t < last else None, P_["rhat"][t], P_["rrstd"][t], address(gh), EPS, P_["zh"][t],
                zh_const, threads)
        ctx.save_for_backward(w_hh, gh, rmask, zh, gates, hbn, hist, hd, rhat, rrstd)
        ctx.active, ctx.offsets, ctx.consts, ctx.batch, ctx.has_bias = active, offsets, consts, batch, b_hh is not None
        return y, h

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dh_n):
        w_hh, gh, rmask, zh, gates, hbn, hist, hd, rhat, rrstd = ctx.saved_tensors
        dirs, rows, gsize = gates.shape
        hidden, batch = gsize // 3, ctx.batch
        (zh_const,) = ctx.consts
        bwd = getattr(_gru_lib(), f"gru_step_backward_{_SUFFIX[gates.dtype]}")
        threads = torch.get_num_threads()
        need = ctx.needs_input_grad
        dy = dy.contiguous() if dy is not None else gates.new_zeros(dirs, rows, hidden)
        dh = dh_n.contiguous().clone() if dh_n is not None else gates.new_zeros(dirs, batch, hidden)
        dpre, dhb = gates.new_empty(dirs, rows, gsize), gates.new_empty(dirs, rows, gsize)
        dr = dhb if gh is None else gates.new_empty(dirs, rows, gsize)
        acc_gh = gates.new_zeros(dirs, gsize) if gh is not None and need[4] else None
        offsets = ctx.offsets
        P_ = {k: _steps(v, offsets) for k, v in dict(dy=dy, hist=hist, gates=gates, hbn=hbn, rhat=rhat, rrstd=rrstd,
                                                      zh=zh, dpre=dpre, dhb=dhb, dr=dr).items()}
        for t in range(len(ctx.active) - 1, -1, -1):
            n, o = ctx.active[t], offsets[t]
            bwd(dirs, batch, n, hidden, rows, P_["dy"][t], dh.data_ptr(), P_["hist"][t], P_["gates"][t], P_["hbn"][t],
                P_["rhat"][t], P_["rrstd"][t], address(gh), P_["zh"][t], zh_const, P_["dpre"][t], P_["dhb"][t],
                P_["dr"][t], address(acc_gh), threads)
            g = torch.bmm(dr[:, o:o + n], w_hh)  # (D, n, H)
            if rmask is not None:
                g.mul_(rmask[:, :n])
            dh[:, :n] += g
        d_w_hh = torch.bmm(dr.transpose(1, 2), hd) if need[2] else None  # one GEMM over all packed rows
        d_b_hh = dhb.sum(1) if ctx.has_bias and need[3] else None
        return dpre if need[0] else None, dh if need[1] else None, d_w_hh, d_b_hh, acc_gh, None, None, None, None
