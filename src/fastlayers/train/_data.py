"""Training data: splits, per-feature normalisation and the epoch order (batching: :mod:`fastlayers.data`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..data import Sequences, load_japanese_vowels, load_spoken_digits, stratified_split, subset


@dataclass(frozen=True)
class Splits:
    train: Sequences
    val: Sequences
    test: Sequences
    num_features: int
    num_classes: int


def load_splits(dataset: str, seed: int, max_samples: int | None = None) -> Splits:
    """Train / validation / test splits, normalised with the training frames' mean and std.

    digits: a stratified 80/20 train/test split of the 3000 recordings (seeded); vowels: the
    archive's own 270/370 split. Validation: a stratified 10% of the training set.
    """
    if dataset == "digits":
        data = load_spoken_digits()
        train_idx, test_idx = stratified_split(data.labels, 0.2, seed)
        train, test = subset(data, train_idx), subset(data, test_idx)
    else:
        train, test = load_japanese_vowels()
    fit_idx, val_idx = stratified_split(train.labels, 0.1, seed + 1)
    train, val = subset(train, fit_idx), subset(train, val_idx)
    if max_samples is not None:
        train = subset(train, np.random.default_rng(seed).permutation(len(train.features))[:max_samples])
    frames = np.concatenate(train.features)
    mean, std = frames.mean(0), frames.std(0) + 1e-6

    def norm(s: Sequences) -> Sequences:
        return Sequences([((f - mean) / std).astype(np.float32) for f in s.features], s.labels, s.lengths)

    classes = int(max(train.labels.max(), test.labels.max())) + 1
    return Splits(norm(train), norm(val), norm(test), frames.shape[1], classes)


def epoch_order(n: int, epoch: int, seed: int, rank: int = 0, world: int = 1) -> list[int]:
    """This process's sample order in ``epoch``: torch's DistributedSampler (shuffle, seed + epoch,
    padded to a multiple of ``world``), so it is the same after a restart and disjoint across ranks."""
    sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)
