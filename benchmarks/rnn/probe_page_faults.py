"""Issue 62: first-touch page faults and time of the seed-shape LayerNorm LSTM against torch.nn.LSTM.

Seed shape (bidirectional 512 -> 256, T=800, B=32, fp32). ``fastlayers.LSTM(layer_norm=True)`` and
``torch.nn.LSTM`` in one process, calls interleaved, after --warmup rounds: per call the wall time
and the process's minor page faults (``getrusage``), medians over --repeats; for fwd+bwd (input
requires grad, ``out.sum().backward()``) and the forward under ``no_grad``. Then the training-mask
draw alone: ``fastlayers.rnn._masks.keep_mask`` against ``torch.rand(shape) < p`` for a
(2, 1600, 128) mask (median of 50 each, interleaved). Run it again with ``FASTLAYERS_CPU_CACHE_MB=0``
to see the layer without its block cache.

    python benchmarks/rnn/probe_page_faults.py [--repeats 5] [--warmup 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

import fastlayers
from fastlayers._core.system import cpu_description
from fastlayers.rnn import _masks


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(call) -> tuple[float, int]:
    f0, t0 = _faults(), time.perf_counter()
    call()
    return time.perf_counter() - t0, _faults() - f0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours = fastlayers.LSTM(512, 256, bidirectional=True, layer_norm=True)
    theirs = torch.nn.LSTM(512, 256, bidirectional=True)
    x = torch.randn(800, 32, 512)

    def fwd_bwd(m):
        m(x.detach().requires_grad_(True))[0].sum().backward()

    def no_grad(m):
        with torch.no_grad():
            m(x)

    cache = os.environ.get("FASTLAYERS_CPU_CACHE_MB", "default (1024)")
    print(f"# {cpu_description()}; torch {torch.__version__}, {args.threads} threads; FASTLAYERS_CPU_CACHE_MB="
          f"{cache}; medians of {args.repeats} after {args.warmup}")
    print("| call | fastlayers s | faults / call (MB) | torch.nn.LSTM s | faults / call (MB) | x torch |\n"
          "|---|---:|---:|---:|---:|---:|")
    for name, run in (("LN-LSTM fwd+bwd", fwd_bwd), ("LN-LSTM no_grad fwd", no_grad)):
        got: dict[str, list[tuple[float, int]]] = {"ours": [], "theirs": []}
        for rep in range(args.warmup + args.repeats):
            for key in (("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours")):
                r = measure(lambda: run(ours if key == "ours" else theirs))
                if rep >= args.warmup:
                    got[key].append(r)
        s = {k: statistics.median(t for t, _ in v) for k, v in got.items()}
        f = {k: statistics.median(n for _, n in v) for k, v in got.items()}
        print(f"| {name} | {s['ours']:.3f} | {f['ours']:.0f} ({f['ours'] * 4096 / 1e6:.0f}) | {s['theirs']:.3f} | "
              f"{f['theirs']:.0f} ({f['theirs'] * 4096 / 1e6:.0f}) | {s['ours'] / s['theirs']:.2f} |")
    shape, prob = (2, 1600, 128), 0.1
    times: dict[str, list[float]] = {"keep_mask": [], "torch.rand < p": []}
    for _ in range(50):
        times["keep_mask"].append(measure(lambda: _masks.keep_mask(shape, prob, torch.float32, "cpu"))[0])
        times["torch.rand < p"].append(measure(lambda: (torch.rand(shape) < prob).float())[0])
    a, b = (statistics.median(v) * 1e3 for v in times.values())
    print(f"\nmask {shape}, p={prob}: keep_mask {a:.3f} ms, torch.rand < p {b:.3f} ms ({a / b:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
