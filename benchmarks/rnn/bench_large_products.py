"""Issue 62: the recurrent engine's large products on matmul.c against torch's BLAS (torch.bmm).

The products one fwd+bwd call of a layer runs over all its packed rows (N = T*B per direction),
fp32, at the seed shape (bidirectional 512 -> 256, T=800, B=32, LSTM: G = 1024) and at the sweep's
unidirectional LSTM H=64 B=32 (T=200: G = 256) and a short unidirectional call of the seed's sizes
(T=20, B=32: 640 rows, the smallest count matmul.c takes on AMD): the input projection xp = X W_ih^T, its input
gradient dX = dpre W_ih, and the weight gradients dW_ih = dpre^T X and dW_hh = dr^T hd, each through
the engine's own helpers (``fastlayers.rnn._cpu_recurrence``) with the choice forced each way
(:func:`fastlayers._native.prefer_own_products`). One process, the two engines interleaved, median
of --repeats after one warm-up call; GFLOP/s and matmul.c's time over torch's.

    python benchmarks/rnn/bench_large_products.py [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastlayers import _native
from fastlayers._core import precision
from fastlayers._core.system import cpu_description
from fastlayers.rnn import _cpu_recurrence as engine

SHAPES = {  # name -> (D, N rows, G, F input size, H hidden)
    "seed (2 x 25600 rows, G 1024, F 512, H 256)": (2, 25600, 1024, 512, 256),
    "H=64 unidirectional (1 x 6400 rows, G 256, F 64, H 64)": (1, 6400, 256, 64, 64),
    "short unidirectional call (1 x 640 rows: T 20, B 32; G 1024, F 512, H 256)": (1, 640, 1024, 512, 256),
}


def products(d: int, n: int, g: int, f: int, h: int) -> dict:
    """name -> (call, GEMM FLOPs) for one shape."""
    torch.manual_seed(0)
    mm = precision.Products(torch.float32, torch.float32, torch.device("cpu"))
    x, w_ih, dpre = torch.randn(d, n, f), torch.randn(d, g, f), torch.randn(d, n, g)
    hd, xp = torch.randn(d, n, h), torch.empty(d, n, g)
    return {
        "projection X W_ih^T": (lambda: engine._project(mm, x, w_ih, None, xp), 2 * d * n * g * f),
        "input gradient dpre W_ih": (lambda: engine._input_grad(mm, dpre, w_ih, torch.float32), 2 * d * n * g * f),
        "dW_ih = dpre^T X": (lambda: engine._weight_grad(mm, dpre, x, torch.float32), 2 * d * n * g * f),
        "dW_hh = dr^T hd": (lambda: engine._weight_grad(mm, dpre, hd, torch.float32), 2 * d * n * g * h),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_description()}; torch {torch.__version__}, {args.threads} threads; this CPU's choice: "
          f"{'matmul.c' if _native.own_products() else 'torch BLAS'} from 1024 rows")
    print("| shape | product | matmul.c GFLOP/s | torch.bmm GFLOP/s | matmul.c / torch time |")
    print("|---|---|---:|---:|---:|")
    try:
        for shape, dims in SHAPES.items():
            for name, (call, flops) in products(*dims).items():
                times = {True: [], False: []}
                for rep in range(-1, args.repeats):
                    for own in ((True, False) if rep % 2 == 0 else (False, True)):
                        _native.prefer_own_products(own)
                        t0 = time.perf_counter()
                        call()
                        if rep >= 0:
                            times[own].append(time.perf_counter() - t0)
                ours, theirs = statistics.median(times[True]), statistics.median(times[False])
                print(f"| {shape} | {name} | {flops / ours / 1e9:.1f} | {flops / theirs / 1e9:.1f} | "
                      f"{ours / theirs:.2f} |")
    finally:
        _native.prefer_own_products(None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
