"""Issue 62: the engine against torch.nn over hidden sizes and batches, each cell option alone.

Shapes: T = 200 (--steps), bidirectional (one direction with --unidirectional), input_size =
hidden = H, H in --hidden, B in --batch,
fp32, fwd+bwd (the input and every parameter require grad), the module in training mode (zoneout
and recurrent dropout draw their masks, as users train). For each cell type and option: the
fastlayers layer with that option alone against the plain torch.nn.LSTM / GRU of the same shape
(cuDNN / oneDNN have no such option; the plain layer is what a user gives up the option for),
calls interleaved in one process, median of --repeats after one warm-up round. Prints one H x B
table of ratios (fastlayers / torch) per option, and the largest.

    python benchmarks/rnn/bench_cpu_sweep.py [--cells LSTM,GRU] [--options layer_norm,peephole,...]
        [--hidden 64,128,256,512] [--batch 8,32,128] [--steps 200] [--repeats 3] [--threads 2]
        [--unidirectional]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastlayers
from fastlayers._core.system import cpu_description

OPTIONS = {  # option -> (cells it applies to, fastlayers kwargs)
    "layer_norm": (("LSTM", "GRU"), dict(layer_norm=True)),
    "peephole": (("LSTM",), dict(peephole=True)),
    "cell_clip": (("LSTM",), dict(cell_clip=3.0)),
    "zoneout": (("LSTM", "GRU"), dict(zoneout=0.1)),
    "recurrent_dropout": (("LSTM", "GRU"), dict(recurrent_dropout=0.25)),
}


def fwd_bwd(module, x) -> float:
    x = x.detach().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    module(x)[0].sum().backward()
    return time.perf_counter() - t0


def ratio(cell: str, kwargs: dict, hidden: int, batch: int, steps: int, repeats: int,
          bidirectional: bool = True) -> float:
    torch.manual_seed(0)
    ours = getattr(fastlayers, cell)(hidden, hidden, bidirectional=bidirectional, **kwargs).train()
    theirs = getattr(torch.nn, cell)(hidden, hidden, bidirectional=bidirectional).train()
    x = torch.randn(steps, batch, hidden)
    times = {"ours": [], "theirs": []}
    for rep in range(-1, repeats):
        for name in (("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours")):
            t = fwd_bwd(ours if name == "ours" else theirs, x)
            if rep >= 0:
                times[name].append(t)
    return statistics.median(times["ours"]) / statistics.median(times["theirs"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", default="LSTM,GRU")
    p.add_argument("--options", default=",".join(OPTIONS))
    p.add_argument("--hidden", default="64,128,256,512")
    p.add_argument("--batch", default="8,32,128")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--unidirectional", action="store_true", help="one direction instead of two")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hiddens = [int(v) for v in args.hidden.split(",")]
    batches = [int(v) for v in args.batch.split(",")]
    print(f"# {cpu_description()}; torch {torch.__version__}, {args.threads} threads; T={args.steps}, "
          f"{'unidirectional' if args.unidirectional else 'bidirectional'}, "
          f"input = hidden = H, fwd+bwd, training mode; fastlayers / torch.nn, median of {args.repeats}")
    worst = (0.0, "")
    for cell in args.cells.split(","):
        for option in args.options.split(","):
            cells, kwargs = OPTIONS[option]
            if cell not in cells:
                continue
            print(f"\n{cell}, {option} (x torch.nn.{cell})\n| H \\ B | " + " | ".join(map(str, batches)) + " |\n|---|" +
                  "---:|" * len(batches))
            for hidden in hiddens:
                row = [ratio(cell, kwargs, hidden, batch, args.steps, args.repeats, not args.unidirectional)
                       for batch in batches]
                worst = max(worst, *((r, f"{cell} {option} H={hidden} B={b}") for r, b in zip(row, batches)))
                print(f"| {hidden} | " + " | ".join(f"{r:.2f}" for r in row) + " |", flush=True)
    print(f"\nlargest: {worst[0]:.2f}x ({worst[1]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
