"""Issue: every layer under autocast — the LayerNorm-LSTM engine in bfloat16 on CPU, seed shape.

Candidates (bidirectional, 1 layer, 512 -> 256x2, T=800, B=32, x requires grad), timed
interleaved in one process (check=False: the candidates compute in different precisions):

* ``fastlayers.LSTM(layer_norm=True)`` in float32 (the anchor);
* the same module under ``torch.autocast("cpu", torch.bfloat16)``;
* the same module with bfloat16 parameters and input;
* ``torch.nn.LSTM`` under the same autocast (oneDNN's bf16 LSTM: needs AVX512-BF16 or AMX; where
  it fails the row says so and the next one stands in);
* ``torch.nn.LSTM`` with bfloat16 parameters and input;
* ``torch.nn.LSTM`` in float32.

Prints whether this CPU has bf16 instructions (torch.cpu._is_avx512_bf16_supported /
_is_amx_tile_supported) and the bf16 vs float32 GEMM throughput at the input-projection shape.

    python benchmarks/bench_mixed_precision.py [--repeats 3] [--size seed|small]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import fastlayers
from fastlayers import _precision
from fastlayers.bench import compare


class Call(nn.Module):
    """module(x)[0] in ``dtype`` (the module converted once), optionally under CPU bf16 autocast."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, autocast: bool) -> None:
        super().__init__()
        self.rnn, self.dtype, self.autocast = module.to(dtype), dtype, autocast

    def forward(self, x):
        with torch.autocast("cpu", torch.bfloat16, enabled=self.autocast):
            return self.rnn(x.to(self.dtype))[0]


def gemm_rate(dtype: torch.dtype, rows: int = 25600) -> float:
    a, b = torch.randn(rows, 512).to(dtype), torch.randn(512, 1024).to(dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(3):
        a @ b
    return 3 * 2 * rows * 512 * 1024 / (time.perf_counter() - start) / 1e9


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", default="seed", choices=["seed", "small"])
    args = p.parse_args()
    d, h, t, b = (512, 256, 800, 32) if args.size == "seed" else (16, 8, 20, 4)
    print(f"CPU bf16 instructions: avx512_bf16={torch.cpu._is_avx512_bf16_supported()}, "
          f"amx={torch.cpu._is_amx_tile_supported()} -> fastlayers multiplies bf16 operands "
          f"{'with bf16 GEMMs' if _precision.native('cpu', torch.bfloat16) else 'in float32 arithmetic'}")
    print(f"GEMM (25600 x 512) @ (512 x 1024): float32 {gemm_rate(torch.float32):.0f} GFLOP/s, "
          f"bfloat16 {gemm_rate(torch.bfloat16):.0f} GFLOP/s (torch.matmul)")
    torch.manual_seed(0)
    ours = fastlayers.LSTM(d, h, bidirectional=True, layer_norm=True)
    vendor = nn.LSTM(d, h, bidirectional=True)
    vendor.load_state_dict(ours.state_dict(), strict=False)
    candidates = {
        "fastlayers LN-LSTM float32": Call(ours, torch.float32, False),
        "fastlayers LN-LSTM autocast bf16": Call(ours, torch.float32, True),
        "fastlayers LN-LSTM bf16 parameters": Call(type(ours)(d, h, bidirectional=True, layer_norm=True), torch.bfloat16,
                                                   False),
        "torch.nn.LSTM autocast bf16": Call(vendor, torch.float32, True),
        "torch.nn.LSTM bf16 parameters": Call(nn.LSTM(d, h, bidirectional=True), torch.bfloat16, False),
        "torch.nn.LSTM float32": Call(nn.LSTM(d, h, bidirectional=True), torch.float32, False),
    }
    x = torch.rand(t, b, d)
    for name in list(candidates):
        try:
            candidates[name](x[:3, :2])
        except RuntimeError as e:
            print(f"{name}: fails on this CPU ({str(e).splitlines()[0][:120]}); left out")
            del candidates[name]

    def make_inputs():
        return {"x": torch.rand(t, b, d, generator=torch.Generator().manual_seed(0)).requires_grad_(True)}

    rep = compare(candidates, make_inputs, repeats=args.repeats, warmup=1, check=False, memory=False,
                  workload=f"LN-LSTM precision (BLSTM {d} -> {h}x2, T={t}, B={b})",
                  progress=lambda m: print("  ..", m, file=sys.stderr, flush=True))
    print(rep.markdown("fastlayers LN-LSTM float32"))
    anchor = "fastlayers LN-LSTM float32"
    for name in rep.results[1:]:
        print(f"{name.name}: fwd+bwd {rep.ratio(name.name, anchor):.2f}x fastlayers float32")
    for ours_name in ("fastlayers LN-LSTM autocast bf16", "fastlayers LN-LSTM bf16 parameters"):
        for torch_name in ("torch.nn.LSTM autocast bf16", "torch.nn.LSTM bf16 parameters"):
            if torch_name in candidates:
                print(f"{ours_name} / {torch_name}: {rep.ratio(ours_name, torch_name):.2f}x (fwd+bwd)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rep.cpu}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
