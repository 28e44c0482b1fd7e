"""checkpoint_every (issue 40): peak memory and time of one forward + backward, each candidate in a
fresh process (peak RSS from getrusage, so no run sees another's pages; with --device cuda the
allocator's peak), seed sizes (512 -> 256 x 2 directions), float32. Time: the median of --calls
calls after one warm-up call (--calls 1 for the long scaling runs).

Candidates: fastlayers.LSTM(layer_norm=True) with and without checkpoint_every; torch.nn.LSTM;
and the anchor a user writes by hand: torch.nn.LSTM over chunks of the sequence under
torch.utils.checkpoint with the state carried (one direction per chunk loop; the reverse
direction runs over the flipped sequence, so the batch has no padding here).

"memory beyond" = peak RSS minus the RSS after the inputs, the output-sized gradient and the model
were allocated and touched and one call at T = 4 ran (what the run adds: activations, kept states,
work space, and the output and its gradient; not what any first call sets up once, about 80 MiB
for every candidate, torch.nn.LSTM included, which the JSON's "beyond_cold_gib" still holds).

    python benchmarks/rnn/bench_remat.py --steps 800 --batch 32 [--every 28] [--json FILE] [--device cuda]
    python benchmarks/rnn/bench_remat.py --scaling 1000,4000,16000,100000 --batch 8 --with-torch --calls 1 [--max-gib 18]

Then (not with --scaling) the time ratio of the layer with and without the option measured side by
side in one process, calls interleaved, median of --side-calls: the figure the time bar is read
from (a fresh process per row varies by about 10% from run to run on the 2-core machine); beside it
the floor of any exact recomputation that keeps no per-step activation: the same segments run as
plain calls of the layer without the option (a no-grad forward of each, then each one's forward +
backward), with no bookkeeping.

With --scaling a run whose peak RSS, scaled linearly in T from the largest T measured of the same
candidate, would exceed --max-gib is not run; its row gives the scaled peak and time instead. A
torch.nn.LSTM run that cuDNN refuses (CUDNN_STATUS_NOT_SUPPORTED: at T = 100,000, B = 8 on the
H200) gets the same scaled row, marked refused; a failure of any other run, or of ours, fails the
script (exit 1).

    python benchmarks/rnn/bench_remat.py --device cuda --steps 800 --batch 32 --sweep none,auto,32,64,128,200,400,800

times each checkpoint_every value in ONE process instead (on CUDA with the allocator's peak beyond
what the process held before the call).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_PROBE = r"""
import json, resource, sys, time
import torch
import fastlayers
from torch.utils.checkpoint import checkpoint
name, steps, batch, every, device, calls = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
                                             int(sys.argv[6]))
every = None if every == "none" else (every if every == "auto" else int(every))
torch.manual_seed(0)
if name == "torch":
    model = torch.nn.LSTM(512, 256, bidirectional=True)
elif name == "torch-checkpointed":
    model = torch.nn.ModuleList([torch.nn.LSTM(512, 256), torch.nn.LSTM(512, 256)])
else:
    model = fastlayers.LSTM(512, 256, bidirectional=True, layer_norm=True, checkpoint_every=every)
cuda = device == "cuda"
if cuda:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
model = model.to(device)
x = torch.randn(steps, batch, 512, device=device, requires_grad=True)
grad = torch.randn(steps, batch, 512, device=device)
def rss():  # CPU: the process's peak RSS; CUDA: the allocator's peak
    if cuda:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss in KiB)
def now():
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()
def flat(r):
    return r[0], r[1][0], r[1][1]
def chunked(lstm, x, k):
    h0 = x.new_zeros(1, x.size(1), 256)
    c0 = torch.zeros_like(h0)
    outs = []
    for s in range(0, x.size(0), k):
        y, h0, c0 = checkpoint(lambda xs, h, c: flat(lstm(xs, (h, c))), x[s:s + k], h0, c0, use_reentrant=False)
        outs.append(y)
    return torch.cat(outs)
def run(x, grad):
    if name == "torch-checkpointed":
        k = max(1, round(steps ** 0.5)) if every in (None, "auto") else every
        fwd = chunked(model[0], x, k)
        bwd = chunked(model[1], x.flip(0), k).flip(0)
        y = torch.cat([fwd, bwd], -1)
    else:
        y = model(x)[0]
    y.backward(grad)
    x.grad = None
    for p in model.parameters():
        p.grad = None
cold = None if cuda else rss()
if not cuda:  # one call at T = 4 first: what any first call sets up once (libraries, thread pools, allocator
    # arenas: about 80 MiB, torch.nn.LSTM's too) is then in the base, not in the run's memory
    run(torch.randn(4, batch, 512, requires_grad=True), torch.randn(4, batch, 512))
base = torch.cuda.memory_allocated() / 2**30 if cuda else rss()
times = []
for _ in range(1 + calls):  # the first call warms up (kernel caches, pools); the median of the others
    t0 = now(); run(x, grad); times.append(now() - t0)
later = sorted(times[1:])
print(json.dumps({"name": name, "steps": steps, "batch": batch, "every": every, "first_s": times[0],
                  "second_s": later[len(later) // 2], "times_s": times, "peak_gib": rss(),
                  "beyond_gib": rss() - base, "base_gib": base,
                  "beyond_cold_gib": None if cuda else rss() - cold}))
"""

_SIDE = r"""
import json, statistics, sys, time
import torch
import fastlayers
from fastlayers.rnn._remat import segment_length
steps, batch, every, calls = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
every = every if every == "auto" else int(every)
k = segment_length(every, steps, 2, batch)  # as the C kernels' engine takes it
torch.manual_seed(0)
plain = fastlayers.LSTM(512, 256, bidirectional=True, layer_norm=True)
remat = fastlayers.LSTM(512, 256, bidirectional=True, layer_norm=True, checkpoint_every=every)
remat.load_state_dict(plain.state_dict())
x = torch.randn(steps, batch, 512, requires_grad=True)
grad = torch.randn(steps, batch, 512)
def whole(model):
    model(x)[0].backward(grad)
def floor(model):  # the same work with no recomputation bookkeeping: a no-grad forward of every
    # segment, then each segment's forward + backward as a plain call of the layer without the option
    # (each its own leaf: slices of x would accumulate a whole-sequence gradient per segment)
    segments = [x[s:s + k].detach().requires_grad_() for s in range(0, steps, k)]
    with torch.no_grad():
        for part in segments:
            model(part)
    for s, part in zip(range(0, steps, k), segments):
        model(part)[0].backward(grad[s:s + k])
def call(run, model):
    x.grad = None
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    run(model)
    return time.perf_counter() - t0
times = {"plain": [], "remat": [], "floor": []}
for i in range(1 + calls):  # interleaved; the first round warms up
    for name, run, model in (("plain", whole, plain), ("remat", whole, remat), ("floor", floor, plain)):
        t = call(run, model)
        if i:
            times[name].append(t)
med = {name: statistics.median(v) for name, v in times.items()}
print(json.dumps({"steps": steps, "batch": batch, "every": every, "k": k, "times_s": times, "median_s": med,
                  "ratio": med["remat"] / med["plain"], "floor_ratio": med["floor"] / med["plain"]}))
"""


_SWEEP = r"""
import json, statistics, sys, time
import torch
import fastlayers
steps, batch, values, device, calls = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4], int(sys.argv[5])
dev = torch.device(device)
cuda = dev.type == "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
torch.manual_seed(0)
model = fastlayers.LSTM(512, 256, bidirectional=True, layer_norm=True).to(dev)
x = torch.randn(steps, batch, 512, device=dev, requires_grad=True)
grad = torch.randn(steps, batch, 512, device=dev)
def sync():
    if cuda:
        torch.cuda.synchronize()
def call():
    x.grad = None
    model.zero_grad(set_to_none=True)
    sync()
    t0 = time.perf_counter()
    model(x)[0].backward(grad)
    sync()
    return time.perf_counter() - t0
for value in values:
    model.checkpoint_every = None if value == "none" else value if value == "auto" else int(value)
    call()  # warm-up (compiles, captures)
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = [call() for _ in range(calls)]
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    print(json.dumps({"every": value, "median_s": statistics.median(times), "times_s": times,
                      "peak_beyond_start_gib": peak}), flush=True)
"""


def sweep(steps: int, batch: int, values: str, device: str, calls: int) -> list[dict]:
    """fwd+bwd time (and on CUDA the allocator's peak beyond what the process held before the call:
    activations, the output and the gradients) for each checkpoint_every in ``values``, one process."""
    proc = subprocess.run([sys.executable, "-c", _SWEEP, str(steps), str(batch), values, device, str(calls)],
                          capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        rows.append({"error": (proc.stderr.strip().splitlines() or ["?"])[-1]})
    return rows


def side_by_side(steps: int, batch: int, every: str, calls: int) -> dict:
    """The time of the layer with and without checkpoint_every in ONE process, calls interleaved."""
    proc = subprocess.run([sys.executable, "-c", _SIDE, str(steps), str(batch), every, str(calls)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def one(name: str, steps: int, batch: int, every: str, device: str = "cpu", calls: int = 3) -> dict:
    proc = subprocess.run([sys.executable, "-c", _PROBE, name, str(steps), str(batch), every, device, str(calls)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"name": name, "steps": steps, "batch": batch, "every": every,
                "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--every", default="auto")
    parser.add_argument("--calls", type=int, default=3, help="timed calls after one warm-up call (median)")
    parser.add_argument("--side-calls", type=int, default=9,
                        help="the time ratio with / without the option, both in one process, interleaved (0: off)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the GPU engine; memory is the CUDA allocator's peak, not RSS (fp32, TF32 off)")
    parser.add_argument("--scaling", default=None, help="comma-separated T values (fastlayers with and without)")
    parser.add_argument("--with-torch", action="store_true", help="torch.nn.LSTM at each --scaling T too")
    parser.add_argument("--max-gib", type=float, default=18.0,
                        help="--scaling: skip a run whose peak, scaled from a smaller T, would exceed this")
    parser.add_argument("--json", default=None)
    parser.add_argument("--sweep", default=None,
                        help="comma-separated checkpoint_every values (none, auto, ints) timed in ONE process at "
                             "--steps, --batch (median of --calls after one), instead of the table")
    args = parser.parse_args()
    import torch

    if args.sweep:
        rows = sweep(args.steps, args.batch, args.sweep, args.device, args.calls)
        where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
        print(f"# torch {torch.__version__}, {where}; fastlayers.LSTM(512, 256, bidirectional, layer_norm), "
              f"T={args.steps}, B={args.batch}, fwd+bwd float32, one process, median of {args.calls} after one")
        print("| checkpoint_every | s (fwd+bwd) | x without | peak beyond the call's start GiB |\n|---|---:|---:|---:|")
        plain = next((r["median_s"] for r in rows if r.get("every") == "none"), None)
        for r in rows:
            if "error" in r:
                print(f"failed: {r['error']}")
                continue
            ratio = f"{r['median_s'] / plain:.2f}" if plain else ""
            peak = "" if r["peak_beyond_start_gib"] is None else f"{r['peak_beyond_start_gib']:.3f}"
            print(f"| {r['every']} | {r['median_s']:.4f} | {ratio} | {peak} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        sys.exit(1 if any("error" in r for r in rows) else 0)

    where = (torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads")
    print(f"# torch {torch.__version__}, {where}; fwd+bwd float32, 512 -> 256 x 2, "
          f"fresh process per row; times: median of {args.calls} calls after one; memory: "
          f"{'CUDA allocator peak' if args.device == 'cuda' else 'peak RSS'}")
    peak = "peak allocated GiB" if args.device == "cuda" else "peak RSS GiB"
    print(f"| candidate | T | B | checkpoint_every | s (fwd+bwd) | {peak} | beyond inputs GiB | beyond, cold GiB |\n"
          "|---|---:|---:|---|---:|---:|---:|---:|")
    rows = []
    if args.scaling:
        plan = []
        for steps in map(int, args.scaling.split(",")):
            plan += [("fastlayers", steps, "none"), ("fastlayers", steps, args.every)]
            if args.with_torch:
                plan.append(("torch", steps, "none"))
    else:
        plan = [("fastlayers", args.steps, "none"), ("fastlayers", args.steps, args.every), ("torch", args.steps, "none"),
                ("torch-checkpointed", args.steps, args.every)]
    measured: dict[tuple[str, str], dict] = {}  # the largest T run so far per (candidate, every)
    for name, steps, every in plan:
        label = {"fastlayers": "fastlayers.LSTM(layer_norm=True)", "torch": "torch.nn.LSTM",
                 "torch-checkpointed": "torch.nn.LSTM chunks under torch.utils.checkpoint"}[name]
        last = measured.get((name, every))
        if last is not None:  # peak scaled linearly in T from the largest T measured: skip what cannot fit
            need = last["base_gib"] * steps / last["steps"] + last["beyond_gib"] * steps / last["steps"]
            if need > args.max_gib:
                rows.append({"name": name, "steps": steps, "batch": args.batch, "every": every, "skipped": True,
                             "scaled_peak_gib": need, "scaled_s": last["second_s"] * steps / last["steps"]})
                print(f"| {label} | {steps} | {args.batch} | {every} | not run: about {need:.0f} GiB scaled from "
                      f"T = {last['steps']} (over --max-gib {args.max_gib:g}); about "
                      f"{last['second_s'] * steps / last['steps']:.0f} s | | | |", flush=True)
                continue
        row = one(name, steps, args.batch, every, args.device, args.calls)
        if name == "torch" and "CUDNN_STATUS_NOT_SUPPORTED" in row.get("error", "") and last is not None:
            # the anchor where cuDNN refuses T: the figure from the largest T it ran, scaled (not our failure)
            need = (last["base_gib"] + last["beyond_gib"]) * steps / last["steps"]
            rows.append({"name": name, "steps": steps, "batch": args.batch, "every": every, "skipped": True,
                         "refused": row["error"], "scaled_peak_gib": need,
                         "scaled_s": last["second_s"] * steps / last["steps"]})
            print(f"| {label} | {steps} | {args.batch} | {every} | refused by cuDNN (CUDNN_STATUS_NOT_SUPPORTED); "
                  f"about {need:.0f} GiB and {last['second_s'] * steps / last['steps']:.0f} s scaled from "
                  f"T = {last['steps']} | | | |", flush=True)
            continue
        rows.append(row)
        if "error" not in row:
            measured[(name, every)] = row
        if "error" in row:
            print(f"| {label} | {steps} | {args.batch} | {every} | failed: {row['error']} | | | |")
        else:
            cold = "" if row.get("beyond_cold_gib") is None else f"{row['beyond_cold_gib']:.2f}"
            print(f"| {label} | {steps} | {args.batch} | {row['every']} | {row['second_s']:.2f} | "
                  f"{row['peak_gib']:.2f} | {row['beyond_gib']:.2f} | {cold} |", flush=True)
    if not args.scaling and args.device == "cpu" and args.side_calls:
        side = side_by_side(args.steps, args.batch, args.every, args.side_calls)
        rows.append({"side_by_side": side})
        if "error" in side:
            rows.append({"error": side["error"]})
            print(f"side by side: failed: {side['error']}")
        else:
            print(f"\nside by side in one process (interleaved, median of {args.side_calls} after one round): "
                  f"without {side['median_s']['plain']:.3f} s, checkpoint_every={args.every} "
                  f"{side['median_s']['remat']:.3f} s: {side['ratio']:.2f}x; the floor (k = {side['k']}: a no-grad "
                  f"forward of every segment, then each one's forward + backward, as plain calls) "
                  f"{side['median_s']['floor']:.3f} s: {side['floor_ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if any("error" in row for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
