"""Issue: masked attention pooling, gradient cost vs forward. Seed-001 shape, fp32, one process.

query (B=128, 32), keys (B, T=256, 32), values (B, T, 100), lengths uniform in [T/2, T]. As in
seed 001, query and keys (the Dense outputs) require grad and the values (the context features
H, data) do not; a second table has all three requiring grad. Candidates: fastlayers.attention_pool
with each score, and the same masked pooling written with einsum + masked_fill + softmax
(anchor). The target is fwd+bwd <= 3x fwd for ours.

    python benchmarks/attention/bench_attention.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import fastlayers
from fastlayers import AttentionPooling, attention_pool
from fastlayers.bench import compare


def einsum_masked(query, keys, values, lengths):
    scores = torch.einsum("bd,btd->bt", query, keys)
    valid = torch.arange(keys.size(1)) < lengths.unsqueeze(1)
    weights = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=1)
    return torch.einsum("bt,btd->bd", weights, values), weights


def einsum_masked_scaled(query, keys, values, lengths):
    return einsum_masked(query / keys.size(2) ** 0.5, keys, values, lengths)


class OnBackend(nn.Module):
    """An attention module run on a forced backend ("reference": the plain-torch twin, the oracle
    of the additive score's check), its parameters under ``pool.``."""

    def __init__(self, pool: nn.Module, backend: str | None) -> None:
        super().__init__()
        self.pool, self.backend = pool, backend

    def forward(self, query, keys, values, lengths):
        if self.backend is None:
            return self.pool(query, keys, values, lengths)
        with fastlayers.backend(self.backend):
            return self.pool(query, keys, values, lengths)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    b, t, d, dv = 128, 256, 32, 100

    def inputs(values_grad):
        def make_inputs():
            g = torch.Generator().manual_seed(0)
            return {"query": torch.randn(b, d, generator=g).requires_grad_(True),
                    "keys": torch.randn(b, t, d, generator=g).requires_grad_(True),
                    "values": torch.randn(b, t, dv, generator=g).requires_grad_(values_grad),
                    "lengths": torch.randint(t // 2, t + 1, (b,), generator=g)}
        return make_inputs

    torch.manual_seed(0)
    additive = AttentionPooling(d, d, score="additive", attention_size=d)
    dot = {"einsum + masked_fill (anchor)": einsum_masked,
           "fastlayers dot": lambda query, keys, values, lengths: attention_pool(query, keys, values, lengths)}
    rep = compare(dot, inputs(False), repeats=args.repeats, warmup=2, workload=f"attention_pool (B={b}, T={t}, "
                  f"{d}-d keys, {dv}-d values without grad, lengths)")
    print(rep.markdown())
    print()
    rep_all = compare(dot, inputs(True), repeats=args.repeats, warmup=2, workload="same, values requiring grad too")
    print(rep_all.markdown())
    print()
    # the other scores, each checked against its plain formulation in float64 (values and gradients)
    scaled = {"fastlayers scaled_dot": lambda query, keys, values, lengths:
              attention_pool(query, keys, values, lengths, score="scaled_dot")}
    rep2 = compare(scaled, inputs(False), reference=einsum_masked_scaled, repeats=args.repeats, warmup=2,
                   workload="scaled_dot score, values without grad (checked against einsum on query / sqrt(Dk))")
    print(rep2.markdown())
    print()
    rep3 = compare({"fastlayers additive (module)": OnBackend(additive, None)}, inputs(False),
                   reference=OnBackend(additive, "reference"), repeats=args.repeats, warmup=2,
                   workload="additive score, values without grad (checked against the reference backend)")
    print(rep3.markdown())
    failed = [f"{r.name}: {r.failures()}" for x in (rep, rep_all, rep2, rep3) for r in x.results if r.failures()]
    for label, r in [("values without grad", x) for x in rep.results[1:] + rep2.results + rep3.results] + \
            [("values with grad", x) for x in rep_all.results[1:]]:
        print(f"{r.name} ({label}): fwd+bwd / fwd = {r.backward_ratio:.2f}")
    if failed:
        print(f"check failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
