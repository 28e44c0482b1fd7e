"""TorchScript: torch.jit.trace records the calls made of torch ops or operators (equal to eager at
another shape than the traced one; the locally connected layers' reference up to float32 rounding) and raises one clear error, naming torch.export, for the engine's
calls; torch.jit.script raises one clear error for every fastlayers module, also inside a model."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fastlayers

pytestmark = pytest.mark.reference_only  # (see pyproject's markers)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


TRACEABLE = {
    "LSTM": (lambda: fastlayers.LSTM(4, 5, bidirectional=True), (torch.randn(5, 3, 4),), (torch.randn(7, 2, 4),)),
    "GRU": (lambda: fastlayers.GRU(4, 5), (torch.randn(5, 3, 4),), (torch.randn(7, 2, 4),)),
    "RNN": (lambda: fastlayers.RNN(4, 5), (torch.randn(5, 3, 4),), (torch.randn(7, 2, 4),)),
    "LSTMCell layer_norm": (lambda: fastlayers.LSTMCell(4, 5, layer_norm=True, peephole=True).eval(),
                            (torch.randn(3, 4),), (torch.randn(6, 4),)),
    "GRUCell": (lambda: fastlayers.GRUCell(4, 5), (torch.randn(3, 4),), (torch.randn(6, 4),)),
    "LocallyConnected2d": (lambda: fastlayers.LocallyConnected2d(2, 3, (6, 6), 3), (torch.randn(2, 2, 6, 6),),
                           (torch.randn(4, 2, 6, 6),)),
    "LocallyConnected1d": (lambda: fastlayers.LocallyConnected1d(2, 3, 6, 3), (torch.randn(2, 2, 6),),
                           (torch.randn(4, 2, 6),)),
}


@pytest.mark.parametrize("name", list(TRACEABLE))
def test_trace_equals_eager_at_another_shape(name):
    build, example, other = TRACEABLE[name]
    torch.manual_seed(0)
    module = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(module, example)
    # the locally connected layers' trace records their plain-PyTorch reference (torch ops, which
    # torch.jit.save takes), eager calls run the C kernels: equal up to the order of float32 sums
    exact = not name.startswith("LocallyConnected")
    torch.testing.assert_close(_first(traced(*other)), _first(module(*other)), rtol=0 if exact else 1e-5,
                               atol=0 if exact else 1e-6)


class _Pooling(nn.Module):  # as a user's model: a projection of the keys, then attention pooling with lengths
    def __init__(self, score):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.pool = fastlayers.AttentionPooling(6, score=score, attention_size=4 if score == "additive" else None)

    def forward(self, q, k, lengths):
        return self.pool(q, self.proj(k), lengths=lengths)[0]


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
def test_attention_pooling_with_lengths_traces_and_runs_again(score, tmp_path):
    """torch.jit.trace's check (a second trace, without gradients) found another graph: the padded
    weights' masking was recorded only with gradients. A saved trace's second call with gradients on
    (libtorch's default) raised "a view of a leaf Variable ... in-place": the scores' in-place ops."""
    torch.manual_seed(0)
    model = _Pooling(score).eval()
    q, k, lengths = torch.randn(4, 6), torch.randn(4, 7, 6), torch.tensor([7, 3, 5, 1])
    traced = torch.jit.trace(model, (q, k, lengths))  # (the default check_trace)
    torch.jit.save(traced, tmp_path / "pool.pt")
    loaded = torch.jit.load(tmp_path / "pool.pt")
    k2, lengths2 = torch.randn(3, 9, 6), torch.tensor([2, 9, 4])
    for _ in range(3):
        torch.testing.assert_close(loaded(q[:3], k2, lengths2), model(q[:3], k2, lengths2), rtol=1e-6, atol=1e-7)


class _WithLengths(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, lengths):
        return self.layer(x, lengths=lengths)[0]


@pytest.mark.parametrize("build,lengths", [
    (lambda: fastlayers.LSTM(4, 5, layer_norm=True), None),
    (lambda: fastlayers.GRU(4, 5, zoneout=0.1), None),
    (lambda: fastlayers.LSTM(4, 5), torch.tensor([5, 3, 2])),
    (lambda: fastlayers.RNN(4, 5), torch.tensor([5, 3, 2])),
])
def test_trace_of_an_engine_call_names_torch_export(build, lengths):
    module, x = build(), torch.randn(5, 3, 4)
    model, example = (module, (x,)) if lengths is None else (_WithLengths(module), (x, lengths))
    with pytest.raises(RuntimeError, match=r"^torch.jit.trace cannot record fastlayers\.\w+ with .*torch\.export\.export"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            torch.jit.trace(model, example)


class _Model(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer, self.head = layer, nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.layer(x)[0])


@pytest.mark.parametrize("build", [lambda: fastlayers.LSTM(4, 5), lambda: fastlayers.GRU(4, 5, layer_norm=True),
                                   lambda: fastlayers.RNN(4, 5), lambda: fastlayers.LSTMCell(4, 5),
                                   lambda: fastlayers.LocallyConnected2d(2, 3, 4),
                                   lambda: fastlayers.AttentionPooling(4)])
def test_script_raises_one_clear_error(build):
    module = build()
    with pytest.raises(RuntimeError, match=rf"^torch.jit.script cannot compile fastlayers\.{type(module).__name__} "
                                           r".*torch\.export\.export"):
        torch.jit.script(module)
    if isinstance(module, (fastlayers.LSTM, fastlayers.GRU, fastlayers.RNN)):
        model = _Model(module)
        with pytest.raises(RuntimeError, match=r"^torch.jit.script cannot compile"):
            torch.jit.script(model)
        assert model.layer is module  # the model is left as it was
