"""Small C kernels compiled on first use with the system C compiler and loaded with ctypes.

The sources live next to this file (``*.c`` and the shared ``*.h``, plain C99 + OpenMP, no
Python or torch headers, so a build takes about a second). A build is cached under
``$FASTLAYERS_CACHE`` (default ``~/.cache/fastlayers``) keyed by the source, the headers, the flags, the compiler and the CPU's feature
flags, so later processes reuse it. Where no compiler works, :func:`load` returns None and the
callers use their pure-PyTorch path (also the path for non-CPU tensors).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

# -fno-trapping-math -fno-signed-zeros: lets GCC if-convert the clamps and selects of the pointwise
# loops into vector compare + blend. No -ffinite-math-only: it lets GCC assume no NaN/inf (x * 0 -> 0,
# min/max that drop NaN), and the step kernels then turned a NaN input into finite outputs.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fno-signed-zeros",
          "-fopenmp", "-shared", "-fPIC", "-std=gnu99"]
_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def cache_dir() -> Path:
    return Path(os.environ.get("FASTLAYERS_CACHE", Path.home() / ".cache" / "fastlayers"))


def _build(name: str) -> ctypes.CDLL | None:
    if os.environ.get("FASTLAYERS_NO_NATIVE"):
        return None
    here = Path(__file__).parent
    source = (here / f"{name}.c").read_text()
    headers = "".join(h.read_text() for h in sorted(here.glob("*.h")))  # part of the cache key
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        warnings.warn(f"fastlayers: no C compiler found; {name} uses the slower pure-PyTorch path", stacklevel=3)
        return None
    key = hashlib.sha256("\0".join([source, headers, " ".join(_FLAGS), compiler, _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            proc = subprocess.run([compiler, *_FLAGS, f"-I{here}", str(src), "-o", str(out), "-lm"], capture_output=True,
                                  text=True)
            if proc.returncode != 0:
                warnings.warn(f"fastlayers: building {name} failed, using the pure-PyTorch path:\n{proc.stderr[-2000:]}",
                              stacklevel=3)
                return None
            os.replace(out, target)
    return ctypes.CDLL(str(target))


def address(tensor) -> int | None:
    """Data address of a tensor for a ctypes call, None for an absent (optional) argument."""
    return None if tensor is None else tensor.data_ptr()


def load(name: str) -> ctypes.CDLL | None:
    """The compiled library ``name`` (built on first call, then cached), or None if unavailable."""
    if name in _LOADED:  # (built or failed already: no lock needed to read it)
        return _LOADED[name]
    with _LOCK:
        if name not in _LOADED:
            _LOADED[name] = _build(name)
        return _LOADED[name]


_MADV_HUGEPAGE = 14
_HUGE = 2 * 1024 * 1024
_libc: ctypes.CDLL | None | bool = False


def advise_huge_pages(tensor) -> None:
    """Ask Linux for transparent huge pages on a freshly allocated, not yet touched, large buffer.

    Writing a new 16 MiB output otherwise takes ~4000 page faults, which on this machine cost more
    than the kernel itself. Only the 2 MiB-aligned interior is advised; a no-op elsewhere or when
    the call fails (the memory stays valid either way).
    """
    global _libc
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < 2 * _HUGE or tensor.device.type != "cpu":
        return
    if _libc is False:
        try:
            _libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" and hasattr(os, "uname") \
                and os.uname().sysname == "Linux" else None
        except OSError:
            _libc = None
    if not _libc:
        return
    start = tensor.data_ptr()
    lo = (start + _HUGE - 1) // _HUGE * _HUGE
    hi = (start + nbytes) // _HUGE * _HUGE
    if hi > lo:
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE)

