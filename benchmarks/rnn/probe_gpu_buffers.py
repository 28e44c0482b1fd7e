"""The memory a captured layer of the GPU engine holds: the buffers of its loops' entry
(``fastlayers.rnn._gpu_graphs``) after one training call, by buffer, for the LayerNorm LSTM and GRU.

The entry holds what the time loops read and write, sized by the longest T it served (a multiple of
the chunk): the input projection and its gradient, the output, the step-layout buffers the backward
reads, and the backward's own. It stays allocated between calls (the captured graphs replay into
it), so the allocator's peak during a later call does not show it; this script lists it.

    python benchmarks/rnn/probe_gpu_buffers.py --device cuda                      # the seed shape
    TRITON_INTERPRET=1 python benchmarks/rnn/probe_gpu_buffers.py --device cpu --steps 40 --batch 8 \\
        --input-size 16 --hidden 32                                               # anywhere (emulated)

On CPU the loops run on Triton's interpreter with the graphs emulated (:func:`_gpu_graphs.emulated`),
which sizes the entry as the GPU does.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import fastlayers
from fastlayers.rnn import _gpu_graphs


def entry_bytes(cell: str, steps: int, batch: int, features: int, hidden: int, device: torch.device) -> dict[str, int]:
    """Bytes of each buffer of the entry a bidirectional ``cell`` (layer_norm=True) holds after one
    fwd+bwd call with lengths U[T/2, T] (the longest T), float32."""
    _gpu_graphs.clear()
    torch.manual_seed(0)
    cls = fastlayers.LSTM if cell == "LSTM" else fastlayers.GRU
    layer = cls(features, hidden, bidirectional=True, layer_norm=True, device=device)
    x = torch.randn(steps, batch, features, device=device, requires_grad=True)
    lengths = torch.randint(steps // 2, steps + 1, (batch,))
    lengths[0] = steps
    ctx = _gpu_graphs.emulated() if device.type == "cpu" else contextlib.nullcontext()
    with fastlayers.backend("triton"), ctx:
        y, _ = layer(x, lengths=lengths)
        y.sum().backward()
    entries = [e for es in _gpu_graphs._entries.values() for e in es]
    sizes: dict[str, int] = {}
    for e in entries:
        for name, t in e.buffers.items():
            sizes[name] = sizes.get(name, 0) + t.numel() * t.element_size()
    return sizes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--cells", default="LSTM,GRU")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-size", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args()
    device = torch.device(args.device)
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else "CPU, Triton's interpreter, emulated graphs")
    print(f"# {machine}; torch {torch.__version__}; bidirectional, layer_norm=True, float32, F = {args.input_size}, "
          f"H = {args.hidden}, T = {args.steps}, B = {args.batch}, one fwd+bwd with lengths")
    for cell in args.cells.split(","):
        sizes = entry_bytes(cell, args.steps, args.batch, args.input_size, args.hidden, device)
        total = sum(sizes.values())
        listed = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1]))
        print(f"{cell}: entry {total / 2**20:.2f} MiB ({listed})")


if __name__ == "__main__":
    main()
