"""TorchScript: what ``torch.jit.trace`` and ``torch.jit.script`` meet in fastlayers' modules.

``torch.jit.trace`` records torch ops: the layers and cells whose calls are torch ops or operators
(torch's own RNN kernels, the cells' step equations, the locally connected operator, attention
pooling) trace as usual. The recurrent engine (cell options, or ``lengths=``) runs its time loop in
C / Triton kernels called from Python with a plan computed from the lengths, which a trace cannot
record (it would keep T, B and the lengths of the traced call): such a call raises one clear
RuntimeError naming the supported route instead. ``torch.jit.script`` cannot compile the modules'
Python forward (keyword-only ``lengths``, options): scripting raises one clear RuntimeError
(through ``__prepare_scriptable__``, which torch.jit.script calls on every module first).
"""

from __future__ import annotations

import torch

_EXPORT = ("torch.export.export(model, args, kwargs) is the supported route out of Python (dynamic batch and "
           "time; see docs/deploy.md)")


def refuse_trace(what: str, why: str) -> None:
    """Raise RuntimeError when ``torch.jit.trace`` is recording a call it cannot record (``why``)."""
    if torch.jit.is_tracing():
        raise RuntimeError(f"torch.jit.trace cannot record {what}: {why}. {_EXPORT}.")


ENGINE = ("the engine's time loop runs C / Triton kernels outside TorchScript, and a trace would fix T, B and the "
          "lengths of this call (torch.jit.trace works for the layers without cell options and lengths)")
TRITON = "its Triton kernels run outside TorchScript (on CPU tensors it traces)"
VARLEN = ("the varlen form reads cu_seqlens on the host to lay out its rows, so a trace would fix the lengths of "
          "this call")


class NotScriptable:
    """Mixed into fastlayers' modules: ``torch.jit.script`` raises one clear error."""

    _TRACES = "torch.jit.trace records its calls"  # (the recurrent layers: not with cell options or lengths)

    def __prepare_scriptable__(self):
        name = type(self).__name__
        raise RuntimeError(f"torch.jit.script cannot compile fastlayers.{name} (its forward is Python that "
                           f"TorchScript does not support, and TorchScript is deprecated in torch). {_EXPORT}; "
                           f"for fastlayers.{name}, {self._TRACES}.")
