"""``fastlayers doctor``: what fastlayers finds on this machine, as a plain-text report.

:func:`report` lists the versions (fastlayers, Python, torch, numpy, Triton), the platform, the CPU
and the features its kernels use, the C / C++ compilers (``$CC`` / ``$CXX``) and whether they run,
the kernel cache and whether it can be written, whether the C kernels and the C++ operator library
build and load (it builds them where the cache lacks them: about 1 s each for the C kernels, about
15 s for the C++ library), CUDA, and the backend :func:`fastlayers._core.backend.select` picks for each
layer family. Every probe is guarded: a failing one prints its reason and the report goes on; the
warnings the probes raise are listed at its end instead of being printed.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import warnings
from typing import Callable

from . import _native

# CPU features that the C kernels (compiled with -march=native) or torch's low-precision products use
_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16", "asimd", "sve", "sve2", "bf16")
# layer family (the op name select() takes) -> the layers that ask for it
_FAMILIES = (("lstm", "LSTM, LSTMCell"), ("gru", "GRU, GRUCell"), ("local2d", "LocallyConnected1d/2d"),
             ("attention", "attention_pool, AttentionPooling"))
_NATIVE_LIBRARIES = ("lstm", "gru", "local")


def version() -> str:
    """fastlayers' installed version ("unknown" where the package is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("fastlayers")
    except Exception:  # PackageNotFoundError, or broken metadata
        return "unknown"


def _guard(probe: Callable[[], str]) -> str:
    try:
        return probe()
    except Exception as e:  # (the report always completes)
        return f"error: {type(e).__name__}: {e}"


def _torch() -> str:
    import torch

    text = f"{torch.__version__} ("
    if torch.version.cuda:
        text += f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        text += f"ROCm {torch.version.hip}"
    else:
        text += "CPU-only build"
    capability = _guard(lambda: torch.backends.cpu.get_cpu_capability())
    return text + f", CPU capability {capability}, {torch.get_num_threads()} threads)"


def _numpy() -> str:
    try:
        import numpy
    except ImportError:
        return "not installed"
    return numpy.__version__


def _triton() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    interpret = " (TRITON_INTERPRET=1: the interpreter, for tests)" if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return f"{triton.__version__}{interpret}"


def _cpu() -> str:
    from ._core import system

    return f"{system.cpu_name()} ({os.cpu_count()} logical cores)"


def _cpu_features() -> str:
    import torch

    from . import _native
    from ._core import precision as _precision

    line = _native._cpu_flags()
    flags = set(line.split(":", 1)[1].split()) if ":" in line else set()
    present = [f for f in _FEATURES if f in flags] if flags else []
    text = " ".join(present) if present else ("none of " + " ".join(_FEATURES[:8]) if flags else
                                              "unknown (no /proc/cpuinfo)")
    low = [name for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16))
           if _precision.native_cached("cpu", dtype)]
    return text + f"; low-precision products in hardware: {', '.join(low) if low else 'none (computed in float32)'}"


def _compiler(variable: str, defaults: tuple[str, ...]) -> str:
    import shlex

    from . import _native

    setting = f"${variable}={os.environ[variable]!r}" if os.environ.get(variable, "").strip() else \
        f"${variable} unset, default {' or '.join(defaults)}"
    try:
        command = _native.compiler(variable, defaults)
    except RuntimeError as e:
        return f"{setting}: not usable: {e}"
    try:
        proc = subprocess.run([*command, "--version"], capture_output=True, text=True, errors="replace", timeout=60,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{setting}: `{shlex.join(command)}` does not run: {e}"
    first = (proc.stdout or proc.stderr).strip().splitlines()[:1]
    status = "runs" if proc.returncode == 0 else f"`--version` exited with status {proc.returncode}"
    return f"{setting}: `{shlex.join(command)}` {status}" + (f": {first[0]}" if first else "")


def _cache() -> str:
    import tempfile

    from . import _native

    where = "$FASTLAYERS_CACHE" if os.environ.get("FASTLAYERS_CACHE", "").strip() else "default; FASTLAYERS_CACHE unset"
    folder = _native.cache_dir()
    if folder is None:
        return f"none ({where}, and no home folder): builds go to a private temporary cache per process"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
        files = sorted(p.name for p in folder.glob("*.so"))
        state = f"writable, {len(files)} cached librar{'y' if len(files) == 1 else 'ies'}"
    except OSError as e:
        state = f"NOT writable ({type(e).__name__}: {e}): builds go to a private temporary cache per process"
    text = f"{folder} ({where}): {state}"
    private = _native.private_cache_dir()
    return text + (f"; this process's private cache: {private}" if private is not None else "")


def _native_libraries() -> str:
    from . import _native

    if os.environ.get("FASTLAYERS_NO_NATIVE"):
        return "switched off (FASTLAYERS_NO_NATIVE is set)"
    parts = []
    for name in _NATIVE_LIBRARIES:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            lib = _guard(lambda: _native.load(name))  # type: ignore[arg-type, return-value]
        if lib is None or isinstance(lib, str):
            why = lib if isinstance(lib, str) else (_native.why_unavailable(name) or "unavailable")
            parts.append(f"{name}: NOT available: {why}")
        else:
            parts.append(f"{name}: loaded ({getattr(lib, '_name', '?')})")
    return "\n    ".join(["(built now where the cache lacks them, about 1 s each)", *parts])


def _operator_library(build: bool) -> str:
    from . import _native
    from ._native import ops_lib

    if not build:
        try:
            filename, _ = ops_lib._spec()
        except RuntimeError as e:
            return f"cannot be built: {e}"
        found = [folder / filename for folder in _native._folders() if (folder / filename).is_file()]
        return f"built: {found[0]}" if found else f"not built yet ({filename}; built on first use, about 15 s)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = ops_lib.load()
    if loaded:
        return f"loaded ({ops_lib._STATE.get('path') or 'loaded before by this process'}; built now if it was missing)"
    why = ops_lib._STATE.get("error") or (str(caught[-1].message) if caught else "unavailable")
    return f"NOT available: {why}"


def _cuda() -> str:
    import torch

    if not torch.cuda.is_available():
        return "not available"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return f"available: {names}" + (f" (cuDNN {cudnn})" if cudnn else "")


def _backends() -> str:
    import torch

    from ._core import backend as _backend

    def forced() -> str:
        chosen = _backend.forced()
        return f"{chosen[0]!r} (by {chosen[1]})" if chosen else "no (automatic choice)"

    forced = _guard(forced)
    cuda = _guard(lambda: str(torch.cuda.is_available())) == "True"
    inputs = [("CPU float32", lambda: torch.zeros(1))]
    if cuda:
        inputs.append(("CUDA float32", lambda: torch.zeros(1, device="cuda")))
    lines = [f"forced: {forced}"]
    for op, layers in _FAMILIES:
        choices = []
        for label, make in inputs:
            choices.append(f"{label}: {_guard(lambda: _backend.select(op, make()))}")  # noqa: B023
        lines.append(f"{layers} ({op}): " + ", ".join(choices))
    lines.append("(cpu = the C kernels, triton = the Triton kernels, reference = plain PyTorch; a plain "
                 "LSTM/GRU without options or lengths runs torch's own kernels whatever the backend)")
    return "\n    ".join(lines)


def report(build: bool = True) -> str:
    """A plain-text report of the machine as fastlayers sees it (see the module docstring).

    Args:
        build: build (where the cache lacks them) and load the C kernels and the C++ operator
            library to say whether they work; False only looks for the C++ library's cached file.

    It never raises: a probe that fails prints its reason.
    """
    rows: list[tuple[str, Callable[[], str]]] = [
        ("fastlayers", version),
        ("Python", lambda: f"{platform.python_version()} ({sys.executable})"),
        ("torch", _torch),
        ("numpy", _numpy),
        ("Triton", _triton),
        ("OS", lambda: platform.platform()),
        ("CPU", _cpu),
        ("CPU features", _cpu_features),
        ("C compiler", lambda: _compiler(*_native.C_COMPILER)),
        ("C++ compiler", lambda: _compiler(*_native.CXX_COMPILER)),
        ("Cache", _cache),
        ("C kernels", _native_libraries),
        ("C++ operator library", lambda: _operator_library(build)),
        ("CUDA", _cuda),
        ("Backends", _backends),
    ]
    lines = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, probe in rows:
            lines.append(f"{name}: {_guard(probe)}")
    if caught:
        lines.append("Warnings:")
        seen = set()
        for w in caught:
            text = str(w.message)
            if text not in seen:
                seen.add(text)
                lines.append(f"    {text}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
