"""The GPU engine's per-step recurrent product (fastlayers._triton.step_matmul) against torch.bmm,
and the seed's layers by elements of K per slice: the measurements behind step_matmul's choices.

1. Per step, 800 steps captured in one CUDA graph (CUDA events around its replay, median of 7),
   the seed's shapes (D=2, B=32, H=256, fp32, TF32 off): the forward's product h (D, B, H) @ W_hh^T
   (K=H, N=4H LSTM / 3H GRU) with W_hh^T as a transposed view (as the engine passed it to
   torch.bmm before) or contiguous; the backward's dr (D, B, G) @ W_hh (K=G, N=H), torch.bmm and
   the Triton kernel in 1 and in G/128 slices (reading its step from device data, as the engine's
   loops do). Each candidate's result is checked against torch.bmm.
2. The seed's LayerNorm LSTM / GRU fwd+bwd (CUDA graphs from the first call; CUDA events, median of
   7 after two warm-up calls) for each K_PER_SLICE.

    python benchmarks/rnn/bench_gpu_step_matmul.py          # CUDA only
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import torch

import fastlayers
from fastlayers._triton import step_matmul
from fastlayers.rnn import _gpu_graphs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared timing.py
from timing import Timer  # noqa: E402  (CUDA events on the GPU, perf_counter elsewhere)

DEV = torch.device("cuda")


def _events(fn, repeats=7, warmup=2) -> float:
    """Median milliseconds of fn() between CUDA events, after warm-up calls."""
    timer = Timer(DEV)
    return statistics.median([timer(fn) for _ in range(warmup + repeats)][warmup:])


def _per_step_us(step, steps: int) -> float:
    """Microseconds per call of step(s), s = 0..steps-1, all captured in one CUDA graph (as the
    engine captures its loops, fastlayers.rnn._gpu_graphs.capture)."""
    def loop() -> None:
        for s in range(steps):
            step(s)

    return _events(_gpu_graphs.capture(loop, DEV).replay) / steps * 1e3


def products() -> None:
    steps, dirs, batch, hidden = 800, 2, 32, 256
    print("| cell | product | candidate | us per step | max abs diff vs torch.bmm |\n|---|---|---|---:|---:|")
    for cell, gsize in (("LSTM", 4 * hidden), ("GRU", 3 * hidden)):
        g = torch.Generator(DEV).manual_seed(0)
        hd = torch.randn(dirs, steps, batch, hidden, generator=g, device=DEV)
        dr = torch.randn(dirs, steps, batch, gsize, generator=g, device=DEV)
        w = torch.randn(dirs, gsize, hidden, generator=g, device=DEV) / 16
        w_view, w_t = w.transpose(1, 2), w.transpose(1, 2).contiguous()
        r = torch.empty(dirs, batch, gsize, device=DEV)
        parts = {n: torch.empty(n, dirs, batch, hidden, device=DEV) for n in (1, step_matmul.slices(gsize))}
        gbuf = torch.empty(dirs, batch, hidden, device=DEV)
        clock = torch.tensor([0, steps], dtype=torch.int32, device=DEV)  # the Triton rows read step 0 + s
        rows = [
            ("forward", "torch.bmm, W_hh^T a transposed view", lambda s: torch.bmm(hd[:, s], w_view, out=r),
             lambda: r, torch.bmm(hd[:, 3], w_view)),
            ("forward", "torch.bmm, W_hh^T contiguous", lambda s: torch.bmm(hd[:, s], w_t, out=r), lambda: r,
             torch.bmm(hd[:, 3], w_view)),
            ("forward", "Triton, W_hh^T contiguous", lambda s: step_matmul.matmul(hd, w_t, r, (clock, s)), lambda: r,
             torch.bmm(hd[:, 3], w_view)),
            ("backward", "torch.bmm", lambda s: torch.bmm(dr[:, s], w, out=gbuf), lambda: gbuf,
             torch.bmm(dr[:, 3], w)),
        ]
        for n, buf in parts.items():
            rows.append(("backward", f"Triton, {n} slice(s)",
                         lambda s, buf=buf: step_matmul.matmul(dr, w, buf, (clock, s)), lambda buf=buf: buf.sum(0),
                         torch.bmm(dr[:, 3], w)))
        for product, name, step, result, want in rows:
            step(3)
            diff = (result() - want).abs().max().item()
            print(f"| {cell} | {product} | {name} | {_per_step_us(step, steps):.2f} | {diff:.1e} |")


def slices() -> None:
    os.environ[_gpu_graphs.ENV] = "1"
    print("\n| layer (seed shape, layer_norm, CUDA graphs) | K_PER_SLICE | backward slices | fwd+bwd ms |\n"
          "|---|---:|---:|---:|")
    default = step_matmul.K_PER_SLICE
    for cell in ("LSTM", "GRU"):
        torch.manual_seed(0)
        m = getattr(fastlayers, cell)(512, 256, bidirectional=True, layer_norm=True, device=DEV)
        x = torch.randn(800, 32, 512, device=DEV, requires_grad=True)
        for per_slice in (64, 128, 256, 1024):
            step_matmul.K_PER_SLICE = per_slice
            ms = _events(lambda: m(x)[0].sum().backward())
            print(f"| {cell} | {per_slice} | {step_matmul.slices((4 if cell == 'LSTM' else 3) * 256)} | {ms:.2f} |")
        step_matmul.K_PER_SLICE = default


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; fp32, TF32 off")
    products()
    slices()
    return 0


if __name__ == "__main__":
    sys.exit(main())
