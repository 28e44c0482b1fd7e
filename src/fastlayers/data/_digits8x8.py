"""The 8x8 handwritten digits (UCI optdigits test set) that scikit-learn ships, read offline.

Source: scikit-learn (BSD-3), ``sklearn/datasets/data/digits.csv.gz``: 1797 rows of 64 pixel
values 0-16 and a label 0-9 (what ``sklearn.datasets.load_digits`` reads). Read from the installed
package or its wheel (see :mod:`fastlayers.data._shipped`); scikit-learn is never imported.
"""

from __future__ import annotations

import gzip
import io

import numpy as np

from ._shipped import read_shipped


def load_digits_8x8() -> tuple[np.ndarray, np.ndarray]:
    """Images (1797, 8, 8) float32 in [0, 1] and labels (1797,) int64 (digits 0-9): the UCI optdigits
    test set as scikit-learn 1.9.1 ships it (``sklearn.datasets.load_digits``'s data, pixels / 16).

    Raises:
        DataUnavailable (a FileNotFoundError): the file is neither installed nor downloaded and
            fetching it is off (``FASTLAYERS_OFFLINE=1``) or failed, or no copy here reads
            (:func:`fastlayers.data._shipped.read_shipped`); one line saying how to provide it.
    """
    data = read_shipped("scikit-learn", "datasets/data/digits.csv.gz", _parse)
    return (data[:, :64] / 16.0).reshape(-1, 8, 8), data[:, 64].astype(np.int64)


def _parse(raw: bytes) -> np.ndarray:
    data = np.loadtxt(io.BytesIO(gzip.decompress(raw)), delimiter=",", dtype=np.float32)
    if data.ndim != 2 or data.shape[1] != 65:
        raise ValueError(f"sklearn/datasets/data/digits.csv.gz: expected rows of 64 pixels + 1 label, got shape "
                         f"{data.shape}")
    return data
