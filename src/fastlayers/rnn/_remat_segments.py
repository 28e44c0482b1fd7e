"""Recomputation through time, the mechanics: :class:`Segments`, the autograd Function that runs a
layer's directions as time segments (keeping each segment's entering state, recomputing it in the
backward), and the row maps, plans and per-segment calls it uses. The entry point and the design
(what is kept, what is recomputed, how the directions and engines are served) are in
:mod:`._remat`.

Legend: T time, B batch, F input features, H hidden size, P output size (proj_size, or H),
D directions, k steps per segment.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, NamedTuple

import torch
from torch import Tensor

from .._core import pool, precision, twice
from ._cpu import packed_layer
from ._lengths import make_plan
from ._options import CellOptions

Engine = Callable[..., tuple[Tensor, tuple[Tensor, ...]]]


def row_maps(lengths: Tensor | None, steps: int, batch: int, dirs: int, device: torch.device) -> list[Tensor]:
    """Per direction, (T, B) flat row index into a (T*B, X) view of the padded tensor: row t of
    sequence b in the direction's own time. Forward: t*B + b. Reverse: the time reversed within
    each sequence's length (padding rows stay in place), as a PackedSequence reads it."""
    t = torch.arange(steps, device=device).unsqueeze(1).expand(steps, batch)
    col = torch.arange(batch, device=device)
    maps = [(t * batch + col).contiguous()]
    if dirs == 2:
        reverse = to_device([_reversed_steps(steps, batch, lengths)], device)[0] if lengths is not None else steps - 1 - t
        maps.append((reverse * batch + col).contiguous())
    return maps


def value_maps(maps: list[Tensor], lengths: Tensor) -> tuple[list[Tensor], Tensor]:
    """The varlen form's row maps: ``maps`` (:func:`row_maps`, flat rows of the padded (T*B, X) view)
    turned into rows of the values (N, X), the sequences one after another, sequence b's step t at
    starts[b] + t (the padding rows, which the C kernels' engine never reads, at the sequence's last
    row); and (N,) the padded flat row of every value row. lengths: (B,) int64 on the maps' device."""
    steps, batch = maps[0].shape
    starts = torch.cumsum(lengths, 0) - lengths
    last = (lengths - 1).unsqueeze(0)
    out = [starts.unsqueeze(0) + torch.minimum(torch.div(m, batch, rounding_mode="floor"), last) for m in maps]
    t = torch.arange(steps, device=lengths.device).unsqueeze(1)
    valid = t < lengths.unsqueeze(0)  # (T, B)
    flat = (t * batch + torch.arange(batch, device=lengths.device)).expand(steps, batch)
    rows = torch.empty(int(lengths.sum()), dtype=torch.int64, device=lengths.device)
    rows[(starts.unsqueeze(0) + t.expand(steps, batch))[valid]] = flat[valid]
    return [m.contiguous() for m in out], rows


def _reversed_steps(steps: int, batch: int, lengths: Tensor) -> Tensor:
    """(T, B) on the lengths' device: for row t of sequence b, the row of the same step with the time
    reversed within the sequence's length (lengths[b] - 1 - t), rows at or after the length
    unchanged. Its own inverse."""
    t = torch.arange(steps, device=lengths.device).unsqueeze(1).expand(steps, batch)
    n = lengths.unsqueeze(0)
    return torch.where(t < n, n - 1 - t, t)


def to_device(parts: list[Tensor], device: torch.device) -> list[Tensor]:
    """CPU integer tensors (one dtype) on ``device`` in ONE host-to-device copy, from pinned memory
    on CUDA (asynchronous: a copy from pageable memory per tensor made the host wait for the GPU
    once per segment); the tensors themselves on the CPU."""
    if device.type == "cpu" or not parts:
        return parts
    flat = torch.cat([p.reshape(-1) for p in parts])
    if device.type == "cuda":
        flat = flat.pin_memory()
    flat = flat.to(device, non_blocking=True)
    return [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in parts]), parts)]


def _index(fmap: Tensor, start: int, stop: int, rows: Tensor | None) -> Tensor:
    """The flat rows of steps [start, stop) (batch rows ``rows`` or all), (k * B_j,)."""
    idx = fmap[start:stop]
    return (idx if rows is None else idx[:, rows]).reshape(-1)


def take(flat: Tensor, fmap: Tensor, identity: bool, start: int, stop: int, rows: Tensor | None) -> Tensor:
    """Steps [start, stop) of ``flat`` ((T*B, X), any row stride) in the direction's time: (k, B_j, X).
    ``identity``: fmap is the forward direction's (a slice then, no copy)."""
    k, batch = stop - start, fmap.size(1)
    if identity and rows is None:
        return flat[start * batch:stop * batch].view(k, batch, flat.size(1))
    return flat.index_select(0, _index(fmap, start, stop, rows)).view(k, -1, flat.size(1))


def _give(flat: Tensor, fmap: Tensor, identity: bool, start: int, stop: int, rows: Tensor | None, value: Tensor,
          add: bool) -> None:
    """Steps [start, stop) of ``flat`` ((T*B, X) view) in the direction's time (batch rows ``rows``)
    receive ``value`` (k, B_j, X): copied, or added (``add``). In place."""
    batch = fmap.size(1)
    value = value.reshape(-1, flat.size(1))
    if identity and rows is None:
        part = flat[start * batch:stop * batch]
        part.add_(value) if add else part.copy_(value)
    elif add:
        flat.index_add_(0, _index(fmap, start, stop, rows), value)
    else:
        flat.index_copy_(0, _index(fmap, start, stop, rows), value)


class Plan:
    """The segments of one layer (both directions share them, each in its own time): bounds, and
    per segment the running batch rows (on the device) and lengths (CPU, as the engines take them);
    with ``flips``, per segment the (k_j, B_j) index that reverses each running sequence's steps
    within the segment (:func:`_flip`; None: all k_j steps), on the device. Lengths: CPU int64."""

    def __init__(self, steps: int, k: int, lengths: Tensor | None, device: torch.device, flips: bool = False) -> None:
        self.bounds = [(s, min(s + k, steps)) for s in range(0, steps, k)]
        self.parts: list[tuple[Tensor | None, Tensor | None]] = []  # (rows or None = all, lengths or None = full)
        self.flips: list[Tensor | None] = []
        if lengths is not None:  # segments after every sequence's end run nothing
            last = int(lengths.max())
            self.bounds = [(start, stop) for start, stop in self.bounds if start < last]
        moved: list[Tensor] = []  # rows and flip indices, moved to the device together below
        for start, stop in self.bounds:
            rows = seg = None
            if lengths is not None:
                running = lengths > start
                seg = (lengths - start).clamp(max=stop - start)
                if bool(running.all()):
                    seg = None if bool((seg == stop - start).all()) else seg
                else:
                    rows = running.nonzero().flatten()
                    seg = seg[rows]
            self.parts.append((rows, seg))
            self.flips.append(_reversed_steps(stop - start, seg.numel(), seg) if flips and seg is not None else None)
            moved += [t for t in (rows, self.flips[-1]) if t is not None]
        on_device = iter(to_device(moved, device))  # in the order moved: each segment's rows, then its flip
        for j, ((rows, seg), flip) in enumerate(zip(self.parts, self.flips)):
            self.parts[j] = (next(on_device) if rows is not None else None, seg)
            self.flips[j] = next(on_device) if flip is not None else None


class Spec(NamedTuple):
    """What a layer's segments need besides tensors (the Function's first argument)."""
    engine: Engine
    plan: Plan
    maps: list[Tensor]  # per direction, (T, B) flat rows in its own time (row_maps)
    options: CellOptions
    training: bool
    masks: list[dict[str, Tensor] | None]  # per direction, full-time masks in its own time
    n_states: int
    names: list[str]  # parameter names of one direction
    width: int  # P, the output columns of one direction
    cell: str  # "LSTM" or "GRU"
    native: bool  # the engine is the C kernels' (lstm_engine / gru_engine): a segment's directions in one call
    triton: bool  # the engine is the Triton one: a segment's two directions run in one call (_paired)
    # the varlen form (the C kernels' engine only): per direction, (T, B) rows of the values (N, F) that
    # its input, output and their gradients are (value_maps); ``maps`` still index the masks' layout
    data_maps: list[Tensor] | None = None
    flat_rows: Tensor | None = None  # (N,) each value row's flat row in the padded (T*B, X) view


class Segments(torch.autograd.Function):
    """One layer, every direction, over its segments (see the module docstring).

    forward(ctx, spec, x, *tensors): ``spec`` a :class:`Spec`; x (T, B, F) (the varlen form,
    ``spec.data_maps``: (N, F)); ``tensors`` = the states (D, B, width) then each direction's
    parameters (``spec.names`` order, direction after direction). Returns the output (T, B, D*P)
    (varlen: (N, D*P)) and the final states (D, B, width).
    """

    @staticmethod
    def forward(ctx, spec: Spec, x: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        kept: list[Tensor] = []
        # every engine call of the segments returns its final states in acc (float32 under bf16): the
        # state crosses a segment's bound as it crosses a step, in both passes
        with precision.states_in_acc():
            out, states = _all_segments(spec, x, tensors, kept)
        ctx.spec = spec
        # the recomputation runs under the forward's autocast state (the backward usually runs
        # outside the user's autocast region), as torch.utils.checkpoint does
        device = x.device.type
        ctx.autocast = ((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                        if torch.amp.is_autocast_available(device) else None)  # (None: meta, which has no autocast)
        ctx.save_for_backward(x, *tensors, *kept)
        return (out, *states)

    @staticmethod
    def backward(ctx, dy: Tensor, *dfinal: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        autocast = contextlib.nullcontext() if ctx.autocast is None else torch.autocast(
            ctx.autocast[0], dtype=ctx.autocast[2], enabled=ctx.autocast[1])
        recorded = twice.recording(dy, *dfinal)  # (False inside inference mode: nothing is recorded there)
        # (a backward run inside torch.inference_mode(): the segments' recomputation records its own
        # graph to differentiate, so inference mode is off for it, as it was for the forward's graph)
        with torch.inference_mode(False), autocast, precision.states_in_acc():
            return Segments._backward(ctx, recorded, dy, *dfinal)

    @staticmethod
    def _backward(ctx, recorded: bool, dy: Tensor, *dfinal: Tensor) -> tuple[Tensor | None, ...]:
        spec: Spec = ctx.spec
        n_states, n_params, dirs = spec.n_states, len(spec.names), len(spec.maps)
        saved = ctx.saved_tensors
        x, tensors = saved[0], saved[1:1 + n_states + dirs * n_params]
        kept_flat = saved[1 + n_states + dirs * n_params:]
        if recorded:  # create_graph (or batched gradients): the whole layer again, recorded
            return _recorded_backward(spec, x, tensors, dy, dfinal)
        steps, batch = spec.maps[0].shape
        # kept[j][d] = the states entering segment j of direction d, each (1, B, width)
        per_seg = n_states * dirs
        kept = [[kept_flat[j * per_seg + d * n_states:j * per_seg + (d + 1) * n_states] for d in range(dirs)]
                for j in range(len(kept_flat) // per_seg)]
        params = tensors[n_states:]
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in params]
        dx = None
        if ctx.needs_input_grad[1]:  # (the C kernels' engine: from the block cache, as the output)
            dx = (pool.empty(tuple(x.shape), x.dtype, x) if spec.native else x.new_empty(x.shape)).zero_()
        if spec.data_maps is not None:  # the values themselves
            x2, dy2 = x, dy.contiguous()
        else:
            x2, dy2 = x.reshape(steps * batch, -1), dy.reshape(steps * batch, -1)  # copies only if strided
        dx2 = dx.view(x2.size(0), -1) if dx is not None else None
        acc = precision.dtypes(x)[1]  # (the states' gradients carried in acc, as the states are)
        carry = [(g.to(acc, copy=True) if g is not None else torch.zeros_like(s, dtype=acc))
                 for g, s in zip(dfinal, tensors[:n_states])]
        dparams: list[Tensor | None] = [None] * len(leaves)
        if spec.native or (spec.triton and dirs == 2):  # both directions in one engine call per segment
            # (the Triton engine: each direction with its own input), the parameters stacked once
            stacked = _stack_once(spec.names, params, dirs, [t.requires_grad for t in leaves])
            sums: dict[str, Tensor] = {}
            run = _native_segment_backward if spec.native else _paired_segment_backward
            if spec.native:  # its rows of direction columns: (T*B*D, P), reshaped once (a copy only if strided)
                dy2 = dy2.reshape(-1, spec.width)
            for j in reversed(range(len(spec.plan.bounds))):
                run(spec, j, x2, dy2, dx2, kept[j], stacked, carry, sums)
            for i, name in enumerate(spec.names):
                for d in range(dirs):
                    if leaves[d * n_params + i].requires_grad and name in sums:
                        dparams[d * n_params + i] = sums[name][d]
            return (None, dx, *(c.to(t.dtype) for c, t in zip(carry, tensors)), *dparams)
        for j in reversed(range(len(spec.plan.bounds))):
            start, stop = spec.plan.bounds[j]
            rows = spec.plan.parts[j][0]
            pick = rows if rows is not None else slice(None)
            for d in range(dirs):
                fmap, ident = spec.maps[d], d == 0
                mine = leaves[d * n_params:(d + 1) * n_params]
                with torch.enable_grad():
                    xs = take(x2, fmap, ident, start, stop, rows).detach().requires_grad_(dx is not None)
                    s_in = [s[:, pick].detach().requires_grad_() for s in kept[j][d]]
                    y, new = _segment(spec, j, d, xs, s_in, dict(zip(spec.names, mine)))
                block = dy2[:, d * spec.width:(d + 1) * spec.width]
                dys = take(block, fmap, ident, start, stop, rows)
                wrt = [t for t in (xs, *s_in, *mine) if t.requires_grad]
                grads = torch.autograd.grad([y, *new], wrt, [dys, *(c[d:d + 1, pick] for c in carry)],
                                            allow_unused=True)
                it = iter(grads)
                if xs.requires_grad:  # added: the other direction's segments write these rows too
                    _give(dx2, fmap, ident, start, stop, rows, next(it), add=True)
                _hand_out(it, carry, slice(d, d + 1), pick, leaves, range(d * n_params, (d + 1) * n_params), dparams)
        return (None, dx, *(c.to(t.dtype) for c, t in zip(carry, tensors)), *dparams)


def _stack_once(names: list[str], params: tuple[Tensor, ...] | list[Tensor], dirs: int,
                wants: list[bool] | None = None) -> dict[str, Tensor]:
    """The directions' parameters (``params``: direction after direction, ``names`` order) stacked
    once by name, (D, ...) each, detached; with ``wants`` (per parameter, whether it wants a
    gradient) each a leaf that requires grad if any direction's does. Engines given the rows of
    these (:func:`_directions`) use them without a copy (:func:`._common.stack_directions`)."""
    n = len(names)
    out = {}
    for i, name in enumerate(names):
        t = torch.stack([params[d * n + i] for d in range(dirs)]).detach()
        out[name] = t.requires_grad_(any(wants[d * n + i] for d in range(dirs))) if wants is not None else t
    return out


def _directions(stacked: dict[str, Tensor], dirs: int) -> list[dict[str, Tensor]]:
    """Per direction, its rows of the stacked parameters (views)."""
    return [{name: t[d] for name, t in stacked.items()} for d in range(dirs)]


def _sum_stacked(grads: Iterator[Tensor | None], stacked: dict[str, Tensor], sums: dict[str, Tensor]) -> None:
    """The stacked parameters' gradients (those that want one, in ``stacked``'s order) added into
    ``sums`` by name, one buffer each (no allocation per segment)."""
    for name, t in stacked.items():
        if not t.requires_grad:
            continue
        g = next(grads)
        if g is None:
            continue
        if name in sums:
            sums[name].add_(g)
        else:
            sums[name] = g.clone(memory_format=torch.contiguous_format)


def _carried(grads: Iterator[Tensor | None], carry: list[Tensor], lanes: slice, pick: Tensor | slice) -> None:
    """The entering states' gradients (the next of ``grads``, one per state) become the carried state
    gradients of directions ``lanes``, batch rows ``pick`` (zeros where autograd gave None)."""
    for c in carry:
        g = next(grads)
        c[lanes, pick] = g if g is not None else 0.0


def _hand_out(grads: Iterator[Tensor | None], carry: list[Tensor], lanes: slice, pick: Tensor | slice,
              leaves: list[Tensor], which: range, dparams: list[Tensor | None]) -> None:
    """A segment's gradients after its input's: the entering states' become the carried state
    gradients (directions ``lanes``, batch rows ``pick``); those of the parameters ``leaves[i]``, i in
    ``which``, that want one are summed into ``dparams[i]``, in one buffer of ours (no allocation per
    segment)."""
    _carried(grads, carry, lanes, pick)
    for i in which:
        if leaves[i].requires_grad:
            g = next(grads)
            if g is None:
                continue
            if dparams[i] is None:
                dparams[i] = g.clone(memory_format=torch.contiguous_format)
            else:
                dparams[i].add_(g)  # type: ignore[union-attr]


class _Packed(NamedTuple):
    """Segment j's rows as the C kernels' engine takes them, every direction in one call (as the
    layer without segments runs them): ``idx`` (D, N) the packed rows' flat rows in the (T*B, X)
    views of the input and the output, each direction in its own time; ``active`` the k_j
    active-prefix sizes; ``order`` the segment's batch rows sorted longest first and ``unorder`` its
    inverse (None: already sorted, every running sequence runs all k_j steps); ``pick`` the segment's
    running batch rows; ``masks`` the directions' masks together (recurrent (D, B_j, P) in the batch
    order, zoneout packed (D, N, width)). The forward and the backward's recomputation both take
    them from here, so they run the same rows with the same draws."""
    idx: Tensor
    active: tuple[int, ...]
    order: Tensor | None
    unorder: Tensor | None
    pick: Tensor | slice
    masks: dict[str, Tensor]

    def sort(self, t: Tensor) -> Tensor:
        """(D, B_j, ...) in the batch order -> length-sorted."""
        return t if self.order is None else t.index_select(1, self.order)

    def unsort(self, t: Tensor) -> Tensor:
        """(D, B_j, ...) length-sorted -> the batch order."""
        return t if self.unorder is None else t.index_select(1, self.unorder)


def _packed(spec: Spec, j: int, device: torch.device) -> _Packed:
    """Segment j's :class:`_Packed` rows."""
    start, stop = spec.plan.bounds[j]
    rows, seg_lengths = spec.plan.parts[j]
    dirs = len(spec.maps)
    k = stop - start
    batch = spec.maps[0].size(1) if rows is None else rows.numel()
    if seg_lengths is None:  # every running sequence runs all k steps: packed rows = padded rows
        active, packed, order, unorder = (batch,) * k, None, None, None
    else:
        plan = make_plan(seg_lengths, k, False, device)
        active = tuple(n for span, n in plan.segments for _ in range(span))
        packed, order, unorder = plan.forward_rows, plan.sorted_indices, plan.unsorted_indices

    def pack(t: Tensor) -> Tensor:  # (k * B_j, ...) in (step, batch) order -> packed rows
        return t if packed is None else t.index_select(0, packed)

    maps = spec.data_maps if spec.data_maps is not None else spec.maps
    idx = torch.stack([pack(_index(maps[d], start, stop, rows)) for d in range(dirs)])  # (D, N)
    masks: dict[str, Tensor] = {}
    per_dir = [_segment_masks(spec, j, d) or {} for d in range(dirs)]
    for key in per_dir[0]:
        parts = [m[key] if key == "recurrent" else pack(m[key].reshape(-1, m[key].size(-1))).unsqueeze(0)
                 for m in per_dir]
        masks[key] = torch.cat(parts)
    return _Packed(idx, active, order, unorder, rows if rows is not None else slice(None), masks)


def _run_packed(spec: Spec, seg: _Packed, xs: Tensor, params: list[dict[str, Tensor]], states: list[Tensor],
                src: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """One engine call of a segment's directions (:func:`._cpu.packed_layer`): xs (D, N, F) its
    packed input rows, or with ``src`` (D, N) the rows of xs (R, F) to read; ``states`` (D, B_j,
    width) each, in the batch order. Returns y (D, N, P) and the final states, length-sorted."""
    rmask = seg.masks.get("recurrent")
    return packed_layer(spec.cell, xs, params, tuple(seg.sort(s) for s in states),
                        seg.sort(rmask) if rmask is not None else None, seg.masks.get("zoneout_c"),
                        seg.masks.get("zoneout_h"), seg.active, spec.options, spec.training, src=src)


def _rows_of(t: Tensor, index: Tensor) -> Tensor:
    """t's rows ``index`` (t (R, X)), a fresh tensor from the block cache (:func:`.._core.pool.empty`:
    a segment's rows are MiBs, whose first touch on every segment cost more than their copy)."""
    return torch.index_select(t.detach(), 0, index, out=pool.empty((index.numel(), t.size(1)), t.dtype, t))


def _interleaved(idx: Tensor) -> Tensor:
    """(D * N,) the rows of a (T*B*D, P) view of a (T*B, D*P) tensor that hold direction d's columns
    of the flat rows idx[d] (D, N), direction after direction."""
    dirs = idx.size(0)
    return (idx * dirs + torch.arange(dirs, device=idx.device).unsqueeze(1)).reshape(-1)


def _native_segment_forward(spec: Spec, j: int, x2: Tensor, out2: Tensor, states: list[list[Tensor]],
                            params: list[dict[str, Tensor]]) -> list[list[Tensor]]:
    """Segment j's forward without autograd with the C kernels' engine, every direction in one call
    (:func:`_run_packed`; the projection reads the input's rows itself where it can): its output rows
    written into ``out2`` ((T*B, D*P) view), the states after it returned as ``states`` is given
    (per direction, per state, (1, B, width))."""
    seg = _packed(spec, j, x2.device)
    dirs, width = len(spec.maps), spec.width
    s_in = [torch.cat([states[d][i] for d in range(dirs)])[:, seg.pick] for i in range(spec.n_states)]
    y, last = _run_packed(spec, seg, x2, params, s_in, src=seg.idx)
    # direction d's columns of flat row r are row r * D + d of the (T*B*D, P) view: one copy of whole rows
    out2.view(-1, width).index_copy_(0, _interleaved(seg.idx), y.reshape(-1, width).to(out2.dtype))
    rows = spec.plan.parts[j][0]
    new = [seg.unsort(t) for t in last]
    return [_merge(states[d], tuple(t[d:d + 1] for t in new), rows) for d in range(dirs)]


def _native_segment_backward(spec: Spec, j: int, x2: Tensor, dy2: Tensor, dx2: Tensor | None,
                             kept: list[tuple[Tensor, ...]], stacked: dict[str, Tensor], carry: list[Tensor],
                             sums: dict[str, Tensor]) -> None:
    """Segment j's backward with the C kernels' engine, every direction in one call (as the layer
    without segments runs them; dy2 here the (T*B*D, P) view of the output gradient, a row per
    flat row and direction): the segment's packed rows of both directions gathered from the
    input by their original flat rows (each direction in its own time), recomputed with autograd
    (:func:`_run_packed`, from the parameters ``stacked`` by name, (D, ...) each), and
    back-propagated; the input gradient added into ``dx2``, the state gradients into ``carry`` (D,
    B, width) and the stacked parameters' gradients into ``sums`` (by name; one buffer each, no
    allocation per segment)."""
    seg = _packed(spec, j, x2.device)
    dirs, rows_n = len(spec.maps), seg.idx.size(1)
    pick = seg.pick
    with torch.enable_grad():
        xs = _rows_of(x2, seg.idx.reshape(-1)).view(dirs, rows_n, -1).requires_grad_(dx2 is not None)
        s_in = [torch.cat([kept[d][i] for d in range(dirs)])[:, pick].detach().requires_grad_()
                for i in range(spec.n_states)]
        y, last = _run_packed(spec, seg, xs, _directions(stacked, dirs), s_in)
    dys = _rows_of(dy2, _interleaved(seg.idx)).view(dirs, rows_n, -1)
    wrt = [t for t in (xs, *s_in, *stacked.values()) if t.requires_grad]
    grads = iter(torch.autograd.grad([y, *last], wrt, [dys, *(seg.sort(c[:, pick]) for c in carry)],
                                     allow_unused=True))
    if xs.requires_grad:
        dx2.index_add_(0, seg.idx.reshape(-1), next(grads).reshape(dirs * rows_n, -1))  # type: ignore[union-attr]
    _carried(grads, carry, slice(None), pick)
    _sum_stacked(grads, stacked, sums)


def _flip(t: Tensor, idx: Tensor | None) -> Tensor:
    """A segment's rows (k, B_j, ...) with each sequence's first lengths[b] steps in reverse order
    (``idx``, the segment's :attr:`Plan.flips`; all k when None); the rows after them stay. Its own
    inverse. The Triton engine's reverse direction runs row t from len_b - 1 down to 0, so a
    direction's own-time rows given flipped run in their own order there."""
    if idx is None:
        return t.flip(0)
    return t.gather(0, idx.view(*idx.shape, *(1,) * (t.dim() - 2)).expand_as(t))


def _paired(spec: Spec, j: int, xs: list[Tensor], states: list[Tensor], params: list[dict[str, Tensor]]
            ) -> tuple[list[Tensor], tuple[Tensor, ...]]:
    """Segment j of both directions in ONE call of the Triton engine (each direction's launches then
    serve both, as the layer without segments runs them): xs[d] direction d's input rows in its own
    time (k_j, B_j, F), states (2, B_j, width) per state, params[d] direction d's parameters.
    Returns ([direction d's output in its own time, (k_j, B_j, P)], the final states (2, B_j, width)).
    The reverse direction's rows go in flipped within each sequence's length (:func:`_flip`)."""
    seg_lengths, flip = spec.plan.parts[j][1], spec.plan.flips[j]
    x = torch.stack([xs[0], _flip(xs[1], flip)])  # (2, k_j, B_j, F)
    per_dir = [_segment_masks(spec, j, d) for d in range(2)]
    masks = None
    if per_dir[0] is not None:
        masks = {key: torch.cat([per_dir[0][key], per_dir[1][key] if key == "recurrent"
                                 else _flip(per_dir[1][key][0], flip).unsqueeze(0)])
                 for key in per_dir[0]}
    y, last = spec.engine(x, tuple(states), [list(params)], seg_lengths, spec.options, dropout=0.0,
                          training=spec.training, masks=[masks] if masks is not None else None)
    width = spec.width
    return [y[..., :width], _flip(y[..., width:], flip)], last


def _paired_segment_backward(spec: Spec, j: int, x2: Tensor, dy2: Tensor, dx2: Tensor | None,
                             kept: list[tuple[Tensor, ...]], stacked: dict[str, Tensor], carry: list[Tensor],
                             sums: dict[str, Tensor]) -> None:
    """Segment j's backward with the Triton engine, both directions in one call (:func:`_paired`,
    from the parameters ``stacked`` by name), recomputed with autograd and back-propagated: the input
    gradient added into ``dx2``, the state gradients into ``carry`` (2, B, width), the stacked
    parameters' gradients into ``sums`` by name."""
    start, stop = spec.plan.bounds[j]
    rows = spec.plan.parts[j][0]
    pick = rows if rows is not None else slice(None)
    with torch.enable_grad():
        xs = [take(x2, spec.maps[d], d == 0, start, stop, rows).detach().requires_grad_(dx2 is not None)
              for d in range(2)]
        s_in = [torch.cat([kept[d][i] for d in range(2)])[:, pick].detach().requires_grad_()
                for i in range(spec.n_states)]
        y, last = _paired(spec, j, xs, s_in, _directions(stacked, 2))
    width = spec.width
    dys = [take(dy2[:, d * width:(d + 1) * width], spec.maps[d], d == 0, start, stop, rows) for d in range(2)]
    wrt = [t for t in (*xs, *s_in, *stacked.values()) if t.requires_grad]
    grads = iter(torch.autograd.grad([*y, *last], wrt, [*dys, *(c[:, pick] for c in carry)], allow_unused=True))
    if dx2 is not None:  # added: the other direction's segments write these rows too
        for d in range(2):
            _give(dx2, spec.maps[d], d == 0, start, stop, rows, next(grads), add=True)
    _carried(grads, carry, slice(None), pick)
    _sum_stacked(grads, stacked, sums)


def _segment(spec: Spec, j: int, d: int, x: Tensor, states: list[Tensor] | tuple[Tensor, ...],
             params: dict[str, Tensor]) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Segment j of direction d through the engine, from its running rows' input x (k_j, B_j, F)
    and states (1, B_j, width): (its output (k_j, B_j, P), its final states (1, B_j, width))."""
    seg_lengths = spec.plan.parts[j][1]
    m = _segment_masks(spec, j, d)
    return spec.engine(x, tuple(states), [[params]], seg_lengths, spec.options, dropout=0.0, training=spec.training,
                       masks=[m] if m is not None else None)


def _segment_masks(spec: Spec, j: int, d: int) -> dict[str, Tensor] | None:
    """Direction d's masks for segment j's running rows: recurrent (1, B_j, P), zoneout_h
    (1, k_j, B_j, P) and zoneout_c (1, k_j, B_j, H) in the direction's time; None without masks."""
    masks = spec.masks[d]
    if not masks:
        return None
    start, stop = spec.plan.bounds[j]
    rows = spec.plan.parts[j][0]
    m = {}
    for key, mask in masks.items():
        if key == "recurrent":  # (1, B, P)
            m[key] = mask if rows is None else mask[:, rows]
        else:  # (1, T, B, width)
            part = mask[:, start:stop]
            m[key] = part if rows is None else part[:, :, rows]
    return m


def _all_segments(spec: Spec, x: Tensor, tensors: tuple[Tensor, ...],
                  kept: list[Tensor] | None = None) -> tuple[Tensor, list[Tensor]]:
    """Every segment of every direction in order from the states and parameters ``tensors``: (the
    output (T, B, D*P), the final states (D, B, width)); ``kept`` receives the states entering
    each segment (segment after segment, direction after direction, state after state)."""
    n_states, n_params, dirs = spec.n_states, len(spec.names), len(spec.maps)
    steps, batch = spec.maps[0].shape
    low, acc = precision.dtypes(x)  # the engines' output dtype (the low one under autocast) and float32's
    # the states between segments in acc, as the engines carry them between steps (precision.states_in_acc)
    states = [[s[d:d + 1].to(acc) for s in tensors[:n_states]] for d in range(dirs)]
    params = [dict(zip(spec.names, tensors[n_states + d * n_params:n_states + (d + 1) * n_params]))
              for d in range(dirs)]
    # every row of every step written: no step dropped after the longest sequence, none short in a segment
    full = bool(spec.plan.bounds) and spec.plan.bounds[-1][1] == steps and all(
        rows is None and seg is None for rows, seg in spec.plan.parts)
    # (recorded: per direction, differentiable twice)
    paired = spec.triton and dirs == 2 and not twice.graph_recorded()
    # the C kernels' engine without autograd (eager: the projection reads the input's rows itself)
    native = spec.native and not twice.graph_recorded() and not torch.compiler.is_compiling() \
        and not torch.jit.is_tracing()
    varlen = spec.data_maps is not None  # the values (N, F) in, (N, D*P) out: every row written
    if varlen and not native:  # (recorded backwards pad the values first: _recorded_backward)
        raise RuntimeError("checkpoint_every: the varlen form runs on the C kernels' engine without autograd only")
    shape = (x.size(0), dirs * spec.width) if varlen else (steps, batch, dirs * spec.width)
    # with the C kernels' engine the output's memory from the block cache (mapped already on a repeated call)
    out = pool.empty(shape, low, x) if native else x.new_empty(shape, dtype=low)
    if not full and not varlen:
        out.zero_()  # zeros at t >= len_b
    out2 = out.view(-1, out.size(-1)) if varlen else out.view(steps * batch, -1)
    x2 = x if varlen else x.reshape(steps * batch, -1)
    if paired or native:  # the engine takes the rows of parameters stacked once without a copy per segment
        params = _directions(_stack_once(spec.names, tensors[n_states:], dirs), dirs)
    for j in range(len(spec.plan.bounds)):
        start, stop = spec.plan.bounds[j]
        rows = spec.plan.parts[j][0]
        if kept is not None:  # the states entering the segment, direction after direction
            for d in range(dirs):
                kept.extend(states[d])
        if native:  # every direction in one call of the C kernels' engine
            states = _native_segment_forward(spec, j, x2, out2, states, params)
            continue
        if paired:
            pick = rows if rows is not None else slice(None)
            xs = [take(x2, spec.maps[d], d == 0, start, stop, rows) for d in range(dirs)]
            y, new = _paired(spec, j, xs, [torch.cat([states[d][i] for d in range(dirs)])[:, pick]
                                           for i in range(n_states)], params)
            for d, part in enumerate(y):
                _give(out2[:, d * spec.width:(d + 1) * spec.width], spec.maps[d], d == 0, start, stop, rows, part,
                      add=False)
                states[d] = _merge(states[d], tuple(s[d:d + 1] for s in new), rows)
            continue
        for d in range(dirs):
            xs = take(x2, spec.maps[d], d == 0, start, stop, rows)
            y, new = _segment(spec, j, d, xs, states[d] if rows is None else [s[:, rows] for s in states[d]],
                              params[d])
            _give(out2[:, d * spec.width:(d + 1) * spec.width], spec.maps[d], d == 0, start, stop, rows, y,
                  add=False)
            states[d] = _merge(states[d], new, rows)
    return out, [torch.cat([states[d][i] for d in range(dirs)]).to(low) for i in range(n_states)]


def _merge(states: list[Tensor], new: tuple[Tensor, ...], rows: Tensor | None) -> list[Tensor]:
    if rows is None:
        return list(new)
    merged = []
    for s, n in zip(states, new):
        s = s.clone()
        s[:, rows] = n
        merged.append(s)
    return merged


def _recorded_backward(spec: Spec, x: Tensor, tensors: tuple[Tensor, ...], dy: Tensor,
                       dfinal: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    if spec.data_maps is not None:  # the varlen form: through the padded layout, differentiably
        steps, batch = spec.maps[0].shape
        padded = spec._replace(data_maps=None, flat_rows=None)
        rows = spec.flat_rows

        def layer(x: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
            flat = x.new_zeros(steps * batch, x.size(1)).index_copy(0, rows, x)
            out, states = _all_segments(padded, flat.view(steps, batch, -1), tensors)
            return (out.reshape(steps * batch, -1).index_select(0, rows), *states)
    else:
        def layer(x: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
            out, states = _all_segments(spec, x, tensors)
            return (out, *states)

    inputs = [x, *tensors]
    return (None, *twice.recorded_vjp(layer, inputs, [dy, *dfinal], [t.requires_grad for t in inputs]))
