"""Per-call overhead at small shapes: every layer and cell against its torch counterpart (issue 42).

Each row: time per call of fastlayers' call and of the counterpart, measured side by side in this
one process with torch.utils.benchmark, 1 thread, in alternating rounds (ours, theirs, ours, ...:
--rounds of blocked_autorange each, so a slow spell of a shared machine falls on both columns);
a column's figure is the median of its rounds' medians; forward
under torch.no_grad(), and forward + backward (a sum of the outputs) with gradients of the input
and the parameters. The shapes are the issue's: the calls of step-wise decoding, streaming
inference and small models, where the fixed cost of a call dominates.

Both columns start from the same weights (torch's, loaded into ours), and before any timing every
row whose two calls compute the same function is checked: outputs and the gradients of the input
and the parameters (a random cotangent) agree to 1e-3 relative, else the script exits 1 untimed.
Rows that compare different functions by design (so not checked; the torch call is the speed
anchor): the ``layer_norm=True`` layers and cells (torch has no LayerNorm LSTM / GRU: its plain
one, sharing the weights it has) and ``LocallyConnected1d/2d`` against ``Conv1d/2d`` (unshared
kernels against shared ones).

    python benchmarks/bench_overhead.py [--min-run-time 0.3] [--rounds 5] [--device cuda]
        [--only SUBSTRING] [--eager-steps N]

With ``--device cuda`` every module and tensor is on the GPU: the time per call is then that of an
eager call on CUDA (torch.utils.benchmark synchronizes once per block of calls), at these shapes
the host's Python and launch time, not the GPU's work. ``--eager-steps N`` sets
``fastlayers.rnn._gpu_graphs.EAGER_STEPS`` (loops of at most N steps run eagerly, longer ones as
captured chunks; 0: every loop captured, as before it existed), to compare the two on CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.utils.benchmark as benchmark
from torch import nn

import fastlayers
from fastlayers._core.system import cpu_name
from fastlayers.bench._harness import _rel_err

RTOL = 1e-3  # the harness's float32 tolerance


def _torch_attention(q, k, v, lengths):
    """The plain-torch formulation of attention_pool (dot score): einsum, mask, softmax, einsum."""
    scores = torch.einsum("bd,btd->bt", q, k)
    mask = torch.arange(k.size(1), device=k.device).unsqueeze(0) >= lengths.unsqueeze(1)
    weights = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=1)
    return torch.einsum("bt,btd->bd", weights, v)


def _same_weights(ours: nn.Module, theirs: nn.Module) -> nn.Module:
    """``ours`` with ``theirs``'s weights (those it has: a LayerNorm layer keeps its own norms)."""
    ours.load_state_dict(theirs.state_dict(), strict=False)
    return ours


def _rows():
    """name -> (ours, theirs, our leaves, their leaves, target ratio, same): ``ours`` / ``theirs``
    call the layer, the leaves are the inputs and parameters whose gradients a backward computes
    (in the same order on both sides), ``same``: both compute the same function (checked)."""
    torch.manual_seed(0)

    def layer(ours_cls, theirs_cls, x, target, **options):
        theirs = theirs_cls(4, 4)
        ours = _same_weights(ours_cls(4, 4, **options), theirs)
        return (lambda: ours(x)[0], lambda: theirs(x)[0], [x, *ours.parameters()], [x, *theirs.parameters()], target,
                not options)

    x_seq = torch.randn(2, 1, 4)
    rows = {
        "LSTM(4, 4), T=2, B=1": layer(fastlayers.LSTM, nn.LSTM, x_seq, 1.5),
        "GRU(4, 4), T=2, B=1": layer(fastlayers.GRU, nn.GRU, x_seq, 1.5),
        "RNN(4, 4), T=2, B=1": layer(fastlayers.RNN, nn.RNN, x_seq, 1.5),
        "LSTM(4, 4, layer_norm=True), T=2, B=1": layer(fastlayers.LSTM, nn.LSTM, x_seq, 2.5, layer_norm=True),
        "GRU(4, 4, layer_norm=True), T=2, B=1": layer(fastlayers.GRU, nn.GRU, x_seq, 2.5, layer_norm=True),
    }
    x_step = torch.randn(8, 32)
    for name, ours_cls, theirs_cls, options, target in (
            ("LSTMCell(32, 64)", fastlayers.LSTMCell, nn.LSTMCell, {}, 1.5),
            ("GRUCell(32, 64)", fastlayers.GRUCell, nn.GRUCell, {}, 1.5),
            ("RNNCell(32, 64)", fastlayers.RNNCell, nn.RNNCell, {}, 1.5),
            ("LSTMCell(32, 64, layer_norm=True)", fastlayers.LSTMCell, nn.LSTMCell, {"layer_norm": True}, 2.0),
            ("GRUCell(32, 64, layer_norm=True)", fastlayers.GRUCell, nn.GRUCell, {"layer_norm": True}, 2.0)):
        theirs = theirs_cls(32, 64)
        ours = _same_weights(ours_cls(32, 64, **options).eval(), theirs)
        first = (lambda m: (lambda: m(x_step)[0])) if ours_cls is fastlayers.LSTMCell else (lambda m: (lambda: m(x_step)))
        rows[f"{name}, one step, B=8"] = (first(ours), first(theirs), [x_step, *ours.parameters()],
                                          [x_step, *theirs.parameters()], target, not options)
    x_img = torch.randn(1, 2, 4, 4)
    local, conv = fastlayers.LocallyConnected2d(2, 2, (4, 4), kernel_size=1), nn.Conv2d(2, 2, 1)
    rows["LocallyConnected2d(2, 2, (4, 4), 1) vs Conv2d, (1, 2, 4, 4)"] = (
        lambda: local(x_img), lambda: conv(x_img), [x_img, *local.parameters()], [x_img, *conv.parameters()], 2.5,
        False)
    x_line = torch.randn(1, 2, 8)
    local1, conv1 = fastlayers.LocallyConnected1d(2, 2, 8, kernel_size=3), nn.Conv1d(2, 2, 3)
    rows["LocallyConnected1d(2, 2, 8, 3) vs Conv1d, (1, 2, 8)"] = (
        lambda: local1(x_line), lambda: conv1(x_line), [x_line, *local1.parameters()], [x_line, *conv1.parameters()],
        2.5, False)
    q, k = torch.randn(8, 16), torch.randn(8, 20, 16)
    lengths = torch.randint(1, 21, (8,))
    rows["attention_pool(q, k, k, lengths), B=8, T=20, D=16"] = (
        lambda: fastlayers.attention_pool(q, k, k, lengths), lambda: _torch_attention(q, k, k, lengths), [q, k], [q, k],
        1.3, True)
    return rows


def _mismatch(ours, theirs, our_leaves, their_leaves) -> str | None:
    """None when ``ours`` and ``theirs`` agree in output and in every leaf's gradient (a random
    cotangent; max relative error <= RTOL), else what differs and by how much."""
    results = []
    # (TF32 in cuDNN's RNNs on a GPU: precision, not the function; the flags' context manager, which
    # also works where the global flags are locked, as in the tests' poisoned pass)
    with torch.backends.cudnn.flags(enabled=None, benchmark=None, benchmark_limit=None, deterministic=None,
                                    allow_tf32=False, fp32_precision=None, depthwise_kernel=None):  # (None: as is)
        for fn, leaves in ((ours, our_leaves), (theirs, their_leaves)):
            for t in leaves:
                t.requires_grad_(True)
                t.grad = None
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
            out.backward(cotangent)
            results.append((out.detach(), [t.grad for t in leaves]))
            for t in leaves:
                t.grad = None
    (got, got_grads), (want, want_grads) = results
    errors = {"output": _rel_err(got, want)}
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        errors["input" if i == 0 else f"parameter {i}"] = float("inf") if (g is None) != (w is None) else (
            0.0 if g is None else _rel_err(g, w))
    bad = {k: e for k, e in errors.items() if not e <= RTOL}
    return ", ".join(f"{k} {e:.1e}" for k, e in bad.items()) if bad else None


def _time(fn, min_run_time: float) -> float:
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=1).blocked_autorange(
        min_run_time=min_run_time).median


def _side_by_side(ours, theirs, min_run_time: float, rounds: int) -> tuple[float, float]:
    """(ours, theirs): the medians of ``rounds`` alternating measurements of each (the first of the
    pair alternates too), each a blocked_autorange of min_run_time / rounds seconds."""
    times: dict[int, list[float]] = {0: [], 1: []}
    fns = (ours, theirs)
    for i in range(rounds):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            times[j].append(_time(fns[j], min_run_time / rounds))
    return statistics.median(times[0]), statistics.median(times[1])


def _fwd_bwd(fn, leaves):
    def run():
        for t in leaves:
            t.requires_grad_(True)
            t.grad = None
        out = fn()
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-run-time", type=float, default=0.3, help="seconds per column and pass")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per column and pass")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: eager calls on the GPU")
    parser.add_argument("--only", default="", help="only the rows whose name contains this")
    parser.add_argument("--eager-steps", type=int, default=None,
                        help="fastlayers.rnn._gpu_graphs.EAGER_STEPS for this run (default: the library's)")
    args = parser.parse_args()
    if args.eager_steps is not None:
        from fastlayers.rnn import _gpu_graphs

        _gpu_graphs.EAGER_STEPS = args.eager_steps
    device = torch.device(args.device)
    torch.set_num_threads(1)
    where = f"{cpu_name()}, 1 thread" if device.type == "cpu" else f"{torch.cuda.get_device_name(device)} (host: {cpu_name()})"
    if args.eager_steps is not None:
        where += f", EAGER_STEPS={args.eager_steps}"
    with device:  # the rows' modules and tensors are made on the device
        rows = {name: row for name, row in _rows().items() if args.only in name}
    # values and gradients before any timing, where both calls compute the same function
    failed = [f"{name}: {bad}" for name, (ours, theirs, our_leaves, their_leaves, _, same) in rows.items()
              if same and (bad := _mismatch(ours, theirs, our_leaves, their_leaves))]
    if failed:
        print(f"check failed (relative error above {RTOL}; nothing timed): {'; '.join(failed)}", file=sys.stderr)
        return 1
    print(f"{where}, torch {torch.__version__}; time per call (us), torch.utils.benchmark "
          f"blocked_autorange, the median of {args.rounds} alternating rounds a column, both columns in this process; "
          f"outputs and gradients checked equal to torch's where both compute the same function")
    print("| call | fastlayers fwd | torch fwd | x | target | fastlayers fwd+bwd | torch fwd+bwd | x |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (ours, theirs, our_leaves, their_leaves, target, _) in rows.items():
        with torch.no_grad():
            f_ours, f_theirs = _side_by_side(ours, theirs, args.min_run_time, args.rounds)
        b_ours, b_theirs = _side_by_side(_fwd_bwd(ours, our_leaves), _fwd_bwd(theirs, their_leaves),
                                         args.min_run_time, args.rounds)
        print(f"| {name} | {f_ours * 1e6:.0f} | {f_theirs * 1e6:.0f} | {f_ours / f_theirs:.2f} | {target} | "
              f"{b_ours * 1e6:.0f} | {b_theirs * 1e6:.0f} | {b_ours / b_theirs:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
