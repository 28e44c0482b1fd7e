"""Deterministic training on the GPU (issue 67, deliverable 3): with
``torch.use_deterministic_algorithms(True)``, two runs of two training steps from the same seed
give bitwise-equal outputs, parameter gradients and input gradients, for every cell option
(recurrent dropout and zoneout drawn in training mode, inter-layer dropout, lengths); and what the
deterministic mode costs: fwd+bwd time with it on against off, calls interleaved in one process.

    python benchmarks/rnn/bench_gpu_deterministic.py [--device cuda] [--size seed|small] [--repeats 7]
    TRITON_INTERPRET=1 python benchmarks/rnn/bench_gpu_deterministic.py --device cpu --size small   # interpreter

cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` for deterministic results (torch raises without it under
deterministic algorithms); this script sets ``:4096:8`` before torch starts CUDA, as a user must.
Exit 1 when any pair differs by a single bit (NaNs compared by their bits) or a result is not finite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import fastlayers  # noqa: E402
from fastlayers.rnn._gpu_graphs import ENV as GRAPHS  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing.py
from timing import Timer  # noqa: E402  (CUDA events on the GPU, perf_counter elsewhere)

SIZES = {"seed": (512, 256, 800, 32), "small": (6, 5, 7, 3)}  # input_size, hidden, T, B
OPTIONS = {
    "LSTM layer_norm": ("LSTM", dict(layer_norm=True)),
    "LSTM layer_norm + peephole + cell_clip": ("LSTM", dict(layer_norm=True, peephole=True, cell_clip=3.0)),
    "LSTM zoneout (0.1, 0.2)": ("LSTM", dict(zoneout=(0.1, 0.2))),
    "LSTM recurrent_dropout 0.25": ("LSTM", dict(recurrent_dropout=0.25)),
    "LSTM proj_size H/2 + layer_norm": ("LSTM", dict(proj_size=0.5, layer_norm=True)),
    "LSTM 2 layers, dropout 0.3, layer_norm + zoneout": ("LSTM", dict(num_layers=2, dropout=0.3, layer_norm=True,
                                                                      zoneout=0.1)),
    "GRU layer_norm": ("GRU", dict(layer_norm=True)),
    "GRU zoneout 0.1": ("GRU", dict(zoneout=0.1)),
    "GRU recurrent_dropout 0.2": ("GRU", dict(recurrent_dropout=0.2)),
    "GRU zoneout 0.1 + recurrent_dropout 0.2": ("GRU", dict(zoneout=0.1, recurrent_dropout=0.2)),
    "GRU layer_norm + zoneout 0.1 + recurrent_dropout 0.2": ("GRU", dict(layer_norm=True, zoneout=0.1,
                                                                         recurrent_dropout=0.2)),
}


def build(label, features, hidden, device):
    cell, kwargs = OPTIONS[label]
    if "proj_size" in kwargs:
        kwargs = {**kwargs, "proj_size": max(1, int(hidden * kwargs["proj_size"]))}
    cls = fastlayers.LSTM if cell == "LSTM" else fastlayers.GRU
    return cls(features, hidden, bidirectional=True, device=device, **kwargs).train()


def run(label, size, device, seed=0, steps=2):
    """Two SGD steps (lr 0.1, a mean loss over the output and the final states) from ``seed`` (the
    module as constructed); every output, parameter gradient and input gradient of both steps, on
    the host, by name."""
    features, hidden, t, batch = SIZES[size]
    torch.manual_seed(seed)
    m = build(label, features, hidden, device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(max(1, t // 2), t + 1, (batch,), generator=g)
    lengths[0] = t
    seen = []
    for i in range(steps):
        x = torch.randn(t, batch, features, generator=g).to(device).requires_grad_(True)
        y, state = m(x, lengths=lengths.to(device))
        w = torch.randn(y.shape, generator=g).to(device)
        loss = (y * w).mean() + sum(s.mean() for s in (state if isinstance(state, tuple) else (state,)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        seen += [(f"step {i} output", y.detach().cpu()), (f"step {i} input grad", x.grad.cpu())]
        seen += [(f"step {i} {name} grad", p.grad.cpu()) for name, p in m.named_parameters()]
        opt.step()
    return seen


def bitwise_equal(a, b) -> bool:
    """Same dtype, shape and bytes (NaNs compare by their bits, unlike torch.equal)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def time_both(label, size, device, repeats):
    """Median fwd+bwd ms with deterministic algorithms off and on, interleaved."""
    features, hidden, t, batch = SIZES[size]
    m = build(label, features, hidden, device)
    x = torch.randn(t, batch, features, device=device, requires_grad=True)
    lengths = torch.full((batch,), t, device=device)
    times = {False: [], True: []}

    def once():
        y = m(x, lengths=lengths)[0]
        y.sum().backward()

    timer = Timer(device)
    for rep in range(-2, repeats):
        for mode in (False, True) if rep % 2 == 0 else (True, False):
            torch.use_deterministic_algorithms(mode)
            ms = timer(once)
            if rep >= 0:
                times[mode].append(ms)
    torch.use_deterministic_algorithms(False)
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", choices=list(SIZES), default="seed")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", default="", help="only the option sets whose label contains this")
    p.add_argument("--runs", type=int, default=2, help="runs compared with the first (each two training steps)")
    p.add_argument("--graphs", choices=["on", "off", "both"], default="on",
                   help="the engine's CUDA graphs (FASTLAYERS_CUDA_GRAPHS): on as users get them, off, or both rows")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"# {name}; torch {torch.__version__}; F, H, T, B = {SIZES[args.size]}; 2 directions; lengths; "
          f"training mode; fp32, TF32 off")
    print(f"| option set | CUDA graphs | bitwise equal ({args.runs} runs x 2 steps) | fwd+bwd ms, deterministic off "
          "| on | on / off |")
    print("|---|---|---|---:|---:|---:|")
    bad = 0
    with fastlayers.backend("triton") if device.type != "cuda" else torch.enable_grad():
        for label in OPTIONS:
            if args.only and args.only not in label:
                continue
            for graphs in (("1", "0") if args.graphs == "both" else ("0",) if args.graphs == "off" else ("1",)):
                os.environ[GRAPHS] = graphs
                torch.use_deterministic_algorithms(True)
                first = run(label, args.size, device)
                differ = []
                for _ in range(args.runs - 1):
                    again = run(label, args.size, device)
                    differ += [f"{n} (max {(u - v).abs().max().item():.1e})"
                               for (n, u), (_, v) in zip(first, again) if not bitwise_equal(u, v)]
                torch.use_deterministic_algorithms(False)
                finite = all(bool(torch.isfinite(t).all()) for _, t in first)
                bad += bool(differ) or not finite
                off, on = time_both(label, args.size, device, args.repeats)
                print(f"| {label} | {'on' if graphs == '1' else 'off'} | {'yes' if not differ else 'NO'}"
                      f"{'' if finite else ' (not finite)'} | {off:.1f} | "
                      f"{on:.1f} | {on / off:.2f} |", flush=True)
                if differ:
                    print(f"  differing: {'; '.join(dict.fromkeys(differ))}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
