"""Issue: the recurrent engine — which CPU path should run LSTM / GRU with lengths and no options?

Candidates on the same module and inputs: the foundation's segment path (torch's fused kernel once
per run of steps with the same active sequences, ``fastlayers.rnn.varlen_rnn``) and the engine
(packed rows, one C step kernel, hand-written backward). Two shapes, 2-layer bidirectional:
``seed`` (512 -> 256x2, T=800, B=32, lengths in [400, 800]) and ``demo`` (the spoken-digit demo:
13 -> 64x2, T=92, B=32, lengths in [6, 92]). fastlayers.LSTM / GRU dispatch to the faster one.
Exits 1 when the two paths disagree in value or gradient (float64 check).

    python benchmarks/rnn/bench_lengths_paths.py [--shapes seed,demo] [--modes LSTM,GRU]
"""

from __future__ import annotations

import argparse
import sys

import torch

import fastlayers
from fastlayers.bench import compare
from fastlayers.rnn._options import CellOptions

from bench_engine import Engine, Segments  # the same engine / segment-path candidates as the engine bench

SHAPES = {"seed": (512, 256, 800, 32, 400, 3), "demo": (13, 64, 92, 32, 6, 30), "small": (4, 3, 6, 3, 1, 1)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="seed,demo")
    p.add_argument("--modes", default="LSTM,GRU")
    args = p.parse_args()
    failed = []
    for shape in args.shapes.split(","):
        f, h, t, b, lo, repeats = SHAPES[shape]
        for mode in args.modes.split(","):
            torch.manual_seed(0)
            rnn = (fastlayers.LSTM if mode == "LSTM" else fastlayers.GRU)(f, h, num_layers=2, bidirectional=True)

            def make_inputs():
                g = torch.Generator().manual_seed(0)
                lengths = torch.randint(lo, t + 1, (b,), generator=g)
                lengths[0] = t
                return {"x": torch.rand(t, b, f, generator=g).requires_grad_(True), "lengths": lengths}

            rep = compare({"segment path": Segments(rnn), "engine": Engine(rnn, CellOptions(), True)}, make_inputs, repeats=repeats,
                          warmup=1, workload=f"{mode} 2-layer bidirectional {f} -> {h}x2, T={t}, B={b}, lengths in "
                          f"[{lo}, {t}] ({shape})")
            print(rep.markdown() + "\n", flush=True)
            failed += [f"{rep.workload}: {r.name}: {r.failures()}" for r in rep.results if r.failures()]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if failed:
        print(f"check failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
