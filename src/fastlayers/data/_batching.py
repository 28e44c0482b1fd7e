"""Splitting and batching variable-length sequences.

Legend: N sequences, B batch, T longest sequence of a batch, F features per frame.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ._sequences import Sequences


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(rest, held out) sorted index arrays: ``fraction`` of every class is held out (seeded).

    Raises:
        ValueError: ``fraction`` outside [0, 1]."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"fraction: expected a number in [0, 1], got {fraction!r}")
    rng = np.random.default_rng(seed)
    rest, held = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n = int(round(fraction * idx.size))
        held.append(idx[:n])
        rest.append(idx[n:])
    return np.sort(np.concatenate(rest)), np.sort(np.concatenate(held))


def subset(s: Sequences, idx: np.ndarray) -> Sequences:
    """The sequences at ``idx`` (an integer array or list of indices), in that order, as a new
    :class:`Sequences` (features shared, not copied)."""
    return Sequences([s.features[i] for i in idx], s.labels[idx], s.lengths[idx])


def batches(order: list[int] | np.ndarray, batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``batch_size`` indices (the last may be shorter).

    Raises:
        ValueError: ``batch_size`` not an int >= 1."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    order = list(order)
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def pad_batch(s: Sequences, idx: list[int], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """x (B, T, F) zero-padded float32, lengths (B,) int64 (on CPU), labels (B,) int64.

    Raises:
        ValueError: ``idx`` empty (a batch of no sequences has no feature size to pad to)."""
    if len(idx) == 0:
        raise ValueError("idx: expected the indices of at least one sequence, got none")
    feats = [s.features[i] for i in idx]
    lengths = torch.tensor([f.shape[0] for f in feats], dtype=torch.int64)
    x = torch.zeros(len(feats), int(lengths.max()), feats[0].shape[1])
    for i, f in enumerate(feats):
        x[i, :f.shape[0]] = torch.from_numpy(f)
    return x.to(device), lengths, torch.from_numpy(s.labels[idx]).to(device)


def concat_batch(s: Sequences, idx: list[int], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """The varlen form: x (N, F) in the features' dtype (float32 for the shipped loaders; the
    sequences one after another, N their total length),
    cu_seqlens (B+1,) int64 (0, then the running sum of the lengths), labels (B,) int64.

    Raises:
        ValueError: ``idx`` empty."""
    if len(idx) == 0:
        raise ValueError("idx: expected the indices of at least one sequence, got none")
    feats = [torch.from_numpy(s.features[i]) for i in idx]
    lengths = torch.tensor([f.shape[0] for f in feats], dtype=torch.int64)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return torch.cat(feats).to(device), cu_seqlens.to(device), torch.from_numpy(s.labels[idx]).to(device)
