"""Issue: the recurrent engine at vendor speed. Seed shape (512 -> 256x2, T=800, B=32), fp32, one process.

Candidates (bidirectional, 1 layer): torch.nn.LSTM padded (vendor kernel, the anchor); the engine
with all options off (called directly: the module sends options off without lengths to torch's
kernel); through the public module API ``fastlayers.LSTM(..., layer_norm=True)(x)``; the same
LayerNorm-LSTM as a per-step loop through autograd (the users' way, ``lstm_reference``); the
module with layer_norm=True and lengths uniform in [400, 800], and the module with options off and
those lengths (the engine) next to the foundation's lengths path (segments of torch's fused
kernel, ``varlen_rnn``). First each pair that must agree is checked with the harness (float64,
repeats=1; a failed check exits 1 before any timing), then the timing runs interleaved
(check=False, since the candidates compute different functions).

    python benchmarks/rnn/bench_engine.py [--repeats 5] [--size seed|small]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import fastlayers
from fastlayers.bench import compare
from fastlayers.rnn import varlen_rnn
from fastlayers.rnn._cpu import gru_engine, lstm_engine
from fastlayers.rnn._reference import lstm_reference
from fastlayers.rnn._options import CellOptions


class Engine(nn.Module):
    """The engine (``lstm_engine`` / ``gru_engine`` by the module's mode, or ``impl``) on a fastlayers
    LSTM/GRU's parameters with ``options``, zero initial states; lengths passed or dropped."""

    def __init__(self, rnn, options: CellOptions, use_lengths: bool, impl=None) -> None:
        super().__init__()
        self.rnn, self.options, self.use_lengths = rnn, options, use_lengths
        self.impl = impl or (lstm_engine if rnn.mode == "LSTM" else gru_engine)

    def forward(self, x, lengths):
        zeros = x.new_zeros(self.rnn.num_layers * 2, x.size(1), self.rnn.hidden_size)
        states = (zeros, zeros) if self.rnn.mode == "LSTM" else (zeros,)
        return self.impl(x, states, self.rnn._layer_parameters(), lengths if self.use_lengths else None,
                         self.options, training=True)[0]


class Module(nn.Module):
    """The public module API: ``rnn(x, lengths=lengths)[0]`` (lengths passed or dropped)."""

    def __init__(self, rnn, use_lengths: bool) -> None:
        super().__init__()
        self.rnn, self.use_lengths = rnn, use_lengths

    def forward(self, x, lengths):
        return self.rnn(x, lengths=lengths if self.use_lengths else None)[0]


class Segments(nn.Module):
    """The foundation's lengths path (torch's fused kernel per run of equal active counts) on a
    bidirectional fastlayers LSTM/GRU's weights."""

    def __init__(self, rnn) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x, lengths):
        zeros = x.new_zeros(self.rnn.num_layers * 2, x.size(1), self.rnn.hidden_size)
        states = (zeros, zeros) if self.rnn.mode == "LSTM" else (zeros,)
        return varlen_rnn(x, states, self.rnn._flat_weights, lengths, mode=self.rnn.mode, has_biases=True,
                          num_layers=self.rnn.num_layers, bidirectional=True, batch_first=False, dropout=0.0,
                          training=True)[0]


class Vendor(nn.Module):
    def __init__(self, lstm: nn.LSTM) -> None:
        super().__init__()
        self.rnn = lstm

    def forward(self, x, lengths):
        return self.rnn(x)[0]


def setup(cls_torch, cls_ours, argv=None):
    """Arguments, the seed (or small) shape, vendor / plain / layer_norm modules with shared weights, inputs."""
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--size", default="seed", choices=["seed", "small"])
    args = p.parse_args(argv)
    d, h, t, b = (512, 256, 800, 32) if args.size == "seed" else (16, 8, 20, 4)
    torch.manual_seed(0)
    vendor = cls_torch(d, h, bidirectional=True)
    plain = cls_ours(d, h, bidirectional=True)
    plain.load_state_dict(vendor.state_dict())
    ln = cls_ours(d, h, bidirectional=True, layer_norm=True)
    ln.load_state_dict(vendor.state_dict(), strict=False)

    def make_inputs():
        g = torch.Generator().manual_seed(0)
        return {"x": torch.rand(t, b, d, generator=g).requires_grad_(True),
                "lengths": torch.randint(t // 2, t + 1, (b,), generator=g)}

    return args, (d, h, t, b), vendor, plain, ln, make_inputs


def say(message: str) -> None:
    print("  ..", message, file=sys.stderr, flush=True)


def check_pairs(candidates: dict, pairs, make_inputs) -> list[str]:
    """Check each pair of ``candidates`` that must compute the same function with the harness
    (float64 reference: the pair's first), print the errors, and return the failures (empty: all agree)."""
    failed = []
    for pair in pairs:
        chk = compare({k: candidates[k] for k in pair}, make_inputs, repeats=1, warmup=0, memory=False,
                      workload="check " + " vs ".join(pair), progress=say)
        print(f"check vs {pair[0]} in float64: " + "; ".join(
            f"{r.name}: max rel err output {r.output_error:.1e}, gradients "
            f"{max(r.grad_errors.values(), default=0.0):.1e}, flags {r.flags or 'none'}" for r in chk.results),
            flush=True)
        failed += [f"{r.name}: {r.failures()}" for r in chk.results if r.failures()]
    if failed:
        print(f"check failed (not timed): {'; '.join(failed)}", file=sys.stderr)
    return failed


def main() -> int:
    args, (d, h, t, b), vendor, plain, ln, make_inputs = setup(nn.LSTM, fastlayers.LSTM)
    off, lnopt = CellOptions(), ln.options
    candidates = {
        "torch.nn.LSTM padded (vendor)": Vendor(vendor),
        "engine, options off": Engine(plain, off, False),
        "fastlayers.LSTM(layer_norm=True)": Module(ln, False),
        "LayerNorm-LSTM per-step autograd loop": Engine(ln, lnopt, False, impl=lstm_reference),
        "fastlayers.LSTM(layer_norm=True) + lengths": Module(ln, True),
        "fastlayers.LSTM + lengths (engine)": Module(plain, True),
        "segment path + lengths": Segments(plain),
    }
    # correctness at this shape, before any timing: pairs that compute the same function
    checks = {"LayerNorm-LSTM per-step autograd loop + lengths": Engine(ln, lnopt, True, impl=lstm_reference),
              **candidates}
    if check_pairs(checks, (("torch.nn.LSTM padded (vendor)", "engine, options off"),
                            ("LayerNorm-LSTM per-step autograd loop", "fastlayers.LSTM(layer_norm=True)"),
                            ("LayerNorm-LSTM per-step autograd loop + lengths",
                             "fastlayers.LSTM(layer_norm=True) + lengths"),
                            ("segment path + lengths", "fastlayers.LSTM + lengths (engine)")), make_inputs):
        return 1
    rep = compare(candidates, make_inputs, repeats=args.repeats, warmup=1, check=False, memory=True,
                  workload=f"engine (BLSTM {d} -> {h}x2, T={t}, B={b})", progress=say)
    print(rep.render("torch.nn.LSTM padded (vendor)"))
    anchor = "torch.nn.LSTM padded (vendor)"
    for name in list(candidates)[1:]:
        print(f"{name}: fwd+bwd {rep.ratio(name, anchor):.2f}x vendor, fwd {rep.ratio(name, anchor, 'forward'):.2f}x; "
              f"peak {rep[name].peak_memory_bytes / 2**20:.0f} MiB vs vendor {rep[anchor].peak_memory_bytes / 2**20:.0f} MiB")
    print(f"per-step loop / engine layer_norm (fwd+bwd): "
          f"{rep.ratio('LayerNorm-LSTM per-step autograd loop', 'fastlayers.LSTM(layer_norm=True)'):.1f}x")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rep.cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
