"""Per-call overhead at small shapes: every layer and cell against its torch counterpart (issue 42).

Each row: time per call of fastlayers' call and of the counterpart, measured side by side in this
one process with torch.utils.benchmark, 1 thread, in alternating rounds (ours, theirs, ours, ...:
--rounds of blocked_autorange each, so a slow spell of a shared machine falls on both columns);
a column's figure is the median of its rounds' medians; forward
under torch.no_grad(), and forward + backward (a sum of the outputs) with gradients of the input
and the parameters. The shapes are the issue's: the calls of step-wise decoding, streaming
inference and small models, where the fixed cost of a call dominates.

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

import torch
import torch.utils.benchmark as benchmark
from torch import nn

import fastlayers
from fastlayers._core.system import cpu_name


def _torch_attention(q, k, v, lengths):
    """The plain-torch formulation of attention_pool (dot score): einsum, mask, softmax, einsum."""
    scores = torch.einsum("bd,btd->bt", q, k)
    mask = torch.arange(k.size(1), device=k.device).unsqueeze(0) >= lengths.unsqueeze(1)
    weights = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=1)
    return torch.einsum("bt,btd->bd", weights, v)


def _rows():
    """(name, ours, theirs, target ratio) with ``ours`` / ``theirs`` returning (forward, inputs that want grads)."""
    torch.manual_seed(0)

    def layer(ours_cls, theirs_cls, x, target, **options):
        ours, theirs = ours_cls(4, 4, **options), theirs_cls(4, 4)
        return (lambda: ours(x)[0], lambda: theirs(x)[0], [x, *ours.parameters()], [x, *theirs.parameters()], target)

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
        ours, theirs = ours_cls(32, 64, **options).eval(), theirs_cls(32, 64)
        first = (lambda m: (lambda: m(x_step)[0])) if ours_cls is fastlayers.LSTMCell else (lambda m: (lambda: m(x_step)))
        rows[f"{name}, one step, B=8"] = (first(ours), first(theirs), [x_step, *ours.parameters()],
                                          [x_step, *theirs.parameters()], target)
    x_img = torch.randn(1, 2, 4, 4)
    local, conv = fastlayers.LocallyConnected2d(2, 2, (4, 4), kernel_size=1), nn.Conv2d(2, 2, 1)
    rows["LocallyConnected2d(2, 2, (4, 4), 1) vs Conv2d, (1, 2, 4, 4)"] = (
        lambda: local(x_img), lambda: conv(x_img), [x_img, *local.parameters()], [x_img, *conv.parameters()], 2.5)
    x_line = torch.randn(1, 2, 8)
    local1, conv1 = fastlayers.LocallyConnected1d(2, 2, 8, kernel_size=3), nn.Conv1d(2, 2, 3)
    rows["LocallyConnected1d(2, 2, 8, 3) vs Conv1d, (1, 2, 8)"] = (
        lambda: local1(x_line), lambda: conv1(x_line), [x_line, *local1.parameters()], [x_line, *conv1.parameters()],
        2.5)
    q, k = torch.randn(8, 16), torch.randn(8, 20, 16)
    lengths = torch.randint(1, 21, (8,))
    rows["attention_pool(q, k, k, lengths), B=8, T=20, D=16"] = (
        lambda: fastlayers.attention_pool(q, k, k, lengths), lambda: _torch_attention(q, k, k, lengths), [q, k], [q, k],
        1.3)
    return rows


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


def main() -> None:
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
    print(f"{where}, torch {torch.__version__}; time per call (us), torch.utils.benchmark "
          f"blocked_autorange, the median of {args.rounds} alternating rounds a column, both columns in this process")
    print("| call | fastlayers fwd | torch fwd | x | target | fastlayers fwd+bwd | torch fwd+bwd | x |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with device:  # the rows' modules and tensors are made on the device
        rows = _rows()
    for name, (ours, theirs, our_leaves, their_leaves, target) in rows.items():
        if args.only not in name:
            continue
        with torch.no_grad():
            f_ours, f_theirs = _side_by_side(ours, theirs, args.min_run_time, args.rounds)
        b_ours, b_theirs = _side_by_side(_fwd_bwd(ours, our_leaves), _fwd_bwd(theirs, their_leaves),
                                         args.min_run_time, args.rounds)
        print(f"| {name} | {f_ours * 1e6:.0f} | {f_theirs * 1e6:.0f} | {f_ours / f_theirs:.2f} | {target} | "
              f"{b_ours * 1e6:.0f} | {b_theirs * 1e6:.0f} | {b_ours / b_theirs:.2f} |")


if __name__ == "__main__":
    main()
