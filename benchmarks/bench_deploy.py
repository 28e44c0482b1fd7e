"""Deployed forward at the seed shape: an AOTInductor package of fastlayers' LSTM against the eager
layer (issue 39: the package's forward at most 1.1x eager).

The seed's BLSTM (input 512, hidden 256 per direction, 2 layers, bidirectional), T=800, B=32,
lengths uniform in [400, 800], float32, torch.no_grad(); plain and with layer_norm=True. Both run in
this one process, interleaved, medians after warm-up; the package is compiled here first (export
with dynamic batch and time, torch._inductor.aoti_compile_and_package).

    python benchmarks/bench_deploy.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch.export import Dim

import fastlayers
from fastlayers._core.system import cpu_name


def _median(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(800, 32, 512)
    lengths = torch.randint(400, 801, (32,))
    lengths[0] = 800
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; T=800, B=32, 512 -> 256x2, "
          f"2 layers, lengths in [400, 800]; forward, medians of {args.repeats} after 2 warm-up calls")
    for name, options in (("LSTM", {}), ("LSTM(layer_norm=True)", {"layer_norm": True})):
        model = fastlayers.LSTM(512, 256, num_layers=2, bidirectional=True, **options).eval()
        ep = torch.export.export(model, (x,), {"lengths": lengths},
                                 dynamic_shapes={"input": {0: Dim("T"), 1: Dim("B")}, "lengths": {0: Dim("B")}})
        with tempfile.TemporaryDirectory() as tmp:
            package = torch._inductor.aoti_load_package(
                torch._inductor.aoti_compile_and_package(ep, package_path=f"{tmp}/model.pt2"))
        with torch.no_grad():
            eager, aoti = (lambda: model(x, lengths=lengths)), (lambda: package(x, lengths=lengths))
            for fn in (eager, aoti, eager, aoti):
                fn()
            check = max(float((a - b).abs().max()) for a, b in zip(torch.utils._pytree.tree_leaves(aoti()),
                                                                    torch.utils._pytree.tree_leaves(eager())))
            times = {"eager": [], "aoti": []}
            for _ in range(args.repeats):
                times["eager"].append(_median(eager, 1))
                times["aoti"].append(_median(aoti, 1))
        e, a = statistics.median(times["eager"]), statistics.median(times["aoti"])
        print(f"{name}: eager {e * 1e3:.0f} ms, AOTInductor package {a * 1e3:.0f} ms, {a / e:.2f}x eager "
              f"(max abs difference {check:.1e})")


if __name__ == "__main__":
    main()
