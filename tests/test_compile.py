"""torch.compile: the C kernels are custom operators (opcheck), the local layers and attention pooling
compile with fullgraph=True, the recurrent layers too on padded input with allow_rnn, a model of
every layer compiles with default settings; outputs and gradients equal eager; graph breaks counted;
the export operators (torch.export's) pass opcheck and differentiate twice.

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


@pytest.mark.parametrize("name", ["LSTM options", "LSTM proj", "GRU options"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@torch._dynamo.config.patch(allow_rnn=True)
def test_a_new_t_and_b_every_call_compile_once(name, grad):
    """Padded calls of a layer with cell options, a new (T, B) every call, dynamic=True: one graph
    (the engine's active-row counts were a tuple of T Python ints, which specialised the graph on T
    and B: a recompile per shape, and with fullgraph=True the ninth shape raised
    FailOnRecompileLimitHit); values and input gradients equal eager's."""
    torch.manual_seed(0)
    m = RECURRENT[name]().eval()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for steps, batch in [(3, 2), (5, 3), (9, 2), (4, 5), (11, 4), (6, 2), (7, 3), (8, 6), (10, 2), (12, 3)]:
        x = torch.randn(steps, batch, 4, requires_grad=grad)
        with torch.set_grad_enabled(grad):
            got, want = compiled(x)[0], m(x)[0]
        torch.testing.assert_close(got, want)
        if grad:
            torch.testing.assert_close(*(torch.autograd.grad(y.square().sum(), x)[0] for y in (got, want)))
        frames.append(counter.frame_count)
    assert frames == frames[:1] * len(frames), frames


CELLS = {
    "LSTMCell options": lambda: fastlayers.LSTMCell(4, 5, layer_norm=True, peephole=True, proj_size=2, cell_clip=0.5),
    "GRUCell options": lambda: fastlayers.GRUCell(4, 5, layer_norm=True, zoneout=0.2),
    "LSTMCell": lambda: fastlayers.LSTMCell(4, 5),
    "RNNCell": lambda: fastlayers.RNNCell(4, 5, nonlinearity="relu"),
}


@pytest.mark.parametrize("name", list(CELLS))
def test_cells_in_a_step_loop_fullgraph(name):
    """A decoder's per-step loop over a cell compiles to one graph (torch.nn's cells do): a cell
    with options read the backend's context variable first, which Dynamo cannot trace
    ("Unsupported method call")."""
    torch.manual_seed(0)
    cell = CELLS[name]().eval()

    def loop(xs):
        state, outs = None, []
        for t in range(xs.size(0)):
            state = cell(xs[t], state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        return torch.stack(outs)

    _assert_compiled_equals_eager(loop, cell, [torch.randn(3, 2, 4)], fullgraph=True, backend="aot_eager")
    assert _graph_breaks(loop, torch.randn(3, 2, 4)) == 0


@pytest.mark.parametrize("name", list(RECURRENT) + list(CELLS))
@torch._dynamo.config.patch(allow_rnn=True)
def test_modules_compile_fullgraph_before_any_eager_call(name):
    """A module compiled before its first eager call: the options' cached ``plain`` was filled at
    that first read, under Dynamo, which refused cached_property's lock (Python 3.11: "Unsupported
    context manager"); every test above ran the module eagerly first."""
    torch.manual_seed(0)
    module = (RECURRENT | CELLS)[name]().eval()
    x = torch.randn(2, 4) if name in CELLS else torch.randn(5, 2, 4)
    got = torch.compile(module, fullgraph=True, backend="eager")(x)  # (Dynamo's tracing is what failed; aot_eager
    want = module(x)  # fails torch.nn.LSTM's own plain layer here, parameters with grad and an input without)
    for a, b in zip(_flat(got), _flat(want), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _flat(out):
    return [out] if isinstance(out, torch.Tensor) else [t for o in out for t in ((o,) if isinstance(o, torch.Tensor) else o)]


def test_cell_training_masks_compiled_draw_the_eager_masks():
    """Training zoneout and recurrent dropout inside a compiled step loop draw what the eager loop
    draws from the same seed (aot_eager keeps torch's random numbers)."""
    cell = fastlayers.LSTMCell(4, 5, layer_norm=True, zoneout=(0.2, 0.3), recurrent_dropout=0.3).train()

    def loop(xs):
        state, outs, mask = None, [], cell.recurrent_mask(xs.size(1))
        for t in range(xs.size(0)):
            state = cell(xs[t], state, recurrent_mask=mask)
            outs.append(state[0])
        return torch.stack(outs)

    compiled = torch.compile(loop, fullgraph=True, backend="aot_eager")
    xs = torch.randn(4, 3, 4)
    torch.manual_seed(5)
    eager = loop(xs)
    torch.manual_seed(5)
    torch.testing.assert_close(compiled(xs), eager, rtol=1e-6, atol=1e-6)


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
    the three cells over the pooled features, locally connected 1-D and 2-D layers after them."""

    def __init__(self):
        super().__init__()
        self.lstm = fastlayers.LSTM(4, 6, bidirectional=True, layer_norm=True, peephole=True)
        self.gru = fastlayers.GRU(12, 6, layer_norm=True)
        self.rnn = fastlayers.RNN(6, 6)
        self.pool = fastlayers.AttentionPooling(6, score="additive")
        self.lstm_cell = fastlayers.LSTMCell(6, 6, layer_norm=True)
        self.gru_cell = fastlayers.GRUCell(6, 6)
        self.rnn_cell = fastlayers.RNNCell(6, 6)
        self.local = fastlayers.LocallyConnected1d(1, 2, 6, 3, padding=1)
        self.local2d = fastlayers.LocallyConnected2d(1, 1, (2, 6), 3, padding=1)

    def forward(self, x, lengths):
        y, _ = self.lstm(x, lengths=lengths)
        y, h = self.gru(y)
        y, _ = self.rnn(y)
        ctx, _ = self.pool(h[-1], y.transpose(0, 1), lengths=lengths)
        ctx = self.rnn_cell(self.gru_cell(self.lstm_cell(ctx)[0]))
        return self.local2d(self.local(ctx.unsqueeze(1)).unsqueeze(1)).flatten(1)


def test_a_model_of_every_layer_compiles_with_default_settings():
    torch.manual_seed(0)
    m = EveryLayer().eval()
    lengths = torch.tensor([7, 3, 5])
    _assert_compiled_equals_eager(lambda x: m(x, lengths), m, [torch.randn(7, 3, 4)])
    # without allow_rnn Dynamo does not trace nn.RNNBase subclasses (as for torch.nn.LSTM): each
    # recurrent layer runs eagerly between compiled graphs
    assert _graph_breaks(m, torch.randn(7, 3, 4), lengths) >= 1


VARLEN = [(fastlayers.LSTM, dict(layer_norm=True, peephole=True, bidirectional=True, num_layers=2)),
          (fastlayers.LSTM, dict(proj_size=3, zoneout=0.2, cell_clip=0.5)),
          (fastlayers.GRU, dict(layer_norm=True, bidirectional=True)),
          (fastlayers.RNN, dict(nonlinearity="relu", num_layers=2))]


def _varlen_batch(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return torch.randn(sum(lengths), 6, generator=g), cu  # (6 features: no cu_seqlens length duck-sized to them)


@pytest.mark.parametrize("cls, kwargs", VARLEN, ids=lambda v: getattr(v, "__name__", None) or "-".join(v))
@torch._dynamo.config.patch(allow_rnn=True)
def test_varlen_fullgraph_with_allow_rnn_and_one_graph_for_every_batch(cls, kwargs):
    """The varlen form (issue 66) traces without a graph break (one operator per layer) and, with
    dynamic shapes, one graph serves batches of other lengths, totals and sizes; outputs and
    gradients equal eager."""
    torch.manual_seed(0)
    m = cls(6, 5, **kwargs).eval()

    def call(x, cu):
        out, h = m(x, cu_seqlens=cu)
        return out, h

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(call, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for seed, lengths in enumerate(([3, 7, 1], [5, 2, 2, 6], [1, 4], [9, 3, 3])):
        x, cu = _varlen_batch(lengths, seed)
        eager = _outputs_and_grads(lambda v: call(v, cu), m, [x])
        got = _outputs_and_grads(lambda v: compiled(v, cu), m, [x])
        for a, b in zip(got[0] + list(got[1]), eager[0] + list(eager[1]), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == frames[:1] * 4, frames  # compiled at the first batch only


@pytest.mark.parametrize("score", ["dot", "additive"])
def test_attention_pool_varlen_fullgraph_and_one_graph_for_every_batch(score):
    """attention_pool's varlen form traces as segment operations (no graph break, no host read): one
    graph for batches of other lengths, N and B; outputs and gradients equal eager."""
    torch.manual_seed(0)
    pool = fastlayers.AttentionPooling(6, score=score)

    def call(q, k, cu):
        return pool(q, k, cu_seqlens=cu)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(call, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for seed, lengths in enumerate(([3, 7, 1], [5, 2, 2, 6], [1, 4])):
        k, cu = _varlen_batch(lengths, seed)
        q = torch.randn(len(lengths), 6)
        eager = _outputs_and_grads(lambda q, k: call(q, k, cu), pool, [q, k])
        got = _outputs_and_grads(lambda q, k: compiled(q, k, cu), pool, [q, k])
        for a, b in zip(got[0] + list(got[1]), eager[0] + list(eager[1]), strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == frames[:1] * 3, frames


@torch._dynamo.config.patch(allow_rnn=True)
def test_jagged_nested_input_compiles_fullgraph():
    torch.manual_seed(0)
    m = fastlayers.GRU(6, 5, bidirectional=True, layer_norm=True).eval()
    nested = torch.nested.nested_tensor([torch.randn(n, 6) for n in (3, 5, 2)], layout=torch.jagged)
    got = torch.compile(lambda t: m(t)[0], backend="aot_eager", fullgraph=True)(nested)
    want = m(nested)[0]
    assert got.is_nested and torch.equal(got.offsets(), want.offsets())
    torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=1e-6)


@torch._dynamo.config.patch(allow_rnn=True)
@pytest.mark.parametrize("cls, kwargs", [
    (fastlayers.LSTM, {"zoneout": (0.2, 0.3), "recurrent_dropout": 0.25, "bidirectional": True}),
    (fastlayers.LSTM, {"recurrent_dropout": 0.5, "num_layers": 2, "proj_size": 3}),
    (fastlayers.GRU, {"zoneout": 0.3, "recurrent_dropout": 0.2, "bidirectional": True, "num_layers": 2}),
], ids=["LSTM-bidirectional", "LSTM-proj-2-layers", "GRU-bidirectional-2-layers"])
@torch._dynamo.config.patch(allow_rnn=True)
def test_varlen_compiled_in_training_draws_the_eager_calls_masks(cls, kwargs):
    """In training mode the compiled varlen call draws its zoneout and recurrent-dropout masks as the
    eager call does (docs/compile.md: the same masks from the same seed under aot_eager): equal
    outputs and gradients. It drew them in another order and layout (the operators' value rows,
    not the C engine's packed rows), so they differed by up to 1.5; lengths with ties here, as the
    engine's stable sort orders them."""
    torch.manual_seed(0)
    m = cls(6, 5, **kwargs).train()
    x, cu = _varlen_batch([3, 6, 2, 3, 3], 0)
    torch.manual_seed(1)
    want = _outputs_and_grads(lambda v: m(v, cu_seqlens=cu)[0], m, [x])
    torch.manual_seed(1)
    compiled = torch.compile(lambda v: m(v, cu_seqlens=cu)[0], backend="aot_eager", fullgraph=True)
    got = _outputs_and_grads(compiled, m, [x])
    for a, b in zip(got[0] + list(got[1]), want[0] + list(want[1]), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert bool(got[1][0].abs().sum() > 0)


def test_custom_operators_pass_opcheck():
    assert ops_lib.load()  # the C++ operators (locally_connected2d)
    torch.manual_seed(0)
    w, b = torch.randn(3, 2, 3, 3, 6, 3, requires_grad=True), torch.randn(3, 6, 3, requires_grad=True)
    x = torch.randn(2, 2, 6, 5, requires_grad=True)  # (output 6 x 3: padding 1, stride (1, 2))
    torch.library.opcheck(torch.ops.fastlayers.locally_connected2d, (x, w, b, [1, 2], [1, 1], [1, 1]))
    d, n, batch, f, h = 2, 12, 4, 3, 5
    r = lambda *s: torch.randn(*s, requires_grad=True)  # noqa: E731
    active = torch.tensor([4, 4, 2, 2])
    torch.library.opcheck(_ops_compile.lstm_layer, (r(d, n, f), r(d, 4 * h, f), r(d, 4 * h), r(d, 4 * h), r(d, batch, h),
                                            r(d, batch, h), r(d, 4 * h, h), r(d, 4 * h), r(d, h), r(d, h), r(d, 3 * h),
                                            None, None, None, None, active, [1.5, 0.0, 0.0, 0.0]))
    torch.library.opcheck(_ops_compile.gru_layer, (r(d, n, f), r(d, 3 * h, f), None, r(d, 3 * h), r(d, batch, h),
                                           r(d, 3 * h, h), r(d, 3 * h), None, None, None, active, [0.0]))
    # the varlen operators (issue 66): the values (12, F) of sequences 4, 4, 2, 2 and their cu_seqlens
    cu = torch.tensor([0, 4, 8, 10, 12])
    g = 4 * h
    torch.library.opcheck(torch.ops.fastlayers.lstm_varlen,
                          (r(n, f), cu, r(d, 4, h), r(d, 4, h), r(d, g, f), r(d, g, h), r(d, g), r(d, g), r(d, g),
                           r(d, g), r(d, h), r(d, h), r(d, 3 * h), None, None, None, None, 0.5, 0.0, 0.0, 0.0))
    torch.library.opcheck(torch.ops.fastlayers.gru_varlen, (r(n, f), cu, r(d, 4, h), r(d, 3 * h, f), r(d, 3 * h, h),
                                                            r(d, 3 * h), r(d, 3 * h), None, None, None, None, 0.0))
    torch.library.opcheck(torch.ops.fastlayers.rnn_varlen, (r(n, f), cu, r(d, 4, h), r(d, h, f), r(d, h, h), None,
                                                            None, True))


@torch._dynamo.config.patch(allow_rnn=True)
def test_inductor_compiles_training_masks():
    """Inductor compiles a layer in training with zoneout and recurrent dropout: the masks come from
    the fastlayers::counter_mask operator (Inductor's code for the counter hash's int64 products
    corrupted the heap), with the eager call's draws under torch's fallback_random."""
    torch.manual_seed(0)
    m = fastlayers.LSTM(6, 5, zoneout=(0.2, 0.3), recurrent_dropout=0.25, bidirectional=True).train()
    x = torch.randn(9, 3, 6)
    torch.manual_seed(1)
    want = m(x)[0]
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(1)
        got = torch.compile(lambda v: m(v)[0], backend="inductor", fullgraph=True)(x)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _second_derivative(f, x0):
    """d/dx |d f(x).sum() / dx|^2 (None where autograd reports x unused)."""
    x = x0.clone().requires_grad_()
    g, = torch.autograd.grad(f(x).sum(), x, create_graph=True)
    gg, = torch.autograd.grad(g.pow(2).sum(), x, allow_unused=True)
    return gg


@pytest.mark.parametrize("allow_rnn", [False, True])
def test_which_compiled_calls_differentiate_twice(allow_rnn):
    """docs/gradients.md: a layer inside a compiled graph gives no second derivative with respect to
    its input (None, as torch.nn.LSTM compiled with allow_rnn); the calls Dynamo leaves eager give
    the eager one, and torch.compiler.disable keeps a layer eager."""
    torch.manual_seed(0)
    ours, plain_ln = fastlayers.LSTM(3, 3), fastlayers.LSTM(3, 3, layer_norm=True)
    theirs = nn.LSTM(3, 3)
    theirs.load_state_dict(ours.state_dict())
    x0, lengths = torch.randn(4, 3, 3), torch.tensor([4, 2, 3])
    calls = {
        "torch.nn.LSTM": (theirs, {}),
        "LSTM": (ours, {}),
        "LSTM lengths": (ours, {"lengths": lengths}),
        "LSTM layer_norm": (plain_ln, {}),
    }
    in_graph = {"torch.nn.LSTM": allow_rnn, "LSTM": allow_rnn, "LSTM lengths": not allow_rnn, "LSTM layer_norm": True}
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=allow_rnn):
        for name, (m, kwargs) in calls.items():
            eager = _second_derivative(lambda x: m(x, **kwargs)[0], x0)
            compiled = torch.compile(m, backend="aot_eager")
            got = _second_derivative(lambda x: compiled(x, **kwargs)[0], x0)
            if in_graph[name]:
                assert got is None, name
            else:
                torch.testing.assert_close(got, eager, msg=name)
            kept_eager = torch.compile(lambda x: torch.compiler.disable(m)(x, **kwargs)[0] * 2, backend="aot_eager")
            torch.testing.assert_close(_second_derivative(kept_eager, x0), 4 * eager, msg=name)
    torch._dynamo.reset()


@pytest.mark.parametrize("allow_rnn", [False, True])
def test_compiled_lengths_errors_name_the_bound_as_eager_ones_do(allow_rnn):
    """Compiled, bad lengths are checked in the graph: RuntimeError (so is the eager error, a
    ValueError too) naming the broken bound (the compiled check once said only "in [1, T]")."""
    torch.manual_seed(0)
    x = torch.randn(5, 2, 3)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=allow_rnn):
        for m in (fastlayers.GRU(3, 4), fastlayers.LSTM(3, 4, layer_norm=True)):
            compiled = torch.compile(m, backend="eager")
            for f in (m, compiled):
                with pytest.raises(RuntimeError, match=r"^Length of all samples has to be greater than 0, but found an "
                                                       r"element in 'lengths' that is <= 0; lengths: every length must be "
                                                       r">= 1, got (0|a smaller one)$"):
                    f(x, lengths=torch.tensor([5, 0]))
                with pytest.raises(RuntimeError, match=r"^lengths: every length must be <= T( = 5)? \(the padded time "
                                                       r"size\), got (6|a larger one)$"):
                    f(x, lengths=torch.tensor([6, 1]))
            with pytest.raises(ValueError):
                m(x, lengths=torch.tensor([6, 1]))
    torch._dynamo.reset()


@pytest.mark.parametrize("cls", [fastlayers.LSTM, fastlayers.GRU])
@torch._dynamo.config.patch(allow_rnn=True)
def test_compiled_varlen_layers_run_once_each_and_name_a_bad_cu_seqlens(cls, monkeypatch):
    """The compiled varlen call asked for its backend with a layer's output: tracing ran the layers
    below it for real (a first call of a 2-layer model ran 4 layer operators, not 2), and a bad
    cu_seqlens raised there, inside Dynamo's "RuntimeError when trying to get real value from
    fx.Node" (the eager ValueError only as its cause)."""
    from fastlayers.rnn import _ops_varlen

    runs = []
    real = _ops_varlen._varlen_eagerly
    monkeypatch.setattr(_ops_varlen, "_varlen_eagerly", lambda *a, **k: runs.append(a[0]) or real(*a, **k))
    torch.manual_seed(0)
    m = cls(3, 4, num_layers=2)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, cu: m(x, cu_seqlens=cu), backend="aot_eager", fullgraph=True, dynamic=True)
    x, cu = torch.randn(14, 3), torch.tensor([0, 5, 7, 14])
    got = compiled(x, cu)
    assert len(runs) == 2  # one operator run per layer
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(m(x, cu_seqlens=cu))):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, cu: m(x, cu_seqlens=cu), backend="aot_eager", fullgraph=True, dynamic=True)
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected cu_seqlens\[-1\] = 14 \(the number of value rows\), "
                                         r"got 13$"):
        compiled(x, torch.tensor([0, 5, 7, 13]))
    torch._dynamo.reset()


def test_varlen_operators_differentiate_twice():
    """The varlen operators' backward (and the padded ones', whose recomputation it shares) is
    differentiable: gradgradcheck in float64, not zeros."""
    torch.manual_seed(0)
    d, f, h, batch = 2, 3, 4, 3
    cu = torch.tensor([0, 2, 7, 8])
    r = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)  # noqa: E731
    w_ih, w_hh, ln, ln_cell = r(d, 4 * h, f), r(d, 4 * h, h), r(d, 4 * h), r(d, h)

    def layer(x, h0, c0, w_ih):  # with LayerNorm (gains: ln for W_ih x and W_hh h, ln_cell with bias ln_cell)
        return torch.ops.fastlayers.lstm_varlen(x, cu, h0, c0, w_ih, w_hh, None, None, ln, ln, ln_cell, ln_cell, None,
                                                None, None, None, None, 0.0, 0.0, 0.0, 0.0)

    inputs = (r(8, f), r(d, batch, h), r(d, batch, h), w_ih)
    assert torch.autograd.gradcheck(layer, inputs) and torch.autograd.gradgradcheck(layer, inputs, fast_mode=True)
    assert ops_lib.load()
    lengths = torch.tensor([2, 5, 1])

    def padded(x, h0, c0, w_ih):
        return torch.ops.fastlayers.lstm_padded(x, lengths, h0, c0, w_ih, w_hh, None, None, None, None, None, None,
                                                None, None, None, None, None, 0.0, 0.0, 0.0, 0.0)

    inputs = (r(5, batch, f), r(d, batch, h), r(d, batch, h), w_ih)
    assert torch.autograd.gradcheck(padded, inputs, fast_mode=True) and \
        torch.autograd.gradgradcheck(padded, inputs, fast_mode=True)


def test_export_operators_pass_opcheck():
    """Schema, fake functions and autograd registration. Not test_aot_dispatch_dynamic: the operators'
    backward recomputes the layer with the eager engine, whose plan reads the lengths on the host
    (an exported program's backward runs eagerly, as ep.module() does)."""
    assert ops_lib.load()
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    d, steps, batch, f, h = 2, 5, 3, 4, 3
    lengths = torch.tensor([5, 2, 4])
    torch.library.opcheck(torch.ops.fastlayers.lstm_padded, (
        r(steps, batch, f), lengths, r(d, batch, h), r(d, batch, h), r(d, 4 * h, f), r(d, 4 * h, h), r(d, 4 * h),
        r(d, 4 * h), r(d, 4 * h), r(d, 4 * h), r(d, h), r(d, h), r(d, 3 * h), None, None, None, None, 0.5, 0.1, 0.2,
        0.0), test_utils=checks)
    torch.library.opcheck(torch.ops.fastlayers.gru_padded, (
        r(steps, batch, f), None, r(d, batch, h), r(d, 3 * h, f), r(d, 3 * h, h), r(d, 3 * h), r(d, 3 * h), None, None,
        None, None, 0.0), test_utils=checks)
    torch.library.opcheck(torch.ops.fastlayers.rnn_padded, (
        r(steps, batch, f), lengths, r(d, batch, h), r(d, h, f), r(d, h, h), r(d, h), r(d, h), True), test_utils=checks)


def test_export_operators_refuse_operands_of_other_shapes():
    """The C++ operators check every operand their kernels read through a raw pointer (they read
    the sizes the weights imply: a smaller bias, gain, mask or a weight of another geometry was read
    past its end, returning garbage or crashing the process)."""
    assert ops_lib.load()
    r = torch.randn
    d, steps, batch, f, h = 2, 5, 3, 4, 3
    lengths = torch.tensor([5, 2, 4])
    lstm = dict(x=r(steps, batch, f), lengths=lengths, h0=r(d, batch, h), c0=r(d, batch, h), w_ih=r(d, 4 * h, f),
                w_hh=r(d, 4 * h, h), b_ih=r(d, 4 * h), b_hh=r(d, 4 * h), ln_ih=r(d, 4 * h), ln_hh=r(d, 4 * h),
                ln_cell_weight=r(d, h), ln_cell_bias=r(d, h), peephole=r(d, 3 * h), w_hr=None, rmask=r(d, batch, h),
                zc=r(d, steps, batch, h), zh=r(d, steps, batch, h))
    gru = dict(x=r(steps, batch, f), lengths=lengths, h0=r(d, batch, h), w_ih=r(d, 3 * h, f), w_hh=r(d, 3 * h, h),
               b_ih=r(d, 3 * h), b_hh=r(d, 3 * h), ln_ih=r(d, 3 * h), ln_hh=r(d, 3 * h), rmask=r(d, batch, h),
               zh=r(d, steps, batch, h))
    rnn = dict(x=r(steps, batch, f), lengths=lengths, h0=r(d, batch, h), w_ih=r(d, h, f), w_hh=r(d, h, h),
               b_ih=r(d, h), b_hh=r(d, h))
    cases = [(torch.ops.fastlayers.lstm_padded, lstm, [0.5, 0.0, 0.0, 0.0]),
             (torch.ops.fastlayers.gru_padded, gru, [0.0]), (torch.ops.fastlayers.rnn_padded, rnn, [True])]
    too_short = (r"^Length of all samples has to be greater than 0, but found an element in 'lengths' that is <= 0; "
                 r"lengths: every length must be >= 1, got 0")
    for op, args, rest in cases:
        op(*args.values(), *rest)  # (as given: runs)
        # lengths: the Python half's messages (torch's first), also where no Python checks them (a C++ caller)
        for lengths, message in [([5, 0, 4], too_short),
                                 ([5, 6, 4], r"^lengths: every length must be <= T = 5 \(the padded time size\), got 6")]:
            with pytest.raises(RuntimeError, match=message):
                op(*dict(args, lengths=torch.tensor(lengths)).values(), *rest)
        for name, value in args.items():
            if name in ("x", "lengths", "w_ih", "h0", "c0") or value is None:  # (checked before: test_export.py)
                continue
            bad = dict(args, **{name: value[:, :-1] if name == "w_hh" else value[..., :-1]})
            with pytest.raises(RuntimeError, match=rf"{name}: expected .*got \["):
                op(*bad.values(), *rest)
    x, w, b = r(2, 3, 6, 6), r(4, 3, 3, 3, 4, 4), r(4, 4, 4)
    local = torch.ops.fastlayers.locally_connected2d
    assert local(x, w, b, [1, 1], [0, 0], [1, 1]).shape == (2, 4, 4, 4)
    for args, message in [((x, r(4, 3, 3, 3, 40, 40), b, [1, 1], [0, 0], [1, 1]), r"with \(OH, OW\) = \(4, 4\)"),
                          ((x, r(4, 5, 3, 3, 4, 4), b, [1, 1], [0, 0], [1, 1]), r"with C = 3"),
                          ((x, w, r(4), [1, 1], [0, 0], [1, 1]), r"bias: expected shape \[4, 4, 4\]"),
                          ((x, w, b, [1], [0], [1]), r"of 2 values each"),
                          ((x, w, b, [0, 1], [0, 0], [1, 1]), r"stride >= 1")]:
        with pytest.raises(RuntimeError, match=message):
            local(*args)
    grad = r(2, 4, 4, 4)
    backward = torch.ops.fastlayers.locally_connected2d_backward
    assert backward(grad, x, w, [1, 1], [0, 0], [1, 1], [True, True, True])[1].shape == w.shape
    with pytest.raises(RuntimeError, match=r"grad: expected shape \[2, 4, 4, 4\]"):
        backward(grad[..., :2], x, w, [1, 1], [0, 0], [1, 1], [True, True, True])
