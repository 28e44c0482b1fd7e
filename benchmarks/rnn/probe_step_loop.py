"""Issue 62: the CPU engine's no-grad forward split into its time loop and its input projection.

The bidirectional 256-hidden layer at T=800, B=32 under ``torch.no_grad()``: (a) with input size 16,
so that the call is its time loop (the projection is 1/32 of the seed's): ``LSTM(layer_norm=True)``,
``LSTM(cell_clip=3.0)``, ``LSTM(peephole=True)`` and torch.nn.LSTM, in ms a call and us a step; (b)
at the seed's input size 512: ``LSTM(layer_norm=True)``, torch.nn.LSTM, and the input projection
alone (``fastlayers.rnn._cpu_recurrence._project``, 2 x 25600 x 512 -> 1024, this CPU's choice of
kernel). One process, medians of --repeats calls after one, the candidates one after another, the
whole set --rounds times (compare our builds across processes run alternately; compare against
torch.nn.LSTM within one).

    python benchmarks/rnn/probe_step_loop.py [--repeats 9] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import fastlayers
from fastlayers._core import precision
from fastlayers._core.system import cpu_description
from fastlayers.rnn import _cpu_recurrence as engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing.py
from timing import median_seconds  # noqa: E402

STEPS, BATCH, HIDDEN = 800, 32, 256


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"# {cpu_description()}; torch {torch.__version__}, {args.threads} threads; no_grad, T={STEPS}, B={BATCH}, "
          f"bidirectional, hidden {HIDDEN}")
    small = torch.randn(STEPS, BATCH, 16)
    loop = {name: fastlayers.LSTM(16, HIDDEN, bidirectional=True, **kw) for name, kw in
            (("layer_norm", {"layer_norm": True}), ("cell_clip", {"cell_clip": 3.0}), ("peephole", {"peephole": True}))}
    loop["torch.nn.LSTM"] = torch.nn.LSTM(16, HIDDEN, bidirectional=True)
    seed_x = torch.randn(STEPS, BATCH, 512)
    seed = {"layer_norm": fastlayers.LSTM(512, HIDDEN, bidirectional=True, layer_norm=True),
            "torch.nn.LSTM": torch.nn.LSTM(512, HIDDEN, bidirectional=True)}
    mm = precision.Products(torch.float32, torch.float32, torch.device("cpu"))
    rows, g = STEPS * BATCH, 4 * HIDDEN
    xs, w, xp = torch.randn(2, rows, 512), torch.randn(2, g, 512), torch.empty(2, rows, g)
    with torch.no_grad():
        for r in range(args.rounds):
            cells = [f"{name} {t * 1e3:.1f} ms ({t / STEPS * 1e6:.0f} us a step)" for name, t in
                     ((n, median_seconds(lambda m=m: m(small), args.repeats)) for n, m in loop.items())]
            print(f"round {r + 1}, input 16: " + "; ".join(cells))
            cells = [f"{name} {median_seconds(lambda m=m: m(seed_x), args.repeats) * 1e3:.1f} ms"
                     for name, m in seed.items()]
            proj = median_seconds(lambda: engine._project(mm, xs, w, None, xp), args.repeats)
            print(f"round {r + 1}, input 512: " + "; ".join(cells) + f"; the projection alone {proj * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
