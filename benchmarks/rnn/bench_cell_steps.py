"""The LayerNorm cells stepped in a Python loop against torch.nn's cells, over hidden sizes and
batches: the no-grad step (the C++ operator, one step per call) and fwd+bwd over the loop.

Shapes: input_size 64, hidden H in --hidden, batch B in --batch, --steps steps a loop, fp32,
--threads threads. fastlayers.LSTMCell / GRUCell(layer_norm=True) against torch.nn.LSTMCell /
GRUCell (no LayerNorm: what a user gives up the option for), both in this process, calls
alternating, the median of --repeats loops after two warm-up loops. Prints ms a step and the
ratio (fastlayers / torch) per row.

    python benchmarks/rnn/bench_cell_steps.py [--cells LSTM,GRU] [--hidden 128,256,512,1024]
        [--batch 1,4,8,32] [--steps 20] [--repeats 7] [--threads 2] [--grad]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastlayers
from fastlayers._core.system import cpu_description


def loop(cell, xs: torch.Tensor, hidden: int, lstm: bool, grad: bool):
    def run() -> None:
        with torch.set_grad_enabled(grad):
            h = torch.zeros(xs.size(1), hidden)
            state = (h, torch.zeros_like(h)) if lstm else h
            loss = 0.0
            for x in xs:
                state = cell(x, state)
                loss = loss + (state[0] if lstm else state).sum()
            if grad:
                loss.backward()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="LSTM,GRU")
    ap.add_argument("--hidden", default="128,256,512,1024")
    ap.add_argument("--batch", default="1,4,8,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--grad", action="store_true", help="fwd+bwd over the loop (default: no-grad steps)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_description()}; torch {torch.__version__}, {args.threads} threads; "
          f"{'fwd+bwd' if args.grad else 'no_grad'}, {args.steps} steps a loop, median of {args.repeats}")
    print("| cell | H | B | fastlayers ms/step | torch ms/step | x |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.cells.split(","):
        lstm = name == "LSTM"
        for hidden in map(int, args.hidden.split(",")):
            for batch in map(int, args.batch.split(",")):
                torch.manual_seed(0)
                ours = getattr(fastlayers, f"{name}Cell")(64, hidden, layer_norm=True)
                theirs = getattr(torch.nn, f"{name}Cell")(64, hidden)
                xs = torch.randn(args.steps, batch, 64)
                runs = [loop(ours, xs, hidden, lstm, args.grad), loop(theirs, xs, hidden, lstm, args.grad)]
                times: list[list[float]] = [[], []]
                for _ in range(2):
                    for run in runs:
                        run()
                for _ in range(args.repeats):
                    for i, run in enumerate(runs):
                        t0 = time.perf_counter()
                        run()
                        times[i].append((time.perf_counter() - t0) * 1e3 / args.steps)
                a, b = (statistics.median(t) for t in times)
                print(f"| {name}Cell(layer_norm) | {hidden} | {batch} | {a:.3f} | {b:.3f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
