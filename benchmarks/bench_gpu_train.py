"""Issue 41: ``fastlayers train --device cuda`` against the same training with torch.nn.LSTM + PackedSequence.

For each dataset (the spoken digits, the Japanese vowels) the default ``fastlayers train`` run
(bidirectional LSTM, hidden 64, final-state head, fp32) three times: fastlayers.LSTM, fastlayers.LSTM
with ``--layer-norm`` (the GPU engine, a different T in almost every batch), and torch.nn.LSTM on the
PackedSequence of each batch (the encoder swapped in, nothing else changed). Printed per run: the
seconds per epoch (median over epochs; the first epoch, with Triton's compile and the CUDA-graph
captures, apart), the final validation and test accuracy, and the CUDA-graph captures
(fastlayers.rnn._gpu_graphs). The same seed for all: accuracies of the plain runs should agree closely,
layer_norm's be in the same band.

    python benchmarks/bench_gpu_train.py [--device cuda] [--epochs 12] [--datasets digits,vowels]
                                         [--json FILE]

Needs the dataset wheels (``make setup``; on a machine without the network, copy them and set
``FASTLAYERS_DATA``); exits 3 naming them when they are missing. ``--device cpu --epochs 2
--max-samples 64`` is a smoke test of the script (its times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from unittest import mock

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from fastlayers.rnn import _gpu_graphs
from fastlayers.train import TrainConfig, _model, run


class PackedLSTM(nn.LSTM):
    """torch.nn.LSTM taking the padded batch with ``lengths=`` as fastlayers.LSTM does, run on its
    PackedSequence (cuDNN's variable-length path); no cell options."""

    def __init__(self, *args, layer_norm=False, peephole=False, cell_clip=None, zoneout=None,
                 recurrent_dropout=0.0, checkpoint_every=None, **kwargs):
        if layer_norm or peephole or cell_clip is not None or zoneout or recurrent_dropout \
                or checkpoint_every is not None:
            raise ValueError("PackedLSTM: torch.nn.LSTM has no cell options nor checkpoint_every")
        super().__init__(*args, **kwargs)

    def forward(self, x, hx=None, *, lengths=None):  # noqa: D102
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=self.batch_first, enforce_sorted=False)
        out, state = super().forward(packed, hx)
        steps = x.size(1 if self.batch_first else 0)
        return pad_packed_sequence(out, batch_first=self.batch_first, total_length=steps)[0], state


def one_run(dataset: str, variant: str, args, out: str) -> dict:
    cfg = TrainConfig(dataset=dataset, layer_norm=variant == "fastlayers.LSTM layer_norm", epochs=args.epochs,
                      device=args.device, out=out, checkpoint_every=0, seed=args.seed, max_samples=args.max_samples)
    before = dict(_gpu_graphs.stats)
    _gpu_graphs.clear()
    patch = mock.patch.object(_model, "LSTM", PackedLSTM) if variant.startswith("torch") else contextlib.nullcontext()
    with patch:
        summary = run(cfg, log=lambda message: None)
    with open(f"{out}/metrics.jsonl") as f:
        history = [json.loads(line) for line in f]
    ends = [h["seconds"] for h in history]  # cumulative training seconds at each epoch's end
    per_epoch = [b - a for a, b in zip([0.0] + ends, ends)]
    return {"dataset": dataset, "variant": variant, "first_epoch_s": per_epoch[0],
            "epoch_s": statistics.median(per_epoch[1:]) if len(per_epoch) > 1 else per_epoch[0],
            "val_accuracy": history[-1]["val_accuracy"], "test_accuracy": summary["test_accuracy"],
            "captures": _gpu_graphs.stats["captures"] - before["captures"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--datasets", default="digits,vowels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-samples", type=int, default=None, help="train on the first N sequences (smoke tests)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"# {name}; torch {torch.__version__}; fastlayers train defaults (BLSTM hidden 64, final head, fp32, "
          f"TF32 off), {args.epochs} epochs, seed {args.seed}")
    print("| dataset | encoder | s / epoch (median) | first epoch s | vs torch.nn | val acc | test acc | captures |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for dataset in args.datasets.split(","):
        base = None
        for variant in ("torch.nn.LSTM + PackedSequence", "fastlayers.LSTM", "fastlayers.LSTM layer_norm"):
            with tempfile.TemporaryDirectory() as out:
                try:
                    row = one_run(dataset, variant, args, out)
                except FileNotFoundError as e:
                    print(f"dataset files missing: {e}", file=sys.stderr)
                    return 3
            base = base or row["epoch_s"]
            rows.append(row)
            print(f"| {dataset} | {variant} | {row['epoch_s']:.2f} | {row['first_epoch_s']:.2f} | "
                  f"{row['epoch_s'] / base:.2f} | {row['val_accuracy']:.3f} | {row['test_accuracy']:.3f} | "
                  f"{row['captures']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
