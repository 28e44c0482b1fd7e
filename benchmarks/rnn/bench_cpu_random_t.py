"""Issue 62: the CPU layers on what users run, a new T in every call, against torch.nn.

Workload (the seed's sizes, fp32): bidirectional, input 512, hidden 256, B=32; call i draws T_i from
U[--t-min, --t-max] and lengths from U[T_i / 2, T_i] (seeded: the same calls for every candidate),
--warmup calls then --calls timed ones, each fwd+bwd (the input requires grad, ``out.sum()
.backward()``), candidates interleaved call by call (their order rotating). Per cell (LSTM, GRU):
torch.nn's module on the padded batch (the anchor, as issue 62's lengths bar: it ignores the
lengths); ``fastlayers`` with ``layer_norm=True`` on the padded batch and with ``lengths=``; and
``fastlayers`` without options with ``lengths=`` (packed semantics on the engine; torch.nn's own
form of that, a PackedSequence, is benchmarks/rnn/bench_rnn_lengths.py's: its CPU backward is the
seed's cliff, tens of seconds a call here).

Printed: per candidate the summed seconds of the timed calls and the ratio to the padded torch.nn
call; minor page faults per call (median, ``getrusage``); then the block cache's state
(``fastlayers._core.pool.cache_info()``: bytes idle and in use, requests served by an idle
block or a new one, the limit) after the run.

    python benchmarks/rnn/bench_cpu_random_t.py [--calls 20] [--warmup 3] [--threads 2]
                                                [--t-min 100] [--t-max 1000] [--only LSTM|GRU]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import torch

import fastlayers
from fastlayers._core import pool
from fastlayers._core.system import cpu_description

F_IN, HIDDEN, BATCH = 512, 256, 32


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def candidates(mode: str) -> dict[str, object]:
    """name -> call(x, lengths) returning the padded output to sum."""
    ours_cls, torch_cls = (fastlayers.LSTM, torch.nn.LSTM) if mode == "LSTM" else (fastlayers.GRU, torch.nn.GRU)
    theirs = torch_cls(F_IN, HIDDEN, bidirectional=True)
    layer_norm = ours_cls(F_IN, HIDDEN, bidirectional=True, layer_norm=True)
    plain = ours_cls(F_IN, HIDDEN, bidirectional=True)
    return {
        f"torch.nn.{mode} padded (anchor)": lambda x, lengths: theirs(x)[0],
        f"fastlayers {mode}(layer_norm=True) padded": lambda x, lengths: layer_norm(x)[0],
        f"fastlayers {mode}(layer_norm=True), lengths=": lambda x, lengths: layer_norm(x, lengths=lengths)[0],
        f"fastlayers {mode}(), lengths=": lambda x, lengths: plain(x, lengths=lengths)[0],
    }


def run(mode: str, calls: list[tuple[int, torch.Tensor]], warmup: int) -> list[tuple[str, float, float]]:
    """(name, summed seconds of the timed calls, median faults per call) per candidate."""
    cands = candidates(mode)
    names = list(cands)
    times: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}
    gen = torch.Generator().manual_seed(1)
    for i, (steps, lengths) in enumerate(calls):
        x = torch.randn(steps, BATCH, F_IN, generator=gen)
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            leaf = x.detach().requires_grad_(True)
            f0, t0 = _faults(), time.perf_counter()
            cands[name](leaf, lengths).sum().backward()
            dt, df = time.perf_counter() - t0, _faults() - f0
            if i >= warmup:
                times[name].append(dt)
                faults[name].append(df)
    return [(n, sum(times[n]), statistics.median(faults[n])) for n in names]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--t-min", type=int, default=100)
    p.add_argument("--t-max", type=int, default=1000)
    p.add_argument("--only", choices=("LSTM", "GRU"), default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    draw = random.Random(0)
    calls = []
    for _ in range(args.warmup + args.calls):
        steps = draw.randint(args.t_min, args.t_max)
        calls.append((steps, torch.tensor([draw.randint(max(1, steps // 2), steps) for _ in range(BATCH)])))
    timed = [t for t, _ in calls[args.warmup:]]
    print(f"# {cpu_description()}; torch {torch.__version__}, {args.threads} threads; T per call from "
          f"U[{args.t_min}, {args.t_max}] (timed calls: mean {statistics.mean(timed):.0f}, "
          f"{min(timed)}-{max(timed)}), lengths U[T/2, T], B={BATCH}, {F_IN} -> {HIDDEN}x2, fp32, fwd+bwd; "
          f"{args.calls} timed calls after {args.warmup}, candidates interleaved call by call")
    print("| candidate | s (sum of timed calls) | x torch.nn padded | faults / call (MB) |\n|---|---:|---:|---:|")
    for mode in ("LSTM", "GRU"):
        if args.only not in (None, mode):
            continue
        rows = run(mode, calls, args.warmup)
        anchor = rows[0][1]
        for name, seconds, faults in rows:
            print(f"| {name} | {seconds:.2f} | {seconds / anchor:.2f} | {faults:.0f} ({faults * 4096 / 1e6:.0f}) |")
    print(f"\nblock cache after the run: {pool.cache_info()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
