"""The recurrent layers as C++ operators: torch.export (dynamic batch, time and lengths) and eager
calls without autograd.

Legend: T time, B batch, F input features, H hidden size, P output size (proj_size, or H), G gates,
D directions, L layers.

While ``torch.export`` traces (``torch.compiler.is_exporting()``), LSTM, GRU and RNN (every cell
option, proj_size, lengths, hx) run each layer as one call of a C++ operator
(:mod:`fastlayers._native.ops_lib`, ``_native/ops.cpp``): ``torch.ops.fastlayers.lstm_padded``,
``gru_padded`` or ``rnn_padded``, taking the padded time-major batch (T, B, F), the lengths as a
tensor (or None) and the layer's weights stacked over directions, and returning the padded
output (T, B, D*P) (zeros at t >= len_b) and the final states. Their fake functions give every
shape in terms of T and B, so an exported program keeps both dynamic (torch.nn.LSTM's
``aten.lstm`` specialises T), and the lengths are data of the graph. The program runs in Python
(``ep.module()``) and in AOTInductor packages (the CPU kernels are C++), and
``torch.onnx.export(..., dynamo=True)`` converts it with the operators' ONNX translations
(:mod:`._ops_onnx`, applied by :func:`fastlayers.onnx.export`).

The operators' CPU kernels are C++; on CUDA they run the Triton engine (a Python implementation
registered here, so a CUDA program needs Python). Their autograd recomputes the layer with the
eager engine (the C / Triton kernels and their hand-written backward) and takes its gradient:
an exported program trains, with one extra forward per layer in its backward.

Eager calls that record no gradient (``torch.no_grad()`` / ``inference_mode``) on CPU in float32 or
float64 run the same operators (:func:`serve_inference`): one dispatcher call per layer instead of
the engine's Python driver, which is what costs at small shapes (issue 42: the operators run a
small LSTM call in about torch.nn.LSTM's time, the Python driver in 5x; :func:`fastlayers._native.ops_lib.serves`).
The first such call on a machine builds the library (about 15 s, once; then cached).

Training masks (zoneout, recurrent dropout) are drawn with :func:`._common.draw_mask` and passed to the
operator: (D, T, B, width) zoneout keep-masks and a (D, B, P) recurrent mask.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core import exporter, twice
from .._core import precision as _precision
from .._native import ops_lib
from ._common import draw_mask, draws
from ._cpu import engine_draws
from ._options import CellOptions

_LSTM_KEYS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "ln_ih_weight", "ln_hh_weight", "ln_cell_weight",
              "ln_cell_bias", "weight_peephole", "weight_hr")
_GRU_KEYS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh", "ln_ih_weight", "ln_hh_weight")
_RNN_KEYS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
_PLAIN = CellOptions()
_PRODUCT_WEIGHTS = ("weight_ih", "weight_hh", "weight_hr")  # the weights the products multiply


def rounding(x: Tensor) -> tuple[torch.dtype, Callable[[Any], Any]]:
    """(the call's low dtype, the rounding of a product operand to it): float32 under autocast
    (bf16 / fp16) runs the operators in float32 on the products' operands rounded to the low dtype
    and returns the outputs and final states in it, as the eager call (mixed_precision.md's rule);
    otherwise (low = x's dtype) nothing is rounded."""
    low = _precision.dtypes(x)[0]
    return low, ((lambda t: _precision.rounded(t, low)) if low != x.dtype else (lambda t: t))


def layer_parameters(module: Any, layer: int, dirs: int, keys: tuple[str, ...],
                     rounded: Callable[[Any], Any]) -> dict[str, Tensor | None]:
    """Layer ``layer``'s parameters ``keys`` stacked over its ``dirs`` directions (D, ...) (None for
    one the module lacks: no bias), the product weights through ``rounded`` (:func:`rounding`). Each
    read once: a parametrized weight's parametrization runs once a call. One direction: a view (no
    copy; the operators take any layout)."""
    found = {k: [getattr(module, f"{k}_l{layer}{s}", None) for s in ("", "_reverse")[:dirs]] for k in keys}
    stacked = {k: None if ts[0] is None else ts[0].unsqueeze(0) if dirs == 1 else torch.stack(ts)
               for k, ts in found.items()}
    return {k: rounded(t) if t is not None and k in _PRODUCT_WEIGHTS else t for k, t in stacked.items()}


def operator_layers(module: Any, x: Tensor, states: tuple[Tensor, ...], lengths: Tensor | None
                    ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """A layer call as one operator per layer: x batched (layout per batch_first), states batched
    3-D, lengths validated (or None) -> (output, final states), as :meth:`_LengthsMixin._run`.
    Under torch.export it raises RuntimeError with the reason where the operators cannot be built."""
    if torch.compiler.is_compiling():  # (Dynamo: the loader runs for real, its answer a constant)
        from .._core.compiling import constant

        why = constant(ops_lib.unavailable_reason)
    else:
        why = ops_lib.unavailable_reason()
    if why:
        raise RuntimeError(why)
    with ops_lib.eager_below_autograd():
        return _layers(module, x, states, lengths)


def _layers(module: Any, x: Tensor, states: tuple[Tensor, ...], lengths: Tensor | None
            ) -> tuple[Tensor, tuple[Tensor, ...]]:
    mode = "RNN" if module.mode.startswith("RNN") else module.mode
    dirs = 2 if module.bidirectional else 1
    options: CellOptions = getattr(module, "options", None) or _PLAIN
    training = module.training
    z_h, z_c = options.zoneout
    low, rounded = rounding(x)
    x, states = rounded(x), tuple(rounded(s) for s in states)
    xt = x.transpose(0, 1) if module.batch_first else x  # (T, B, F)
    steps, batch = xt.shape[:2]
    finals: list[list[Tensor]] = [[] for _ in states]
    keys = {"LSTM": _LSTM_KEYS, "GRU": _GRU_KEYS, "RNN": _RNN_KEYS}[mode]
    for li in range(module.num_layers):
        p = layer_parameters(module, li, dirs, keys, rounded)
        k = slice(li * dirs, (li + 1) * dirs)
        if mode == "RNN":
            y, h = torch.ops.fastlayers.rnn_padded(xt, lengths, states[0][k], p["weight_ih"], p["weight_hh"],
                                                   p["bias_ih"], p["bias_hh"], module.mode == "RNN_RELU")
            last: tuple[Tensor, ...] = (h,)
        else:
            rmask, zc, zh = _layer_masks(mode, options, training, xt, lengths, dirs, states[0].size(2),
                                         module.hidden_size)
            if mode == "LSTM":
                y, h, c = torch.ops.fastlayers.lstm_padded(
                    xt, lengths, states[0][k], states[1][k], p["weight_ih"], p["weight_hh"], p["bias_ih"],
                    p["bias_hh"], p["ln_ih_weight"], p["ln_hh_weight"], p["ln_cell_weight"], p["ln_cell_bias"],
                    p["weight_peephole"], p["weight_hr"], rmask, zc, zh, float(options.cell_clip or 0.0),
                    0.0 if training else float(z_c), 0.0 if training else float(z_h), float(options.proj_clip or 0.0))
                last = (h, c)
            else:
                y, h = torch.ops.fastlayers.gru_padded(xt, lengths, states[0][k], p["weight_ih"], p["weight_hh"],
                                                       p["bias_ih"], p["bias_hh"], p["ln_ih_weight"], p["ln_hh_weight"],
                                                       rmask, zh, 0.0 if training else float(z_h))
                last = (h,)
        xt = y
        if module.dropout > 0 and training and li < module.num_layers - 1:
            xt = F.dropout(xt, module.dropout, True)
        for acc, s in zip(finals, last):
            acc.append(s)
    out = xt.transpose(0, 1) if module.batch_first else xt
    return out.to(low), tuple((f[0] if len(f) == 1 else torch.cat(f)).to(low) for f in finals)


# ---- the Python side of the operators (run once the library loads: ops_lib.on_load at the end)

def _layer_args(cell: str, w: dict, consts: dict) -> tuple[list[dict[str, Tensor]], CellOptions]:
    """The engine's arguments for one layer: its per-direction parameter dicts (both biases or
    neither) and its cell options, from the operators' stacked weights ``w`` and constants."""
    dirs = w["w_ih"].size(0)
    names = {"ln_ih": "ln_ih_weight", "ln_hh": "ln_hh_weight", "peephole": "weight_peephole", "w_hr": "weight_hr",
             "w_ih": "weight_ih", "w_hh": "weight_hh", "b_ih": "bias_ih", "b_hh": "bias_hh"}
    layer = [{names.get(k, k): v[d] for k, v in w.items() if v is not None} for d in range(dirs)]
    if layer[0].keys() & {"bias_ih", "bias_hh"}:  # the engine wants both biases or neither
        for p in layer:
            for b in ("bias_ih", "bias_hh"):
                p.setdefault(b, torch.zeros_like(p["weight_ih"][:, 0]))
    if cell == "LSTM":
        options = CellOptions(layer_norm=w.get("ln_ih") is not None, peephole=w.get("peephole") is not None,
                              cell_clip=consts["cell_clip"] or None, zoneout=(consts["z_h"], consts["z_c"]),
                              proj_clip=consts["proj_clip"] or None)
    else:
        options = CellOptions(layer_norm=w.get("ln_ih") is not None, zoneout=(consts["z_h"], 0.0))
    return layer, options


def operator_masks(options: CellOptions, training: bool, like: Tensor, dirs: int, batch: int, rows: tuple[int, ...],
                   width: int, hidden: int | None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The training masks an operator takes, drawn by its caller in like's dtype and device (in this
    order): recurrent dropout's scaled keep-mask (D, B, width), zoneout's h mask (D, *rows, width) and,
    for an LSTM (``hidden`` given), its c mask (D, *rows, hidden); None where none is drawn. ``rows``:
    (T, B) for the padded operators, (N,) for the varlen ones."""
    z_h, z_c = options.zoneout
    rmask = zc = zh = None
    if training and options.recurrent_dropout > 0:
        rmask = draw_mask("recurrent", options, (dirs, batch, width), like)
    if training and z_h > 0:
        zh = draw_mask("zoneout_h", options, (dirs, *rows, width), like)
    if training and hidden is not None and z_c > 0:
        zc = draw_mask("zoneout_c", options, (dirs, *rows, hidden), like)
    return rmask, zc, zh


def _layer_masks(cell: str, options: CellOptions, training: bool, x: Tensor, lengths: Tensor | None, dirs: int,
                 width: int, hidden: int) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """A padded layer's operator masks (rmask, zc, zh; as :func:`operator_masks`). Eager (a call
    without autograd): drawn as the C engine draws them when the same call records gradients
    (:func:`._cpu.engine_draws`), so a training-mode call gives the same masks from a seed with or
    without gradients (torch.utils.checkpoint's reentrant form reruns a no_grad forward with them).
    Exported: :func:`operator_masks`, whose draws the traced program can repeat (T and B dynamic)."""
    if not draws(options, training):
        return None, None, None
    if torch.compiler.is_exporting():
        return operator_masks(options, training, x, dirs, x.size(1), (x.size(0), x.size(1)), width,
                              hidden if cell == "LSTM" else None)
    m = engine_draws(cell, options, training, {}, x, lengths, (dirs, x.size(0), x.size(1), width, hidden))
    return m.get("recurrent"), m.get("zoneout_c"), m.get("zoneout_h")


def engine_masks(masks: dict) -> dict:
    """The operators' mask arguments (``rmask``, ``zh``, ``zc``) as the engines' masks dict
    (``recurrent``, ``zoneout_h``, ``zoneout_c``), those absent left out."""
    m = {"recurrent": masks.get("rmask"), "zoneout_h": masks.get("zh"), "zoneout_c": masks.get("zc")}
    return {k: v for k, v in m.items() if v is not None}


def _layer_eagerly(cell: str, x: Tensor, lengths: Tensor | None, states: tuple[Tensor, ...], w: dict,
                   masks: dict, consts: dict) -> tuple[Tensor, ...]:
    """One layer with the eager engine (differentiable): the operators' CUDA kernel and the
    recomputation their autograd differentiates. Arguments as the operators'."""
    from .._core.backend import select
    from ._routing import engine

    layer, options = _layer_args(cell, w, consts)
    lens = None if lengths is None else lengths.to("cpu", torch.int64)
    which = select(cell.lower(), x)
    out, final = engine(cell, which)(x, states, [layer], lens, options, training=False, masks=[engine_masks(masks)])
    return (out, *final)


def _rnn_eagerly(x: Tensor, lengths: Tensor | None, h0: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None,
                 b_hh: Tensor | None, relu: bool) -> tuple[Tensor, Tensor]:
    """rnn_padded with torch's modules: the layer's PackedSequence call (differentiable)."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    dirs, hidden, features = w_ih.shape
    rnn = torch.nn.RNN(features, hidden, nonlinearity="relu" if relu else "tanh", bias=b_ih is not None,
                       bidirectional=dirs == 2, device=x.device, dtype=x.dtype)
    params = {}
    for d, sfx in enumerate(("", "_reverse")[:dirs]):
        params.update({f"weight_ih_l0{sfx}": w_ih[d], f"weight_hh_l0{sfx}": w_hh[d]})
        if b_ih is not None:
            params.update({f"bias_ih_l0{sfx}": b_ih[d], f"bias_hh_l0{sfx}": b_hh[d]})
    steps = x.size(0)
    lens = torch.full((x.size(1),), steps, dtype=torch.int64) if lengths is None else lengths.to("cpu", torch.int64)
    packed = pack_padded_sequence(x, lens, enforce_sorted=False)
    out, h = torch.func.functional_call(rnn, params, (packed, h0))
    return pad_packed_sequence(out, total_length=steps)[0], h


def vjp(run, inputs: list, needs: list[bool], grads: list) -> list[Tensor | None]:
    """The gradients of ``inputs`` (where ``needs``) of ``run(*inputs)`` against the output gradients
    ``grads``: recomputed with the eager engine, then its vector-Jacobian product. While grad mode
    is on (a backward with create_graph) the recomputation runs on the inputs themselves, so the
    gradients stay differentiable functions of them; otherwise on detached copies."""
    create_graph = twice.graph_recorded()
    with torch.enable_grad():
        leaves = list(inputs) if create_graph else [
            t.detach().requires_grad_(bool(n)) if t is not None and t.is_floating_point() else t
            for t, n in zip(inputs, needs)]
        outs = run(*leaves)
        wanted = [i for i, (t, n) in enumerate(zip(leaves, needs)) if n and t is not None and t.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        got = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in wanted], [g for _, g in pairs],
                                  allow_unused=True, create_graph=create_graph) if wanted and pairs else ()
    result: list[Tensor | None] = [None] * len(inputs)
    # an operator's outputs may alias neither its inputs nor each other (the bias of b_ih + b_hh gives
    # both the same gradient; stack_directions takes the rows of an input without a copy): copies
    held = {t.untyped_storage().data_ptr() for t in (*inputs, *grads) if isinstance(t, Tensor)}
    for i, g in zip(wanted, got):
        if g is not None:
            if g.untyped_storage().data_ptr() in held:
                g = g.clone()
            held.add(g.untyped_storage().data_ptr())
        result[i] = g
    return result


def _recompute_backward(ctx, grads: tuple, run) -> tuple:
    """Gradients of the saved inputs: ``run(*inputs)`` recomputed with the eager engine, then its
    vector-Jacobian product (:func:`vjp`; differentiable again under create_graph)."""
    return tuple(vjp(run, list(ctx.saved_tensors), list(ctx.needs_input_grad), list(grads)))


_LSTM_ARGS = ("x", "lengths", "h0", "c0", "w_ih", "w_hh", "b_ih", "b_hh", "ln_ih", "ln_hh", "ln_cell_weight",
              "ln_cell_bias", "peephole", "w_hr", "rmask", "zc", "zh")
_GRU_ARGS = ("x", "lengths", "h0", "w_ih", "w_hh", "b_ih", "b_hh", "ln_ih", "ln_hh", "rmask", "zh")


def _lstm_eagerly(*args):
    a = dict(zip(_LSTM_ARGS, args))
    consts = dict(zip(("cell_clip", "z_c", "z_h", "proj_clip"), args[len(_LSTM_ARGS):]))
    w = {k: a[k] for k in ("w_ih", "w_hh", "b_ih", "b_hh", "ln_ih", "ln_hh", "peephole", "w_hr")}
    w.update({"ln_cell_weight": a["ln_cell_weight"], "ln_cell_bias": a["ln_cell_bias"]})
    return _layer_eagerly("LSTM", a["x"], a["lengths"], (a["h0"], a["c0"]), w, a, consts)


def _gru_eagerly(*args):
    a = dict(zip(_GRU_ARGS, args))
    w = {k: a[k] for k in ("w_ih", "w_hh", "b_ih", "b_hh", "ln_ih", "ln_hh")}
    return _layer_eagerly("GRU", a["x"], a["lengths"], (a["h0"],), w, a, {"z_h": args[len(_GRU_ARGS)]})


def register_operators() -> None:
    """Fake functions, autograd and CUDA implementations of lstm_padded, gru_padded, rnn_padded."""

    @torch.library.register_fake("fastlayers::lstm_padded")
    def _(x, lengths, h0, c0, w_ih, *rest):
        steps, batch = x.shape[:2]
        dirs, out, hidden = h0.size(0), h0.size(2), c0.size(2)
        return x.new_empty(steps, batch, dirs * out), h0.new_empty(dirs, batch, out), c0.new_empty(dirs, batch, hidden)

    @torch.library.register_fake("fastlayers::gru_padded")
    def _(x, lengths, h0, *rest):
        steps, batch = x.shape[:2]
        dirs, hidden = h0.size(0), h0.size(2)
        return x.new_empty(steps, batch, dirs * hidden), h0.new_empty(dirs, batch, hidden)

    torch.library.register_fake("fastlayers::rnn_padded")(lambda x, lengths, h0, *rest: (
        x.new_empty(x.size(0), x.size(1), h0.size(0) * h0.size(2)), h0.new_empty(h0.shape)))

    for name, run, count in (("lstm_padded", _lstm_eagerly, len(_LSTM_ARGS)),
                             ("gru_padded", _gru_eagerly, len(_GRU_ARGS)), ("rnn_padded", _rnn_eagerly, 7)):
        def setup_context(ctx, inputs, output, count=count):
            ctx.save_for_backward(*inputs[:count])
            ctx.consts = inputs[count:]

        def backward(ctx, *grads, run=run):
            return (*_recompute_backward(ctx, grads, lambda *t: run(*t, *ctx.consts)), *([None] * len(ctx.consts)))

        torch.library.register_autograd(f"fastlayers::{name}", backward, setup_context=setup_context)

        def cuda(*args, run=run):
            with torch.no_grad():
                return tuple(run(*args))

        torch.library.impl(f"fastlayers::{name}", "CUDA")(cuda)


ops_lib.on_load(register_operators)


def _onnx_translations() -> dict:
    """Called once onnxscript's registry is imported (this imports onnxscript too); loads the
    operators, which the registry must find when torch.onnx reads it; none where they cannot load."""
    from . import _ops_onnx

    return _ops_onnx.translations() if ops_lib.load() else {}


exporter.offer(_onnx_translations)  # torch.onnx.export finds the translations (fastlayers._core.exporter)
