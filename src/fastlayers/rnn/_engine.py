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
from ._options import CellOptions

EPS = 1e-5
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
P = ctypes.c_void_p


def _lib():
    lib = _native.load("lstm")
    if lib is not None and not getattr(lib, "_fastlayers_typed", False):
        for suffix, real in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
            f = getattr(lib, f"lstm_step_forward_{suffix}")
            i64 = ctypes.c_int64
            f.argtypes = [i64] * 4 + [P, P, i64, P, P, P] + [P] * 4 + [real, real] + [P, P, real, real] + [P] * 7 + [ctypes.c_int]
            f.restype = None
            b = getattr(lib, f"lstm_step_backward_{suffix}")
            b.argtypes = [i64] * 4 + [P] * 4 + [P] * 7 + [P, P, P, real] + [P, P, real, real] + [P] * 3 + [ctypes.c_int]
            b.restype = None
        lib._fastlayers_typed = True
    return lib


def engine_available(x: Tensor) -> bool:
    """True when the fused C step kernels can run on this tensor (CPU, float32/64, compiler)."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and _lib() is not None


def _p(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class LSTMRecurrence(torch.autograd.Function):
    """The time loop of one layer, all directions. Inputs (time already local per direction):

    xp (T, D, B, G) input pre-activations incl. bias; h0, c0 (D, B, H); w_hh (D, G, H);
    gh (D, G) | None recurrent LayerNorm gain; gc, bc (D, H) | None cell LayerNorm gain, bias;
    peep (D, 3H) | None; rmask (D, B, H) | None recurrent-dropout mask (scaled);
    zc, zh (T, D, B, H) | None zoneout keep-masks; active: tuple of T active-prefix sizes;
    consts: (cell_clip or 0, z_c, z_h) (the z are used where the masks are None).
    Returns y (T, D, B, H) (zero for inactive rows), h_n, c_n (D, B, H).
    """

    @staticmethod
    def forward(ctx, xp, h0, c0, w_hh, gh, gc, bc, peep, rmask, zc, zh, active, consts):
        steps, dirs, batch, gsize = xp.shape
        hidden = gsize // 4
        clip, zc_const, zh_const = consts
        fwd = getattr(_lib(), f"lstm_step_forward_{_SUFFIX[xp.dtype]}")
        threads = torch.get_num_threads()
        h, c = h0.contiguous().clone(), c0.contiguous().clone()
        z = lambda *s: xp.new_zeros(*s)  # noqa: E731  (inactive rows must read as 0 after the loop)
        y, gates, c1, th = z(steps, dirs, batch, hidden), z(steps, dirs, batch, gsize), z(steps, dirs, batch, hidden), \
            xp.new_empty(steps, dirs, batch, hidden)
        chist, hd = z(steps, dirs, batch, hidden), z(steps, dirs, batch, hidden)
        rhat = z(steps, dirs, batch, gsize) if gh is not None else None
        rrstd = xp.new_empty(steps, dirs, batch) if gh is not None else None
        chat = z(steps, dirs, batch, hidden) if gc is not None else None
        crstd = xp.new_empty(steps, dirs, batch) if gc is not None else None
        w_t = w_hh.transpose(1, 2)
        at = lambda buf, t: None if buf is None else _p(buf[t])  # noqa: E731
        for t, n in enumerate(active):
            chist[t, :, :n] = c[:, :n]
            hin = h[:, :n] if rmask is None else h[:, :n] * rmask[:, :n]
            hd[t, :, :n] = hin
            r = torch.bmm(hin, w_t)  # (D, n, G) contiguous
            fwd(dirs, batch, n, hidden, _p(xp[t]), _p(r), n, _p(c), _p(h), _p(y[t]), _p(gh), _p(gc), _p(bc), _p(peep),
                clip, EPS, at(zc, t), at(zh, t), zc_const, zh_const, _p(gates[t]), _p(c1[t]), _p(th[t]), at(rhat, t),
                at(rrstd, t), at(chat, t), at(crstd, t), threads)
        ctx.save_for_backward(w_hh, gh, gc, peep, rmask, zc, zh, gates, c1, th, chist, hd, rhat, rrstd, chat, crstd)
        ctx.active, ctx.consts = active, consts
        return y, h, c

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dh_n, dc_n):
        w_hh, gh, gc, peep, rmask, zc, zh, gates, c1, th, chist, hd, rhat, rrstd, chat, crstd = ctx.saved_tensors
        steps, dirs, batch, gsize = gates.shape
        hidden = gsize // 4
        clip, zc_const, zh_const = ctx.consts
        bwd = getattr(_lib(), f"lstm_step_backward_{_SUFFIX[gates.dtype]}")
        threads = torch.get_num_threads()
        dy = dy.contiguous() if dy is not None else gates.new_zeros(steps, dirs, batch, hidden)
        dh = dh_n.contiguous().clone() if dh_n is not None else gates.new_zeros(dirs, batch, hidden)
        dc = dc_n.contiguous().clone() if dc_n is not None else gates.new_zeros(dirs, batch, hidden)
        dpre = gates.new_zeros(steps, dirs, batch, gsize)
        dr = dpre if gh is None else gates.new_zeros(steps, dirs, batch, gsize)
        dn = gates.new_zeros(steps, dirs, batch, hidden) if gc is not None else None
        at = lambda buf, t: None if buf is None else _p(buf[t])  # noqa: E731
        for t in range(steps - 1, -1, -1):
            n = ctx.active[t]
            bwd(dirs, batch, n, hidden, _p(dy[t]), _p(dh), _p(dc), _p(chist[t]), _p(gates[t]), _p(c1[t]), _p(th[t]),
                at(rhat, t), at(rrstd, t), at(chat, t), at(crstd, t), _p(gh), _p(gc), _p(peep), clip, at(zc, t),
                at(zh, t), zc_const, zh_const, _p(dpre[t]), _p(dr[t]), at(dn, t), threads)
            g = torch.bmm(dr[t, :, :n], w_hh)  # (D, n, H)
            if rmask is not None:
                g.mul_(rmask[:, :n])
            dh[:, :n] += g
        need = ctx.needs_input_grad
        d_w_hh = torch.einsum("tdbg,tdbh->dgh", dr, hd) if need[3] else None
        d_gh = (dpre * rhat).sum((0, 2)) if gh is not None and need[4] else None
        d_gc = (dn * chat).sum((0, 2)) if gc is not None and need[5] else None
        d_bc = dn.sum((0, 2)) if gc is not None and need[6] else None
        d_peep = None
        if peep is not None and need[7]:
            d_peep = torch.cat([(dpre[..., :hidden] * chist).sum((0, 2)), (dpre[..., hidden : 2 * hidden] * chist).sum((0, 2)),
                                (dpre[..., 3 * hidden :] * c1).sum((0, 2))], dim=1)
        return (dpre if need[0] else None, dh if need[1] else None, dc if need[2] else None, d_w_hh, d_gh, d_gc, d_bc,
                d_peep, None, None, None, None, None)


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
    for li, dir_params in enumerate(layers):
        # one GEMM for all steps and directions
        w_ih = torch.cat([p["weight_ih"] for p in dir_params])
        pre = torch.matmul(x, w_ih.T).view(run, batch, dirs, 4 * hidden)
        if options.layer_norm:
            pre = F.layer_norm(pre, (4 * hidden,), eps=EPS) * torch.stack([p["ln_ih_weight"] for p in dir_params])
        if "bias_ih" in dir_params[0]:
            pre = pre + torch.stack([p["bias_ih"] + p["bias_hh"] for p in dir_params])
        xps = []
        for d in range(dirs):
            part = pre[:, :, d]
            if d == 1:
                part = part.reshape(run * batch, -1).index_select(0, rev).view(run, batch, -1)
            xps.append(part)
        xp = torch.stack(xps, dim=1).contiguous()  # (T, D, B, G)
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
                zm = torch.bernoulli(torch.full((run, dirs, batch, hidden), prob, dtype=x.dtype, device=dev))
            elif zm is not None:  # (D, T, B, H) original order -> local time, sorted batch
                zm = zm[:, :run].index_select(2, order_d)
                parts = [zm[0]] + ([zm[1].reshape(run * batch, hidden).index_select(0, rev).view(run, batch, hidden)]
                                   if dirs == 2 else [])
                zm = torch.stack(parts, dim=1).contiguous()
            zmasks.append(zm)
        consts = (clip, 0.0 if training else z_c, 0.0 if training else z_h)
        k = slice(li * dirs, (li + 1) * dirs)
        stack = lambda name, use=True: torch.stack([p[name] for p in dir_params]) if use else None  # noqa: E731
        ln, peep = options.layer_norm, options.peephole
        y, hl, cl = LSTMRecurrence.apply(
            xp, h0[k], c0[k], stack("weight_hh"), stack("ln_hh_weight", ln), stack("ln_cell_weight", ln),
            stack("ln_cell_bias", ln), stack("weight_peephole", peep), rmask, zmasks[0], zmasks[1], active, consts)
        outs = []
        for d in range(dirs):
            part = y[:, d]
            if d == 1:
                part = part.reshape(run * batch, hidden).index_select(0, rev).view(run, batch, hidden)
            outs.append(part)
        x = torch.cat(outs, dim=2) if dirs == 2 else outs[0]
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
        h_n.append(hl)
        c_n.append(cl)
    out = x.index_select(1, unorder_d)
    if run < steps:
        out = F.pad(out, (0, 0, 0, 0, 0, steps - run))
    return out, (torch.cat(h_n).index_select(1, unorder_d), torch.cat(c_n).index_select(1, unorder_d))
