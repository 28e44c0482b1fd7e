"""The GPU engine's layers as autograd Functions: :class:`LSTMLayer` and :class:`GRULayer` run one
layer (all directions) as a loop of Triton step kernels (``fastlayers._triton.lstm`` / ``gru``)
between the input projection and the input gradients (torch's GEMMs), over the loop driver of
:mod:`._gpu_graphs` (chunks of steps captured in CUDA graphs and replayed, or run eagerly); their
double backward differentiates the reference twin (:func:`._reference.layer_reference`). The
driver that stacks the layers and directions is :mod:`._gpu`; the engine's layout, grid and
precision rules are described there.

Legend: T time (padded), B batch, F input features, H hidden size, P output size (proj_size, or H),
G gates, D directions, N value rows (the varlen form: the sum of the lengths).

Both Functions also run the varlen form (``varlen``, issue 66): x (N, F), the sequences one after
another, and every buffer of the loops sized by N instead of T x B (:mod:`fastlayers._triton._cell`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .._core import jagged, precision as _precision, twice as _twice
from . import _gpu_graphs
from ._gpu_graphs import TIME
from ._common import as_dtype, in_dtypes
from ._reference import layer_reference, recorded_layer_backward

EPS = 1e-5


def _project_input(mm: _precision.Products, x: Tensor, w_ih: Tensor, bias: Tensor | None) -> Tensor:
    """x (T, B, F) @ W_ih^T for every direction, one GEMM: (T, B, D, G) in mm.acc, + bias if given
    (varlen: x (N, F) -> (N, D, G)). x (D, T, B, F), each direction's own input: one batched GEMM,
    then laid out as (T, B, D, G)."""
    features = x.size(-1)
    dirs, gsize, _ = w_ih.shape
    if x.dim() == 4:
        steps, batch = x.shape[1:3]
        xp = mm.bmm(x.reshape(dirs, steps * batch, features), w_ih.transpose(1, 2))  # (D, T*B, G)
        if bias is not None:
            xp += bias.unsqueeze(1).to(xp.dtype)
        return xp.view(dirs, steps, batch, gsize).permute(1, 2, 0, 3).contiguous()
    xp = mm.matmul(x.reshape(-1, features), w_ih.reshape(dirs * gsize, features).t())
    if bias is not None:
        xp += bias.reshape(1, dirs * gsize).to(xp.dtype)
    return xp.view(*x.shape[:-1], dirs, gsize)


def _input_grads(mm, dpre: Tensor, x: Tensor, w_ih: Tensor, need_x: bool, need_w: bool):
    """dX (T, B, F) and dW_ih (D, G, F) from dpre (T, B, D, G): one GEMM each (varlen: dpre
    (N, D, G), dX (N, F)). With x (D, T, B, F) (each direction's own input): dX (D, T, B, F),
    batched GEMMs."""
    dirs, gsize = dpre.shape[-2:]
    if x.dim() == 4:
        steps, batch = dpre.shape[:2]
        per_dir = dpre.permute(2, 0, 1, 3).reshape(dirs, steps * batch, gsize)
        d_x = mm.bmm(per_dir, w_ih).view(dirs, steps, batch, -1) if need_x else None
        d_w = mm.bmm(per_dir.transpose(1, 2), x.reshape(dirs, steps * batch, -1)) if need_w else None
        return d_x, d_w
    flat = dpre.reshape(-1, dirs * gsize)
    d_x = mm.matmul(flat, w_ih.reshape(dirs * gsize, -1)).view(x.shape) if need_x else None
    d_w = mm.matmul(flat.t(), x.reshape(-1, x.size(-1))).view(dirs, gsize, -1) if need_w else None
    return d_x, d_w


def _outer(mm, a: Tensor, b: Tensor) -> Tensor:
    """sum over (T, B) of a^T b per direction: a (D, T, B, X), b (D, T, B, Y) -> (D, X, Y)."""
    dirs = a.size(0)
    return mm.bmm(a.reshape(dirs, -1, a.size(-1)).transpose(1, 2), b.reshape(dirs, -1, b.size(-1)))


def _slices(w: Tensor) -> int:
    """S: the partial sums a step's recurrent product a @ w (w (D, K, N), prepared) is split into
    (:mod:`fastlayers._triton.step_matmul`)."""
    from .._triton import step_matmul

    return step_matmul.slices(w.size(1))


def _product(mm, w: Tensor, st: dict) -> Callable[[Tensor, tuple[Tensor, int], Tensor], Tensor]:
    """A time loop's product with the prepared ``w`` (D, K, N): ``product(a, at, out)`` -> out
    (S, D, B, N) or (D, B, N), the S partial sums of step clock[0] + j of a (D, TC, B, K), at =
    (clock, j) (:mod:`fastlayers._triton.step_matmul`; a mixed-precision call rounds a to its low
    dtype, as :meth:`fastlayers._core.precision.Products.bmm_prepared`); in the varlen layout
    (``st["starts"]`` given) a (D, TC, K), the rows of the step gathered by the lengths and starts."""
    from .._triton import step_matmul

    low = mm.low if mm.mixed and w.dtype == mm.acc else None
    rows = (st["lengths"], st["starts"]) if st.get("starts") is not None else None
    return lambda a, at, out: step_matmul.matmul(a, w, out, at, low, rows)


def _tf32() -> bool:
    """Whether float32 step products use TF32 (read when a loop is captured: part of its key)."""
    return torch.backends.cuda.matmul.allow_tf32


def lengths_tensor(lengths: Tensor | None, steps: int, batch: int, like: Tensor) -> Tensor:
    """The lengths as the kernels read them: (B,) int64 on like's device, all T when None."""
    if lengths is not None:
        return lengths
    return _gpu_graphs.constant(("lengths", steps, batch, like.device),
                            lambda: torch.full((batch,), steps, dtype=torch.int64, device=like.device), like.device)


def numbers_tensor(kernels, consts: tuple, like: Tensor) -> Tensor:
    """``kernels.scalars(consts, EPS)`` as a tensor in like's dtype and device, a :func:`._gpu_graphs.constant`."""
    return _gpu_graphs.constant(("numbers", kernels.__name__, consts, like.dtype, like.device),
                            lambda: _gpu_graphs.values(kernels.scalars(consts, EPS), like.dtype, like.device), like.device)


def _state_buffer(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A state the time loop writes over: a contiguous copy of ``t`` in ``dtype``."""
    return t.to(dtype, copy=True, memory_format=torch.contiguous_format)


def _result(loop: _gpu_graphs.Loop, t: Tensor, dtype: torch.dtype) -> Tensor:
    """A result of the loops in ``dtype``: a copy where the loop's buffers are an entry's (the next
    call replays into the same memory), else the buffer itself when already in ``dtype``."""
    if loop.captured:
        return t.to(dtype, copy=True)
    return t if t.dtype == dtype else t.to(dtype)


def _rows_sum(t: Tensor | None) -> Tensor | None:
    """A parameter gradient from its per-row sums over the steps (D, B, X), which the backward
    kernels accumulate in place: the sum over the rows, (D, X)."""
    return None if t is None else t.sum(1)


def _zero(st: dict, *names: str) -> None:
    """The per-row sums among ``names`` that this backward has, zeroed before its loop."""
    for name in names:
        if st.get(name) is not None:
            st[name].zero_()


class Varlen(NamedTuple):
    """The varlen form of a layer call: ``plan`` (:func:`fastlayers._core.jagged.varlen`, time-major:
    the lengths, T and each value row's padded row) and ``starts`` (B,) int64 on the values' device,
    the first value row of each sequence."""

    plan: jagged.Varlen
    starts: Tensor

    @staticmethod
    def of(plan: jagged.Varlen, device: torch.device) -> "Varlen":
        return Varlen(plan, (torch.cumsum(plan.lengths, 0) - plan.lengths).to(device, non_blocking=True))


def _layout(x: Tensor, batch: int, dirs: int, varlen: Varlen | None) -> tuple[int, int, tuple, tuple, tuple]:
    """(T, the extent of the buffers' TIME dimension, the step layout's leading dimensions, the time
    layout's, the output's leading shape): padded (T, T, (D, TIME, B), (TIME, B, D), (T, B)); varlen
    (T, N, (D, TIME), (TIME, D), (N,)): the loops run T steps over buffers of N rows."""
    if varlen is None:
        steps = x.size(-3)
        return steps, steps, (dirs, TIME, batch), (TIME, batch, dirs), (steps, batch)
    rows = x.size(0)
    return varlen.plan.steps, rows, (dirs, TIME), (TIME, dirs), (rows,)


def _first_rows(varlen: Varlen | None, lengths: Tensor, dirs: int) -> Tensor | None:
    """Varlen: the row of each sequence's first step per direction (D, B), starts (forward) and
    starts + len - 1 (reverse), where the loop's prologue writes the initial recurrent input."""
    if varlen is None:
        return None
    return torch.stack([varlen.starts, varlen.starts + lengths - 1][:dirs])


def _first_inputs(st: dict) -> None:
    """The recurrent input of every row's first step, h_0 (* the recurrent mask): step 0 of hd
    (padded), or each sequence's first row per direction (varlen)."""
    h = st["h"] * st["rmask"] if st["rmask"] is not None else st["h"]
    if st.get("first") is None:
        st["hd"][:, 0] = h
        return
    for d in range(h.size(0)):
        st["hd"][d].index_copy_(0, st["first"][d], h[d])


class LSTMLayer(torch.autograd.Function):
    """One LSTM layer, all directions, padded layout with lengths as data.

    Inputs: x (T, B, F); w_ih (D, G, F); gx (D, G) | None input LayerNorm gain; bias (D, G) | None
    (b_ih + b_hh); h0 (D, B, P), c0 (D, B, H); w_hh (D, G, P); gh (D, G) | None; gc, bc (D, H) |
    None; peep (D, 3H) | None (i, f, o); w_hr (D, P, H) | None; rmask (D, B, P) | None (scaled);
    zc (D, T, B, H), zh (D, T, B, P) | None zoneout keep-masks in original order; lengths (B,) int64
    on x's device | None (all T); consts (cell_clip or 0, z_c, z_h, proj_clip or 0); varlen: a
    :class:`Varlen` for the varlen form (x (N, F), zc / zh (D, N, *), lengths given), else None.
    Returns y (T, B, D*P) (zeros at padding; varlen (N, D*P)), h_n (D, B, P), c_n (D, B, H). The time
    loops run on the buffers of a :class:`._gpu_graphs.Loop` (captured chunks replayed, or eagerly),
    kept on ``ctx.loop`` for the backward.
    """

    @staticmethod
    def forward(ctx, x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, lengths, consts, varlen):
        from .._triton import lstm as kernels

        ctx.dtypes = [t.dtype if t is not None else None for t in (x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep,
                                                                    w_hr)]
        originals = (x, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, lengths)  # see backward
        mm = _precision.Products.of(x)  # read the autocast state before switching it off
        with torch.autocast(x.device.type, enabled=False):
            acc = mm.acc
            dirs, gsize, _ = w_ih.shape
            batch, hidden, out_size = h0.size(1), gsize // 4, h0.size(2)
            steps, extent, step, timed, lead = _layout(x, batch, dirs, varlen)
            _, zc_const, _, pclip = consts
            ln, proj = gx is not None, w_hr is not None
            gx, bias, gh, gc, bc, peep, rmask, zc, zh = (as_dtype(t, acc) for t in (gx, bias, gh, gc, bc, peep, rmask, zc,
                                                                               zh))
            xp = _project_input(mm, x, w_ih, None if ln else bias)  # with LayerNorm the kernel adds the bias
            # the state buffers: fresh contiguous copies (to(copy=True) alone keeps a transposed hx's
            # strides, and the kernels index rows of a contiguous (D, B, *) state)
            ins = dict(xp=xp, bias=bias, gx=gx, h=_state_buffer(h0, acc), c=_state_buffer(c0, acc),
                       w_t=mm.operand(w_hh.transpose(1, 2)).contiguous(),
                       w_hr_t=mm.operand(w_hr.transpose(1, 2)).contiguous() if proj else None,
                       gh=gh, gc=gc, bc=bc, peep=peep, rmask=rmask, zc=zc, zh=zh,
                       lengths=lengths_tensor(lengths, steps, batch, x), starts=varlen.starts if varlen else None,
                       first=_first_rows(varlen, lengths, dirs), numbers=numbers_tensor(kernels, consts, xp))
            outs = dict(
                gates=(*step, gsize), c1=(*step, hidden), hd=(*step, out_size),
                chist=(*step, hidden) if zc is not None or zc_const else None,
                xstat=(*step, 2) if ln else None, rhat=(*step, gsize) if ln else None, rrstd=step if ln else None,
                cstat=(*step, 2) if ln else None, y1=(*step, hidden) if proj else None,
                keep=(*step, out_size) if proj and pclip else None, y=(*timed, out_size),
                r=(dirs, batch, gsize), hp=(dirs, batch, out_size) if proj else None)
            loop = _gpu_graphs.open(ctx, ("LSTM", consts, mm.low, _tf32(), varlen is not None), steps, ins, outs,
                                    _TIMED, extent)
            loop.run("forward", loop.st, _first_inputs,
                     lambda st, js: _lstm_forward_steps(kernels, mm, st, consts, js))
            st = loop.st
        # c0 as the backward's kernels read it: contiguous rows (an initial state expanded over the
        # batch, h0.expand(-1, B, -1), has stride 0 there), in the accumulation dtype
        ctx.save_for_backward(*originals, x, w_ih, c0.to(acc).contiguous(), w_hh, w_hr)
        ctx.loop, ctx.mm, ctx.consts, ctx.has_bias = loop, mm, consts, bias is not None
        ctx.varlen = varlen
        # captured: the state and output are copies (the next call replays into the same memory)
        return (_result(loop, st["y"][:extent].view(*lead, dirs * out_size), mm.low),
                _result(loop, st["h"], _precision.state_dtype(mm)),
                _result(loop, st["c"], _precision.state_dtype(mm)))

    @staticmethod
    def backward(ctx, dy, dh_n, dc_n):
        from .._triton import lstm as kernels

        if _twice.recording(dy, dh_n, dc_n):  # create_graph: a differentiable recomputation instead of the kernels
            return _recorded_backward("LSTM", ctx, (dy, dh_n, dc_n))
        x, w_ih, c0, w_hh, w_hr = ctx.saved_tensors[16:]
        loop, mm, need = ctx.loop, ctx.mm, ctx.needs_input_grad
        fwd = loop.st
        dirs, gsize, _ = w_ih.shape
        batch, hidden, out_size = c0.size(1), gsize // 4, w_hh.size(2)
        _, _, step, timed, lead = _layout(x, batch, dirs, ctx.varlen)
        ln, proj = fwd["gx"] is not None, w_hr is not None
        like = fwd["numbers"]
        acc = like.dtype
        with torch.autocast(like.device.type, enabled=False):
            dy = (dy.to(acc).contiguous() if dy is not None else like.new_zeros(*lead, dirs * out_size)
                  ).view(*lead, dirs, out_size)
            dh = dh_n.to(acc, copy=True).contiguous() if dh_n is not None else like.new_zeros(dirs, batch, out_size)
            dc = dc_n.to(acc, copy=True).contiguous() if dc_n is not None else like.new_zeros(dirs, batch, hidden)
            w = mm.operand(w_hh).contiguous()  # (a user's column-major weight: step_matmul reads rows)
            ins = dict(dy=dy, dh=dh, dc=dc, c0=c0, w_hh=w, w_hr=mm.operand(w_hr).contiguous() if proj else None)
            row = (dirs, batch)  # the parameter gradients' per-row sums over the steps
            outs = dict(
                dpre=(*timed, gsize), dr=(*step, gsize),
                pgx=(*row, gsize) if ln and need[2] else None, pb=(*row, gsize) if ln and ctx.has_bias and need[3]
                else None, pgh=(*row, gsize) if ln and need[7] else None,
                pgc=(*row, hidden) if ln and (need[8] or need[9]) else None,
                pbc=(*row, hidden) if ln and (need[8] or need[9]) else None,
                ppeep=(*row, 3 * hidden) if fwd["peep"] is not None and need[10] else None,
                dhp=(*step, out_size) if proj else None, g=(_slices(w), dirs, batch, out_size),
                dy1=(dirs, batch, hidden) if proj else None, dhk=(dirs, batch, hidden) if proj else None)
            st = loop.add(ins, outs, {"dy": 0})
            loop.run("backward", st, _lstm_backward_prologue,
                     lambda st, js: _lstm_backward_steps(kernels, mm, st, ctx.consts, js), reverse=True)
            g = st["g"].sum(0)
            dh = st["dh"] + (g * st["rmask"] if st["rmask"] is not None else g)
            dc = st["dc"].clone()
            cut = loop.cut(st)
            d_x, d_w_ih = _input_grads(mm, cut["dpre"], x, w_ih, need[0], need[1])
            d_bias = None
            if ctx.has_bias and need[3]:
                d_bias = _rows_sum(cut["pb"]) if ln else cut["dpre"].flatten(0, -3).sum(0)
            d_w_hh = _outer(mm, cut["dr"], cut["hd"]) if need[6] else None
            d_w_hr = _outer(mm, cut["dhp"], cut["y1"]) if proj and need[11] else None
            out = (d_x, d_w_ih, _rows_sum(cut["pgx"]), d_bias, dh if need[4] else None, dc if need[5] else None,
                   d_w_hh, _rows_sum(cut["pgh"]), _rows_sum(cut["pgc"]) if need[8] else None,
                   _rows_sum(cut["pbc"]) if need[9] else None, _rows_sum(cut["ppeep"]), d_w_hr)
        _gpu_graphs.backward_done(ctx)
        return (*in_dtypes(out, ctx.dtypes), None, None, None, None, None, None)


_TIMED = {"xp": 0, "zc": 1, "zh": 1}  # the time dimension of the layers' inputs with one


def _lstm_forward_steps(kernels, mm, st: dict, consts, js) -> None:
    """Steps clock[0] + j, j in ``js``, of the forward time loop, on the tensors of ``st`` only (so
    that they can be captured and replayed)."""
    proj, hd, lengths, clock, starts = st["w_hr_t"] is not None, st["hd"], st["lengths"], st["clock"], st["starts"]
    product = _product(mm, st["w_t"], st)
    project = _product(mm, st["w_hr_t"], st) if proj else None
    for j in js:
        at = (clock, j)
        product(hd, at, st["r"])
        kernels.step_forward(at, lengths, st["xp"], st["bias"], st["gx"], st["r"], None if proj else st["h"], st["c"],
                             None if proj else st["rmask"], st["gh"], st["gc"], st["bc"], st["peep"], st["zc"],
                             None if proj else st["zh"], None if proj else st["y"], None if proj else hd, st, consts,
                             st["numbers"], starts)
        if proj:
            project(st["y1"], at, st["hp"])
            kernels.project(at, lengths, st["hp"], st["h"], st["rmask"], st["zh"], st["keep"], st["y"], hd,
                            st["numbers"], starts)


def _lstm_backward_prologue(st: dict) -> None:
    st["g"].zero_()  # the recurrent part of the gradient before the loop's first step
    _zero(st, "dhk", "pgx", "pb", "pgh", "pgc", "pbc", "ppeep")


def _lstm_backward_steps(kernels, mm, st: dict, consts, js) -> None:
    """Steps clock[0] + j, j in ``js`` (clock[0] counting down), of the backward time loop on the
    tensors of ``st`` only; leaves dh, dc as the gradients of h_0, c_0 but for the recurrent part
    of the first step, g (added after the loop)."""
    proj, lengths, dh, rmask, clock = st["w_hr"] is not None, st["lengths"], st["dh"], st["rmask"], st["clock"]
    starts = st["starts"]
    product = _product(mm, st["w_hh"], st)
    back_project = _product(mm, st["w_hr"], st) if proj else None
    for j in js:
        at = (clock, j)
        if proj:  # back through the projection first; the kernel's own h gradient stays 0
            kernels.project_backward(at, lengths, st["dy"], dh, st["g"], rmask, st["zh"], st["keep"], st["dhp"],
                                     st["numbers"], starts)
            back_project(st["dhp"], at, st["dy1"])
            kernels.step_backward(at, lengths, st["dy1"], st["dhk"], st["dc"], st["g"], None, st["c0"], st["xp"],
                                  st["gx"], st["gh"], st["gc"], st["bc"], st["peep"], st["zc"], None, st, st, consts,
                                  st["numbers"], starts, True)
        else:
            kernels.step_backward(at, lengths, st["dy"], dh, st["dc"], st["g"], rmask, st["c0"], st["xp"], st["gx"],
                                  st["gh"], st["gc"], st["bc"], st["peep"], st["zc"], st["zh"], st, st, consts,
                                  st["numbers"], starts, False)
        product(st["dr"], at, st["g"])


class GRULayer(torch.autograd.Function):
    """One GRU layer, all directions, padded layout with lengths as data.

    Inputs: x (T, B, F); w_ih (D, G, F); gx (D, G) | None; b_ih (D, G) | None; h0 (D, B, H); w_hh
    (D, G, H); b_hh (D, G) | None; gh (D, G) | None; rmask (D, B, H) | None; zh (D, T, B, H) |
    None; lengths (B,) | None; consts (z_h,); varlen as :class:`LSTMLayer`'s. Returns y (T, B, D*H)
    (varlen (N, D*H)), h_n (D, B, H). Loops as :class:`LSTMLayer`'s.
    """

    @staticmethod
    def forward(ctx, x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, lengths, consts, varlen):
        from .._triton import gru as kernels

        ctx.dtypes = [t.dtype if t is not None else None for t in (x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh)]
        originals = (x, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, lengths)  # see backward
        mm = _precision.Products.of(x)
        with torch.autocast(x.device.type, enabled=False):
            acc = mm.acc
            dirs, gsize, _ = w_ih.shape
            batch, hidden = h0.size(1), gsize // 3
            steps, extent, step, timed, lead = _layout(x, batch, dirs, varlen)
            ln = gx is not None
            gx, b_ih, b_hh, gh, rmask, zh = (as_dtype(t, acc) for t in (gx, b_ih, b_hh, gh, rmask, zh))
            xp = _project_input(mm, x, w_ih, None if ln else b_ih)
            ins = dict(xp=xp, b_ih=b_ih, gx=gx, h=_state_buffer(h0, acc),
                       w_t=mm.operand(w_hh.transpose(1, 2)).contiguous(), b_hh=b_hh, gh=gh, rmask=rmask, zh=zh,
                       lengths=lengths_tensor(lengths, steps, batch, x), starts=varlen.starts if varlen else None,
                       first=_first_rows(varlen, lengths, dirs), numbers=numbers_tensor(kernels, consts[0], xp))
            outs = dict(gates=(*step, gsize), hbn=(*step, hidden), hist=(*step, hidden), hd=(*step, hidden),
                        xstat=(*step, 2) if ln else None, rhat=(*step, gsize) if ln else None,
                        rrstd=step if ln else None, y=(*timed, hidden), r=(dirs, batch, gsize))
            loop = _gpu_graphs.open(ctx, ("GRU", mm.low, _tf32(), varlen is not None), steps, ins, outs, _TIMED,
                                    extent)
            loop.run("forward", loop.st, _first_inputs, lambda st, js: _gru_forward_steps(kernels, mm, st, js))
            st = loop.st
        ctx.save_for_backward(*originals, x, w_ih, w_hh)
        ctx.loop, ctx.mm, ctx.has_bias, ctx.consts = loop, mm, (b_ih is not None, b_hh is not None), consts
        ctx.varlen = varlen
        return (_result(loop, st["y"][:extent].view(*lead, dirs * hidden), mm.low),
                _result(loop, st["h"], _precision.state_dtype(mm)))

    @staticmethod
    def backward(ctx, dy, dh_n):
        from .._triton import gru as kernels

        if _twice.recording(dy, dh_n):  # create_graph: a differentiable recomputation instead of the kernels
            return _recorded_backward("GRU", ctx, (dy, dh_n))
        x, w_ih, w_hh = ctx.saved_tensors[11:]
        loop, mm, need = ctx.loop, ctx.mm, ctx.needs_input_grad
        fwd = loop.st
        dirs, gsize, _ = w_ih.shape
        batch, hidden = fwd["h"].size(1), gsize // 3
        _, _, step, timed, lead = _layout(x, batch, dirs, ctx.varlen)
        ln = fwd["gx"] is not None
        like = fwd["numbers"]
        acc = like.dtype
        with torch.autocast(like.device.type, enabled=False):
            dy = (dy.to(acc).contiguous() if dy is not None else like.new_zeros(*lead, dirs * hidden)
                  ).view(*lead, dirs, hidden)
            dh = dh_n.to(acc, copy=True).contiguous() if dh_n is not None else like.new_zeros(dirs, batch, hidden)
            row = (dirs, batch, gsize)  # the parameter gradients' per-row sums over the steps
            w = mm.operand(w_hh).contiguous()  # (a user's column-major weight: step_matmul reads rows)
            outs = dict(dpre=(*timed, gsize), dr=(*step, gsize),
                        dhb=row if ln and ctx.has_bias[1] and need[6] else None,
                        pgx=row if ln and need[2] else None,
                        pb=row if ln and ctx.has_bias[0] and need[3] else None,
                        pgh=row if ln and need[7] else None, g=(_slices(w), dirs, batch, hidden))
            st = loop.add(dict(dy=dy, dh=dh, w_hh=w), outs, {"dy": 0})
            loop.run("backward", st, _gru_backward_prologue, lambda st, js: _gru_backward_steps(kernels, mm, st, js),
                     reverse=True)
            g = st["g"].sum(0)
            dh = st["dh"] + (g * st["rmask"] if st["rmask"] is not None else g)
            cut = loop.cut(st)
            d_x, d_w_ih = _input_grads(mm, cut["dpre"], x, w_ih, need[0], need[1])
            d_b_ih = (_rows_sum(cut["pb"]) if ln else cut["dpre"].flatten(0, -3).sum(0)) \
                if ctx.has_bias[0] and need[3] else None
            d_w_hh = _outer(mm, cut["dr"], cut["hd"]) if need[5] else None
            d_b_hh = (_rows_sum(cut["dhb"]) if ln else cut["dr"].flatten(1, -2).sum(1)) \
                if ctx.has_bias[1] and need[6] else None
            out = (d_x, d_w_ih, _rows_sum(cut["pgx"]), d_b_ih, dh if need[4] else None, d_w_hh, d_b_hh,
                   _rows_sum(cut["pgh"]))
        _gpu_graphs.backward_done(ctx)
        return (*in_dtypes(out, ctx.dtypes), None, None, None, None, None)


def _gru_forward_steps(kernels, mm, st: dict, js) -> None:
    hd, clock = st["hd"], st["clock"]
    product = _product(mm, st["w_t"], st)
    for j in js:
        at = (clock, j)
        product(hd, at, st["r"])
        kernels.step_forward(at, st["lengths"], st["xp"], st["b_ih"], st["gx"], st["r"], st["h"], st["rmask"],
                             st["b_hh"], st["gh"], st["zh"], st["y"], hd, st, st["numbers"], st["starts"])


def _gru_backward_prologue(st: dict) -> None:
    st["g"].zero_()
    _zero(st, "dhb", "pgx", "pb", "pgh")


def _gru_backward_steps(kernels, mm, st: dict, js) -> None:
    clock = st["clock"]
    product = _product(mm, st["w_hh"], st)
    for j in js:
        at = (clock, j)
        kernels.step_backward(at, st["lengths"], st["dy"], st["dh"], st["g"], st["rmask"], st["xp"], st["gx"],
                              st["gh"], st["zh"], st, st, st["numbers"], st["starts"])
        product(st["dr"], at, st["g"])


def _recorded_backward(cell: str, ctx, grads: tuple) -> tuple[Tensor | None, ...]:
    """The backward of a layer while it is being recorded (create_graph): the vector-Jacobian product
    of :func:`~._reference.layer_reference` (padded layout, lengths as data) on the saved
    inputs (:mod:`fastlayers._core.twice`)."""
    count = 15 if cell == "LSTM" else 10
    inputs, lengths = ctx.saved_tensors[:count], ctx.saved_tensors[count]
    if inputs[0].dim() == 4:
        raise RuntimeError(f"fastlayers: a {cell} layer run with per-direction inputs (checkpoint_every's segments) "
                           "cannot differentiate twice; the layer's second derivatives recompute it whole instead")
    plan = ctx.varlen.plan if ctx.varlen is not None else None

    def layout(x, params, states, options, masks):
        if plan is None:
            return layer_reference(cell, x, params, states, lengths, options, masks)
        # varlen: the padded reference between pad and unpad (differentiable index ops); the
        # zoneout masks (D, N, *) padded per direction
        masks = {k: torch.stack([jagged.pad(m, plan, batch_first=False) for m in v]) if k.startswith("zoneout")
                 else v for k, v in masks.items()}
        y, *finals = layer_reference(cell, jagged.pad(x, plan, batch_first=False), params, states, lengths, options,
                                     masks)
        return (jagged.unpad(y, plan), *finals)

    return (*recorded_layer_backward(cell, ctx, grads, inputs, layout), None, None, None)
