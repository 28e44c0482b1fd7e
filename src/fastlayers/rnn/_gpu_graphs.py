"""The GPU engine's time loops: run eagerly, or as a captured chunk of steps replayed for any length.

A time loop launches 2-4 kernels per step (GEMM, step kernel, and with a projection one more of
each): T = 800 steps are thousands of launches, whose host cost dominates an eager loop on a GPU
(measured on an H100 at the seed shape, BENCHMARKS.md, 2026-11-24: the LayerNorm-LSTM's fwd+bwd
took 21.5 ms with its loops in CUDA graphs against 233.3 ms eagerly).

What is captured is one *chunk* of ``CHUNK`` steps, not a loop of T steps. Every launch of a step
reads its step from device data: s = clock[0] + j, j fixed in the launch, ``clock`` = [first step,
T] an int32 tensor of the loop's buffers (:mod:`fastlayers._triton._cell`); a launch whose s is
outside [0, T) does nothing, and the chunk ends by moving clock[0] on by CHUNK (back, for a
backward loop). A loop of T steps sets the clock and replays the chunk ceil(T / CHUNK) times. So
one capture serves every T, and every lengths vector (the lengths are data too).

Entries. A captured entry holds the buffers of one layer call (its inputs, its saved activations
and, once a backward ran, the backward's buffers), each with its time dimension sized by the entry's
*capacity*, and the chunk graphs captured on them (the forward's, the backward's). It is keyed by
everything but T (the layer's loop key, the buffers' other dimensions, dtypes, device). A call of T
steps takes an idle entry of its key whose capacity is at least T; if there is none, the key's
capacity grows to max(T, GROWTH x the last one), rounded up to a multiple of CHUNK, and a new entry
is made (its graphs captured on first use) while the idle smaller ones are dropped: a recapture per
growth, never per T, and the memory held is that of the longest T seen (at most GROWTH x it, plus a
chunk). A varlen call's buffers hold its N value rows instead of T steps of B rows: its entries'
capacity counts rows (:func:`open`'s ``extent``). The forward's entry stays busy until the layer's
backward is done (``backward_done``; or its autograd node is dropped): a second call with the same
key meanwhile takes a second entry. Idle entries are dropped, least recently used first, when the
buffers of all entries of a device exceed ``FASTLAYERS_CUDA_GRAPHS_MAX_MB`` (default: a quarter of
the device's memory).

Eager loops run where capture is off or impossible: ``FASTLAYERS_CUDA_GRAPHS=0``, CPU tensors
(Triton's interpreter), inside a capture of the caller's own, under torch.compile; and loops of at
most ``EAGER_STEPS`` steps (small calls: a cell's step, a short sequence), whose few launches cost
less than an entry's bookkeeping (copies into its buffers, the clock) and a chunk's replay, whose
CHUNK steps all launch on the device even where T is 2. An eager loop has buffers of exactly T
steps and launches every step once (clock = [0, T], a :func:`constant` for the small T; j = s). A capture
that fails warns and runs that loop eagerly on the entry's buffers (the key is not captured
again in this process).

``FASTLAYERS_CUDA_GRAPHS``: ``0`` never captures, ``1`` or unset (``auto``) captures.

One file (about 560 lines) for one idea, the cache of captured loops: the loop (:class:`Loop`,
:func:`open`), the entries it claims and their sizes, eviction under the memory limit, the
generation counter the engine's readiness records check and the captured constants all share this
module's state (the entries, ``stats``, ``generation``) under one lock.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import Tensor

from .._core import pool

ENV = "FASTLAYERS_CUDA_GRAPHS"
MAX_MB = "FASTLAYERS_CUDA_GRAPHS_MAX_MB"
TIME = "T"  # in a buffer's shape: its time dimension (the loop's T eagerly, an entry's capacity captured)
CHUNK = 32  # steps per captured chunk (to measure on the GPU: benchmarks/rnn/bench_gpu_random_t.py --chunk)
GROWTH = 1.125  # a key's capacity grows at least this much (memory held <= GROWTH x the longest T + CHUNK)
EAGER_STEPS = 4  # loops of at most this many steps run eagerly (to measure on the GPU: bench_overhead.py --device cuda)
Chunk = Callable[[dict[str, Any], Iterable[int]], None]

_entries: "OrderedDict[tuple, list[_Entry]]" = OrderedDict()  # least recently used first
_capacity: dict[tuple, int] = {}  # per key: the capacity of its newest entry
_broken: set[tuple] = set()  # keys whose capture failed: eager from then on
_lock = threading.Lock()
_state = threading.local()  # .emulated (tests), .preparing (capacity of a capture-only call)
_constants: dict[tuple, Tensor] = {}  # read-only tensors the loops take (see constant)
_MAX_CONSTANTS = 256  # the cache of constants starts over past it
stats = {"captures": 0, "evicted": 0, "grown": 0, "replays": 0, "failed": 0}  # since import
generation = 0  # bumped whenever an entry is dropped: what _gpu's readiness records check


class _Entry:
    def __init__(self, key: tuple, capacity: int) -> None:
        self.key, self.capacity = key, capacity
        self.buffers: dict[str, Tensor] = {}
        self.graphs: dict[tuple, Any] = {}
        self.busy = False
        self.nbytes = 0


def mode() -> str:
    """``off`` or ``on`` from ``FASTLAYERS_CUDA_GRAPHS`` (0; 1, unset or auto). Raises ValueError
    naming the variable for another value."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes", "always", "", "auto"):
        return "on"
    raise ValueError(f"{ENV} must be 0, 1 or auto, got {value!r}")


def enabled(like: Tensor) -> bool:
    """Whether loops on tensors like ``like`` may be captured and replayed: CUDA (or CPU tensors
    under :func:`emulated`), not switched off, not inside someone else's capture, not under
    torch.compile."""
    if getattr(_state, "emulated", False):
        return mode() != "off"
    return like.device.type == "cuda" and mode() != "off" and not torch.compiler.is_compiling() \
        and not _capturing(like.device)


@contextlib.contextmanager
def emulated() -> Iterator[None]:
    """Within: loops on CPU tensors are "captured" as :class:`Replayed` graphs, which run their
    chunk at every replay: the driver's chunk, capacity and replay logic without a GPU (tests,
    benchmarks/gpu_static.py)."""
    before = getattr(_state, "emulated", False)
    _state.emulated = True
    try:
        yield
    finally:
        _state.emulated = before


@contextlib.contextmanager
def preparing(steps: int) -> Iterator[list[int]]:
    """Within: loops take (or make) entries of capacity >= ``steps`` and capture their chunks, but
    neither run nor replay them (their results are garbage): a call that readies the graphs for a
    later call of up to ``steps`` steps (:func:`fastlayers.rnn._gpu.replays`). Yields the
    list of the capacities of the entries taken (none when a loop ran eagerly)."""
    before = getattr(_state, "preparing", None), getattr(_state, "claimed", None)
    _state.preparing, _state.claimed = steps, []
    try:
        yield _state.claimed
    finally:
        _state.preparing, _state.claimed = before


def clear() -> None:
    """Drop every captured loop and its buffers."""
    global generation
    with _lock:
        _entries.clear()
        _capacity.clear()
        _broken.clear()
        generation += 1


pool.on_empty_cache(clear)  # (fastlayers.empty_cache releases the captures' buffers too)


def limit_bytes(device: torch.device) -> int:
    """The most bytes the captured entries of ``device`` keep (``FASTLAYERS_CUDA_GRAPHS_MAX_MB``,
    default a quarter of the device's memory; 1 GiB for CPU tensors under :func:`emulated`).
    Raises ValueError naming the variable for a value that is not a finite number >= 0."""
    value = os.environ.get(MAX_MB, "").strip()
    if value:
        try:
            mb = float(value)
        except ValueError:
            mb = -1.0
        if not 0 <= mb < float("inf"):
            raise ValueError(f"{MAX_MB} must be a finite number of MiB >= 0, got {value!r}")
        return int(mb * 2**20)
    if device.type != "cuda":
        return 2**30
    return torch.cuda.get_device_properties(device).total_memory // 4


def grown(capacity: int, steps: int) -> int:
    """The capacity a key takes for a call of ``steps`` steps when its last one was ``capacity``
    (0: none yet): at least GROWTH x the last, rounded up to a multiple of CHUNK."""
    return CHUNK * math.ceil(max(steps, math.ceil(capacity * GROWTH)) / CHUNK)


class Loop:
    """The buffers of one layer call and the time loops (forward, then backward) run on them.

    ``st``: name -> tensor or None; a buffer with a time dimension has the entry's capacity there
    when captured, T eagerly (:meth:`steps` is T; the kernels take the capacity from the buffers).
    """

    def __init__(self, entry: _Entry | None, st: dict[str, Any], steps: int, device: torch.device,
                 time_dims: dict[str, int], extent: int | None = None) -> None:
        self.entry, self.st, self.steps, self.device = entry, st, steps, device
        self.extent = steps if extent is None else extent  # what the buffers' time dimension holds
        self.time_dims = dict(time_dims)  # name -> time dimension, of every buffer with one
        self.release: Callable[[], None] = _nothing

    def cut(self, st: dict[str, Any]) -> dict[str, Any]:
        """The tensors of ``st`` cut to the loop's extent (T steps, or N rows) along their time dimension."""
        return {k: v.narrow(self.time_dims[k], 0, self.extent) if v is not None and k in self.time_dims else v
                for k, v in st.items()}

    @property
    def captured(self) -> bool:
        return self.entry is not None

    def add(self, ins: dict[str, Tensor | None], outs: dict[str, tuple | None],
            time_dims: dict[str, int] | None = None) -> dict[str, Any]:
        """The loop's buffers plus ``ins`` (copied into the entry's buffers when captured; their
        time dimension, ``time_dims[name]``, holds the first T steps) and new buffers of the shapes
        ``outs`` (TIME for the time dimension; None: absent), in the dtype of ``st["numbers"]``:
        the dict a backward loop runs on (the forward's buffers are read where they are)."""
        like = self.st["numbers"]
        part = dict(self.st)
        self.time_dims.update(_time_dims(outs, time_dims))
        if self.entry is None:
            part.update(ins)
            part.update({k: _empty(like, s, self.extent) for k, s in outs.items()})
            return part
        entry = self.entry
        dims = time_dims or {}
        wanted = {k: shape for k, shape, _ in _shapes({k: v for k, v in ins.items() if v is not None},
                                                      {k: s for k, s in outs.items() if s is not None}, dims,
                                                      entry.capacity, like)}
        stale = [k for k, shape in wanted.items() if k in entry.buffers and (
            tuple(entry.buffers[k].shape) != shape or entry.buffers[k].dtype != (ins[k].dtype if k in ins else like.dtype))]
        for k in stale:  # another shape or dtype than a part before (e.g. the product's slices changed)
            old = entry.buffers.pop(k)
            entry.nbytes -= old.numel() * old.element_size()
            entry.graphs = {p: g for p, g in entry.graphs.items() if k not in p[1]}
        new = {k: v for k, v in ins.items() if v is not None and k not in entry.buffers}
        new_outs = {k: s for k, s in outs.items() if s is not None and k not in entry.buffers}
        if new or new_outs:
            size = _nbytes(new, new_outs, time_dims or {}, entry.capacity, like)
            with _lock:
                _evict(self.device, size, limit_bytes(self.device))
                entry.nbytes += size
            _allocate(entry, new, new_outs, time_dims or {}, like)
        for k, v in ins.items():
            part[k] = _fill(entry.buffers[k], v, (time_dims or {}).get(k), self.extent) if v is not None else None
        part.update({k: entry.buffers[k] if s is not None else None for k, s in outs.items()})
        return part

    def run(self, name: str, st: dict[str, Any], prologue: Callable[[dict[str, Any]], None], chunk: Chunk,
            reverse: bool = False) -> None:
        """Run the time loop ``chunk`` over steps 0..T-1 (T-1..0 when ``reverse``) on ``st``, after
        ``prologue(st)``: eagerly ``chunk(st, every step)`` with clock = [0, T]; captured, the chunk
        ``chunk(st, j's of CHUNK steps)`` captured once per entry and part (``name`` and which
        buffers ``st`` has), replayed ceil(T / CHUNK) times from clock = [0 or T - 1, T]."""
        steps, clock = self.steps, st["clock"]
        entry = self.entry
        if entry is not None and entry.key not in _broken:
            part = (name, tuple(sorted(k for k, v in st.items() if v is not None)))
            graph = entry.graphs.get(part)
            if graph is None:
                graph = self._capture(part, st, chunk, reverse)
            if graph is not None:
                if getattr(_state, "preparing", None) is not None:
                    return
                prologue(st)
                _set_clock(clock, steps - 1 if reverse else 0, steps)
                count = -(-steps // CHUNK)
                for _ in range(count):
                    graph.replay()
                stats["replays"] += count
                return
        prologue(st)
        if entry is not None:  # an entry's clock (capture failed); an eager loop's is [0, T] already
            _set_clock(clock, 0, steps)
        chunk(st, range(steps - 1, -1, -1) if reverse else range(steps))

    def _capture(self, part: tuple, st: dict[str, Any], chunk: Chunk, reverse: bool) -> Any:
        """The chunk captured on this entry's buffers (None, with a warning, if that failed)."""
        global generation
        entry = self.entry
        assert entry is not None
        step = -CHUNK if reverse else CHUNK
        js = range(0, step, -1 if reverse else 1)
        clock = st["clock"]

        def body() -> None:
            chunk(st, js)
            clock[:1].add_(step)

        _set_clock(clock, 0, 0)  # no step in [0, 0): the run before the capture only compiles
        try:
            graph = capture(body, self.device)
        except Exception as e:  # a failing speed path falls back, it does not fail the call
            warnings.warn(f"fastlayers: capturing a time loop in a CUDA graph failed ({type(e).__name__}: {e}); "
                          f"this layer configuration runs its loops eagerly (slower) from now on", RuntimeWarning,
                          stacklevel=4)
            stats["failed"] += 1
            with _lock:
                _broken.add(entry.key)
                generation += 1
            _drop(entry)  # this call goes on eagerly on its buffers
            return None
        entry.graphs[part] = graph
        stats["captures"] += 1
        return graph


def open(owner: object | None, key: tuple, steps: int, ins: dict[str, Tensor | None], outs: dict[str, tuple | None],
         time_dims: dict[str, int] | None = None, extent: int | None = None) -> Loop:
    """The buffers of a layer call of ``steps`` steps: ``ins`` (tensors or None; the dimension
    ``time_dims[name]`` of an input is its time dimension) and new buffers of the shapes ``outs``
    (TIME in the time dimension, None: absent) in the dtype and device of ``ins["numbers"]``, plus
    ``clock`` (int32 [first step, T]). Captured (:func:`enabled`): an entry's buffers, the inputs
    copied in, valid until ``Loop.release()`` (also called when ``owner`` is garbage-collected);
    eagerly, the inputs themselves and fresh buffers. The loops may update inputs in place.
    ``extent``: what the TIME dimension holds when it is not the steps (the varlen form's N rows,
    run in T steps): an entry's capacity then counts rows."""
    like = ins["numbers"]
    assert like is not None
    time_dims = time_dims or {}
    size = steps if extent is None else extent
    prepare_steps = getattr(_state, "preparing", None)
    most = max(size, prepare_steps or 0)
    entry = _claim(key, most, ins, outs, time_dims) if max(steps, prepare_steps or 0) > EAGER_STEPS and \
        enabled(like) else None
    if entry is None:
        st: dict[str, Any] = {**ins, **{k: _empty(like, s, size) for k, s in outs.items()}}
        st["clock"] = _clock(like.device, steps)
        return Loop(None, st, steps, like.device, _time_dims(outs, time_dims), size)
    st = {k: _fill(entry.buffers[k], v, time_dims.get(k), size) if v is not None else None for k, v in ins.items()}
    st.update({k: entry.buffers[k] if s is not None else None for k, s in outs.items()})
    st["clock"] = entry.buffers["clock"]
    if prepare_steps is not None:
        _state.claimed.append(entry.capacity)
    loop = Loop(entry, st, steps, like.device, _time_dims(outs, time_dims), size)
    # weakref.finalize runs once, whether called or when the owner is collected
    loop.release = weakref.finalize(owner, _free, entry) if owner is not None else lambda: _free(entry)
    return loop


def capture(fn: Callable[[], None], device: torch.device) -> Any:
    """``fn`` captured in a new CUDA graph on ``device``, after one uncaptured call on a side stream
    (which compiles its kernels and sets cuBLAS up; ``fn`` must leave its inputs valid for a rerun).
    Under :func:`emulated` (CPU): a :class:`Replayed` of ``fn``, after the same one call."""
    if getattr(_state, "emulated", False) and device.type != "cuda":
        fn()
        return Replayed(fn)
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # captured on this device's own stream (torch's default capture stream is one for the process,
        # made on the device of its first capture: work for another device would run uncaptured, and
        # its graph replay nothing); thread_local: another thread's CUDA calls meanwhile (a
        # DataLoader's pin-memory thread allocating pinned memory) neither fail nor break the capture
        with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
            fn()
    return graph


class Replayed:
    """A stand-in for a CUDA graph that runs its function at every replay (:func:`emulated`)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def backward_done(ctx: Any) -> None:
    """At the end of a backward: give the forward's loop buffers back (an entry becomes idle, eager
    buffers are dropped) when this backward frees the autograd graph (with retain_graph they stay
    until the graph is dropped)."""
    loop = getattr(ctx, "loop", None)
    if loop is not None and pool.graph_freed_after_this_backward():
        loop.release()
        ctx.loop = None


def holding(device: torch.device) -> tuple[int, int]:
    """(entries, bytes of their buffers) held for ``device`` now."""
    with _lock:
        mine = [e for k, es in _entries.items() if k[-1] == device for e in es]
        return len(mine), sum(e.nbytes for e in mine)


# ---- internals

def _time_dims(outs: dict[str, tuple | None], time_dims: dict[str, int] | None) -> dict[str, int]:
    """name -> time dimension of the inputs with one and of the buffers of ``outs``."""
    found = dict(time_dims or {})
    found.update({k: s.index(TIME) for k, s in outs.items() if s is not None and TIME in s})
    return found


def _empty(like: Tensor, shape: tuple | None, steps: int) -> Tensor | None:
    if shape is None:
        return None
    return like.new_empty(tuple(steps if s == TIME else s for s in shape))


def _fill(buffer: Tensor, value: Tensor, time_dim: int | None, steps: int) -> Tensor:
    """``value`` copied into the first ``steps`` steps of ``buffer`` (all of it without a time
    dimension); returns the buffer."""
    (buffer if time_dim is None else buffer.narrow(time_dim, 0, steps)).copy_(value)
    return buffer


def constant(key: tuple, make: Callable[[], Tensor], device: torch.device) -> Tensor:
    """``make()``, a tensor on ``device`` that the loops only read (an eager loop's clock, the
    kernels' scalars), kept per ``key`` (which names its values, dtype and device) so that a small
    call makes no host-to-device copy or fill for it. Made anew inside a CUDA graph capture of the
    caller's own: a capture records the fill without running it, and the caller's graph must own
    the memory it reads."""
    if _capturing(device):
        return make()
    value = _constants.get(key)
    if value is None:
        if len(_constants) >= _MAX_CONSTANTS:
            _constants.clear()
        value = _constants[key] = make()
    return value


def values(numbers: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``numbers`` as a 1-D tensor on ``device``: one copy from the host, or, while the current CUDA
    stream captures, one fill per value (a copy from unpinned host memory cannot be captured: torch
    refuses it or the graph reads freed memory)."""
    if _capturing(device):
        return _filled(numbers, dtype, device)
    return torch.tensor(numbers, dtype=dtype).to(device, non_blocking=True)


def _capturing(device: torch.device) -> bool:
    """Whether work on ``device`` is being recorded into a CUDA graph (the current stream captures)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _filled(numbers: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    out = torch.empty(len(numbers), dtype=dtype, device=device)
    for i, v in enumerate(numbers):
        out[i].fill_(v)
    return out


def _clock(device: torch.device, steps: int) -> Tensor:
    """An eager loop's clock, int32 [0, steps] on ``device``: a :func:`constant` for T up to CHUNK,
    made per call for longer loops."""
    def make() -> Tensor:
        return values([0, steps], torch.int32, device)

    return constant(("clock", steps, device), make, device) if steps <= CHUNK else make()


def _set_clock(clock: Tensor, first: int, steps: int) -> None:
    clock.copy_(torch.tensor([first, steps], dtype=torch.int32), non_blocking=True)


def _signature(ins: dict[str, Tensor | None], outs: dict[str, tuple | None], time_dims: dict[str, int]) -> tuple:
    shapes = []
    for k, v in ins.items():
        if v is None:
            shapes.append((k, None))
        else:
            shape = list(v.shape)
            if k in time_dims:
                shape[time_dims[k]] = TIME
            shapes.append((k, tuple(shape), v.dtype))
    return tuple(shapes), tuple(outs.items())


def _shapes(ins: dict[str, Tensor], outs: dict[str, tuple], time_dims: dict[str, int], capacity: int,
            like: Tensor) -> Iterator[tuple[str, tuple[int, ...], Tensor]]:
    """(name, shape at ``capacity``, a tensor of its dtype and device) of every buffer to make."""
    for k, v in ins.items():
        shape = list(v.shape)
        if k in time_dims:
            shape[time_dims[k]] = capacity
        yield k, tuple(shape), v
    for k, s in outs.items():
        yield k, tuple(capacity if d == TIME else d for d in s), like


def _nbytes(ins: dict[str, Tensor], outs: dict[str, tuple], time_dims: dict[str, int], capacity: int,
            like: Tensor) -> int:
    return sum(math.prod(shape) * t.element_size() for _, shape, t in _shapes(ins, outs, time_dims, capacity, like))


def _allocate(entry: _Entry, ins: dict[str, Tensor], outs: dict[str, tuple], time_dims: dict[str, int],
              like: Tensor) -> None:
    """New zero-filled buffers in ``entry`` for ``ins`` (their shapes and dtypes) and ``outs``
    (like's dtype), time dimensions at the entry's capacity; normal tensors even when made under
    torch.inference_mode (a later call outside it copies into them), and ``clock`` with the first."""
    with torch.inference_mode(False):
        for k, shape, t in _shapes(ins, outs, time_dims, entry.capacity, like):
            entry.buffers[k] = t.new_zeros(shape)
        if "clock" not in entry.buffers:
            entry.buffers["clock"] = torch.zeros(2, dtype=torch.int32, device=like.device)


def _claim(key: tuple, steps: int, ins: dict[str, Tensor | None], outs: dict[str, tuple | None],
           time_dims: dict[str, int]) -> _Entry | None:
    """An idle entry of capacity >= steps for this call (made, with its buffers, if none), marked
    busy; None for a key whose capture failed before (the call runs eagerly)."""
    global generation
    like = ins["numbers"]
    assert like is not None
    full = (key, _signature(ins, outs, time_dims), like.device)
    if full in _broken:
        return None
    present_ins = {k: v for k, v in ins.items() if v is not None}
    present_outs = {k: s for k, s in outs.items() if s is not None}
    with _lock:
        entries = _entries.get(full, [])
        fits = [e for e in entries if not e.busy and e.capacity >= steps]
        if fits:
            entry = max(fits, key=lambda e: (len(e.graphs), -e.capacity))  # captured already, then the smallest
        else:
            capacity = _capacity.get(full, 0)
            if capacity < steps:
                if capacity:
                    stats["grown"] += 1
                capacity = _capacity[full] = grown(capacity, steps)
            small = [e for e in entries if not e.busy and e.capacity < capacity]
            if small:  # outgrown: a bigger entry takes their place
                entries = [e for e in entries if e not in small]
                generation += 1
            if entries:
                _entries[full] = entries
            else:
                _entries.pop(full, None)
            entry = _Entry(full, capacity)
            entry.nbytes = _nbytes(present_ins, present_outs, time_dims, capacity, like)
            _evict(like.device, entry.nbytes, limit_bytes(like.device))
            _entries.setdefault(full, []).append(entry)
        _entries.move_to_end(full)
        entry.busy = True
    if not entry.buffers:
        try:
            _allocate(entry, present_ins, present_outs, time_dims, like)
        except BaseException:
            _drop(entry)
            raise
    return entry


def _evict(device: torch.device, incoming: int, limit: int) -> None:
    """Drop idle entries of ``device``, least recently used first, until ``incoming`` more bytes fit
    under ``limit`` (busy entries stay: a pending backward reads their buffers)."""
    global generation
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
                generation += 1
        if kept:
            _entries[k] = kept
        else:
            del _entries[k]


def _drop(entry: _Entry) -> None:
    """Forget an entry (its buffers could not be made)."""
    global generation
    with _lock:
        entries = _entries.get(entry.key, [])
        if entry in entries:
            entries.remove(entry)
            generation += 1
            if not entries:
                del _entries[entry.key]


def _free(entry: _Entry) -> None:
    entry.busy = False


def _nothing() -> None:
    return None
