"""fastlayers' operators in C++: the shared library that holds them, built on first use, and the
Python side of the same operators.

``_native/ops.cpp`` defines every ``torch.ops.fastlayers`` operator that runs without Python
(``TORCH_LIBRARY``: ``lstm_padded``, ``gru_padded``, ``rnn_padded``, ``locally_connected2d`` and
its backward) with CPU kernels that call the C step kernels linked in from ``_native/*.c``. It is
built like the C kernels (on first use, cached under ``$FASTLAYERS_CACHE``, keyed by the sources,
the compilers, the flags, the CPU and torch's version), with the C++ compiler of ``$CXX`` (default
g++; a command with arguments such as ``CXX="ccache g++"`` works, as for ``$CC``, which compiles the
C sources) against the headers and libraries inside the installed torch wheel; a build takes about
15 s. torch.compile, torch.export (and so AOTInductor and ONNX) use these operators, and so do eager
calls that record no gradient (:func:`serves`: one dispatcher call instead of a Python driver, the
fixed cost that dominates small calls); eager calls with autograd run the same C kernels through
autograd Functions.

Failures are handled as the C kernels' (:mod:`fastlayers._native`): an unwritable cache builds into
the process's private temporary cache (removed at exit: set ``$FASTLAYERS_CACHE`` to keep the file
of :func:`library_path`), a damaged cached file (truncated, not ELF, or one
``torch.ops.load_library`` refuses) is rebuilt with one warning, and where the library cannot be
built or loaded :func:`load` returns False after one warning (eager calls keep their autograd path,
on the C kernels where those load; torch.compile takes the plain-PyTorch path): no layer's call
raises for it.

Python registers, once the library is loaded (:func:`load`), the fake (shape) functions and the
autograd of the same operators (one definition of each operator: its schema in C++), and their
CUDA implementations (the Triton engine): each layer family hands its registration to
:func:`on_load` when it is imported. :func:`library_path` gives the file, to load it in a
process without fastlayers (``torch.ops.load_library(path)``) or to link a C++ program with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch

from .. import _native

_HERE = Path(_native.__file__).parent
_C_SOURCES = ("lstm.c", "gru.c", "local.c")
_C_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fno-signed-zeros", "-fopenmp",
            "-fPIC", "-std=gnu99"]
_CXX_FLAGS = ["-O2", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w"]
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}
_REGISTER: list[Callable[[], None]] = []  # the families' Python halves of their operators (on_load)
_WHAT = "C++ operator library"


def _torch_dirs() -> tuple[Path, list[Path], Path]:
    root = Path(torch.__file__).parent
    return root, [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"], root / "lib"


def _spec() -> tuple[str, Callable[[Path], Path]]:
    """(the library's file name in the cache, the function that builds it into a folder).

    Raises:
        RuntimeError: no C or C++ compiler (``$CC`` / ``$CXX``, see :func:`fastlayers._native.compiler`).
    """
    cc, cxx = _native.compiler(*_native.C_COMPILER), _native.compiler(*_native.CXX_COMPILER)
    root, includes, libdir = _torch_dirs()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    sources = [_HERE / "ops.cpp", *(_HERE / s for s in _C_SOURCES), *sorted(_HERE.glob("*.h"))]
    key = hashlib.sha256("\0".join([*(p.read_text() for p in sources), " ".join(cc), " ".join(cxx),
                                    " ".join(_C_FLAGS + _CXX_FLAGS), torch.__version__, str(abi), str(root),
                                    _native._cpu_flags()]).encode()).hexdigest()[:16]

    def build(work: Path) -> Path:
        objects = []
        for name in _C_SOURCES:
            obj = work / f"{name}.o"
            _native.run([*cc, *_C_FLAGS, f"-I{_HERE}", "-c", str(_HERE / name), "-o", str(obj)])
            objects.append(str(obj))
        out = work / "ops.so"
        _native.run([*cxx, *_CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{d}" for d in includes),
                     str(_HERE / "ops.cpp"), *objects, f"-L{libdir}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{libdir}",
                     "-o", str(out)])
        return out

    return f"libfastlayers_ops-{key}.so", build


def library_path() -> str:
    """The path of the operator library, built first if needed (a damaged cached file is rebuilt,
    see :func:`fastlayers._native.cached`).

    Raises:
        RuntimeError: it cannot be built (no C / C++ compiler, no torch headers, a compile error),
            with the reason.
    """
    with _LOCK:
        if "path" not in _STATE:
            try:
                filename, build = _spec()
                _STATE["path"] = str(_native.cached(filename, build, lambda path: path, _WHAT)[1])
            except Exception as e:  # (RuntimeError, or OSError from the cache)
                _STATE["path"] = None
                _STATE["error"] = str(e)
        if _STATE["path"] is None:
            raise RuntimeError(f"fastlayers: the C++ operator library cannot be built: {_STATE['error']}")
        return _STATE["path"]  # type: ignore[return-value]


def _open() -> None:
    """Load the library into this process (under _LOCK); a cached file that does not load is rebuilt."""
    if hasattr(torch.ops.fastlayers, "lstm_padded"):  # (a process may have loaded it already)
        return
    if "path" in _STATE and _STATE["path"] is None:  # (library_path failed already)
        raise RuntimeError(_STATE["error"])
    filename, build = _spec()
    _STATE["path"] = str(_native.cached(filename, build, lambda path: torch.ops.load_library(str(path)), _WHAT)[1])


def load() -> bool:
    """Load the library into this process and register the Python side of its operators (once).
    False (with one warning) where it cannot be built or loaded; callers then take another path.
    It never raises."""
    if _STATE.get("loaded") is not None:
        return bool(_STATE["loaded"])
    with _LOCK:
        if _STATE.get("loaded") is None:
            try:
                try:
                    _open()
                except Exception as e:
                    _STATE["path"], _STATE["error"] = None, str(e)  # (library_path says so too, without building again)
                    raise
                for register in _REGISTER:
                    register()
                _STATE["loaded"] = True
            except Exception as e:  # (a layer's call must not raise for it)
                _STATE["loaded"] = False
                warnings.warn(f"fastlayers: the C++ operator library cannot be built or loaded: {e}; torch.compile / "
                              f"torch.export use the plain-PyTorch path instead, eager calls their autograd path",
                              stacklevel=3)
    return bool(_STATE["loaded"])


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
    library loads (the first such call on a machine builds it, about 15 s; where it cannot be built,
    False after one warning, and the callers keep their autograd path)."""
    if torch.is_grad_enabled() or x.dtype not in (torch.float32, torch.float64) or x.device.type != "cpu" \
            or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    loaded = _STATE.get("loaded")
    return bool(loaded) if loaded is not None else load()


def eager_below_autograd() -> contextlib.AbstractContextManager:
    """Eager calls without autograd skip the operators' (Python) autograd kernel: straight to the
    C++ kernel (a few microseconds per call); traced calls keep it."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else torch._C._AutoDispatchBelowAutograd()
