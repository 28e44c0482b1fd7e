"""The recurrent engine: LSTM with cell options at vendor speed, hand-written backward.

Legend: T time, B batch (sorted longest first), F input features, H hidden size, G = 4H,
D directions, L layers.

Per layer: the input projection of all steps and both directions is one GEMM (plus LayerNorm
and bias, in torch ops with autograd); :class:`LSTMRecurrence` then runs the time loop with one
batched recurrent GEMM (both directions) and one fused C pointwise kernel per step
(``_native/lstm.c``), on the still-active prefix of the length-sorted batch only. Its backward
runs the per-step kernel and recurrent GEMM in reverse, and computes the recurrent weight
gradient and the LayerNorm / peephole parameter gradients as large reductions after the loop.
The reverse direction reads each sequence back to front from its own last step (one gather), so
both directions share the active prefix and lengths cost nothing extra.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _native
from .._native import address
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
            f.argtypes = [i64] * 5 + [P] * 5 + [P] * 6 + [P] * 4 + [P] * 4 + [real, real] + [P, P, real, real] + [ctypes.c_int]
            f.restype = None
            b = getattr(lib, f"lstm_step_backward_{suffix}")
            b.argtypes = [i64] * 5 + [P] * 3 + [P] * 4 + [P] * 4 + [P, P, P, real] + [P, P, real, real] + [P] * 7 + [ctypes.c_int]
            b.restype = None
        lib._fastlayers_typed = True
    return lib


def engine_available(x: Tensor) -> bool:
    """True when the fused C step kernels can run on this tensor (CPU, float32/64, compiler)."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and _lib() is not None


def _steps(buf: Tensor | None, steps: int) -> list[int | None]:
    """Addresses of (d=0, t, b=0) of a contiguous [D, T, B, ...] buffer for every t (computed once)."""
    if buf is None:
        return [None] * (steps + 1)
    stride = buf.stride(1) * buf.element_size()
    return [buf.data_ptr() + t * stride for t in range(steps)] + [None]


class LSTMRecurrence(torch.autograd.Function):
    """The time loop of one layer, all directions (time already local per direction).

    Inputs: xp (D, T, B, G) input pre-activations incl. bias; h0, c0 (D, B, H); w_hh (D, G, H);
    gh (D, G) | None recurrent LayerNorm gain; gc, bc (D, H) | None cell LayerNorm gain, bias;
    peep (D, 3H) | None; rmask (D, B, H) | None recurrent-dropout mask (scaled);
    zc, zh (D, T, B, H) | None zoneout keep-masks; active: tuple of T active-prefix sizes;
    consts: (cell_clip or 0, z_c, z_h) (the z are used where the masks are None).
    Returns y (D, T, B, H) (zero on inactive rows), h_n, c_n (D, B, H).
    """

    @staticmethod
    def forward(ctx, xp, h0, c0, w_hh, gh, gc, bc, peep, rmask, zc, zh, active, consts):
        dirs, steps, batch, gsize = xp.shape
        hidden = gsize // 4
        clip, zc_const, zh_const = consts
        fwd = getattr(_lib(), f"lstm_step_forward_{_SUFFIX[xp.dtype]}")
        threads = torch.get_num_threads()
        xp = xp.contiguous()
        h, c = h0.contiguous().clone(), c0.contiguous().clone()
        e = lambda *s: xp.new_empty(dirs, steps, batch, *s)  # noqa: E731  (the kernel writes every row)
        y, gates, c1, th, chist, hd = e(hidden), e(gsize), e(hidden), e(hidden), e(hidden), e(hidden)
        rhat, rrstd = (e(gsize), e()) if gh is not None else (None, None)
        chat, crstd = (e(hidden), e()) if gc is not None else (None, None)
        rmask = rmask.contiguous() if rmask is not None else None
        zc = zc.contiguous() if zc is not None else None
        zh = zh.contiguous() if zh is not None else None
        hd[:, 0] = h * rmask if rmask is not None else h
        w_t = w_hh.transpose(1, 2)
        ds = steps * batch
        P_ = {k: _steps(v, steps) for k, v in dict(xp=xp, y=y, gates=gates, c1=c1, th=th, chist=chist, hd=hd, rhat=rhat,
                                                    rrstd=rrstd, chat=chat, crstd=crstd, zc=zc, zh=zh).items()}
        fixed = (address(gh), address(gc), address(bc), address(peep), clip, EPS)
        for t, n in enumerate(active):
            r = torch.bmm(hd[:, t, :n], w_t)  # (D, n, G) contiguous
            fwd(dirs, batch, n, hidden, ds, P_["xp"][t], r.data_ptr(), c.data_ptr(), h.data_ptr(), address(rmask),
                P_["y"][t], P_["gates"][t], P_["c1"][t], P_["th"][t], P_["chist"][t], P_["hd"][t + 1],
                P_["rhat"][t], P_["rrstd"][t], P_["chat"][t], P_["crstd"][t], *fixed,
                P_["zc"][t], P_["zh"][t], zc_const, zh_const, threads)
        ctx.save_for_backward(w_hh, gh, gc, peep, rmask, zc, zh, gates, c1, th, chist, hd, rhat, rrstd, chat, crstd)
        ctx.active, ctx.consts = active, consts
        return y, h, c

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dh_n, dc_n):
        w_hh, gh, gc, peep, rmask, zc, zh, gates, c1, th, chist, hd, rhat, rrstd, chat, crstd = ctx.saved_tensors
        dirs, steps, batch, gsize = gates.shape
        hidden = gsize // 4
        clip, zc_const, zh_const = ctx.consts
        bwd = getattr(_lib(), f"lstm_step_backward_{_SUFFIX[gates.dtype]}")
        threads = torch.get_num_threads()
        need = ctx.needs_input_grad
        dy = dy.contiguous() if dy is not None else gates.new_zeros(dirs, steps, batch, hidden)
        dh = dh_n.contiguous().clone() if dh_n is not None else gates.new_zeros(dirs, batch, hidden)
        dc = dc_n.contiguous().clone() if dc_n is not None else gates.new_zeros(dirs, batch, hidden)
        dpre = gates.new_empty(dirs, steps, batch, gsize)
        dr = dpre if gh is None else gates.new_empty(dirs, steps, batch, gsize)
        dn = gates.new_empty(dirs, batch, hidden)
        acc_gh = gates.new_zeros(dirs, gsize) if gh is not None and need[4] else None
        acc_gc = gates.new_zeros(dirs, hidden) if gc is not None and (need[5] or need[6]) else None
        acc_bc = gates.new_zeros(dirs, hidden) if acc_gc is not None else None
        acc_peep = gates.new_zeros(dirs, 3 * hidden) if peep is not None and need[7] else None
        ds = steps * batch
        P_ = {k: _steps(v, steps) for k, v in dict(dy=dy, chist=chist, gates=gates, c1=c1, th=th, rhat=rhat, rrstd=rrstd,
                                                    chat=chat, crstd=crstd, zc=zc, zh=zh, dpre=dpre, dr=dr).items()}
        fixed = (address(dn), address(acc_gh), address(acc_gc), address(acc_bc), address(acc_peep), threads)
        for t in range(steps - 1, -1, -1):
            n = ctx.active[t]
            bwd(dirs, batch, n, hidden, ds, P_["dy"][t], dh.data_ptr(), dc.data_ptr(), P_["chist"][t], P_["gates"][t],
                P_["c1"][t], P_["th"][t], P_["rhat"][t], P_["rrstd"][t], P_["chat"][t], P_["crstd"][t], address(gh),
                address(gc), address(peep), clip, P_["zc"][t], P_["zh"][t], zc_const, zh_const, P_["dpre"][t], P_["dr"][t],
                *fixed)
            g = torch.bmm(dr[:, t, :n], w_hh)  # (D, n, H)
            if rmask is not None:
                g.mul_(rmask[:, :n])
            dh[:, :n] += g
        d_w_hh = None
        if need[3]:  # one GEMM over all steps: dW_hh[d] = dr[d]^T hd[d]
            d_w_hh = torch.bmm(dr.view(dirs, steps * batch, gsize).transpose(1, 2), hd.view(dirs, steps * batch, hidden))
        return (dpre if need[0] else None, dh if need[1] else None, dc if need[2] else None, d_w_hh, acc_gh,
                acc_gc if need[5] else None, acc_bc if need[6] else None, acc_peep, None, None, None, None, None)


def reverse_rows(lengths: Tensor, steps: int, batch: int) -> Tensor:
    """Flat (T*B) row index mapping (t, b) -> (len_b - 1 - t, b) for t < len_b, else itself (an involution)."""
    t = torch.arange(steps).unsqueeze(1)
    src = torch.where(t < lengths.unsqueeze(0), lengths.unsqueeze(0) - 1 - t, t)
    return (src * batch + torch.arange(batch).unsqueeze(0)).flatten()


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
        input: (T, B, F). hx: (h_0, c_0), each (L*D, B, H).
        layers: per layer, per direction, a dict of parameters: ``weight_ih`` (G, F_l),
            ``weight_hh`` (G, H), optional ``bias_ih``/``bias_hh`` (G); with layer_norm
            ``ln_ih_weight``, ``ln_hh_weight`` (G), ``ln_cell_weight``, ``ln_cell_bias`` (H);
            with peephole ``weight_peephole`` (3H, order i, f, o).
        lengths: (B,) CPU int64 (validated) or None (all T).
        options: :class:`CellOptions`.
        masks: optional per-layer dict with ``recurrent`` (D, B, H) and ``zoneout_h`` /
            ``zoneout_c`` (D, T, B, H) keep-masks in original time and batch order (tests pass
            them to compare with the reference); sampled here in training when None.

    Returns:
        output (T, B, D*H) with zeros at t >= len_b; (h_n, c_n) each (L*D, B, H), torch's packed
        semantics.
    """
    steps, batch, _ = input.shape
    dirs = len(layers[0])
    hidden = layers[0][0]["weight_hh"].size(1)
    if lengths is None:
        lengths = torch.full((batch,), steps, dtype=torch.int64)
    sorted_lengths, order = torch.sort(lengths, descending=True, stable=True)
    unorder = torch.empty_like(order)
    unorder[order] = torch.arange(batch)
    run = int(sorted_lengths[0]) if batch else 0
    active = tuple((sorted_lengths > t).sum().item() for t in range(run))
    dev = input.device
    order_d, unorder_d = order.to(dev), unorder.to(dev)
    rev = reverse_rows(sorted_lengths, run, batch).to(dev)
    x = input[:run].index_select(1, order_d)
    h0, c0 = (s.index_select(1, order_d) for s in hx)
    clip = options.cell_clip or 0.0
    z_h, z_c = options.zoneout
    h_n, c_n = [], []
    flip = lambda t: t.reshape(run * batch, -1).index_select(0, rev).view(run, batch, -1)  # noqa: E731
    for li, dir_params in enumerate(layers):
        stack = lambda name, use=True: torch.stack([p[name] for p in dir_params]) if use else None  # noqa: E731
        # input projection of all steps and directions: one batched GEMM, (D, T*B, F) x (D, F, G)
        xs = x.reshape(1, run * batch, -1) if dirs == 1 else torch.stack([x, flip(x)]).view(2, run * batch, -1)
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
        xp = pre.view(dirs, run, batch, 4 * hidden)
        m = (masks[li] if masks is not None else None) or {}
        rmask = m.get("recurrent")
        if rmask is None and training and options.recurrent_dropout > 0:
            keep = 1 - options.recurrent_dropout
            rmask = torch.bernoulli(torch.full((dirs, batch, hidden), keep, dtype=x.dtype, device=dev)) / keep
        elif rmask is not None:
            rmask = rmask.index_select(1, order_d).contiguous()
        zmasks = []
        for key, prob in (("zoneout_c", z_c), ("zoneout_h", z_h)):
            zm = m.get(key)
            if zm is None and training and prob > 0:
                zm = torch.bernoulli(torch.full((dirs, run, batch, hidden), prob, dtype=x.dtype, device=dev))
            elif zm is not None:  # (D, T, B, H) in original time and batch order -> local time, sorted batch
                zm = zm[:, :run].index_select(2, order_d)
                zm = torch.stack([zm[0]] + ([flip(zm[1])] if dirs == 2 else []))
            zmasks.append(zm)
        consts = (clip, 0.0 if training else z_c, 0.0 if training else z_h)
        k = slice(li * dirs, (li + 1) * dirs)
        ln, peep = options.layer_norm, options.peephole
        y, hl, cl = LSTMRecurrence.apply(
            xp, h0[k], c0[k], stack("weight_hh"), stack("ln_hh_weight", ln), stack("ln_cell_weight", ln),
            stack("ln_cell_bias", ln), stack("weight_peephole", peep), rmask, zmasks[0], zmasks[1], active, consts)
        x = y[0] if dirs == 1 else torch.cat([y[0], flip(y[1])], dim=2)
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
        h_n.append(hl)
        c_n.append(cl)
    out = x.index_select(1, unorder_d)
    if run < steps:
        out = F.pad(out, (0, 0, 0, 0, 0, steps - run))
    return out, (torch.cat(h_n).index_select(1, unorder_d), torch.cat(c_n).index_select(1, unorder_d))
