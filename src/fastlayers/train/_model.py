"""The sequence classifier ``fastlayers train`` builds from fastlayers layers."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import GRU, LSTM, AttentionPooling
from ._config import TrainConfig


class SequenceClassifier(nn.Module):
    """Recurrent encoder over a padded batch with lengths, then a classification head.

    encoder: :class:`fastlayers.LSTM` or :class:`fastlayers.GRU` (batch_first, with the cell
    options of the config); head ``"final"``: a linear layer on the last layer's final states of
    every direction; ``"attention"``: :class:`fastlayers.AttentionPooling` (additive score) over
    the outputs, queried by those final states, then the linear layer.

    Args:
        cfg: the run's :class:`TrainConfig` (cell, sizes, options, head).
        num_features: F, the input features per step.
        num_classes: the logits per sequence.

    Forward: x (B, T, F) float32, lengths (B,) int64 -> logits (B, num_classes) in the parameters'
    dtype; or the varlen form x (N, F), ``cu_seqlens=`` (B+1,) (the sequences one after another,
    no padding). Errors: the encoder's (:class:`fastlayers.LSTM`).
    """

    def __init__(self, cfg: TrainConfig, num_features: int, num_classes: int) -> None:
        super().__init__()
        options = dict(layer_norm=cfg.layer_norm, zoneout=cfg.zoneout or None, recurrent_dropout=cfg.recurrent_dropout,
                       checkpoint_every=cfg.rnn_checkpoint_every)
        if cfg.cell == "lstm":
            options.update(peephole=cfg.peephole, cell_clip=cfg.cell_clip)
        cls = LSTM if cfg.cell == "lstm" else GRU
        self.encoder = cls(num_features, cfg.hidden_size, num_layers=cfg.num_layers, batch_first=True,
                           bidirectional=cfg.bidirectional, dropout=cfg.dropout, **options)
        self.directions = 2 if cfg.bidirectional else 1
        width = self.directions * cfg.hidden_size
        self.pool = AttentionPooling(width, score="additive") if cfg.head == "attention" else None
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor, lengths: Tensor | None = None, *, cu_seqlens: Tensor | None = None) -> Tensor:
        """Logits (B, num_classes) of a padded batch x (B, T, F) with ``lengths`` (B,), or of the
        varlen values x (N, F) with ``cu_seqlens`` (B+1,)."""
        varlen = {"cu_seqlens": cu_seqlens} if cu_seqlens is not None else {"lengths": lengths}
        out, state = self.encoder(x, **varlen)
        h_n = state[0] if isinstance(state, tuple) else state
        final = torch.cat(list(h_n[-self.directions:]), dim=1)  # (B, D*H)
        if self.pool is not None:
            final, _ = self.pool(final, out, out, **varlen)
        return self.head(final)
