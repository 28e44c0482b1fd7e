"""The GPU engine's time loops, run eagerly or captured once in a CUDA graph and replayed.

A time loop launches 2-4 kernels per step (GEMM, step kernel, and with a projection one more of
each): T = 800 steps are thousands of launches, whose host cost dominates an eager loop on a GPU.
A loop here is a function of a dict of tensors (its inputs and the buffers it writes) and of
nothing else, so it can be captured in a ``torch.cuda.CUDAGraph`` and replayed with new inputs
copied into the captured ones. The lengths are one of those inputs (the kernels read them), so
a new lengths vector reuses the graph; a new shape, dtype, option set or device captures a new one.

Capture is opt-in while its speed is unmeasured: set the environment variable
``FASTLAYERS_CUDA_GRAPHS=1``. A captured entry's buffers hold one call's saved activations
until that call's backward is done (or its autograd graph is dropped); a second call with the
same key meanwhile captures a second entry.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _pool

ENV = "FASTLAYERS_CUDA_GRAPHS"
Loop = Callable[[dict[str, Any]], None]


class _Entry:
    def __init__(self) -> None:
        self.statics: dict[str, Any] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.busy = False


_entries: dict[tuple, list[_Entry]] = {}
_lock = threading.Lock()


def enabled(like: Tensor) -> bool:
    """Whether loops on tensors like ``like`` are captured and replayed (CUDA, opted in, and not
    inside someone else's capture)."""
    return (like.device.type == "cuda" and os.environ.get(ENV, "0") == "1"
            and not torch.cuda.is_current_stream_capturing())


def clear() -> None:
    """Drop every captured loop and its buffers."""
    with _lock:
        _entries.clear()


def run(owner: object | None, key: tuple, ins: dict[str, Tensor | None], outs: dict[str, tuple | None],
        loop: Loop) -> tuple[dict[str, Any], Callable[[], None]]:
    """Run ``loop`` on ``ins`` plus new buffers of the shapes ``outs`` (None: absent), in the dtype
    and device of ``ins["numbers"]``. Returns (the tensors the loop ran on, release): eagerly, the
    inputs themselves and fresh buffers; captured, the entry's tensors, valid until ``release()``
    is called (also when ``owner`` is garbage-collected). The loop may update inputs in place."""
    like = ins["numbers"]
    assert like is not None
    if not enabled(like):
        st: dict[str, Any] = {**ins, **{k: like.new_empty(s) if s is not None else None for k, s in outs.items()}}
        loop(st)
        return st, _nothing
    signature = tuple((k, None if v is None else (tuple(v.shape), v.dtype, v.device)) for k, v in ins.items())
    full = (key, signature, tuple(outs.items()))
    with _lock:
        entries = _entries.setdefault(full, [])
        entry = next((e for e in entries if not e.busy), None)
        if entry is None:
            entry = _Entry()
            entries.append(entry)
        entry.busy = True
    if entry.graph is None:
        st = {k: v.clone() if v is not None else None for k, v in ins.items()}
        st.update({k: like.new_empty(s) if s is not None else None for k, s in outs.items()})
        side = torch.cuda.Stream(like.device)
        side.wait_stream(torch.cuda.current_stream(like.device))
        with torch.cuda.stream(side):
            loop(st)  # compiles the kernels and sets cuBLAS up before the capture
        torch.cuda.current_stream(like.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loop(st)
        entry.statics, entry.graph = st, graph
    st = entry.statics
    assert st is not None and entry.graph is not None
    for k, v in ins.items():
        if v is not None:
            st[k].copy_(v)
    entry.graph.replay()
    # weakref.finalize runs once, whether called or when the owner is collected
    return st, weakref.finalize(owner, _free, entry) if owner is not None else functools.partial(_free, entry)


def backward_done(ctx: Any) -> None:
    """At the end of a backward: free the forward's captured buffers when this backward frees the
    autograd graph (with retain_graph they stay until the graph is dropped)."""
    release = getattr(ctx, "release", None)
    if release is not None and _pool.graph_freed_after_this_backward():
        release()


def _free(entry: _Entry) -> None:
    entry.busy = False


def _nothing() -> None:
    return None
