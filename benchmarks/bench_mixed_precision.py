"""Issue: the CPU engine at torch's bfloat16 speed — the LayerNorm LSTM / GRU in bf16, seed shape.

Candidates (bidirectional, 1 layer, 512 -> 256x2, T=800, B=32, x requires grad), timed
interleaved in one process (check=False: the candidates compute in different precisions):

* ``fastlayers.{LSTM,GRU}(layer_norm=True)`` in float32 (the anchor);
* the same module under ``torch.autocast("cpu", torch.bfloat16)``;
* the same again with the time loops' bf16 step products in float32 (``_cpu_recurrence.BF16_DOT``
  off: the path of a CPU without AVX512-BF16, which the default row takes where the CPU has none);
* the same again with the large products (input projection, input gradient) on torch's bf16 GEMM
  (``fastlayers._native.prefer_own_products(False)``) where the default takes matmul.c's VDPBF16PS
  kernel (:func:`fastlayers._native.bf16_large_products`; where it does not, the two rows match);
* the same module with bfloat16 parameters and input;
* with ``--lengths``: the float32 and autocast rows again with lengths U[400, 800] (seeded);
* ``torch.nn.{LSTM,GRU}`` under the same autocast (oneDNN's bf16 kernels: need AVX512-BF16 or
  AMX; where a candidate fails the row says so and it is left out);
* ``torch.nn.{LSTM,GRU}`` with bfloat16 parameters and input;
* ``torch.nn.{LSTM,GRU}`` in float32.

Prints whether this CPU has bf16 instructions (torch.cpu._is_avx512_bf16_supported /
_is_amx_tile_supported), the bf16 vs float32 GEMM throughput at the input-projection shape, and
the issue's ratios (fwd+bwd medians).

    python benchmarks/bench_mixed_precision.py [--cell lstm|gru] [--repeats 5] [--lengths] [--size seed|small]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import fastlayers
from fastlayers import _native
from fastlayers._core import precision as _precision
from fastlayers._core.system import cpuinfo
from fastlayers.bench import compare
from fastlayers.rnn import _cpu_recurrence


class Call(nn.Module):
    """module(x)[0] in ``dtype`` (the module converted once), optionally under CPU bf16 autocast,
    optionally with per-sequence lengths; ``dot``: the time loops' bf16 products on the CPU's bf16
    instructions where it has them; ``own``: the large products' choice
    (:func:`fastlayers._native.prefer_own_products`; None the CPU's). Both set at each call: the
    harness runs a call's backward before the next candidate's call."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, autocast: bool, lengths: torch.Tensor | None = None,
                 dot: bool = True, own: bool | None = None):
        super().__init__()
        self.rnn, self.dtype, self.autocast, self.lengths = module.to(dtype), dtype, autocast, lengths
        self.dot, self.own = dot, own

    def forward(self, x):
        _cpu_recurrence.BF16_DOT = self.dot
        _native.prefer_own_products(self.own)
        with torch.autocast("cpu", torch.bfloat16, enabled=self.autocast):
            if self.lengths is None:
                return self.rnn(x.to(self.dtype))[0]
            return self.rnn(x.to(self.dtype), lengths=self.lengths)[0]


def cpu_model() -> str:
    """'family F model M' from /proc/cpuinfo: tells AMD Zen 3 (19h model 1) from Zen 4 (19h model 11h), say."""
    fields = cpuinfo()
    if not fields:
        return "unknown"
    return f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def gemm_rate(dtype: torch.dtype, rows: int = 25600) -> float:
    a, b = torch.randn(rows, 512).to(dtype), torch.randn(512, 1024).to(dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(3):
        a @ b
    return 3 * 2 * rows * 512 * 1024 / (time.perf_counter() - start) / 1e9


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cell", default="lstm", choices=["lstm", "gru"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lengths", action="store_true", help="add rows with lengths U[T/2, T]")
    p.add_argument("--size", default="seed", choices=["seed", "small"])
    args = p.parse_args()
    d, h, t, b = (512, 256, 800, 32) if args.size == "seed" else (16, 8, 20, 4)
    name = args.cell.upper()
    ours_cls, torch_cls = getattr(fastlayers, name), getattr(nn, name)
    print(f"CPU bf16 instructions: avx512_bf16={torch.cpu._is_avx512_bf16_supported()}, "
          f"amx={torch.cpu._is_amx_tile_supported()} -> fastlayers multiplies bf16 operands "
          f"{'with bf16 GEMMs' if _precision.native('cpu', torch.bfloat16) else 'in float32 arithmetic'}")
    print(f"GEMM (25600 x 512) @ (512 x 1024): float32 {gemm_rate(torch.float32):.0f} GFLOP/s, "
          f"bfloat16 {gemm_rate(torch.bfloat16):.0f} GFLOP/s (torch.matmul)")
    torch.manual_seed(0)
    ours = ours_cls(d, h, bidirectional=True, layer_norm=True)
    vendor = torch_cls(d, h, bidirectional=True)
    vendor.load_state_dict(ours.state_dict(), strict=False)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=torch.Generator().manual_seed(1))
    anchor = f"fastlayers LN-{name} float32"
    candidates = {
        anchor: Call(ours, torch.float32, False),
        f"fastlayers LN-{name} autocast bf16": Call(ours, torch.float32, True),
        f"fastlayers LN-{name} autocast bf16, float32 products": Call(ours, torch.float32, True, dot=False),
        f"fastlayers LN-{name} autocast bf16, torch's bf16 GEMMs": Call(ours, torch.float32, True, own=False),
        f"fastlayers LN-{name} bf16 parameters": Call(ours_cls(d, h, bidirectional=True, layer_norm=True),
                                                     torch.bfloat16, False),
    }
    if args.lengths:
        candidates[f"fastlayers LN-{name} float32, lengths"] = Call(ours, torch.float32, False, lengths)
        candidates[f"fastlayers LN-{name} autocast bf16, lengths"] = Call(ours, torch.float32, True, lengths)
    candidates.update({
        f"torch.nn.{name} autocast bf16": Call(vendor, torch.float32, True),
        f"torch.nn.{name} bf16 parameters": Call(torch_cls(d, h, bidirectional=True), torch.bfloat16, False),
        f"torch.nn.{name} float32": Call(torch_cls(d, h, bidirectional=True), torch.float32, False),
    })
    x = torch.rand(t, b, d)
    for cand in list(candidates):
        try:
            if candidates[cand].lengths is None:  # (the lengths rows run the same module as a row above)
                candidates[cand](x[:3, :2])
        except RuntimeError as e:
            print(f"{cand}: fails on this CPU ({str(e).splitlines()[0][:120]}); left out")
            del candidates[cand]

    def make_inputs():
        return {"x": torch.rand(t, b, d, generator=torch.Generator().manual_seed(0)).requires_grad_(True)}

    # times only (check=False): the rows compute different functions (LayerNorm vs plain cells, other
    # weights, other precisions); the precision rule is tested in tests/test_mixed_precision.py
    rep = compare(candidates, make_inputs, repeats=args.repeats, warmup=1, check=False, memory=False,
                  workload=f"LN-{name} precision (B{name} {d} -> {h}x2, T={t}, B={b})",
                  progress=lambda m: print("  ..", m, file=sys.stderr, flush=True))
    _cpu_recurrence.BF16_DOT = True  # (the choices the candidates set: back to the defaults)
    _native.prefer_own_products(None)
    print(rep.markdown(anchor))
    auto, low_params = f"fastlayers LN-{name} autocast bf16", f"fastlayers LN-{name} bf16 parameters"
    torch_auto = f"torch.nn.{name} autocast bf16"
    print(f"{auto}: {1 / rep.ratio(auto, anchor):.2f}x faster than {anchor} (fwd+bwd)")
    print(f"{low_params}: {rep.ratio(low_params, auto):.2f}x the autocast call (fwd+bwd)")
    plain = f"{auto}, float32 products"
    print(f"{auto} / {plain}: {rep.ratio(auto, plain):.2f}x (fwd+bwd), {rep.ratio(auto, plain, 'forward'):.2f}x (fwd); "
          f"bf16 instructions in the time loops: {_native.bf16_products()}")
    gemms = f"{auto}, torch's bf16 GEMMs"
    print(f"{auto} / {gemms}: {rep.ratio(auto, gemms):.2f}x (fwd+bwd), {rep.ratio(auto, gemms, 'forward'):.2f}x (fwd); "
          f"large products on matmul.c's bf16 kernel: {_native.bf16_large_products(t * b)}")
    if torch_auto in candidates:
        print(f"{auto} / {torch_auto}: {rep.ratio(auto, torch_auto):.2f}x (fwd+bwd), "
              f"{rep.ratio(auto, torch_auto, 'forward'):.2f}x (fwd)")
    if args.lengths:
        for precision in ("float32", "autocast bf16"):
            padded = f"fastlayers LN-{name} {precision}"
            print(f"{padded}, lengths U[{t // 2}, {t}] / padded: {rep.ratio(padded + ', lengths', padded):.2f}x "
                  f"(fwd+bwd), {rep.ratio(padded + ', lengths', padded, 'forward'):.2f}x (fwd)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rep.cpu} ({cpu_model()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
