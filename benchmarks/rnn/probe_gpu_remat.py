"""Issue 67, deliverable 4: where ``checkpoint_every`` spends its time on the Triton engine.

Seed sizes (``LSTM(512, 256, bidirectional=True, layer_norm=True)``, B = 32, T = --steps), without
lengths and with lengths U[T/2, T]: fwd+bwd time of the layer with checkpoint_every None, "auto",
100, 200 and T (one segment), interleaved in one process, median of 5 after 2 untimed calls,
``x without`` against the run without the option; the allocator's peak beyond the call's start
(after those calls, so the captured loops' buffers that the run without the option keeps between
calls are not in it: hold fresh-process figures, ``bench_remat.py``, against a memory bar). Each
configuration twice: the loops' clock set by a host copy (the library's) and by two device fills.
On CUDA, then: torch.profiler's counts of launches, copies and synchronizations in one "auto" call
with lengths (and one without the option), the synchronizing operations that
``torch.cuda.set_sync_debug_mode("warn")`` reports in that call, and the input gradient of both
clock variants compared.

    python benchmarks/rnn/probe_gpu_remat.py [--device cuda] [--steps 800]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import fastlayers
from fastlayers.rnn import _gpu_graphs

ORIGINAL = _gpu_graphs._set_clock


def filled(clock: torch.Tensor, first: int, steps: int) -> None:
    clock[0].fill_(first)
    clock[1].fill_(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=800)
    args = parser.parse_args()
    dev, steps = args.device, args.steps
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.randn(steps, 32, 512, device=dev, requires_grad=True)
    lens = torch.randint(steps // 2, steps + 1, (32,), generator=torch.Generator().manual_seed(0))
    lens[0] = steps
    models = {}
    for every in (None, "auto", 100, 200, steps):
        torch.manual_seed(0)
        models[every] = fastlayers.LSTM(512, 256, bidirectional=True, layer_norm=True, checkpoint_every=every,
                                        device=dev)

    def call(m, lengths):
        y, _ = m(x, lengths=lengths)
        y.sum().backward()

    rows = []
    for lengths in (None, lens):
        for clock in ("copy", "fill"):
            _gpu_graphs._set_clock = ORIGINAL if clock == "copy" else filled
            times: dict = {k: [] for k in models}
            for m in models.values():
                call(m, lengths)
                call(m, lengths)
            for _ in range(5):
                for k, m in models.items():
                    sync()
                    t = time.perf_counter()
                    call(m, lengths)
                    sync()
                    times[k].append(time.perf_counter() - t)
            peaks = {}
            if cuda:
                for k, m in models.items():
                    sync()
                    torch.cuda.reset_peak_memory_stats()
                    start = torch.cuda.memory_allocated()
                    call(m, lengths)
                    sync()
                    peaks[k] = (torch.cuda.max_memory_allocated() - start) / 2**30
            base = statistics.median(times[None])
            for k in models:
                med = statistics.median(times[k])
                rows.append((lengths is not None, clock, k, med * 1e3, med / base, peaks.get(k, float("nan"))))
    _gpu_graphs._set_clock = ORIGINAL
    where = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{where}, torch {torch.__version__}; LSTM(layer_norm) 512 -> 256 x 2, T = {steps}, B = 32; fwd+bwd "
          "median of 5 (interleaved) after 2; peak: allocator, beyond the call's start")
    print("| lengths | clock | checkpoint_every | ms | x without | peak GiB |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {'U[T/2, T]' if r[0] else 'none'} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.2f} | {r[5]:.3f} |")
    if cuda:
        _profile(models, call, lens, sync)
    grads = []
    for setter in (ORIGINAL, filled):
        _gpu_graphs._set_clock = setter
        x.grad = None
        call(models["auto"], lens)
        grads.append(x.grad.clone())
    _gpu_graphs._set_clock = ORIGINAL
    print("input gradient, clock by copy against by fills, max abs diff:", float((grads[0] - grads[1]).abs().max()))


def _profile(models: dict, call, lens: torch.Tensor, sync) -> None:
    from torch.profiler import ProfilerActivity, profile

    names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernel",
             "cudaGraphLaunch", "Memcpy HtoD (Pageable -> Device)", "Memcpy DtoD (Device -> Device)", "aten::item")
    for every in ("auto", None):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call(models[every], lens)
            sync()
        averages = prof.key_averages()
        print(f"\nprofile, checkpoint_every={every}, lengths U[T/2, T], one fwd+bwd:")
        for e in averages:
            if e.key in names:
                print(f"  {e.key}: count {e.count}, host {e.cpu_time_total / 1e3:.2f} ms")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(models["auto"], lens)
            sync()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    count = sum("synchronizing" in str(w.message) for w in caught)
    print(f"synchronizing operations (set_sync_debug_mode), checkpoint_every='auto', lengths: {count}")


if __name__ == "__main__":
    main()
