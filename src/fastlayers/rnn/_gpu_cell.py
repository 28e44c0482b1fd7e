"""One step of ``LSTMCell`` / ``GRUCell`` with cell options on the Triton backend: the layers'
step kernels (:mod:`fastlayers._triton.lstm` / ``gru``) over one time step of one direction,
without the GPU engine's loop driver (:mod:`._gpu`, :mod:`._gpu_graphs`).

Legend: B batch, F input_size, H hidden_size, G gates (4H LSTM, 3H GRU), P the LSTM's h size
(proj_size, or H).

Why: a cell is called once per generated token, so its fixed cost is the call's cost. The same
step as separate torch ops (:func:`._reference.lstm_cell_step`) is about 19 launches
forward (two LayerNorms, the gate activations, clip, zoneout) and their autograd nodes; here it
is torch's two GEMMs (addmm with the bias where there is no LayerNorm), two state copies (the
kernels update the state in place) and one step kernel; with a projection one more GEMM and
kernel. The backward is one step kernel, the GEMMs of the input, weight and state gradients, and
the sums over the rows of the per-row terms of the LayerNorm and peephole gradients (which the
kernel adds into one zero-filled buffer).

Served (:func:`serves`): eager float32 / float64 calls without autocast, on CUDA where the
backend choice is Triton's (:func:`fastlayers._core.backend.triton_kernels`), or on CPU tensors under
Triton's interpreter with the backend forced to "triton" (tests). Everything else, including
torch.compile, TorchScript tracing, torch.func's transforms, mixed precision, an empty batch and
a recurrent mask that requires grad, runs the step as torch ops (:mod:`._cells`). Second derivatives: a recorded backward (``create_graph=True``)
differentiates :func:`_reference` on the saved inputs (:mod:`fastlayers._core.twice`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import precision, twice
from .._core.backend import forced, select, triton_kernels
from . import _gpu_graphs
from ._gpu_layers import lengths_tensor, numbers_tensor
from ._reference import gru_cell_step, layer_options, lstm_cell_step
from ._options import CellOptions
from ._common import as_dtype
from ._masks import keep_mask

_DTYPES = (torch.float32, torch.float64)


def serves(mode: str, x: Tensor, recurrent_mask: Tensor | None) -> bool:
    """Whether :func:`step` runs this call of a cell with options (module docstring)."""
    if (recurrent_mask is not None and recurrent_mask.requires_grad) or torch.compiler.is_compiling():
        return False  # (traced: the equations, torch ops; the backend's context variable is not read there)
    if not x.is_cuda:  # CPU tensors: Triton's interpreter, only where "triton" is forced (select may refuse it)
        chosen = forced()
        if chosen is None or chosen[0] != "triton":
            return False
    if x.dtype not in _DTYPES or x.size(0) == 0 or torch.jit.is_tracing() \
            or torch._C._are_functorch_transforms_active():  # (torch.func.vmap / grad: torch ops)
        return False
    if precision.autocasting(x.device.type):
        return False
    op = mode.lower()
    return triton_kernels(op, x) if x.is_cuda else select(op, x) == "triton"


def step(mode: str, x: Tensor, states: tuple[Tensor, ...], params: dict[str, Tensor], options: CellOptions,
         training: bool, recurrent_mask: Tensor | None) -> tuple[Tensor, ...]:
    """:func:`._cells.step` for a call that :func:`serves` admits: x (B, F), states (h (B, P),
    c (B, H)) or (h (B, H),), ``params`` by torch's names without suffix. Training zoneout draws
    its keep-masks here, as the equations do (h's first, then c's), from the same generator."""
    dtype = x.dtype

    def get(name: str) -> Tensor | None:
        return as_dtype(params.get(name), dtype)

    z_h, z_c = options.zoneout
    batch = x.size(0)
    recurrent_mask = as_dtype(recurrent_mask, dtype)

    def keep(z: float, width: int) -> Tensor | None:
        return keep_mask((batch, width), z, x.dtype, x.device) if training and z else None

    ln = options.layer_norm
    if mode == "LSTM":
        zh, zc = keep(z_h, states[0].size(1)), keep(z_c, states[1].size(1))
        bias = get("bias_ih")
        if bias is not None:
            bias = bias + get("bias_hh")  # the kernels take b_ih + b_hh, as the layer's
        consts = (float(options.cell_clip or 0.0), 0.0 if training else float(z_c), 0.0 if training else float(z_h),
                  float(options.proj_clip or 0.0))
        return LSTMStep.apply(x, params["weight_ih"], get("ln_ih_weight") if ln else None, bias, states[0],
                              states[1], params["weight_hh"], get("ln_hh_weight") if ln else None,
                              get("ln_cell_weight") if ln else None, get("ln_cell_bias") if ln else None,
                              get("weight_peephole"), get("weight_hr"), recurrent_mask, zc, zh, consts)
    zh = keep(z_h, states[0].size(1))
    return (GRUStep.apply(x, params["weight_ih"], get("ln_ih_weight") if ln else None, get("bias_ih"), states[0],
                          params["weight_hh"], get("bias_hh"), get("ln_hh_weight") if ln else None, recurrent_mask, zh,
                          (0.0 if training else float(z_h),)),)


def _at(x: Tensor) -> tuple[Tensor, int]:
    """The launch's step: clock [0, 1], j = 0 (:mod:`fastlayers._triton._cell`)."""
    return _gpu_graphs._clock(x.device, 1), 0


def _state_grad(dh: Tensor, dr: Tensor, w_hh: Tensor, rmask: Tensor | None) -> Tensor:
    """The gradient of the state before the step: the kernel's direct part dh (B, P) plus the
    recurrent product's, dr (B, G) @ w_hh through the recurrent mask."""
    back = dr @ w_hh
    return dh + (back * rmask if rmask is not None else back)


def _sums(like: Tensor, batch: int, widths: dict[str, int | None]) -> dict[str, Tensor | None]:
    """Zeroed per-row sums (1, B, width) for the names whose width is not None, carved from one
    zero-filled tensor (one fill for all of them: a cell's backward is a few launches)."""
    used = {k: w for k, w in widths.items() if w is not None}
    flat = like.new_zeros(batch * sum(used.values()))
    out: dict[str, Tensor | None] = dict.fromkeys(widths)
    offset = 0
    for k, w in used.items():
        out[k] = flat[offset:offset + batch * w].view(1, batch, w)
        offset += batch * w
    return out


def _sum(t: Tensor | None) -> Tensor | None:
    """A parameter gradient from the step kernel's per-row sums (1, B, X): the sum over the rows, (X,)."""
    return None if t is None else t.sum((0, 1))


class LSTMStep(torch.autograd.Function):
    """One LSTM step: x (B, F); w_ih (G, F); gx (G,) | None input LayerNorm gain; bias (G,) | None
    (b_ih + b_hh); h0 (B, P), c0 (B, H); w_hh (G, P); gh (G,) | None; gc, bc (H,) | None; peep
    (3H,) | None (i, f, o); w_hr (P, H) | None; rmask (B, P) | None (scaled); zc (B, H), zh (B, P)
    | None zoneout keep-masks; consts (cell_clip or 0, z_c, z_h, proj_clip or 0), the z used
    without masks. Returns (h_1 (B, P), c_1 (B, H))."""

    @staticmethod
    def forward(ctx, x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, consts):
        from .._triton import lstm as kernels

        batch, gsize, size = x.size(0), w_ih.size(0), h0.size(1)
        hidden = gsize // 4
        ln, proj = gx is not None, w_hr is not None
        h_in = h0 * rmask if rmask is not None else h0
        xp = torch.addmm(bias, x, w_ih.t()) if bias is not None and not ln else x @ w_ih.t()  # (B, G)
        r = h_in @ w_hh.t()
        new = xp.new_empty
        h = h0.clone(memory_format=torch.contiguous_format)
        c = c0.clone(memory_format=torch.contiguous_format)
        y = new(1, batch, 1, size)
        row = (1, 1, batch)
        buf = dict(gates=new(*row, gsize), c1=new(*row, hidden), xstat=new(*row, 2) if ln else None,
                   rhat=new(*row, gsize) if ln else None, rrstd=new(*row) if ln else None,
                   cstat=new(*row, 2) if ln else None, y1=new(*row, hidden) if proj else None)
        at, lengths, numbers = _at(x), lengths_tensor(None, 1, batch, x), numbers_tensor(kernels, consts, xp)
        xp = xp.view(1, batch, 1, gsize)
        hd = y.view(*row, size)  # the next step's recurrent input: never written over one step
        kernels.step_forward(at, lengths, xp, bias, gx, r,
                             None if proj else h.unsqueeze(0), c.unsqueeze(0), None if proj else rmask, gh, gc, bc,
                             peep, zc, None if proj else zh, None if proj else y, None if proj else hd, buf, consts,
                             numbers)
        keep_clip = None
        if proj:
            hp = buf["y1"].view(batch, hidden) @ w_hr.t()
            keep_clip = new(*row, size) if consts[3] else None
            kernels.project(at, lengths, hp.unsqueeze(0), h.unsqueeze(0), rmask, zh, keep_clip, y, hd, numbers)
        ctx.save_for_backward(x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, h_in)
        ctx.buf, ctx.xp, ctx.keep, ctx.consts = buf, xp if ln else None, keep_clip, consts
        return h, c

    @staticmethod
    def backward(ctx, dh1, dc1):
        from .._triton import lstm as kernels

        saved = ctx.saved_tensors
        if twice.recording(dh1, dc1):  # create_graph: a differentiable recomputation instead of the kernels
            return (*twice.recorded_vjp(lambda *t: _reference("LSTM", ctx.consts, *t), saved[:15], (dh1, dc1),
                                         ctx.needs_input_grad[:15]), None)
        x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, h_in = saved
        need, buf, consts = ctx.needs_input_grad, ctx.buf, ctx.consts
        batch, gsize, size = x.size(0), w_ih.size(0), h0.size(1)
        hidden = gsize // 4
        ln, proj = gx is not None, w_hr is not None
        new = x.new_empty
        row = (1, 1, batch)
        dy = (dh1.contiguous() if dh1 is not None else x.new_zeros(batch, size)).view(1, batch, 1, size)
        dc = dc1.clone(memory_format=torch.contiguous_format) if dc1 is not None else x.new_zeros(batch, hidden)
        z = x.new_zeros(2, batch, size)  # the state gradient before the step, and no recurrent part after it
        dh, g = z[:1], z[1:].view(*row, size)
        grads = dict(dpre=new(1, batch, 1, gsize), dr=new(*row, gsize), **_sums(x, batch, dict(  # the kernel adds to
            pgx=gsize if ln and need[2] else None, pb=gsize if ln and bias is not None and need[3] else None,
            pgh=gsize if ln and need[7] else None, pgc=hidden if ln and (need[8] or need[9]) else None,
            pbc=hidden if ln and (need[8] or need[9]) else None,
            ppeep=3 * hidden if peep is not None and need[10] else None)))
        at, lengths, numbers = _at(x), lengths_tensor(None, 1, batch, x), numbers_tensor(kernels, consts, x)
        c0v = c0.contiguous().unsqueeze(0)
        d_w_hr = None
        if proj:  # back through the projection first; the step kernel's own h gradient is then 0
            dhp = new(*row, size)
            kernels.project_backward(at, lengths, dy, dh, g, rmask, zh, ctx.keep, dhp, numbers)
            dy1 = (dhp.view(batch, size) @ w_hr).unsqueeze(0)
            kernels.step_backward(at, lengths, dy1, x.new_zeros(1, batch, hidden), dc.unsqueeze(0), g, None, c0v,
                                  ctx.xp, gx, gh, gc, bc, peep, zc, None, buf, grads, consts, numbers)
            d_w_hr = dhp.view(batch, size).t() @ buf["y1"].view(batch, hidden) if need[11] else None
        else:
            kernels.step_backward(at, lengths, dy, dh, dc.unsqueeze(0), g, rmask, c0v, ctx.xp, gx, gh, gc, bc, peep,
                                  zc, zh, buf, grads, consts, numbers)
        dpre, dr = grads["dpre"].view(batch, gsize), grads["dr"].view(batch, gsize)
        d_h0 = _state_grad(dh[0], dr, w_hh, rmask) if need[4] else None
        d_bias = None
        if bias is not None and need[3]:
            d_bias = _sum(grads["pb"]) if ln else dpre.sum(0)
        return (dpre @ w_ih if need[0] else None, dpre.t() @ x if need[1] else None, _sum(grads["pgx"]), d_bias, d_h0,
                dc if need[5] else None, dr.t() @ h_in if need[6] else None, _sum(grads["pgh"]),
                _sum(grads["pgc"]) if need[8] else None, _sum(grads["pbc"]) if need[9] else None,
                _sum(grads["ppeep"]), d_w_hr, None, None, None, None)


class GRUStep(torch.autograd.Function):
    """One GRU step: x (B, F); w_ih (G, F); gx (G,) | None; b_ih (G,) | None; h0 (B, H); w_hh
    (G, H); b_hh (G,) | None; gh (G,) | None; rmask (B, H) | None; zh (B, H) | None; consts
    (z_h,). Returns h_1 (B, H)."""

    @staticmethod
    def forward(ctx, x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, consts):
        from .._triton import gru as kernels

        batch, gsize, hidden = x.size(0), w_ih.size(0), h0.size(1)
        ln = gx is not None
        h_in = h0 * rmask if rmask is not None else h0
        xp = torch.addmm(b_ih, x, w_ih.t()) if b_ih is not None and not ln else x @ w_ih.t()
        r = h_in @ w_hh.t()
        new = xp.new_empty
        h = h0.clone(memory_format=torch.contiguous_format)
        y = new(1, batch, 1, hidden)
        row = (1, 1, batch)
        buf = dict(gates=new(*row, gsize), hbn=new(*row, hidden), hist=new(*row, hidden),
                   xstat=new(*row, 2) if ln else None, rhat=new(*row, gsize) if ln else None,
                   rrstd=new(*row) if ln else None)
        xp = xp.view(1, batch, 1, gsize)
        kernels.step_forward(_at(x), lengths_tensor(None, 1, batch, x), xp, b_ih, gx, r, h.unsqueeze(0), rmask,
                             b_hh, gh, zh, y, y.view(*row, hidden), buf, numbers_tensor(kernels, consts[0], xp))
        ctx.save_for_backward(x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, h_in)
        ctx.buf, ctx.xp, ctx.consts = buf, xp if ln else None, consts
        return h

    @staticmethod
    def backward(ctx, dh1):
        from .._triton import gru as kernels

        saved = ctx.saved_tensors
        if twice.recording(dh1):
            return (*twice.recorded_vjp(lambda *t: _reference("GRU", ctx.consts, *t), saved[:10], (dh1,),
                                         ctx.needs_input_grad[:10]), None)
        x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, h_in = saved
        need, buf = ctx.needs_input_grad, ctx.buf
        batch, gsize, hidden = x.size(0), w_ih.size(0), h0.size(1)
        ln = gx is not None
        new = x.new_empty
        row = (1, 1, batch, gsize)
        z = x.new_zeros(2, batch, hidden)
        dh, g = z[:1], z[1:].view(1, 1, batch, hidden)
        grads = dict(dpre=new(1, batch, 1, gsize), dr=new(*row), **_sums(x, batch, dict(  # the kernel adds to
            dhb=gsize if ln and b_hh is not None and need[6] else None, pgx=gsize if ln and need[2] else None,
            pb=gsize if ln and b_ih is not None and need[3] else None, pgh=gsize if ln and need[7] else None)))
        kernels.step_backward(_at(x), lengths_tensor(None, 1, batch, x), dh1.contiguous().view(1, batch, 1, hidden), dh, g,
                              rmask, ctx.xp, gx, gh, zh, buf, grads, numbers_tensor(kernels, ctx.consts[0], x))
        dpre, dr = grads["dpre"].view(batch, gsize), grads["dr"].view(batch, gsize)
        d_h0 = _state_grad(dh[0], dr, w_hh, rmask) if need[4] else None
        d_b_ih = (_sum(grads["pb"]) if ln else dpre.sum(0)) if b_ih is not None and need[3] else None
        d_b_hh = (_sum(grads["dhb"]) if ln else dr.sum(0)) if b_hh is not None and need[6] else None
        return (dpre @ w_ih if need[0] else None, dpre.t() @ x if need[1] else None, _sum(grads["pgx"]), d_b_ih, d_h0,
                dr.t() @ h_in if need[5] else None, d_b_hh, _sum(grads["pgh"]), None, None, None)


def _reference(mode: str, consts: tuple, *tensors: Tensor | None) -> tuple[Tensor, ...]:
    """The step of :class:`LSTMStep` / :class:`GRUStep` (their tensor inputs, in order) as
    differentiable torch ops: :func:`._reference.lstm_cell_step` / ``gru_cell_step`` and
    zoneout, keep * previous + (1 - keep) * new, keep the mask or the constant z."""
    if mode == "LSTM":
        x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh = tensors
        named = dict(weight_ih=w_ih, weight_hh=w_hh, ln_ih_weight=gx, ln_hh_weight=gh, ln_cell_weight=gc,
                     ln_cell_bias=bc, weight_peephole=peep, weight_hr=w_hr)
        if bias is not None:
            named.update(bias_ih=bias, bias_hh=torch.zeros_like(bias))
        _, z_c, z_h, _ = consts
        options = layer_options(consts, cell="LSTM", layer_norm=gx is not None, peephole=peep is not None)
        h_in = h0 * rmask if rmask is not None else h0
        h1, c1 = lstm_cell_step(x, h_in, c0, {k: v for k, v in named.items() if v is not None}, options)
        kh, kc = zh if zh is not None else z_h, zc if zc is not None else z_c
        return kh * h0 + (1 - kh) * h1, kc * c0 + (1 - kc) * c1
    x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh = tensors
    named = dict(weight_ih=w_ih, weight_hh=w_hh, bias_ih=b_ih, bias_hh=b_hh, ln_ih_weight=gx, ln_hh_weight=gh)
    options = layer_options(consts, cell="GRU", layer_norm=gx is not None)
    h_in = h0 * rmask if rmask is not None else h0
    h1 = gru_cell_step(x, h0, {k: v for k, v in named.items() if v is not None}, options, h_in)
    kh = zh if zh is not None else consts[0]
    return (kh * h0 + (1 - kh) * h1,)
