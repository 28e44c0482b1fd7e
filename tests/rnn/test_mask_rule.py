"""The training masks every engine draws follow the documented rule (rnn/_masks.py, _common.py):
zoneout keep-masks of h and c with probabilities z_h and z_c, the recurrent-dropout mask kept with
1 - p and scaled by 1 / (1 - p), dropout between layers only. Checked without randomness: with
every keep-mask replaced by its expectation (a tensor full of its probability), a training call
computes exactly what the eval call does (eval zoneout is the expectation; an expected recurrent
mask is 1), on every engine, with and without lengths, varlen and checkpoint_every, and for the
cells; the probabilities asked for are the options' own. The engine-versus-reference tests pass
masks in; a swapped z_h / z_c or a missing 1 / keep passed them all.

Dropout between layers (F.dropout, not a keep-mask) is checked apart: a training call of three
layers applies it after the first two only (a dropout after the last layer zeroes outputs)."""

from __future__ import annotations

import importlib

import pytest
import torch

import fastlayers

BACKENDS = ["cpu", "triton", "reference"]  # triton: CPU tensors under the interpreter (conftest)
# every module that binds keep_mask by name
_BINDERS = ["_masks", "_common", "_reference", "_remat", "_cells", "_gpu_cell"]
Z_H, Z_C, P = 0.1, 0.3, 0.25  # distinct: a swapped or unscaled mask shows


@pytest.fixture
def expected_masks(monkeypatch):
    """keep_mask -> its expectation everywhere; returns the probabilities asked for."""
    asked: list[float] = []

    def expectation(shape, p, dtype, device):
        asked.append(round(float(p), 12))
        return torch.full(tuple(shape), float(p), dtype=dtype, device=device)

    for name in _BINDERS:
        monkeypatch.setattr(importlib.import_module(f"fastlayers.rnn.{name}"), "keep_mask", expectation)
    return asked


LAYERS = {
    "LSTM": (fastlayers.LSTM, dict(zoneout=(Z_H, Z_C), recurrent_dropout=P), {Z_H, Z_C, 1 - P}),
    "LSTM-ln-proj": (fastlayers.LSTM, dict(zoneout=(Z_H, Z_C), recurrent_dropout=P, layer_norm=True, proj_size=3),
                     {Z_H, Z_C, 1 - P}),
    "GRU": (fastlayers.GRU, dict(zoneout=Z_H, recurrent_dropout=P), {Z_H, 1 - P}),
    "GRU-ln": (fastlayers.GRU, dict(zoneout=Z_H, recurrent_dropout=P, layer_norm=True), {Z_H, 1 - P}),
}
CALLS = ["padded", "lengths", "varlen", "checkpoint_every"]
LENGTHS = [7, 3, 5, 1]


def _call(layer, how: str, x: torch.Tensor):
    if how == "varlen":
        values = torch.cat([x[:n, b] for b, n in enumerate(LENGTHS)])
        cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
        return layer(values, cu_seqlens=cu)
    return layer(x, lengths=LENGTHS if how == "lengths" else None)


def _cases():
    """every layer x call x backend, but checkpoint_every on Triton's interpreter for the layers
    without LayerNorm only (the same segments; 8-14 s each with it under the interpreter)"""
    for name in LAYERS:
        for how in CALLS:
            for backend in BACKENDS:
                if not (backend == "triton" and how == "checkpoint_every" and "-ln" in name):
                    yield pytest.param(name, how, backend, id=f"{name}-{how}-{backend}")


@pytest.mark.parametrize("name, how, backend", list(_cases()))
def test_expected_masks_make_training_equal_eval(name, how, backend, expected_masks):
    cls, options, probabilities = LAYERS[name]
    if how == "checkpoint_every":
        options = {**options, "checkpoint_every": 2}
    torch.manual_seed(0)
    layer = cls(4, 5, num_layers=2, bidirectional=True, dtype=torch.float64, **options)
    x = torch.randn(7, 4, 4, dtype=torch.float64)
    with fastlayers.backend(backend):
        want = _call(layer.eval(), how, x)
        assert expected_masks == []
        got = _call(layer.train(), how, x)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert set(expected_masks) == {round(p, 12) for p in probabilities}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls, options", [
    (fastlayers.LSTMCell, dict(zoneout=(Z_H, Z_C), recurrent_dropout=P, layer_norm=True)),
    (fastlayers.GRUCell, dict(zoneout=Z_H, recurrent_dropout=P)),
], ids=["LSTMCell", "GRUCell"])
def test_expected_masks_make_a_cell_step_equal_eval(cls, options, backend, expected_masks):
    torch.manual_seed(0)
    cell = cls(4, 5, dtype=torch.float64, **options)
    x = torch.randn(3, 4, dtype=torch.float64)
    state = (torch.randn(3, 5, dtype=torch.float64),) * (2 if cls is fastlayers.LSTMCell else 1)
    state = state if cls is fastlayers.LSTMCell else state[0]
    with fastlayers.backend(backend):
        assert cell.eval().recurrent_mask(3) is None
        want = cell(x, state)
        mask = cell.train().recurrent_mask(3)  # (one per sequence: the expectation of mask / keep is 1)
        got = cell(x, state, recurrent_mask=mask)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    z = options["zoneout"]
    assert set(expected_masks) == {round(p, 12) for p in ({*z} if isinstance(z, tuple) else {z}) | {1 - P}}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, options", [("LSTM", {}), ("LSTM", dict(layer_norm=True)), ("GRU", {}),
                                           ("GRU", dict(layer_norm=True)), ("RNN", {})])
@pytest.mark.parametrize("lengths", [None, LENGTHS])
def test_dropout_between_layers_only(mode, options, lengths, backend, monkeypatch):
    """Three layers with dropout=0.5 in training: F.dropout after the first two layers' outputs
    (p = 0.5, training), never after the last (there the output keeps no dropped zeros)."""
    torch.manual_seed(0)
    layer = getattr(fastlayers, mode)(4, 5, num_layers=3, dropout=0.5, bidirectional=True, dtype=torch.float64,
                                      **options).train()
    x = torch.randn(7, 4, 4, dtype=torch.float64)
    calls = []
    dropout = torch.nn.functional.dropout

    def counting(t, p=0.5, training=True, inplace=False):
        calls.append((p, training))
        return dropout(t, p, training, inplace)

    monkeypatch.setattr(torch.nn.functional, "dropout", counting)
    with fastlayers.backend(backend):
        out = layer(x, lengths=lengths)[0]
    valid = (torch.arange(7)[:, None] < torch.tensor(lengths or [7] * 4)).unsqueeze(-1).expand_as(out)
    assert not (out[valid] == 0).any()
    if options or lengths is not None:  # (plain layers without lengths: torch's fused kernel, dropout inside it)
        assert calls == [(0.5, True)] * 2
