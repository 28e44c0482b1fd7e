"""fastlayers.LSTMCell / GRUCell / RNNCell: drop-ins for torch.nn's cells (options off: the same
kernel, bitwise), the layers' cell options (the layer's ``cell(layer, direction)`` gives bitwise the
same step; one step equals the engine's layer over one time step). Their errors: test_torch_errors.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck

import fastlayers

KINDS = [("LSTMCell", {}), ("GRUCell", {}), ("RNNCell", {}), ("RNNCell", {"nonlinearity": "relu"})]


def _pair(name, kwargs, bias=True):
    torch.manual_seed(0)
    ours = getattr(fastlayers, name)(4, 5, bias=bias, **kwargs)
    torch.manual_seed(0)
    theirs = getattr(nn, name)(4, 5, bias=bias, **kwargs)
    return ours, theirs


def _state(name, batch, dtype=torch.float32):
    g = torch.Generator().manual_seed(2)
    shape = (batch, 5) if batch else (5,)
    h = torch.randn(shape, generator=g).to(dtype)
    return (h, torch.randn(shape, generator=g).to(dtype)) if name == "LSTMCell" else h


@pytest.mark.parametrize("name,kwargs", KINDS)
@pytest.mark.parametrize("batch", [3, None], ids=["batched", "unbatched"])
@pytest.mark.parametrize("bias", [True, False])
def test_options_off_equals_torch_bitwise(name, kwargs, batch, bias):
    ours, theirs = _pair(name, kwargs, bias)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))  # same draws
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn((batch, 4) if batch else (4,), requires_grad=True)
    for hx in (None, _state(name, batch)):
        a, b = ours(x, hx), theirs(x, hx)
        for s, t in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(s, t)
        ga = torch.autograd.grad(sum(s.sum() for s in (a if isinstance(a, tuple) else (a,))), [x, *ours.parameters()])
        gb = torch.autograd.grad(sum(s.sum() for s in (b if isinstance(b, tuple) else (b,))),
                                 [x, *theirs.parameters()])
        assert all(torch.equal(u, v) for u, v in zip(ga, gb))


OPTION_SETS = {
    "LSTM": [dict(layer_norm=True), dict(peephole=True, cell_clip=0.5), dict(zoneout=(0.2, 0.3)),
             dict(proj_size=3, proj_clip=0.4, layer_norm=True, peephole=True)],
    "GRU": [dict(layer_norm=True), dict(zoneout=0.25)],
}


def _layer_and_cell(mode, opts, direction):
    torch.manual_seed(0)
    layer = getattr(fastlayers, mode)(4, 5, bidirectional=True, **opts).double().eval()
    cell = getattr(fastlayers, mode + "Cell")(4, 5, **opts).double().eval()
    sfx = "_l0_reverse" if direction else "_l0"
    cell.load_state_dict({k[:-len(sfx)]: v for k, v in layer.state_dict().items() if k.endswith(sfx)}, strict=True)
    return layer, cell


@pytest.mark.parametrize("mode,opts", [(m, o) for m, sets in OPTION_SETS.items() for o in sets])
@pytest.mark.parametrize("direction", [0, 1])
def test_layer_cell_view_and_cell_module_are_bitwise_equal(mode, opts, direction):
    layer, cell = _layer_and_cell(mode, opts, direction)
    x = torch.randn(3, 4, dtype=torch.double)
    states = cell(x)
    for _ in range(3):  # a few steps of decoding
        a, b = layer.cell(0, direction)(x, states), cell(x, states)
        for s, t in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(s, t)
        states = b


@pytest.mark.parametrize("mode,opts", [(m, o) for m, sets in OPTION_SETS.items() for o in sets])
def test_one_step_equals_the_engine_layer_over_one_time_step(mode, opts):
    layer, cell = _layer_and_cell(mode, opts, 0)
    x = torch.randn(1, 3, 4, dtype=torch.double)
    out, final = layer(x, lengths=[1, 1, 1])
    step = cell(x[0])
    if mode == "LSTM":
        torch.testing.assert_close(step[0], final[0][0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(step[1], final[1][0], rtol=1e-10, atol=1e-12)
    else:
        torch.testing.assert_close(step, final[0], rtol=1e-10, atol=1e-12)
    p = step[0].size(-1) if mode == "LSTM" else 5
    torch.testing.assert_close(out[0, :, :p], step[0] if mode == "LSTM" else step, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode,opts", [(m, o) for m, sets in OPTION_SETS.items() for o in sets])
def test_option_cell_gradcheck(mode, opts):
    torch.manual_seed(0)
    cell = getattr(fastlayers, mode + "Cell")(3, 4, **{**opts, **({"proj_size": 2} if "proj_size" in opts else {})})
    cell = cell.double().eval()
    x = torch.randn(2, 3, dtype=torch.double, requires_grad=True)
    w = cell.weight_hh.detach().clone().requires_grad_(True)
    h = torch.randn(2, cell.weight_hh.size(1), dtype=torch.double, requires_grad=True)
    # from a random state (from the zero state weight_hh's and the peepholes' Jacobians are zero)
    if mode == "LSTM":
        c = torch.randn(2, 4, dtype=torch.double, requires_grad=True)
        assert gradcheck(lambda x, w, h, c: torch.func.functional_call(cell, {"weight_hh": w}, (x, (h, c))),
                         (x, w, h, c))
    else:
        assert gradcheck(lambda x, w, h: torch.func.functional_call(cell, {"weight_hh": w}, (x, h)), (x, w, h))


def test_training_zoneout_and_recurrent_mask():
    torch.manual_seed(0)
    cell = fastlayers.LSTMCell(4, 5, zoneout=0.5, recurrent_dropout=0.5).train()
    x, hx = torch.randn(3, 4), (torch.randn(3, 5), torch.randn(3, 5))
    mask = cell.recurrent_mask(3)
    assert mask.shape == (3, 5) and set(mask.unique().tolist()) <= {0.0, 2.0}
    a, b = cell(x, hx, recurrent_mask=mask), cell(x, hx, recurrent_mask=mask)
    assert not torch.equal(a[0], b[0])  # fresh zoneout masks every step
    kept = (a[0] == hx[0]).float().mean()
    assert 0.2 < kept < 0.8
    cell.eval()
    assert cell.recurrent_mask(3) is None
    plain = fastlayers.LSTMCell(4, 5).eval()
    plain.load_state_dict(cell.state_dict())
    h, c = plain(x, hx)  # eval: the expectation z * prev + (1 - z) * new
    torch.testing.assert_close(cell(x, hx), (0.5 * hx[0] + 0.5 * h, 0.5 * hx[1] + 0.5 * c))
    with pytest.raises(ValueError, match=r"recurrent_mask: expected shape \(3, 5\)"):
        cell(x, hx, recurrent_mask=torch.ones(3, 4))


def test_readme_decoding_example_runs():
    """The greedy decoding loop of docs/recurrent.md (shapes as written there)."""
    torch.manual_seed(0)
    vocab, emb = 10, 8
    embed = nn.Embedding(vocab, emb)
    cell = fastlayers.LSTMCell(emb, 16, layer_norm=True, zoneout=0.1).eval()
    head = nn.Linear(16, vocab)
    runs = []
    for context in (torch.no_grad, torch.enable_grad):  # without autograd the step runs the C++ operator
        token, state = torch.zeros(2, dtype=torch.long), None
        out, states = [], []
        with context():
            for _ in range(5):
                state = cell(embed(token), state)
                token = head(state[0]).argmax(-1)
                out.append(token)
                states.append(torch.cat(state, -1).detach())
        runs.append((torch.stack(out), torch.stack(states)))
    (tokens, states), (tokens_grad, states_grad) = runs
    assert tokens.shape == (5, 2) and torch.equal(tokens, tokens_grad)
    torch.testing.assert_close(states, states_grad, rtol=1e-5, atol=1e-6)


def test_forced_reference_backend_runs_the_equations_without_autograd(monkeypatch):
    """Without autograd a cell with options runs the C++ operator over one step, unless a backend
    other than the C kernels is forced: then the per-step equations, equal to the operator's."""
    from fastlayers.rnn import _cells

    torch.manual_seed(0)
    cell = fastlayers.LSTMCell(4, 5, layer_norm=True, peephole=True).eval()
    x = torch.randn(3, 4)
    calls = []
    original = _cells._step_on_operator
    monkeypatch.setattr(_cells, "_step_on_operator", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        fast = cell(x)
        assert calls == [1]
        with fastlayers.backend("reference"):
            slow = cell(x)
    assert calls == [1]
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


PRUNE_KINDS = KINDS + [(m + "Cell", o) for m, sets in OPTION_SETS.items() for o in sets]


def _states(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("how", ["prune", "weight_norm hooks", "spectral_norm hooks", "buffers"])
@pytest.mark.parametrize("name,kwargs", PRUNE_KINDS)
def test_cells_read_pruned_and_hook_normalised_parameters(name, kwargs, how):
    """torch.nn.utils.prune and the hook-based weight_norm / spectral_norm turn a Parameter into
    ``<name>_orig`` (or ``_g`` / ``_v``) and set the tensor they compute as a plain attribute before
    each call. The cells read registered Parameters only: KeyError for a weight, a pruned bias
    silently dropped (outputs 0.1-0.5 off); so were weights frozen as buffers. The call equals a
    cell holding the computed tensors, with and without autograd, and its input gradient that
    cell's."""
    from torch.nn.utils import prune

    torch.manual_seed(0)
    cell = getattr(fastlayers, name)(4, 5, **kwargs).double().eval()
    if how == "prune":
        for param, _ in list(cell.named_parameters()):
            prune.random_unstructured(cell, param, amount=0.4)
    elif how == "weight_norm hooks":
        with pytest.warns(FutureWarning):  # (torch deprecates it for the parametrization)
            nn.utils.weight_norm(cell, "weight_hh")
    elif how == "spectral_norm hooks":
        nn.utils.spectral_norm(cell, "weight_hh")
    else:  # frozen: a Parameter replaced by a buffer (torch.nn's cells read it; ours dropped a bias)
        for param, p in list(cell.named_parameters()):
            delattr(cell, param)
            cell.register_buffer(param, p.detach().clone())
    twin = getattr(fastlayers, name)(4, 5, **kwargs).double().eval()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            got = _states(cell(x))
        with torch.no_grad():
            for param, p in twin.named_parameters():
                p.copy_(getattr(cell, param))  # the tensors this call computed
        with torch.set_grad_enabled(grad):
            want = _states(twin(x))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(sum(s.sum() for s in _states(cell(x))), [x, *cell.parameters()])
    torch.testing.assert_close(grads[0], torch.autograd.grad(sum(s.sum() for s in _states(twin(x))), x)[0],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_rnn_cell_recurrent_mask_multiplies_h_before_torchs_kernel(nonlinearity):
    """RNNCell documents ``recurrent_mask=``; it ran the GRU's step equations for it (a size error)."""
    ours, theirs = _pair("RNNCell", {"nonlinearity": nonlinearity})
    x, h = torch.randn(3, 4, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    mask = torch.bernoulli(torch.full((3, 5), 0.7)) / 0.7
    got = ours(x, h, recurrent_mask=mask)
    want = theirs(x, h * mask)
    assert torch.equal(got, want)
    leaves = [x, h, *ours.parameters()]
    g_ours = torch.autograd.grad(got.square().sum(), leaves)
    g_theirs = torch.autograd.grad(want.square().sum(), [x, h, *theirs.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(g_ours, g_theirs, strict=True))
    assert torch.equal(ours(x[0], h[0], recurrent_mask=mask[0]), theirs(x[0], h[0] * mask[0]))  # unbatched


@pytest.mark.parametrize("make", [lambda: fastlayers.LSTMCell(4, 5, layer_norm=True),
                                  lambda: fastlayers.GRUCell(4, 5, layer_norm=True)], ids=["LSTMCell", "GRUCell"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_recurrent_mask_on_another_device_is_refused(make, grad):
    """The mask's device is checked as the state's is (without autograd the operator read a meta
    mask's memory and returned garbage; with it, torch's error did not name the argument)."""
    cell = make()
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=r"^recurrent_mask: expected device cpu "
                                                                          r"\(that of input\), got meta$"):
        cell(torch.randn(3, 4), recurrent_mask=torch.ones(3, 5, device="meta"))


@pytest.mark.parametrize("make, batch", [
    (lambda: fastlayers.LSTMCell(8, 300, layer_norm=True, peephole=True, cell_clip=0.5), 1),
    (lambda: fastlayers.LSTMCell(8, 750, layer_norm=True), 20),  # (2M values or more, at batch 16 or more)
    (lambda: fastlayers.LSTM(8, 160, layer_norm=True, bidirectional=True), 3),
    (lambda: fastlayers.GRUCell(8, 300, layer_norm=True, zoneout=0.2), 1),
    (lambda: fastlayers.GRUCell(8, 850, layer_norm=True), 20),
    (lambda: fastlayers.GRU(8, 160, layer_norm=True, bidirectional=True), 3),
    (lambda: fastlayers.GRU(8, 20, zoneout=0.1, bidirectional=True), 20)])
def test_one_step_of_a_large_weight_on_the_per_step_path(make, batch):
    """One step of a weight over 64K values now takes the per-step path in the no-grad operator
    where packing the weight for one step cost more than the step (a batch under 16, or a weight of
    2M values or more: 4.6x torch.nn.LSTMCell's step at hidden 512, batch 1; the GRU had no per-step
    path); it equals the float64 reference and the grad path."""
    torch.manual_seed(0)
    module = make().eval()
    x = torch.randn(batch, 8) if isinstance(module, (fastlayers.LSTMCell, fastlayers.GRUCell)) else torch.randn(1, batch, 8)
    with torch.no_grad(), fastlayers.backend("cpu"):
        got = module(x)
    with fastlayers.backend("cpu"):
        grad_path = module(x.requires_grad_())
    with torch.no_grad(), fastlayers.backend("reference"):
        want = copy.deepcopy(module).double()(x.detach().double())
    from torch.utils._pytree import tree_leaves

    for a, b, c in zip(tree_leaves(got), tree_leaves(grad_path), tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.double(), c, rtol=1e-5, atol=1e-5)
