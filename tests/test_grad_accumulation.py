"""Parameter gradients accumulate as torch.nn's do, on every backend: two backward passes before an
optimizer step (gradient accumulation, or a retained graph backwarded twice) give twice one pass's
gradient, no two parameters' ``.grad`` share memory, and an in-place clip of the gradients
(``torch.nn.utils.clip_grad_norm_``) scales each once.

Before, the LSTM engines (C and Triton) summed b_ih and b_hh after stacking the directions. Each bias
then got a view of the sum's one gradient, and torch's AccumulateGrad keeps such a view as ``.grad``
without a copy (pytorch issue 34082). So b_ih.grad and b_hh.grad were the same memory: a second
backward added to both twice (3x one pass's gradient instead of 2x), and a clip scaled both twice."""

from __future__ import annotations

import itertools

import pytest
import torch

import fastlayers

BACKENDS = ["cpu", "reference", "triton"]  # triton: CPU tensors under the interpreter (tests/conftest.py)
LENGTHS = torch.tensor([4, 2, 3])


def _rnn(name, lengths=False, **options):
    def make(dtype):
        m = getattr(fastlayers, name)(3, 4, num_layers=2, bidirectional=True, dtype=dtype, **options)
        x = torch.randn(4, 3, 3, dtype=dtype)
        kwargs = {"lengths": LENGTHS} if lengths else {}
        return m, lambda: m(x, **kwargs)
    return make


def _cell(name, **options):
    def make(dtype):
        m = getattr(fastlayers, name)(3, 4, dtype=dtype, **options)
        x = torch.randn(3, 3, dtype=dtype)
        return m, lambda: m(x)
    return make


def _other(which):
    def make(dtype):
        if which == "LocallyConnected2d":
            m, inputs = fastlayers.LocallyConnected2d(2, 3, 4, 3, dtype=dtype), (torch.randn(2, 2, 4, 4, dtype=dtype),)
        else:
            m = fastlayers.AttentionPooling(4, 4, score="additive", dtype=dtype)
            inputs = (torch.randn(3, 4, dtype=dtype), torch.randn(3, 5, 4, dtype=dtype))
        return m, lambda: m(*inputs)
    return make


CASES = {
    "LSTM-lengths": _rnn("LSTM", lengths=True),
    "LSTM-layer_norm": _rnn("LSTM", layer_norm=True),
    "LSTM-layer_norm-lengths": _rnn("LSTM", lengths=True, layer_norm=True),
    "LSTM-peephole-cell_clip": _rnn("LSTM", peephole=True, cell_clip=1.0),
    "LSTM-proj_size-lengths": _rnn("LSTM", lengths=True, proj_size=2),
    "LSTM-checkpoint_every": _rnn("LSTM", layer_norm=True, checkpoint_every=2),
    "GRU-lengths": _rnn("GRU", lengths=True),
    "GRU-layer_norm": _rnn("GRU", layer_norm=True),
    "RNN-lengths": _rnn("RNN", lengths=True),
    "LSTMCell-layer_norm": _cell("LSTMCell", layer_norm=True),
    "GRUCell-layer_norm": _cell("GRUCell", layer_norm=True),
    "LocallyConnected2d": _other("LocallyConnected2d"),
    "AttentionPooling-additive": _other("AttentionPooling"),
}


def _loss(call) -> torch.Tensor:
    """A weighted sum of every output and final state of one call."""
    out = call()
    outs = [t for t in (out if isinstance(out, tuple) else (out,))
            for t in (t if isinstance(t, tuple) else (t,))]
    return sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outs)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of ``a`` and ``b`` overlaps (the bytes each spans in its storage)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        start = t.storage_offset() * t.element_size()
        return start, start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_accumulate_and_clip_as_torch_nns(case, backend):
    dtype = torch.float32 if backend == "triton" else torch.float64
    torch.manual_seed(0)
    module, call = CASES[case](dtype)
    module.train()
    with fastlayers.backend(backend):
        _loss(call).backward()
        once = {n: p.grad.clone() for n, p in module.named_parameters()}
        grads = [(n, p.grad) for n, p in module.named_parameters()]
        shared = [(a, b) for (a, ga), (b, gb) in itertools.combinations(grads, 2) if _overlap(ga, gb)]
        assert not shared, f"parameters whose .grad share memory: {shared}"

        # an in-place clip scales each gradient once (as after torch.nn's backward)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in once.values()]))
        torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm=0.5 * total.item())
        for n, p in module.named_parameters():
            torch.testing.assert_close(p.grad, once[n] * (0.5 * total / (total + 1e-6)), msg=n)

        # two passes (two forwards, as gradient accumulation; then one graph retained and backwarded twice)
        module.zero_grad(set_to_none=True)
        _loss(call).backward()
        _loss(call).backward()
        for n, p in module.named_parameters():
            torch.testing.assert_close(p.grad, 2 * once[n], msg=n)
        module.zero_grad(set_to_none=True)
        loss = _loss(call)
        loss.backward(retain_graph=True)
        loss.backward()
        for n, p in module.named_parameters():
            torch.testing.assert_close(p.grad, 2 * once[n], msg=n)
