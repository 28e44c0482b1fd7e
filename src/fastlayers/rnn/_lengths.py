"""Length handling: from a lengths vector to the time segments and row indices of the fused path.

Legend: T time (padded), B batch, N = sum(lengths) valid steps.

Sequences are sorted by length (longest first, stable). At time t the active sequences are then
a prefix of the sorted batch of size ``batch_sizes[t] = #{b : len_b > t}`` (the same numbers a
PackedSequence carries). Consecutive steps with the same active count form one *segment*; each
segment is run by one call of a fused recurrent kernel on a contiguous (T_s, n_s, F) block.

The valid rows of a padded batch, taken in segment order, are the "packed" rows. For the reverse
direction each sequence is read back to front from its own last step, so its packed rows point at
time ``len_b - 1 - t`` instead of ``t``; running the forward recurrence over those rows *is* the
length-aware reverse direction (flax's ``flip_sequences`` idea, done as one gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .._core import jagged


@dataclass(frozen=True)
class LengthPlan:
    """Everything the fused varlen path needs, computed once per forward call.

    Attributes:
        sorted_indices: (B,) int64, batch order longest-first (stable).
        unsorted_indices: (B,) int64, inverse permutation of ``sorted_indices``.
        segments: tuple of (steps, active) per segment, in time order; ``active`` decreases.
        forward_rows: (N,) int64, flat row index (into the padded input viewed as (T*B, F) or
            (B*T, F) when batch_first) of each packed row, forward direction.
        reverse_rows: (N,) int64, the same for the reverse direction.
        num_rows: T * B, rows of the padded tensor.
    """

    sorted_indices: Tensor
    unsorted_indices: Tensor
    segments: tuple[tuple[int, int], ...]
    forward_rows: Tensor
    reverse_rows: Tensor
    num_rows: int


def full_plan(steps: int, batch: int, device: torch.device) -> LengthPlan:
    """The plan of a time-major batch without padding (every length T), from the shapes alone:
    no host values are read, so torch.compile traces it without a graph break."""
    rows = torch.arange(steps * batch, device=device)
    order = torch.arange(batch, device=device)
    return LengthPlan(sorted_indices=order, unsorted_indices=order, segments=((steps, batch),), forward_rows=rows,
                      reverse_rows=rows.view(steps, batch).flip(0).reshape(-1), num_rows=steps * batch)


def _ints(t: Tensor) -> list[int]:
    """t.tolist(); element by element under torch.func.functionalize (its tensors have no tolist)."""
    return [int(v) for v in t] if torch._is_functional_tensor(t) else t.tolist()


def make_plan(lengths: Tensor, max_len: int, batch_first: bool, device: torch.device, *,
              varlen: bool = False) -> LengthPlan:
    """Build the plan for a validated CPU int64 ``lengths`` of shape (B,) and padded length T.
    ``varlen``: the rows index the sequences one after another (N, F) instead of a padded batch
    (sequence b's step t at row ``sum(lengths[:b]) + t``; ``num_rows`` N)."""
    batch = lengths.numel()
    sorted_lengths, sorted_indices = torch.sort(lengths, descending=True, stable=True)
    unsorted_indices = torch.argsort(sorted_indices)  # the inverse permutation (no in-place write: functionalize)
    longest = int(sorted_lengths[0])
    steps = torch.arange(longest)
    # batch_sizes[t] = number of sequences still running at step t
    batch_sizes = (lengths.unsqueeze(0) > steps.unsqueeze(1)).sum(1)
    change = torch.nonzero(batch_sizes[1:] != batch_sizes[:-1]).flatten() + 1
    bounds = [0, *_ints(change), longest]
    active = _ints(batch_sizes[torch.tensor(bounds[:-1], dtype=torch.int64)])
    segments = tuple((b - a, n) for a, b, n in zip(bounds[:-1], bounds[1:], active))

    time = torch.repeat_interleave(steps, batch_sizes)  # (N,) step of each packed row
    offsets = torch.cumsum(batch_sizes, 0) - batch_sizes
    slot = torch.arange(time.numel()) - offsets[time]  # position within the sorted batch
    seq = sorted_indices[slot]  # original batch index
    rev_time = lengths[seq] - 1 - time
    if varlen:
        starts = torch.cumsum(lengths, 0) - lengths
        fwd, rev = starts[seq] + time, starts[seq] + rev_time
        return LengthPlan(sorted_indices=sorted_indices.to(device), unsorted_indices=unsorted_indices.to(device),
                          segments=segments, forward_rows=fwd.to(device), reverse_rows=rev.to(device),
                          num_rows=int(lengths.sum()))
    if batch_first:
        fwd, rev = seq * max_len + time, seq * max_len + rev_time
    else:
        fwd, rev = time * batch + seq, rev_time * batch + seq
    return LengthPlan(
        sorted_indices=sorted_indices.to(device),
        unsorted_indices=unsorted_indices.to(device),
        segments=segments,
        forward_rows=fwd.to(device),
        reverse_rows=rev.to(device),
        num_rows=max_len * batch,
    )


def varlen_rows(backend: str, cu_seqlens: object, total: int, device: torch.device,
                max_seqlen: object = None) -> tuple[Tensor, dict]:
    """A varlen batch (``cu_seqlens`` over ``total`` value rows) validated for the engine of
    ``backend`` that runs it on the value rows: (the lengths (B,), the engine's keyword for its rows:
    ``{"varlen": jagged.Varlen}`` for the Triton engine, ``{"plan": LengthPlan}`` (:func:`make_plan`,
    varlen=True) for the C engine).

    Raises:
        TypeError, ValueError: ``cu_seqlens`` or ``max_seqlen`` is invalid
        (:func:`fastlayers._core.jagged.check_cu_seqlens`).
    """
    if backend == "triton":
        varlen = jagged.varlen(cu_seqlens, total, device, batch_first=False, max_seqlen=max_seqlen)
        return varlen.lengths, {"varlen": varlen}
    lengths, longest = jagged.check_cu_seqlens(cu_seqlens, total, device, max_seqlen=max_seqlen)
    return lengths, {"plan": make_plan(lengths, longest, False, device, varlen=True)}
