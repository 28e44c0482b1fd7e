"""The varlen form of the recurrent layers as operators: torch.compile without a graph break in
the layer, torch.export with a dynamic total length (issue 66).

Legend: N total rows (the sum of the lengths), B batch, F input features, H hidden size, P
output size (proj_size, or H), D directions.

While torch.compile or torch.export traces a call with ``cu_seqlens`` (or a jagged NestedTensor),
each layer is one call of ``torch.ops.fastlayers.lstm_varlen``, ``gru_varlen`` or ``rnn_varlen``:
plain tensors in (the values (N, F), ``cu_seqlens`` (B+1,), the states, the layer's weights stacked
over directions, the training masks) and out (the output (N, D*P), the final states). Their shapes
follow from N and B alone, so the graph never reads a length: a new batch of other lengths (or
another N, dynamic under torch.export) runs the same graph. The operators run the eager engine (the
C engine's varlen rows on CPU, the Triton engine's on the Triton backend; the reference backend and
the Elman RNN take the padded path between :func:`fastlayers._core.jagged.pad` and ``unpad``) and
validate ``cu_seqlens``'s values there, at run time, with the eager call's errors (``max_seqlen`` is
not needed there: only its type is checked while tracing). Their autograd recomputes the layer with
the eager engine and takes its gradient, as the padded export operators do (:mod:`._ops_export`): a
compiled training step pays one extra forward per layer. Python operators: an exported program runs
where fastlayers is imported (``ep.module()``), not in AOTInductor packages.

Training masks are drawn by the caller (:func:`varlen_operator_layers`) and passed in one layout:
zoneout keep-masks (D, N, width) in the values' row order, the recurrent mask (D, B, P) in batch
order. Compiled for the C engine they are the eager call's draws (:func:`._cpu.varlen_engine_draws`:
its packed-row draws moved to that layout with tensor operations), so a seed gives a compiled call
the eager call's masks; exported, or for another backend, :func:`._ops_export.operator_masks`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core import jagged, twice
from .._core.backend import select
from ._cpu import varlen_engine_draws
from ._lengths import varlen_rows
from ._ops_export import (_GRU_KEYS, _LSTM_KEYS, _PLAIN, _RNN_KEYS, _layer_args, _layer_eagerly, _rnn_eagerly,
                          engine_masks, layer_parameters, operator_masks, rounding, vjp)
from ._options import CellOptions
from ._routing import engine

_NAMES = ("w_ih", "w_hh", "b_ih", "b_hh", "ln_ih", "ln_hh", "ln_cell_weight", "ln_cell_bias", "peephole", "w_hr")


def _pad_masks(masks: dict, plan: jagged.Varlen) -> dict:
    """Zoneout keep-masks (D, N, width) -> (D, T, B, width) for the padded path."""
    return {k: torch.stack([jagged.pad(m, plan, batch_first=False) for m in v]) if k in ("zc", "zh") and v is not None
            else v for k, v in masks.items()}


def _varlen_eagerly(cell: str, x: Tensor, cu_seqlens: Tensor, states: tuple[Tensor, ...], w: dict, masks: dict,
                    consts: dict) -> tuple[Tensor, ...]:
    """One varlen layer with the eager engine (differentiable): the operators' implementation and
    the recomputation their autograd differentiates. ``cell``: "LSTM", "GRU", "RNN_TANH", "RNN_RELU"."""
    backend = select(cell.lower(), x) if cell in ("LSTM", "GRU") else None
    if backend in ("cpu", "triton"):  # the engines on the value rows (masks (D, N, width) as they are)
        lengths, rows = varlen_rows(backend, cu_seqlens, x.size(0), x.device)
        layer, options = _layer_args(cell, w, consts)
        out, final = engine(cell, backend)(x, states, [layer], lengths, options, training=False,
                                           masks=[engine_masks(masks)], **rows)
        return (out, *final)
    plan = jagged.varlen(cu_seqlens, x.size(0), x.device, batch_first=False)
    padded = jagged.pad(x, plan, batch_first=False)
    if cell.startswith("RNN"):
        out, h = _rnn_eagerly(padded, plan.lengths, states[0], w["w_ih"], w["w_hh"], w.get("b_ih"), w.get("b_hh"),
                              cell == "RNN_RELU")
        return jagged.unpad(out, plan), h
    out, *final = _layer_eagerly(cell, padded, plan.lengths, states, w, _pad_masks(masks, plan), consts)
    return (jagged.unpad(out, plan), *final)


_LSTM_ARGS = ("x", "cu_seqlens", "h0", "c0", *_NAMES, "rmask", "zc", "zh")
_LSTM_CONSTS = ("cell_clip", "z_c", "z_h", "proj_clip")
_GRU_ARGS = ("x", "cu_seqlens", "h0", *_NAMES[:6], "rmask", "zh")
_RNN_ARGS = ("x", "cu_seqlens", "h0", *_NAMES[:4])


def _lstm_run(*args: Any) -> tuple[Tensor, ...]:
    a = dict(zip(_LSTM_ARGS, args))
    w = {k: a[k] for k in _NAMES}
    return _varlen_eagerly("LSTM", a["x"], a["cu_seqlens"], (a["h0"], a["c0"]), w, a,
                           dict(zip(_LSTM_CONSTS, args[len(_LSTM_ARGS):])))


def _gru_run(*args: Any) -> tuple[Tensor, ...]:
    a = dict(zip(_GRU_ARGS, args))
    w = {k: a[k] for k in _NAMES[:6]}
    return _varlen_eagerly("GRU", a["x"], a["cu_seqlens"], (a["h0"],), w, a, {"z_h": args[len(_GRU_ARGS)]})


def _rnn_run(*args: Any) -> tuple[Tensor, ...]:
    a = dict(zip(_RNN_ARGS, args))
    w = {k: a[k] for k in _NAMES[:4]}
    return _varlen_eagerly("RNN_RELU" if args[len(_RNN_ARGS)] else "RNN_TANH", a["x"], a["cu_seqlens"], (a["h0"],),
                           w, {}, {})


@torch.library.custom_op("fastlayers::lstm_varlen", mutates_args=())
def lstm_varlen(x: Tensor, cu_seqlens: Tensor, h0: Tensor, c0: Tensor, w_ih: Tensor, w_hh: Tensor,
                b_ih: Optional[Tensor], b_hh: Optional[Tensor], ln_ih: Optional[Tensor], ln_hh: Optional[Tensor],
                ln_cell_weight: Optional[Tensor], ln_cell_bias: Optional[Tensor], peephole: Optional[Tensor],
                w_hr: Optional[Tensor], rmask: Optional[Tensor], zc: Optional[Tensor], zh: Optional[Tensor],
                cell_clip: float, z_c: float, z_h: float, proj_clip: float) -> tuple[Tensor, Tensor, Tensor]:
    """One varlen LSTM layer: x (N, F), cu_seqlens (B+1,) -> (y (N, D*P), h_n (D, B, P), c_n (D, B, H))."""
    with torch.no_grad():
        y, h, c = _lstm_run(x, cu_seqlens, h0, c0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, ln_cell_weight, ln_cell_bias,
                            peephole, w_hr, rmask, zc, zh, cell_clip, z_c, z_h, proj_clip)
    return y.contiguous(), h.contiguous(), c.contiguous()


@lstm_varlen.register_fake
def _(x, cu_seqlens, h0, c0, *rest):
    return x.new_empty(x.size(0), h0.size(0) * h0.size(2)), h0.new_empty(h0.shape), c0.new_empty(c0.shape)


@torch.library.custom_op("fastlayers::gru_varlen", mutates_args=())
def gru_varlen(x: Tensor, cu_seqlens: Tensor, h0: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Optional[Tensor],
               b_hh: Optional[Tensor], ln_ih: Optional[Tensor], ln_hh: Optional[Tensor], rmask: Optional[Tensor],
               zh: Optional[Tensor], z_h: float) -> tuple[Tensor, Tensor]:
    """One varlen GRU layer: x (N, F), cu_seqlens (B+1,) -> (y (N, D*H), h_n (D, B, H))."""
    with torch.no_grad():
        y, h = _gru_run(x, cu_seqlens, h0, w_ih, w_hh, b_ih, b_hh, ln_ih, ln_hh, rmask, zh, z_h)
    return y.contiguous(), h.contiguous()


@gru_varlen.register_fake
def _(x, cu_seqlens, h0, *rest):
    return x.new_empty(x.size(0), h0.size(0) * h0.size(2)), h0.new_empty(h0.shape)


@torch.library.custom_op("fastlayers::rnn_varlen", mutates_args=())
def rnn_varlen(x: Tensor, cu_seqlens: Tensor, h0: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Optional[Tensor],
               b_hh: Optional[Tensor], relu: bool) -> tuple[Tensor, Tensor]:
    """One varlen Elman RNN layer (tanh, or ReLU): x (N, F), cu_seqlens (B+1,) -> (y (N, D*H), h_n (D, B, H))."""
    with torch.no_grad():
        y, h = _rnn_run(x, cu_seqlens, h0, w_ih, w_hh, b_ih, b_hh, relu)
    return y.contiguous(), h.contiguous()


@rnn_varlen.register_fake
def _(x, cu_seqlens, h0, *rest):
    return x.new_empty(x.size(0), h0.size(0) * h0.size(2)), h0.new_empty(h0.shape)


_RUNS = {"lstm": (_lstm_run, len(_LSTM_ARGS)), "gru": (_gru_run, len(_GRU_ARGS)), "rnn": (_rnn_run, len(_RNN_ARGS))}


def _gradients(cell: str, inputs: list, consts: list, grads: list, needs: list[bool]) -> list[Tensor | None]:
    """The vector-Jacobian product of one varlen layer (:func:`._ops_export.vjp`: recomputed with the
    eager engine; differentiable again while grad mode is on)."""
    run, _ = _RUNS[cell]
    return vjp(lambda *t: run(*t, *consts), inputs, needs, grads)


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """Autograd recording inside an operator's implementation, which the dispatcher runs with the
    autograd keys excluded (so the recomputation below builds its graph). A private torch API
    (``_ForceDispatchKeyGuard``, as torch's higher-order operators use it): the tests run it."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "AutogradCPU", "AutogradCUDA"):
        exclude = exclude.remove(getattr(C.DispatchKey, name))
    with C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude):
        yield


@torch.library.custom_op("fastlayers::varlen_layer_backward", mutates_args=())
def varlen_layer_backward(cell: str, inputs: list[Optional[Tensor]], consts: list[float], grads: list[Optional[Tensor]],
                          needs: list[bool]) -> list[Tensor]:
    """The gradients of a varlen layer's inputs (``needs``; empty where not needed or unused), as an
    operator: torch.compile traces the backward of a varlen operator without reading a length."""
    with _autograd_on():
        out = _gradients(cell, inputs, consts, grads, needs)
    return [g if g is not None else (t.new_zeros(t.shape) if n else t.new_empty(0)) if t is not None
            else inputs[0].new_empty(0) for g, t, n in zip(out, inputs, needs)]


@varlen_layer_backward.register_fake
def _(cell, inputs, consts, grads, needs):
    return [t.new_empty(t.shape) if n and t is not None else inputs[0].new_empty(0) for t, n in zip(inputs, needs)]


for _op, _cell in ((lstm_varlen, "lstm"), (gru_varlen, "gru"), (rnn_varlen, "rnn")):
    def _setup(ctx, inputs, output, count=_RUNS[_cell][1]):
        ctx.save_for_backward(*inputs[:count])
        ctx.consts = inputs[count:]

    def _backward(ctx, *grads, cell=_cell):
        needs = [bool(n) and t is not None and t.is_floating_point()
                 for t, n in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        if twice.graph_recorded() and not torch.compiler.is_compiling():  # create_graph: differentiable
            got = _gradients(cell, list(ctx.saved_tensors), list(ctx.consts), list(grads), needs)
        else:
            got = varlen_layer_backward(cell, list(ctx.saved_tensors), [float(c) for c in ctx.consts], list(grads),
                                        needs)
        return (*(g if n else None for g, n in zip(got, needs)), *([None] * len(ctx.consts)))

    _op.register_autograd(_backward, setup_context=_setup)


def varlen_operator_layers(module: Any, values: Tensor, states: tuple[Tensor, ...], cu_seqlens: Tensor
                           ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """A varlen call (values (N, F), validated states (L*D, B, width), cu_seqlens (B+1,)) as one
    operator per layer -> (output (N, D*P), final states), as the eager varlen call returns them."""
    mode = module.mode
    dirs = 2 if module.bidirectional else 1
    options: CellOptions = getattr(module, "options", None) or _PLAIN
    training = module.training
    z_h, z_c = options.zoneout
    rows, batch = values.size(0), cu_seqlens.size(0) - 1
    keys = {"LSTM": _LSTM_KEYS, "GRU": _GRU_KEYS}.get(mode, _RNN_KEYS)
    finals: list[list[Tensor]] = [[] for _ in states]
    # the backend from the input (a graph input): asked of a layer's output, Dynamo ran the layers
    # below it for real while tracing (and a bad cu_seqlens raised there, wrapped in its own error)
    engine_draws = not mode.startswith("RNN") and not torch.compiler.is_exporting() and \
        select(mode.lower(), values) == "cpu"
    low, rounded = rounding(values)  # (under autocast, as the padded operators: ._ops_export)
    x, states = rounded(values), tuple(rounded(s) for s in states)
    for li in range(module.num_layers):
        p = list(layer_parameters(module, li, dirs, keys, rounded).values())  # (in keys' order)
        k = slice(li * dirs, (li + 1) * dirs)
        if mode.startswith("RNN"):
            x, h = torch.ops.fastlayers.rnn_varlen(x, cu_seqlens, states[0][k], *p, mode == "RNN_RELU")
            last: tuple[Tensor, ...] = (h,)
        else:
            if not engine_draws:
                rmask, zc, zh = operator_masks(options, training, x, dirs, batch, (rows,), states[0].size(2),
                                               module.hidden_size if mode == "LSTM" else None)
            else:  # compiled for the C engine: its eager draws (the same masks from a seed as the eager call)
                m = varlen_engine_draws(mode, options, training, x, cu_seqlens,
                                        (dirs, batch, states[0].size(2), module.hidden_size))
                rmask, zc, zh = m.get("recurrent"), m.get("zoneout_c"), m.get("zoneout_h")
            if mode == "LSTM":
                x, h, c = torch.ops.fastlayers.lstm_varlen(
                    x, cu_seqlens, states[0][k], states[1][k], *p, rmask, zc, zh, float(options.cell_clip or 0.0),
                    0.0 if training else float(z_c), 0.0 if training else float(z_h), float(options.proj_clip or 0.0))
                last = (h, c)
            else:
                x, h = torch.ops.fastlayers.gru_varlen(x, cu_seqlens, states[0][k], *p, rmask, zh,
                                                       0.0 if training else float(z_h))
                last = (h,)
        if module.dropout > 0 and training and li < module.num_layers - 1:
            x = F.dropout(x, module.dropout, True)
        for acc, s in zip(finals, last):
            acc.append(s)
    return x.to(low), tuple(torch.cat(f).to(low) for f in finals)
