"""Issue: fused recurrent engine — two routes for the fused per-step update, measured side by side.

The recurrent part of a LayerNorm-LSTM layer at the seed shape (both directions D=2, B=32, H=256,
G=4H) over K=100 steps: the input projection (one batched GEMM of the K*B rows, F=H features),
then per step the recurrent GEMM (D, B, H) x (D, H, G) plus the pointwise update (recurrent
LayerNorm, gates, cell, cell LayerNorm, h). Candidates differ only in how the per-step update is
fused, all with autograd through every input:

* eager torch ops (the reference: ~15 small kernels and their autograd nodes per step);
* ``torch.compile`` of the same step function (Inductor generates and compiles fused C++ for the
  forward and the backward; first call timed separately: that is the compile cost);
* the engine's route: one GEMM + one C kernel (``_native/lstm.c``), hand-written backward
  (:class:`fastlayers.rnn._cpu_recurrence.LSTMRecurrence`, all K*B rows active).

Values and gradients are checked against the eager ops in float64; a mismatch exits 1.

    python benchmarks/rnn/bench_step_fusion.py [--repeats 20] [--steps 100]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from fastlayers.bench import compare
from fastlayers.rnn._cpu_recurrence import EPS, LSTMRecurrence


def step(xp, h0, c0, w_hh, gh, gc, bc):
    """(D, B, G), (D, B, H) x2, (D, G, H), (D, G), (D, H) x2 -> h, c (D, B, H)."""
    hidden = c0.size(-1)
    r = torch.bmm(h0, w_hh.transpose(1, 2))
    pre = xp + F.layer_norm(r, (4 * hidden,), eps=EPS) * gh.unsqueeze(1)
    i, f, g, o = pre.split(hidden, dim=-1)
    c1 = torch.sigmoid(f) * c0 + torch.sigmoid(i) * torch.tanh(g)
    n = F.layer_norm(c1, (hidden,), eps=EPS) * gc.unsqueeze(1) + bc.unsqueeze(1)
    return torch.sigmoid(o) * torch.tanh(n), c1


def loop(step_fn):
    def run(x, w_ih, h0, c0, w_hh, gh, gc, bc):  # x (D, K, B, F)
        dirs, steps, batch, _ = x.shape
        xp = torch.bmm(x.reshape(dirs, steps * batch, -1), w_ih.transpose(1, 2)).view(dirs, steps, batch, -1)
        h, c, ys = h0, c0, []
        for t in range(steps):
            h, c = step_fn(xp[:, t], h, c, w_hh, gh, gc, bc)
            ys.append(h)
        return torch.stack(ys, 1), h, c
    return run


def engine(x, w_ih, h0, c0, w_hh, gh, gc, bc):
    dirs, steps, batch, _ = x.shape  # all rows active: the packed rows are (D, K*B, F)
    y, h, c = LSTMRecurrence.apply(x.reshape(dirs, steps * batch, -1), w_ih, None, None, h0, c0, w_hh, gh, gc, bc,
                                   None, None, None, None, None, (batch,) * steps, (0.0, 0.0, 0.0, 0.0))
    return y.view(dirs, steps, batch, -1), h, c


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    dirs, batch, hidden, steps = 2, 32, 256, args.steps

    def make_inputs():
        g = torch.Generator().manual_seed(0)
        r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g)).requires_grad_(True)  # noqa: E731
        return {"x": r(dirs, steps, batch, hidden), "w_ih": r(dirs, 4 * hidden, hidden, scale=hidden ** -0.5),
                "h0": r(dirs, batch, hidden, scale=0.5),
                "c0": r(dirs, batch, hidden), "w_hh": r(dirs, 4 * hidden, hidden, scale=hidden ** -0.5),
                "gh": r(dirs, 4 * hidden), "gc": r(dirs, hidden), "bc": r(dirs, hidden)}

    compiled = torch.compile(step, dynamic=False)
    inputs = make_inputs()
    start = time.perf_counter()
    xp0 = torch.bmm(inputs["x"][:, 0], inputs["w_ih"].transpose(1, 2))
    h, c = compiled(xp0, *(inputs[k] for k in ("h0", "c0", "w_hh", "gh", "gc", "bc")))
    (h.sum() + c.sum()).backward()
    first = time.perf_counter() - start
    print(f"torch.compile first call (forward + backward compile): {first:.1f} s", flush=True)
    say = lambda m: None  # noqa: E731
    rep = compare({"eager torch ops": loop(step), "torch.compile(step)": loop(compiled),
                   "engine: GEMM + C kernel": engine},
                  make_inputs, repeats=args.repeats, warmup=2, memory=False,
                  workload=f"LayerNorm-LSTM recurrence, {steps} steps (D={dirs}, B={batch}, H={hidden})", progress=say)
    print(rep.markdown())
    anchor = "engine: GEMM + C kernel"
    for name in ("eager torch ops", "torch.compile(step)"):
        print(f"{name}: fwd {rep.ratio(name, anchor, 'forward'):.2f}x, fwd+bwd {rep.ratio(name, anchor):.2f}x the engine")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rep.cpu}")
    failed = [f"{r.name}: {r.failures()}" for r in rep.results if r.failures()]
    if failed:
        print(f"check failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
