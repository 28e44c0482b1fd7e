"""What only torch.compile's tracing calls, in a module of its own imported at that moment.

Its decorators import ``torch._dynamo`` (about 1 s), which ``import fastlayers`` must not pay: the
eager functions import this module from their ``torch.compiler.is_compiling()`` branch, when
torch.compile is tracing and has imported Dynamo already (Dynamo runs the import itself, so the
decorated functions below are real functions it sees as marked).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from . import _backend, _ops_lib, _precision


@torch.compiler.assume_constant_result  # the choice depends on device, dtype and the forced backend
def select_when_tracing(op: str, x: Tensor) -> str:
    """:func:`fastlayers._backend.select` while tracing: made once, kept by the compiled code."""
    return _backend._select(op, x)


@torch.compiler.assume_constant_result  # a fact of the machine: a constant for torch.compile
def native_when_tracing(device_type: str, dtype: torch.dtype) -> bool:
    """:func:`fastlayers._precision.native` while tracing."""
    return _precision.native_cached(device_type, dtype)


@torch.compiler.assume_constant_result  # builds (once) and loads the library at trace time
def operators_loaded() -> bool:
    """Whether the C++ operators (:mod:`fastlayers._ops_lib`) are loaded (False: warned once)."""
    return _ops_lib.load()


@torch.compiler.disable
def forward_eagerly(module: Any, input: Tensor, hx: Any, lengths: Any) -> Any:
    """A recurrent layer's call with lengths under torch.compile: its plan reads the lengths' values
    on the host, so the layer runs outside the compiled graph (one graph break, and no recompilation
    for new lengths); the engine's kernels run as in eager mode."""
    return module.forward(input, hx, lengths=lengths)
