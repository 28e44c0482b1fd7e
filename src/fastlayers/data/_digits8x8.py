"""The 8x8 handwritten digits (UCI optdigits test set) that scikit-learn ships, read offline.

Source: scikit-learn (BSD-3), ``sklearn/datasets/data/digits.csv.gz``: 1797 rows of 64 pixel
values 0-16 and a label 0-9 (what ``sklearn.datasets.load_digits`` reads). Install with
``pip install --no-deps scikit-learn==1.9.1``; the package is located with importlib, not
imported, so its dependencies are not needed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np


def load_digits_8x8() -> tuple[np.ndarray, np.ndarray]:
    """Images (1797, 8, 8) float32 in [0, 1] and labels (1797,) int64."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 8x8 digits come from scikit-learn, which is not installed: "
                                "run `pip install --no-deps scikit-learn==1.9.1` (or `make demo`)")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    data = np.loadtxt(path, delimiter=",", dtype=np.float32)
    if data.ndim != 2 or data.shape[1] != 65:
        raise ValueError(f"{path}: expected rows of 64 pixels + 1 label, got shape {data.shape}")
    return (data[:, :64] / 16.0).reshape(-1, 8, 8), data[:, 64].astype(np.int64)
