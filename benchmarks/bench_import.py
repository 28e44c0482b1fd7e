"""What ``import fastlayers`` adds to ``import torch`` (issue 43: at most 0.3 s).

Each run is a fresh interpreter that times ``import torch`` and then ``import fastlayers`` (both in
that one process, with time.perf_counter) and reports which heavy modules the second import
pulled in; the table gives medians over the runs.

    python benchmarks/bench_import.py [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_PROBE = """
import json, sys, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
before = set(sys.modules)
import fastlayers; t2 = time.perf_counter()
heavy = sorted(m for m in ("torch._dynamo", "torch._inductor", "triton", "matplotlib", "rich", "tqdm", "sympy")
               if m in sys.modules and m not in before)
print(json.dumps({"torch": t1 - t0, "fastlayers": t2 - t1, "heavy": heavy}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    runs = [json.loads(subprocess.run([sys.executable, "-c", _PROBE], check=True, capture_output=True,
                                      text=True).stdout) for _ in range(args.runs)]
    torch_s = statistics.median(r["torch"] for r in runs)
    ours_s = statistics.median(r["fastlayers"] for r in runs)
    heavy = sorted({m for r in runs for m in r["heavy"]})
    print(f"import torch: {torch_s:.3f} s; import fastlayers after it: +{ours_s:.3f} s "
          f"(median of {args.runs} fresh processes); heavy modules it imported: {', '.join(heavy) or 'none'}")


if __name__ == "__main__":
    main()
