"""Issue 62: the seed workload's GEMM floor on this CPU, and the layers' time as a multiple of it.

The floor: the seed workload's matrix-product FLOPs (bidirectional 512 -> 256, T=800, B=32, fp32,
fwd+bwd: the input projection, the recurrent products of every step, the input gradient and the
two weight gradients; G = 4H for LSTM, 3H for GRU) divided by torch's own large sgemm rate on
these cores (``torch.mm`` of 2048 x 2048 matrices, median of 5). Every candidate does those
products, so no implementation can be faster than the floor; the step products (32 rows) cannot
reach the large-GEMM rate, so the real bound is higher. Where torch's BLAS does not run the CPU's
widest FMA (on the AMD Zen 5 of BENCHMARKS.md it ran at under half of matmul.c's rate), that
floor is not the hardware's: the second one, "x own floor", divides by the layers' own kernel's
rate on the workload's largest product (matmul.c: ``fastlayers.rnn._cpu_recurrence._project``,
the input projection, 2 x 25600 rows, 512 -> 1024). Candidates, one process, interleaved, medians
after one warm-up round: ``fastlayers.LSTM / GRU(layer_norm=True)`` and ``torch.nn.LSTM / GRU``,
fwd+bwd (input requires grad; the gradients are cleared, set to None, before every call, outside
the timed region), and the fastlayers layers' forward under ``no_grad``.

    python benchmarks/rnn/bench_cpu_floor.py [--repeats 5] [--threads 2] [--compare-products]

--compare-products adds, for each fastlayers call, the same call with the layers' large products
(input projection, its input gradient) on the other engine than this CPU's choice (matmul.c or
torch's BLAS, fastlayers._native.own_products), interleaved with the rest.

Prints the CPU (vendor, family / model, the ISA flags that matter), the two GEMM rates, and a
table: seconds, x the floor, x the own floor, x torch's module.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import fastlayers
from fastlayers import _native
from fastlayers._core.system import cpu_description

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing.py
from timing import median_seconds  # noqa: E402

F_IN, HIDDEN, STEPS, BATCH, DIRS = 512, 256, 800, 32, 2


def sgemm_rate(repeats: int = 5, n: int = 2048) -> float:
    """torch's large float32 GEMM rate here, FLOP/s (median of ``repeats`` after one)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2 * n ** 3 / median_seconds(lambda: torch.mm(a, b, out=out), repeats)


def own_rate(repeats: int = 5) -> float:
    """matmul.c's float32 GEMM rate here, FLOP/s, on the seed's input projection (X W_ih^T, 2 x
    25600 rows, 512 -> 1024: the workload's largest product; median of ``repeats`` after one)."""
    from fastlayers._core import precision
    from fastlayers.rnn import _cpu_recurrence as engine

    mm = precision.Products(torch.float32, torch.float32, torch.device("cpu"))
    rows, g = STEPS * BATCH, 4 * HIDDEN
    x, w, out = torch.randn(DIRS, rows, F_IN), torch.randn(DIRS, g, F_IN), torch.empty(DIRS, rows, g)
    _native.prefer_own_products(True)
    try:
        seconds = median_seconds(lambda: engine._project(mm, x, w, None, out), repeats)
    finally:
        _native.prefer_own_products(None)
    return 2 * DIRS * rows * g * F_IN / seconds


def workload_flops(gates: int, backward: bool) -> float:
    """Matrix-product FLOPs of one bidirectional layer at the seed shape."""
    rows, g = STEPS * BATCH, gates * HIDDEN
    forward = DIRS * 2 * rows * g * (F_IN + HIDDEN)  # input projection + recurrent products
    return forward * 3 if backward else forward  # + input gradient and W_ih's; + dh products and W_hh's


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compare-products", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rate = sgemm_rate()
    own_floor = own_rate() if _native.library() is not None else None
    own = _native.own_products()
    print(f"# {cpu_description()}; torch {torch.__version__}, {args.threads} threads; the layers' large products on "
          f"{'matmul.c' if own else 'torch BLAS'}")
    print(f"# torch.mm 2048^3 float32: {rate / 1e9:.1f} GFLOP/s")
    if own_floor:
        print(f"# matmul.c float32, the seed's input projection (2 x 25600 x 512 -> 1024): "
              f"{own_floor / 1e9:.1f} GFLOP/s")
    torch.manual_seed(0)
    x = torch.randn(STEPS, BATCH, F_IN, requires_grad=True)
    cands = {}
    for cell, gates in (("LSTM", 4), ("GRU", 3)):
        ours = getattr(fastlayers, cell)(F_IN, HIDDEN, bidirectional=True, layer_norm=True)
        theirs = getattr(torch.nn, cell)(F_IN, HIDDEN, bidirectional=True)
        other = f" [products on {'torch BLAS' if own else 'matmul.c'}]"
        for grad, call in ((True, "fwd+bwd"), (False, "no_grad fwd")):
            cands[f"fastlayers.{cell}(layer_norm=True) {call}"] = (ours, grad, gates, f"torch.nn.{cell} {call}", None)
            if args.compare_products:
                cands[f"fastlayers.{cell}(layer_norm=True) {call}{other}"] = (ours, grad, gates,
                                                                              f"torch.nn.{cell} {call}", not own)
            cands[f"torch.nn.{cell} {call}"] = (theirs, grad, gates, None, None)
    times: dict[str, list[float]] = {k: [] for k in cands}
    for rep in range(-1, args.repeats):
        names = list(cands)
        names = names[rep % len(names):] + names[:rep % len(names)] if rep >= 0 else names
        for name in names:
            module, grad, _, _, products = cands[name]
            _native.prefer_own_products(products)
            x.grad = None  # untimed, as the harness does: no timed call adds to an earlier call's gradients
            module.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            if grad:
                module(x)[0].sum().backward()
            else:
                with torch.no_grad():
                    module(x)
            if rep >= 0:
                times[name].append(time.perf_counter() - t0)
    print("| call | s (median) | GEMM GFLOP | x floor | x own floor | x torch's module |")
    print("|---|---:|---:|---:|---:|---:|")
    _native.prefer_own_products(None)
    for name, (_, grad, gates, anchor, _) in cands.items():
        med = statistics.median(times[name])
        flops = workload_flops(gates, grad)
        ratio = f"{med / statistics.median(times[anchor]):.2f}" if anchor else ""
        own_x = f"{med / (flops / own_floor):.2f}" if own_floor else "-"
        print(f"| {name} | {med:.3f} | {flops / 1e9:.1f} | {med / (flops / rate):.2f} | {own_x} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
