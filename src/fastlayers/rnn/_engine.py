"""The recurrent engine: LSTM with cell options at vendor speed, hand-written backward.

Legend: T time, B batch (sorted longest first), F input features, H hidden size, G = 4H,
D directions, L layers, N = sum of the lengths (the valid rows of one direction).

Everything runs on *packed* rows (:mod:`._lengths`): the valid (t, b) of the length-sorted batch,
step after step, so step t's rows are a contiguous block of the still-active prefix, as in a
PackedSequence; the reverse direction's rows read each sequence back to front from its own last
step. Per layer: one gather of the valid input rows of both directions, the input projection of
all of them as one batched GEMM (plus LayerNorm and bias, in torch ops with autograd);
:class:`LSTMRecurrence` then runs the time loop with one batched recurrent GEMM (both directions)
and one fused C pointwise kernel per step (``_native/lstm.c``). Its backward runs the per-step
kernel and recurrent GEMM in reverse, and computes the recurrent weight gradient and the
LayerNorm / peephole parameter gradients as large reductions after the loop. The output is
scattered back to the padded (T, B, D*H) layout with one index_copy. Padding costs nothing: no
GEMM, kernel or reduction touches a padded row.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _native
from .._native import address
from ._lengths import make_plan
from ._options import CellOptions

EPS = 1e-5
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
P = ctypes.c_void_p


def _lib():
    lib = _native.load("lstm")
    if lib is not None and not getattr(lib, "_fastlayers_typed", False):
        i64 = ctypes.c_int64
        for suffix, real in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
            f = getattr(lib, f"lstm_step_forward_{suffix}")
            f.argtypes = [i64] * 6 + [P] * 5 + [P] * 6 + [P] * 4 + [P] * 4 + [real, real] + [P, P, real, real] + [ctypes.c_int]
            f.restype = None
            b = getattr(lib, f"lstm_step_backward_{suffix}")
            b.argtypes = [i64] * 5 + [P] * 3 + [P] * 4 + [P] * 4 + [P, P, P, real] + [P, P, real, real] + [P] * 7 + [ctypes.c_int]
            b.restype = None
        lib._fastlayers_typed = True
    return lib


def engine_available(x: Tensor) -> bool:
    """True when the fused C step kernels can run on this tensor (CPU, float32/64, compiler)."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and _lib() is not None


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
        fwd = getattr(_lib(), f"lstm_step_forward_{_SUFFIX[xp.dtype]}")
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
        offsets = tuple(int(o) for o in torch.tensor((0,) + active).cumsum(0).tolist())
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
        bwd = getattr(_lib(), f"lstm_step_backward_{_SUFFIX[gates.dtype]}")
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


def lstm_engine(
    input: Tensor,
    hx: tuple[Tensor, Tensor],
    layers: list[list[dict[str, Tensor]]],
    lengths: Tensor | None,
    options: CellOptions,
    *,
    dropout: float = 0.0,
    training: bool = False,
    masks: list[dict[str, Tensor]] | None = None,
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Multi-layer (bidirectional) LSTM with cell options over a time-major padded batch.

    Args:
        input: (T, B, F). hx: (h_0 (L*D, B, P), c_0 (L*D, B, H)); P = proj_size, or H without.
        layers: per layer, per direction, a dict of parameters: ``weight_ih`` (G, F_l),
            ``weight_hh`` (G, P), optional ``bias_ih``/``bias_hh`` (G); with layer_norm
            ``ln_ih_weight``, ``ln_hh_weight`` (G), ``ln_cell_weight``, ``ln_cell_bias`` (H);
            with peephole ``weight_peephole`` (3H, order i, f, o); with a projection
            ``weight_hr`` (P, H).
        lengths: (B,) CPU int64 (validated) or None (all T).
        options: :class:`CellOptions`.
        masks: optional per-layer dict with ``recurrent`` (D, B, P), ``zoneout_h`` (D, T, B, P)
            and ``zoneout_c`` (D, T, B, H) keep-masks in original time and batch order (tests pass
            them to compare with the reference); sampled here in training when None.

    Returns:
        output (T, B, D*P) with zeros at t >= len_b; h_n (L*D, B, P), c_n (L*D, B, H), torch's
        packed semantics.
    """
    steps, batch, _ = input.shape
    dirs = len(layers[0])
    hidden = layers[0][0]["weight_hh"].size(0) // 4
    proj = "weight_hr" in layers[0][0]
    out_size = layers[0][0]["weight_hr"].size(0) if proj else hidden
    dev = input.device
    if lengths is None:
        lengths = torch.full((batch,), steps, dtype=torch.int64)
    plan = make_plan(lengths, steps, False, dev)
    active = tuple(n for span, n in plan.segments for _ in range(span))
    rows = sum(active)
    # packed row k of direction d reads padded row src[d, k] of the (T*B, ...) input; the output
    # of direction d goes to column block d of padded row src[d, k]
    src = torch.stack([plan.forward_rows, plan.reverse_rows][:dirs])  # (D, N)
    dst = (src * dirs + torch.arange(dirs, device=dev).unsqueeze(1)).flatten()
    order = plan.sorted_indices
    h0, c0 = (s.index_select(1, order) for s in hx)
    clip = options.cell_clip or 0.0
    z_h, z_c = options.zoneout
    h_n, c_n = [], []
    x = input
    for li, dir_params in enumerate(layers):
        stack = lambda name, use=True: torch.stack([p[name] for p in dir_params]) if use else None  # noqa: E731
        # the valid rows of both directions (one gather), their input projection: one batched GEMM
        xs = x.reshape(steps * batch, -1).index_select(0, src.flatten()).view(dirs, rows, -1)
        w_ih_t = stack("weight_ih").transpose(1, 2)
        bias = (stack("bias_ih") + stack("bias_hh")).unsqueeze(1) if "bias_ih" in dir_params[0] else None
        if options.layer_norm:
            pre = torch.bmm(xs, w_ih_t)
            pre = F.layer_norm(pre, (4 * hidden,), eps=EPS) * stack("ln_ih_weight").unsqueeze(1)
            if bias is not None:
                pre = pre + bias
        elif bias is not None:
            pre = torch.baddbmm(bias, xs, w_ih_t)
        else:
            pre = torch.bmm(xs, w_ih_t)
        m = (masks[li] if masks is not None else None) or {}
        rmask = m.get("recurrent")
        if rmask is None and training and options.recurrent_dropout > 0:
            keep = 1 - options.recurrent_dropout
            rmask = torch.bernoulli(torch.full((dirs, batch, out_size), keep, dtype=x.dtype, device=dev)) / keep
        elif rmask is not None:
            rmask = rmask.index_select(1, order).contiguous()
        zmasks = []
        for key, prob, width in (("zoneout_c", z_c, hidden), ("zoneout_h", z_h, out_size)):
            zm = m.get(key)
            if zm is None and training and prob > 0:
                zm = torch.bernoulli(torch.full((dirs, rows, width), prob, dtype=x.dtype, device=dev))
            elif zm is not None:  # (D, T, B, width) in original time and batch order -> packed rows
                zm = torch.stack([zm[d].reshape(steps * batch, width).index_select(0, src[d]) for d in range(dirs)])
            zmasks.append(zm)
        consts = (clip, 0.0 if training else z_c, 0.0 if training else z_h, options.proj_clip or 0.0)
        k = slice(li * dirs, (li + 1) * dirs)
        ln, peep = options.layer_norm, options.peephole
        y, hl, cl = LSTMRecurrence.apply(
            pre, h0[k], c0[k], stack("weight_hh"), stack("ln_hh_weight", ln), stack("ln_cell_weight", ln),
            stack("ln_cell_bias", ln), stack("weight_peephole", peep), stack("weight_hr", proj), rmask, zmasks[0],
            zmasks[1], active, consts)
        # back to the padded layout: one scatter of both directions, zeros at t >= len_b
        x = y.new_zeros(steps * batch * dirs, out_size).index_copy(0, dst, y.reshape(dirs * rows, out_size))
        x = x.view(steps, batch, dirs * out_size)
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
        h_n.append(hl)
        c_n.append(cl)
    unorder = plan.unsorted_indices
    return x, (torch.cat(h_n).index_select(1, unorder), torch.cat(c_n).index_select(1, unorder))
