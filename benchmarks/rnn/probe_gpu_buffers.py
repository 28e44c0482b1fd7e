"""The memory a captured layer of the GPU engine holds: the buffers of its loops' entry
(``fastlayers.rnn._gpu_graphs``) after one training call, by buffer, for the LayerNorm LSTM and GRU.

The entry holds what the time loops read and write, sized by the longest T it served (a multiple of
the chunk): the input projection and its gradient, the output, the step-layout buffers the backward
reads, and the backward's own. It stays allocated between calls (the captured graphs replay into
it), so the allocator's peak during a later call does not show it; this script lists it.

    python benchmarks/rnn/probe_gpu_buffers.py --device cuda                      # the seed shape
    TRITON_INTERPRET=1 python benchmarks/rnn/probe_gpu_buffers.py --device cpu --steps 40 --batch 8 \\
        --input-size 16 --hidden 32                                               # anywhere (emulated)
    python benchmarks/rnn/probe_gpu_buffers.py --device cuda --varlen --steps 1600  # issue 66's batch

``--varlen``: lengths log-normal as ``bench_varlen.py``'s (the longest T, max/mean about 4 at B =
32), and two entries per cell: the padded call with lengths and the varlen call (``cu_seqlens``),
whose buffers hold the N value rows instead of T x B.

On CPU the loops run on Triton's interpreter with the graphs emulated (:func:`_gpu_graphs.emulated`),
which sizes the entry as the GPU does.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import fastlayers
from bench_varlen import lognormal_lengths  # (this script's folder is on the path)
from fastlayers.rnn import _gpu_graphs


def entry_bytes(cell: str, steps: int, batch: int, features: int, hidden: int, device: torch.device,
                lengths: list[int] | None = None, varlen: bool = False) -> dict[str, int]:
    """Bytes of each buffer of the entry a bidirectional ``cell`` (layer_norm=True) holds after one
    fwd+bwd call with ``lengths`` (default U[T/2, T], the longest T), float32: the padded call, or
    the varlen call (``cu_seqlens``) of the same sequences."""
    _gpu_graphs.clear()
    torch.manual_seed(0)
    cls = fastlayers.LSTM if cell == "LSTM" else fastlayers.GRU
    layer = cls(features, hidden, bidirectional=True, layer_norm=True, device=device)
    if lengths is None:
        lengths_t = torch.randint(steps // 2, steps + 1, (batch,))
        lengths_t[0] = steps
    else:
        lengths_t = torch.tensor(lengths)
    x = torch.randn(steps, batch, features, device=device, requires_grad=True)
    ctx = _gpu_graphs.emulated() if device.type == "cpu" else contextlib.nullcontext()
    with fastlayers.backend("triton"), ctx:
        if varlen:
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths_t, 0)]).to(device)
            values = torch.cat([x.detach()[:n, b] for b, n in enumerate(lengths_t.tolist())]).requires_grad_()
            y, _ = layer(values, cu_seqlens=cu)
        else:
            y, _ = layer(x, lengths=lengths_t)
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
    p.add_argument("--varlen", action="store_true", help="log-normal lengths; the padded and the varlen call")
    args = p.parse_args()
    device = torch.device(args.device)
    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else "CPU, Triton's interpreter, emulated graphs")
    lengths = lognormal_lengths(args.batch, args.steps) if args.varlen else None
    shape = (f"lengths log-normal, N = {sum(lengths)}, max/mean {args.steps * args.batch / sum(lengths):.2f}"
             if lengths else "lengths U[T/2, T]")
    print(f"# {machine}; torch {torch.__version__}; bidirectional, layer_norm=True, float32, F = {args.input_size}, "
          f"H = {args.hidden}, T = {args.steps}, B = {args.batch}, one fwd+bwd, {shape}")
    for cell in args.cells.split(","):
        totals = []
        for varlen in (False, True) if args.varlen else (False,):
            sizes = entry_bytes(cell, args.steps, args.batch, args.input_size, args.hidden, device, lengths, varlen)
            totals.append(sum(sizes.values()))
            listed = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1]))
            name = f"{cell} {'varlen' if varlen else 'padded'}" if args.varlen else cell
            print(f"{name}: entry {totals[-1] / 2**20:.2f} MiB ({listed})")
        if args.varlen:
            print(f"{cell}: varlen / padded entry {totals[1] / totals[0]:.2f}")


if __name__ == "__main__":
    main()
