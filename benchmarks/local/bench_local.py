"""Issue: locally connected layers near the memory bound. Seed-003 shape, fp32, one process.

1. kernel 1x1 (x 32x4x256x256 NCHW, 2 output channels, weight and bias require grad, x not):
   the ``local2d`` workload (fastlayers vs the einsum formulations and the seed's cat-of-sums),
   plus the memory floor: bytes that must move over the copy bandwidth measured in this run
   (before and after the comparison; the higher of the two, which gives the stricter ratio).
2. kernel 3x3 (padding 1): fastlayers vs einsum over F.unfold.

Exits 1 when a candidate fails its value or gradient check (a flag the workload does not expect).

    python benchmarks/local/bench_local.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from fastlayers.bench import compare
from fastlayers.bench._workloads import local2d
from fastlayers.functional import locally_connected2d


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 10) -> float:
    """Bytes per second moved by a large tensor copy (read + write counted)."""
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times[1:])


def unfold_einsum(x, weight, bias):
    o, c, kh, kw, oh, ow = weight.shape
    cols = F.unfold(x, (kh, kw), padding=(kh // 2, kw // 2))  # (B, C*KH*KW, L)
    y = torch.einsum("bkl,okl->bol", cols, weight.reshape(o, c * kh * kw, oh * ow))
    return y.view(x.size(0), o, oh, ow) + bias


def failures(rep) -> list[str]:
    """The candidates of ``rep`` that fail their check (a failure flag the report does not expect), named."""
    return [f"{r.name}: {bad}" for r in rep.results if (bad := rep.failed(r))]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    say = lambda m: print("  ..", m, file=sys.stderr, flush=True)  # noqa: E731

    w = local2d("seed")
    bw_before = copy_bandwidth()
    rep = compare(w.candidates, w.make_inputs, repeats=args.repeats, warmup=2, workload=w.name, anchor=w.anchor,
                  expected=w.expected, progress=say)
    bw_after = copy_bandwidth()
    # measured before and after the comparison; the higher one gives the lower floor, i.e. the
    # stricter ratio for the candidates
    bw = max(bw_before, bw_after)
    print(rep.render(w.anchor))
    x_bytes, w_bytes, y_bytes = 32 * 4 * 256 * 256 * 4, 2 * 4 * 256 * 256 * 4, 32 * 2 * 256 * 256 * 4
    b_bytes = 2 * 256 * 256 * 4
    fwd_floor = (x_bytes + w_bytes + b_bytes + y_bytes) / bw
    bwd_floor = (x_bytes + y_bytes + w_bytes + b_bytes) / bw  # read x, dy; write dW, db
    ours, anchor = rep["fastlayers locally_connected2d"], rep[w.anchor]
    print(f"copy bandwidth {bw_before / 1e9:.1f} GB/s before, {bw_after / 1e9:.1f} GB/s after; with the higher, floors: forward {fwd_floor * 1e3:.2f} ms, "
          f"forward+backward {(fwd_floor + bwd_floor) * 1e3:.2f} ms")
    print(f"fastlayers vs '{w.anchor}': forward {anchor.forward_median / ours.forward_median:.2f}x faster, "
          f"forward+backward {anchor.forward_backward_median / ours.forward_backward_median:.2f}x faster")
    print(f"fastlayers vs floor: forward {ours.forward_median / fwd_floor:.2f}x, "
          f"forward+backward {ours.forward_backward_median / (fwd_floor + bwd_floor):.2f}x")
    print(f"fastlayers peak memory of fwd+bwd {ours.peak_memory_bytes / 2**20:.1f} MiB; output alone "
          f"{y_bytes / 2**20:.1f} MiB")

    # forward-only extra memory for kernel 1 (no unfold copies): allocations during one forward
    from torch.profiler import ProfilerActivity, profile

    inputs = w.make_inputs()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        locally_connected2d(inputs["x"], inputs["weight"].view(2, 4, 1, 1, 256, 256), inputs["bias"])
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    print(f"kernel 1x1 forward: {allocated / 2**20:.1f} MiB allocated in total (output {y_bytes / 2**20:.1f} MiB)")

    # 3x3 kernel, padding 1, vs einsum over unfold
    def make3():
        g = torch.Generator().manual_seed(0)
        return {"x": torch.rand(32, 4, 256, 256, generator=g),
                "weight": (torch.rand(2, 4, 3, 3, 256, 256, generator=g) - 0.5).requires_grad_(True),
                "bias": (torch.rand(2, 256, 256, generator=g) - 0.5).requires_grad_(True)}

    rep3 = compare({"einsum over unfold": unfold_einsum,
                    "fastlayers locally_connected2d": lambda x, weight, bias: locally_connected2d(x, weight, bias, 1, 1)},
                   make3, repeats=max(3, args.repeats // 2), warmup=1, workload="local2d 3x3 (pad 1)", progress=say)
    print(rep3.render())
    print(f"3x3: fastlayers vs einsum over unfold: forward {rep3.ratio('einsum over unfold', 'fastlayers locally_connected2d', 'forward'):.2f}x "
          f"faster, forward+backward {rep3.ratio('einsum over unfold', 'fastlayers locally_connected2d'):.2f}x faster")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rep.cpu}")
    failed = failures(rep) + failures(rep3)
    if failed:
        print(f"check failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
