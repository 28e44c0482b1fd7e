"""Shared helpers: build a fastlayers module and its torch twin, run both, compare everything."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fastlayers

MODES = {
    "LSTM": (fastlayers.LSTM, nn.LSTM, {}),
    "LSTM-proj": (fastlayers.LSTM, nn.LSTM, {"proj_size": 3}),
    "GRU": (fastlayers.GRU, nn.GRU, {}),
    "RNN_TANH": (fastlayers.RNN, nn.RNN, {"nonlinearity": "tanh"}),
    "RNN_RELU": (fastlayers.RNN, nn.RNN, {"nonlinearity": "relu"}),
}


def autograd_nodes(t: torch.Tensor) -> set[str]:
    """The class names of every node of t's autograd graph (which kernels' backwards it reaches)."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions)
    return {type(n).__name__ for n in seen}


def make_pair(mode, input_size, hidden_size, dtype=torch.float32, **kwargs):
    ours_cls, torch_cls, extra = MODES[mode]
    kwargs = {**extra, **kwargs}
    ref = torch_cls(input_size, hidden_size, dtype=dtype, **kwargs)
    ours = ours_cls(input_size, hidden_size, dtype=dtype, **kwargs)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def make_hx(module, batch, dtype=torch.float32):
    layers = module.num_layers * (2 if module.bidirectional else 1)
    h_size = getattr(module, "proj_size", 0) or module.hidden_size
    h = torch.randn(layers, batch, h_size, dtype=dtype)
    if isinstance(module, nn.LSTM):
        return (h, torch.randn(layers, batch, module.hidden_size, dtype=dtype))
    return h


def _states(h):
    return tuple(h) if isinstance(h, tuple) else (h,)


def torch_packed(ref, x, hx, lengths):
    """torch's own answer for padded x + lengths: pack, run, pad back to T."""
    steps = x.size(1 if ref.batch_first else 0)
    packed = pack_padded_sequence(x, torch.as_tensor(lengths).cpu(), batch_first=ref.batch_first, enforce_sorted=False)
    out, h = ref(packed, hx)
    out, _ = pad_packed_sequence(out, batch_first=ref.batch_first, total_length=steps)
    return out, h


def run_and_grad(fn, module, x, hx, seed=0):
    """Run fn(x, hx), backprop a random cotangent through output and states, return all results."""
    x = x.detach().clone().requires_grad_(True)
    hx_leaf = None
    if hx is not None:
        hx_leaf = tuple(s.detach().clone().requires_grad_(True) for s in _states(hx))
        hx_arg = hx_leaf if isinstance(hx, tuple) else hx_leaf[0]
    else:
        hx_arg = None
    module.zero_grad(set_to_none=True)
    out, h = fn(x, hx_arg)
    states = _states(h)
    g = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()
    for s in states:
        loss = loss + (s * torch.randn(s.shape, generator=g, dtype=s.dtype)).sum()
    loss.backward()
    grads = {"input": x.grad}
    if hx_leaf is not None:
        for i, s in enumerate(hx_leaf):
            grads[f"hx[{i}]"] = s.grad
    for name, p in module.named_parameters():
        grads[name] = p.grad
    return out.detach(), tuple(s.detach() for s in states), grads


def assert_close_all(a, b, atol=1e-5, rtol=1e-5):
    out_a, st_a, g_a = a
    out_b, st_b, g_b = b
    torch.testing.assert_close(out_a, out_b, atol=atol, rtol=rtol, msg=lambda m: "output: " + m)
    assert len(st_a) == len(st_b)
    for i, (s, t) in enumerate(zip(st_a, st_b)):
        torch.testing.assert_close(s, t, atol=atol, rtol=rtol, msg=lambda m, i=i: f"state {i}: " + m)
    assert g_a.keys() == g_b.keys()
    for k in g_a:
        assert g_a[k] is not None, f"gradient {k} missing (fastlayers)"
        assert g_b[k] is not None, f"gradient {k} missing (torch)"
        torch.testing.assert_close(g_a[k], g_b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"grad {k}: " + m)


def compare_with_torch(mode, lengths, *, num_layers=1, bidirectional=False, batch_first=False, with_hx=False,
                       input_size=5, hidden_size=4, steps=None, seed=0, atol=1e-5):
    torch.manual_seed(seed)
    ours, ref = make_pair(mode, input_size, hidden_size, num_layers=num_layers, bidirectional=bidirectional,
                          batch_first=batch_first)
    batch = len(lengths)
    steps = steps or max(lengths)
    x = torch.randn((batch, steps, input_size) if batch_first else (steps, batch, input_size))
    hx = make_hx(ref, batch) if with_hx else None
    got = run_and_grad(lambda x, h: ours(x, h, lengths=torch.tensor(lengths)), ours, x, hx)
    want = run_and_grad(lambda x, h: torch_packed(ref, x, h, lengths), ref, x, hx)
    assert_close_all(got, want, atol=atol, rtol=atol)
    return got


def assert_engine_equals_torch(engine, ours_cls, torch_cls, **kwargs):
    """The engine itself (forced, all options off) == torch's packed path, fp32 1e-5, all gradients."""
    from fastlayers.rnn._options import CellOptions

    torch.manual_seed(0)
    ref = torch_cls(5, 6, num_layers=2, bidirectional=True, **kwargs)
    ours = ours_cls(5, 6, num_layers=2, bidirectional=True, **kwargs)
    ours.load_state_dict(ref.state_dict())
    lengths = [7, 3, 5, 1, 7]
    x = torch.randn(7, 5, 5)
    hx = make_hx(ref, 5)

    def fn(x, h):
        states = h if isinstance(h, tuple) else (h,)
        out, final = engine(x, states, ours._layer_parameters(), torch.tensor(lengths), CellOptions())
        return out, (final if isinstance(h, tuple) else final[0])

    got = run_and_grad(fn, ours, x, hx)
    want = run_and_grad(lambda x, h: torch_packed(ref, x, h, lengths), ref, x, hx)
    assert_close_all(got, want, atol=1e-5, rtol=1e-5)


class CallAsUser(nn.Module):
    """A recurrent layer called as a user would, with lengths and hx or without (for export tests:
    every variant takes the same four inputs, x, lengths, h0, c0)."""

    def __init__(self, layer, lengths: bool, hx: bool):
        super().__init__()
        self.layer, self.with_lengths, self.with_hx = layer, lengths, hx

    def forward(self, x, lengths, h0, c0):
        hx = ((h0, c0) if self.layer.mode == "LSTM" else h0) if self.with_hx else None
        return self.layer(x, hx, lengths=lengths if self.with_lengths else None)


@contextlib.contextmanager
def on_the_triton_engine():
    """Asserts that the block ran the Triton engine's layer Functions (LSTMLayer / GRULayer, also
    inside checkpoint_every's segments): a forced "triton" that quietly ran the reference would give
    the reference's results and a grad_fn of torch ops."""
    from fastlayers.rnn import _gpu_layers

    calls = []
    with pytest.MonkeyPatch.context() as patch:
        for cls in (_gpu_layers.LSTMLayer, _gpu_layers.GRULayer):
            patch.setattr(cls, "apply", lambda *a, _apply=cls.apply: calls.append(1) or _apply(*a))
        yield
    assert calls, "the Triton engine did not run"
