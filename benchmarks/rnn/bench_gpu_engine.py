"""Issue 11: the recurrent engine on the GPU (Triton step kernels, cuBLAS GEMMs, CUDA graphs) vs cuDNN.

Seed shape (seed 000): BLSTM 512 -> 256 x 2 directions, T=800, B=32, fp32. Candidates, one process,
timed interleaved with CUDA events (median of --repeats after two warm-up rounds): torch.nn.LSTM /
GRU (cuDNN) padded and packed with lengths U[400, 800]; fastlayers with each cell option, without
and with lengths, each eagerly and with its time loops captured in CUDA graphs
(FASTLAYERS_CUDA_GRAPHS=1; 0 for eager); the seed's own way (one torch.lstm_cell call per step and direction).
The engine without options is called directly (the modules send plain calls to it only with CUDA
graphs and at some shapes, see --sweep). Columns: fwd ms,
fwd+bwd ms (input and every parameter require grad), ratio of fwd+bwd to cuDNN padded, peak memory
of fwd+bwd above what was allocated before the call (max_memory_allocated, MiB), first call
(compile / capture) ms. The CUDA-graph rows (FASTLAYERS_CUDA_GRAPHS=1, as the default) capture a
chunk of steps from the first call and replay it ceil(T / chunk) times (fastlayers.rnn._gpu_graphs);
every call here has the same T: bench_gpu_random_t.py draws a new T per call.

    python benchmarks/rnn/bench_gpu_engine.py [--device cuda] [--repeats 7] [--warmup 2] [--tf32] [--autocast bf16]
                                          [--size seed|small] [--only LABEL] [--profile]
    python benchmarks/rnn/bench_gpu_engine.py --sweep [--autocast bf16]
    python benchmarks/rnn/bench_gpu_engine.py --small-hidden [--cells LSTM,GRU]

``--sweep``: plain 2-direction LSTM and GRU (no cell options), the engine called directly with
CUDA graphs against torch.nn (cuDNN) at several shapes: the measurement behind the modules'
dispatch of plain calls on CUDA (fastlayers.rnn._modules, ``_plain_on_engine``).

``--small-hidden``: hidden sizes under cuDNN's persistent kernels (H in 32, 64, 128; B in 8, 32, 128;
T = 800; input_size = H; 2 directions; unpacked input, as torch picks the persistent algorithm
only there): torch.nn (cuDNN), the plain engine called directly and the LayerNorm layer, both with
CUDA graphs; us per time step beside each time.

TF32 is off for every candidate unless --tf32 (then torch's default for cuDNN RNNs and
torch.backends.cuda.matmul.allow_tf32 are on for all). ``TRITON_INTERPRET=1 python
benchmarks/rnn/bench_gpu_engine.py --device cpu --size small`` runs the script on Triton's interpreter
(a smoke test of the script only: its times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fastlayers
from fastlayers.rnn import _gpu_graphs
from fastlayers.rnn._gpu import gru_engine_gpu, lstm_engine_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing.py
from timing import Timer  # noqa: E402  (CUDA events on the GPU, perf_counter elsewhere)

SIZES = {"seed": (512, 256, 800, 32), "small": (6, 5, 5, 3)}  # input_size, hidden, T, B
OPTIONS = {  # label -> (cell, fastlayers kwargs)
    "LSTM layer_norm": ("LSTM", dict(layer_norm=True)),
    "LSTM layer_norm + peephole + cell_clip": ("LSTM", dict(layer_norm=True, peephole=True, cell_clip=3.0)),
    "LSTM zoneout (0.1, 0.1)": ("LSTM", dict(zoneout=(0.1, 0.1))),
    "LSTM recurrent_dropout 0.25 (training)": ("LSTM", dict(recurrent_dropout=0.25)),
    "LSTM proj_size H/2 + layer_norm": ("LSTM", dict(proj_size=0.5, layer_norm=True)),  # 128 at the seed
    "GRU layer_norm": ("GRU", dict(layer_norm=True)),
    "GRU zoneout 0.1": ("GRU", dict(zoneout=0.1)),
    # the engine without options, called directly (eagerly too: plain modules dispatch to the engine
    # only with CUDA graphs and only at some shapes, see --sweep)
    "LSTM no options (engine called directly)": ("LSTM", dict()),
    "GRU no options (engine called directly)": ("GRU", dict()),
}


def seed_loop(cells, x, lengths):
    """The seed's per-step loop: one torch.lstm_cell per step and direction, frozen past each length."""
    steps, batch, _ = x.shape
    outs = []
    for d, cell in enumerate(cells):
        h = x.new_zeros(batch, cell.hidden_size)
        c = x.new_zeros(batch, cell.hidden_size)
        ys = [None] * steps
        for t in (range(steps) if d == 0 else range(steps - 1, -1, -1)):
            alive = (t < lengths).unsqueeze(1)
            h1, c1 = cell(x[t], (h, c))
            h, c = torch.where(alive, h1, h), torch.where(alive, c1, c)
            ys[t] = torch.where(alive, h1, torch.zeros_like(h1))
        outs.append(torch.stack(ys))
    return torch.cat(outs, -1)


def candidates(args, device):
    features, hidden, steps, batch = SIZES[args.size]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(steps // 2, steps + 1, (batch,), generator=g)
    lengths[0] = steps
    lengths_dev = lengths.to(device)
    x = torch.randn(steps, batch, features, device=device)
    out = {}
    torch.manual_seed(0)
    lstm = nn.LSTM(features, hidden, bidirectional=True, device=device)
    gru = nn.GRU(features, hidden, bidirectional=True, device=device)

    def packed(module):
        def run(x):
            p = pack_padded_sequence(x, lengths, enforce_sorted=False)
            return pad_packed_sequence(module(p)[0], total_length=steps)[0]
        return run

    out["torch.nn.LSTM padded (cuDNN)"] = (lstm, lambda x: lstm(x)[0])
    out["torch.nn.LSTM packed, lengths"] = (lstm, packed(lstm))
    out["torch.nn.GRU padded (cuDNN)"] = (gru, lambda x: gru(x)[0])
    for label, (cell, kwargs) in OPTIONS.items():
        if args.only and args.only not in label:
            continue
        cls = fastlayers.LSTM if cell == "LSTM" else fastlayers.GRU
        if "proj_size" in kwargs:  # a fraction of the hidden size (so that --size small runs too)
            kwargs = {**kwargs, "proj_size": max(1, int(hidden * kwargs["proj_size"]))}
        m = cls(features, hidden, bidirectional=True, device=device, **kwargs)
        m.train("training" in label)
        for use_lengths in (False, True):
            for graphs in (False, True):
                name = f"fastlayers {label}" + (", lengths" if use_lengths else "") + \
                    (", CUDA graphs" if graphs else ", eager")
                out[name] = (m, _engine_call(m, use_lengths, lengths, graphs))
    cells = [nn.LSTMCell(features, hidden, device=device) for _ in range(2)]
    out["seed's loop: torch.lstm_cell per step, lengths"] = (nn.ModuleList(cells),
                                                             lambda x: seed_loop(cells, x, lengths_dev))
    return out, x


def _engine_call(m, use_lengths, lengths, graphs):
    direct = m.options.plain  # plain modules dispatch to cuDNN: call the engine itself
    engine = lstm_engine_gpu if m.mode == "LSTM" else gru_engine_gpu

    def run(x):
        os.environ[_gpu_graphs.ENV] = "1" if graphs else "0"
        if not direct:
            return m(x, lengths=lengths if use_lengths else None)[0]
        dirs = 2 if m.bidirectional else 1
        states = tuple(x.new_zeros(m.num_layers * dirs, x.size(1), size) for size in m._state_sizes())
        return engine(x, states, m._layer_parameters(), lengths if use_lengths else None, m.options,
                      dropout=m.dropout, training=m.training)[0]
    return run


SWEEP = [  # (T, B, input_size, hidden): the seed, then smaller and larger batches and hidden sizes
    (800, 32, 512, 256), (100, 16, 64, 64), (200, 64, 256, 128), (200, 128, 512, 512), (100, 256, 1024, 1024),
    (50, 512, 256, 256), (400, 8, 1024, 1024)]


def sweep(args, device, timer, autocast) -> int:
    """Plain LSTM / GRU: torch.nn (cuDNN) against the engine (CUDA graphs)."""
    shapes = SWEEP if device.type == "cuda" else [(7, 3, 6, 5)]
    os.environ[_gpu_graphs.ENV] = "1"
    print("| cell | T, B, F, H | cuDNN fwd ms | fastlayers fwd ms | cuDNN fwd+bwd ms | fastlayers fwd+bwd ms | "
          "fwd+bwd ratio |\n|---|---|---:|---:|---:|---:|---:|")
    for steps, batch, features, hidden in shapes:
        x = torch.randn(steps, batch, features, device=device)
        for cell in ("LSTM", "GRU"):
            torch.manual_seed(0)
            theirs = getattr(nn, cell)(features, hidden, bidirectional=True, device=device)
            ours = getattr(fastlayers, cell)(features, hidden, bidirectional=True, device=device)
            # the engine called directly: the module dispatches to it only where this measured it faster
            cands = {"cudnn": (theirs, lambda x, m=theirs: m(x)[0]), "ours": (ours, _engine_call(ours, False, None, True))}
            with fastlayers.backend("triton") if device.type != "cuda" else _null():
                res = measure(cands, x, timer, args.repeats, autocast, args.warmup)
            med = {k: (statistics.median(r["fwd"]), statistics.median(r["both"])) for k, r in res.items()}
            print(f"| {cell} | {steps}, {batch}, {features}, {hidden} | {med['cudnn'][0]:.2f} | {med['ours'][0]:.2f} | "
                  f"{med['cudnn'][1]:.2f} | {med['ours'][1]:.2f} | {med['ours'][1] / med['cudnn'][1]:.2f} |")
    return 0


SMALL_HIDDEN = [(800, batch, hidden, hidden) for hidden in (32, 64, 128) for batch in (8, 32, 128)]


def small_hidden(args, device, timer, autocast) -> int:
    """torch.nn (cuDNN persistent kernels at these sizes) against the plain engine and the LayerNorm
    layer, both with CUDA graphs."""
    shapes = SMALL_HIDDEN if device.type == "cuda" else [(7, 3, 6, 5)]
    os.environ[_gpu_graphs.ENV] = "1"
    print("| cell | T, B, F, H | cuDNN fwd ms | engine fwd ms | layer_norm fwd ms | cuDNN fwd+bwd ms | "
          "engine fwd+bwd ms | layer_norm fwd+bwd ms | engine x | layer_norm x | layer_norm us/step fwd+bwd |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for steps, batch, features, hidden in shapes:
        x = torch.randn(steps, batch, features, device=device)
        for cell in args.cells.split(","):
            torch.manual_seed(0)
            theirs = getattr(nn, cell)(features, hidden, bidirectional=True, device=device)
            ours = getattr(fastlayers, cell)(features, hidden, bidirectional=True, device=device)
            norm = getattr(fastlayers, cell)(features, hidden, bidirectional=True, layer_norm=True, device=device)
            cands = {"cudnn": (theirs, lambda x, m=theirs: m(x)[0]), "ours": (ours, _engine_call(ours, False, None, True)),
                     "ln": (norm, _engine_call(norm, False, None, True))}
            with fastlayers.backend("triton") if device.type != "cuda" else _null():
                res = measure(cands, x, timer, args.repeats, autocast, args.warmup)
            f = {k: statistics.median(r["fwd"]) for k, r in res.items()}
            b = {k: statistics.median(r["both"]) for k, r in res.items()}
            print(f"| {cell} | {steps}, {batch}, {features}, {hidden} | {f['cudnn']:.2f} | {f['ours']:.2f} | "
                  f"{f['ln']:.2f} | {b['cudnn']:.2f} | {b['ours']:.2f} | {b['ln']:.2f} | "
                  f"{b['ours'] / b['cudnn']:.2f} | {b['ln'] / b['cudnn']:.2f} | {b['ln'] * 1e3 / steps:.1f} |", flush=True)
    return 0


def measure(cands, x, timer, repeats, autocast, warmup):
    names = list(cands)
    res = {k: {"fwd": [], "both": [], "first": None, "peak": None} for k in names}
    device = x.device

    def ctx():
        return torch.autocast(device.type, autocast) if autocast else _null()

    for name in names:  # first call (Triton compile, CUDA graph capture)
        module, fn = cands[name]
        res[name]["first"] = timer(lambda: _both(fn, module, x, ctx))
    for rep in range(-warmup, repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            module, fn = cands[name]
            with torch.no_grad(), ctx():
                f = timer(lambda: fn(x))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            b = timer(lambda: _both(fn, module, x, ctx))
            if rep >= 0:
                res[name]["fwd"].append(f)
                res[name]["both"].append(b)
            if device.type == "cuda":  # above what was allocated before (earlier candidates' captures included)
                res[name]["peak"] = (torch.cuda.max_memory_allocated() - before) / 2**20
    return res


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _both(fn, module, x, ctx):
    xi = x.detach().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with ctx():
        y = fn(xi)
    y.float().sum().backward()


def profile(cands, x, device, autocast) -> int:
    """Per candidate (eager rows only: a replayed graph hides its kernels' names; not the seed's
    loop), the top kernels by device time in one fwd+bwd after a warm-up call, and their total."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    ctx = (lambda: torch.autocast(device.type, autocast)) if autocast else _null
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    for name, (module, fn) in cands.items():
        if "CUDA graphs" in name or name.startswith("seed's loop"):
            continue
        with fastlayers.backend("triton") if device.type != "cuda" and name.startswith("fastlayers") else _null():
            _both(fn, module, x, ctx)
            with torch_profile(activities=[activity]) as prof:
                _both(fn, module, x, ctx)
                if device.type == "cuda":
                    torch.cuda.synchronize()
        events = prof.key_averages()
        key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        rows = sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)
        total = sum(getattr(e, key, 0.0) for e in events) / 1e3
        print(f"\n## {name}: {total:.1f} ms {'device' if device.type == 'cuda' else 'CPU'} time in all")
        print("| kernel / op | calls | ms |\n|---|---:|---:|")
        for e in rows[:12]:
            print(f"| {e.key[:90]} | {e.count} | {getattr(e, key, 0.0) / 1e3:.2f} |")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after the first call (the dry run: 0)")
    p.add_argument("--size", choices=list(SIZES), default="seed")
    p.add_argument("--tf32", action="store_true")
    p.add_argument("--autocast", choices=["bf16", "fp16"], default=None)
    p.add_argument("--only", default="", help="run only the fastlayers rows whose label contains this")
    p.add_argument("--sweep", action="store_true", help="plain LSTM / GRU, cuDNN against the engine, several shapes")
    p.add_argument("--profile", action="store_true",
                   help="instead of timing: the device time per kernel of one eager fwd+bwd of each candidate "
                        "(torch.profiler), e.g. to see where a lengths row spends more than its no-lengths row")
    p.add_argument("--small-hidden", action="store_true",
                   help="H in 32..128, B in 8..128, T=800: cuDNN, the plain engine and the LayerNorm layer")
    p.add_argument("--cells", default="LSTM,GRU", help="with --small-hidden: the cell types")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.autocast]
    timer = Timer(device)
    if device.type == "cuda" and not os.environ.get(_gpu_graphs.MAX_MB):
        # every candidate keeps its captures between the interleaved rounds (30 GiB in all at the seed
        # shape on 2026-11-23): above the default limit, the oldest would be dropped and captured again
        os.environ[_gpu_graphs.MAX_MB] = str(torch.cuda.get_device_properties(device).total_memory * 3 // 4 // 2**20)
    if args.sweep:
        return sweep(args, device, timer, autocast)
    if args.small_hidden:
        return small_hidden(args, device, timer, autocast)
    cands, x = candidates(args, device)
    if args.profile:
        return profile(cands, x, device, autocast)
    if device.type != "cuda":  # the interpreter: Triton kernels on CPU tensors need the backend forced
        forced = {k: v for k, v in cands.items() if k.startswith("fastlayers")}
        with fastlayers.backend("triton"):
            res = measure(forced, x, timer, args.repeats, autocast, args.warmup)
    else:
        res = measure(cands, x, timer, args.repeats, autocast, args.warmup)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter: times mean nothing)"
    features, hidden, steps, batch = SIZES[args.size]
    print(f"# {name}; torch {torch.__version__}; BLSTM {features} -> {hidden}x2, T={steps}, B={batch}; "
          f"TF32 {'on' if args.tf32 else 'off'}; autocast {args.autocast}; median of {args.repeats}")
    base = res.get("torch.nn.LSTM padded (cuDNN)")
    base_ms = statistics.median(base["both"]) if base else None
    print("| candidate | fwd ms | fwd+bwd ms | fwd+bwd / cuDNN LSTM | peak extra MiB | first call ms |")
    print("|---|---|---|---|---|---|")
    for k, r in res.items():
        f, b = statistics.median(r["fwd"]), statistics.median(r["both"])
        ratio = f"{b / base_ms:.2f}" if base_ms else "-"
        peak = f"{r['peak']:.0f}" if r["peak"] is not None else "-"
        print(f"| {k} | {f:.1f} | {b:.1f} | {ratio} | {peak} | {r['first']:.0f} |")
    print(f"CUDA graphs: {_gpu_graphs.stats['captures']} captures, {_gpu_graphs.stats['evicted']} dropped at the "
          f"{os.environ.get(_gpu_graphs.MAX_MB, 'default')} MiB limit (dropped ones were captured again: their rows "
          "include captures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
