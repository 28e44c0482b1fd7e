"""8x8 handwritten digits: a LocallyConnected2d model next to the same model with nn.Conv2d
(shared weights) and an nn.Linear (MLP) baseline, trained with the same budget and seed."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from .. import LocallyConnected2d
from ..data import load_digits_8x8, stratified_split


@dataclass
class Config:
    epochs: int = 40
    channels: int = 16
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0


def make_model(kind: str, channels: int) -> nn.Module:
    """``local``: LocallyConnected2d(1, C, 8x8, 3x3, pad 1); ``conv``: the same with shared weights;
    ``linear``: a 64 -> C*16 -> 10 MLP. All: ReLU, 2x2 max-pool (not for linear), linear head."""
    if kind == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, channels * 16), nn.ReLU(), nn.Linear(channels * 16, 10))
    first = LocallyConnected2d(1, channels, (8, 8), kernel_size=3, padding=1) if kind == "local" else \
        nn.Conv2d(1, channels, 3, padding=1)
    return nn.Sequential(first, nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(channels * 16, 10))


def run(cfg: Config | None = None) -> dict[str, float]:
    cfg = cfg or Config()
    images, labels = load_digits_8x8()
    train_idx, test_idx = stratified_split(labels, 0.2, cfg.seed)
    x = torch.from_numpy(images).unsqueeze(1)
    y = torch.from_numpy(labels)
    print(f"scikit-learn 8x8 digits: {train_idx.size} train / {test_idx.size} test images; {cfg.epochs} epochs, "
          f"Adam lr {cfg.lr}, batch {cfg.batch_size}, seed {cfg.seed}")
    results = {}
    for kind in ("local", "conv", "linear"):
        torch.manual_seed(cfg.seed)
        model = make_model(kind, cfg.channels)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        rng = np.random.default_rng(cfg.seed)
        start = time.perf_counter()
        for _ in tqdm(range(cfg.epochs), desc=f"{kind:6s}", unit="epoch"):
            model.train()
            order = train_idx[rng.permutation(train_idx.size)]
            for s in range(0, order.size, cfg.batch_size):
                idx = torch.from_numpy(order[s : s + cfg.batch_size])
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        secs = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            acc = (model(x[torch.from_numpy(test_idx)]).argmax(1) == y[torch.from_numpy(test_idx)]).float().mean().item()
        params = sum(p.numel() for p in model.parameters())
        results[kind] = acc
        print(f"{kind:6s} test accuracy {acc:.2%}  ({params} parameters, training {secs:.1f} s)")
    return results
