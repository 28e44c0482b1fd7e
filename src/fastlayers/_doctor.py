"""``fastlayers doctor``: what fastlayers finds on this machine, as a plain-text report.

:func:`report` lists the versions (fastlayers, Python, torch, numpy, Triton), the platform, the CPU
and the features its kernels use, the native library (the C kernels and the C++ operators, built with the
package): which CPU variant loads and why, or why none does, whether the operators register, CUDA, and the backend :func:`fastlayers._core.backend.select` picks for each
layer family. Every probe is guarded: a failing one prints its reason and the report goes on; the
warnings the probes raise are listed at its end instead of being printed.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from typing import Callable


# CPU features that the native library's variants (default / avx2 / avx512) or torch's low-precision products use
_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16", "asimd", "sve", "sve2", "bf16")
# layer family (the op name select() takes) -> the layers that ask for it
_FAMILIES = (("lstm", "LSTM, LSTMCell"), ("gru", "GRU, GRUCell"), ("local2d", "LocallyConnected1d/2d"),
             ("attention", "attention_pool, AttentionPooling"))


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
    from ._triton import interpreting

    interpret = " (TRITON_INTERPRET: the interpreter, for tests)" if interpreting() else ""
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


def _native_library(load: bool) -> str:
    from . import _native

    if _native.switched_off():
        return "switched off (FASTLAYERS_NO_NATIVE is set)"
    built = ", ".join(f"{variant} ({path.name})" for variant, path in _native.built().items()) or "none"
    if not load:
        variant, why = _native.choose()
        return f"would load {variant} ({why}); built: {built}" if variant else f"NOT available: {why}"
    line = _native.describe()  # (its warnings: the report's "Warnings:" section, as the other probes')
    if _native.library() is not None:
        own = f"its own kernel (matmul.c) from {_native.own_products_from()} rows"
        bf16_rows = _native.BF16_MIN_ROWS
        own_bf16 = f"VDPBF16PS from {bf16_rows} rows"
        line += (f"; the recurrent layers' large products on "
                 f"{own if _native.own_products() else 'torch BLAS'}"
                 f"; their bf16 time loops' step products on "
                 f"{'VDPBF16PS (AVX512-BF16)' if _native.bf16_products() else 'float32 arithmetic'}"
                 f"; their large bf16 products on "
                 f"{own_bf16 if _native.bf16_large_products(bf16_rows) else 'torch'}")
    return line


def _operators(load: bool) -> str:
    import torch

    from ._native import ops_lib

    if not load:
        return "not loaded (report(load=False))"
    loaded = ops_lib.load()  # (its warnings: the report's "Warnings:" section)
    if loaded:
        limit = torch.ops.fastlayers.cache_info()[4] >> 20
        return ("registered (torch.ops.fastlayers: lstm_padded, gru_padded, rnn_padded, locally_connected2d); "
                f"the CPU block cache of the layers' per-call tensors keeps up to {limit} MiB idle "
                f"(FASTLAYERS_CPU_CACHE_MB{'; 0: off' if limit == 0 else ''})")
    return f"NOT available: {ops_lib._STATE.get('error') or 'unavailable'}"


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


def report(load: bool = True) -> str:
    """A plain-text report of the machine as fastlayers sees it (see the module docstring).

    Args:
        load: load the native library and register its operators to say whether they work;
            False only says which variant would load.

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
        ("Native library", lambda: _native_library(load)),
        ("C++ operators", lambda: _operators(load)),
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
