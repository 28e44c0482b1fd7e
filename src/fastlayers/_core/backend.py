"""Which implementation runs a call: the one place that decides, per call.

Backends:

* ``"cpu"``: the C kernels in ``fastlayers/_native`` (the native library, built with the package; one
  CPU variant loaded): CPU tensors, float32/float64, and bfloat16/float16 (computed in float32, see
  :mod:`fastlayers._core.precision`). Attention pooling's CPU path needs no C library: torch's
  products with a backward of its own (``fastlayers.attention._cpu``).
* ``"triton"``: the Triton kernels in ``fastlayers/_triton``: CUDA tensors, or CPU tensors when
  the environment variable ``TRITON_INTERPRET=1`` was set before Triton was imported (Triton's
  interpreter; slow, for tests).
* ``"reference"``: the plain-PyTorch twin of every op (any device and dtype); also what runs
  where no kernel applies.

Choice: a backend forced with ``with fastlayers.backend(name):`` (the innermost block wins; per
thread and async context) or by the environment variable ``FASTLAYERS_BACKEND`` (read at every
call), otherwise automatic: ``cpu`` for CPU floating-point tensors when the C kernels build,
``triton`` for CUDA tensors when Triton imports and the op has a Triton kernel, else
``reference``; and ``reference`` for every call under a ``torch.func`` transform (``grad``,
``vmap``, ``jvp``, ``jacrev``, ``functionalize``, ...) or inside forward-mode AD's
``torch.autograd.forward_ad.dual_level()``, with a warning once per op: the kernels' autograd
Functions and operators have no functorch rules (jvp, batching), the reference's plain PyTorch ops
have them all. A forced ``cpu`` or ``triton`` that cannot run on the call's tensors raises
RuntimeError naming the backend, the op and why; an op that has no kernel in a forced (and
usable) backend runs its reference implementation.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from typing import Iterator

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .. import _native
from .._triton import interpreting

BACKENDS = ("cpu", "triton", "reference")
ENV = "FASTLAYERS_BACKEND"
# op -> name of its C library in _native (the ops that have a C kernel)
_NATIVE_LIBRARY = {"lstm": "lstm", "gru": "gru", "local2d": "local"}
# ops with a CPU path: those, and attention pooling (torch's products with its own backward, no C library)
CPU_OPS = frozenset({*_NATIVE_LIBRARY, "attention"})
# ops with a Triton kernel (fastlayers._triton's modules; they run where the triton package imports)
TRITON_OPS = frozenset({"local2d", "attention", "lstm", "gru"})
_FORCED: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastlayers_backend", default=None)


class UnknownBackend(ValueError):
    """A backend name other than "cpu", "triton", "reference" (``fastlayers.backend(name)``, or
    ``FASTLAYERS_BACKEND``, read at each call)."""


class BackendUnavailable(RuntimeError):
    """A forced backend that cannot run a call's tensors (:func:`select`)."""


def _validate(name: object, source: str) -> str:
    if name not in BACKENDS:
        raise UnknownBackend(f"{source}: expected one of {BACKENDS}, got {name!r}")
    return name  # type: ignore[return-value]


@contextlib.contextmanager
def backend(name: str) -> Iterator[str]:
    """Force a backend inside a ``with`` block: ``with fastlayers.backend("reference"): ...``, in
    this thread (and async context); the environment variable ``FASTLAYERS_BACKEND`` forces one for
    the process, read at each call that chooses a backend (a plain LSTM / GRU call without lengths
    and the RNN choose none: docs/backends.md; empty or ``auto``: the automatic choice; another
    name: ValueError at such a call). A block wins over the variable.

    Args:
        name: ``"cpu"``, ``"triton"`` or ``"reference"``.

    Raises:
        ValueError: an unknown name (on entering the block, as for any context manager). Calls
            inside the block raise RuntimeError when the backend cannot run on their tensors (see
            :func:`select`).
    """
    token = _FORCED.set(_validate(name, "backend"))
    try:
        yield name
    finally:
        _FORCED.reset(token)


# os.environ's own store: CPython's os._Environ keeps the encoded variables in ``_data`` and updates
# it with every change made through os.environ, so reading it is reading os.environ, in one dict
# lookup instead of Mapping.get's encode, KeyError and decode (a microsecond in every layer's call)
_ENV_STORE = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV) if _ENV_STORE is not None and hasattr(os.environ, "encodekey") else None


def _env() -> str:
    if _ENV_KEY is None:
        return os.environ.get(ENV, "")
    raw = _ENV_STORE.get(_ENV_KEY)  # type: ignore[union-attr]
    return "" if raw is None else os.environ.decodevalue(raw)  # type: ignore[attr-defined]


def forced() -> tuple[str, str] | None:
    """(backend, where it was forced) or None for the automatic choice."""
    name = _FORCED.get()
    if name is not None:
        return name, "fastlayers.backend(...)"
    env = _env().strip()
    if env and env != "auto":
        return _validate(env, f"environment variable {ENV}"), f"{ENV}={env}"
    return None


_FUNCTORCH = getattr(torch._C, "_functorch", None)
_peek_transform = getattr(_FUNCTORCH, "peek_interpreter_stack", lambda: None)
_BATCHED_OR_FORWARD = tuple(getattr(getattr(_FUNCTORCH, "TransformType", None), name, name) for name in ("Vmap", "Jvp"))


def transformed() -> bool:
    """Whether this call runs under a ``torch.func`` transform (its interpreter stack is not empty)
    or inside ``torch.autograd.forward_ad.dual_level()``: then only the reference runs (see the
    module docstring)."""
    return _peek_transform() is not None or forward_ad._current_level >= 0


def batched_or_forward_mode() -> bool:
    """Whether this call runs under ``torch.func.vmap`` or a forward-mode transform (``jvp``,
    ``jacfwd``; ``forward_ad.dual_level()``), where torch's fused RNN kernels do not run (no
    batching rule; the CPU LSTM kernel has no forward derivative): the layers without options then
    run their reference too."""
    if torch.compiler.is_compiling() or not transformed():  # (traced code: torch.compile's own handling)
        return False
    if forward_ad._current_level >= 0:
        return True
    stack = getattr(_FUNCTORCH, "get_interpreter_stack", lambda: [_peek_transform()])()
    return any(interpreter.key() in _BATCHED_OR_FORWARD for interpreter in stack)


def cpu_kernels(op: str, x: Tensor) -> bool:
    """``select(op, x) == "cpu"`` for a CPU tensor ``x`` of float32 / float64 (the calls that the C++
    operators serve, :func:`fastlayers._native.ops_lib.serves`), in the few lookups of the common case: no
    backend forced but "cpu", and the op's C library loaded. False: callers ask :func:`select`,
    which says what runs (or refuses a forced backend)."""
    if x.device.type != "cpu" or torch.compiler.is_compiling() or transformed():  # (compiled: select(), once)
        return False
    chosen = forced()
    if chosen is not None and chosen[0] != "cpu":
        return False
    library = _NATIVE_LIBRARY.get(op)
    return library is None or _native.load(library) is not None


def triton_kernels(op: str, x: Tensor) -> bool:
    """``select(op, x) == "triton"`` for a CUDA tensor ``x``, in a few lookups (the per-call host time
    of small GPU calls): no backend forced but "triton", a dtype the kernels take, Triton
    importable. False: callers ask :func:`select`, which says what runs (or refuses a forced
    backend)."""
    if not x.is_cuda or torch.compiler.is_compiling() or transformed():
        return False
    chosen = forced()
    if chosen is not None and chosen[0] != "triton":
        return False
    return op in TRITON_OPS and x.dtype in _TRITON_DTYPES and _triton_importable()


_TRITON_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    """Whether the triton package is installed and imports (asked for CUDA tensors, and where
    "triton" is forced): a broken install (a driver or CUDA mismatch raising at import) warns once
    and the layers take the reference backend, as they do without the C library."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception as e:
        _native.warn_once(f"fastlayers: the triton package is installed but does not import ({type(e).__name__}: "
                          f"{e}); CUDA tensors run on the reference backend (plain PyTorch ops)", stacklevel=4)
        return False
    return True


def unavailable(name: str, op: str, x: Tensor) -> str | None:
    """Why backend ``name`` cannot run ``op`` on tensors like ``x`` (None: it can)."""
    if name == "reference":
        return None
    if transformed():
        return ("under a torch.func transform (grad, vmap, jvp, ...) or forward-mode AD only the reference "
                "backend runs (the kernels have no functorch rules)")
    if name == "cpu":
        if x.device.type != "cpu":
            return f"the C kernels run on CPU tensors, got a tensor on {x.device}"
        if x.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            return f"the C kernels take float32/float64 (and bfloat16/float16, computed in float32), got {x.dtype}"
        library = _NATIVE_LIBRARY.get(op)
        if library is not None:
            if _native.load(library) is None:
                why = _native.why_unavailable(library) or "see the warning printed at the first call"
                return f"the C library {library!r} is unavailable: {why}"
        return None
    if not _triton_importable():
        return "the triton package is not installed, or does not import"
    if x.device.type == "cpu":
        if not interpreting():
            return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing triton"
    elif x.device.type != "cuda":
        return f"Triton kernels run on CUDA tensors, got a tensor on {x.device}"
    if x.dtype not in _TRITON_DTYPES:
        return f"the Triton kernels take floating-point tensors, got {x.dtype}"
    return None


def _has_kernel(name: str, op: str) -> bool:
    return op in (CPU_OPS if name == "cpu" else TRITON_OPS)


def select(op: str, x: Tensor) -> str:
    """The backend for one call of ``op`` ("lstm", "gru", "local2d", "attention", ...) on tensors
    like ``x``: "cpu", "triton" or "reference" (see the module docstring).

    Under ``torch.compile`` the choice is made once, when the code is traced, and kept by the
    compiled code (it depends on the device and dtype, which the compiled code guards on, and on
    the forced backend at that time)."""
    if torch.compiler.is_compiling():
        from .compiling import constant

        return constant(_select, op, x)
    return _select(op, x)


def _select(op: str, x: Tensor) -> str:
    chosen = forced()
    if chosen is None:
        if transformed():  # (once per op and process; at the caller of select())
            _native.warn_once(f"fastlayers: {op} under a torch.func transform (grad, vmap, jvp, ...) or forward-mode AD "
                              f"runs on the reference backend (plain PyTorch ops, step by step: slower than the C / "
                              f"Triton kernels, which have no functorch rules)", stacklevel=3)
            return "reference"
        if _has_kernel("cpu", op) and unavailable("cpu", op, x) is None:
            return "cpu"
        # Triton's interpreter runs CPU tensors only when forced: it is a test tool, not a backend
        if x.device.type == "cuda" and _has_kernel("triton", op) and unavailable("triton", op, x) is None:
            return "triton"
        return "reference"
    name, where = chosen
    why = unavailable(name, op, x)
    if why is not None:
        raise BackendUnavailable(f"backend {name!r} (forced by {where}) cannot run {op}: {why}")
    return name if name == "reference" or _has_kernel(name, op) else "reference"
