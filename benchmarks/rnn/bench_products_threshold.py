"""Issue 62: where the recurrent layers' large products should leave torch's BLAS for ``_native/matmul.c``.

Whole layers at the row counts around the threshold (``fastlayers._native.own_products``):
``LSTM(2H, H, bidirectional=True, layer_norm=True)`` fwd+bwd at B x T rows per direction, the large
products forced onto matmul.c and onto torch's BLAS (:func:`fastlayers._native.prefer_own_products`)
in one process, calls alternating, medians after --warmup rounds. Below 1 the library's kernel is
faster. Run it once per CPU variant (``FASTLAYERS_CPU_CAPABILITY=avx2`` for the other build).

    python benchmarks/rnn/bench_products_threshold.py [--hidden 64,128,256,512] [--repeats 22] [--warmup 3]
        [--shapes B:T,B:T,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import fastlayers
from fastlayers import _native
from fastlayers._core.system import cpu_description

SHAPES = "32:4,32:8,32:16,32:20,32:24,32:32,8:100"  # B:T


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", default="64,128,256,512")
    p.add_argument("--repeats", type=int, default=22)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default=SHAPES, help="batch:steps pairs, comma-separated")
    args = p.parse_args()
    shapes = [tuple(int(v) for v in pair.split(":")) for pair in args.shapes.split(",")]
    if _native.library() is None:
        print("the native library is unavailable: nothing to compare")
        return 1
    torch.set_num_threads(args.threads)
    print(f"# {cpu_description()}; torch {torch.__version__}, {args.threads} threads; variant {_native.built_as()}; "
          f"LSTM(2H, H, bidirectional, layer_norm) fwd+bwd, medians of {args.repeats} after {args.warmup}, alternating")
    print("| H | B | T | rows | matmul.c ms | torch BLAS ms | x |\n|---:|---:|---:|---:|---:|---:|---:|")
    for hidden in (int(h) for h in args.hidden.split(",")):
        torch.manual_seed(0)
        layer = fastlayers.LSTM(2 * hidden, hidden, bidirectional=True, layer_norm=True)
        for batch, steps in shapes:
            x = torch.randn(steps, batch, 2 * hidden)
            times: dict[bool, list[float]] = {True: [], False: []}
            for rep in range(args.warmup + args.repeats):
                for own in ((True, False) if rep % 2 == 0 else (False, True)):
                    _native.prefer_own_products(own)
                    t0 = time.perf_counter()
                    layer(x.detach().requires_grad_(True))[0].sum().backward()
                    if rep >= args.warmup:
                        times[own].append(time.perf_counter() - t0)
            _native.prefer_own_products(None)
            own, blas = (statistics.median(times[k]) for k in (True, False))
            print(f"| {hidden} | {batch} | {steps} | {batch * steps} | {own * 1e3:.2f} | {blas * 1e3:.2f} | "
                  f"{own / blas:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
