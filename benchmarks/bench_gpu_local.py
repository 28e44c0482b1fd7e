"""Issue: locally connected layers and attention pooling on the GPU near the memory bound (Triton).

Every shape of the issue's table (fp32): x 32x4x256x256 1x1 -> 2; x 1024x4x256x256 1x1 -> 2 (seed
003's example, 1 GiB); x 32x4x256x256 3x3 pad 1 -> 2; x 64x16x64x64 3x3 pad 1 -> 32. Candidates,
timed interleaved with CUDA events (median after warm-up; x does not require grad, weight and
bias do): fastlayers (the Triton kernels), its plain-torch reference (one einsum per kernel
offset), broadcast-and-sum (1x1) or einsum over F.unfold (3x3). The memory floor: bytes that
must move (forward: read x, W, b, write y; backward: read x and dy, write dW and db) over the
device-to-device copy bandwidth measured in the same run. Also: the forward's extra memory
(max_memory_allocated) against the output's size, the host's time per forward call (Python and
launches, not waiting for the GPU) with the functions that take most of it (cProfile), the device
time per forward with the host out of the way (forwards captured in a CUDA graph and replayed),
the time per forward of 20 eager calls back to back, the module's host time with and without
fastlayers._triton._launch (Triton's own launch path), and the first call's time (Triton's
compile); with --sweep the device time of every forward block in SWEEP.
Then attention pooling at seed 001's shape (T=256, B=128, 32-d keys, 100-d values, lengths) for
each score, values requiring grad or not: fwd, fwd+bwd and their ratio.

    python benchmarks/bench_gpu_local.py [--device cuda] [--repeats 20] [--warmup 2] [--size seed|small]
                                         [--sweep] [--only-local]

``TRITON_INTERPRET=1 python benchmarks/bench_gpu_local.py --device cpu --size small`` runs the same
script on Triton's interpreter (a smoke test of the script only: its times mean nothing).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fastlayers
from fastlayers._triton import _launch, local as triton_local
from fastlayers.functional import locally_connected2d
from fastlayers.rnn import _gpu_graphs

from timing import Timer

# attention pooling candidates: the Triton kernels (the additive score runs torch ops under either),
# and the plain-torch path that CUDA tensors took before them
BACKENDS = {"triton": "fastlayers (Triton)", "reference": "plain torch ops (before)"}
SHAPES = {  # (batch, C, H, kernel, C_out)
    "seed": [(32, 4, 256, 1, 2), (1024, 4, 256, 1, 2), (32, 4, 256, 3, 2), (64, 16, 64, 3, 32)],
    "small": [(2, 2, 8, 1, 2), (2, 2, 8, 3, 3)],
}


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 10."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / (statistics.median(timer(lambda: dst.copy_(src)) for _ in range(10)) / 1e3)


def interleaved(candidates: dict, inputs: tuple, timer: Timer, repeats: int,
                warmup: int) -> dict[str, tuple[float, float]]:
    """name -> (median fwd ms, median fwd+bwd ms), candidates interleaved, order rotated, all on the
    same inputs (the 1 GiB shape took minutes when they were drawn on the host for every call)."""
    times = {k: ([], []) for k in candidates}
    names = list(candidates)
    x, w, b = inputs
    for rep in range(-warmup, repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            fn = candidates[name]
            fwd = timer(lambda: fn(x, w, b))
            w.grad = b.grad = None
            both = timer(lambda: fn(x, w, b).backward(torch.ones(1, device=x.device).expand(
                x.size(0), w.size(0), w.size(4), w.size(5))))
            if rep >= 0:
                times[name][0].append(fwd)
                times[name][1].append(both)
    return {k: (statistics.median(f), statistics.median(fb)) for k, (f, fb) in times.items()}


def unfold_einsum(x, w, b):
    o, c, kh, kw, oh, ow = w.shape
    cols = F.unfold(x, (kh, kw), padding=(kh // 2, kw // 2))
    return torch.einsum("bkl,okl->bol", cols, w.reshape(o, c * kh * kw, oh * ow)).view(x.size(0), o, oh, ow) + b


def broadcast_sum(x, w, b):
    return (x.unsqueeze(1) * w[:, :, 0, 0].unsqueeze(0)).sum(2) + b


def local_section(args, device, timer, bandwidth) -> None:
    print("| shape | candidate | fwd ms | fwd+bwd ms | fwd / floor | fwd+bwd / floor |\n|---|---|---:|---:|---:|---:|")
    for batch, chans, hw, k, out in SHAPES[args.size]:
        pad = k // 2
        elem = 4

        def ours(x, w, b):
            with fastlayers.backend("triton"):
                return locally_connected2d(x, w, b, 1, pad)

        g = torch.Generator(device).manual_seed(0)  # inputs drawn once per shape, on the device
        x = torch.rand(batch, chans, hw, hw, generator=g, device=device)
        w = (torch.rand(out, chans, k, k, hw, hw, generator=g, device=device) - 0.5).requires_grad_(True)
        b = (torch.rand(out, hw, hw, generator=g, device=device) - 0.5).requires_grad_(True)
        with fastlayers.backend("reference"):
            reference = locally_connected2d(x, w, b, 1, pad)
        torch.testing.assert_close(ours(x, w, b), reference, atol=1e-4, rtol=1e-4)
        candidates = {"fastlayers (Triton)": ours, ("broadcast-and-sum" if k == 1 else "einsum over unfold"):
                      broadcast_sum if k == 1 else unfold_einsum}
        def plain_reference(x, w, b):
            with fastlayers.backend("reference"):
                return locally_connected2d(x, w, b, 1, pad)

        candidates["fastlayers reference (einsum per offset)"] = plain_reference
        results = interleaved(candidates, (x, w, b), timer, args.repeats, args.warmup)
        x_b, w_b = batch * chans * hw * hw * elem, out * chans * k * k * hw * hw * elem
        y_b, b_b = batch * out * hw * hw * elem, out * hw * hw * elem
        fwd_floor = (x_b + w_b + b_b + y_b) / bandwidth * 1e3
        both_floor = fwd_floor + (x_b + y_b + w_b + b_b) / bandwidth * 1e3
        shape = f"x {batch}x{chans}x{hw}x{hw}, {k}x{k}, {out}"
        for name, (fwd, both) in results.items():
            print(f"| {shape} | {name} | {fwd:.3f} | {both:.3f} | {fwd / fwd_floor:.2f}x | {both / both_floor:.2f}x |")
        print(f"| {shape} | floor | {fwd_floor:.3f} | {both_floor:.3f} | | |")
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            with torch.no_grad():
                y = ours(x, w, b)
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - start
            print(f"forward extra memory {extra / 2**20:.1f} MiB, output {y.numel() * y.element_size() / 2**20:.1f} MiB")
        # the host's share: a forward's Python and launch time without waiting for the GPU; near the
        # fwd ms above, the small shapes measure the host, not the kernel
        with torch.no_grad():
            start_host = time.perf_counter()
            for _ in range(10):
                ours(x, w, b)
            host = (time.perf_counter() - start_host) / 10 * 1e3
        if device.type == "cuda":
            torch.cuda.synchronize()
        print(f"host time per forward call (no wait for the GPU): {host:.3f} ms")
        fast = module_host(x, w, b, k, pad, device)
        _launch.ENABLED = False
        try:
            triton_path = module_host(x, w, b, k, pad, device)
        finally:
            _launch.ENABLED = True
        print(f"host time per forward call of the LocallyConnected2d module, default backend (median of 5 rounds "
              f"of 20, no wait for the GPU inside a round): {fast:.3f} ms; with Triton's own launch path "
              f"(fastlayers._triton._launch off): {triton_path:.3f} ms")
        if device.type == "cuda":
            try:  # a diagnostic line: its failure is printed, and the shapes and attention still run
                graphed = f"{graph_forward(ours, x, w, b, timer):.3f} ms"
            except Exception as e:  # noqa: BLE001
                graphed = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"device time per forward (20 captured in a CUDA graph, replayed): {graphed}")
            print(f"time per forward, 20 eager no-grad calls back to back between two events: "
                  f"{back_to_back(ours, x, w, b, timer):.3f} ms")
            if args.sweep:
                print(tile_sweep(ours, x, w, b, timer, fwd_floor))
        print(host_profile(lambda: ours(x, w, b), calls=200 if device.type == "cuda" else 2))


def module_host(x, w, b, k: int, pad: int, device: torch.device, rounds: int = 5, calls: int = 20) -> float:
    """Milliseconds of host time per no-grad forward of the layer as users call it (the module, the
    backend chosen per call, no ``fastlayers.backend`` context), with the weights ``w``, ``b``:
    ``calls`` calls without waiting for the GPU, the median of ``rounds`` (the GPU drained between)."""
    layer = fastlayers.LocallyConnected2d(x.size(1), w.size(0), tuple(x.shape[2:]), kernel_size=k, padding=pad,
                                          device=device)
    times = []
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
        layer(x)  # warm-up
        for _ in range(rounds):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                layer(x)
            times.append((time.perf_counter() - start) / calls * 1e3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return statistics.median(times)


def back_to_back(fn, x, w, b, timer, calls: int = 20) -> float:
    """Milliseconds per forward of ``calls`` eager no-grad forwards between two CUDA events (the
    host's time overlaps the device's after the first), median of 5."""
    def loop() -> None:
        with torch.no_grad():
            for _ in range(calls):
                fn(x, w, b)

    loop()
    return statistics.median(timer(loop) for _ in range(5)) / calls


# forward blocks (sequences, rows, columns, output channels, warps) that --sweep times besides the
# default (output channels None: the default's)
SWEEP = [(16, 1, 64, None, 4), (8, 2, 64, None, 4), (16, 4, 64, None, 4), (16, 4, 64, None, 8), (32, 2, 64, None, 4),
         (32, 4, 64, None, 8), (16, 8, 64, None, 8), (8, 1, 64, 16, 8), (8, 1, 64, 16, 4), (8, 2, 64, 8, 4),
         (16, 1, 64, 8, 8)]


def tile_sweep(fn, x, w, b, timer, floor: float) -> str:
    """Device time per forward (graph_forward) of every block in SWEEP, the default's first."""
    out_ch = w.size(0)
    default = triton_local.forward_config(x.size(0), out_ch, w.size(4), w.size(5), w.size(2) * w.size(3))
    configs = {None: None}
    for cb, bh, bw, og, warps in SWEEP:
        config = (cb, bh, bw, min(og or default[3], triton_local.next_power_of_2(out_ch)), warps)
        if config != default:
            configs[config] = config
    rows = []
    for config in configs:
        triton_local.FORWARD_CONFIG = config
        try:
            ms = graph_forward(fn, x, w, b, timer)
            rows.append((ms, f"{config or f'{default} (default)'}: {ms * 1e3:.0f} us {ms / floor:.2f}x"))
        except Exception as e:  # noqa: BLE001
            rows.append((float("inf"), f"{config}: failed {type(e).__name__}"))
        finally:
            triton_local.FORWARD_CONFIG = None
    rows.sort(key=lambda r: r[0])
    return ("forward blocks (CB, BH, BW, OG, warps), device time per forward, x floor, fastest first: "
            + "; ".join(r for _, r in rows))


def graph_forward(fn, x, w, b, timer, calls: int = 20) -> float:
    """Milliseconds per forward with the host out of the way: ``calls`` forwards (no grad) captured in
    one CUDA graph, its replay timed (median of 5)."""
    def loop() -> None:
        with torch.no_grad():
            for _ in range(calls):
                fn(x, w, b)

    graph = _gpu_graphs.capture(loop, x.device)
    return statistics.median(timer(graph.replay) for _ in range(5)) / calls


def host_profile(fn, calls: int = 200, top: int = 8) -> str:
    """Where a forward's host time goes: the functions with the most own time over ``calls`` calls
    (no grad) under cProfile, microseconds per call (cProfile's overhead included). Each output is
    dropped before the next call, as in a loop of inference calls (kept, every call allocated a new
    block from the driver and new_empty took 50-100 us of the profile on the H200, 2026-11-26)."""
    def loop() -> None:
        for _ in range(calls):
            fn()

    profile = cProfile.Profile()
    with torch.no_grad():
        profile.runcall(loop)
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive, own s, cumulative s, ...)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return "host profile, own us per forward: " + "; ".join(
        f"{name} ({file.rsplit('/', 1)[-1]}:{line}) {own / calls * 1e6:.1f}" for (file, line, name), (_, _, own, _, *_) in rows)


def attention_section(args, device, timer) -> None:
    b, t, dk, dv = (128, 256, 32, 100) if args.size == "seed" else (4, 9, 4, 3)
    print("\n| score | values | candidate | fwd ms | fwd+bwd ms | fwd+bwd / fwd |\n|---|---|---|---:|---:|---:|")
    for score in ("dot", "scaled_dot", "additive"):
        pool = fastlayers.AttentionPooling(dk, score=score, device=device)
        for values_grad in (False, True):
            g = torch.Generator().manual_seed(0)
            q = torch.rand(b, dk, generator=g).to(device).requires_grad_(True)
            k = torch.rand(b, t, dk, generator=g).to(device).requires_grad_(True)
            v = torch.rand(b, t, dv, generator=g).to(device).requires_grad_(values_grad)
            lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
            times = {name: ([], []) for name in BACKENDS}
            for rep in range(-args.warmup, args.repeats):
                for name in BACKENDS:  # interleaved
                    with fastlayers.backend(name):
                        f = timer(lambda: pool(q, k, v, lengths))
                        bb = timer(lambda: pool(q, k, v, lengths)[0].sum().backward())
                    if rep >= 0:
                        times[name][0].append(f)
                        times[name][1].append(bb)
            for name, (fwds, boths) in times.items():
                fwd, both = statistics.median(fwds), statistics.median(boths)
                print(f"| {score} | {'grad' if values_grad else 'data'} | {BACKENDS[name]} | {fwd:.3f} | {both:.3f} | "
                      f"{both / fwd:.2f} |")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds before the timed ones (the dry run: 0)")
    p.add_argument("--size", default="seed", choices=sorted(SHAPES))
    p.add_argument("--sweep", action="store_true", help="time the forward tiles of SWEEP at every shape (CUDA)")
    p.add_argument("--only-local", action="store_true", help="skip attention pooling")
    args = p.parse_args()
    device = torch.device(args.device)
    timer = Timer(device)
    first = time.perf_counter()
    x = torch.rand(2, 2, 8, 8, device=device)
    w = torch.rand(2, 2, 3, 3, 8, 8, device=device, requires_grad=True)
    with fastlayers.backend("triton"):
        locally_connected2d(x, w, None, 1, 1).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"first call (Triton compiles the forward and both gradients): {time.perf_counter() - first:.1f} s")
    bandwidth = copy_bandwidth(device, timer, 1 << 30 if args.size == "seed" else 1 << 20)
    print(f"device copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    local_section(args, device, timer, bandwidth)
    if not args.only_local:
        attention_section(args, device, timer)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"torch {torch.__version__}, {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
