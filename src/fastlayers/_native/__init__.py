"""Small C kernels compiled on first use with the system C compiler and loaded with ctypes.

The sources live next to this file (``*.c`` and the shared ``*.h``, plain C99 + OpenMP, no
Python or torch headers, so a build takes about a second).

Compiler: the command in ``$CC``, split like a shell would, so it may carry a launcher and
arguments (``CC="ccache gcc"``, ``CC="gcc -fuse-ld=gold"``); where ``$CC`` is unset, ``gcc``, else
``cc``, from ``PATH``. The C++ operator library (:mod:`fastlayers._native.ops_lib`) takes ``$CXX`` the
same way (default ``g++``) and ``$CC`` for its C sources.

Cache: a build is kept under ``$FASTLAYERS_CACHE`` (default ``~/.cache/fastlayers``), named by a
key of the source, the headers, the flags, the compiler command and the CPU's feature flags, so
later processes reuse it. A file is written under a temporary name in that folder and moved onto
its final name (``os.replace``), so a library another process has mapped is never overwritten and
concurrent builds do not see each other's half-written files. A cache that already holds the
builds may be read-only.

Failures never raise from a layer: every one of them ends in one warning (once per process and
library), after which :func:`load` returns None and the callers take their pure-PyTorch path
(:func:`fastlayers._core.backend.select` then never picks ``"cpu"``):

* no compiler: ``$CC`` names no executable (``CC=/nonexistent``), or it is unset and neither
  ``gcc`` nor ``cc`` is on ``PATH`` (one warning for all the C kernels);
* the compiler fails (exits non-zero, or cannot be started): the warning quotes its error output;
* the cache folder cannot be created or written (a read-only home in a container, ``$FASTLAYERS_CACHE``
  under a regular file, no home folder at all): not a failure by itself: one warning, and this
  process builds into a private temporary cache (``tempfile.mkdtemp``, removed at exit; later
  processes build again);
* a cached library is damaged (truncated, so that the ELF headers, segments or section table reach
  past its end -- a file dlopen would map and the process would die of SIGBUS on -- not an ELF file,
  or one that dlopen refuses): one warning, and it is rebuilt into a fresh file moved onto the
  damaged one; only if that build fails too the pure-PyTorch path runs.

``FASTLAYERS_NO_NATIVE=1`` switches the C kernels off without a warning. The C kernels also run
only on CPU tensors: other devices take their own path whatever happens here.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, TypeVar

# -fno-trapping-math -fno-signed-zeros: lets GCC if-convert the clamps and selects of the pointwise
# loops into vector compare + blend. No -ffinite-math-only: it lets GCC assume no NaN/inf (x * 0 -> 0,
# min/max that drop NaN), and the step kernels then turned a NaN input into finite outputs.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fno-signed-zeros",
          "-fopenmp", "-shared", "-fPIC", "-std=gnu99"]
_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}
_CACHE_LOCK = threading.Lock()
_PRIVATE: list[Path] = []  # the private temporary cache of this process, once the configured one failed
_WARNED: set[str] = set()
_WHY: dict[str, str] = {}  # library -> why it is unavailable (what its warning said)
_T = TypeVar("_T")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def cache_dir() -> Path | None:
    """The configured cache folder: ``$FASTLAYERS_CACHE``, else ``~/.cache/fastlayers``; None where
    it is unset and the home folder cannot be determined. (It may not exist or be writable: the
    builds then go to :func:`private_cache_dir`.)"""
    configured = os.environ.get("FASTLAYERS_CACHE", "").strip()
    if configured:
        return Path(configured).expanduser()
    try:
        return Path.home() / ".cache" / "fastlayers"
    except (RuntimeError, KeyError, OSError):  # no $HOME and no passwd entry
        return None


def private_cache_dir() -> Path | None:
    """This process's private temporary cache, where builds went because the configured cache
    could not be written (None: they did not)."""
    return _PRIVATE[0] if _PRIVATE else None


def warn_once(message: str, stacklevel: int = 2) -> None:
    """One warning per distinct message and process."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)


# (the variable, the commands tried where it is unset) of the C and the C++ compiler
C_COMPILER = ("CC", ("gcc", "cc"))
CXX_COMPILER = ("CXX", ("g++", "c++"))


def compiler(variable: str, defaults: tuple[str, ...]) -> list[str]:
    """The compiler command: ``$variable`` split like a shell would (a launcher and arguments are
    allowed: ``"ccache gcc"``), else the first of ``defaults`` on PATH.

    Raises:
        RuntimeError: no such executable, with what was looked for.
    """
    value = os.environ.get(variable, "").strip()
    if value:
        try:
            command = shlex.split(value)
        except ValueError as e:
            raise RuntimeError(f"{variable}={value!r} cannot be split into a command: {e}") from None
        if shutil.which(command[0]) is None:
            raise RuntimeError(f"{variable}={value!r}: {command[0]!r} is not an executable found on PATH")
        return command
    for name in defaults:
        if shutil.which(name):
            return [name]
    raise RuntimeError(f"no compiler found: {variable} is unset and none of {', '.join(defaults)} is on PATH")


def run(command: list[str]) -> None:
    """Run a compiler command; RuntimeError with its error output where it fails."""
    shown = shlex.join(command[:3])
    try:
        proc = subprocess.run(command, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
    except OSError as e:
        raise RuntimeError(f"`{shown} ...` cannot be started: {e}") from None
    if proc.returncode != 0:
        output = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(f"`{shown} ...` exited with status {proc.returncode}" + (f":\n{output}" if output else ""))


def damaged(path: Path | str) -> str | None:
    """Why the shared library ``path`` cannot be whole (None: it looks whole), read from its
    headers without loading it: not an ELF file (on Linux), or a truncated one (its program
    headers, segments or section table reach past the end of the file: dlopen would map it and
    the process would die of SIGBUS on the first touch of the missing pages)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(64)
            if head[:4] != b"\x7fELF":
                return "not an ELF file" if sys.platform.startswith("linux") else None
            order = "<" if head[5:6] == b"\x01" else ">"
            if head[4:5] == b"\x02" and len(head) >= 64:  # ELF64
                phoff, shoff = struct.unpack_from(order + "QQ", head, 32)
                phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54)
                entry, offset, filesz = order + "IIQQQQ", 2, 5  # p_type p_flags p_offset p_vaddr p_paddr p_filesz
            elif head[4:5] == b"\x01" and len(head) >= 52:  # ELF32
                phoff, shoff = struct.unpack_from(order + "II", head, 28)
                phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 42)
                entry, offset, filesz = order + "IIIII", 1, 4  # p_type p_offset p_vaddr p_paddr p_filesz
            else:
                return f"truncated or unknown ELF header ({size} bytes)"
            if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size \
                    or phentsize < struct.calcsize(entry):
                return f"truncated: its headers reach past its end ({size} bytes)"
            f.seek(phoff)
            table = f.read(phnum * phentsize)
            for i in range(phnum):
                fields = struct.unpack_from(entry, table, i * phentsize)
                if fields[offset] + fields[filesz] > size:
                    return f"truncated: a segment reaches past its end ({size} bytes)"
    except OSError as e:
        return f"cannot be read: {e}"
    return None


def _folders() -> list[Path]:
    """Where cached builds are looked up: the private cache (once there is one), the configured one."""
    configured = cache_dir()
    return [*_PRIVATE, *([configured] if configured is not None else [])]


def _workspace() -> tuple[Path, Path]:
    """(the cache to build into, a fresh folder inside it): the configured cache, or where it
    cannot be created or written, this process's private temporary cache (one warning)."""
    with _CACHE_LOCK:
        if not _PRIVATE:
            configured = cache_dir()
            try:
                if configured is None:
                    raise RuntimeError("FASTLAYERS_CACHE is unset and the home folder cannot be determined")
                configured.mkdir(parents=True, exist_ok=True)
                return configured, Path(tempfile.mkdtemp(prefix=".build-", dir=configured))
            except (OSError, RuntimeError) as e:
                private = Path(tempfile.mkdtemp(prefix="fastlayers-cache-"))
                atexit.register(shutil.rmtree, private, True)
                _PRIVATE.append(private)
                warn_once(f"fastlayers: the cache folder {configured} cannot be written ({type(e).__name__}: {e}); "
                          f"this process builds its kernels into the private temporary cache {private} "
                          f"(removed at exit; set FASTLAYERS_CACHE to a writable folder to keep them)", stacklevel=5)
        return _PRIVATE[0], Path(tempfile.mkdtemp(prefix=".build-", dir=_PRIVATE[0]))


def cached(filename: str, build: Callable[[Path], Path], opener: Callable[[Path], _T], what: str) -> tuple[_T, Path]:
    """``opener(path)`` of the cached build ``filename``, built first where the cache lacks it.

    ``build(folder)`` writes the library into the fresh temporary ``folder`` and returns its file,
    which is then moved onto ``filename`` in the cache (:func:`_workspace`). A cached file that is
    :func:`damaged` or that ``opener`` refuses (OSError) is rebuilt once, with one warning.

    Raises:
        RuntimeError (or what ``build`` / ``opener`` raise): it cannot be built or opened, with why.
    """
    broken = None
    for folder in _folders():
        found = folder / filename
        if found.is_file():
            broken = damaged(found)
            if broken is None:
                try:
                    return opener(found), found
                except OSError as e:
                    broken = f"it does not load: {e}"
            broken = f"the cached {what} {found} is broken ({broken})"
            break
    try:
        cache, work = _workspace()
        try:
            target = cache / filename
            os.replace(build(work), target)  # (a fresh file: a process that mapped the old one keeps it)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        why = damaged(target)
        if why is not None:
            raise RuntimeError(f"the new build {target} is broken too ({why})")
        result = opener(target)
    except Exception as e:
        why = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        raise RuntimeError(f"{broken}, and rebuilding it failed: {why}" if broken else why) from e
    if broken:
        warn_once(f"fastlayers: {broken}; rebuilt it as {target}", stacklevel=4)
    return result, target


def _build(name: str) -> ctypes.CDLL | None:
    if os.environ.get("FASTLAYERS_NO_NATIVE"):
        return None
    try:
        command = compiler(*C_COMPILER)
    except RuntimeError as e:
        _WHY[name] = f"no working C compiler ({e})"
        warn_once(f"fastlayers: {_WHY[name]}; the C kernels are unavailable and the layers use the slower "
                  f"pure-PyTorch path", stacklevel=5)
        return None
    try:
        here = Path(__file__).parent
        source = (here / f"{name}.c").read_text()
        # the C sources' headers, part of the cache key (ops_*.h belong to the C++ operators: ops_lib)
        headers = "".join(h.read_text() for h in sorted(here.glob("*.h")) if not h.name.startswith("ops_"))
        resolved = " ".join([shutil.which(command[0]) or command[0], *command[1:]])  # (which gcc is part of the key)
        key = hashlib.sha256("\0".join([source, headers, " ".join(_FLAGS), resolved,
                                        _cpu_flags()]).encode()).hexdigest()[:16]

        def build(work: Path) -> Path:
            src, out = work / f"{name}.c", work / f"{name}.so"
            src.write_text(source)
            run([*command, *_FLAGS, f"-I{here}", str(src), "-o", str(out), "-lm"])
            return out

        lib, _ = cached(f"{name}-{key}.so", build, lambda path: ctypes.CDLL(str(path)), f"C library {name!r}")
        return lib
    except Exception as e:  # (never raise from a layer's call)
        _WHY[name] = f"building it failed: {e}"
        warn_once(f"fastlayers: building the C kernels {name!r} failed, {name} uses the slower pure-PyTorch path: {e}",
                  stacklevel=5)
        return None


def address(tensor) -> int | None:
    """Data address of a tensor for a ctypes call, None for an absent (optional) argument."""
    return None if tensor is None else tensor.data_ptr()


def why_unavailable(name: str) -> str | None:
    """Why :func:`load` returned None for ``name`` (None: it did not, or was not called yet)."""
    if os.environ.get("FASTLAYERS_NO_NATIVE") and _LOADED.get(name, False) is None:
        return "FASTLAYERS_NO_NATIVE is set"
    return _WHY.get(name)


def load(name: str) -> ctypes.CDLL | None:
    """The compiled library ``name`` (built on first call, then cached), or None if unavailable
    (after one warning, see the module docstring; it never raises)."""
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

