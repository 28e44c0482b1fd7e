"""Variable-length batches without padding (issue 66): the varlen form (``cu_seqlens``) against
the padded call with lengths, one process, side by side.

Seed sizes (512 -> 256 x 2 directions), B sequences whose lengths are log-normal (sigma 0.9, scaled
so the longest is T_MAX; max/mean about 4 at B = 32), float32, forward + backward with the input
requiring grad. Memory: the peak bytes allocated during one call that starts from the per-sequence
tensors (a data loader's output): the padded batch or the concatenation built inside it, the layer,
the backward (the torch profiler's allocation records, as ``fastlayers.bench``; the engine's buffer
pool emptied first; on CUDA after one untimed call of each, so that no row holds the first call's
CUDA graph captures; the last columns add the bytes of the captured loops' buffers that call left
held between calls, which the allocator's peak of a replaying call leaves out). Time: medians of
interleaved fwd+bwd calls on inputs built once.

    python benchmarks/rnn/bench_varlen.py [--batch 32] [--t-max 1600] [--repeats 5] [--plain] [--checkpoint]
                                          [--cell lstm|gru] [--device cpu|cuda]

``--checkpoint`` adds a third row: the varlen call of the same layer with ``checkpoint_every="auto"``
(recomputation: the saved activations of the time loop traded for a second forward). ``--cell gru``
runs the GRU (default: the LSTM).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fastlayers
from fastlayers._core.system import cpu_name
from fastlayers.bench._harness import peak_bytes
from fastlayers.rnn import _gpu_graphs


def lognormal_lengths(batch: int, t_max: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(0.9 * torch.randn(batch, generator=g, dtype=torch.float64))
    lengths = (raw / raw.max() * t_max).round().clamp(min=1).to(torch.int64)
    return lengths.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--t-max", type=int, default=1600)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plain", action="store_true", help="the layer without options (default: layer_norm=True)")
    parser.add_argument("--cell", default="lstm", choices=("lstm", "gru"))
    parser.add_argument("--checkpoint", action="store_true", help="also the varlen call with checkpoint_every='auto'")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (memory: the allocator's peak)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    lengths = lognormal_lengths(args.batch, args.t_max)
    parts = [torch.randn(n, 512, device=device) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    layer = getattr(fastlayers, args.cell.upper())
    rnn = layer(512, 256, bidirectional=True, layer_norm=not args.plain, device=device)

    def padded_call(x=None):
        x = torch.nn.utils.rnn.pad_sequence(parts).requires_grad_() if x is None else x
        y, _ = rnn(x, lengths=torch.tensor(lengths, device=device))
        y.sum().backward()

    def varlen_call(x=None):
        x = torch.cat(parts).requires_grad_() if x is None else x
        y, _ = rnn(x, cu_seqlens=cu)
        y.sum().backward()

    calls = {"padded + lengths": padded_call, "varlen (cu_seqlens)": varlen_call}
    if args.checkpoint:
        remat = layer(512, 256, bidirectional=True, layer_norm=not args.plain, checkpoint_every="auto",
                                device=device)
        remat.load_state_dict(rnn.state_dict())

        def remat_call(x=None):
            x = torch.cat(parts).requires_grad_() if x is None else x
            y, _ = remat(x, cu_seqlens=cu)
            y.sum().backward()

        calls["varlen, checkpoint_every='auto'"] = remat_call
    held = dict.fromkeys(calls, 0)  # the bytes of the captured loop entries each call left held (CUDA)
    # on CUDA the first call captures the engine's CUDA graphs: its peak would hold the capture's
    # allocations, and later calls of the same T replay them (measured after one call)
    if device.type == "cuda":
        for name, call in calls.items():
            before = _gpu_graphs.holding(device)[1]
            call()
            held[name] = _gpu_graphs.holding(device)[1] - before
    memory = {name: peak_bytes(call, device) for name, call in calls.items()}
    built = {name: (torch.nn.utils.rnn.pad_sequence(parts) if name.startswith("padded") else torch.cat(parts))
             .requires_grad_() for name in calls}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for name, call in calls.items():  # warm-up
        call(built[name])
    for _ in range(args.repeats):
        for name, call in calls.items():
            built[name].grad = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            call(built[name])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    mean = sum(lengths) / len(lengths)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"{machine}, torch {torch.__version__}, {torch.get_num_threads()} threads; {args.cell.upper()} 512 -> 256 x 2"
          f"{'' if args.plain else ', layer_norm=True'}, B = {args.batch}, lengths log-normal: max {max(lengths)}, "
          f"mean {mean:.0f} (max/mean {max(lengths) / mean:.2f}), N = {sum(lengths)}; fwd+bwd, median of {args.repeats}")
    print("| call | fwd+bwd ms | x padded | peak MiB (from the per-sequence tensors) | x padded | "
          "+ entry held MiB | x padded |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    pad = "padded + lengths"
    base_t, base_m = statistics.median(times[pad]), memory[pad]
    for name in calls:
        t, m, total = statistics.median(times[name]), memory[name], memory[name] + held[name]
        print(f"| {name} | {t * 1e3:.0f} | {t / base_t:.2f} | {m / 2**20:.0f} | {m / base_m:.2f} | "
              f"{total / 2**20:.0f} | {total / (base_m + held[pad]):.2f} |")


if __name__ == "__main__":
    main()
