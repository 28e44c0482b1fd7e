"""The record every sequence-classification loader returns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sequences:
    """Variable-length sequences: a list of N (T_i, F) float32 arrays, int64 labels (N,) and lengths (N,)."""

    features: list[np.ndarray]
    labels: np.ndarray
    lengths: np.ndarray
