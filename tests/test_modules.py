"""Module contract of every public module and option, in the spirit of PyTorch's test_modules.

Every test works on modules *as constructed* (no test sets weights itself): initialisation,
seeding, meta construction, repr, deepcopy, pickle, torch.save/load, state_dict, dtype moves,
zero_grad and train/eval.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import fastlayers

from module_cases import CASE_IDS, CASES, Case, flat, run

each_case = pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
_params = [c for c in CASES if any(True for _ in c.build(device="meta").parameters())]
with_parameters = pytest.mark.parametrize("case", _params, ids=[c.id for c in _params])
with_counterpart = pytest.mark.parametrize("case", [c for c in CASES if c.counterpart is not None],
                                           ids=[c.id for c in CASES if c.counterpart is not None])


def _build(case: Case, seed: int = 0, **factory) -> nn.Module:
    torch.manual_seed(seed)
    return case.build(**factory).eval()


def _assert_same_outputs(a: nn.Module, b: nn.Module, case: Case, dtype=torch.float32) -> None:
    outs_a, _ = run(a, case, dtype, backward=False)
    outs_b, _ = run(b, case, dtype, backward=False)
    assert len(outs_a) == len(outs_b)
    for x, y in zip(outs_a, outs_b):
        assert torch.equal(x, y)


def _assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def _check_init(case: Case, module: nn.Module) -> None:
    """Every parameter finite and following the documented rule (range and moments per parameter)."""
    for name, p in module.named_parameters():
        p = p.detach().double()
        assert torch.isfinite(p).all(), f"{name}: non-finite values as constructed"
        kind, value = case.init(name, module)
        if kind == "const":
            assert torch.equal(p, torch.full_like(p, value)), f"{name}: expected all {value}"
            continue
        bound, n = value, p.numel()
        assert p.abs().max() <= bound, f"{name}: outside uniform(-{bound:.4g}, {bound:.4g})"
        sd = bound / 3 ** 0.5  # of uniform(-b, b)
        assert p.abs().max() > 0.5 * bound, f"{name}: no value near the bound {bound:.4g}"
        if n >= 40:
            assert abs(p.mean()) <= 5 * sd / n ** 0.5, f"{name}: mean {p.mean():.3g} off 0"
            assert 0.7 * sd <= p.std() <= 1.3 * sd, f"{name}: std {p.std():.3g}, expected ~{sd:.3g}"


@with_parameters
def test_constructed_parameters_follow_the_documented_init(case):
    _check_init(case, _build(case))


@with_parameters
def test_same_seed_same_parameters_bitwise(case):
    _assert_same_parameters(_build(case, 3), _build(case, 3))
    different = _build(case, 4)
    assert not any(torch.equal(p, q) for (n, p), (_, q) in zip(_build(case, 3).named_parameters(),
                                                                 different.named_parameters())
                   if case.init(n, different)[0] == "uniform")


@with_counterpart
def test_same_seed_as_the_torch_counterpart(case):
    """With options off a module draws exactly torch's parameters; with options, the shared ones."""
    ours = _build(case, 2)
    torch.manual_seed(2)
    for name, p in case.counterpart().named_parameters():
        assert torch.equal(p, getattr(ours, name)), name


@each_case
def test_meta_then_to_empty_and_reset_parameters(case):
    meta = _build(case, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(5)
    meta.reset_parameters()
    _check_init(case, meta)
    # construction is exactly one reset_parameters() after the same seed
    _assert_same_parameters(meta, _build(case, 5))
    _assert_same_outputs(meta, _build(case, 5), case)


@pytest.mark.parametrize("how", ["prune", "parametrize"])
@pytest.mark.parametrize("name", ["LSTM", "GRU", "LSTMCell", "GRUCell"])
def test_reset_parameters_sets_layer_norm_gains_that_are_pruned_or_parametrized(name, how):
    """reset_parameters() gives LayerNorm gains 1 in the tensor the module stores (``<name>_orig``,
    ``parametrizations.<name>.original``): the layers filled the computed tensor, so the next call
    used torch's uniform draw (the cells did so under parametrize)."""
    from torch.nn.utils import parametrize, prune

    module = getattr(fastlayers, name)(4, 6, layer_norm=True)
    gains = [n for n, _ in module.named_parameters() if n.startswith("ln_") and "weight" in n]
    for gain in gains:
        if how == "prune":
            prune.identity(module, gain)
        else:
            parametrize.register_parametrization(module, gain, nn.Identity())
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-1, 1)
    module.reset_parameters()
    module(torch.randn(2, 3, 4) if name in ("LSTM", "GRU") else torch.randn(3, 4))  # (prune recomputes here)
    for gain in gains:
        assert torch.equal(getattr(module, gain), torch.ones_like(getattr(module, gain))), gain


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("name", ["LSTM", "GRU"])
def test_a_parametrized_weight_is_computed_once_a_call(name, grad):
    """Each read of a parametrized weight runs its parametrization (spectral_norm: one power
    iteration in training), so a call reads it once, with or without autograd (the C++ operator
    path read it twice: a hasattr, then the value)."""
    from torch.nn.utils import parametrize

    class Counted(nn.Module):
        calls = 0

        def forward(self, w):
            Counted.calls += 1
            return w

    module = getattr(fastlayers, name)(4, 6, num_layers=2, layer_norm=True)
    parametrize.register_parametrization(module, "weight_hh_l0", Counted())
    Counted.calls = 0  # (registering computes it once)
    with torch.set_grad_enabled(grad):
        module(torch.randn(5, 3, 4), lengths=[5, 2, 4])
    assert Counted.calls == 1


@each_case
def test_repr(case):
    text = repr(_build(case))
    for part in case.repr_has:
        assert part in text, f"{part!r} not in {text!r}"


@each_case
def test_deepcopy_is_equal_and_independent(case):
    module = _build(case)
    clone = copy.deepcopy(module)
    _assert_same_parameters(module, clone)
    _assert_same_outputs(module, clone, case)
    for p, q in zip(module.parameters(), clone.parameters()):
        assert p.data_ptr() != q.data_ptr()
    with torch.no_grad():
        for q in clone.parameters():
            q.add_(1.0)
    _assert_same_parameters(module, _build(case))


@each_case
def test_pickle_and_torch_save_round_trips(case):
    module = _build(case)
    _assert_same_outputs(module, pickle.loads(pickle.dumps(module)), case)
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    _assert_same_outputs(module, torch.load(buf, weights_only=False), case)
    buf = io.BytesIO()
    torch.save(module.state_dict(), buf)
    buf.seek(0)
    fresh = _build(case, 9)
    fresh.load_state_dict(torch.load(buf, weights_only=True), strict=True)
    _assert_same_outputs(module, fresh, case)


@each_case
def test_state_dict_round_trip_and_torch_counterpart(case):
    module = _build(case)
    fresh = _build(case, 9)
    fresh.load_state_dict(module.state_dict(), strict=True)
    _assert_same_parameters(module, fresh)
    _assert_same_outputs(module, fresh, case)
    if case.counterpart is None:
        return
    torch.manual_seed(9)
    theirs = case.counterpart().eval()
    result = theirs.load_state_dict(module.state_dict(), strict=False)
    extra = {n for n, _ in module.named_parameters()} - {n for n, _ in theirs.named_parameters()}
    assert set(result.unexpected_keys) == extra and not result.missing_keys
    for name, p in theirs.named_parameters():
        assert torch.equal(p, getattr(module, name))
    options = getattr(module, "options", None)
    if options is None or options.plain:  # options off: the same function, both ways round
        module.load_state_dict(theirs.state_dict(), strict=True)
        args, _ = case.inputs(torch.float32)
        engine = getattr(module, "checkpoint_every", None) is not None  # (the engine's segments: another order
        for a, b in zip(module(*args), theirs(*args), strict=True):  # of sums than torch's kernel)
            for s, t in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True):
                if engine:
                    torch.testing.assert_close(s, t, rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(s, t)


@each_case
@pytest.mark.parametrize("move", ["to", "double"])
def test_float64_then_forward(case, move):
    module = _build(case)
    outs32, _ = run(module, case)
    moved = module.to(torch.float64) if move == "to" else module.double()
    assert all(p.dtype == torch.float64 for p in moved.parameters())
    outs64, grads = run(moved, case, torch.float64)
    assert all(o.dtype == torch.float64 for o in outs64)
    assert all(g is not None and g.dtype == torch.float64 for g in grads.values())
    for a, b in zip(outs32, outs64):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4)


@each_case
def test_zero_grad(case):
    module = _build(case)
    _, grads = run(module, case)
    assert all(g is not None for g in grads.values())
    module.zero_grad(set_to_none=False)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in module.parameters())
    module.zero_grad()
    assert all(p.grad is None for p in module.parameters())


@each_case
def test_train_eval_switches(case):
    module = _build(case)
    assert not module.training and all(not m.training for m in module.modules())
    assert module.train() is module and all(m.training for m in module.modules())
    torch.manual_seed(1)
    train_a, _ = run(module, case, backward=False)
    torch.manual_seed(2)
    train_b, _ = run(module, case, backward=False)
    module.eval()
    eval_a, _ = run(module, case, backward=False)
    eval_b, _ = run(module, case, backward=False)
    assert all(torch.equal(a, b) for a, b in zip(eval_a, eval_b))
    same_train = all(torch.equal(a, b) for a, b in zip(train_a, train_b))
    same_as_eval = all(torch.equal(a, b) for a, b in zip(train_a, eval_a))
    if case.stochastic:  # masks drawn in training only
        assert not same_train and not same_as_eval
    else:
        assert same_train and same_as_eval


@each_case
def test_second_derivatives_as_constructed(case):
    """Every module's gradient is differentiable again (create_graph): gradgradcheck in float64 with
    respect to the first input (fast mode: random projections of the Jacobians), eval mode."""
    module = _build(case).double()
    args, kwargs = case.inputs(torch.float64)
    x = args[0].detach().clone().requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda x: tuple(flat(module(x, *args[1:], **kwargs))), (x,), fast_mode=True)


@each_case
@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_as_constructed_values_and_gradients_equal_the_float64_reference(case, backend):
    """Each module as constructed (its own initialisation), in float32 on each backend (triton: CPU
    tensors under the interpreter), against a float64 copy on the reference backend: the outputs and
    the gradients of every input and parameter (the engine tests set their weights themselves)."""
    import fastlayers

    module = _build(case)
    reference = copy.deepcopy(module).double()
    with fastlayers.backend(backend):
        outs, grads = run(module, case)
    with fastlayers.backend("reference"):
        want_outs, want_grads = run(reference, case, torch.float64)
    assert len(outs) == len(want_outs) and grads.keys() == want_grads.keys()
    for a, b in zip(outs, want_outs):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4)
    for name, g in grads.items():
        want = want_grads[name]
        assert (g is None) == (want is None), name
        if g is not None:  # (float32 sums of terms up to the gradient's largest: rounding scales with it)
            scale = max(1.0, want.abs().max().item())
            torch.testing.assert_close(g.double(), want, atol=1e-5 * scale, rtol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")
