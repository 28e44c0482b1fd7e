"""Spoken-digit classification with a bidirectional fastlayers.LSTM over padded batches + lengths.

Trains on the Free Spoken Digit Dataset (13 MFCCs per frame), then trains the same model with
torch.nn.LSTM + PackedSequence on the same data, seed and initial weights, and prints both test
accuracies and wall times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence
from tqdm import tqdm

from .. import LSTM
from ..data import Sequences, batches, load_spoken_digits, pad_batch, stratified_split


@dataclass
class Config:
    epochs: int = 12
    hidden_size: int = 64
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0


class DigitClassifier(nn.Module):
    """BLSTM encoder + linear head on the final states of both directions.

    ``packed=True`` runs the encoder as torch.nn.LSTM on a PackedSequence (the usual torch way);
    otherwise fastlayers.LSTM on the padded batch with ``lengths``.
    """

    def __init__(self, hidden_size: int, packed: bool = False) -> None:
        super().__init__()
        cls = nn.LSTM if packed else LSTM
        self.packed = packed
        self.encoder = cls(13, hidden_size, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden_size, 10)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        if self.packed:
            _, (h, _) = self.encoder(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
        else:
            _, (h, _) = self.encoder(x, lengths=lengths)
        return self.head(torch.cat([h[-2], h[-1]], dim=1))


def train_and_evaluate(cfg: Config, packed: bool, data, train_idx, test_idx, init_state=None, desc=""):
    torch.manual_seed(cfg.seed)
    model = DigitClassifier(cfg.hidden_size, packed=packed)
    if init_state is not None:
        model.load_state_dict(init_state)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    rng = np.random.default_rng(cfg.seed)
    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        model.train()
        order = batches(train_idx[rng.permutation(train_idx.size)], cfg.batch_size)
        bar = tqdm(order, desc=f"{desc} epoch {epoch + 1}/{cfg.epochs}", leave=False)
        for idx in bar:
            x, lengths, y = pad_batch(data, idx)
            loss = nn.functional.cross_entropy(model(x, lengths), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    train_time = time.perf_counter() - start
    model.eval()
    correct = 0
    with torch.no_grad():
        for idx in batches(test_idx, 256):
            x, lengths, y = pad_batch(data, idx)
            correct += int((model(x, lengths).argmax(1) == y).sum())
    return model, correct / test_idx.size, train_time


def run(cfg: Config | None = None) -> dict[str, float]:
    cfg = cfg or Config()
    data = load_spoken_digits()
    train_idx, test_idx = stratified_split(data.labels, 0.2, cfg.seed)
    frames = np.concatenate([data.features[i] for i in train_idx])
    mean, std = frames.mean(0), frames.std(0) + 1e-6
    features = [((f - mean) / std).astype(np.float32) for f in data.features]
    data = Sequences(features=features, labels=data.labels, lengths=data.lengths)
    print(f"Free Spoken Digit Dataset, 13 MFCCs/frame: {train_idx.size} train / {test_idx.size} test recordings, "
          f"{int(data.lengths.min())}-{int(data.lengths.max())} frames, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    torch.manual_seed(cfg.seed)
    init = DigitClassifier(cfg.hidden_size).state_dict()
    _, acc, secs = train_and_evaluate(cfg, False, data, train_idx, test_idx, init, "fastlayers.LSTM + lengths")
    print(f"fastlayers.LSTM (padded + lengths):   test accuracy {acc:.2%}, training {secs:.1f} s")
    _, acc_t, secs_t = train_and_evaluate(cfg, True, data, train_idx, test_idx, init, "torch.nn.LSTM packed")
    print(f"torch.nn.LSTM (PackedSequence):       test accuracy {acc_t:.2%}, training {secs_t:.1f} s")
    print(f"same data, seed and initial weights; fastlayers / torch training time: {secs / secs_t:.2f}x")
    return {"accuracy": acc, "seconds": secs, "torch_accuracy": acc_t, "torch_seconds": secs_t}
