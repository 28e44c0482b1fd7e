"""Backwards whose incoming gradients are batched by autograd's own vmap: ``torch.autograd.grad(...,
is_grads_batched=True)`` and ``torch.autograd.functional.jacobian(..., vectorize=True)`` over every
layer, on the CPU kernels and the Triton engine (interpreter), as they run over torch.nn's.

Before, the kernels' backwards took the batched gradient to their raw-memory kernels and ``out=``
ops and raised ("Batching rule not implemented for aten::index_select.out"); now they recompute with
the reference (fastlayers._core.twice.recording). The Jacobian equals the one built a row at a time
by ordinary backwards (vectorize=False), and torch.nn.LSTM's with the same weights, in float64."""

from __future__ import annotations

import os

import pytest
import torch
from torch.autograd.functional import jacobian

import fastlayers

pytestmark = pytest.mark.reference_only  # the batched backwards run the reference's ops (pyproject's markers)

triton = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                            reason="no GPU and Triton's interpreter is off")
LENGTHS = torch.tensor([5, 3, 4])


def _rnn(cls, with_lengths=False, **options):
    def make():
        torch.manual_seed(0)
        m = cls(4, 3, **options).double().eval()  # as constructed
        kwargs = {"lengths": LENGTHS} if with_lengths else {}
        return (lambda x: m(x, **kwargs)[0]), torch.randn(5, 3, 4, dtype=torch.float64)
    return make


def _cell():
    torch.manual_seed(0)
    m = fastlayers.LSTMCell(4, 3, layer_norm=True).double()
    return (lambda x: m(x)[0]), torch.randn(3, 4, dtype=torch.float64)


def _local(two_d):
    def make():
        torch.manual_seed(0)
        if two_d:
            return fastlayers.LocallyConnected2d(2, 3, 4, 3).double(), torch.randn(2, 2, 4, 4, dtype=torch.float64)
        return fastlayers.LocallyConnected1d(2, 3, 6, 3).double(), torch.randn(2, 2, 6, dtype=torch.float64)
    return make


def _attention(score):
    def make():
        torch.manual_seed(0)
        m = fastlayers.AttentionPooling(4, 4, score=score).double()
        keys = torch.randn(3, 5, 4, dtype=torch.float64)
        return (lambda q: m(q, keys, lengths=torch.tensor([5, 2, 4]))[0]), torch.randn(3, 4, dtype=torch.float64)
    return make


CASES = {
    "LSTM lengths": _rnn(fastlayers.LSTM, True),
    "LSTM layer_norm bidirectional 2 layers": _rnn(fastlayers.LSTM, layer_norm=True, bidirectional=True,
                                                   num_layers=2),
    "LSTM peephole cell_clip lengths": _rnn(fastlayers.LSTM, True, peephole=True, cell_clip=0.5),
    "LSTM proj_size": _rnn(fastlayers.LSTM, proj_size=2),
    "LSTM layer_norm checkpoint_every": _rnn(fastlayers.LSTM, layer_norm=True, checkpoint_every=2),
    "GRU layer_norm bidirectional lengths": _rnn(fastlayers.GRU, True, layer_norm=True, bidirectional=True),
    "GRU lengths": _rnn(fastlayers.GRU, True),
    "RNN lengths": _rnn(fastlayers.RNN, True),
    "LSTMCell layer_norm": _cell,
    "LocallyConnected1d": _local(False),
    "LocallyConnected2d": _local(True),
    "AttentionPooling dot": _attention("dot"),
    "AttentionPooling additive": _attention("additive"),
}
TRITON_CASES = ["LSTM layer_norm bidirectional 2 layers", "GRU layer_norm bidirectional lengths", "LocallyConnected2d",
                "AttentionPooling dot"]


def _jacobians(name, backend):
    fn, x = CASES[name]()

    def call(x):
        with fastlayers.backend(backend):
            return fn(x)

    return jacobian(call, x, vectorize=True), jacobian(call, x, vectorize=False)


@pytest.mark.parametrize("name", list(CASES))
def test_vectorized_jacobian_equals_the_row_by_row_one(name):
    batched, rows = _jacobians(name, "cpu")
    assert rows.abs().sum() > 0
    torch.testing.assert_close(batched, rows, rtol=1e-10, atol=1e-12)


@triton
@pytest.mark.parametrize("name", TRITON_CASES)
def test_vectorized_jacobian_on_the_triton_engine(name):
    """The whole vectorized Jacobian against the row-by-row one of the CPU engine (the interpreter
    takes about 2 s per ordinary backward of these layers: 90 rows would be minutes), and two of its
    rows against the Triton engine's own ordinary backward."""
    fn, x = CASES[name]()

    def call(x, backend):
        with fastlayers.backend(backend):
            return fn(x)

    batched = jacobian(lambda x: call(x, "triton"), x, vectorize=True)
    rows = jacobian(lambda x: call(x, "cpu"), x, vectorize=False)
    assert rows.abs().sum() > 0
    torch.testing.assert_close(batched, rows, rtol=1e-10, atol=1e-12)
    x = x.clone().requires_grad_()
    out = call(x, "triton")
    flat = batched.reshape(out.numel(), *x.shape)
    for row in (0, out.numel() - 1):  # first and last output element
        (grad,) = torch.autograd.grad(out.reshape(-1)[row], x, retain_graph=True)
        torch.testing.assert_close(flat[row], grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_is_grads_batched_equals_torch_nn_with_the_same_weights(cls):
    """Per-output-row gradients of the input and of every weight, in one batched backward, equal
    torch.nn's (which supports it) on a bidirectional layer with lengths (torch: PackedSequence)."""
    torch.manual_seed(0)
    ours = getattr(fastlayers, cls)(4, 3, bidirectional=True, layer_norm=False).double()
    theirs = getattr(torch.nn, cls)(4, 3, bidirectional=True).double()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, 3, 4, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([5, 3, 4])
    out = ours(x, lengths=lengths)[0]
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, enforce_sorted=False)
    ref = torch.nn.utils.rnn.pad_packed_sequence(theirs(packed)[0], total_length=5)[0]
    torch.testing.assert_close(out, ref)
    grads = torch.randn(6, *out.shape, dtype=torch.float64)  # 6 cotangents at once
    got = torch.autograd.grad(out, [x, *ours.parameters()], grads, is_grads_batched=True)
    want = torch.autograd.grad(ref, [x, *theirs.parameters()], grads, is_grads_batched=True)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)
