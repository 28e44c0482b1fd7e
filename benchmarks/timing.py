"""The benchmarks' shared clock: :class:`Timer`, elapsed milliseconds of a callable (CUDA events on
the GPU, perf_counter elsewhere); :func:`median_seconds` of a CPU call. Family benchmarks in
subfolders import it with the folder above them on ``sys.path``."""

from __future__ import annotations

import statistics
import time

import torch


class Timer:
    """Elapsed milliseconds of a callable: CUDA events on the GPU, perf_counter elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3



def median_seconds(call, repeats: int) -> float:
    """The median wall time in seconds of ``repeats`` calls after one (perf_counter: CPU work)."""
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
