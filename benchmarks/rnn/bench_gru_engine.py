"""Issue: the recurrent engine — GRU options at the seed shape (512 -> 256x2, T=800, B=32), fp32, one process.

Candidates (bidirectional, 1 layer, x requires grad): torch.nn.GRU padded (vendor kernel, the
anchor); the engine with all options off (called directly); through the module API
``fastlayers.GRU(..., layer_norm=True)``, without and with lengths uniform in [400, 800]. First
the engine with options off is checked against torch.nn.GRU in float64 (a failed check exits 1
before any timing), then the timing runs interleaved (check=False: the candidates compute
different functions).

    python benchmarks/rnn/bench_gru_engine.py [--repeats 5] [--size seed|small]
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import fastlayers
from fastlayers.bench import compare
from fastlayers.rnn._options import CellOptions

from bench_engine import (  # the same shapes, modules, inputs and check as the LSTM engine bench
    Engine, Module, Vendor, check_pairs, say, setup)


def main() -> int:
    args, (d, h, t, b), vendor, plain, ln, make_inputs = setup(nn.GRU, fastlayers.GRU)
    anchor = "torch.nn.GRU padded (vendor)"
    candidates = {
        anchor: Vendor(vendor),
        "engine GRU, options off": Engine(plain, CellOptions(), False),
        "fastlayers.GRU(layer_norm=True)": Module(ln, False),
        "fastlayers.GRU(layer_norm=True) + lengths": Module(ln, True),
    }
    if check_pairs(candidates, ((anchor, "engine GRU, options off"),), make_inputs):
        return 1
    rep = compare(candidates, make_inputs, repeats=args.repeats, warmup=1, check=False, memory=True,
                  workload=f"GRU engine (BGRU {d} -> {h}x2, T={t}, B={b})", progress=say)
    print(rep.render(anchor))
    for name in list(candidates)[1:]:
        print(f"{name}: fwd+bwd {rep.ratio(name, anchor):.2f}x vendor, fwd {rep.ratio(name, anchor, 'forward'):.2f}x; "
              f"peak {rep[name].peak_memory_bytes / 2**20:.0f} MiB vs vendor {rep[anchor].peak_memory_bytes / 2**20:.0f} MiB")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rep.cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
