"""``fastlayers train``: train a sequence classifier built from fastlayers layers on real data.

One process or several under ``torchrun`` (DistributedDataParallel); checkpoints that survive
interruption (``--resume``); metrics per epoch (``metrics.jsonl``), loss/accuracy curves
(``curves.png``) and a final test accuracy (``summary.json``).
"""

from __future__ import annotations

from typing import Any, Callable

from ._checkpoint import CheckpointError as CheckpointError, load_checkpoint as load_checkpoint
from ._config import TrainConfig as TrainConfig
from ._model import SequenceClassifier as SequenceClassifier


def run(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train as ``cfg`` says (see :mod:`fastlayers.train._loop`; needs the ``cli`` extra: tqdm,
    matplotlib); returns the summary."""
    from ._loop import run as _run

    return _run(cfg, log)

__all__ = ["TrainConfig", "run", "SequenceClassifier", "load_checkpoint", "CheckpointError"]
