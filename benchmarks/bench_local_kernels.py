"""The locally connected C kernels alone (no autograd, output preallocated), seed-003 shape, fp32.

Prints min/median ms over 40 calls for 1 and 2 threads, next to a 64 MiB tensor copy.

    python benchmarks/bench_local_kernels.py
"""

from __future__ import annotations

import statistics
import time

import torch

from fastlayers._local_function import _lib


def timed(fn, n: int = 40) -> str:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return f"{min(times) * 1e3:.2f}/{statistics.median(times) * 1e3:.2f}"


def main() -> None:
    lib = _lib()
    assert lib is not None, "the C kernels did not build (no compiler?)"
    torch.manual_seed(0)
    x, w, b = torch.rand(32, 4, 256, 256), torch.rand(2, 4, 1, 1, 256, 256), torch.rand(2, 256, 256)
    dy = torch.rand(32, 2, 256, 256)
    y, dw, db = torch.empty(32, 2, 256, 256), torch.empty_like(w), torch.empty_like(b)
    geometry = (32, 4, 256, 256, 2, 1, 1, 256, 256, 1, 1, 1, 1)
    src = torch.rand(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    print("threads  forward ms (min/median)  param-grad ms  copy 64 MiB ms")
    for threads in (1, 2):
        fwd = timed(lambda: lib.lc2d_forward_f32(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), *geometry,
                                                 threads))
        bwd = timed(lambda: lib.lc2d_backward_params_f32(dy.data_ptr(), x.data_ptr(), dw.data_ptr(), db.data_ptr(),
                                                         *geometry, threads))
        print(f"{threads:7d}  {fwd:>23}  {bwd:>13}  {timed(lambda: dst.copy_(src)):>14}")


if __name__ == "__main__":
    main()
