"""checkpoint_every (recomputation through time, fastlayers.rnn._remat): the same outputs and
gradients as the run without it over random k and T (k not dividing T, k > T), lengths, hx and
options; the same masks in the recomputation as in the forward; second derivatives; the module
option's checks, repr and state_dict."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fastlayers
from fastlayers.rnn._cpu import gru_engine, lstm_engine
from fastlayers.rnn._options import CellOptions
from rnn_helpers import on_the_triton_engine
from fastlayers.rnn._remat import checkpointed, segment_length

LSTM_OPTIONS = [{}, {"layer_norm": True}, {"peephole": True, "cell_clip": 0.5}, {"proj_size": 3, "proj_clip": 0.4},
                {"layer_norm": True, "peephole": True, "zoneout": (0.1, 0.2)}]
GRU_OPTIONS = [{}, {"layer_norm": True}, {"zoneout": 0.1}]


_CALLS = [0]  # calls of the modules' checkpointed (the fixture counts them): a test of the option checks
# that the call it compares with the run without it did recompute (equal results alone would also hold
# for a module that ignored the option)


@pytest.fixture(autouse=True, scope="module")
def _count_recomputations():
    from fastlayers.rnn import _modules

    def counted(*args, **kwargs):
        _CALLS[0] += 1
        return checkpointed(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_modules, "checkpointed", counted)
        yield


@contextlib.contextmanager
def _recomputing():
    """Asserts that the block called the modules' recomputation through time."""
    before = _CALLS[0]
    yield
    assert _CALLS[0] > before, "checkpoint_every was set, but the call ran no recomputed segments"


def _loss_and_grads(module, x, hx, lengths):
    out, final = module(x, hx, lengths=lengths)
    finals = final if isinstance(final, tuple) else (final,)
    g = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum() + sum((f * f).sum() for f in finals)
    wrt = [x, *(hx if isinstance(hx, tuple) else (hx,) if hx is not None else ()), *module.parameters()]
    return [out, *finals], list(torch.autograd.grad(loss, wrt))


def _case(seed: int):
    rng = random.Random(seed)
    mode = rng.choice(["LSTM", "GRU"])
    options = dict(rng.choice(LSTM_OPTIONS if mode == "LSTM" else GRU_OPTIONS))
    steps, batch = rng.randint(1, 17), rng.randint(1, 5)
    every = rng.choice([1, 2, 3, 5, 7, 20, "auto"])
    kw = dict(num_layers=rng.choice([1, 2]), bidirectional=rng.random() < 0.7, batch_first=rng.random() < 0.5)
    lengths = torch.tensor([rng.randint(1, steps) for _ in range(batch)]) if rng.random() < 0.7 else None
    return mode, options, steps, batch, every, kw, lengths, rng.random() < 0.5


@pytest.mark.parametrize("seed", range(16))
def test_gradients_equal_the_run_without_it_float64(seed):
    mode, options, steps, batch, every, kw, lengths, with_hx = _case(seed)
    cls = getattr(fastlayers, mode)
    torch.manual_seed(seed)
    plain = cls(4, 6, **kw, **options).double().eval()  # eval: zoneout's expectation, no masks
    torch.manual_seed(seed)
    ours = cls(4, 6, **kw, **options, checkpoint_every=every).double().eval()
    x = torch.randn(*((batch, steps) if kw["batch_first"] else (steps, batch)), 4, dtype=torch.float64,
                    requires_grad=True)
    hx = None
    if with_hx:
        dirs = 2 if kw["bidirectional"] else 1
        h = torch.randn(kw["num_layers"] * dirs, batch, options.get("proj_size") or 6, dtype=torch.float64,
                        requires_grad=True)
        hx = (h, torch.randn(kw["num_layers"] * dirs, batch, 6, dtype=torch.float64, requires_grad=True)) \
            if mode == "LSTM" else h
    a_out, a_grads = _loss_and_grads(plain, x, hx, lengths)
    with _recomputing():
        b_out, b_grads = _loss_and_grads(ours, x, hx, lengths)
    for a, b in zip(a_out + a_grads, b_out + b_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_float32_within_1e_6_relative_and_bitwise_with_one_segment():
    torch.manual_seed(0)
    plain = fastlayers.LSTM(8, 16, bidirectional=True, layer_norm=True)
    torch.manual_seed(0)
    ours = fastlayers.LSTM(8, 16, bidirectional=True, layer_norm=True, checkpoint_every=7)
    x = torch.randn(60, 4, 8, requires_grad=True)
    lengths = torch.tensor([60, 41, 13, 59])
    a_out, a_grads = _loss_and_grads(plain, x, None, lengths)
    with _recomputing():
        b_out, b_grads = _loss_and_grads(ours, x, None, lengths)
    for a, b in zip(a_out + a_grads, b_out + b_grads, strict=True):
        assert ((a - b).norm() / a.norm()).item() <= 1e-6
    ours.checkpoint_every = 60  # one segment: the same kernels in the same order
    with _recomputing():
        c_out, c_grads = _loss_and_grads(ours, x, None, lengths)
    for a, c in zip(a_out + a_grads, c_out + c_grads, strict=True):
        assert torch.equal(a, c)


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_training_masks_given_to_the_engine_are_used_in_both_passes(mode):
    torch.manual_seed(0)
    steps, batch, hidden, dirs = 9, 3, 5, 2
    gates = 4 if mode == "LSTM" else 3
    layers = [[{"weight_ih": torch.randn(gates * hidden, 4, dtype=torch.float64, requires_grad=True),
                "weight_hh": torch.randn(gates * hidden, hidden, dtype=torch.float64, requires_grad=True),
                "bias_ih": torch.randn(gates * hidden, dtype=torch.float64, requires_grad=True),
                "bias_hh": torch.randn(gates * hidden, dtype=torch.float64, requires_grad=True)}
               for _ in range(dirs)]]
    options = CellOptions.make(False, False, None, (0.3, 0.2), 0.25, None) if mode == "LSTM" else \
        CellOptions.make_gru(False, 0.3, 0.25)
    masks = [{"recurrent": torch.bernoulli(torch.full((dirs, batch, hidden), 0.75, dtype=torch.float64)) / 0.75,
              "zoneout_h": torch.bernoulli(torch.full((dirs, steps, batch, hidden), 0.3, dtype=torch.float64))}]
    if mode == "LSTM":
        masks[0]["zoneout_c"] = torch.bernoulli(torch.full((dirs, steps, batch, hidden), 0.2, dtype=torch.float64))
    x = torch.randn(steps, batch, 4, dtype=torch.float64, requires_grad=True)
    hx = tuple(torch.zeros(dirs, batch, hidden, dtype=torch.float64) for _ in range(2 if mode == "LSTM" else 1))
    lengths = torch.tensor([9, 4, 6])
    engine = lstm_engine if mode == "LSTM" else gru_engine
    params = [p for d in layers[0] for p in d.values()]
    results = []
    for run in (lambda: engine(x, hx, layers, lengths, options, training=True, masks=masks),
                lambda: checkpointed(engine, 2, x, hx, layers, lengths, options, training=True, masks=masks, cell=mode)):
        out, final = run()
        loss = (out * out.detach().cos()).sum() + sum(f.sum() for f in final)
        results.append([out, *final, *torch.autograd.grad(loss, [x, *params])])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.parametrize("lengths", [None, [10, 10, 10], [10, 4, 10]])
def test_frozen_parameters_and_lengths_that_end_on_a_segment_bound(cell, lengths):
    """The C engine's backward stacks the directions' parameters once per call: a parameter frozen
    in one direction only gets no gradient, the others theirs; with every sequence ending on a
    segment bound before T (the last segments run nothing) the steps after stay zero."""
    kw = dict(bidirectional=True, layer_norm=True)
    torch.manual_seed(0)
    plain = getattr(fastlayers, cell)(4, 6, **kw).double()
    torch.manual_seed(0)
    ours = getattr(fastlayers, cell)(4, 6, **kw, checkpoint_every=5).double()
    frozen = {"weight_ih_l0_reverse", "bias_hh_l0", "ln_hh_weight_l0"}
    for m in (plain, ours):
        for name, p in m.named_parameters():
            p.requires_grad_(name not in frozen)
    x = torch.randn(15, 3, 4, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor(lengths) if lengths is not None else None
    a_out, a_grads = _loss_and_grads_of_trainable(plain, x, lengths)
    with _recomputing():
        b_out, b_grads = _loss_and_grads_of_trainable(ours, x, lengths)
    for a, b in zip(a_out + a_grads, b_out + b_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    if lengths is not None:
        assert b_out[0][10:].abs().max().item() == 0.0
    assert all(p.grad is None for name, p in ours.named_parameters() if name in frozen)
    assert all(p.grad is not None for name, p in ours.named_parameters() if name not in frozen)


def _loss_and_grads_of_trainable(module, x, lengths):
    out, final = module(x, lengths=lengths)
    finals = final if isinstance(final, tuple) else (final,)
    loss = (out * out.detach().cos()).sum() + sum((f * f).sum() for f in finals)
    loss.backward()
    return [out, *finals], [x.grad] + [p.grad for p in module.parameters() if p.requires_grad]


def test_auto_segment_length():
    """"auto": about sqrt(T / D); on the C kernels' engine (B given) at least ceil(1280 / B) steps
    while that leaves at least 16 segments."""
    assert [segment_length("auto", t, 2) for t in (1, 17, 800, 100_000)] == [1, 3, 20, 224]
    assert segment_length("auto", 800, 2, 32) == 40 and segment_length("auto", 800, 2, 8) == 50
    assert segment_length("auto", 800, 1, 128) == 28 and segment_length("auto", 100_000, 2, 8) == 224
    assert segment_length("auto", 100, 2, 8) == 7 and segment_length(5, 800, 2, 8) == 5
    for steps in (1, 7, 100, 800, 5000):
        for batch in (1, 8, 32, 512):
            k = segment_length("auto", steps, 2, batch)
            root = segment_length("auto", steps, 2)
            assert k == root or (root < k <= steps // 16 and (k - 1) * batch < 1280)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_auto_with_the_batch_rule_equals_the_run_without_it(cell):
    # T = 160, B = 4: sqrt(T / D) = 9 steps, the C engine's "auto" 10 (T / 16)
    assert segment_length("auto", 160, 2, 4) == 10
    torch.manual_seed(0)
    plain = getattr(fastlayers, cell)(3, 4, bidirectional=True, layer_norm=True).double()
    torch.manual_seed(0)
    ours = getattr(fastlayers, cell)(3, 4, bidirectional=True, layer_norm=True, checkpoint_every="auto").double()
    x = torch.randn(160, 4, 3, dtype=torch.float64, requires_grad=True)
    lengths = torch.tensor([160, 97, 10, 150])
    a_out, a_grads = _loss_and_grads(plain, x, None, lengths)
    with _recomputing():
        b_out, b_grads = _loss_and_grads(ours, x, None, lengths)
    for a, b in zip(a_out, b_out, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    # the gradients up to the order of sums over 160 steps (3.6e-12 apart in a sanitizer build)
    for a, b in zip(a_grads, b_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-11)


def test_training_draws_masks_once_per_call():
    # with zoneout and recurrent dropout in training, the backward's recomputation must see the
    # forward's masks: the gradient of a call with seeded masks passes gradcheck
    torch.manual_seed(0)
    lstm = fastlayers.LSTM(3, 4, bidirectional=True, zoneout=(0.3, 0.2), recurrent_dropout=0.3, checkpoint_every=2)
    lstm = lstm.double().train()
    lengths = torch.tensor([7, 3])

    def f(x):
        torch.manual_seed(5)
        return lstm(x, lengths=lengths)[0]

    x = torch.randn(7, 2, 3, dtype=torch.float64, requires_grad=True)
    with _recomputing():
        assert torch.autograd.gradcheck(f, (x,))


def test_second_derivatives():
    torch.manual_seed(0)
    gru = fastlayers.GRU(3, 4, bidirectional=True, layer_norm=True, checkpoint_every=2).double()
    lengths = torch.tensor([5, 2, 4])
    x = torch.randn(5, 3, 3, dtype=torch.float64, requires_grad=True)
    with _recomputing():
        assert torch.autograd.gradgradcheck(lambda x: gru(x, lengths=lengths)[0], (x,))


def test_the_option_checks_its_value_shows_in_repr_and_stays_out_of_state_dict():
    for bad in (0, -1, 2.5, True, "sqrt"):
        with pytest.raises(ValueError, match=r"checkpoint_every: expected None, an int >= 1 or 'auto', got"):
            fastlayers.LSTM(3, 4, checkpoint_every=bad)
    lstm = fastlayers.LSTM(3, 4, layer_norm=True, checkpoint_every="auto")
    assert repr(lstm) == "LSTM(3, 4, layer_norm=True, checkpoint_every='auto')"
    assert lstm.state_dict().keys() == fastlayers.LSTM(3, 4, layer_norm=True).state_dict().keys()
    assert "checkpoint_every=16" in repr(fastlayers.GRU(3, 4, checkpoint_every=16))
    with torch.no_grad():  # no gradient recorded: the plain call (nothing to recompute)
        out, _ = fastlayers.LSTM(3, 4, checkpoint_every=2)(torch.randn(5, 2, 3))
    assert out.shape == (5, 2, 4)


def _seeded_training_call(cell, options, every, x, lengths, backend, num_layers, batch_first=False, cu_seqlens=None):
    """One training forward + backward from seed 0 (weights) and seed 1 (masks, dropout): the
    output, final states, input gradient and every parameter gradient (``x`` (T, B, F), or (B, T, F)
    with ``batch_first``, or the varlen (N, F) with ``cu_seqlens``)."""
    torch.manual_seed(0)
    m = getattr(fastlayers, cell)(x.size(-1), 4, bidirectional=True, num_layers=num_layers,
                                  dropout=0.3 if num_layers > 1 else 0.0, checkpoint_every=every,
                                  batch_first=batch_first, **options).double().train()
    x = x.detach().requires_grad_(True)
    torch.manual_seed(1)
    with fastlayers.backend(backend), _recomputing() if every is not None else contextlib.nullcontext():
        out, states = m(x, lengths=lengths) if cu_seqlens is None else m(x, cu_seqlens=cu_seqlens)
    states = states if isinstance(states, tuple) else (states,)
    loss = (out * out.detach().cos()).sum() + sum((s * s.detach().sin()).sum() for s in states)
    loss.backward()
    return [out.detach(), *(s.detach() for s in states), x.grad] + [p.grad for p in m.parameters()]


MASKED_OPTIONS = {
    "LSTM": [dict(zoneout=(0.3, 0.2), recurrent_dropout=0.25), dict(zoneout=0.2, layer_norm=True, peephole=True),
             dict(recurrent_dropout=0.3, proj_size=3, zoneout=(0.1, 0.4))],
    "GRU": [dict(zoneout=0.3, recurrent_dropout=0.25), dict(zoneout=0.2, layer_norm=True)],
}
for _options in MASKED_OPTIONS.values():
    _options.append({})  # no cell option: the option alone sends the call to the engine (dropout between layers)


@settings(max_examples=30, deadline=None)
@given(cell=st.sampled_from(["LSTM", "GRU"]), which=st.integers(0, 3), steps=st.integers(1, 12),
       batch=st.integers(1, 4), layers=st.integers(1, 2), use_lengths=st.booleans(),
       backend=st.sampled_from(["cpu", "reference"]), batch_first=st.booleans(), data=st.data())
def test_training_with_checkpoint_every_draws_what_the_run_without_it_draws(cell, which, steps, batch, layers,
                                                                             use_lengths, backend, batch_first, data):
    """Turning the memory option on does not change a seeded training run (issue 62): the same
    zoneout, recurrent-dropout and inter-layer dropout draws, so the same outputs and gradients up to
    the order of sums, for any k, T, lengths and layout (the C engine, and the reference, which draws
    per step: the segments draw its masks in its order, _remat._reference_draws; a plain layer with
    lengths on the reference once drew its dropout between layers batch-first without the option)."""
    options = MASKED_OPTIONS[cell][which % len(MASKED_OPTIONS[cell])]
    every = data.draw(st.one_of(st.integers(1, steps + 2), st.just("auto")), label="checkpoint_every")
    lengths = None
    if use_lengths:
        lengths = data.draw(st.lists(st.integers(1, steps), min_size=batch, max_size=batch), label="lengths")
    x = torch.randn(steps, batch, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(steps * 7 + batch))
    x = x.transpose(0, 1).contiguous() if batch_first else x
    want = _seeded_training_call(cell, options, None, x, lengths, backend, layers, batch_first)
    got = _seeded_training_call(cell, options, every, x, lengths, backend, layers, batch_first)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_plain_layers_with_lengths_draw_the_dropout_between_layers_time_major(cell, batch_first):
    """A plain two-layer layer with lengths on the reference backend (torch's kernels per segment of
    equal active counts) draws its dropout between layers as the engine does, time-major: with
    ``batch_first`` it once drew it over the batch-first rows, so checkpoint_every changed the run."""
    x = torch.randn(6, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = x.transpose(0, 1).contiguous() if batch_first else x
    want = _seeded_training_call(cell, {}, None, x, [6, 2, 4], "reference", 2, batch_first)
    got = _seeded_training_call(cell, {}, 2, x, [6, 2, 4], "reference", 2, batch_first)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["cpu", "reference", pytest.param("triton", marks=pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU, interpreter off"))])
@pytest.mark.parametrize("cell, options", [("LSTM", dict(layer_norm=True, zoneout=0.2)), ("GRU", dict(layer_norm=True)),
                                           ("LSTM", {})])
def test_varlen_training_with_checkpoint_every_draws_what_the_run_without_it_draws(cell, options, backend):
    """The varlen form, two layers with dropout between them: the same draws with and without the
    option (the Triton engine once drew the dropout over the value rows without it, over the padded
    (T, B) rows with it)."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    cu = torch.tensor([0, 7, 9, 14], device=device)
    x = torch.randn(14, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)
    want = _seeded_training_call(cell, options, None, x, None, backend, 2, cu_seqlens=cu)
    got = _seeded_training_call(cell, options, 3, x, None, backend, 2, cu_seqlens=cu)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "x"])
def test_setting_the_option_on_a_module_checks_it(bad):
    """``m.checkpoint_every = k`` is checked as the constructor's argument (a negative k once gave
    zero outputs and gradients without an error)."""
    m = fastlayers.LSTM(3, 4, layer_norm=True)
    with pytest.raises(ValueError, match=r"checkpoint_every: expected None, an int >= 1 or 'auto', got"):
        m.checkpoint_every = bad
    assert m.checkpoint_every is None
    m.checkpoint_every = 2
    assert m.checkpoint_every == 2 and "checkpoint_every=2" in repr(m)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="no GPU and Triton's interpreter is off")
@pytest.mark.parametrize("cell, options, lengths, every, layers", [
    ("LSTM", dict(zoneout=(0.3, 0.2), recurrent_dropout=0.25, layer_norm=True), [7, 3, 5], 3, 1),
    ("GRU", dict(zoneout=0.3, recurrent_dropout=0.25), None, 2, 1),
    # two layers, the longest sequence shorter than T: the plain call runs (and drew the dropout
    # between layers over) the longest length only, the segments all T steps
    ("LSTM", dict(recurrent_dropout=0.25, proj_size=2), [5, 3, 2], 2, 2),
    ("GRU", dict(zoneout=0.3, recurrent_dropout=0.25, layer_norm=True), [4, 6, 1], "auto", 2),
])
def test_triton_engine_with_checkpoint_every_draws_what_the_run_without_it_draws(cell, options, lengths, every, layers):
    """The same on the Triton engine (CPU tensors under the interpreter; the GPU's code path)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(7, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)
    with on_the_triton_engine():  # (a triton quietly run as the reference compared the reference with itself)
        want = _seeded_training_call(cell, options, None, x, lengths, "triton", layers)
    with on_the_triton_engine():
        got = _seeded_training_call(cell, options, every, x, lengths, "triton", layers)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_stack_directions_takes_the_rows_of_one_stacked_tensor_without_a_copy():
    """The engines stack the directions' parameters with stack_directions: the rows 0..D-1 of one
    tensor are that tensor (the remat backward's parameters, stacked once per call), its gradient
    the stacked one; anything else is a stacked copy."""
    from fastlayers.rnn._common import stack_directions

    base = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    assert stack_directions([base[0], base[1]]) is base
    assert stack_directions([base[0]]).shape == (1, 3, 4)
    for parts in ([base[1], base[0]], [base[0], base[0]], [base[0, :2], base[1, :2]], [base[:, 0], base[:, 1]]):
        out = stack_directions(parts)
        assert out is not base and torch.equal(out, torch.stack(parts))
    wide = torch.randn(3, 3, 4)
    assert stack_directions([wide[0], wide[1]]) is not wide  # rows of a longer tensor: copied
    separate = [torch.randn(3, 4), torch.randn(3, 4)]
    assert torch.equal(stack_directions(separate), torch.stack(separate))
    w = torch.randn(2, 3, 4, dtype=torch.float64)
    (stack_directions([base[0], base[1]]) * w).sum().backward()
    assert torch.equal(base.grad, w)
