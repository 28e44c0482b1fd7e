"""Seed-shape speed of the native library this tree loads (issue 64: a package variant against the
run-time build of earlier commits): LayerNorm LSTM and plain LSTM with lengths (fastlayers) against
torch.nn.LSTM padded, fwd+bwd and no-grad forward, medians of REPEATS after one warm-up, one JSON
line. The candidates run interleaved, the order rotated every round (as the harness does: none
always follows the same one), gradients cleared outside the timed calls. Run it with each tree on
PYTHONPATH (or FASTLAYERS_CPU_CAPABILITY per variant), alternating.

    PYTHONPATH=src python benchmarks/rnn/bench_native_variant.py [REPEATS]
"""
import argparse
import json
import statistics
import sys
import time

import torch

import fastlayers

T, B, F, H = 800, 32, 512, 256


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("repeats", nargs="?", type=int, default=5, metavar="REPEATS",
                   help="timed rounds after one warm-up (default: %(default)s)")
    reps = p.parse_args().repeats
    torch.manual_seed(0)
    x = torch.randn(T, B, F)
    lengths = torch.randint(400, 801, (B,))
    lengths[0] = T
    ln = fastlayers.LSTM(F, H, bidirectional=True, layer_norm=True)
    plain = fastlayers.LSTM(F, H, bidirectional=True)
    anchor = torch.nn.LSTM(F, H, bidirectional=True)

    def fb(call):
        xi = x.clone().requires_grad_()
        y = call(xi)
        y.sum().backward()

    def fwd(call):
        with torch.no_grad():
            call(x)

    cands = {"torch padded": lambda v: anchor(v)[0], "LN lengths": lambda v: ln(v, lengths=lengths)[0],
             "plain lengths": lambda v: plain(v, lengths=lengths)[0]}
    modules = (ln, plain, anchor)
    names = list(cands)
    out = {}
    for mode, runner in (("fb", fb), ("fwd", fwd)):
        for name, c in cands.items():
            runner(c)
        times = {name: [] for name in cands}
        for rep in range(reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                for m in modules:  # (untimed: no call times the accumulation into earlier gradients)
                    m.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                runner(cands[name])
                times[name].append(time.perf_counter() - t0)
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        for n in ("LN lengths", "plain lengths"):
            out[f"{mode} {n} ms"] = round(med[n], 1)
            out[f"{mode} {n} x torch"] = round(med[n] / med["torch padded"], 3)
        out[f"{mode} torch ms"] = round(med["torch padded"], 1)
    from fastlayers import _native

    out["native"] = _native.describe() if hasattr(_native, "describe") else "runtime build (-march=native)"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
