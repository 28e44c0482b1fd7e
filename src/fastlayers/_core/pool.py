"""Reuse of the engine's internal buffers between calls.

The recurrent engine keeps large per-row buffers for its backward (gates, LayerNorm statistics,
cell states: ~600 MB per layer at the seed shape) that never leave it. Fresh buffers of that
size cost the kernel's first touch of every page (measured on the 2-core machine: the seed-shape
LayerNorm-LSTM forward kernel took 412 ms on fresh buffers and 222 ms on reused ones, the
backward 377 vs 249 ms), so the engine takes them from this pool and gives them back when they
are dead: at the end of a backward that frees the graph, or when the autograd node that holds
them is destroyed (no backward, ``torch.no_grad``, a retained graph dropped later).

Buffers come as one flat slab per call, cut into views. The pool keeps at most ``CAPACITY``
slabs (the smallest go first); a request that no free slab fits drops the free slabs of its dtype
and device (all smaller) before allocating; :func:`empty_cache` releases them all. With
``torch.utils.deterministic.fill_uninitialized_memory`` on, a reused slab is filled with NaN like
a fresh ``torch.empty``, so the poisoned test pass still sees reads of unwritten memory.

The tensors that leave the engine (its outputs, the input gradients, the packed input rows autograd
keeps) cannot come from a slab, their lifetime is not the engine's: :func:`empty` takes their
memory from the native library's block cache (``_native/ops_cache.h``), which gets a block back
when its tensor dies, whoever held it. Its idle blocks are kept up to ``$FASTLAYERS_CPU_CACHE_MB``
MiB (default 1024; 0 off); :func:`empty_cache` releases them too.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import weakref
from typing import Any, Callable

import torch
from torch import Tensor

from .._native import ops_lib, warn_once

CAPACITY = 8
CACHE_MIN_BYTES = 1 << 20  # smaller tensors: torch.empty (malloc keeps such blocks mapped itself)
_cache: dict[str, Any] = {}
_ALIGN = 16  # elements between the starts of two views (64 bytes for float32)
_free: list[Tensor] = []
_lock = threading.Lock()


def _take(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    with _lock:
        best, best_numel = -1, 0  # the smallest free slab that fits (by position: list.remove would compare
        for i, s in enumerate(_free):  # tensors elementwise); the cheap tests first
            n = s.numel()
            if n >= numel and (best < 0 or n < best_numel) and s.dtype == dtype and s.device == device:
                best, best_numel = i, n
        if best >= 0:
            slab = _free.pop(best)
            if torch.utils.deterministic.fill_uninitialized_memory and torch.are_deterministic_algorithms_enabled():
                slab.fill_(float("nan") if dtype.is_floating_point else 0)
            return slab
        # none fits: the free slabs of this kind are too small for this call (e.g. the forward's
        # work space when the backward asks for its larger one); drop them before allocating, so
        # idle memory does not add to the peak (the new slab serves their requests next time)
        _free[:] = [s for s in _free if not (s.dtype == dtype and s.device == device)]
    # (made outside inference mode: a slab reused outside it too)
    normal = torch.inference_mode(False) if not torch.compiler.is_compiling() and torch.is_inference_mode_enabled() \
        else contextlib.nullcontext()
    with normal:
        return torch.empty(numel + numel // 8, dtype=dtype, device=device)  # headroom for a slightly longer batch


def give(slab: Tensor) -> None:
    """Return a slab (from :func:`views`) for later calls; nothing may use its views afterwards.
    An inference tensor (not one of :func:`_take`'s, which are made outside inference mode) is
    dropped instead: it cannot be written outside inference mode."""
    if not torch.compiler.is_compiling() and slab.is_inference():
        return
    with _lock:
        _free.append(slab)
        while len(_free) > CAPACITY:
            _free.pop(min(range(len(_free)), key=lambda i: _free[i].numel()))


_RELEASE: list[Callable[[], None]] = []  # the families' own caches (on_empty_cache)


def on_empty_cache(release: Callable[[], None]) -> None:
    """Have :func:`empty_cache` call ``release`` too (a layer family's own buffers: the GPU engine's
    captured loops), so this module knows no family."""
    _RELEASE.append(release)


def empty_cache() -> None:
    """Release every buffer the recurrent engine keeps for reuse between calls (it holds at most
    a few calls' worth of saved activations, the idle blocks of the CPU block cache up to
    ``$FASTLAYERS_CPU_CACHE_MB``, and on CUDA the captured time loops (CUDA graphs) with their
    buffers; the next call allocates them again, and captures again). Like
    ``torch.cuda.empty_cache``, it frees memory that no live tensor uses; the memory goes back to
    torch's caching allocator (``torch.cuda.empty_cache()`` then returns it to the device)."""
    with _lock:
        _free.clear()
    if _cache_on():  # (decided here too: a process of no-grad calls filled it through the C++ operators alone)
        torch.ops.fastlayers.cache_release()
    for release in _RELEASE:
        release()


def _cache_on() -> bool:
    """Whether the native block cache serves :func:`empty`: the library loads and its limit
    (``$FASTLAYERS_CPU_CACHE_MB``, read by the library) is not 0. Decided once per process."""
    on = _cache.get("on")
    if on is None:
        raw = os.environ.get("FASTLAYERS_CPU_CACHE_MB", "").strip()
        if raw and not (raw.isascii() and raw.isdigit()):  # (the library reads it so, and takes the default then)
            warn_once(f"fastlayers: FASTLAYERS_CPU_CACHE_MB={raw!r}: expected a whole number of MiB >= 0; "
                      f"the default (1024) is used", stacklevel=4)
        on = _cache["on"] = bool(ops_lib.load() and torch.ops.fastlayers.cache_info()[4] > 0)
    return on


def empty(shape: tuple[int, ...], dtype: torch.dtype, like: Tensor) -> Tensor:
    """``torch.empty(shape, dtype=dtype, device=like.device)`` for a per-call tensor that leaves the
    engine: from the native block cache where it serves (a plain CPU tensor ``like``, eager, at
    least ``CACHE_MIN_BYTES``, the C++ operators' floor too), else torch's allocator. Poisoned as
    ``torch.empty`` is under ``torch.utils.deterministic.fill_uninitialized_memory`` (the operator
    fills its tensor then)."""
    numel = math.prod(shape)
    if (numel * dtype.itemsize < CACHE_MIN_BYTES or like.device.type != "cpu"
            or not (type(like) is torch.Tensor or type(like) is torch.nn.Parameter)  # not fake / functional
            or torch.compiler.is_compiling() or not _cache_on()):
        return torch.empty(shape, dtype=dtype, device=like.device)
    return torch.ops.fastlayers.cached_empty(list(shape), dtype)


def cache_info() -> dict[str, int] | None:
    """The CPU block cache's counters (bytes idle, bytes in use, requests served by an idle block
    ``hits`` or by a new one ``misses``, the limit in bytes); None where it is off."""
    if not _cache_on():
        return None
    return dict(zip(("idle", "used", "hits", "misses", "limit"), torch.ops.fastlayers.cache_info()))


Shape = tuple[int, ...]


def views(shapes: dict[str, Shape | tuple[Shape, torch.dtype] | None], dtype: torch.dtype, device: torch.device,
          fresh: bool = False) -> tuple[Tensor | None, dict[str, Tensor | None]]:
    """One slab from the pool cut into contiguous views of the given shapes (None stays None).
    A value ``(shape, other_dtype)`` gives a view of that dtype (e.g. the bfloat16 copies of GEMM
    operands inside a float32 slab). Returns (slab, views). ``fresh``: separate new tensors
    instead (slab None), for buffers that leave their owner, e.g. as outputs of a custom operator."""
    typed = {k: (v if v is None or (len(v) == 2 and isinstance(v[1], torch.dtype)) else (v, dtype))
             for k, v in shapes.items()}
    if fresh:
        return None, {k: torch.empty(v[0], dtype=v[1], device=device) if v is not None else None
                      for k, v in typed.items()}
    item = dtype.itemsize
    sizes = {k: -(-math.prod(v[0]) * v[1].itemsize // item) if v is not None else 0 for k, v in typed.items()}
    total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes.values())
    slab = _take(max(total, 1), dtype, device)
    out: dict[str, Tensor | None] = {}
    offset = 0
    for k, v in typed.items():
        if v is None:
            out[k] = None
            continue
        shape, dt = v
        region = slab[offset:offset + sizes[k]]
        out[k] = (region if dt == dtype else region.view(dt)[:math.prod(shape)]).view(shape)
        offset += -(-sizes[k] // _ALIGN) * _ALIGN
    return slab, out


def hold(owner: Any, slab: Tensor | None) -> Any:
    """Give ``slab`` back when ``owner`` (an autograd context) is destroyed, or earlier when the
    returned finalizer is called (once; later calls do nothing). No slab: a no-op."""
    return weakref.finalize(owner, give, slab) if slab is not None else (lambda: None)


def graph_freed_after_this_backward() -> bool:
    """Inside a backward: True when the running backward frees the graph (no retain_graph /
    create_graph), so the saved buffers are dead once it returns. False when unknown."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep is not None and not keep()
