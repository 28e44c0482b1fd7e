"""Recomputation through time (the layers' ``checkpoint_every``): training memory that does not
grow with T's activations.

Legend: T time, B batch, F input features, H hidden size, P output size (proj_size, or H),
D directions, L layers, k steps per segment.

Each layer and direction runs as time segments of k steps (the last one shorter) through any
engine with the signature of :func:`._engine.lstm_engine` (the C kernels, the Triton engine or
the plain-PyTorch reference). The forward keeps only the state entering each segment (T / k
states of (B, P) and (B, H)) and the masks it drew (zoneout, recurrent dropout: the backward
must see the same ones); the backward walks the segments from the last, runs each one's forward
again from its kept state, with autograd, and back-propagates through it the output gradient of
those steps and the state gradient carried from the segment after it. So at most one segment's
activations exist at a time: memory about (T / k + k) states per layer instead of T steps' gates,
for one more forward of each segment. The reverse direction runs forward over the time-reversed
valid steps of each sequence (its padding stays in place), so its segments walk each sequence
back to front from its own last step, as a PackedSequence does.

Gradients are those of the run without segments up to the order of sums (the weight gradients
add k-step partial sums); with k >= T the same kernels run in the same order. Second derivatives
(a backward recorded with ``create_graph=True``) recompute the whole layer with autograd instead:
right, without the memory bound.

Source: gradient checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; sqrt(T) segments), as JAX/Flax ``nn.remat_scan``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._options import CellOptions

Engine = Callable[..., tuple[Tensor, tuple[Tensor, ...]]]


def check_every(name: str, every: Any) -> int | str | None:
    """``every`` if it is None, an int >= 1 or ``"auto"``; else ValueError naming ``name``."""
    if every is None or every == "auto" or (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        return every
    raise ValueError(f"{name}: expected None, an int >= 1 or 'auto', got {every!r}")


def segment_length(every: int | str, steps: int) -> int:
    """k: ``every`` itself, or for ``"auto"`` about sqrt(T) (at least 1)."""
    return max(1, round(math.sqrt(steps))) if every == "auto" else int(every)


def _reversal(lengths: Tensor | None, steps: int, batch: int, device: torch.device) -> Tensor:
    """(T, B) time index: row t of sequence b reversed within its length (padding rows stay)."""
    t = torch.arange(steps, device=device).unsqueeze(1).expand(steps, batch)
    if lengths is None:
        return (steps - 1 - t).contiguous()
    n = lengths.to(device).unsqueeze(0)
    return torch.where(t < n, n - 1 - t, t).contiguous()


def _rows(x: Tensor, index: Tensor | None, start: int, stop: int) -> Tensor:
    """Steps [start, stop) of x (T, B, ...) in the direction's own time (``index``: reversal or None)."""
    if index is None:
        return x[start:stop]
    idx = index[start:stop]
    return x.gather(0, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))


def _put(out: Tensor, index: Tensor | None, start: int, stop: int, rows: Tensor, value: Tensor) -> None:
    """out[steps start..stop of the direction's time, batch rows ``rows``] += value (in place)."""
    if index is None:
        out[start:stop, rows] += value
        return
    full = value.new_zeros(stop - start, out.size(1), *out.shape[2:])
    full[:, rows] = value
    out.scatter_add_(0, index[start:stop].view(stop - start, -1, *([1] * (out.dim() - 2))).expand_as(full), full)


class _Plan:
    """The segments of one direction: bounds, and per segment the running batch rows and lengths."""

    def __init__(self, steps: int, k: int, lengths: Tensor | None, device: torch.device) -> None:
        self.bounds = [(s, min(s + k, steps)) for s in range(0, steps, k)]
        self.parts: list[tuple[Tensor | None, Tensor | None]] = []  # (rows or None = all, lengths or None = full)
        for start, stop in self.bounds:
            if lengths is None:
                self.parts.append((None, None))
                continue
            running = lengths > start
            seg = (lengths - start).clamp(max=stop - start)
            if bool(running.all()):
                full = bool((seg == stop - start).all())
                self.parts.append((None, None if full else seg))
            else:
                rows = running.nonzero().flatten()
                self.parts.append((rows.to(device), seg[rows]))
        if lengths is not None:  # segments after every sequence's end run nothing
            last = int(lengths.max())
            keep = [i for i, (start, _) in enumerate(self.bounds) if start < last]
            self.bounds = [self.bounds[i] for i in keep]
            self.parts = [self.parts[i] for i in keep]


class _Segments(torch.autograd.Function):
    """One layer and direction over its segments (see the module docstring).

    forward(ctx, spec, x, *tensors): ``spec`` = (engine, plan, reversal or None, options, training,
    masks (dict of full-time masks in the direction's time, or None), number of states, parameter
    names); ``tensors`` = the states (1, B, width) then the parameters. Returns the output (T, B, P)
    and the final states (1, B, width).
    """

    @staticmethod
    def forward(ctx, spec: tuple, x: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        kept: list[tuple[Tensor, ...]] = []
        out, states = _all_segments(spec, x, tensors, kept)
        ctx.spec = spec
        ctx.save_for_backward(x, *tensors, *(s for pair in kept for s in pair))
        return (out, *states)

    @staticmethod
    def backward(ctx, dy: Tensor, *dfinal: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        engine, plan, index, options, training, masks, n_states, names = ctx.spec
        saved = ctx.saved_tensors
        x, tensors, kept_flat = saved[0], saved[1:1 + n_states + len(names)], saved[1 + n_states + len(names):]
        if torch.is_grad_enabled():  # create_graph: the whole layer again, recorded, for higher derivatives
            return _recorded_backward(ctx.spec, x, tensors, dy, dfinal)
        kept = [kept_flat[i:i + n_states] for i in range(0, len(kept_flat), n_states)]
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors[n_states:]]
        params = dict(zip(names, leaves))
        dx = torch.zeros_like(x) if ctx.needs_input_grad[1] else None
        carry = [g.clone() if g is not None else torch.zeros_like(s) for g, s in zip(dfinal, tensors[:n_states])]
        dparams: list[Tensor | None] = [None] * len(leaves)
        for j in reversed(range(len(plan.bounds))):
            start, stop = plan.bounds[j]
            rows = plan.parts[j][0]
            pick = rows if rows is not None else slice(None)
            with torch.enable_grad():
                xs = _rows(x, index, start, stop)
                xs = (xs if rows is None else xs[:, rows]).detach().requires_grad_(dx is not None)
                s_in = [s[:, pick].detach().requires_grad_() for s in kept[j]]
                y, new = _segment(engine, plan, j, index, options, training, masks, xs, s_in, params, rows_done=True)
            dys = _rows(dy, index, start, stop)
            dys = dys if rows is None else dys[:, rows]
            wrt = [t for t in (xs, *s_in, *leaves) if t.requires_grad]
            grads = torch.autograd.grad([y, *new], wrt, [dys, *(c[:, pick] for c in carry)], allow_unused=True)
            it = iter(grads)
            gx = next(it) if xs.requires_grad else None
            gs = [next(it) for _ in s_in]
            if gx is not None:
                _put(dx, index, start, stop, pick, gx)
            for c, g in zip(carry, gs):
                c[:, pick] = g if g is not None else 0.0
            for i, leaf in enumerate(leaves):
                if leaf.requires_grad:
                    g = next(it)
                    if g is not None:
                        dparams[i] = g if dparams[i] is None else dparams[i] + g
        return (None, dx, *carry, *dparams)


def _segment(engine: Engine, plan: _Plan, j: int, index: Tensor | None, options: CellOptions, training: bool,
             masks: dict[str, Tensor] | None, x: Tensor, states: list[Tensor] | tuple[Tensor, ...],
             params: dict[str, Tensor], rows_done: bool = False) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Segment j through ``engine``: (its output (k_j, B_j, P), its final states (1, B_j, width)).
    ``rows_done``: x and states are already the segment's running rows (the backward's leaves)."""
    start, stop = plan.bounds[j]
    rows, seg_lengths = plan.parts[j]
    if not rows_done:
        x = _rows(x, index, start, stop)
        if rows is not None:
            x, states = x[:, rows], [s[:, rows] for s in states]
    m = None
    if masks:
        m = {}
        for key, mask in masks.items():
            if key == "recurrent":  # (1, B, P)
                m[key] = mask if rows is None else mask[:, rows]
            else:  # (1, T, B, width) in the direction's time
                part = mask[:, start:stop]
                m[key] = part if rows is None else part[:, :, rows]
    return engine(x, tuple(states), [[params]], seg_lengths, options, dropout=0.0, training=training,
                  masks=[m] if m is not None else None)


def _merge(states: list[Tensor], new: tuple[Tensor, ...], rows: Tensor | None) -> list[Tensor]:
    if rows is None:
        return list(new)
    merged = []
    for s, n in zip(states, new):
        s = s.clone()
        s[:, rows] = n
        merged.append(s)
    return merged


def _all_segments(spec: tuple, x: Tensor, tensors: tuple[Tensor, ...],
                  kept: list[tuple[Tensor, ...]] | None = None) -> tuple[Tensor, list[Tensor]]:
    """Every segment in order from the states and parameters ``tensors``: (the output (T, B, P),
    the final states); ``kept`` receives the states entering each segment."""
    engine, plan, index, options, training, masks, n_states, names = spec
    states, params = list(tensors[:n_states]), dict(zip(names, tensors[n_states:]))
    out = None
    for j in range(len(plan.bounds)):
        if kept is not None:
            kept.append(tuple(states))
        y, new = _segment(engine, plan, j, index, options, training, masks, x, states, params)
        if out is None:
            out = x.new_zeros(x.size(0), x.size(1), y.size(-1))
        rows = plan.parts[j][0]
        _put(out, index, *plan.bounds[j], rows if rows is not None else slice(None), y)
        states = _merge(states, new, rows)
    return out, states


def _recorded_backward(spec: tuple, x: Tensor, tensors: tuple[Tensor, ...], dy: Tensor,
                       dfinal: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    out, states = _all_segments(spec, x, tensors)
    inputs = [x, *tensors]
    wrt = [t for t in inputs if t.requires_grad]
    outs = [out, *states]
    grads_out = [dy, *(g if g is not None else torch.zeros_like(s) for g, s in zip(dfinal, states))]
    grads = iter(torch.autograd.grad(outs, wrt, grads_out, create_graph=True, allow_unused=True))
    return (None, *(next(grads) if t.requires_grad else None for t in inputs))


def checkpointed(engine: Engine, every: int | str, input: Tensor, hx: tuple[Tensor, ...],
                 layers: list[list[dict[str, Tensor]]], lengths: Tensor | None, options: CellOptions, *,
                 dropout: float = 0.0, training: bool = False, masks: list[dict[str, Tensor]] | None = None,
                 cell: str = "LSTM") -> tuple[Tensor, tuple[Tensor, ...]]:
    """``engine(input, hx, layers, lengths, options, dropout=, training=, masks=)`` (same arguments,
    masks and results) with every layer and direction run as segments of :func:`segment_length`
    steps, recomputed in the backward (module docstring). ``cell``: "LSTM" or "GRU"."""
    steps, batch = input.shape[:2]
    k = segment_length(every, steps)
    dirs = len(layers[0])
    dev = input.device
    plan = _Plan(steps, k, lengths, dev)
    index = _reversal(lengths, steps, batch, dev) if dirs == 2 else None
    finals: list[list[Tensor]] = [[] for _ in hx]
    x = input
    for li, dir_params in enumerate(layers):
        outs = []
        for d, params in enumerate(dir_params):
            idx = index if d == 1 else None
            width = params["weight_hr"].size(0) if "weight_hr" in params else params["weight_hh"].size(1)
            hidden = params["weight_hh"].size(0) // (4 if cell == "LSTM" else 3)
            m = _direction_masks(masks[li] if masks is not None else None, d, idx, options, training, cell,
                                 (steps, batch, width, hidden), x)
            names = list(params)
            n = li * dirs + d
            states = tuple(s[n:n + 1] for s in hx)
            spec = (engine, plan, idx, options, training, m, len(states), names)
            y, *last = _Segments.apply(spec, x, *states, *params.values())
            outs.append(y)
            for acc, s in zip(finals, last):
                acc.append(s)
        x = torch.cat(outs, -1) if dirs == 2 else outs[0]
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
    return x, tuple(torch.cat(f) for f in finals)


def _direction_masks(given: dict[str, Tensor] | None, d: int, index: Tensor | None, options: CellOptions,
                     training: bool, cell: str, sizes: tuple[int, int, int, int], like: Tensor
                     ) -> dict[str, Tensor] | None:
    """Direction d's masks for the whole sequence, drawn once here (so the recomputation sees the
    same ones) or taken from ``given`` ((D, ...) in original time, as the engines take them), in the
    direction's time: recurrent (1, B, P), zoneout_h (1, T, B, P), zoneout_c (1, T, B, H)."""
    steps, batch, width, hidden = sizes
    z_h, z_c = options.zoneout
    want = {"recurrent": (training and options.recurrent_dropout > 0, (1, batch, width)),
            "zoneout_h": (training and z_h > 0, (1, steps, batch, width)),
            "zoneout_c": (training and cell == "LSTM" and z_c > 0, (1, steps, batch, hidden))}
    out: dict[str, Any] = {}
    for key, (needed, shape) in want.items():
        mask = given.get(key) if given else None
        if mask is not None:
            mask = mask[d:d + 1]
            if key != "recurrent" and index is not None:  # original time -> the direction's time
                mask = _rows(mask[0], index, 0, steps).unsqueeze(0)
        elif needed:
            if key == "recurrent":
                keep = 1 - options.recurrent_dropout
                mask = torch.bernoulli(torch.full(shape, keep, dtype=like.dtype, device=like.device)) / keep
            else:
                prob = z_h if key == "zoneout_h" else z_c
                mask = torch.bernoulli(torch.full(shape, prob, dtype=like.dtype, device=like.device))
        if mask is not None:
            out[key] = mask.contiguous()
    return out or None
