"""torch.func transforms (grad, vmap over grad, jvp) and forward-mode AD over every layer, as they
run over torch.nn's: the call runs on the reference backend (fastlayers._core.backend.transformed),
with a warning, and gives what the ordinary autograd of the default path gives, in float64. And
``torch.func.functional_call`` and ``torch.nn.utils.parametrize`` (weight_norm) on every backend:
the call sees the parameters given for it.

The kernels' autograd Functions have no functorch rules; before, each of these raised "In order to
use an autograd.Function with functorch transforms ... it must override the setup_context
staticmethod" (or, for forward AD, "You must implement the jvp function")."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import functional_call, grad, jvp, vmap

import fastlayers
from fastlayers._core import backend as _backend

# the transformed calls run the reference's ops (see pyproject's markers); functional_call and the
# parametrizations run every backend
reference_only = pytest.mark.reference_only

LENGTHS = torch.tensor([5, 3, 4])
RNN_CASES = {
    "LSTM lengths": (fastlayers.LSTM, {}, True),
    "GRU lengths": (fastlayers.GRU, {}, True),
    "RNN lengths": (fastlayers.RNN, {}, True),
    "LSTM layer_norm 2 layers bidirectional": (fastlayers.LSTM, {"layer_norm": True, "num_layers": 2,
                                                                 "bidirectional": True}, False),
    "LSTM peephole cell_clip lengths": (fastlayers.LSTM, {"peephole": True, "cell_clip": 0.5}, True),
    "LSTM proj_size proj_clip": (fastlayers.LSTM, {"proj_size": 2, "proj_clip": 0.4}, False),
    "LSTM zoneout (eval) lengths": (fastlayers.LSTM, {"zoneout": 0.3}, True),
    "LSTM layer_norm checkpoint_every": (fastlayers.LSTM, {"layer_norm": True, "checkpoint_every": 2}, False),
    "GRU layer_norm bidirectional lengths": (fastlayers.GRU, {"layer_norm": True, "bidirectional": True}, True),
}


def _rnn(name):
    cls, options, with_lengths = RNN_CASES[name]
    torch.manual_seed(0)
    module = cls(4, 3, **options).double().eval()  # as constructed (its own initialisation)
    kwargs = {"lengths": LENGTHS} if with_lengths else {}
    return module, (torch.randn(5, 3, 4, dtype=torch.float64),), kwargs


def _local(name):
    torch.manual_seed(0)
    if name == "LocallyConnected2d":
        return fastlayers.LocallyConnected2d(2, 3, 5, 3).double(), (torch.randn(3, 2, 5, 5, dtype=torch.float64),), {}
    return fastlayers.LocallyConnected1d(2, 3, 6, 3).double(), (torch.randn(3, 2, 6, dtype=torch.float64),), {}


def _attention(name):
    torch.manual_seed(0)
    module = fastlayers.AttentionPooling(4, 4, score="additive" if "additive" in name else "dot").double()
    return module, (torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)), \
        {"lengths": torch.tensor([5, 2, 4])}


CASES = {**{name: _rnn for name in RNN_CASES}, "LocallyConnected2d": _local, "LocallyConnected1d": _local,
         "AttentionPooling dot": _attention, "AttentionPooling additive": _attention}


def _case(name):
    return CASES[name](name)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _loss(module, params, args, kwargs):
    out = _first(functional_call(module, params, args, kwargs))
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum()


def _autograd_gradients(module, args, kwargs):
    """The ordinary backward's gradients of the parameters and the inputs (the default path)."""
    module.zero_grad()
    args = tuple(a.detach().requires_grad_() for a in args)
    _loss(module, dict(module.named_parameters()), args, kwargs).backward()
    return {k: p.grad.clone() for k, p in module.named_parameters()}, tuple(a.grad for a in args)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fastlayers: .* under a torch.func transform")
        warnings.filterwarnings("ignore", message="There is a performance drop")  # (torch's vmap fallback)
        yield


@reference_only
@pytest.mark.parametrize("name", CASES)
def test_func_grad_equals_autograd(name):
    module, args, kwargs = _case(name)
    expected, expected_inputs = _autograd_gradients(module, args, kwargs)
    params = {k: p.detach() for k, p in module.named_parameters()}
    got, got_inputs = grad(lambda p, a: _loss(module, p, a, kwargs), argnums=(0, 1))(params, args)
    assert got.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-12, msg=f"{name}: {key}")
    for i, (g, e) in enumerate(zip(got_inputs, expected_inputs)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=f"{name}: input {i}")


@reference_only
@pytest.mark.parametrize("cls,options", [
    (fastlayers.LSTM, {"zoneout": (0.3, 0.2), "recurrent_dropout": 0.25, "layer_norm": True}),
    (fastlayers.GRU, {"zoneout": 0.3, "recurrent_dropout": 0.25, "num_layers": 2, "dropout": 0.3}),
    (fastlayers.LSTM, {"zoneout": 0.2, "checkpoint_every": 2}),
], ids=["LSTM", "GRU two layers", "LSTM checkpoint_every"])
def test_func_grad_in_training_draws_the_masks_autograd_draws(cls, options):
    """Training mode under torch.func.grad runs (it once raised "Cannot access data pointer": the
    native mask kernel cannot read torch.func's wrapped tensors; the torch-ops twin makes the same
    masks from the CPU generator's draws) and draws the masks the ordinary call on the reference
    backend draws from the same seed (the reference, which runs under transforms, draws them step by
    step, the C engine per layer), so the same gradients."""
    torch.manual_seed(0)
    module = cls(4, 3, **options).double().train()
    args, kwargs = (torch.randn(5, 3, 4, dtype=torch.float64),), {"lengths": LENGTHS}
    torch.manual_seed(1)
    with fastlayers.backend("reference"):
        expected, expected_inputs = _autograd_gradients(module, args, kwargs)
    params = {k: p.detach() for k, p in module.named_parameters()}
    torch.manual_seed(1)
    got, got_inputs = grad(lambda p, a: _loss(module, p, a, kwargs), argnums=(0, 1))(params, args)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-12, msg=key)
    torch.testing.assert_close(got_inputs[0], expected_inputs[0], rtol=1e-10, atol=1e-12)


@reference_only
@pytest.mark.parametrize("name", CASES)
def test_functionalize_gives_the_call_and_its_gradients(name):
    """torch.func.functionalize over every layer (and grad over it): the plain layers with lengths
    once raised "mutating a non-functional tensor with a functional tensor" and then "tolist()
    shouldn't be called on a tensor with unallocated storage" (the lengths plan's host reads)."""
    from torch.func import functionalize

    module, args, kwargs = _case(name)
    expected, expected_inputs = _autograd_gradients(module, args, kwargs)
    torch.testing.assert_close(functionalize(lambda *a: _first(module(*a, **kwargs)))(*args),
                               _first(module(*args, **kwargs)), rtol=1e-12, atol=1e-12)
    params = {k: p.detach() for k, p in module.named_parameters()}
    got, got_inputs = grad(functionalize(lambda p, a: _loss(module, p, a, kwargs)), argnums=(0, 1))(params, args)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-12, msg=f"{name}: {key}")
    for i, (g, e) in enumerate(zip(got_inputs, expected_inputs)):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12, msg=f"{name}: input {i}")


@reference_only
@pytest.mark.parametrize("cls", [fastlayers.LSTM, fastlayers.GRU, fastlayers.RNN])
def test_functionalize_over_a_varlen_call(cls):
    from torch.func import functionalize

    torch.manual_seed(0)
    module = cls(4, 3, bidirectional=True).double().eval()
    values, cu = torch.randn(12, 4, dtype=torch.float64), torch.tensor([0, 5, 8, 12])
    want = module(values, cu_seqlens=cu)
    got = functionalize(lambda v: module(v, cu_seqlens=cu))(values)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@reference_only
@pytest.mark.parametrize("name", CASES)
def test_per_sample_gradients_with_vmap(name):
    """vmap(grad) over the batch (per-sample gradients, as torch.func's tutorial and Opacus compute
    them) equals one ordinary backward per sample. Without lengths: they are read on the host to
    plan the call, which vmap cannot batch (neither can torch.nn's PackedSequence)."""
    module, args, kwargs = _case(name)
    kwargs = {k: v for k, v in kwargs.items() if k != "lengths"}
    dims = [1 if name in RNN_CASES else 0] + [0] * (len(args) - 1)
    params = {k: p.detach() for k, p in module.named_parameters()}

    def one(p, *sample):  # one sample, as a batch of one
        return _loss(module, p, tuple(s.unsqueeze(d) for s, d in zip(sample, dims)), kwargs)

    if name == "RNN lengths":  # a plain RNN runs torch.nn.RNN's fused kernel: no batching rule, torch's error
        with pytest.raises(RuntimeError) as raised:
            vmap(grad(one, argnums=(0, 1)), in_dims=(None, *dims))(params, *args)
        assert str(raised.traceback[-1].path).endswith("torch/nn/modules/rnn.py")  # torch's kernel raised it
        return
    got, got_inputs = vmap(grad(one, argnums=(0, 1)), in_dims=(None, *dims))(params, *args)
    for b in range(args[0].size(dims[0])):
        sample = tuple(a.narrow(d, b, 1) for a, d in zip(args, dims))
        expected, expected_inputs = _autograd_gradients(module, sample, kwargs)
        for key in expected:
            torch.testing.assert_close(got[key][b], expected[key], rtol=1e-10, atol=1e-12, msg=f"{name}: {key}[{b}]")
        torch.testing.assert_close(got_inputs[b], expected_inputs[0].squeeze(dims[0]), rtol=1e-10, atol=1e-12)


FORWARD_AD = list(CASES)


def _tangents(args):
    torch.manual_seed(1)
    return tuple(torch.randn_like(a) for a in args)


def _double_backward_jvp(module, args, kwargs, tangents):
    """The Jacobian-vector product through reverse mode twice (torch.autograd.functional.jvp): the
    default path's second derivatives, with no forward-mode AD."""
    return torch.autograd.functional.jvp(lambda *a: _first(module(*a, **kwargs)), args, tangents)[1]


def _forward_mode(how, module, args, kwargs, tangents):
    if how == "torch.func.jvp":
        return jvp(lambda *a: _first(module(*a, **kwargs)), args, tangents)[1]
    with forward_ad.dual_level():
        duals = tuple(forward_ad.make_dual(a, t) for a, t in zip(args, tangents))
        return forward_ad.unpack_dual(_first(module(*duals, **kwargs))).tangent


@reference_only
@pytest.mark.parametrize("how", ["torch.func.jvp", "forward_ad"])
@pytest.mark.parametrize("name", FORWARD_AD)
def test_forward_mode_equals_double_backward(name, how):
    module, args, kwargs = _case(name)
    tangents = _tangents(args)
    expected = _double_backward_jvp(module, args, kwargs, tangents)
    got = _forward_mode(how, module, args, kwargs, tangents)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@reference_only
def test_plain_layers_under_vmap_and_forward_ad_where_torch_nn_raises():
    """torch.nn.LSTM's float32 CPU kernel (oneDNN) has no forward derivative, and torch's fused RNN
    kernels no vmap batching rule: the plain LSTM / GRU run their reference there (values of the
    default path); torch.nn.RNN's kernels stay (torch's errors)."""
    torch.manual_seed(0)
    x, tangent = torch.randn(5, 3, 4), torch.randn(5, 3, 4)
    for cls, ours in ((torch.nn.LSTM, fastlayers.LSTM), (torch.nn.GRU, fastlayers.GRU)):
        torch.manual_seed(0)
        module, twin = ours(4, 3), cls(4, 3)
        twin.load_state_dict(module.state_dict())
        expected = torch.autograd.functional.jvp(lambda x: module(x)[0], (x,), (tangent,))[1]
        with forward_ad.dual_level():
            got = forward_ad.unpack_dual(module(forward_ad.make_dual(x, tangent))[0]).tangent
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        batched = vmap(lambda x: module(x.unsqueeze(1))[0].squeeze(1), in_dims=1)(x)
        torch.testing.assert_close(batched, module(x)[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
        if cls is torch.nn.LSTM:
            with forward_ad.dual_level(), pytest.raises(NotImplementedError, match="forward AD"):
                twin(forward_ad.make_dual(x, tangent))
        with pytest.raises(RuntimeError, match=r"^Batching rule not implemented for aten::(lstm|gru)"):
            vmap(lambda x: twin(x.unsqueeze(1))[0].squeeze(1), in_dims=1)(x)


def test_transformed_is_false_outside_and_true_inside():
    assert not _backend.transformed()
    seen = []
    grad(lambda x: (seen.append(_backend.transformed()), x.sum())[1])(torch.ones(2))
    vmap(lambda x: (seen.append(_backend.transformed()), x)[1])(torch.ones(2))
    with forward_ad.dual_level():
        seen.append(_backend.transformed())
    assert seen == [True, True, True] and not _backend.transformed()


@reference_only
def test_the_reference_runs_with_a_warning_once_per_op(monkeypatch):
    monkeypatch.setattr(fastlayers._native, "_WARNED", set())
    module, args, kwargs = _case("LSTM layer_norm 2 layers bidirectional")
    params = {k: p.detach() for k, p in module.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            grad(lambda p: _loss(module, p, args, kwargs))(params)
    ours = [w for w in caught if "fastlayers: lstm under a torch.func transform" in str(w.message)]
    assert len(ours) == 1 and ours[0].category is UserWarning
    assert _backend.select("lstm", args[0]) == "cpu"  # outside the transform: the kernels again


@reference_only
@pytest.mark.parametrize("forced", ["cpu", "triton"])
def test_a_forced_kernel_backend_under_a_transform_says_why(forced):
    module, args, kwargs = _case("LSTM layer_norm 2 layers bidirectional")
    params = {k: p.detach() for k, p in module.named_parameters()}
    with fastlayers.backend(forced), pytest.raises(RuntimeError, match=f"backend '{forced}' .* cannot run lstm"):
        grad(lambda p: _loss(module, p, args, kwargs))(params)
    with fastlayers.backend("reference"):  # forced reference: runs
        grad(lambda p: _loss(module, p, args, kwargs))(params)



@reference_only
@pytest.mark.parametrize("forced", ["cpu", "triton"])
@pytest.mark.parametrize("cls,op", [(fastlayers.LSTMCell, "lstm"), (fastlayers.GRUCell, "gru")], ids=["LSTMCell", "GRUCell"])
def test_a_forced_kernel_backend_under_a_transform_says_why_for_the_cells_too(forced, cls, op):
    """The cells with options ran their equations under a transform with a kernel backend forced,
    where the layers refuse it: now the same RuntimeError, and the reference still runs."""
    torch.manual_seed(0)
    cell = cls(4, 3, layer_norm=True).double()
    x = torch.randn(2, 4, dtype=torch.float64)

    def loss(x):
        return torch.utils._pytree.tree_leaves(cell(x))[0].sum()

    leaf = x.clone().requires_grad_()
    g, = torch.autograd.grad(loss(leaf), leaf)  # the ordinary backward, outside any transform
    along = torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)
    for transform, want in ((grad, g), (lambda f: (lambda x: jvp(f, (x,), (along,))[1]), (g * along).sum())):
        with fastlayers.backend(forced), pytest.raises(RuntimeError, match=f"backend '{forced}' .* cannot run {op}"):
            transform(loss)(x)
        with fastlayers.backend("reference"):
            torch.testing.assert_close(transform(loss)(x), want, rtol=1e-10, atol=1e-12)
FUNCTIONAL_CASES = {
    **{f"{cls.__name__} {label}": (cls, options) for cls in (fastlayers.LSTM, fastlayers.GRU)
       for label, options in (("plain", {}), ("layer_norm", {"layer_norm": True}),
                              ("2 layers bidirectional", {"num_layers": 2, "bidirectional": True}))},
    "RNN plain": (fastlayers.RNN, {}), "RNN 2 layers bidirectional": (fastlayers.RNN, {"num_layers": 2,
                                                                                       "bidirectional": True}),
    "LSTM proj_size": (fastlayers.LSTM, {"proj_size": 2}),
}


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("name", FUNCTIONAL_CASES)
def test_functional_call_runs_the_given_parameters(name, with_lengths, backend):
    """torch.func.functional_call(module, params, ...) computes with ``params`` (values, and the
    gradients reach them) on every path: the plain layers with lengths read torch's
    ``_flat_weights``, which torch refreshes at the start of its own forward only (a plain RNN with
    lengths, and LSTM / GRU on the reference backend, ran the module's own parameters and gave
    ``params`` no gradient)."""
    cls, options = FUNCTIONAL_CASES[name]
    torch.manual_seed(0)
    module = cls(4, 3, **options).double()
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    kwargs = {"lengths": LENGTHS} if with_lengths else {}
    params = {k: (p.detach() * 1.5).requires_grad_() for k, p in module.named_parameters()}
    twin = cls(4, 3, **options).double()
    twin.load_state_dict({k: v.detach() for k, v in params.items()})
    with fastlayers.backend(backend):
        out = functional_call(module, params, (x,), kwargs)[0]
        want = twin(x, **kwargs)[0]
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
        weight = torch.randn_like(out)
        (out * weight).sum().backward()
        (want * weight).sum().backward()
    for key, p in twin.named_parameters():
        torch.testing.assert_close(params[key].grad, p.grad, rtol=1e-10, atol=1e-12, msg=key)
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("name", ["LSTM", "GRU", "RNN", "LSTM layer_norm", "LSTMCell", "LSTMCell layer_norm",
                                  "GRUCell layer_norm", "RNNCell"])
def test_weight_norm_on_the_recurrent_weight(name, backend):
    """torch.nn.utils.parametrizations.weight_norm on weight_hh (as AWD-LSTM-style models use
    parametrizations): the layer computes with the parametrized weight and its gradient reaches
    the parametrization's tensors (the cells read their parameters from nn.Module's own dict and
    raised KeyError)."""
    cls_name, *option = name.split()
    options = {"layer_norm": True} if option else {}
    cell = cls_name.endswith("Cell")
    torch.manual_seed(0)
    module = getattr(fastlayers, cls_name)(4, 3, **options).double()
    key = "weight_hh" if cell else "weight_hh_l0"
    plain = getattr(fastlayers, cls_name)(4, 3, **options).double()
    plain.load_state_dict(module.state_dict())
    normed = torch.nn.utils.parametrizations.weight_norm(module, name=key)
    with torch.no_grad():
        getattr(normed.parametrizations, key).original0.mul_(1.5)
        getattr(plain, key).mul_(1.5)
    x = torch.randn(3, 4, dtype=torch.float64) if cell else torch.randn(5, 3, 4, dtype=torch.float64)
    state = torch.randn(3, 3, dtype=torch.float64) if cell else None
    hx = ((state, state) if cls_name == "LSTMCell" else state) if cell else None
    kwargs = {} if cell else {"lengths": LENGTHS}
    with fastlayers.backend(backend):
        out = _first(normed(x, hx, **kwargs))
        want = _first(plain(x, hx, **kwargs))
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        out.sum().backward()
    parametrization = getattr(normed.parametrizations, key)
    assert parametrization.original0.grad.abs().sum() > 0 and parametrization.original1.grad.abs().sum() > 0


@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("cls", [fastlayers.RNN, fastlayers.LSTM, fastlayers.GRU])
def test_functional_call_with_parameters_of_another_dtype(cls, with_lengths):
    """Parameters of another dtype than the module's (float64 for a float32 module; bf16 for a bf16
    RNN, whose CPU call computes in float32 on the rounded parameters): the call runs them, as a
    module holding them does (torch.nn's layers compare the input with the parameters given)."""
    torch.manual_seed(0)
    kwargs = {"lengths": LENGTHS} if with_lengths else {}
    for dtype, module in ((torch.float64, cls(4, 3)), (torch.bfloat16, cls(4, 3).bfloat16())):
        params = {k: (p.detach() * 1.5).to(dtype) for k, p in module.named_parameters()}
        twin = cls(4, 3).to(dtype)
        twin.load_state_dict(params)
        x = torch.randn(5, 3, 4).to(dtype)
        torch.testing.assert_close(functional_call(module, params, (x,), kwargs)[0], twin(x, **kwargs)[0],
                                   rtol=0, atol=0)
