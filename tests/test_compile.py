"""torch.compile: the C kernels are custom operators (opcheck), the local layers and attention pooling
compile with fullgraph=True, the recurrent layers too on padded input with allow_rnn, a model of
every layer compiles with default settings; outputs and gradients equal eager; graph breaks counted.

Inductor (the default backend) compiles the whole-model test and the local layers; the per-layer
fullgraph checks use the aot_eager backend, which runs the same Dynamo capture, fake
implementations and autograd registration without Inductor's code generation (seconds instead of
tens of seconds per graph on this machine)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch import nn

import fastlayers
from fastlayers._native import ops_lib
from fastlayers.rnn import _ops_compile


pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _outputs_and_grads(fn, module, inputs):
    inputs = _leaves(*inputs)
    out = fn(*inputs)
    flat = [out] if isinstance(out, torch.Tensor) else [t for o in out for t in ((o,) if isinstance(o, torch.Tensor) else o)]
    g = torch.Generator().manual_seed(0)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in flat)
    params = list(module.parameters()) if module is not None else []
    grads = torch.autograd.grad(loss, inputs + params)
    return [o.detach() for o in flat], grads


def _assert_compiled_equals_eager(fn, module, inputs, **compile_kwargs):
    eager = _outputs_and_grads(fn, module, inputs)
    compiled = _outputs_and_grads(torch.compile(fn, **compile_kwargs), module, inputs)
    for a, b in zip(eager[0] + list(eager[1]), compiled[0] + list(compiled[1]), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def _graph_breaks(fn, *args, **kwargs) -> int:
    return torch._dynamo.explain(fn)(*args, **kwargs).graph_break_count


@pytest.mark.parametrize("dims", [1, 2])
def test_locally_connected_fullgraph(dims):
    torch.manual_seed(0)
    if dims == 2:
        m = fastlayers.LocallyConnected2d(2, 3, (6, 5), 3, stride=(1, 2), padding=1)
        x = torch.randn(2, 2, 6, 5)
    else:
        m = fastlayers.LocallyConnected1d(2, 3, 9, 3, dilation=2)
        x = torch.randn(2, 2, 9)
    _assert_compiled_equals_eager(m, m, [x], fullgraph=True)


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_attention_pool_fullgraph(score, with_lengths):
    torch.manual_seed(0)
    pool = fastlayers.AttentionPooling(4, score=score)
    lengths = torch.tensor([5, 2, 4]) if with_lengths else None
    q, k, v = torch.randn(3, 4), torch.randn(3, 5, 4), torch.randn(3, 5, 2)
    _assert_compiled_equals_eager(lambda q, k, v: pool(q, k, v, lengths), pool, [q, k, v], fullgraph=True,
                                  backend="aot_eager")


RECURRENT = {
    "LSTM": lambda: fastlayers.LSTM(4, 5, num_layers=2, bidirectional=True),
    "LSTM options": lambda: fastlayers.LSTM(4, 5, num_layers=2, bidirectional=True, layer_norm=True, peephole=True,
                                            cell_clip=1.0, zoneout=(0.1, 0.2)),
    "LSTM proj": lambda: fastlayers.LSTM(4, 5, bidirectional=True, proj_size=3, layer_norm=True, proj_clip=0.5),
    "GRU options": lambda: fastlayers.GRU(4, 5, bidirectional=True, layer_norm=True, zoneout=0.1),
    "RNN": lambda: fastlayers.RNN(4, 5, bidirectional=True, nonlinearity="relu"),
}


@pytest.mark.parametrize("name", list(RECURRENT))
@torch._dynamo.config.patch(allow_rnn=True)
def test_recurrent_layers_fullgraph_on_padded_input_with_allow_rnn(name):
    torch.manual_seed(0)
    m = RECURRENT[name]().eval()
    _assert_compiled_equals_eager(m, m, [torch.randn(7, 3, 4)], fullgraph=True, backend="aot_eager")
    assert _graph_breaks(m, torch.randn(7, 3, 4)) == 0


@torch._dynamo.config.patch(allow_rnn=True)
def test_reference_backend_compiles_too(monkeypatch):
    """Forced to the reference (what runs without a C compiler): the per-step torch loop is traced."""
    monkeypatch.setenv("FASTLAYERS_BACKEND", "reference")
    torch.manual_seed(0)
    lstm = fastlayers.LSTM(4, 5, bidirectional=True, layer_norm=True).eval()
    local = fastlayers.LocallyConnected2d(2, 3, (6, 5), 3, padding=1)
    with torch._dynamo.config.patch(allow_rnn=True):
        _assert_compiled_equals_eager(lstm, lstm, [torch.randn(6, 2, 4)], fullgraph=True, backend="aot_eager")
    _assert_compiled_equals_eager(local, local, [torch.randn(2, 2, 6, 5)], fullgraph=True, backend="aot_eager")


@torch._dynamo.config.patch(allow_rnn=True)
def test_lengths_cost_one_graph_break_and_no_recompilation():
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.rnn = fastlayers.LSTM(4, 5, bidirectional=True, layer_norm=True)
            self.out = nn.Linear(10, 2)

        def forward(self, x, lengths):
            return self.out(self.rnn(torch.tanh(self.inp(x)), lengths=lengths)[0])

    m = Model().eval()
    x = torch.randn(7, 3, 4)
    assert _graph_breaks(m, x, torch.tensor([7, 2, 5])) == 1  # at the recurrent layer's call
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, backend=counter)
    for lengths in ([7, 2, 5], [3, 7, 1], [6, 6, 2]):
        torch.testing.assert_close(compiled(x, torch.tensor(lengths)), m(x, torch.tensor(lengths)))
    assert counter.frame_count == 2  # the graphs before and after the layer, compiled once for every lengths


class EveryLayer(nn.Module):
    """A model of every fastlayers layer: LSTM with options and lengths, GRU, RNN, attention pooling,
    a locally connected 1-D layer over the pooled features."""

    def __init__(self):
        super().__init__()
        self.lstm = fastlayers.LSTM(4, 6, bidirectional=True, layer_norm=True, peephole=True)
        self.gru = fastlayers.GRU(12, 6, layer_norm=True)
        self.rnn = fastlayers.RNN(6, 6)
        self.pool = fastlayers.AttentionPooling(6, score="additive")
        self.local = fastlayers.LocallyConnected1d(1, 2, 6, 3, padding=1)

    def forward(self, x, lengths):
        y, _ = self.lstm(x, lengths=lengths)
        y, h = self.gru(y)
        y, _ = self.rnn(y)
        ctx, _ = self.pool(h[-1], y.transpose(0, 1), lengths=lengths)
        return self.local(ctx.unsqueeze(1)).flatten(1)


def test_a_model_of_every_layer_compiles_with_default_settings():
    torch.manual_seed(0)
    m = EveryLayer().eval()
    lengths = torch.tensor([7, 3, 5])
    _assert_compiled_equals_eager(lambda x: m(x, lengths), m, [torch.randn(7, 3, 4)])
    # without allow_rnn Dynamo does not trace nn.RNNBase subclasses (as for torch.nn.LSTM): each
    # recurrent layer runs eagerly between compiled graphs
    assert _graph_breaks(m, torch.randn(7, 3, 4), lengths) >= 1


def test_custom_operators_pass_opcheck():
    assert ops_lib.load()  # the C++ operators (locally_connected2d)
    torch.manual_seed(0)
    w, b = torch.randn(3, 2, 3, 3, 4, 3, requires_grad=True), torch.randn(3, 4, 3, requires_grad=True)
    x = torch.randn(2, 2, 6, 5, requires_grad=True)
    torch.library.opcheck(torch.ops.fastlayers.locally_connected2d, (x, w, b, [1, 2], [1, 1], [1, 1]))
    d, n, batch, f, h = 2, 12, 4, 3, 5
    r = lambda *s: torch.randn(*s, requires_grad=True)  # noqa: E731
    active = torch.tensor([4, 4, 2, 2])
    torch.library.opcheck(_ops_compile.lstm_layer, (r(d, n, f), r(d, 4 * h, f), r(d, 4 * h), r(d, 4 * h), r(d, batch, h),
                                            r(d, batch, h), r(d, 4 * h, h), r(d, 4 * h), r(d, h), r(d, h), r(d, 3 * h),
                                            None, None, None, None, active, [1.5, 0.0, 0.0, 0.0]))
    torch.library.opcheck(_ops_compile.gru_layer, (r(d, n, f), r(d, 3 * h, f), None, r(d, 3 * h), r(d, batch, h),
                                           r(d, 3 * h, h), r(d, 3 * h), None, None, None, active, [0.0]))
