"""Issue: per-sequence lengths without the PackedSequence cliff. Seed shape, fp32, one process.

Runs the ``blstm`` workload of fastlayers.bench for LSTM (1 layer), GRU (1 layer) and LSTM
(2 layers): torch packed with lengths, torch padded (no lengths), fastlayers padded (no lengths)
and fastlayers with lengths, interleaved, median after warm-up; values and gradients are checked
against fastlayers-with-lengths evaluated in float64 (torch packed fp32 is cross-checked by it);
with ``--configs X:padded``, the padded calls against torch's padded call. Exits 1 when a check
fails (a flag the workload does not expect). ``--json`` refuses an existing file unless ``--overwrite``.

    python benchmarks/rnn/bench_rnn_lengths.py [--size seed|small] [--repeats 3] [--json out.json [--overwrite]]
    python benchmarks/rnn/bench_rnn_lengths.py --configs LSTM:padded,GRU:padded --repeats 11   # drop-in overhead
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

from fastlayers.bench import compare
from fastlayers.bench._workloads import blstm


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="seed", choices=["seed", "small"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the reports as JSON")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    p.add_argument("--configs", default="LSTM:1,GRU:1,LSTM:2")
    args = p.parse_args()
    if args.json and os.path.exists(args.json) and not args.overwrite:  # before minutes of measuring
        p.exit(2, f"bench_rnn_lengths.py: --json {args.json}: exists; pass --overwrite to replace it, or name "
                  f"another file\n")
    reports, failed = [], []
    for spec in args.configs.split(","):
        mode, layers = spec.split(":")
        if layers == "padded":  # no-lengths drop-in check only: same kernels, so more repeats are cheap
            w = blstm(args.size, mode=mode, with_loop=False)
            names = [f"torch.nn.{mode} padded (ignores lengths)", f"fastlayers.{mode} padded (ignores lengths)"]
            cands = {n: w.candidates[n] for n in names}
            control = f"torch.nn.{mode} padded, second copy (A/A control)"
            cands[control] = copy.deepcopy(w.candidates[names[0]])  # same code twice: the noise floor
            rep = compare(cands, w.make_inputs, repeats=args.repeats, warmup=1, memory=False,
                          workload=w.name + " without lengths")
            reports.append(rep)
            failed += [f"{r.name}: {r.failures()}" for r in rep.results if r.failures()]  # the same function
            print(rep.render())
            for which in ("forward", "forward_backward"):
                print(f"{rep.workload} {which}: fastlayers-padded / torch-padded = {rep.ratio(names[1], names[0], which):.3f}x"
                      f" (A/A control: torch copy / torch = {rep.ratio(control, names[0], which):.3f}x)")
            print(flush=True)
            continue
        w = blstm(args.size, mode=mode, num_layers=int(layers), with_loop=False)
        rep = compare(w.candidates, w.make_inputs, reference=w.reference, repeats=args.repeats, warmup=1,
                      memory=False, workload=w.name, anchor=w.anchor, expected=w.expected,
                      progress=lambda m: print("  ..", m, file=sys.stderr, flush=True))
        reports.append(rep)  # (the anchor and expected flags kept in the JSON: its ratios read back the same)
        failed += [f"{r.name}: {unexpected}" for r in rep.results
                   if (unexpected := rep.failed(r))]
        packed, padded = f"torch.nn.{mode} packed (lengths)", f"torch.nn.{mode} padded (ignores lengths)"
        ours, ours_padded = f"fastlayers.{mode} lengths", f"fastlayers.{mode} padded (ignores lengths)"
        print(rep.render(w.anchor))
        for which in ("forward", "forward_backward"):
            print(f"{w.name} {which}: packed / fastlayers-lengths = {rep.ratio(packed, ours, which):.1f}x faster; "
                  f"fastlayers-lengths / torch-padded = {rep.ratio(ours, padded, which):.2f}x; "
                  f"fastlayers-padded / torch-padded = {rep.ratio(ours_padded, padded, which):.3f}x")
        print(flush=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {reports[0].cpu}")
    status = 0
    if args.json:  # ("x": a file someone made during the run is not replaced without --overwrite)
        try:
            with open(args.json, "w" if args.overwrite else "x") as f:
                json.dump([json.loads(r.to_json()) for r in reports], f, indent=2)
        except OSError as e:  # (the tables above hold the numbers)
            why = "made during the run; pass --overwrite to replace it" if isinstance(e, FileExistsError) else ""
            print(f"bench_rnn_lengths.py: --json {args.json}: not written ({why or e.strerror or e})", file=sys.stderr)
            status = 1
    if failed:
        print(f"check failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
