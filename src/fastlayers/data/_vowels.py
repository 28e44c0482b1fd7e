"""UCI Japanese Vowels (Kudo et al. 1999) as 12 LPC cepstrum coefficients per frame, read offline.

Source: aeon 1.6.0 (BSD-3), ``aeon/datasets/data/JapaneseVowels/JapaneseVowels_{TRAIN,TEST}.ts``
(the UEA/UCR multivariate archive's sktime ``.ts`` format): 9 male speakers saying "ae"; 270
training and 370 test utterances of 7 to 29 frames, label = speaker 1-9 (stored 0-8 here). Read
from the installed package or its wheel (see :mod:`fastlayers.data._shipped`); aeon is never
imported.
"""

from __future__ import annotations

import numpy as np

from ._sequences import Sequences
from ._shipped import read_shipped


def _parse_ts(text: str, name: str) -> Sequences:
    """The ``@data`` section of a ``.ts`` file: per line, dimensions separated by ``:``, each a
    comma-separated series, then the class label."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip().lower() == "@data") + 1
    except StopIteration:
        raise ValueError(f"{name}: no @data section") from None
    features, labels = [], []
    for number, line in enumerate(lines[start:], start + 1):
        if not line.strip():
            continue
        *dims, label = line.strip().split(":")
        series = [np.array(d.split(","), dtype=np.float32) for d in dims]
        if len(series) != 12 or len({s.size for s in series}) != 1:
            raise ValueError(f"{name} line {number}: expected 12 dimensions of one length, got "
                             f"{[s.size for s in series]}")
        features.append(np.stack(series, axis=1))  # (T, 12)
        labels.append(int(label) - 1)
    lengths = np.array([f.shape[0] for f in features], dtype=np.int64)
    return Sequences(features=features, labels=np.array(labels, dtype=np.int64), lengths=lengths)


def load_japanese_vowels() -> tuple[Sequences, Sequences]:
    """(train, test): 270 and 370 utterances as (T_i, 12) float32 arrays of LPC cepstrum
    coefficients, labels int64 0-8 (the speaker), lengths int64: UCI Japanese Vowels (Kudo et al.
    1999) as aeon 1.6.0 ships it.

    Raises:
        DataUnavailable (a FileNotFoundError): the file is neither installed nor downloaded and
            fetching it is off (``FASTLAYERS_OFFLINE=1``) or failed, or no copy here reads
            (:func:`fastlayers.data._shipped.read_shipped`); one line saying how to provide it.
    """
    member = "datasets/data/JapaneseVowels/JapaneseVowels_{}.ts"
    return tuple(read_shipped("aeon", member.format(part), lambda raw, part=part: _parse_ts(  # type: ignore[misc]
        raw.decode(), f"JapaneseVowels_{part}.ts")) for part in ("TRAIN", "TEST"))  # type: ignore[return-value]
