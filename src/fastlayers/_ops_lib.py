"""fastlayers' operators in C++: the shared library that holds them, built on first use, and the
Python side of the same operators.

``_native/ops.cpp`` defines every ``torch.ops.fastlayers`` operator that runs without Python
(``TORCH_LIBRARY``: ``lstm_padded``, ``gru_padded``, ``rnn_padded``, ``locally_connected2d`` and
its backward) with CPU kernels that call the C step kernels linked in from ``_native/*.c``. It is
built like the C kernels (on first use, cached under ``$FASTLAYERS_CACHE``, keyed by the sources,
the compilers, the flags, the CPU and torch's version), with the C++ compiler of ``$CXX`` (default
g++) against the headers and libraries inside the installed torch wheel; a build takes about 15 s.
torch.compile, torch.export (and so AOTInductor and ONNX) use these operators, and so do eager
calls that record no gradient (:func:`serves`: one dispatcher call instead of a Python driver, the
fixed cost that dominates small calls); eager calls with autograd run the same C kernels through
autograd Functions.

Python registers, once the library is loaded (:func:`load`), the fake (shape) functions and the
autograd of the same operators (one definition of each operator: its schema in C++), and their
CUDA implementations (the Triton engine). :func:`library_path` gives the file, to load it in a
process without fastlayers (``torch.ops.load_library(path)``) or to link a C++ program with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from . import _native

_HERE = Path(_native.__file__).parent
_C_SOURCES = ("lstm.c", "gru.c", "local.c")
_C_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fno-signed-zeros", "-fopenmp",
            "-fPIC", "-std=gnu99"]
_CXX_FLAGS = ["-O2", "-std=c++20", "-fPIC", "-shared", "-fopenmp", "-w"]
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _torch_dirs() -> tuple[Path, list[Path], Path]:
    root = Path(torch.__file__).parent
    return root, [root / "include", root / "include" / "torch" / "csrc" / "api" / "include"], root / "lib"


def _compiler(variable: str, default: str) -> list[str] | None:
    """The compiler command of ``$variable`` (arguments allowed, e.g. "ccache g++"), else ``default``."""
    command = shlex.split(os.environ.get(variable, "")) or [default]
    return command if shutil.which(command[0]) else None


def _build() -> Path:
    """Build (or find in the cache) the library; RuntimeError says why it cannot be built."""
    cc, cxx = _compiler("CC", "gcc"), _compiler("CXX", "g++")
    if cc is None or cxx is None:
        raise RuntimeError(f"no C / C++ compiler found (CC={os.environ.get('CC', 'gcc')!r}, "
                           f"CXX={os.environ.get('CXX', 'g++')!r})")
    root, includes, libdir = _torch_dirs()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    sources = [_HERE / "ops.cpp", *(_HERE / s for s in _C_SOURCES), *sorted(_HERE.glob("*.h"))]
    key = hashlib.sha256("\0".join([*(p.read_text() for p in sources), " ".join(cc), " ".join(cxx),
                                    " ".join(_C_FLAGS + _CXX_FLAGS), torch.__version__, str(abi), str(root),
                                    _native._cpu_flags()]).encode()).hexdigest()[:16]
    target = _native.cache_dir() / f"libfastlayers_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for name in _C_SOURCES:
            obj = Path(tmp) / f"{name}.o"
            _run([*cc, *_C_FLAGS, f"-I{_HERE}", "-c", str(_HERE / name), "-o", str(obj)])
            objects.append(str(obj))
        out = Path(tmp) / "ops.so"
        _run([*cxx, *_CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{d}" for d in includes),
              str(_HERE / "ops.cpp"), *objects, f"-L{libdir}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{libdir}",
              "-o", str(out)])
        os.replace(out, target)
    return target


def _run(command: list[str]) -> None:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[:2])} ...` failed:\n{proc.stderr[-2000:]}")


def library_path() -> str:
    """The path of the operator library, built first if needed.

    Raises:
        RuntimeError: it cannot be built (no C / C++ compiler, no torch headers, a compile error),
            with the reason.
    """
    with _LOCK:
        if "path" not in _STATE:
            try:
                _STATE["path"] = str(_build())
            except (RuntimeError, OSError) as e:
                _STATE["path"] = None
                _STATE["error"] = str(e)
        if _STATE["path"] is None:
            raise RuntimeError(f"fastlayers: the C++ operator library cannot be built: {_STATE['error']}")
        return _STATE["path"]  # type: ignore[return-value]


def load() -> bool:
    """Load the library into this process and register the Python side of its operators (once).
    False (with one warning) where it cannot be built; callers then take another path."""
    if _STATE.get("loaded") is not None:
        return bool(_STATE["loaded"])
    try:
        path = library_path()
    except RuntimeError as e:
        warnings.warn(f"{e}; torch.compile / torch.export use the plain-PyTorch path instead", stacklevel=3)
        _STATE["loaded"] = False
        return False
    with _LOCK:
        if _STATE.get("loaded") is None:
            if not hasattr(torch.ops.fastlayers, "lstm_padded"):  # (a process may have loaded it already)
                torch.ops.load_library(path)
            from . import _local_function
            from .rnn import _export

            _local_function.register_operators()
            _export.register_operators()
            _STATE["loaded"] = True
    return True


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
