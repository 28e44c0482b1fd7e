"""Splitting and batching variable-length sequences.

Legend: N sequences, B batch, T longest sequence of a batch, F features per frame.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch
from torch import Tensor

from ._sequences import Sequences


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(rest, held out) sorted int64 index arrays: ``fraction`` of every class is held out (seeded),
    round(fraction * class size) samples of each (Python's round: halves to even).

    Raises:
        ValueError: ``fraction`` not a number in [0, 1]; ``labels`` not 1-D, or with a NaN."""
    if isinstance(fraction, (bool, np.bool_)) or not isinstance(fraction, numbers.Real) or not 0 <= fraction <= 1:
        raise ValueError(f"fraction: expected a number in [0, 1], got {fraction!r}")
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels: expected a 1-D array (N,), got shape {labels.shape}")
    if labels.dtype.kind in "fc" and np.isnan(labels).any():
        raise ValueError(f"labels: expected no NaN (a NaN is no class), got {int(np.isnan(labels).sum())}")
    rng = np.random.default_rng(seed)
    rest, held = [np.empty(0, np.int64)], [np.empty(0, np.int64)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n = int(round(float(fraction) * idx.size))
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


def _frames(s: Sequences, idx: list[int]) -> list[np.ndarray]:
    if len(idx) == 0:
        raise ValueError("idx: expected the indices of at least one sequence, got none")
    feats = [s.features[i] for i in idx]
    for i, f in zip(idx, feats):
        if np.ndim(f) != 2:
            raise ValueError(f"features[{i}]: expected a 2-D (T_i, F) array, got shape {np.shape(f)}")
    return feats


def _labels(s: Sequences, idx: list[int], device: torch.device | str) -> Tensor:
    return torch.as_tensor(np.asarray(s.labels)[idx].astype(np.int64)).to(device)


def pad_batch(s: Sequences, idx: list[int], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """x (B, T, F) zero-padded float32, lengths (B,) int64 (on CPU), labels (B,) int64.

    Raises:
        ValueError: ``idx`` empty (a batch of no sequences has no feature size to pad to), or a
            sequence not a 2-D (T_i, F) array."""
    feats = _frames(s, idx)
    lengths = torch.tensor([f.shape[0] for f in feats], dtype=torch.int64)
    x = torch.zeros(len(feats), int(lengths.max()), feats[0].shape[1])
    frames = x.numpy()  # (NumPy copies any array in: a reversed view, another byte order, a read-only one)
    for i, f in enumerate(feats):
        frames[i, :f.shape[0]] = f
    return x.to(device), lengths, _labels(s, idx, device)


def concat_batch(s: Sequences, idx: list[int], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """The varlen form: x (N, F) in the features' dtype (float32 for the shipped loaders; the
    sequences one after another, N their total length),
    cu_seqlens (B+1,) int64 (0, then the running sum of the lengths), labels (B,) int64.

    Raises:
        ValueError: ``idx`` empty, or a sequence not a 2-D (T_i, F) array."""
    feats = [np.asarray(f, dtype=f.dtype.newbyteorder("=")) for f in _frames(s, idx)]  # (native byte order)
    lengths = torch.tensor([f.shape[0] for f in feats], dtype=torch.int64)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    x = torch.from_numpy(np.concatenate(feats))  # (one new array: any strides, read-only arrays too)
    return x.to(device), cu_seqlens.to(device), _labels(s, idx, device)
