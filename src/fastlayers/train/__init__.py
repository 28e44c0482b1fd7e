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
    """Train as ``cfg`` says (one process, or one of several under ``torchrun``; needs the ``cli``
    extra: tqdm, matplotlib); returns the summary, a dict also written to ``cfg.out /
    "summary.json"``: test accuracy and loss, epochs and steps done, seconds, the settings.

    Raises:
        RuntimeError: ``cfg.out`` holds another run and neither ``resume`` nor ``overwrite`` is set,
            another run is using it, or the settings differ from those of the run it resumes
            (the messages name the command line's flags: ``--out`` for ``out``, ``--resume``,
            ``--overwrite``); :class:`CheckpointError` (a RuntimeError) for a checkpoint that
            cannot be resumed (truncated, or written by another run or number of processes);
            BackendUnavailable for a forced backend that cannot run the run's layers.
        ValueError: a backend forced by ``FASTLAYERS_BACKEND`` that is unknown (UnknownBackend),
            or the settings' own checks (:class:`TrainConfig`).
        FileNotFoundError: the dataset's file is unavailable offline
            (``fastlayers.data``'s DataUnavailable).
    """
    from ._loop import run as _run

    return _run(cfg, log)

__all__ = ["TrainConfig", "run", "SequenceClassifier", "load_checkpoint", "CheckpointError"]
