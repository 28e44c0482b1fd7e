"""``fastlayers train``: train a sequence classifier built from fastlayers layers on real data.

One process or several under ``torchrun`` (DistributedDataParallel); checkpoints that survive
interruption (``--resume``); metrics per epoch (``metrics.jsonl``), loss/accuracy curves
(``curves.png``) and a final test accuracy (``summary.json``).
"""

from ._checkpoint import CheckpointError as CheckpointError, load_checkpoint as load_checkpoint
from ._config import TrainConfig as TrainConfig
from ._loop import run as run
from ._model import SequenceClassifier as SequenceClassifier

__all__ = ["TrainConfig", "run", "SequenceClassifier", "load_checkpoint", "CheckpointError"]
