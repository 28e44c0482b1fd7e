"""The layers (LSTM, GRU, RNN with and without cell options and lengths, LocallyConnected2d, attention
pooling's dot and additive scores) under torch.autocast (CPU bfloat16 and float16) and with bfloat16
or float16 parameters:
each runs, returns the low dtype, and its error against a float64 reference (output and every
gradient) is at most twice that of the corresponding torch module, or a plain-torch formulation, in
the same precision (flash-attention's same-precision budget); the cells under autocast return what
torch's cells return. Above the result's own rounding (half the low dtype's eps): see _check. Not
here: LocallyConnected1d (LocallyConnected2d's kernels with H = 1) and the
scaled-dot score (the dot score's kernels with a scale)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastlayers
from fastlayers._core import precision as _precision
from fastlayers.rnn._reference import gru_cell_step, lstm_cell_step
from rnn_helpers import torch_packed

BF16 = torch.bfloat16
LENGTHS = [12, 5, 9, 1, 12, 7]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _run(fn, module, inputs, cot_seed=0):
    """outputs and the gradients of every floating input and parameter, with fixed cotangents."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    module.zero_grad(set_to_none=True)
    outs = fn(module, *leaves)
    outs = [outs] if isinstance(outs, torch.Tensor) else outs
    g = torch.Generator().manual_seed(cot_seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs)
    loss.backward()
    grads = [t.grad for t in leaves if t.is_floating_point()] + [p.grad for p in module.parameters()]
    return [o.detach() for o in outs], grads


def _errors(result, reference):
    (outs, grads), (routs, rgrads) = result, reference
    return [_rel(a, b) for a, b in zip(outs, routs, strict=True)] + \
           [_rel(a, b) for a, b in zip(grads, rgrads, strict=True)]


def _check(ours_fn, ours, base_fn, base, inputs, mode):
    """ours in ``mode`` ("autocast": float32 module under CPU bf16 autocast, "autocast-fp16": under
    float16 autocast; "bf16" / "fp16": module and inputs in that dtype) vs the baseline in the low
    dtype, both against ours in float64."""
    low = torch.float16 if "fp16" in mode else BF16
    reference = _run(ours_fn, copy.deepcopy(ours).double(), [t.double() if t.is_floating_point() else t for t in inputs])
    low_inputs = [t.to(low) if t.is_floating_point() else t for t in inputs]
    if mode.startswith("autocast"):
        with torch.autocast("cpu", low):
            result = _run(ours_fn, ours, inputs)
    else:
        result = _run(ours_fn, copy.deepcopy(ours).to(low), low_inputs)
    assert all(o.dtype == low for o in result[0]), [o.dtype for o in result[0]]
    want_grad = torch.float32 if mode.startswith("autocast") else low
    assert all(g is not None and g.dtype == want_grad for g in result[1])
    baseline = _run(base_fn, copy.deepcopy(base).to(low), low_inputs)
    ours_err, base_err = _errors(result, reference), _errors(baseline, reference)
    # plus one rounding of the result to the low dtype (half its eps, relative to the largest value):
    # below that the baseline's error is luck (over 30 seeds of attention pooling the ratio's median
    # is 0.5-1.0 and its maximum 1.6-3.1 in each low precision, on every tensor)
    floor = torch.finfo(low).eps / 2
    for i, (a, b) in enumerate(zip(ours_err, base_err)):
        assert a <= 2 * b + floor, f"tensor {i}: error {a:.2e} > 2 x the {low} baseline's {b:.2e}; all: {ours_err} vs {base_err}"
    return ours_err, base_err


MODES = ["autocast", "bf16"]
BUDGET_MODES = [*MODES, "autocast-fp16", "fp16"]  # the error budget against torch in the same precision


# tests of the C kernels' own switches (bf16 instructions, the library's products), or that choose
# their backends themselves: on the automatic backend only (under a forced reference the switches
# change nothing, and such a test compared a computation with itself)
AUTO_ONLY = {"test_engine_and_its_reference_implement_the_same_rule", "test_bf16_products_run_where_the_cpu_has_them",
             "test_bf16_large_products_on_the_library_kernel", "test_bf16_dot_products_give_the_float32_products",
             "test_c_time_loops_follow_the_per_step_rule_in_training",
             "test_cpu_without_bf16_instructions_multiplies_in_float32", "test_float16_layer_norm_gradients_stay_finite"}


def pytest_generate_tests(metafunc):
    """Every other test on the automatic backend (the C kernels) and on the plain-torch reference."""
    if metafunc.function.__name__ not in AUTO_ONLY:
        metafunc.parametrize("backend", ["auto", "reference"], indirect=True)


@pytest.fixture(autouse=True)
def backend(request):
    name = getattr(request, "param", "auto")
    if name == "reference":
        with fastlayers.backend("reference"):
            yield name
    else:
        yield name


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rnn_pair(ours_cls, torch_cls, **kw):
    torch.manual_seed(0)
    ours = ours_cls(8, 16, num_layers=2, bidirectional=True, **kw)
    theirs = torch_cls(8, 16, num_layers=2, bidirectional=True, **kw)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


@pytest.mark.parametrize("mode", BUDGET_MODES)
@pytest.mark.parametrize("cls,torch_cls", [(fastlayers.LSTM, nn.LSTM), (fastlayers.GRU, nn.GRU),
                                           (fastlayers.RNN, nn.RNN)], ids=["LSTM", "GRU", "RNN"])
def test_padded_plain_layers(cls, torch_cls, mode):
    ours, theirs = _rnn_pair(cls, torch_cls)
    _check(lambda m, x: m(x)[0], ours, lambda m, x: m(x)[0], theirs, [_x(12, 6, 8)], mode)


@pytest.mark.parametrize("mode", BUDGET_MODES)
@pytest.mark.parametrize("cls,torch_cls", [(fastlayers.LSTM, nn.LSTM), (fastlayers.GRU, nn.GRU),
                                           (fastlayers.RNN, nn.RNN)], ids=["LSTM", "GRU", "RNN"])
def test_lengths_against_torch_packed(cls, torch_cls, mode):
    ours, theirs = _rnn_pair(cls, torch_cls)
    lengths = torch.tensor(LENGTHS)

    _check(lambda m, x: m(x, lengths=lengths)[0], ours, lambda m, x: torch_packed(m, x, None, lengths)[0], theirs,
           [_x(12, 6, 8)], mode)


@pytest.mark.parametrize("mode", BUDGET_MODES)
def test_lstm_with_a_projection(mode):
    """proj_size in low precision (the per-step loop from Python with the projection between the
    steps), two layers, bidirectional, lengths, three calls: against torch.nn.LSTM(proj_size=...).
    (The kernel's float32 step state was once allocated in the input's bf16 dtype, half its size:
    under autocast every call wrote past it and the process died in malloc within a few calls.)"""
    ours, theirs = _rnn_pair(fastlayers.LSTM, nn.LSTM, proj_size=5)
    lengths = torch.tensor(LENGTHS)
    for seed in range(3):
        _check(lambda m, x: m(x, lengths=lengths)[0], ours, lambda m, x: torch_packed(m, x, None, lengths)[0], theirs,
               [_x(12, 6, 8, seed=seed)], mode)


def _results(out):
    """The tensors of a layer's (output, h_n or (h_n, c_n)) or a cell's h or (h, c), flat."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _results(o)]


@pytest.mark.parametrize("name,options", [(n, False) for n in ("LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell")]
                         + [(n, True) for n in ("LSTM", "GRU", "LSTMCell", "GRUCell")])
@pytest.mark.parametrize("state", [None, torch.float32, BF16], ids=["no state", "float32 state", "bf16 state"])
def test_an_autocast_activation_feeds_a_float32_module(name, options, state):
    """An autocast layer's bf16 output (or a bf16 state) reaching a float32 module inside the
    autocast region: torch.nn's modules take it (ours once raised "input dtype ... does not match
    weight dtype"). Ours runs it as the float32 call under autocast, bitwise (the conversion is
    exact); the results in torch's dtype (a layer's: the autocast dtype; a cell's: that of the
    state its step adds to), the input's gradient in bf16."""
    cell = name.endswith("Cell")
    kw = {"layer_norm": True} if options else {}
    torch.manual_seed(0)
    ours = getattr(fastlayers, name)(8, 16, **kw).eval()
    theirs = getattr(nn, name)(8, 16)
    theirs.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("ln_")})
    x = _x(6, 8) if cell else _x(12, 6, 8)
    shape = (6, 16) if cell else (1, 6, 16)
    hx = None if state is None else _x(*shape, seed=1).to(state)
    hx = (hx, hx.clone()) if hx is not None and name.startswith("LSTM") else hx
    a = x.to(BF16).requires_grad_()
    with torch.autocast("cpu", BF16):
        got = _results(ours(a, hx))
        as_float32 = _results(ours(a.detach().float(), None if hx is None else _precision.autocast_operand(
            hx, torch.float32)))
        want_dtypes = [t.dtype for t in _results(theirs(a, hx))]
    if not options and name != "GRU":  # (torch's GRU layer returns float32 here: ours the autocast dtype, as
        assert [t.dtype for t in got] == want_dtypes  # documented in docs/precision.md)
    for g, f in zip(got, as_float32, strict=True):
        assert torch.equal(g, f.to(g.dtype))
    grad, = torch.autograd.grad(sum(t.float().sum() for t in got), a)
    assert grad.dtype == BF16 and grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
@pytest.mark.parametrize("options", [False, True], ids=["plain", "layer_norm"])
@pytest.mark.parametrize("state", [None, BF16], ids=["no state", "bf16 state"])
def test_a_layer_cell_view_takes_an_autocast_activation_as_the_cells(mode, options, state):
    """``LSTM(...).cell()`` runs the cells' step (its docstring): under autocast a bf16 activation
    reaching its float32 parameters is taken as fastlayers.LSTMCell / GRUCell take it (the view
    once raised "mat1 and mat2 must have the same dtype"), with the cell's results bitwise."""
    kw = {"layer_norm": True} if options else {}
    torch.manual_seed(0)
    layer = getattr(fastlayers, mode)(8, 16, **kw).eval()
    cell = getattr(fastlayers, mode + "Cell")(8, 16, **kw).eval()
    cell.load_state_dict({k.removesuffix("_l0"): v for k, v in layer.state_dict().items()})
    x = _x(6, 8).to(BF16)
    hx = None if state is None else _x(6, 16, seed=1).to(state)
    hx = (hx, hx.clone()) if hx is not None and mode == "LSTM" else hx
    with torch.autocast("cpu", BF16):
        got, want = _results(layer.cell()(x, hx)), _results(cell(x, hx))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        assert torch.equal(g, w)


_LOW_MODELS = {
    "LSTM": lambda: fastlayers.LSTM(8, 16, num_layers=2, bidirectional=True), "GRU": lambda: fastlayers.GRU(8, 16),
    "RNN": lambda: fastlayers.RNN(8, 16), "LSTM layer_norm": lambda: fastlayers.LSTM(8, 16, layer_norm=True),
    "GRU layer_norm": lambda: fastlayers.GRU(8, 16, layer_norm=True), "LSTMCell": lambda: fastlayers.LSTMCell(8, 16),
    "GRUCell": lambda: fastlayers.GRUCell(8, 16), "RNNCell": lambda: fastlayers.RNNCell(8, 16),
    "LSTMCell peephole": lambda: fastlayers.LSTMCell(8, 16, peephole=True),
    "LocallyConnected1d": lambda: fastlayers.LocallyConnected1d(8, 4, 12, 3),
    "LocallyConnected2d": lambda: fastlayers.LocallyConnected2d(8, 4, (5, 5), 3, padding=1),
}


@pytest.mark.parametrize("name,state", [(n, s) for n in _LOW_MODELS for s in (
    (False,) if n.startswith("Locally") else (False, True))])  # (the local layers have no state)
@pytest.mark.parametrize("low,autocast", [(BF16, BF16), (torch.float16, torch.float16), (BF16, torch.float16)],
                         ids=["bf16", "fp16", "bf16 model, fp16 autocast"])
def test_a_low_precision_model_under_autocast_takes_float32_activations(name, state, low, autocast):
    """A model converted with ``.to(torch.bfloat16)`` called under autocast with float32 input (and
    state): torch.nn's modules run it (their dtype check is skipped under autocast); ours raised
    InputDtypeError, and with another autocast dtype than the parameters' torch's internal
    "Unexpected floating ScalarType" error. It runs as the low-precision model's call on the
    converted activations, bitwise; results in the parameters' dtype (the plain cells: torch's
    cell's, that of the state the step adds to, as torch.nn's cells return); float32 input gradients."""
    local = name.startswith("Locally")
    torch.manual_seed(0)
    model = _LOW_MODELS[name]().to(low)
    cell = name.split()[0].endswith("Cell")
    x = _x(6, 8) if cell else _x(3, 8, 12) if name == "LocallyConnected1d" else _x(3, 8, 5, 5) if local else _x(5, 6, 8)
    x.requires_grad_()
    hx = None
    if state:
        layers = 1 if cell else model.num_layers * (2 if model.bidirectional else 1)
        hx = _x(6, 16, seed=1) if cell else _x(layers, 6, 16, seed=1)
        hx = (hx, hx.clone()) if name.startswith("LSTM") else hx
    args = (x,) if local else (x, hx)
    with torch.autocast("cpu", autocast):
        got = _results(model(*args))
    want = _results(model(*((x.to(low),) if local else (x.to(low), _precision.autocast_operand(hx, torch.float32)
                                                                   if hx is None else _convert(hx, low)))))
    plain_cell = name in ("LSTMCell", "GRUCell")
    for g, w in zip(got, want, strict=True):
        assert g.dtype == (torch.float32 if plain_cell else low)
        assert torch.equal(g, w.to(g.dtype))
    if low == autocast == BF16 and name in ("LSTMCell", "GRUCell", "RNNCell"):  # (torch's own fp16 LSTM fails
        theirs = getattr(nn, name)(8, 16).to(low)                                  # on CPU: oneDNN)
        theirs.load_state_dict(model.state_dict())
        with torch.autocast("cpu", autocast):
            assert [t.dtype for t in got] == [t.dtype for t in _results(theirs(*args))]
    grad, = torch.autograd.grad(sum(t.float().sum() for t in got), x)
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0


def _convert(hx, dtype):
    return tuple(h.to(dtype) for h in hx) if isinstance(hx, tuple) else hx.to(dtype)


def test_a_float64_rnn_under_autocast_refuses_float32_input_as_torchs():
    """A float64 RNN called under autocast with float32 input: torch.nn.RNN raises; ours ran it
    silently in bfloat16 (the float32 parameters' autocast path)."""
    torch.manual_seed(0)
    ours = fastlayers.RNN(8, 16).double()
    theirs = nn.RNN(8, 16).double()
    x = _x(5, 6, 8)
    with torch.autocast("cpu", BF16):
        with pytest.raises(RuntimeError):
            theirs(x)
        with pytest.raises(RuntimeError, match="dtype"):
            ours(x)
        assert ours(x.double())[0].dtype == theirs(x.double())[0].dtype == torch.float64


@pytest.mark.parametrize("lengths", [None, [5, 2, 4]], ids=["padded", "lengths"])
def test_a_low_precision_rnn_call_never_writes_the_module(lengths, monkeypatch):
    """An RNN call under CPU autocast leaves the module as it was, during the call too: it swapped
    rounded copies into the module's _flat_weights for the call, so a call from another thread then
    ran on them (wrong values), and two overlapping calls could leave them there for good (parameter
    updates no longer reached the forward)."""
    from fastlayers.rnn import _modules

    torch.manual_seed(0)
    ours = fastlayers.RNN(8, 16)
    seen = []

    def own_weights():
        return all(w is p for w, p in zip(ours._flat_weights, ours.parameters(), strict=True))

    def spy(fn):
        def call(*args, **kwargs):
            seen.append(own_weights())
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(nn.RNN, "forward", spy(nn.RNN.forward))  # (the padded call's kernel)
    monkeypatch.setattr(_modules, "varlen_rnn", spy(_modules.varlen_rnn))  # (the lengths path's)
    x = _x(5, 3, 8)
    with torch.autocast("cpu", BF16):
        out = ours(x, lengths=lengths)[0]
    assert out.dtype == BF16 and seen and all(seen) and own_weights()


@pytest.mark.parametrize("lengths", [None, [5, 2, 4]], ids=["padded", "lengths"])
@pytest.mark.parametrize("low_params", [False, True], ids=["autocast", "bf16 parameters"])
def test_a_low_precision_rnn_call_reads_a_parametrized_weight_once_rounded(lengths, low_params):
    """torch.nn.utils.parametrize computes the weight at each read, so torch's forward saw it as
    changed and put the raw weights back in place of the call's rounded ones: bf16 parameters
    crashed (float32 input vs a bf16 weight), and autocast ran the weight unrounded (4e-3 off the
    same module with the weight stored). Equal to that module, and the original's gradient twice
    the stored weight's."""
    from torch.nn.utils import parametrize

    class Twice(nn.Module):
        def forward(self, w):
            return w * 2.0

    torch.manual_seed(0)
    stored = fastlayers.RNN(8, 16)
    param = copy.deepcopy(stored)
    with torch.no_grad():
        stored.weight_hh_l0.mul_(2.0)
    if low_params:
        stored, param = stored.to(BF16), param.to(BF16)
    parametrize.register_parametrization(param, "weight_hh_l0", Twice())
    x = _x(5, 3, 8).to(BF16 if low_params else torch.float32)
    with torch.autocast("cpu", BF16, enabled=not low_params):
        want, got = stored(x, lengths=lengths)[0], param(x, lengths=lengths)[0]
    assert got.dtype == BF16 and torch.equal(got, want)
    want.float().sum().backward(), got.float().sum().backward()
    assert torch.equal(param.parametrizations.weight_hh_l0.original.grad, 2 * stored.weight_hh_l0.grad)


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("low_params", [False, True], ids=["autocast", "bf16 parameters"])
def test_a_packed_sequence_in_low_precision_runs_as_the_lengths_call(mode, low_params):
    """A PackedSequence through a plain layer in low precision on CPU: it went to torch's packed
    kernel (float32 results under autocast, a bf16 cell state with bf16 parameters: twice the
    error, and torch's LSTM fails under bf16 autocast on CPUs without oneDNN's bf16 LSTM) where
    the padded call with lengths follows the rule; the same values and gradients now."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    m = getattr(fastlayers, mode)(8, 16, bidirectional=True)
    m = m.to(BF16) if low_params else m
    lengths = [5, 2, 4]
    x = _x(5, 3, 8).to(BF16 if low_params else torch.float32).requires_grad_()
    with torch.autocast("cpu", BF16, enabled=not low_params):
        packed, h_packed = m(pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False))
        want, h_want = m(x, lengths=lengths)
    got = pad_packed_sequence(packed, total_length=5)[0]
    assert got.dtype == BF16 and torch.equal(got, want)
    for a, b in zip(_results(h_packed), _results(h_want), strict=True):
        assert torch.equal(a, b)
    (g_packed,) = torch.autograd.grad(got.float().sum(), x)
    (g_want,) = torch.autograd.grad(want.float().sum(), x)
    assert torch.equal(g_packed, g_want)


class _NaiveLoop(nn.Module):
    """The LayerNorm / peephole / clip cell written the plain way, one step at a time, every op in
    the parameters' dtype (bf16 state included): the plain-torch formulation of the options."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        rnn = self.rnn
        p = rnn._layer_parameters()[0][0]
        lstm = rnn.mode == "LSTM"
        mm = _precision.Products(x.dtype, x.dtype, x.device)
        h = x.new_zeros(x.size(1), rnn.hidden_size)
        c = x.new_zeros(x.size(1), rnn.hidden_size)
        ys = []
        for t in range(x.size(0)):
            if lstm:
                h, c = lstm_cell_step(x[t], h, c, p, rnn.options, mm)
            else:
                h = gru_cell_step(x[t], h, p, rnn.options, mm=mm)
            ys.append(h)
        return torch.stack(ys)


@pytest.mark.parametrize("mode", BUDGET_MODES)
@pytest.mark.parametrize("make", [
    lambda: fastlayers.LSTM(8, 16, layer_norm=True, peephole=True, cell_clip=2.0),
    lambda: fastlayers.GRU(8, 16, layer_norm=True),
], ids=["LSTM options", "GRU layer_norm"])
def test_cell_options_against_a_plain_bf16_loop(make, mode):
    torch.manual_seed(0)
    ours = make().eval()
    _check(lambda m, x: m(x)[0], ours, lambda m, x: m(x), _NaiveLoop(copy.deepcopy(ours)), [_x(12, 6, 8)], mode)


@pytest.mark.parametrize("mode", BUDGET_MODES)
def test_locally_connected_against_unfold_einsum(mode):
    torch.manual_seed(0)
    ours = fastlayers.LocallyConnected2d(3, 4, (10, 9), 3, padding=1)

    class Unfold(nn.Module):  # the usual plain-torch locally connected layer
        def __init__(self, weight, bias):
            super().__init__()
            self.weight, self.bias = nn.Parameter(weight.clone()), nn.Parameter(bias.clone())

        def forward(self, x):
            patches = F.unfold(x, 3, padding=1).view(x.size(0), 3, 9, 10, 9)  # (B, C, K, OH, OW)
            w = self.weight.view(4, 3, 9, 10, 9)
            return torch.einsum("bckij,ockij->boij", patches, w) + self.bias

    _check(lambda m, x: m(x), ours, lambda m, x: m(x), Unfold(ours.weight.data, ours.bias.data),
           [_x(2, 3, 10, 9)], mode)


@pytest.mark.parametrize("mode", BUDGET_MODES)
@pytest.mark.parametrize("score", ["dot", "additive"])
def test_attention_pooling_against_plain_softmax(score, mode):
    torch.manual_seed(0)
    ours = fastlayers.AttentionPooling(6, score=score)
    lengths = torch.tensor(LENGTHS)

    class Plain(nn.Module):
        def __init__(self, pool):
            super().__init__()
            self.pool = pool

        def forward(self, q, k, v):
            if score == "dot":
                s = (k * q.unsqueeze(1)).sum(-1)
            else:
                p = self.pool
                s = torch.tanh(k @ p.weight_key.T + (q @ p.weight_query.T).unsqueeze(1) + p.bias) @ p.v
            s = s.masked_fill(torch.arange(k.size(1)) >= lengths[:, None], float("-inf"))
            w = torch.softmax(s, 1)
            return (w.unsqueeze(-1) * v).sum(1), w

    inputs = [_x(6, 6, seed=1), _x(6, 12, 6, seed=2), _x(6, 12, 5, seed=3)]
    _check(lambda m, q, k, v: m(q, k, v, lengths), ours, lambda m, q, k, v: m(q, k, v), Plain(copy.deepcopy(ours)),
           inputs, mode)


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
def test_attention_pooling_takes_an_autocast_layers_keys_for_a_float32_query(score):
    """A learned float32 query pooling an autocast LSTM's bf16 output (the usual classifier): a
    DtypeError (keys vs query) where torch's attention takes it; it runs as the float32 call under
    autocast (bf16 results), the same as with the keys given in float32."""
    torch.manual_seed(0)
    lstm, pool = fastlayers.LSTM(8, 8, batch_first=True), fastlayers.AttentionPooling(8, score=score)
    query = nn.Parameter(torch.randn(4, 8))
    x, lengths = _x(4, 7, 8), torch.tensor([7, 3, 5, 1])
    with torch.autocast("cpu", BF16):
        out = lstm(x, lengths=lengths)[0]
        assert out.dtype == BF16
        context, weights = pool(query, out, lengths=lengths)
        want, want_weights = pool(query, out.float(), lengths=lengths)
    assert context.dtype == weights.dtype == BF16
    assert torch.equal(context, want) and torch.equal(weights, want_weights)
    context.float().sum().backward()
    assert query.grad is not None and query.grad.dtype == torch.float32


def _outputs(m, x, lengths):
    """The output and the final states of one call, as a list (LSTM: h, c; GRU: h)."""
    out, states = m(x, lengths=lengths)
    return [out, *(states if isinstance(states, tuple) else (states,))]


def _autocast_call(m, x, lengths, backend):
    """m's output, final states and the gradients of x and every parameter of one call under CPU
    bf16 autocast on ``backend``."""
    x = x.detach().clone().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    with torch.autocast("cpu", BF16), fastlayers.backend(backend):
        outs = _outputs(m, x, lengths)
    g = torch.Generator().manual_seed(1)
    loss = sum((t.float() * torch.randn(t.shape, generator=g)).sum() for t in outs)
    loss.backward()
    return outs, [x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_engine_and_its_reference_implement_the_same_rule(cell, monkeypatch):
    """bf16 operands, float32 sums, cell state and LayerNorm. Where torch's bf16 GEMMs are emulated
    (a CPU without bf16 instructions; forced here) every product multiplies bf16-rounded operands in
    float32: there the engine's C time loops give the numbers of its per-step torch loop (the rule
    written with torch ops), and the engine agrees with the per-step reference to the last bf16
    rounding of the outputs, its gradients to 1e-2. With hardware bf16 GEMMs (torch's rounds each
    result to bf16, as the reference's step products do; the C time loops sum in float32 and do
    not) the engine is at least as close to float64 as the reference, over 36 steps."""
    from fastlayers.rnn import _cpu_recurrence

    torch.manual_seed(0)
    kw = dict(peephole=True) if cell == "LSTM" else {}
    m = getattr(fastlayers, cell)(8, 16, bidirectional=True, layer_norm=True, **kw)
    x, lengths = _x(40, 6, 8), torch.tensor(LENGTHS) * 3
    with torch.no_grad():
        exact = _outputs(copy.deepcopy(m).double(), x.double(), lengths)
    outs, ref_outs = _autocast_call(m, x, lengths, "cpu")[0], _autocast_call(m, x, lengths, "reference")[0]
    for a, b, e in zip(outs, ref_outs, exact, strict=True):
        assert a.dtype == b.dtype == BF16
        assert (a.double() - e).abs().max() <= 1.5 * (b.double() - e).abs().max() + 1e-3
    monkeypatch.setattr(_precision, "native", lambda device_type, dtype: dtype not in _precision.LOW)
    x, lengths = _x(12, 6, 8), torch.tensor(LENGTHS)  # (over more steps a last-bit flip grows)
    loops, ref = _autocast_call(m, x, lengths, "cpu"), _autocast_call(m, x, lengths, "reference")
    monkeypatch.setattr(_cpu_recurrence, "_rounds_bf16", lambda mm: False)  # the per-step torch loop
    steps = _autocast_call(m, x, lengths, "cpu")
    for other in (steps, ref):
        for a, b in zip(loops[0], other[0], strict=True):
            assert a.dtype == b.dtype == BF16
            torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
        for a, b in zip(loops[1], other[1], strict=True):
            assert _rel(a, b.double()) <= 1e-2


def test_bf16_products_run_where_the_cpu_has_them():
    """The time loops' bf16 step products run on VDPBF16PS exactly where the avx512 variant is
    loaded on a CPU with AVX512-BF16 (so the test below compares two code paths there)."""
    from fastlayers import _native

    want = _native.built_as() == "avx512" and torch.cpu._is_avx512_bf16_supported()
    assert _native.bf16_products() == want


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_bf16_large_products_on_the_library_kernel(cell, mode):
    """The input projection and its input gradient on matmul.c's VDPBF16PS kernel (forced here at
    any size; by default on CPUs with AVX512-BF16 and no AMX from 640 rows), float32 results written
    in place: a two-layer bidirectional layer with lengths at least as close to float64 as with
    torch's bf16 GEMMs (whose bf16 results are then converted), outputs and every gradient; under
    autocast the input gradient is float32 with the input never converted to bf16 whole."""
    from fastlayers import _native

    torch.manual_seed(0)
    m = getattr(fastlayers, cell)(8, 16, num_layers=2, bidirectional=True, layer_norm=cell == "GRU")
    x, lengths = _x(12, 6, 8), torch.tensor(LENGTHS)
    exact = _run(lambda mod, t: _outputs(mod, t, lengths), copy.deepcopy(m).double(), [x.double()])
    low = copy.deepcopy(m).to(BF16) if mode == "bf16" else m
    xl = x.to(BF16) if mode == "bf16" else x

    def call(own):
        _native.prefer_own_products(own)
        try:
            with torch.autocast("cpu", BF16, enabled=mode == "autocast"):
                return _run(lambda mod, t: _outputs(mod, t, lengths), low, [xl])
        finally:
            _native.prefer_own_products(None)

    _native.prefer_own_products(True)
    want_own = _native.bf16_products() and not torch.cpu._is_amx_tile_supported()
    assert _native.bf16_large_products(1) == want_own
    _native.prefer_own_products(None)
    ours, torch_gemms = call(True), call(False)
    assert ours[1][0].dtype == (BF16 if mode == "bf16" else torch.float32)
    for a, b in zip(_errors(ours, exact), _errors(torch_gemms, exact), strict=True):
        assert a <= 1.5 * b + 1e-3


# (cell, hidden, batch, bidirectional, options): K odd and N a partial panel (33), two row blocks of
# the 12-row tile (13), one direction on two threads split by rows (small weight) or by panels
# (600: 2.9 MB), the backward's k in two blocks (4 * 1030 > 2 * 2048), the mask through g
@pytest.mark.parametrize("cell, hidden, batch, bidirectional, options", [
    ("LSTM", 33, 13, True, dict(recurrent_dropout=0.3)), ("GRU", 33, 13, True, dict(recurrent_dropout=0.3)),
    ("LSTM", 45, 5, False, dict(layer_norm=True)), ("GRU", 45, 5, False, {}),
    ("LSTM", 600, 3, False, {}), ("GRU", 600, 3, False, dict(layer_norm=True)),
    ("LSTM", 1030, 2, False, {})])
def test_bf16_dot_products_give_the_float32_products(cell, hidden, batch, bidirectional, options, monkeypatch):
    """Training calls under bf16 autocast with lengths and h0: the time loops' step products on
    the CPU's bf16 instructions (gemm_bf16.h, where it has them) give the outputs, final states and
    every gradient of the float32 products of the same bf16-rounded operands (the sums in another
    order: relative l2 error 1e-3, a rounding to bf16 that flips a last bit included)."""
    from fastlayers.rnn import _cpu_recurrence

    torch.manual_seed(0)
    m = getattr(fastlayers, cell)(8, hidden, bidirectional=bidirectional, **options).train()
    dirs = 2 if bidirectional else 1
    x, h0 = _x(3, batch, 8), _x(dirs, batch, hidden, seed=1)
    hx = (h0, _x(dirs, batch, hidden, seed=2)) if cell == "LSTM" else h0
    lengths = torch.tensor([3] + [1 + i % 3 for i in range(batch - 1)])

    def call():
        torch.manual_seed(3)  # the same dropout masks
        xs = x.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", BF16):
            out, states = m(xs, hx, lengths=lengths)
        outs = [out, *(states if isinstance(states, tuple) else (states,))]
        g = torch.Generator().manual_seed(1)
        sum((t.float() * torch.randn(t.shape, generator=g)).sum() for t in outs).backward()
        return [*outs, xs.grad, *(p.grad for p in m.parameters())]

    dot = call()
    monkeypatch.setattr(_cpu_recurrence, "BF16_DOT", False)
    plain = call()
    for a, b in zip(dot, plain, strict=True):
        assert a.dtype == b.dtype
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= 1e-3


@pytest.mark.parametrize("cell, options", [
    ("LSTM", dict(recurrent_dropout=0.3, zoneout=(0.2, 0.1))), ("LSTM", dict(layer_norm=True, recurrent_dropout=0.2)),
    ("LSTM", dict(cell_clip=0.5, peephole=True)), ("GRU", dict(recurrent_dropout=0.3, zoneout=0.2)),
    ("GRU", dict(layer_norm=True))])
def test_c_time_loops_follow_the_per_step_rule_in_training(cell, options, monkeypatch):
    """Training calls (masks drawn from one seed, lengths, two layers, bf16 autocast) with bf16
    GEMMs emulated: the C time loops (bf16-rounded operands in float32, forward and backward) give
    the outputs and every gradient of the per-step torch loop to float32 rounding."""
    from fastlayers.rnn import _cpu_recurrence

    monkeypatch.setattr(_precision, "native", lambda device_type, dtype: dtype not in _precision.LOW)
    torch.manual_seed(0)
    m = getattr(fastlayers, cell)(8, 16, bidirectional=True, num_layers=2, **options).train()
    x, lengths = _x(10, 5, 8), torch.tensor([10, 3, 7, 1, 9])

    def call():
        torch.manual_seed(3)
        return _autocast_call(m, x, lengths, "cpu")

    loops = call()
    monkeypatch.setattr(_cpu_recurrence, "_rounds_bf16", lambda mm: False)  # the per-step torch loop
    steps = call()
    for a, b in zip([*loops[0], *loops[1]], [*steps[0], *steps[1]], strict=True):
        assert _rel(a.float(), b.double()) <= 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_checkpoint_every_under_autocast(cell, mode, backend):
    """checkpoint_every under bf16 (autocast, or bf16 parameters): the output and final states in
    bf16, the backward's recomputation under the forward's autocast (the backward runs outside it),
    and the states carried from segment to segment in float32, as from step to step: with one
    segment or short ones the outputs and final states of the run without the option, bitwise, and
    its gradients to 1e-2 (summed segment by segment; a bf16 GEMM rounds each segment's weight
    gradient to bf16). (Carried in bf16, the outputs of k = 3 differed by 0.4-1.4 %.)"""
    torch.manual_seed(0)
    plain = getattr(fastlayers, cell)(8, 16, bidirectional=True, layer_norm=True)
    x, lengths = _x(20, 3, 8), torch.tensor([20, 7, 13])
    if mode == "bf16":
        plain, x = plain.to(BF16), x.to(BF16)

    def call(every):
        m = getattr(fastlayers, cell)(8, 16, bidirectional=True, layer_norm=True, checkpoint_every=every)
        m = m.to(BF16) if mode == "bf16" else m
        m.load_state_dict(plain.state_dict())
        leaf = x.clone().requires_grad_(True)
        with torch.autocast("cpu", BF16, enabled=mode == "autocast"):
            outs = _outputs(m, leaf, lengths)
        assert all(o.dtype == BF16 for o in outs)
        sum((o.float() ** 2).sum() for o in outs).backward()
        return outs, [leaf.grad, *(p.grad for p in m.parameters())]

    want = call(None)
    for every in (20, 3, 7):
        outs, grads = call(every)
        for a, b in zip(outs, want[0], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(grads, want[1], strict=True):
            assert a.dtype == b.dtype
            assert ((a.double() - b.double()).norm() / b.double().norm()).item() <= 1e-2


@pytest.mark.parametrize("own", [None, True])
@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_checkpoint_every_draws_the_same_masks_in_bf16(cell, own):
    """Training with recurrent dropout (p = 0.3: 1 / keep is no bf16 value) and zoneout under bf16
    autocast: checkpoint_every gives the outputs of the call without it bitwise, with the large
    products on torch or on the library's bf16 kernel (own=True, forced at any size), where the
    input stays float32: the engine draws its masks in the products' dtype either way, as the
    segments do. (Drawn in float32 there, the outputs differed by a bf16 last bit.)"""
    from fastlayers import _native

    torch.manual_seed(0)
    plain = getattr(fastlayers, cell)(6, 8, bidirectional=True, recurrent_dropout=0.3, zoneout=0.1).train()
    x = _x(12, 4, 6)
    _native.prefer_own_products(own)
    try:
        outs = []
        for every in (None, 3):
            m = getattr(fastlayers, cell)(6, 8, bidirectional=True, recurrent_dropout=0.3, zoneout=0.1,
                                          checkpoint_every=every).train()
            m.load_state_dict(plain.state_dict())
            torch.manual_seed(7)
            with torch.autocast("cpu", BF16):
                outs.append(_outputs(m, x, None))
    finally:
        _native.prefer_own_products(None)
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_cpu_without_bf16_instructions_multiplies_in_float32(monkeypatch):
    """The two routes of a low-precision product give the same numbers (bf16 operands, fp32 sums)."""
    a, b = _x(2, 5, 7), _x(2, 7, 3, seed=1)
    emulated = _precision.Products(BF16, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(emulated, "native", True)  # (lowered = mixed and native, as __init__ sets it on a
    monkeypatch.setattr(emulated, "lowered", True)  # CPU with bf16 instructions: the test runs on either CPU)
    fast = _precision.Products(BF16, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(fast, "native", False)
    monkeypatch.setattr(fast, "lowered", False)
    torch.testing.assert_close(fast.bmm(a, b), emulated.bmm(a, b), atol=1e-2, rtol=1e-2)
    exact = torch.bmm(a.to(BF16).double(), b.to(BF16).double())
    assert _rel(fast.bmm(a, b), exact) < 1e-6  # exact products, float32 sums


@pytest.mark.parametrize("name", ["LSTMCell", "GRUCell", "RNNCell"])
def test_cells_under_autocast_return_what_torchs_cells_return(name):
    """docs/mixed-precision.md: a cell without options under CPU autocast gives torch's cell's dtype
    (float32 for LSTMCell / GRUCell, bfloat16 for RNNCell) and values."""
    torch.manual_seed(0)
    theirs = getattr(nn, name)(8, 16)
    ours = getattr(fastlayers, name)(8, 16)
    ours.load_state_dict(theirs.state_dict())
    x = _x(6, 8)
    with torch.autocast("cpu", BF16):
        want, got = theirs(x), ours(x)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_float16_layer_norm_gradients_stay_finite(cell):
    """float16 parameters, LayerNorm, a zero initial state, output gradients of a few hundred: the
    gate gradient of the first step (through the recurrent LayerNorm's 1 / std of a zero vector)
    exceeds float16's range; rounded for the weight-gradient product it became inf and met h = 0
    there, NaN in d weight_hh on the C engine. Every gradient finite, and d weight_hh within
    float16 precision of the reference backend's."""
    def grads(which):
        torch.manual_seed(0)
        m = getattr(fastlayers, cell)(4, 4, layer_norm=True).half()
        x = torch.randn(5, 2, 4, dtype=torch.half, requires_grad=True)
        with fastlayers.backend(which):
            y, _ = m(x)
            gy = (torch.randn(y.shape, generator=torch.Generator().manual_seed(1)) * 1000).half()
            return torch.autograd.grad(y, [x, *m.parameters()], gy)

    got, want = grads("cpu"), grads("reference")
    assert all(bool(torch.isfinite(g).all()) for g in got)
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=2e-2, atol=2e-2 * want[2].float().abs().max().item())
