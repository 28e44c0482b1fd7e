"""Recomputation through time (the layers' ``checkpoint_every``): training memory that does not
grow with T's activations.

Legend: T time, B batch, F input features, H hidden size, P output size (proj_size, or H),
D directions, L layers, k steps per segment.

Each layer and direction runs as time segments of k steps (the last one shorter) through any
engine with the signature of :func:`._cpu.lstm_engine` (the C kernels, the Triton engine or
the plain-PyTorch reference). The forward keeps only the state entering each segment (T / k
states of (B, P) and (B, H)) and the masks it drew (zoneout, recurrent dropout: the backward
must see the same ones); the backward walks the segments from the last, runs each one's forward
again from its kept state, with autograd, and back-propagates through it the output gradient of
those steps and the state gradient carried from the segment after it. So at most one segment's
activations exist at a time: memory about (T / k + k) states per layer instead of T steps' gates,
for one more forward of each segment. The reverse direction runs forward over the time-reversed
valid steps of each sequence (its padding stays in place), so its segments walk each sequence
back to front from its own last step, as a PackedSequence does.

One autograd Function runs a layer's directions: each segment's rows are taken from the input by
flat row index (a slice for the forward direction) and written into the layer's (T, B, D*P)
output, and the backward adds each segment's input gradient into one (T, B, F) gradient, so
no per-direction copy of the input, the output or the input gradient exists (at T = 100,000 those
are 1.5 GiB each at B = 8). With the C kernels' engine (``lstm_engine`` / ``gru_engine``) the
forward and the backward's recomputation both run a segment's directions together in one engine
call (:func:`._cpu.packed_layer`: each thread one direction, as the layer without segments runs
them; the forward's projection reads their rows of the input itself, the backward gathers them),
from the parameters stacked once per call (their gradients summed stacked;
:func:`._common.stack_directions` takes the rows of one stacked tensor without a copy, for the
Triton engine too); the output and the input gradient come from the block cache. With the Triton engine a
segment's two directions also run in one engine call (one launch per step serves both, as without
segments; the engine then takes each direction's own input, (D, k, B, F)), the reverse direction's
rows flipped within each sequence's length so that the engine's reverse loop walks them in their
own time (:func:`_paired`); recorded backwards (second derivatives) and the reference engine run
each direction's segment alone.

The varlen form (values (N, F), ``varlen=True``, the C kernels' engine): the segments' rows are
read from and written to the values themselves through per-direction maps of value rows
(:func:`._remat_segments.value_maps`; the masks keep the padded layout's maps), so the output
(N, D*P) and the input gradient (N, F) are all there is; a recorded backward pads the values
inside, differentiably.

Gradients are those of the run without segments up to the order of sums (the weight gradients
add k-step partial sums); with k >= T the same kernels run in the same order. Second derivatives
(a backward recorded with ``create_graph=True``) recompute the whole layer with autograd instead:
right, without the memory bound.

Source: gradient checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; sqrt(T) segments), as JAX/Flax ``nn.remat_scan``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core import precision
from ._common import draw_mask, drawn_masks, draws
from ._cpu import engine_draws, gru_engine, lstm_engine
from ._gpu import gru_engine_gpu, lstm_engine_gpu
from ._masks import keep_mask
from ._options import CellOptions
from ._reference import gru_reference, lstm_reference
from ._remat_segments import Engine, Plan, Segments, Spec, row_maps, take, value_maps


def check_every(name: str, every: Any) -> int | str | None:
    """``every`` if it is None, an int >= 1 or ``"auto"``; else ValueError naming ``name``."""
    if every is None or every == "auto" or (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
        return every
    raise ValueError(f"{name}: expected None, an int >= 1 or 'auto', got {every!r}")


# "auto" on the C kernels' engine: segments of at least this many rows (k * B) per direction, where
# that keeps k <= T / AUTO_MIN_SEGMENTS (bench_remat.py's k sweep, BENCHMARKS.md: a segment's fixed
# cost, the weights' packing and the per-call work, is about 4-6 ms on 2 Zen 4 cores whatever B is)
AUTO_ROWS = 1280
AUTO_MIN_SEGMENTS = 16


def segment_length(every: int | str, steps: int, dirs: int = 1, batch: int = 0) -> int:
    """k: ``every`` itself, or for ``"auto"`` about sqrt(T / D) (at least 1): the backward recomputes
    a segment's D directions together, so it holds the activations of about sqrt(T * D) steps, as
    sqrt(T) segments of one direction would. With ``batch`` (B; the C kernels' engine passes it)
    "auto" takes at least ceil(AUTO_ROWS / B) steps, as long as that leaves at least
    AUTO_MIN_SEGMENTS segments (so at most 1/16 of the layer's activations held): every segment
    costs the same fixed time, which short segments of a small batch do not amortise (T = 800,
    B = 8: 1.8x the time without the option at k = 20, 1.6x at k = 50). (On the Triton engine a
    segment costs about 1 ms of host time per engine call, so longer segments are faster there at
    the price of memory: ``bench_remat.py --sweep``, BENCHMARKS.md.)"""
    if every != "auto":
        return int(every)
    k = max(1, round(math.sqrt(steps / dirs)))
    if batch > 0:
        k = max(k, min(-(-AUTO_ROWS // batch), steps // AUTO_MIN_SEGMENTS))
    return k


def checkpointed(engine: Engine, every: int | str, input: Tensor, hx: tuple[Tensor, ...],
                 layers: list[list[dict[str, Tensor]]], lengths: Tensor | None, options: CellOptions, *,
                 dropout: float = 0.0, training: bool = False, masks: list[dict[str, Tensor]] | None = None,
                 cell: str = "LSTM", varlen: bool = False) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``engine(input, hx, layers, lengths, options, dropout=, training=, masks=)`` (same arguments,
    masks and results) with every layer and direction run as segments of :func:`segment_length`
    steps, recomputed in the backward (module docstring). ``cell``: "LSTM" or "GRU". With
    ``varlen`` (the C kernels' engine only): ``input`` is the values (N, F), the sequences of
    ``lengths`` one after another, and the output (N, D*P); no padded tensor is made (a recorded
    backward pads the values inside)."""
    if varlen:
        steps, batch = int(lengths.max()), lengths.numel()
    else:
        steps, batch = input.shape[:2]
    dirs = len(layers[0])
    k = segment_length(every, steps, dirs, batch if engine in (lstm_engine, gru_engine) else 0)
    dev = input.device
    triton = engine in (lstm_engine_gpu, gru_engine_gpu)
    plan = Plan(steps, k, lengths, dev, flips=triton and dirs == 2)
    maps = row_maps(lengths, steps, batch, dirs, dev)
    data_maps = flat_rows = None
    if varlen:
        data_maps, flat_rows = value_maps(maps, lengths.to(dev))
    finals: list[Tensor] = []
    x = input
    for li, dir_params in enumerate(layers):
        width = dir_params[0]["weight_hr"].size(0) if "weight_hr" in dir_params[0] else dir_params[0]["weight_hh"].size(1)
        hidden = dir_params[0]["weight_hh"].size(0) // (4 if cell == "LSTM" else 3)
        given = _engine_draws(engine, cell, options, training, masks[li] if masks is not None else None, x, lengths,
                              (dirs, steps, batch, width, hidden))
        m = [_direction_masks(given, d, maps[d] if d else None, options, training, cell, (steps, batch, width, hidden),
                              x) for d in range(dirs)]
        names = list(dir_params[0])
        states = tuple(s[li * dirs:(li + 1) * dirs] for s in hx)
        spec = Spec(engine, plan, maps, options, training, m, len(states), names, width, cell,
                     engine in (lstm_engine, gru_engine), triton, data_maps, flat_rows)
        x, *last = Segments.apply(spec, x, *states, *(p[n] for p in dir_params for n in names))
        finals.append(last)
        if dropout > 0 and training and li < len(layers) - 1:
            x = F.dropout(x, dropout, True)
    return x, tuple(torch.cat([f[i] for f in finals]) for i in range(len(hx)))


def _engine_draws(engine: Engine, cell: str, options: CellOptions, training: bool, given: dict[str, Tensor] | None,
                  x: Tensor, lengths: Tensor | None, sizes: tuple[int, int, int, int, int]) -> dict[str, Tensor] | None:
    """One layer's masks in the engines' given layout ((D, B, P); zoneout (D, T, B, width), original
    time and batch order): ``given``'s, and those it lacks drawn as ``engine`` draws them when it runs
    the layer whole (the same :func:`._common.draw_mask` calls, shapes and order, :func:`._common.drawn_masks`),
    so that a training call with checkpoint_every sees the masks the same call without it sees
    from the same seed (the reference's per-step draws: :func:`_reference_draws`)."""
    dirs, steps, batch, width, hidden = sizes
    m = dict(given) if given else {}
    if not draws(options, training):
        return m or None  # nothing to draw: no packing plan to build
    if engine in (lstm_engine_gpu, gru_engine_gpu):
        m.update(drawn_masks(cell, options, training, m, (dirs, batch, width), (dirs, steps, batch), hidden, width, x))
    elif engine in (lstm_engine, gru_engine):
        m.update(engine_draws(cell, options, training, m, x, lengths, sizes))
    elif engine in (lstm_reference, gru_reference):
        m.update(_reference_draws(cell, options, m, sizes, x))
    return m or None


def _reference_draws(cell: str, options: CellOptions, given: dict[str, Tensor], sizes: tuple[int, int, int, int, int],
                     x: Tensor) -> dict[str, Tensor]:
    """The masks ``given`` lacks, drawn as the reference draws them in training when it runs the
    layer whole (:func:`._reference._reference`): per direction its recurrent-dropout mask (B, P),
    then per step in the direction's time each state's zoneout keep-mask with probability z > 0 (h,
    then c), in float32 (the accumulator); returned in the given layout, (D, B, P) and (D, T, B,
    width) in original time."""
    dirs, steps, batch, width, hidden = sizes
    acc, dev = precision.dtypes(x)[1], x.device
    z_h, z_c = options.zoneout
    candidates = (("zoneout_h", z_h, width), ("zoneout_c", z_c if cell == "LSTM" else 0.0, hidden))
    states = [(key, prob, w) for key, prob, w in candidates if prob > 0 and key not in given]
    recurrent = options.recurrent_dropout > 0 and "recurrent" not in given
    keep = 1 - options.recurrent_dropout
    rec: list[Tensor] = []
    zoneout: dict[str, list[Tensor]] = {key: [] for key, _, _ in states}
    for d in range(dirs):
        if recurrent:
            rec.append(keep_mask((batch, width), keep, acc, dev) / keep)
        per_step: dict[str, list[Tensor | None]] = {key: [None] * steps for key, _, _ in states}
        for t in (range(steps) if d == 0 else range(steps - 1, -1, -1)):
            for key, prob, w in states:
                per_step[key][t] = keep_mask((batch, w), prob, acc, dev)
        for key in per_step:
            zoneout[key].append(torch.stack(per_step[key]))  # type: ignore[arg-type]
    out = {key: torch.stack(parts) for key, parts in zoneout.items()}
    if recurrent:
        out["recurrent"] = torch.stack(rec)
    return out


def _direction_masks(given: dict[str, Tensor] | None, d: int, fmap: Tensor | None, options: CellOptions,
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
            if key != "recurrent" and fmap is not None:  # original time -> the direction's time
                mask = take(mask[0].reshape(steps * batch, -1), fmap, False, 0, steps, None).unsqueeze(0)
        elif needed:
            mask = draw_mask(key, options, shape, like)
        if mask is not None:
            out[key] = mask.contiguous()
    return out or None
