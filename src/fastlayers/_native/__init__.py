"""fastlayers' native library: the C kernels (``lstm.c``, ``gru.c``, ``local.c``, ``matmul.c``; plain
C99 + OpenMP, called through ctypes) and the C++ operators (``ops.cpp``, ``TORCH_LIBRARY``) linked into one shared
library per CPU variant, built when the package is built (``setup.py``: ``pip install
--no-build-isolation .``, ``pip wheel``, or an editable install) and loaded here, one variant per
process. Nothing is compiled at run time.

Variants (x86-64; elsewhere ``default`` only), PyTorch's own capability levels and flags:
``default`` (the x86-64 baseline), ``avx2`` (AVX2 + FMA + F16C) and ``avx512`` (AVX-512 F/BW/VL/DQ).
The one loaded: ``$FASTLAYERS_CPU_CAPABILITY`` where set (``default``, ``avx2`` or ``avx512``: a
variant this CPU cannot run, or one not built, gives one warning and the best that runs), else the
best variant the CPU runs, read from torch's own CPU check
(``torch.backends.cpu.get_cpu_capability()``: ``AVX512`` needs AVX-512 F/BW/VL/DQ and FMA, ``AVX2``
AVX2 and FMA). ``fastlayers doctor`` prints the choice and why (:func:`describe`).

Failures never raise from a layer: a variant's file that does not load (damaged, an older glibc)
gives one warning and the next variant down that the build holds; no library (a source checkout
that was not built: ``pip install -e . --no-build-isolation`` builds it), one built against another
torch release (recorded in the file, read before loading it: its C++ ABI differs), or no variant
that loads ends in one warning per process, after which :func:`load` returns None
and the callers take their pure-PyTorch path (:func:`fastlayers._core.backend.select` then picks
``"cpu"`` only for an op that needs no C library). A process that loaded a variant's file itself
first (``torch.ops.load_library``, docs/deploy.md) keeps it: that file (or a copy of it) is used,
with one warning where it is another variant; a file of another build that registered the
operators gives one warning and the pure-PyTorch path (a second library of the operators cannot
load beside the first: the process would abort). ``FASTLAYERS_NO_NATIVE=1`` switches the library
off without a warning. The C kernels run only on CPU tensors: other devices take their own path
whatever happens here.
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
import warnings
from pathlib import Path

VARIANTS = ("default", "avx2", "avx512")  # lowest first
ENV = "FASTLAYERS_CPU_CAPABILITY"
PRODUCTS_ENV = "FASTLAYERS_LARGE_PRODUCTS"
_HERE = Path(__file__).parent
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "lib": the CDLL or None; "path", "variant", "why"; "error": why it is unavailable
_WARNED: set[str] = set()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def warn_once(message: str, stacklevel: int = 2) -> None:
    """One warning per distinct message and process."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)


def built() -> dict[str, Path]:
    """variant -> its library file in this package (the variants this build holds)."""
    found = {}
    for variant in VARIANTS:
        files = sorted(glob.glob(str(_HERE / f"_C_{variant}*.so")))
        if files:
            found[variant] = Path(files[0])
    return found


def cpu_capability() -> str:
    """The best variant this CPU runs (torch's CPU check: ``torch.backends.cpu.get_cpu_capability()``)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability().upper()
    if capability.startswith("AVX512"):
        return "avx512"
    return "avx2" if capability.startswith("AVX2") else "default"


def choose() -> tuple[str | None, str]:
    """(the variant to load, why), or (None, why not): see the module docstring."""
    have = built()
    if not have:
        return None, (f"no native library in {_HERE} (a source checkout that was not built: "
                      f"pip install -e . --no-build-isolation)")
    best = cpu_capability()
    runs = [v for v in VARIANTS[:VARIANTS.index(best) + 1] if v in have]
    if not runs:
        return None, f"this build holds {sorted(have)}, none of which this CPU ({best}) runs"
    forced = os.environ.get(ENV, "").strip().lower()
    if forced:
        if forced in runs:
            return forced, f"{ENV}={forced}"
        warn_once(f"fastlayers: {ENV}={forced!r}: expected one of {list(VARIANTS)} that this CPU runs and this "
                  f"build holds ({runs}); using {runs[-1]}", stacklevel=5)
        return runs[-1], f"{ENV}={forced!r} is not available here; the best this CPU runs"
    return runs[-1], f"the best this CPU runs (torch's CPU capability: {best})"


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to anything but empty, ``0``, ``false``,
    ``no`` or ``off`` (case and surrounding white space ignored): fastlayers' on / off switches."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def switched_off() -> bool:
    """``FASTLAYERS_NO_NATIVE`` set (:func:`env_flag`)."""
    return env_flag("FASTLAYERS_NO_NATIVE")


_MARKER = b"fastlayers-torch-version:"  # variant.cpp: the torch a library was built against


def built_against(path: Path) -> str | None:
    """The torch version ``path`` was built against, read from the file's bytes (loading it would
    register its operators with this torch already); None for a library without the record."""
    data = path.read_bytes()
    start = data.find(_MARKER)
    if start < 0:
        return None
    start += len(_MARKER)
    end = data.find(b"\0", start)
    return data[start:end].decode("ascii", "replace") if end > start else None


def _other_torch(path: Path) -> str | None:
    """Why ``path`` must not load into this torch (another major.minor release: torch's C++ ABI
    changes between them), or None."""
    import torch

    built, running = built_against(path), torch.__version__.split("+")[0]
    if built is not None and built.split(".")[:2] != running.split(".")[:2]:
        return f"{path} was built against torch {built}, and this is torch {running}"
    return None


def _registered() -> bool:
    """Whether this process holds the C++ operators (``ops.cpp``'s ``TORCH_LIBRARY``), from any file."""
    import torch

    return bool(torch._C._jit_get_schemas_for_operator("fastlayers::lstm_padded"))


def _loaded_already(have: dict[str, Path]) -> tuple[str | None, str] | None:
    """Where the C++ operators were registered before this loader ran (``torch.ops.load_library`` of
    a variant's file by hand, as a serving process does: docs/deploy.md): (the variant of this build
    that file is, or None for another file, its path), or None where they are not registered. A
    second ``TORCH_LIBRARY`` of the namespace aborts the process, so no other file may load then."""
    import torch

    if not _registered():
        return None
    for path in sorted(torch.ops.loaded_libraries):
        for variant, ours in have.items():
            try:
                if os.path.samefile(path, ours) or (os.path.getsize(path) == ours.stat().st_size
                                                    and Path(path).read_bytes() == ours.read_bytes()):
                    return variant, str(path)  # (this build's file, or a copy of it)
            except OSError:
                continue
    others = sorted(str(p) for p in torch.ops.loaded_libraries)
    return None, (", ".join(others) if others else "a library loaded without torch.ops.load_library")


def _open() -> ctypes.CDLL | None:
    if switched_off():
        _STATE["error"] = "FASTLAYERS_NO_NATIVE is set"
        return None
    variant, why = choose()
    _STATE["variant"], _STATE["why"] = variant, why
    if variant is None:
        _STATE["error"] = why
        warn_once(f"fastlayers: {why}; the C kernels and C++ operators are unavailable and the layers use the "
                  f"slower pure-PyTorch path", stacklevel=5)
        return None
    have = built()
    path = have[variant]
    try:
        other = _other_torch(path)
    except OSError:  # unreadable (a dangling link, no permission): the load below says so, then the next variant
        other = None
    if other is not None:
        _STATE["error"] = other
        warn_once(f"fastlayers: the native library {other}; the layers use the slower pure-PyTorch path (install "
                  f"the torch it was built against, or rebuild fastlayers against this one)", stacklevel=5)
        return None
    # the chosen variant, else the next ones down that this build holds (a damaged file of one
    # variant costs its speed, not the library)
    candidates = [v for v in VARIANTS[VARIANTS.index(variant)::-1] if v in have]
    loaded = _loaded_already(have)
    if loaded is not None:  # the operators registered before fastlayers loads (torch.ops.load_library by hand)
        if loaded[0] is None:
            _STATE["error"] = (f"the operators torch.ops.fastlayers are already registered in this process by "
                               f"{loaded[1]}, which is not a file of this fastlayers build")
            warn_once(f"fastlayers: {_STATE['error']} (one operator library per process: another one cannot load "
                      f"beside it); the layers use the slower pure-PyTorch path", stacklevel=5)
            return None
        if loaded[0] != variant:
            warn_once(f"fastlayers: this process loaded the {loaded[0]} variant of the native library before "
                      f"fastlayers did ({loaded[1]}); it is used instead of {variant} (one operator library per "
                      f"process: another one cannot load beside it)", stacklevel=5)
            _STATE["variant"], _STATE["why"] = loaded[0], f"loaded before fastlayers did ({loaded[1]})"
        candidates, have = [loaded[0]], {**have, loaded[0]: Path(loaded[1])}
    failed: list[str] = []
    lib = None
    import torch

    for candidate in candidates:
        try:
            torch.ops.load_library(str(have[candidate]))  # the operators (TORCH_LIBRARY); the same file holds the C kernels
        except Exception as e:  # (OSError: undefined symbols, an older glibc, a damaged file; never raise from a layer)
            failed.append(f"{have[candidate]} does not load ({type(e).__name__}: {e})")
            if not _registered():
                continue
        else:
            try:
                lib = ctypes.CDLL(str(have[candidate]))
            except Exception as e:
                failed.append(f"{have[candidate]} does not load ({type(e).__name__}: {e})")
        break  # its operators are registered: no other variant can load beside them (the process would abort)
    if lib is None:
        _STATE["error"] = "; ".join(failed)
        warn_once(f"fastlayers: the native library {_STATE['error']}; the layers use the slower pure-PyTorch path "
                  f"(rebuild fastlayers against the installed torch)", stacklevel=5)
        return None
    if failed:
        _STATE["variant"], _STATE["why"] = candidate, f"{variant} does not load; the next variant down"
        warn_once(f"fastlayers: the native library {'; '.join(failed)}; loaded the {candidate} variant instead "
                  f"(slower)", stacklevel=5)
    try:
        _declare(lib)
    except AttributeError as e:  # a library of another build (a symbol missing): its C kernels cannot be called
        _STATE["error"] = f"{have[candidate]} lacks a C kernel this fastlayers calls ({e})"
        warn_once(f"fastlayers: the native library {_STATE['error']}; the layers use the slower pure-PyTorch path "
                  f"(reinstall or rebuild fastlayers)", stacklevel=5)
        return None
    _STATE["path"] = have[candidate]
    choice = os.environ.get(PRODUCTS_ENV, "").strip().lower()
    if choice in ("native", "torch"):
        lib.fl_matmul_prefer(int(choice == "native"))
    elif choice:
        warn_once(f"fastlayers: {PRODUCTS_ENV}={choice!r}: expected 'native' or 'torch'; the CPU's choice is used",
                  stacklevel=5)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    """The signatures of the C entry points called through ctypes (AttributeError for a missing one)."""
    lib.fl_matmul_preferred.argtypes, lib.fl_matmul_preferred.restype = [ctypes.c_int64], ctypes.c_int
    lib.fl_matmul_prefer.argtypes, lib.fl_matmul_prefer.restype = [ctypes.c_int], None
    lib.fl_matmul_scratch_rows.argtypes, lib.fl_matmul_scratch_rows.restype = [], ctypes.c_int64
    lib.fl_matmul_min_rows.argtypes, lib.fl_matmul_min_rows.restype = [], ctypes.c_int64
    lib.fl_bf16_products.argtypes, lib.fl_bf16_products.restype = [], ctypes.c_int
    lib.fl_matmul_bf16_scratch.argtypes, lib.fl_matmul_bf16_scratch.restype = [ctypes.c_int64], ctypes.c_int64
    lib.fl_matmul_bf16.restype = None
    lib.fl_matmul_bf16.argtypes = [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int] * 2 \
        + [ctypes.c_void_p] * 4 + [ctypes.c_int]


def library() -> ctypes.CDLL | None:
    """The loaded library (loaded on the first call), or None if unavailable (one warning)."""
    if "lib" in _STATE:
        return _STATE["lib"]  # type: ignore[return-value]
    with _LOCK:
        if "lib" not in _STATE:
            _STATE["lib"] = _open()
        return _STATE["lib"]  # type: ignore[return-value]


def load(name: str) -> ctypes.CDLL | None:
    """The library holding the C kernels of ``name`` (``"lstm"``, ``"gru"``, ``"local"``: one
    library holds them all), or None if unavailable (see the module docstring; it never raises)."""
    return library()


def why_unavailable(name: str | None = None) -> str | None:
    """Why :func:`library` returned None (None: it did not, or was not called yet)."""
    return _STATE.get("error")  # type: ignore[return-value]


def library_path() -> str:
    """The path of the loaded library (loading it first).

    Raises:
        RuntimeError: it is unavailable, with why.
    """
    if library() is None:
        raise RuntimeError(f"fastlayers: the native library is unavailable: {why_unavailable()}")
    return str(_STATE["path"])


def own_products(rows: int = 1 << 62) -> bool:
    """Whether the recurrent layers' large products (the input projection, its input gradient and the
    weight gradients) of ``rows`` rows per direction run on the library's own kernel (``matmul.c``)
    instead of torch's BLAS: on AMD CPUs from :func:`own_products_from` rows, where it was measured
    faster (torch's MKL runs a generic code path there; on Intel it runs its own AVX-512 code; below
    those rows packing the weight costs more than the kernel gains); ``$FASTLAYERS_LARGE_PRODUCTS``
    (``native`` or ``torch``, any size) or :func:`prefer_own_products` overrides. False where the
    library is unavailable."""
    lib = library()
    return bool(lib is not None and lib.fl_matmul_preferred(rows))


def own_products_from() -> int | None:
    """The fewest rows per direction whose large products :func:`own_products` puts on ``matmul.c``
    by this CPU's choice, where it would on an AMD CPU (640; on AMD family 26, Zen 5, and newer: 64
    in the avx512 build, 256 in the avx2 one: ``matmul.c``'s ``fl_matmul_min_rows``); None without
    the library, and in the default variant (no AVX2), which never chooses ``matmul.c`` by itself."""
    lib = library()
    if lib is None or built_as() == "default":
        return None
    return int(lib.fl_matmul_min_rows())


def prefer_own_products(choice: bool | None) -> None:
    """Force the choice of :func:`own_products` for this process (True: ``matmul.c`` at any size, False:
    torch's BLAS, None: the CPU's choice); the C++ operators follow it too. A no-op without the library."""
    lib = library()
    if lib is not None:
        lib.fl_matmul_prefer(-1 if choice is None else int(choice))


def bf16_products() -> bool:
    """Whether the LSTM / GRU time loops multiply in bfloat16 on this CPU's dot-product instructions
    (AVX512-BF16's VDPBF16PS, ``gemm_bf16.h``; the avx512 variant on a CPU that has them) when they
    run in bf16; elsewhere they multiply the bf16-rounded values in float32 (the same products,
    summed in another order). False where the library is unavailable."""
    lib = library()
    return bool(lib is not None and lib.fl_bf16_products())


BF16_MIN_ROWS = 640  # the fewest rows of the large bf16 products on matmul.c by the CPU's choice


def bf16_large_products(rows: int) -> bool:
    """Whether the recurrent layers' large bf16 products of ``rows`` rows per direction (the input
    projection and its input gradient) run on ``matmul.c``'s VDPBF16PS kernel (``fl_matmul_bf16``,
    float32 results written in place) instead of torch's bf16 GEMM: where the step loops multiply
    on it (:func:`bf16_products`), :func:`own_products` chooses the library's kernels for that size,
    the CPU has no AMX (torch's oneDNN multiplies on AMX tiles there, faster), and from
    ``BF16_MIN_ROWS`` rows unless :func:`prefer_own_products` forces the library's kernels (measured
    on a Zen 4; the float32 products' smaller counts of a Zen 5, :func:`own_products_from`, were
    measured in float32 only)."""
    import torch

    forced = own_products(0)  # (no CPU's own choice takes a product of 0 rows: only a forced one)
    return (bf16_products() and own_products(rows) and (forced or rows >= BF16_MIN_ROWS)
            and not torch.cpu._is_amx_tile_supported())


def describe() -> str:
    """One line for ``fastlayers doctor``: the variant loaded (or why none) and why it was chosen."""
    made = built_as()  # what the loaded file says it was built as
    if made is None:
        return f"unavailable: {why_unavailable()}"
    return f"{made} ({_STATE['why']}; {_STATE['path']}; built: {', '.join(built())})"


def declare(lib: ctypes.CDLL, name: str, signatures) -> ctypes.CDLL:
    """``lib`` with the argtypes of layer family ``name``'s kernels set, once per family (one library
    holds every family's kernels): ``signatures(real)`` -> {function stem: argtypes} for ``real`` =
    c_float (the ``<stem>_f32`` functions) and c_double (``<stem>_f64``); every kernel returns void."""
    mark = f"_fastlayers_typed_{name}"
    if not getattr(lib, mark, False):
        for suffix, real in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
            for stem, argtypes in signatures(real).items():
                f = getattr(lib, f"{stem}_{suffix}")
                f.argtypes, f.restype = argtypes, None
        setattr(lib, mark, True)
    return lib


def built_as() -> str | None:
    """The variant the loaded library says it was built as (its ``fastlayers_variant()``), None
    where none is loaded."""
    lib = library()
    if lib is None:
        return None
    lib.fastlayers_variant.restype = ctypes.c_char_p
    return lib.fastlayers_variant().decode()


def address(tensor) -> int | None:
    """Data address of a tensor for a ctypes call, None for an absent (optional) argument."""
    return None if tensor is None else tensor.data_ptr()


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

