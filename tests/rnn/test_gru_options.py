"""Cell options of fastlayers.GRU (the engine) against the independent float64 per-step reference."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fastlayers
from fastlayers.rnn._cpu import gru_engine
from fastlayers.rnn._reference import gru_reference
from fastlayers.rnn._options import CellOptions

from rnn_helpers import assert_close_all, assert_engine_equals_torch, autograd_nodes, make_hx, run_and_grad

OPTION_SETS = {
    "layer_norm": dict(layer_norm=True),
    "zoneout": dict(zoneout=0.3),
    "recurrent_dropout": dict(recurrent_dropout=0.3),
    "all": dict(layer_norm=True, zoneout=0.2, recurrent_dropout=0.25),
}


def _random_ln(module):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("ln_"):
                p.add_(0.2 * torch.randn_like(p))


def _masks(module, steps, batch):
    dirs, h = 2 if module.bidirectional else 1, module.hidden_size
    keep = 1 - module.options.recurrent_dropout
    z_h = module.options.zoneout[0]
    return [{"recurrent": torch.bernoulli(torch.full((dirs, batch, h), keep, dtype=torch.float64)) / keep,
             "zoneout_h": torch.bernoulli(torch.full((dirs, steps, batch, h), z_h, dtype=torch.float64))}
            for _ in range(module.num_layers)]


def _compare(options, *, num_layers=2, bidirectional=True, lengths=(5, 2, 4, 1), training=False, steps=None, seed=0,
             bias=True, input_size=3, hidden_size=4):
    torch.manual_seed(seed)
    m = fastlayers.GRU(input_size, hidden_size, num_layers=num_layers, bidirectional=bidirectional, bias=bias,
                       dtype=torch.float64, **options)
    _random_ln(m)
    steps, batch = steps or max(lengths), len(lengths)
    x = torch.randn(steps, batch, input_size, dtype=torch.float64)
    hx = make_hx(m, batch, dtype=torch.float64)
    masks = _masks(m, steps, batch) if training else None
    lens = torch.tensor(lengths)

    def run(fn):
        def call(x, h):
            out, (h_n,) = fn(x, (h,), m._layer_parameters(), lens, m.options, training=training, masks=masks)
            return out, h_n
        return call

    got = run_and_grad(run(gru_engine), m, x, hx)
    want = run_and_grad(run(gru_reference), m, x, hx)
    assert_close_all(got, want, atol=1e-10, rtol=1e-10)
    return got


@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_options_match_reference(name, training, bidirectional):
    _compare(OPTION_SETS[name], training=training, bidirectional=bidirectional)


def test_no_bias_and_padding_beyond_the_longest_sequence():
    got = _compare(OPTION_SETS["all"], training=True, lengths=(3, 1, 2), steps=6, bias=False)
    assert got[0][3:].abs().max() == 0


@pytest.mark.parametrize("bias", [True, False])
def test_engine_with_options_off_equals_torch_gru_fp32(bias):
    """The engine itself (forced, all options off) == torch.nn.GRU packed, fp32 1e-5, all grads."""
    assert_engine_equals_torch(gru_engine, fastlayers.GRU, torch.nn.GRU, bias=bias)


def test_gradcheck_module_float64():
    torch.manual_seed(0)
    m = fastlayers.GRU(2, 3, num_layers=2, bidirectional=True, batch_first=True, dtype=torch.float64,
                       layer_norm=True, zoneout=0.2).eval()
    _random_ln(m)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in m.parameters()]
    x = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(4, 3, 3, dtype=torch.float64, requires_grad=True)

    def f(x, h0, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (x, h0), {"lengths": [4, 1, 3]})

    assert torch.autograd.gradcheck(f, (x, h0, *params), eps=1e-6, atol=1e-6, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(layer_norm=st.booleans(), z=st.sampled_from([0.0, 0.4]), rd=st.sampled_from([0.0, 0.3]),
       training=st.booleans(), num_layers=st.integers(1, 2), bidirectional=st.booleans(),
       lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_hypothesis_option_combinations(layer_norm, z, rd, training, num_layers, bidirectional, lengths, seed):
    opts = dict(layer_norm=layer_norm, zoneout=z, recurrent_dropout=rd)
    if CellOptions.make(layer_norm, False, None, (z, 0.0), rd).plain:
        opts["layer_norm"] = True
    _compare(opts, num_layers=num_layers, bidirectional=bidirectional, lengths=tuple(lengths), training=training,
             seed=seed)


def test_module_dispatch_repr_and_step_cell():
    torch.manual_seed(0)
    m = fastlayers.GRU(3, 4, num_layers=2, layer_norm=True, zoneout=0.1).eval()
    _random_ln(m)
    assert "layer_norm=True" in repr(m) and "zoneout=0.1" in repr(m)
    assert {n for n, _ in m.named_parameters()} >= {"ln_ih_weight_l0", "ln_hh_weight_l1"}
    assert m.ln_ih_weight_l0.shape == (12,)
    x = torch.randn(5, 2, 3)
    out, h_n = m(x)
    assert "GRURecurrenceBackward" in autograd_nodes(out)  # the C engine's time loop, with the options
    s0 = s1 = None
    for t in range(5):
        s0 = m.cell(0)(x[t], s0)
        s1 = m.cell(1)(s0, s1)
        torch.testing.assert_close(s1, out[t], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s1, h_n[1], atol=1e-6, rtol=1e-5)
    assert m.cell(0)(x[0, 0]).shape == (4,)


def test_plain_gru_keeps_torch_kernels():
    m = fastlayers.GRU(3, 4)
    assert m.options.plain and not any(n.startswith("ln_") for n, _ in m.named_parameters())


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(zoneout=(0.1, 0.2)), TypeError, r"zoneout: expected one probability \(a GRU has one state\), got \(0.1, 0.2\)"),
    (dict(zoneout=1.0), ValueError, r"zoneout\[0\] \(z_h\): expected a probability in \[0, 1\), got 1.0"),
    (dict(recurrent_dropout=-0.1), ValueError, r"recurrent_dropout: expected a probability in \[0, 1\), got -0.1"),
    (dict(layer_norm="rms"), ValueError, r"layer_norm: expected True or False .* got 'rms'"),
    (dict(peephole=True), TypeError, r"unexpected keyword argument 'peephole'"),
])
def test_bad_options(kwargs, err, msg):
    with pytest.raises(err, match=msg):
        fastlayers.GRU(3, 4, **kwargs)


# the C time loops (gru.c's gru_forward_loop / gru_backward_loop, gemm.h's step products) past one
# register block of rows, with a partial panel of columns and (backward, k = 3H = 210) two blocks of k
@pytest.mark.parametrize("hidden_size", [17, 70])
@pytest.mark.parametrize("name", ["layer_norm", "all"])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_time_loop_sizes_match_reference(hidden_size, name, training, bias):
    _compare(OPTION_SETS[name], training=training, hidden_size=hidden_size, input_size=6, bias=bias,
             lengths=(9, 3, 9, 1, 7, 8, 2, 9, 5, 6, 4, 9, 8))


@pytest.mark.parametrize("threads", [2, 3])
def test_time_loop_threads_match_reference(threads):
    """The loops split every step between the threads (the suite's workers run one thread each)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare(OPTION_SETS["all"], training=True, hidden_size=40, input_size=6, lengths=(7, 2, 7, 5, 1, 6, 7))
    finally:
        torch.set_num_threads(before)
