"""fastlayers' operators in C++, the Python side: loading them and registering each family's half.

``_native/ops.cpp`` defines every ``torch.ops.fastlayers`` operator that runs without Python
(``TORCH_LIBRARY``: ``lstm_padded``, ``gru_padded``, ``rnn_padded``, ``locally_connected2d`` and
its backward) with CPU kernels that call the C kernels; it is part of the native library that the
package build compiles (``setup.py``; one library per CPU variant, :mod:`fastlayers._native` loads
one). torch.compile, torch.export (and so AOTInductor and ONNX) use these operators, and so do eager
calls that record no gradient (:func:`serves`: one dispatcher call instead of a Python driver, the
fixed cost that dominates small calls); eager calls with autograd run the same C kernels through
autograd Functions.

Python registers, once the library is loaded (:func:`load`), the fake (shape) functions and the
autograd of the same operators (one definition of each operator: its schema in C++), and their
CUDA implementations (the Triton engine): each layer family hands its registration to
:func:`on_load` when it is imported, so this loader knows no family. Where the library is missing
or does not load, :func:`load` returns False after the native library's one warning (eager calls
keep their autograd path, torch.compile takes the plain-PyTorch path): no layer's call raises for
it. :func:`library_path` gives the file, to load it in a process without fastlayers
(``torch.ops.load_library(path)``) or to link a C++ program with it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from .. import _native

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
_REGISTER: list[Callable[[], None]] = []  # the families' Python halves of their operators (on_load)


def library_path() -> str:
    """The path of the native library that holds the operators (the variant this process loads).

    Raises:
        RuntimeError: it is unavailable (not built, or built for another torch), with why.
    """
    return _native.library_path()


def load() -> bool:
    """Load the library into this process and register the Python side of its operators (once).
    False (after the native library's one warning) where it is unavailable; callers then take
    another path. It never raises."""
    if _STATE.get("loaded") is not None:
        return bool(_STATE["loaded"])
    with _LOCK:
        if _STATE.get("loaded") is None:
            if _native.library() is None:
                _STATE["loaded"], _STATE["error"] = False, _native.why_unavailable()
            else:
                try:
                    for register in _REGISTER:
                        register()
                    _STATE["loaded"] = True
                except Exception as e:  # (a layer's call must not raise for it)
                    _STATE["loaded"], _STATE["error"] = False, f"registering its Python half failed: {e}"
                    _native.warn_once(f"fastlayers: the C++ operators' {_STATE['error']}; eager calls and "
                                      f"torch.compile take their autograd path, and torch.export of a recurrent "
                                      f"layer (one operator per layer) raises with this reason", stacklevel=3)
    return bool(_STATE["loaded"])


def unavailable_reason() -> str:
    """Load the library and its operators (:func:`library_path`, :func:`load`): '' when they are
    loaded, else why not. Callers that Dynamo may trace (a strict torch.export, torch.compile)
    call it through :func:`fastlayers._core.compiling.constant` there: Dynamo cannot trace the
    loader's lock, and the result is a constant of the process."""
    try:
        library_path()
    except RuntimeError as e:
        return str(e)
    if not load():  # (the library loaded, its operators' Python half did not register: no fake, no autograd)
        return str(_STATE.get("error") or "the C++ operators did not register")
    return ""


def on_load(register: Callable[[], None]) -> None:
    """A layer family's Python half of its operators (fake functions, autograd, CUDA kernels):
    ``register()`` runs once the library is loaded (:func:`load`), now if it is loaded already.
    Each family calls this when it is imported, so this loader knows no family."""
    with _LOCK:
        _REGISTER.append(register)
        loaded = _STATE.get("loaded")
    if loaded:
        register()


def serves(x) -> bool:
    """Whether an eager call on tensors like ``x`` runs on the operators: no gradient is recorded
    (torch.no_grad / inference_mode), CPU float32 / float64 without autocast, not traced, and the
    library loads (where it does not, False after one warning, and the callers keep their autograd
    path)."""
    if torch.is_grad_enabled() and (torch.compiler.is_compiling() or not torch.is_inference_mode_enabled()):
        return False  # (a gradient recorded: enable_grad inside inference_mode records none)
    if torch.compiler.is_compiling() or x.dtype not in (torch.float32, torch.float64) or x.device.type != "cpu" \
            or torch.is_autocast_enabled("cpu") or torch.jit.is_tracing():
        return False
    loaded = _STATE.get("loaded")
    return bool(loaded) if loaded is not None else load()


def eager_below_autograd() -> contextlib.AbstractContextManager:
    """Eager calls without autograd skip the operators' (Python) autograd kernel: straight to the
    C++ kernel (a few microseconds per call); traced calls keep it."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else torch._C._AutoDispatchBelowAutograd()
