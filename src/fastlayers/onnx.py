"""ONNX export of models built from fastlayers layers.

``torch.onnx.export(model, args, dynamo=True)`` works as it is: ``import fastlayers`` arranges that
the translations of its C++ operators (:func:`translations`: the ONNX graphs of the operators a
traced model contains) are in onnxscript's torchlib registry, where the exporter reads its table,
once onnxscript's registry is imported (:mod:`fastlayers._core.exporter`; ``import fastlayers``
itself does not import onnxscript). :func:`export` is the same call with the table passed
explicitly and a clear error for a layer left in training mode with random masks.
Needs ``onnxscript`` (torch's ONNX exporter needs it too); ``onnxruntime`` runs the result.

Shape legend: T time, B batch, F input features, H hidden size (P = proj_size, or H), D directions
(2 if bidirectional), L layers.

What each layer becomes (torch.export first traces it, :mod:`fastlayers.rnn._ops_export`):

* ``fastlayers.LSTM`` / ``GRU`` / ``RNN`` run each layer as one operator (``lstm_padded``,
  ``gru_padded``, ``rnn_padded``) over the padded time-major batch (T, B, F), with the lengths as a
  (B,) tensor; batch_first transposes around it. A layer without cell options (peepholes allowed;
  LSTM without proj_size) becomes ONNX's own ``LSTM`` / ``GRU`` / ``RNN`` operator (lengths as
  ``sequence_lens``, bidirectional as ``direction="bidirectional"``); a layer with layer_norm,
  cell_clip, zoneout, proj_size / proj_clip (LSTM) or layer_norm, zoneout (GRU) becomes one ONNX
  ``Scan`` over time with one step of both directions as its body (:mod:`fastlayers.rnn._ops_onnx`).
  The output is (T, B, D*P) (or (B, T, D*P)) with zeros at t >= lengths[b], the final states
  (L*D, B, P) (and c (L*D, B, H)) as the eager layer returns them; B, T and the lengths are inputs of
  the ONNX graph where the export marks them dynamic.
* ``LocallyConnected1d`` / ``2d`` (``locally_connected2d``): strided slices and one batched MatMul;
  the batch is dynamic, the spatial sizes are the weight's.
* ``attention_pool`` / ``AttentionPooling``, the cells (``LSTMCell``, ``GRUCell``, ``RNNCell``, eval
  mode) export as torch ops (no translation needed); batch and T dynamic.

Not supported: a recurrent layer or cell traced in training mode with zoneout or recurrent_dropout
(the random masks; ValueError: export in eval mode), and the recurrent layers where fastlayers'
C++ operator library cannot be built (no C++ compiler: the trace raises, saying why). Tested in
ONNX Runtime in float32 (the Scan path also in float64; ONNX Runtime's LSTM / GRU / RNN kernels are
float32 only); the ONNX graph does not check that 1 <= lengths[b] <= T.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["export", "translations"]


def _onnxscript() -> None:
    if importlib.util.find_spec("onnxscript") is None:
        raise ImportError("fastlayers.onnx needs onnxscript (torch.onnx.export(..., dynamo=True) does too): "
                          "pip install onnxscript (tested with onnxscript 0.7.2, onnxruntime 1.32.0)")


def translations() -> dict[Callable, Callable]:
    """The translation table of fastlayers' operators, for ``torch.onnx.export(model, args,
    dynamo=True, custom_translation_table=fastlayers.onnx.translations())``.

    Returns:
        ``{torch.ops.fastlayers.<op>.default: translation}`` for ``lstm_padded``, ``gru_padded``,
        ``rnn_padded`` and ``locally_connected2d``; empty where fastlayers' C++ operator library
        cannot be built or loaded (one warning: then a recurrent layer's export raises, saying why,
        and the locally connected layers export their plain-PyTorch path).

    Raises:
        ImportError: onnxscript is not installed.
    """
    _onnxscript()
    from ._native import ops_lib

    if not ops_lib.load():
        return {}
    from .local import _ops_onnx as local_onnx
    from .rnn import _ops_onnx as rnn_onnx

    named = {**rnn_onnx.translations(), **local_onnx.translations()}  # {"fastlayers::<op>": translation}
    return {getattr(torch.ops.fastlayers, name.split("::")[1]).default: fn for name, fn in named.items()}


_DRAWS = ("rand", "rand_like", "bernoulli", "bernoulli_", "uniform", "uniform_")  # (the masks' ops)
_DRAWING = tuple(f"fastlayers.rnn.{where}.{cls}" for where, cls in (
    ("_modules", "LSTM"), ("_modules", "GRU"), ("_cells", "LSTMCell"), ("_cells", "GRUCell")))


def _refuse_program_masks(program: Any) -> None:
    """An ExportedProgram has no modules to ask for their mode: a mask draw in the graph (a random
    op that a fastlayers recurrent layer or cell traced, by the nodes' module stack) is refused as
    :func:`_refuse_training_masks` refuses the module (torch.nn.Dropout elsewhere stays, as for
    torch.nn's layers)."""
    for node in program.graph.nodes:
        packet = getattr(node.target, "_overloadpacket", None)
        if node.op != "call_function" or getattr(packet, "__name__", None) not in _DRAWS:
            continue
        for fqn, kind in (node.meta.get("nn_module_stack") or {}).values():
            if str(kind) in _DRAWING:
                where = f"model.{fqn}" if fqn else "model"
                raise ValueError(
                    f"{where}: the ExportedProgram's fastlayers.{str(kind).rsplit('.', 1)[1]} was traced in training "
                    f"mode and draws random masks (zoneout or recurrent_dropout: {node.target}), which ONNX cannot "
                    "reproduce; call model.eval() before torch.export.export (eval mode uses zoneout's expectation "
                    "and no recurrent dropout)")


def _refuse_training_masks(model: Any) -> None:
    from .rnn._cells import GRUCell, LSTMCell
    from .rnn._modules import GRU, LSTM

    if isinstance(model, torch.export.ExportedProgram):
        _refuse_program_masks(model)
    modules = model.named_modules() if isinstance(model, torch.nn.Module) else ()
    for name, module in modules:
        options = getattr(module, "options", None)
        if not isinstance(module, (LSTM, GRU, LSTMCell, GRUCell)) or not module.training or options is None:
            continue
        drawn = []
        if any(options.zoneout):  # (as the module's repr writes it: one value for a GRU's one state)
            zoneout = options.zoneout[0] if isinstance(module, (GRU, GRUCell)) else options.zoneout
            drawn.append(f"zoneout={zoneout!r}")
        if options.recurrent_dropout:
            drawn.append(f"recurrent_dropout={options.recurrent_dropout!r}")
        if drawn:
            where = f"model.{name}" if name else "model"
            raise ValueError(
                f"{where}: fastlayers.{type(module).__name__} in training mode draws random masks "
                f"({', '.join(drawn)}), which ONNX cannot reproduce; call model.eval() before fastlayers.onnx.export "
                "(eval mode uses zoneout's expectation and no recurrent dropout)")


def export(model: Any, args: tuple = (), f: Any = None, *, kwargs: dict[str, Any] | None = None,
           dynamic_shapes: Any = None, **options: Any) -> Any:
    """Export ``model`` to ONNX: ``torch.onnx.export(model, args, f, kwargs=kwargs,
    dynamic_shapes=dynamic_shapes, dynamo=True, custom_translation_table=translations(), **options)``.

    Args:
        model: a ``torch.nn.Module`` (or ``torch.export.ExportedProgram``) using fastlayers layers,
            in eval mode. Legend: T time, B batch, F features, H hidden_size, P = proj_size or H,
            L num_layers, D directions (2 if bidirectional). A recurrent layer takes ``input``
            (T, B, F) or (B, T, F) float32 (batch_first), optionally ``hx`` (L*D, B, P) (LSTM: a
            pair, c (L*D, B, H)) and ``lengths`` (B,) int64 with 1 <= lengths[b] <= T.
        args, f, kwargs: as ``torch.onnx.export`` (``f``: a path to save to, or None).
        dynamic_shapes: as ``torch.export.export`` (e.g. ``{"input": {0: Dim("T"), 1: Dim("B")},
            "lengths": {0: Dim("B")}}``): the dimensions that stay inputs of the ONNX graph; others are
            fixed at the example's sizes.
        **options: passed on to ``torch.onnx.export`` (``input_names``, ``output_names``, ``opset_version``,
            ``optimize``, ``verify``, ``report``, ``external_data``, ...); a ``custom_translation_table``
            given here is applied over fastlayers' table.

    Returns:
        torch's ``ONNXProgram`` (``.save(path)``, ``.model_proto``, ``program(*inputs)`` runs it in ONNX
        Runtime). Its outputs: what the model returns, flattened (a recurrent layer's output (T, B, D*P),
        then its final states, float32; lengths are checked by neither ONNX nor the graph).

    Raises:
        ImportError: onnxscript is not installed.
        ValueError: ``dynamo`` given as anything but True; a recurrent layer or cell in training mode
            with zoneout or recurrent_dropout (random masks: call ``model.eval()``; in an
            ExportedProgram, a mask draw its graph holds, traced in such a layer or cell).
        torch.onnx.OnnxExporterError (a RuntimeError): torch's exporter failed; its message names the
            step, the node and the cause (e.g. fastlayers' C++ operator library cannot be built here,
            which torch.export of a recurrent layer needs, with the reason).
    """
    if options.pop("dynamo", True) is not True:
        raise ValueError("dynamo: fastlayers.onnx.export always runs the dynamo exporter (torch.export); "
                         "expected True or nothing")
    _refuse_training_masks(model)
    table = {**translations(), **(options.pop("custom_translation_table", None) or {})}
    return torch.onnx.export(model, args, f, kwargs=kwargs, dynamic_shapes=dynamic_shapes, dynamo=True,
                             custom_translation_table=table, **options)
