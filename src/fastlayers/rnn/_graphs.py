"""The GPU engine's time loops, run eagerly or captured once in a CUDA graph and replayed.

A time loop launches 2-4 kernels per step (GEMM, step kernel, and with a projection one more of
each): T = 800 steps are thousands of launches, whose host cost dominates an eager loop on a GPU.
A loop here is a function of a dict of tensors (its inputs and the buffers it writes) and of
nothing else, so it can be captured in a ``torch.cuda.CUDAGraph`` and replayed with new inputs
copied into the captured ones. The lengths are one of those inputs (the kernels read them), so
a new lengths vector reuses the graph; a new shape, dtype, option set or device captures a new one.

Capture is the default on CUDA (measured on an H100 at the seed shape, BENCHMARKS.md, 2026-11-24:
the LayerNorm-LSTM's fwd+bwd took 21.5 ms captured against 233.3 ms eagerly), with a warm-up: the
first call with a given key (shapes, dtypes, option set, device) runs eagerly, the second
captures, later ones replay. ``FASTLAYERS_CUDA_GRAPHS``: ``0`` never captures (every loop eager),
``1`` captures from the first call, unset (or ``auto``) is the default.

A captured entry keeps its buffers (one call's saved activations and work space) for the next
replay; while one call's backward is pending, a second call with the same key captures a second
entry. Idle entries are dropped, least recently used first, when the buffers of all entries of a
device exceed ``FASTLAYERS_CUDA_GRAPHS_MAX_MB`` (default: a quarter of the device's memory), so
a workload with many shapes does not keep a capture per shape alive.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _pool

ENV = "FASTLAYERS_CUDA_GRAPHS"
MAX_MB = "FASTLAYERS_CUDA_GRAPHS_MAX_MB"
WARMUP = 1  # eager calls of a key before it is captured (mode "auto")
Loop = Callable[[dict[str, Any]], None]


class _Entry:
    def __init__(self) -> None:
        self.statics: dict[str, Any] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.busy = False
        self.nbytes = 0


_entries: "OrderedDict[tuple, list[_Entry]]" = OrderedDict()  # least recently used first
_seen: "OrderedDict[tuple, int]" = OrderedDict()  # eager calls per key not captured yet (bounded)
_SEEN_KEYS = 4096
_lock = threading.Lock()
stats = {"captures": 0, "evicted": 0}  # since import: what a benchmark checks (a capture per key, none evicted)


def mode() -> str:
    """``off``, ``always`` or ``auto`` from ``FASTLAYERS_CUDA_GRAPHS`` (0, 1, unset / auto)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes", "always"):
        return "always"
    if value in ("", "auto"):
        return "auto"
    raise ValueError(f"{ENV} must be 0, 1 or auto, got {value!r}")


def enabled(like: Tensor) -> bool:
    """Whether loops on tensors like ``like`` may be captured and replayed (CUDA, not switched off,
    and not inside someone else's capture)."""
    return (like.device.type == "cuda" and mode() != "off"
            and not torch.cuda.is_current_stream_capturing())


def clear() -> None:
    """Drop every captured loop and its buffers."""
    with _lock:
        _entries.clear()
        _seen.clear()


def limit_bytes(device: torch.device) -> int:
    """The most bytes the captured entries of ``device`` keep (``FASTLAYERS_CUDA_GRAPHS_MAX_MB``,
    default a quarter of the device's memory)."""
    value = os.environ.get(MAX_MB, "").strip()
    if value:
        try:
            mb = float(value)
        except ValueError:
            mb = -1.0
        if not mb >= 0:
            raise ValueError(f"{MAX_MB} must be a number of MiB >= 0, got {value!r}")
        return int(mb * 2**20)
    return torch.cuda.get_device_properties(device).total_memory // 4


def _warm(full: tuple) -> bool:
    """Count an eager call of ``full``; True once it has had its warm-up calls (mode auto)."""
    if mode() == "always":
        return True
    count = _seen.pop(full, 0)
    if count >= WARMUP:
        return True
    _seen[full] = count + 1
    while len(_seen) > _SEEN_KEYS:
        _seen.popitem(last=False)
    return False


def _evict(device: torch.device, incoming: int, limit: int) -> None:
    """Drop idle entries of ``device``, least recently used first, until ``incoming`` more bytes fit
    under ``limit`` (busy entries stay: a pending backward reads their buffers)."""
    keys = [k for k in _entries if k[-1] == device]
    held = sum(e.nbytes for k in keys for e in _entries[k])
    for k in keys:
        if held + incoming <= limit:
            return
        kept = []
        for e in _entries[k]:
            if e.busy or held + incoming <= limit:
                kept.append(e)
            else:
                held -= e.nbytes
                stats["evicted"] += 1
        if kept:
            _entries[k] = kept
        else:
            del _entries[k]


def run(owner: object | None, key: tuple, ins: dict[str, Tensor | None], outs: dict[str, tuple | None],
        loop: Loop) -> tuple[dict[str, Any], Callable[[], None]]:
    """Run ``loop`` on ``ins`` plus new buffers of the shapes ``outs`` (None: absent), in the dtype
    and device of ``ins["numbers"]``. Returns (the tensors the loop ran on, release): eagerly, the
    inputs themselves and fresh buffers; captured, the entry's tensors, valid until ``release()``
    is called (also when ``owner`` is garbage-collected). The loop may update inputs in place."""
    like = ins["numbers"]
    assert like is not None
    entry = _claim(key, ins, outs) if enabled(like) else None
    if entry is None:  # eagerly
        st: dict[str, Any] = {**ins, **{k: like.new_empty(s) if s is not None else None for k, s in outs.items()}}
        loop(st)
        return st, _nothing
    if entry.graph is None:
        st = {k: v.clone() if v is not None else None for k, v in ins.items()}
        st.update({k: like.new_empty(s) if s is not None else None for k, s in outs.items()})
        try:
            graph = capture(lambda: loop(st), like.device)
        except BaseException:
            _drop(entry)
            raise
        entry.statics, entry.graph = st, graph
        stats["captures"] += 1
    st = entry.statics
    assert st is not None and entry.graph is not None
    for k, v in ins.items():
        if v is not None:
            st[k].copy_(v)
    entry.graph.replay()
    # weakref.finalize runs once, whether called or when the owner is collected
    return st, weakref.finalize(owner, _free, entry) if owner is not None else functools.partial(_free, entry)


def capture(fn: Callable[[], None], device: torch.device) -> "torch.cuda.CUDAGraph":
    """``fn`` captured in a new CUDA graph on ``device``, after one uncaptured call on a side stream
    (which compiles its kernels and sets cuBLAS up; ``fn`` must leave its inputs valid for a rerun)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _claim(key: tuple, ins: dict[str, Tensor | None], outs: dict[str, tuple | None]) -> _Entry | None:
    """An idle entry for this call (captured already, or new and to be captured), marked busy; None
    when the call runs eagerly (a key still warming up)."""
    like = ins["numbers"]
    assert like is not None
    signature = tuple((k, None if v is None else (tuple(v.shape), v.dtype, v.device)) for k, v in ins.items())
    full = (key, signature, tuple(outs.items()), like.device)
    with _lock:
        entries = _entries.get(full)
        entry = next((e for e in entries if not e.busy), None) if entries else None
        if entry is None:
            if not entries and not _warm(full):
                return None
            size = sum(int(torch.Size(s).numel()) for s in outs.values() if s is not None) * like.element_size() + \
                sum(v.numel() * v.element_size() for v in ins.values() if v is not None)
            _evict(like.device, size, limit_bytes(like.device))
            entry = _Entry()
            entry.nbytes = size
            _entries.setdefault(full, []).append(entry)
        _entries.move_to_end(full)
        entry.busy = True
    return entry


def backward_done(ctx: Any) -> None:
    """At the end of a backward: free the forward's captured buffers when this backward frees the
    autograd graph (with retain_graph they stay until the graph is dropped)."""
    release = getattr(ctx, "release", None)
    if release is not None and _pool.graph_freed_after_this_backward():
        release()


def _drop(entry: _Entry) -> None:
    """Forget an entry whose capture failed."""
    with _lock:
        for k, entries in list(_entries.items()):
            if entry in entries:
                entries.remove(entry)
                if not entries:
                    del _entries[k]


def _free(entry: _Entry) -> None:
    entry.busy = False


def _nothing() -> None:
    return None
