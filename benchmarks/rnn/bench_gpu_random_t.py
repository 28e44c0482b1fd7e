"""Issue 41: the GPU engine on real-data shapes, a different T in every call, against cuDNN.

Workload (the seed's sizes, fp32, TF32 off unless --tf32): bidirectional, input 512, hidden 256,
B=32; call i draws T_i from U[100, 1000] and lengths from U[T_i / 2, T_i] (seeded, the same calls
for every candidate), 10 warm-up calls then 50 timed ones, each fwd+bwd (input and every parameter
require grad), timed with CUDA events, candidates interleaved call by call. Candidates per cell
(LSTM, GRU): torch.nn (cuDNN) on the PackedSequence of the call; fastlayers without options
(plain: the engine where its graphs replay, cuDNN otherwise, see fastlayers.rnn._modules) and
with layer_norm=True (the engine), both with lengths=.

Printed: per candidate the summed fwd+bwd ms of the timed calls and its ratio to the same cell's
cuDNN row (issue 41's bars: layer_norm <= 0.5, plain <= 1.0); for the plain rows how many timed
calls the engine served; the CUDA-graph captures (rnn/_gpu_graphs.py) during warm-up and during the
timed calls, growths, evictions; then, per fastlayers candidate run alone, the peak memory of the
whole workload above what was allocated before it, against --fixed-calls calls of the same layer
at fixed T = 1000 (bar: <= 1.25x), and the memory its captured loops hold at the end.

    python benchmarks/rnn/bench_gpu_random_t.py [--device cuda] [--calls 50] [--warmup 10] [--chunk 32]
                                            [--fixed-calls 10] [--only LSTM|GRU] [--tf32] [--json FILE]

``TRITON_INTERPRET=1 python benchmarks/rnn/bench_gpu_random_t.py --device cpu --size small`` runs the
script on Triton's interpreter with the graphs emulated (replays run on CPU; a smoke test of the
script: its times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fastlayers
from fastlayers.rnn import _gpu_graphs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing.py
from timing import Timer  # noqa: E402  (CUDA events on the GPU, perf_counter elsewhere)

SIZES = {"seed": dict(features=512, hidden=256, batch=32, low=100, high=1000),
         "small": dict(features=6, hidden=5, batch=3, low=3, high=9)}


def draw_calls(count: int, size: dict, seed: int) -> list[tuple[int, torch.Tensor]]:
    """(T, lengths (B,) int64 on CPU) per call: T ~ U[low, high], lengths ~ U[T/2, T]."""
    rng = random.Random(seed)
    calls = []
    for _ in range(count):
        steps = rng.randint(size["low"], size["high"])
        calls.append((steps, torch.tensor([rng.randint(steps // 2, steps) for _ in range(size["batch"])])))
    return calls


def candidates(cell: str, size: dict, device: torch.device) -> dict:
    """name -> (module, fn(x (T, B, F), lengths) -> output (T, B, 2H))."""
    torch.manual_seed(0)
    theirs = getattr(nn, cell)(size["features"], size["hidden"], bidirectional=True, device=device)
    plain = getattr(fastlayers, cell)(size["features"], size["hidden"], bidirectional=True, device=device)
    ln = getattr(fastlayers, cell)(size["features"], size["hidden"], bidirectional=True, layer_norm=True,
                                   device=device)

    def packed(x, lengths):
        p = pack_padded_sequence(x, lengths, enforce_sorted=False)
        return pad_packed_sequence(theirs(p)[0], total_length=x.size(0))[0]

    return {f"torch.nn.{cell} packed (cuDNN)": (theirs, packed),
            f"fastlayers.{cell} plain, lengths": (plain, lambda x, lengths: plain(x, lengths=lengths)[0]),
            f"fastlayers.{cell} layer_norm, lengths": (ln, lambda x, lengths: ln(x, lengths=lengths)[0])}


def fwd_bwd(module, fn, x, lengths) -> bool:
    """One fwd+bwd; returns whether the engine's captured loops served it (they replayed)."""
    replays = _gpu_graphs.stats["replays"]
    xi = x.detach().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    fn(xi, lengths).float().sum().backward()
    return _gpu_graphs.stats["replays"] > replays


def timed_run(cands: dict, calls: list, warmup: int, x: torch.Tensor, timer: Timer) -> dict:
    """Every call for every candidate (interleaved, order rotated per call): summed ms of the timed
    calls, the engine's share of them, captures during warm-up and timed calls."""
    names = list(cands)
    res = {k: {"ms": 0.0, "engine_calls": 0} for k in names}
    before = dict(_gpu_graphs.stats)
    for i, (steps, lengths) in enumerate(calls):
        if i == warmup:
            res["_warmup_stats"] = {k: _gpu_graphs.stats[k] - before[k] for k in before}
            before = dict(_gpu_graphs.stats)
        for name in names[i % len(names):] + names[:i % len(names)]:
            module, fn = cands[name]
            served = []
            ms = timer(lambda: served.append(fwd_bwd(module, fn, x[:steps], lengths)))
            if i >= warmup:
                res[name]["ms"] += ms
                res[name]["engine_calls"] += served[0]
    res["_timed_stats"] = {k: _gpu_graphs.stats[k] - before[k] for k in before}
    return res


def peak_memory(module, fn, calls: list, x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """(peak MiB of these calls above what was allocated before them, MiB the captures hold after),
    starting from no captures."""
    if device.type != "cuda":
        for steps, lengths in calls:
            fwd_bwd(module, fn, x[:steps], lengths)
        return float("nan"), _gpu_graphs.holding(device)[1] / 2**20
    _gpu_graphs.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for steps, lengths in calls:
        fwd_bwd(module, fn, x[:steps], lengths)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20, _gpu_graphs.holding(device)[1] / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", choices=list(SIZES), default="seed")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--fixed-calls", type=int, default=10, help="calls at fixed T (the memory comparison)")
    p.add_argument("--chunk", type=int, default=_gpu_graphs.CHUNK, help="steps per captured chunk (rnn/_gpu_graphs.py)")
    p.add_argument("--only", default="", help="LSTM or GRU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
    _gpu_graphs.CHUNK = args.chunk
    size = SIZES[args.size]
    calls = draw_calls(args.warmup + args.calls, size, args.seed)
    fixed = draw_calls(args.fixed_calls, {**size, "low": size["high"]}, args.seed + 1)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(size["high"], size["batch"], size["features"], generator=g, device=device)
    timer = Timer(device)
    # on CPU: the Triton kernels under the interpreter, the graphs emulated (replays run the chunk)
    ctx = (lambda: contextlib.nullcontext()) if device.type == "cuda" else _emulated_triton
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter: times mean nothing)"
    print(f"# {name}; torch {torch.__version__}; triton {_triton_version()}; {args.size}: "
          f"F={size['features']}, H={size['hidden']}x2, B={size['batch']}, T ~ U[{size['low']}, {size['high']}], "
          f"lengths ~ U[T/2, T]; {args.warmup} warm-up + {args.calls} timed calls, fwd+bwd; TF32 "
          f"{'on' if args.tf32 else 'off'}; chunk {_gpu_graphs.CHUNK} steps")
    report: dict = {"device": name, "torch": torch.__version__, "triton": _triton_version(), "chunk": _gpu_graphs.CHUNK,
                    "rows": []}
    print(f"| candidate | fwd+bwd ms (sum of timed calls) | / cuDNN | calls on the engine | peak MiB random T | "
          f"peak MiB T={size['high']} | ratio | held MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for cell in ("LSTM", "GRU"):
        if args.only and args.only != cell:
            continue
        cands = candidates(cell, size, device)
        _gpu_graphs.clear()
        with ctx():
            res = timed_run(cands, calls, args.warmup, x, timer)
        base = res[f"torch.nn.{cell} packed (cuDNN)"]["ms"]
        for cand, (module, fn) in cands.items():
            with ctx():
                peak, held = peak_memory(module, fn, calls, x, device)
                peak_fixed, _ = peak_memory(module, fn, fixed, x, device)
            r = res[cand]
            row = {"candidate": cand, "ms": r["ms"], "ratio": r["ms"] / base, "engine_calls": r["engine_calls"],
                   "peak_mib": peak, "peak_fixed_mib": peak_fixed, "memory_ratio": peak / peak_fixed,
                   "held_mib": held}
            report["rows"].append(row)
            print(f"| {cand} | {r['ms']:.1f} | {row['ratio']:.2f} | {r['engine_calls']}/{args.calls} | {peak:.0f} | "
                  f"{peak_fixed:.0f} | {row['memory_ratio']:.2f} | {held:.0f} |")
        report[f"{cell}_stats"] = {"warmup": res["_warmup_stats"], "timed": res["_timed_stats"]}
        print(f"\n{cell} CUDA graphs (rnn/_gpu_graphs.py, the cell's candidates together): during the warm-up "
              f"{res['_warmup_stats']}, during the timed calls {res['_timed_stats']}\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


@contextlib.contextmanager
def _emulated_triton():
    with fastlayers.backend("triton"), _gpu_graphs.emulated():
        yield


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


if __name__ == "__main__":
    sys.exit(main())
