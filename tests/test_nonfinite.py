"""Non-finite and extreme input, per layer: NaN / inf reach exactly the outputs the float64
reference sends them to (no kernel swallows a NaN, crashes or hangs), and inputs of size 1e4 keep
LayerNorm, the gates and every output finite."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fastlayers
from module_cases import CASES, CELL_CASES, LENGTHS, Case, flat, leaves_like, weighted_sum

NAN, INF = float("nan"), float("inf")
RNN_CASES = [c for c in CASES if isinstance(c.build(device="meta"), nn.RNNBase)]
OTHER_CASES = [c for c in CASES if c not in RNN_CASES]
assert CELL_CASES and all(c in OTHER_CASES for c in CELL_CASES)
B_BAD, T_BAD = 2, 3  # sequence 2 has length 7: a valid step in the middle


def _module(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return case.build().eval()


def _reference(module: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    with fastlayers.backend("reference"):
        return flat(copy.deepcopy(module).double()(*leaves_like(args, torch.Tensor.double), **kwargs))


def _assert_same_nonfinite(outs, refs, atol=1e-4):
    for o, r in zip(outs, refs, strict=True):
        assert torch.equal(o.isnan(), r.isnan()), "NaN pattern differs from the float64 reference"
        assert torch.equal(o.isinf(), r.isinf()), "inf pattern differs from the float64 reference"
        keep = r.isfinite()
        torch.testing.assert_close(o[keep].double(), r[keep], atol=atol, rtol=atol)


def _backward_runs(outs, leaves):
    """The backward through non-finite values completes (values may be NaN) and reaches every leaf."""
    live = [o for o in outs if o.requires_grad]
    torch.autograd.backward(live, [torch.ones_like(o) for o in live])
    assert all(t.grad is not None for t in leaves)


def _rnn_input(case: Case, value: float) -> tuple[torch.Tensor, dict, int]:
    (x,), kwargs = case.inputs(torch.float32)
    batch_first = x.size(0) == len(LENGTHS) and x.size(1) != len(LENGTHS)
    x = x.clone()
    if batch_first:
        x[B_BAD, T_BAD, 0] = value
    else:
        x[T_BAD, B_BAD, 0] = value
    return x, kwargs, 0 if batch_first else 1


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("case", RNN_CASES, ids=[c.id for c in RNN_CASES])
def test_rnn_nonfinite_input_reaches_what_the_reference_says(case, value):
    module = _module(case)
    x, kwargs, batch_dim = _rnn_input(case, value)
    x.requires_grad_(True)
    outs = flat(module(x, **kwargs))
    _assert_same_nonfinite(outs, _reference(module, (x.detach(),), kwargs))
    out = outs[0]
    others = [b for b in range(len(LENGTHS)) if b != B_BAD]
    assert out.index_select(batch_dim, torch.tensor(others)).isfinite().all(), "spread to other sequences"
    if value != value:  # NaN: the bad sequence's outputs after (forward) / before (reverse) the step
        assert out.select(batch_dim, B_BAD).isnan().any()
    _backward_runs(outs, [x, *module.parameters()])


PADDED_CASES = [c for c in RNN_CASES if "lengths" in c.inputs(torch.float32)[1]]
BACKENDS = ["cpu", "reference", "triton"]  # triton: CPU tensors under the interpreter (tests/conftest.py)


def _fill_padded_steps(x: torch.Tensor, batch_first: bool, value: float) -> torch.Tensor:
    """x with every padded step (t >= LENGTHS[b]) set to ``value``."""
    x = x.clone()
    for b, n in enumerate(LENGTHS):
        (x[b, n:] if batch_first else x[n:, b]).fill_(value)
    return x


def _call_and_grads(module, x, kwargs, create_graph=False):
    """Every output and final state of one training-mode call (masks from one seed), and the
    gradients of a weighted sum of them for the input and every parameter."""
    torch.manual_seed(1)
    outs = flat(module(x, **kwargs))
    return outs, torch.autograd.grad(weighted_sum(outs), [x, *module.parameters()], create_graph=create_graph)


# (the interpreter's triton runs with inf alone: a minute of CPU time fewer)
PADDED_RUNS = [(c, v, b) for b in BACKENDS for v in ([INF] if b == "triton" else [NAN, INF]) for c in PADDED_CASES]


@pytest.mark.parametrize(("case", "value", "backend"), PADDED_RUNS,
                         ids=[f"{c.id}-{v}-{b}" for c, v, b in PADDED_RUNS])
def test_rnn_padded_steps_are_never_read(case, value, backend):
    """NaN or inf at every padded step changes nothing: outputs, final states and every gradient
    equal those of zero padding exactly, and the input's gradient there is 0 (torch's packed
    semantics). The reference backend once ran its cell on the padded steps and dropped the result:
    the zero gradient through that cell turned NaN (0 * inf), in the parameters' gradients too."""
    torch.manual_seed(0)
    module = case.build().train()
    (x,), kwargs = case.inputs(torch.float32)
    batch_first = x.size(0) == len(LENGTHS) and x.size(1) != len(LENGTHS)
    with fastlayers.backend(backend):
        runs = [_call_and_grads(module, _fill_padded_steps(x, batch_first, v).requires_grad_(True), kwargs)
                for v in (0.0, value)]
    (outs, grads), (outs_bad, grads_bad) = runs
    for a, b in zip([*outs, *grads], [*outs_bad, *grads_bad], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(grads_bad[0], _fill_padded_steps(grads_bad[0], batch_first, 0.0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [c for c in PADDED_CASES if c.id in ("LSTM-all+proj", "GRU-all")],
                         ids=lambda c: c.id)
def test_rnn_padded_steps_are_never_read_twice(case, backend):
    """The same for a second derivative (a gradient penalty's backward), which recomputes through
    the reference's differentiable loop on every backend (fastlayers._core.twice)."""
    torch.manual_seed(0)
    module = case.build().train()
    (x,), kwargs = case.inputs(torch.float32)
    batch_first = x.size(0) == len(LENGTHS) and x.size(1) != len(LENGTHS)
    results = []
    with fastlayers.backend(backend):
        for v in (0.0, INF):
            xv = _fill_padded_steps(x, batch_first, v).requires_grad_(True)
            _, grads = _call_and_grads(module, xv, kwargs, create_graph=True)
            penalty = sum(g.pow(2).sum() for g in grads)
            results.append(torch.autograd.grad(penalty, [xv, *module.parameters()]))
    for a, b in zip(*results, strict=True):
        assert a.isfinite().all() and b.isfinite().all()
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("case", RNN_CASES, ids=[c.id for c in RNN_CASES])
def test_rnn_large_input_stays_finite(case):
    module = _module(case)
    (x,), kwargs = case.inputs(torch.float32)
    x = (x * 1e4).requires_grad_(True)
    outs = flat(module(x, **kwargs))
    assert all(o.isfinite().all() for o in outs)
    _assert_same_nonfinite(outs, _reference(module, (x.detach(),), kwargs), atol=5e-3)
    _backward_runs(outs, [x, *module.parameters()])
    assert x.grad.isfinite().all() and all(p.grad.isfinite().all() for p in module.parameters())


def test_layer_norm_lstm_gates_saturate_but_stay_finite_at_1e4():
    """The engine's own LayerNorm statistics and gates (not only the module output) at input 1e4."""
    torch.manual_seed(0)
    m = fastlayers.LSTM(8, 16, layer_norm=True, peephole=True, cell_clip=3.0).eval()
    x = torch.randn(6, 3, 8) * 1e4
    out, (h, c) = m(x, lengths=[6, 2, 5])
    assert out.isfinite().all() and h.isfinite().all() and c.isfinite().all()
    assert c.abs().max() <= 3.0 and h.abs().max() <= 1.0


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("case", [c for c in OTHER_CASES if "Locally" in c.id], ids=lambda c: c.id)
def test_locally_connected_nonfinite_input_reaches_its_receptive_field(case, value):
    module = _module(case)
    (x,), _ = case.inputs(torch.float32)
    x = x.clone()
    x[0, 0, ..., 4] = value  # one column (2-D: every row of it) of channel 0 in sample 0
    x.requires_grad_(True)
    outs = flat(module(x))
    _assert_same_nonfinite(outs, _reference(module, (x.detach(),), {}))
    assert not outs[0][0].isfinite().all() and outs[0][1:].isfinite().all()
    _backward_runs(outs, [x, *module.parameters()])


@pytest.mark.parametrize("case", [c for c in OTHER_CASES if "Locally" in c.id], ids=lambda c: c.id)
def test_locally_connected_large_input_stays_finite(case):
    module = _module(case)
    (x,), _ = case.inputs(torch.float32)
    outs = flat(module(x * 1e4))
    assert outs[0].isfinite().all()
    _assert_same_nonfinite(outs, _reference(module, (x * 1e4,), {}), atol=1e-3)


ATTENTION = [c for c in OTHER_CASES if c.id.startswith("AttentionPooling")]


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("case", ATTENTION, ids=lambda c: c.id)
def test_attention_nonfinite_keys(case, value):
    module = _module(case)
    (q, k, v), kwargs = case.inputs(torch.float32)
    k = k.clone()
    k[B_BAD, T_BAD, 0] = value  # a valid step of sequence 2
    k[3, 5, 0] = value  # a padded step of sequence 3 (length 1): masked, no effect
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    outs = flat(module(*leaves, **kwargs))
    _assert_same_nonfinite(outs, _reference(module, (q.detach(), k.detach(), v.detach()), kwargs))
    context, weights = outs
    assert torch.equal(weights[3], torch.tensor([1.0] + [0.0] * (weights.size(1) - 1)))
    clean = [b for b in range(len(LENGTHS)) if b != B_BAD]
    assert context[clean].isfinite().all() and weights[clean].isfinite().all()
    _backward_runs(outs, leaves)


@pytest.mark.parametrize("case", ATTENTION, ids=lambda c: c.id)
def test_attention_values_at_padded_steps_get_an_exact_zero_weight(case):
    """Documented: a NaN *value* at a padded step meets weight 0, and 0 * NaN is NaN (as torch.bmm)."""
    module = _module(case)
    (q, k, v), kwargs = case.inputs(torch.float32)
    v = v.clone()
    v[3, 5, :] = NAN
    context, weights = module(q, k, v, **kwargs)
    assert weights[3, 5] == 0 and weights.isfinite().all()
    assert context[3].isnan().all() and context[[0, 1, 2, 4]].isfinite().all()


@pytest.mark.parametrize("case", ATTENTION, ids=lambda c: c.id)
def test_attention_large_keys_stay_finite(case):
    module = _module(case)
    (q, k, v), kwargs = case.inputs(torch.float32)
    outs = flat(module(q, k * 1e4, v, **kwargs))
    assert all(o.isfinite().all() for o in outs)
    _assert_same_nonfinite(outs, _reference(module, (q, k * 1e4, v), kwargs), atol=1e-3)


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("case", CELL_CASES, ids=lambda c: c.id)
def test_cells_nonfinite_input_reaches_exactly_its_sample(case, value):
    """A NaN / inf in one sample's input reaches that sample's new state only (the others stay
    finite; a NaN makes it NaN), in the float64 reference's pattern; the backward completes and
    reaches every leaf."""
    module = _module(case)
    (x, *state), _ = case.inputs(torch.float32)
    x = x.clone()
    x[..., 0] = 0.0
    bad = (0,) if x.dim() == 1 else (1, 0)
    x[bad] = value
    x.requires_grad_(True)
    outs = flat(module(x, *state))
    _assert_same_nonfinite(outs, _reference(module, (x.detach(), *state), {}))
    if x.dim() == 2:  # (an inf can saturate the gates into a finite state; a NaN cannot)
        assert all(o[[0, *range(2, o.size(0))]].isfinite().all() for o in outs)
        if value != value:
            assert not any(o[1].isfinite().all() for o in outs)
    _backward_runs(outs, [x, *module.parameters()])


@pytest.mark.parametrize("case", CELL_CASES, ids=lambda c: c.id)
def test_cells_large_input_stays_finite(case):
    module = _module(case)
    (x, *state), _ = case.inputs(torch.float32)
    outs = flat(module(x * 1e4, *state))
    assert all(o.isfinite().all() for o in outs)
    _assert_same_nonfinite(outs, _reference(module, (x * 1e4, *state), {}), atol=1e-3)


@pytest.mark.parametrize("value", [3e38, -INF])
@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_saturated_gates_are_exactly_torchs_in_float32(mode, value):
    """The C engine's float32 exp was clamped to [-87, 88]: its sigmoid never reached 0 (5.9e-39),
    so a huge input's gradient came back ~1 where torch.nn's is ~0.01-0.1 (0 * 3e38 made finite),
    and -inf gave +-inf gradients where torch's are NaN (0 * inf). lengths= takes the engine; the
    anchor is torch.nn on the packed batch, with the same weights."""
    torch.manual_seed(0)
    ours = getattr(fastlayers, mode)(5, 4)
    theirs = getattr(nn, mode)(5, 4)
    theirs.load_state_dict(ours.state_dict())
    lengths = torch.tensor([4, 3, 2])
    x = torch.randn(4, 3, 5)
    x[1, 0, 2] = value
    grads = []
    for run in ("ours", "theirs"):
        xx = x.clone().requires_grad_()
        if run == "ours":
            with fastlayers.backend("cpu"):
                out, _ = ours(xx, lengths=lengths)
            weight = ours.weight_ih_l0
        else:
            packed, _ = theirs(nn.utils.rnn.pack_padded_sequence(xx, lengths, enforce_sorted=False))
            out = nn.utils.rnn.pad_packed_sequence(packed, total_length=4)[0]
            weight = theirs.weight_ih_l0
        grads.append([out, *torch.autograd.grad(out.sum(), (weight, xx))])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        keep = b.isfinite()
        torch.testing.assert_close(a[keep], b[keep], rtol=1e-4, atol=1e-5)


def test_a_peephole_on_a_huge_cell_saturates_to_the_references_zero():
    """sigmoid(-huge) * 3e38 was ~0.44 on the C engine (its sigmoid floor 5.9e-39 times the cell);
    the float32 engine now gives the float64 reference's 0."""
    torch.manual_seed(0)
    lstm = fastlayers.LSTM(5, 4, peephole=True).eval()
    x, h0, c0 = torch.randn(4, 3, 5), torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    c0[0, 0, 1] = 3e38
    with fastlayers.backend("cpu"):
        out = lstm(x, (h0, c0), lengths=[4, 3, 2])[0]
    ref = _reference(lstm, (x, (h0, c0)), {"lengths": [4, 3, 2]})[0]
    _assert_same_nonfinite([out], [ref])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_no_zoneout_passes_an_infinite_state_through_as_the_c_engine(backend):
    """Without zoneout the reference and Triton engines still blended 0 * old + 1 * new, and an
    infinite carried state made that NaN where torch.nn and the C engine give finite outputs."""
    torch.manual_seed(0)
    lstm = fastlayers.LSTM(3, 4, cell_clip=1e30).double().eval()  # (an option: the engines; never clips)
    theirs = nn.LSTM(3, 4).double()
    theirs.load_state_dict(lstm.state_dict())
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    h0 = torch.zeros(1, 2, 4, dtype=torch.float64)
    h0[0, 0, 1] = INF
    c0 = torch.zeros(1, 2, 4, dtype=torch.float64)
    with fastlayers.backend(backend):
        ours = flat(lstm(x, (h0, c0)))
    _assert_same_nonfinite(ours, flat(theirs(x, (h0, c0))), atol=1e-10)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_an_overflowing_layer_norm_variance_is_nan_as_torchs(backend):
    """At 1e30 a float32 row's sum of squares overflows: F.layer_norm's statistics are NaN, so the
    reference's outputs are NaN; the engines turned the NaN variance into 0 (rstd 1 / sqrt(eps))
    and returned finite, wrong numbers."""
    torch.manual_seed(0)
    lstm = fastlayers.LSTM(3, 4, layer_norm=True).eval()
    x = torch.randn(3, 2, 3)
    x[1, 0] = 1e30
    with fastlayers.backend("reference"):
        ref = flat(lstm(x, lengths=[3, 2]))
    assert ref[0][1, 0].isnan().all()  # (the premise: torch's statistics overflow)
    with fastlayers.backend(backend):
        ours = flat(lstm(x, lengths=[3, 2]))
    for o, r in zip(ours, ref, strict=True):
        assert torch.equal(o.isnan(), r.isnan())
        torch.testing.assert_close(o[~r.isnan()], r[~r.isnan()], rtol=1e-4, atol=1e-5)
