"""The seed workloads (../shared/seeds in the project history) rewritten in PyTorch.

Each workload builds candidates (the users' original formulations next to ours) and the inputs
at ``size="small"`` (seconds, for tests) or ``size="seed"`` (the shapes of the user reports).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from .. import GRU, LSTM


@dataclass
class Workload:
    """Candidates and inputs for :func:`fastlayers.bench.compare`, plus notes for the reader.

    Attributes:
        name: the workload and its sizes, as the report prints them.
        candidates: name -> callable (an ``nn.Module`` also has its parameters' gradients compared).
        make_inputs: returns the keyword inputs of every call (tensors requiring grad are compared).
        reference: the candidate used as the oracle (None: the first).
        anchor: the candidate the others' times are divided by in the report's ratios.
        notes: remarks printed under the table.
        expected: candidate name -> the flag kinds it is built to get (a candidate that computes
            another function, as a speed anchor); any other failure flag fails ``fastlayers bench``.
    """

    name: str
    candidates: dict[str, Callable[..., Any]]
    make_inputs: Callable[[], dict[str, Tensor]]
    reference: str | None = None
    anchor: str | None = None
    notes: list[str] = field(default_factory=list)
    expected: dict[str, tuple[str, ...]] = field(default_factory=dict)


# ---------------------------------------------------------------- blstm (seed 000)


class _RNNCandidate(nn.Module):
    """Holds the recurrent module as ``rnn`` so every candidate has the same parameter names."""

    def __init__(self, rnn: nn.Module, how: str) -> None:
        super().__init__()
        self.rnn, self.how = rnn, how

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        if self.how == "packed":
            packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
            out, _ = pad_packed_sequence(self.rnn(packed)[0], total_length=x.size(0))
            return out
        if self.how == "lengths":
            return self.rnn(x, lengths=lengths)[0]
        return self.rnn(x)[0]  # padded: ignores lengths


def _check_size(size: object, sizes: tuple[str, ...] = ("small", "seed")) -> None:
    """ValueError unless ``size`` is one of the workload's ``sizes`` (another name once gave the
    small shapes silently)."""
    if size not in sizes:
        raise ValueError(f"size: expected one of {sizes}, got {size!r}")


def blstm(size: str = "seed", dtype: torch.dtype = torch.float32, device: str = "cpu", mode: str = "LSTM",
          num_layers: int = 1, with_loop: bool = True) -> Workload:
    """Seed 000: bidirectional LSTM, D=512 -> H=256 per direction, T=800, B=32, lengths in [T/2, T]."""
    _check_size(size)
    d, h, t, b = (512, 256, 800, 32) if size == "seed" else (16, 8, 20, 4)
    torch_cls = {"LSTM": nn.LSTM, "GRU": nn.GRU}[mode]
    ours_cls = {"LSTM": LSTM, "GRU": GRU}[mode]
    torch.manual_seed(0)
    base = torch_cls(d, h, num_layers=num_layers, bidirectional=True, device=device, dtype=dtype)
    ours = ours_cls(d, h, num_layers=num_layers, bidirectional=True, device=device, dtype=dtype)
    ours.load_state_dict(base.state_dict())
    candidates: dict[str, Callable[..., Any]] = {
        f"torch.nn.{mode} packed (lengths)": _RNNCandidate(base, "packed"),
        f"torch.nn.{mode} padded (ignores lengths)": _RNNCandidate(copy.deepcopy(base), "padded"),
        f"fastlayers.{mode} padded (ignores lengths)": _RNNCandidate(copy.deepcopy(ours), "padded"),
        f"fastlayers.{mode} lengths": _RNNCandidate(ours, "lengths"),
    }
    if with_loop and mode == "LSTM" and num_layers == 1:
        candidates["LSTMCell loop (seed, masked)"] = _StepwiseLSTM(copy.deepcopy(base))

    def make_inputs() -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(0)
        x = torch.rand(t, b, d, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
        lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
        lengths[0] = t
        return {"x": x, "lengths": lengths}

    return Workload(
        name=f"blstm ({mode}, {num_layers} layer{'s' if num_layers > 1 else ''}, D={d}, H={h}x2, T={t}, B={b})",
        candidates=candidates,
        make_inputs=make_inputs,
        reference=f"fastlayers.{mode} lengths" if size == "seed" else None,
        anchor=f"torch.nn.{mode} padded (ignores lengths)",
        notes=["the 'padded (ignores lengths)' candidates compute a different function (the reverse direction "
               "reads padding), so they are expected to be flagged 'value mismatch' and 'gradient mismatch'; they "
               "are the speed anchor"],
        expected={name: ("value mismatch", "gradient mismatch") for name in candidates if "ignores lengths" in name},
    )


# ---------------------------------------------------------------- attention (seed 001)


class _AttentionCandidate(nn.Module):
    """Dense(64 -> 32) per step, scores of step 1 against every step, softmax over time, context."""

    def __init__(self, dense: nn.Linear, how: str) -> None:
        super().__init__()
        self.dense, self.how = dense, how
        # per-column views: ~10^6 ops, too many for the profiler's memory records (see compare)
        self.bench_memory = not how.startswith("colwise")

    def forward(self, xs: Tensor, hs: Tensor) -> tuple[Tensor, Tensor]:
        # xs (T, B, 64), hs (T, B, 100) -> alpha (T, B), context (B, 100)
        steps, batch = xs.shape[:2]
        if self.how in ("batched", "colwise"):
            ys = self.dense(xs)  # (T, B, 32): one big array, one Linear call
            if self.how == "batched":
                z = torch.einsum("bo,tbo->tb", ys[0], ys)
            else:  # the seed's colwise: a dot of two column views per (step, column); each view's
                # backward scatters into a zero-filled array of its parent's size
                z = torch.stack([torch.stack([ys[0][b].dot(ys[t][b]) for b in range(batch)])
                                 for t in range(steps)])
        else:
            ys_list = [self.dense(xs[t]) for t in range(steps)]  # the seed's m.(xs): one matrix per step
            y1 = ys_list[0]
            if self.how == "diagmatmul":
                z = torch.stack([torch.diagonal(y1 @ y.T) for y in ys_list])
            elif self.how == "colwise (per-step list)":  # column views of per-step matrices
                z = torch.stack([torch.stack([y1[b].dot(y[b]) for b in range(batch)]) for y in ys_list])
            else:  # "usedot": one batched dot per step
                z = torch.stack([(y1 * y).sum(1) for y in ys_list])
        alpha = torch.softmax(z, dim=0)
        return alpha, torch.einsum("tb,tbd->bd", alpha, hs)


def attention(size: str = "seed", dtype: torch.dtype = torch.float32, device: str = "cpu") -> Workload:
    """Seed 001: T=256 steps, batch 128, Dense 64 -> 32, context over 100 features."""
    _check_size(size)
    t, b, fin, fout, dv = (256, 128, 64, 32, 100) if size == "seed" else (12, 6, 8, 4, 5)
    torch.manual_seed(0)
    dense = nn.Linear(fin, fout, device=device, dtype=dtype)
    candidates: dict[str, Callable[..., Any]] = {
        how: _AttentionCandidate(copy.deepcopy(dense), how)
        for how in ("diagmatmul", "colwise", "colwise (per-step list)", "usedot", "batched")
    }
    try:
        from .. import attention_pool  # available once issue "attention pooling" lands
    except ImportError:
        attention_pool = None
    if attention_pool is not None:
        candidates["fastlayers.attention_pool"] = _AttentionPoolCandidate(copy.deepcopy(dense), attention_pool)

    def make_inputs() -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(0)
        xs = torch.rand(t, b, fin, generator=g).to(device=device, dtype=dtype)
        hs = torch.rand(t, b, dv, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
        return {"xs": xs, "hs": hs}

    return Workload(name=f"attention (T={t}, B={b}, {fin}->{fout}, context {dv})", candidates=candidates,
                    make_inputs=make_inputs, anchor="diagmatmul")


class _AttentionPoolCandidate(nn.Module):
    def __init__(self, dense: nn.Linear, pool: Callable[..., Any]) -> None:
        super().__init__()
        self.dense, self.pool = dense, pool

    def forward(self, xs: Tensor, hs: Tensor) -> tuple[Tensor, Tensor]:
        ys = self.dense(xs).transpose(0, 1)  # (B, T, 32)
        context, weights = self.pool(ys[:, 0], ys, hs.transpose(0, 1))
        return weights.T, context


# ---------------------------------------------------------------- fused-rnn (seed 002)


class _StepwiseLSTM(nn.Module):
    """The step-at-a-time formulation of seeds 000/002: per layer and direction one LSTM cell call
    per time step through autograd; with ``lengths``, padded steps are masked (state frozen, output 0)."""

    def __init__(self, rnn: nn.LSTM) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        steps, batch, _ = x.shape
        mask = None
        if lengths is not None:
            mask = (torch.arange(steps, device=x.device).unsqueeze(1) < lengths.to(x.device)).unsqueeze(-1)
        layer_in = x
        for layer in range(self.rnn.num_layers):
            outs = []
            for suffix, order in (("", range(steps)), ("_reverse", range(steps - 1, -1, -1))):
                w = [getattr(self.rnn, f"{n}_l{layer}{suffix}") for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
                h = x.new_zeros(batch, self.rnn.hidden_size)
                c = x.new_zeros(batch, self.rnn.hidden_size)
                ys: list[Tensor | None] = [None] * steps
                for t in order:
                    h2, c2 = torch.lstm_cell(layer_in[t], (h, c), *w)
                    if mask is None:
                        h, c = h2, c2
                        ys[t] = h
                    else:
                        h, c = torch.where(mask[t], h2, h), torch.where(mask[t], c2, c)
                        ys[t] = h * mask[t]
                outs.append(torch.stack(ys))  # type: ignore[arg-type]
            layer_in = torch.cat(outs, dim=-1)
        return layer_in


class _FusedLSTM(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: Tensor) -> Tensor:
        return self.rnn(x)[0]


def fused_rnn(size: str = "seed", dtype: torch.dtype = torch.float32, device: str = "cpu") -> Workload:
    """Seed 002: 3-layer bidirectional LSTM over one 3-D batch, step-wise vs fused."""
    _check_size(size)
    f, h, t, b = (64, 128, 200, 32) if size == "seed" else (6, 5, 9, 3)
    torch.manual_seed(0)
    base = nn.LSTM(f, h, num_layers=3, bidirectional=True, device=device, dtype=dtype)
    ours = LSTM(f, h, num_layers=3, bidirectional=True, device=device, dtype=dtype)
    ours.load_state_dict(base.state_dict())

    def make_inputs() -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(0)
        return {"x": torch.rand(t, b, f, generator=g).to(device=device, dtype=dtype).requires_grad_(True)}

    return Workload(
        name=f"fused-rnn (3-layer BLSTM, F={f}, H={h}x2, T={t}, B={b})",
        candidates={
            "step-wise cell loop": _StepwiseLSTM(copy.deepcopy(base)),
            "torch.nn.LSTM fused": _FusedLSTM(base),
            "fastlayers.LSTM fused": _FusedLSTM(ours),
        },
        make_inputs=make_inputs,
        anchor="torch.nn.LSTM fused",
    )


# ---------------------------------------------------------------- local2d (seed 003)


def _cat_of_sums(x: Tensor, weight: Tensor, bias: Tensor, x_hwcb: Tensor | None = None) -> Tensor:
    # the seed: out[:, o] = sum_c W[o, c] * x[:, c] + b[o], concatenated over o
    return torch.cat([(weight[o] * x).sum(1, keepdim=True) + bias[o] for o in range(weight.size(0))], dim=1)


def _broadcast_sum(x: Tensor, weight: Tensor, bias: Tensor, x_hwcb: Tensor | None = None) -> Tensor:
    return (x.unsqueeze(1) * weight.unsqueeze(0)).sum(2) + bias


def _einsum(x: Tensor, weight: Tensor, bias: Tensor, x_hwcb: Tensor | None = None) -> Tensor:
    return torch.einsum("bchw,ochw->bohw", x, weight) + bias


def _einsum_batch_last(x: Tensor, weight: Tensor, bias: Tensor, x_hwcb: Tensor) -> Tensor:
    # the fastest einsum layout found: location first, batch last, on an input already stored
    # that way ('ijck,ijcn->ijkn' on 256x256x4x32); the output is returned as a (B, O, H, W) view
    y = torch.einsum("ijck,ijcn->ijkn", x_hwcb, weight.permute(2, 3, 1, 0))  # (H, W, B, O)
    return y.permute(2, 3, 0, 1) + bias


def local2d(size: str = "seed", dtype: torch.dtype = torch.float32, device: str = "cpu") -> Workload:
    """Seed 003: x (32, 4, 256, 256), 2 output channels, 1x1 unshared kernel; W and b require grad
    (``size="seed-large"``: the seed's example batch of 1024, x 1 GiB in fp32)."""
    _check_size(size, ("small", "seed", "seed-large"))
    b, c, hw, o = {"seed": (32, 4, 256, 2), "seed-large": (1024, 4, 256, 2)}.get(size, (3, 2, 5, 2))
    candidates: dict[str, Callable[..., Any]] = {
        "einsum batch-last": _einsum_batch_last,
        "torch.einsum": _einsum,
        "cat-of-sums (seed)": _cat_of_sums,
        "broadcast-and-sum": _broadcast_sum,
    }
    try:
        from ..functional import locally_connected2d  # available once the locally connected layer lands
    except ImportError:
        locally_connected2d = None
    if locally_connected2d is not None:
        def _ours(x: Tensor, weight: Tensor, bias: Tensor, x_hwcb: Tensor | None = None) -> Tensor:
            return locally_connected2d(x, weight.view(o, c, 1, 1, hw, hw), bias)

        candidates["fastlayers locally_connected2d"] = _ours

    def make_inputs() -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(0)
        x = torch.rand(b, c, hw, hw, generator=g).to(device=device, dtype=dtype)
        weight = (torch.rand(o, c, hw, hw, generator=g) - 0.5).to(device=device, dtype=dtype).requires_grad_(True)
        bias = (torch.rand(o, hw, hw, generator=g) - 0.5).to(device=device, dtype=dtype).requires_grad_(True)
        return {"x": x, "weight": weight, "bias": bias, "x_hwcb": x.permute(2, 3, 1, 0).contiguous()}

    return Workload(name=f"local2d (x {b}x{c}x{hw}x{hw}, {o} out channels, 1x1 unshared)", candidates=candidates,
                    make_inputs=make_inputs, anchor="einsum batch-last",
                    notes=["'einsum batch-last' reads a copy of x stored (H, W, C, B) (input x_hwcb), as in the "
                           "seed thread; the others read x as (B, C, H, W)"])


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "blstm": blstm,
    "attention": attention,
    "fused-rnn": fused_rnn,
    "local2d": local2d,
}
