"""Edge shapes as torch.nn handles them, on every backend (issue 62): an empty batch (B = 0) returns
empty outputs and states on the autograd graph (zero parameter gradients, an empty input
gradient), with or without lengths (then an empty lengths vector), for every recurrent layer and
cell option, the cells, the locally connected layers and attention pooling; T = 0 raises torch's
own error. Shapes are checked against the torch.nn counterpart of the same configuration."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastlayers

BACKENDS = ["cpu", "reference", "triton"]  # triton: CPU tensors under the interpreter (nothing runs at B = 0)
LAYER_OPTIONS = {
    "plain": {},
    "layer_norm": dict(layer_norm=True),
    "peephole + cell_clip": dict(peephole=True, cell_clip=2.0),
    "zoneout": dict(zoneout=0.1),
    "recurrent_dropout": dict(recurrent_dropout=0.2),
    "proj_size": dict(proj_size=2),
    "checkpoint_every": dict(checkpoint_every=2, layer_norm=True),
}
LSTM_ONLY = ("peephole + cell_clip", "proj_size")


def _layers():
    for mode in ("LSTM", "GRU", "RNN"):
        for name, options in LAYER_OPTIONS.items():
            if (mode != "LSTM" and name in LSTM_ONLY) or (mode == "RNN" and name != "plain"):
                continue
            yield pytest.param(mode, options, id=f"{mode}-{name}")


def _states(result):
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("mode, options", list(_layers()))
def test_empty_batch_returns_empty_outputs_and_states(mode, options, with_lengths, batch_first, backend):
    torch.manual_seed(0)
    kwargs = dict(num_layers=2, bidirectional=True, batch_first=batch_first)
    ours = getattr(fastlayers, mode)(4, 3, **kwargs, **options).train()
    theirs = getattr(nn, mode)(4, 3, **kwargs, proj_size=options.get("proj_size", 0)) if mode == "LSTM" \
        else getattr(nn, mode)(4, 3, **kwargs)
    x = torch.zeros((0, 5, 4) if batch_first else (5, 0, 4), requires_grad=True)
    want_out, want_states = theirs(x)
    with fastlayers.backend(backend):
        out, states = ours(x, lengths=torch.zeros(0, dtype=torch.long) if with_lengths else None)
    assert out.shape == want_out.shape and out.dtype == x.dtype
    assert [s.shape for s in _states(states)] == [s.shape for s in _states(want_states)]
    (out.sum() + sum(s.sum() for s in _states(states))).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for name, p in ours.named_parameters():
        assert p.grad is not None and not p.grad.any(), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, options", list(_layers()))
def test_empty_batch_with_given_states(mode, options, backend):
    ours = getattr(fastlayers, mode)(4, 3, bidirectional=True, **options)
    out_size = options.get("proj_size", 3)
    hx = (torch.zeros(2, 0, out_size), torch.zeros(2, 0, 3)) if mode == "LSTM" else torch.zeros(2, 0, 3)
    with fastlayers.backend(backend):
        out, states = ours(torch.zeros(5, 0, 4), hx)
    assert out.shape == (5, 0, 2 * out_size)
    assert [s.shape for s in _states(states)] == [s.shape for s in _states(hx)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, options", list(_layers()))
def test_no_time_steps_raise_torchs_error(mode, options, backend):
    ours = getattr(fastlayers, mode)(4, 3, **options)
    theirs = getattr(nn, mode)(4, 3)
    for x in (torch.zeros(0, 2, 4), torch.zeros(0, 4)):
        with pytest.raises(RuntimeError, match="Expected sequence length to be larger than 0 in RNN"):
            theirs(x)
        with fastlayers.backend(backend), pytest.raises(RuntimeError,
                                                        match="Expected sequence length to be larger than 0 in RNN"):
            ours(x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, options", [("LSTMCell", {}), ("LSTMCell", dict(layer_norm=True, zoneout=0.1)),
                                           ("GRUCell", {}), ("GRUCell", dict(layer_norm=True)), ("RNNCell", {})])
def test_cells_on_an_empty_batch(mode, options, backend):
    ours = getattr(fastlayers, mode)(4, 3, **options)
    x = torch.zeros(0, 4, requires_grad=True)
    with fastlayers.backend(backend):
        result = ours(x)
    states = _states(result)
    assert [s.shape for s in states] == [(0, 3)] * len(states)
    sum(s.sum() for s in states).backward()
    assert x.grad.shape == (0, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_local_layers_and_attention_on_an_empty_batch(backend):
    with fastlayers.backend(backend):
        x = torch.zeros(0, 2, 4, 4, requires_grad=True)
        y = fastlayers.LocallyConnected2d(2, 3, (4, 4), 3, padding=1)(x)
        assert y.shape == nn.Conv2d(2, 3, 3, padding=1)(x).shape
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert fastlayers.LocallyConnected1d(2, 3, 8, 3)(torch.zeros(0, 2, 8)).shape == (0, 3, 6)
        context, weights = fastlayers.AttentionPooling(4, 4)(torch.zeros(0, 4), torch.zeros(0, 5, 4))
        assert context.shape == (0, 4) and weights.shape == (0, 5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layer", ["LocallyConnected2d", "LocallyConnected1d", "AttentionPooling-additive"])
def test_empty_batch_gives_zero_parameter_gradients(layer, dtype, backend):
    """As torch.nn.Conv2d / Linear: a sum over no sequences is zero, for every parameter (the C kernel
    of the local layers' parameter gradients left them unwritten at B = 0: NaN or stale memory)."""
    torch.manual_seed(0)
    if layer == "LocallyConnected2d":
        module, inputs = fastlayers.LocallyConnected2d(2, 3, (5, 4), (3, 2), stride=(1, 2), padding=1, dtype=dtype), \
            [torch.zeros(0, 2, 5, 4, dtype=dtype)]
    elif layer == "LocallyConnected1d":
        module, inputs = fastlayers.LocallyConnected1d(2, 3, 9, 3, stride=2, dtype=dtype), [torch.zeros(0, 2, 9, dtype=dtype)]
    else:
        module, inputs = fastlayers.AttentionPooling(4, 6, score="additive", attention_size=5, dtype=dtype), \
            [torch.zeros(0, 4, dtype=dtype), torch.zeros(0, 7, 6, dtype=dtype)]
    inputs = [t.requires_grad_() for t in inputs]
    with fastlayers.backend(backend):
        out = module(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(outs, [*inputs, *module.parameters()], [torch.ones_like(o) for o in outs])
    for t, g in zip(inputs, grads):
        assert g.shape == t.shape
    for (name, p), g in zip(module.named_parameters(), grads[len(inputs):], strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype, name
        assert torch.equal(g, torch.zeros_like(p)), f"{name}: {g.flatten()[:4]}"
