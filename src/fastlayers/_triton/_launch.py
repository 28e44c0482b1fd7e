"""Launching a Triton kernel again without Triton's per-call binding (host time of small calls):
the locally connected, attention-pooling and recurrent step kernels launch through :func:`launch`.

``kernel[grid](*args)`` binds the arguments, computes their specialization (dtypes, 16-byte
alignment of pointers, ints equal to 1 or divisible by 16) and looks the compiled kernel up on
every call: 30-40 us of the 80-90 us host time of a small locally connected forward on the H200's
host (Triton 3.6, 2026-11-26). :func:`launch` does that once per *call signature*, a key at least
as fine as Triton's specialization (Triton 3.6 to 3.9, ``native_specialize_impl``): every
tensor's dtype and whether its data pointer is 16-byte aligned; every int's class (equal to 1,
which Triton makes a constant; divisible by 16; 32-bit, 64-bit or unsigned 64-bit), so that a
step index that changes at every launch of a time loop keeps one entry; bools and floats by
type (Triton specializes neither on its value); every constexpr by value; the launch options and
the current device. A later call with the same signature calls the compiled kernel's launcher
directly with this call's values, as ``JITFunction.run`` does after its lookup (Triton 3.6 to 3.9:
``CompiledKernel.run(grid_0, grid_1, grid_2, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *args)``).

Every other case takes Triton's own path: another Triton version, a launch hook set (profilers,
``triton.knobs.runtime.launch_enter_hook``), CPU tensors (Triton's interpreter), or a first call.
The constexprs are passed to the launcher by position: the first call of a kernel checks that
they are named in the kernel's order (AssertionError otherwise, on any device).

Triton launches on the current CUDA device and its current stream; :func:`launch` makes the device
of the first tensor argument current around the launch (as ``torch.cuda.device`` does), so that a
layer on ``cuda:1`` runs there while ``cuda:0`` is current, as torch's own ops do.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

try:  # Triton's runtime settings and driver: where launch hooks and the current stream live
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover - Triton releases before knobs: Triton's own path only
    _knobs = _driver = None

_VERSIONS = ("3.6.", "3.7.", "3.8.", "3.9.")
SUPPORTED = _knobs is not None and triton.__version__.startswith(_VERSIONS)
ENABLED = True  # False: Triton's own path for every call (benchmarks compare the two)
_MAX_ENTRIES = 64  # compiled kernels remembered per Triton kernel; the cache starts over past it
_CACHE: dict[object, dict[tuple, object]] = {}
_CHECKED: set[tuple] = set()  # (kernel, argument count, constexpr names) whose order was checked
_I32, _I64 = 2**31, 2**63


def _key(a):
    """An argument's part of the call signature (module docstring)."""
    if isinstance(a, Tensor):
        return a.dtype, not a.data_ptr() & 15
    if type(a) is int:
        return 1 if a == 1 else (not a & 15, -_I32 <= a < _I32, a < _I64)
    if type(a) in (bool, float):
        return type(a)
    return a  # None and other values: by value


def _check_order(kernel, args: tuple, constexprs: dict) -> None:
    """Assert that ``constexprs`` name the kernel's parameters after ``args``, in its order."""
    names = getattr(kernel, "arg_names", None)
    key = (id(kernel), len(args), tuple(constexprs))
    if names is None or key in _CHECKED:
        return
    assert tuple(names[len(args):]) == tuple(constexprs), (
        f"launch({getattr(kernel, '__name__', kernel)}): constexprs {tuple(constexprs)} are not the kernel's "
        f"parameters after its {len(args)} leading ones, in order: {tuple(names[len(args):])}")
    _CHECKED.add(key)


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps them in chains that are empty by default)."""
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _current_device() -> int:
    return _driver.active.get_current_device() if _driver is not None else torch.cuda.current_device()


def _on_device(index: int):
    """``torch.cuda.device(index)``: that GPU current inside the block."""
    return torch.cuda.device(index)


def launch(kernel, grid: tuple[int, ...], args: tuple, constexprs: dict, **options) -> None:
    """``kernel[grid](*args, **constexprs, **options)``: ``args`` the kernel's leading parameters in
    its order (the first a tensor), ``constexprs`` the rest, by name, in its order (the launcher
    takes them all, positionally, as Triton passes them), ``options`` the launch options
    (num_warps, ...)."""
    if not args[0].is_cuda:  # CPU tensors: Triton's interpreter
        _check_order(kernel, args, constexprs)
        kernel[grid](*args, **constexprs, **options)
        return
    device = _current_device()  # where Triton launches: the current device
    if args[0].get_device() != device:  # tensors on another GPU than the current one: launch on theirs
        with _on_device(args[0].get_device()):
            return launch(kernel, grid, args, constexprs, **options)
    if not ENABLED or not SUPPORTED or _hooked():
        _check_order(kernel, args, constexprs)
        kernel[grid](*args, **constexprs, **options)
        return
    key = (device, *map(_key, args), *constexprs.values(), *options.items())
    cache = _CACHE.setdefault(kernel, {})
    compiled = cache.get(key)
    if compiled is None:
        _check_order(kernel, args, constexprs)
        compiled = kernel[grid](*args, **constexprs, **options)  # Triton's path: binds, compiles if needed, launches
        if len(cache) >= _MAX_ENTRIES:
            cache.clear()
        cache[key] = compiled
        return
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 _driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata, None, None,
                 None, *args, *constexprs.values())
