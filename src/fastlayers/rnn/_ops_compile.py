"""The engine's layers as custom operators (torch.library), for torch.compile.

``fastlayers::lstm_layer`` / ``gru_layer`` run one layer (all directions) exactly as
:class:`~fastlayers.rnn._cpu_recurrence.LSTMRecurrence` / ``GRURecurrence`` do (the same code), and
also return the buffers the backward needs; ``*_layer_backward`` take them back. Fake
implementations give torch.compile the shapes and dtypes, ``register_autograd`` the gradients, so
a compiled model traces around the time loop instead of breaking its graph there. Eager calls
keep the autograd Functions, whose buffers come from the reuse pool (:mod:`fastlayers._core.pool`);
an operator's outputs cannot come from it (autograd owns them), so the operators allocate theirs.

Absent optional buffers are returned as empty tensors (operators return no None); ``active``
(the T active-prefix sizes) is an int64 CPU tensor, so a new lengths vector does not make
torch.compile specialise on its values.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .._core import precision
from ._cpu_recurrence import GRURecurrence, LSTMRecurrence, _offsets

_LSTM_INPUTS = ("xs", "w_ih", "gx", "bias", "h0", "c0", "w_hh", "gh", "gc", "bc", "peep", "w_hr", "rmask", "zc", "zh")
_LSTM_BUFFERS = ("xp", "gates", "c1", "hd", "xstat", "rhat", "rrstd", "cstat", "chist", "y1", "keep")
_GRU_INPUTS = ("xs", "w_ih", "gx", "b_ih", "h0", "w_hh", "b_hh", "gh", "rmask", "zh")
_GRU_BUFFERS = ("xp", "gates", "hbn", "hist", "hd", "xstat", "rhat", "rrstd")
_GRADS = {"lstm": 12, "gru": 8}  # inputs with gradients: all tensors but the masks


class _Context:
    """What the Functions' forward and backward read and write on ``ctx``, for an operator call:
    buffers are fresh tensors (``fresh``), never the pool's; the operators take packed rows (no
    ``src`` index)."""

    fresh = True
    src = None

    def __init__(self, **attributes: Any) -> None:
        self.saved_tensors: tuple = ()
        self.__dict__.update(attributes)

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors


def _lstm_shapes(xs, w_ih, gx, h0, gh, gc, w_hr, zc, consts) -> dict[str, tuple | None]:
    """Shapes of the LSTM buffers (None: absent), as LSTMRecurrence allocates them."""
    dirs, rows = xs.shape[:2]
    gsize, out_size = w_ih.size(1), h0.size(2)
    hidden = gsize // 4
    proj = w_hr is not None
    return {"xp": (dirs, rows, gsize) if gx is not None else None, "gates": (dirs, rows, gsize),
            "c1": (dirs, rows, hidden), "hd": (dirs, rows, out_size), "xstat": (dirs, rows, 2) if gx is not None else None,
            "rhat": (dirs, rows, gsize) if gh is not None else None, "rrstd": (dirs, rows) if gh is not None else None,
            "cstat": (dirs, rows, 2) if gc is not None else None,
            "chist": (dirs, rows, hidden) if zc is not None or consts[1] else None,
            "y1": (dirs, rows, hidden) if proj else None, "keep": (dirs, rows, out_size) if proj and consts[3] else None}


def _gru_shapes(xs, w_ih, gx, gh) -> dict[str, tuple | None]:
    dirs, rows = xs.shape[:2]
    gsize = w_ih.size(1)
    hidden = gsize // 3
    return {"xp": (dirs, rows, gsize) if gx is not None else None, "gates": (dirs, rows, gsize),
            "hbn": (dirs, rows, hidden), "hist": (dirs, rows, hidden), "hd": (dirs, rows, hidden),
            "xstat": (dirs, rows, 2) if gx is not None else None, "rhat": (dirs, rows, gsize) if gh is not None else None,
            "rrstd": (dirs, rows) if gh is not None else None}


def _fake_outputs(xs: Tensor, shapes: dict[str, tuple | None], results: list[tuple[int, ...]]) -> tuple[Tensor, ...]:
    low, acc = precision.dtypes(xs)
    return (*(xs.new_empty(s, dtype=low) for s in results),
            *(xs.new_empty(s, dtype=torch.bool if k == "keep" else acc) if s is not None else xs.new_empty(0)
              for k, s in shapes.items()))


def _present(buffers: tuple[Tensor, ...], names: tuple[str, ...], shapes: dict) -> list[Tensor | None]:
    return [t if shapes[k] is not None else None for t, k in zip(buffers, names)]


# ---- LSTM

@torch.library.custom_op("fastlayers::lstm_layer", mutates_args=(), device_types="cpu")
def lstm_layer(xs: Tensor, w_ih: Tensor, gx: Optional[Tensor], bias: Optional[Tensor], h0: Tensor, c0: Tensor,
               w_hh: Tensor, gh: Optional[Tensor], gc: Optional[Tensor], bc: Optional[Tensor], peep: Optional[Tensor],
               w_hr: Optional[Tensor], rmask: Optional[Tensor], zc: Optional[Tensor], zh: Optional[Tensor],
               active: Tensor, consts: list[float]
               ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                          Tensor, Tensor]:
    """One LSTM layer: (y, h_n, c_n, *buffers) (see LSTMRecurrence; buffers in _LSTM_BUFFERS order)."""
    ctx = _Context()
    y, h, c = LSTMRecurrence.forward(ctx, xs, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh,
                                     tuple(active.tolist()), tuple(consts))
    buf = {**ctx.buf, "keep": ctx.saved_tensors[-1]}
    return y, h, c, *(buf[k] if buf[k] is not None else xs.new_empty(0) for k in _LSTM_BUFFERS)


@lstm_layer.register_fake
def _(xs, w_ih, gx, bias, h0, c0, w_hh, gh, gc, bc, peep, w_hr, rmask, zc, zh, active, consts):
    dirs, rows, batch = xs.size(0), xs.size(1), h0.size(1)
    return _fake_outputs(xs, _lstm_shapes(xs, w_ih, gx, h0, gh, gc, w_hr, zc, consts),
                         [(dirs, rows, h0.size(2)), (dirs, batch, h0.size(2)), (dirs, batch, c0.size(2))])


@torch.library.custom_op("fastlayers::lstm_layer_backward", mutates_args=(), device_types="cpu")
def lstm_layer_backward(inputs: list[Optional[Tensor]], buffers: list[Optional[Tensor]], dy: Optional[Tensor],
                        dh_n: Optional[Tensor], dc_n: Optional[Tensor], active: Tensor, consts: list[float],
                        low: torch.dtype, needs: list[bool]) -> list[Tensor]:
    """Gradients of the tensors of _LSTM_INPUTS but the masks (empty where not needed)."""
    a = dict(zip(_LSTM_INPUTS, inputs))
    buf = dict(zip(_LSTM_BUFFERS, buffers))
    steps = tuple(active.tolist())
    ctx = _Context(buf=buf, mm=precision.Products(low, precision.accumulator(low), a["xs"].device), active=steps,
                   offsets=_offsets(steps), consts=tuple(consts), batch=a["h0"].size(1), has_bias=a["bias"] is not None,
                   dtypes=[t.dtype if t is not None else None for t in inputs[:12]],
                   needs_input_grad=(*needs, False, False, False, False, False), release=lambda: None)
    ctx.saved_tensors = tuple(a[k] for k in _LSTM_INPUTS) + (buf["keep"],)
    grads = LSTMRecurrence.backward(ctx, dy, dh_n, dc_n)[:12]
    return [g if g is not None else a["xs"].new_empty(0) for g in grads]


@lstm_layer_backward.register_fake
def _(inputs, buffers, dy, dh_n, dc_n, active, consts, low, needs):
    return [t.new_empty(t.shape) if n and t is not None else inputs[0].new_empty(0) for t, n in zip(inputs, needs)]


def _lstm_setup(ctx, inputs, output):
    *tensors, active, consts = inputs
    shapes = _lstm_shapes(*(tensors[i] for i in (0, 1, 2, 4, 7, 8, 11, 13)), consts)
    ctx.save_for_backward(*tensors, *_present(output[3:], _LSTM_BUFFERS, shapes))
    ctx.active, ctx.consts, ctx.low = active, consts, precision.dtypes(tensors[0])[0]


def _lstm_backward(ctx, dy, dh_n, dc_n, *unused):
    return _backward(ctx, lstm_layer_backward, len(_LSTM_INPUTS), "lstm", (dy, dh_n, dc_n))


# ---- GRU

@torch.library.custom_op("fastlayers::gru_layer", mutates_args=(), device_types="cpu")
def gru_layer(xs: Tensor, w_ih: Tensor, gx: Optional[Tensor], b_ih: Optional[Tensor], h0: Tensor, w_hh: Tensor,
              b_hh: Optional[Tensor], gh: Optional[Tensor], rmask: Optional[Tensor], zh: Optional[Tensor], active: Tensor,
              consts: list[float]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One GRU layer: (y, h_n, *buffers) (see GRURecurrence; buffers in _GRU_BUFFERS order)."""
    ctx = _Context()
    y, h = GRURecurrence.forward(ctx, xs, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, tuple(active.tolist()),
                                 tuple(consts))
    return y, h, *(ctx.buf[k] if ctx.buf[k] is not None else xs.new_empty(0) for k in _GRU_BUFFERS)


@gru_layer.register_fake
def _(xs, w_ih, gx, b_ih, h0, w_hh, b_hh, gh, rmask, zh, active, consts):
    dirs, rows, (batch, hidden) = xs.size(0), xs.size(1), h0.shape[1:]
    return _fake_outputs(xs, _gru_shapes(xs, w_ih, gx, gh), [(dirs, rows, hidden), (dirs, batch, hidden)])


@torch.library.custom_op("fastlayers::gru_layer_backward", mutates_args=(), device_types="cpu")
def gru_layer_backward(inputs: list[Optional[Tensor]], buffers: list[Optional[Tensor]], dy: Optional[Tensor],
                       dh_n: Optional[Tensor], active: Tensor, consts: list[float], low: torch.dtype,
                       needs: list[bool]) -> list[Tensor]:
    """Gradients of the tensors of _GRU_INPUTS but the masks (empty where not needed)."""
    a = dict(zip(_GRU_INPUTS, inputs))
    steps = tuple(active.tolist())
    ctx = _Context(buf=dict(zip(_GRU_BUFFERS, buffers)), mm=precision.Products(low, precision.accumulator(low), a["xs"].device),
                   active=steps, offsets=_offsets(steps), consts=tuple(consts), batch=a["h0"].size(1),
                   has_bias=(a["b_ih"] is not None, a["b_hh"] is not None),
                   dtypes=[t.dtype if t is not None else None for t in inputs[:8]],
                   needs_input_grad=(*needs, False, False, False, False), release=lambda: None)
    ctx.saved_tensors = tuple(a[k] for k in _GRU_INPUTS)
    grads = GRURecurrence.backward(ctx, dy, dh_n)[:8]
    return [g if g is not None else a["xs"].new_empty(0) for g in grads]


@gru_layer_backward.register_fake
def _(inputs, buffers, dy, dh_n, active, consts, low, needs):
    return [t.new_empty(t.shape) if n and t is not None else inputs[0].new_empty(0) for t, n in zip(inputs, needs)]


def _gru_setup(ctx, inputs, output):
    *tensors, active, consts = inputs
    shapes = _gru_shapes(tensors[0], tensors[1], tensors[2], tensors[7])
    ctx.save_for_backward(*tensors, *_present(output[2:], _GRU_BUFFERS, shapes))
    ctx.active, ctx.consts, ctx.low = active, consts, precision.dtypes(tensors[0])[0]


def _gru_backward(ctx, dy, dh_n, *unused):
    return _backward(ctx, gru_layer_backward, len(_GRU_INPUTS), "gru", (dy, dh_n))


def _backward(ctx, op: Callable, n_inputs: int, cell: str, grads: tuple) -> tuple[Tensor | None, ...]:
    saved = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:_GRADS[cell]]]
    out = op(list(saved[:n_inputs]), list(saved[n_inputs:]), *grads, ctx.active, ctx.consts, ctx.low, needs)
    return (*(g if n else None for g, n in zip(out, needs)), *([None] * (n_inputs + 2 - _GRADS[cell])))


torch.library.register_autograd("fastlayers::lstm_layer", _lstm_backward, setup_context=_lstm_setup)
torch.library.register_autograd("fastlayers::gru_layer", _gru_backward, setup_context=_gru_setup)


def run_layer(cell: str, *args: Any, src: Tensor | None = None) -> tuple[Tensor, ...]:
    """One layer through the autograd Function (eager: pooled buffers) or, while torch.compile
    traces, through the custom operator. ``args``: the Function's inputs, ``active`` a tuple (or,
    traced, an int64 tensor: T and B stay symbolic) and ``consts`` a tuple; ``src``: the padded
    rows' index where the Function reads them itself (eager only:
    :func:`._cpu_recurrence.reads_rows`). Returns (y, h_n) or (y, h_n, c_n)."""
    if src is not None:
        return (LSTMRecurrence if cell == "LSTM" else GRURecurrence).apply(*args, src)
    if not torch.compiler.is_compiling():
        return (LSTMRecurrence if cell == "LSTM" else GRURecurrence).apply(*args)
    *tensors, active, consts = args
    op = lstm_layer if cell == "LSTM" else gru_layer
    active = active if isinstance(active, Tensor) else torch.tensor(active, dtype=torch.int64)
    out = op(*tensors, active, list(consts))
    return tuple(out[:3] if cell == "LSTM" else out[:2])
