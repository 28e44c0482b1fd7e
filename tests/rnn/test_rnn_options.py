"""Cell options of fastlayers.LSTM (the engine) against the independent float64 per-step reference."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fastlayers
from fastlayers.rnn._cpu import lstm_engine
from fastlayers.rnn._reference import lstm_reference
from fastlayers.rnn._options import CellOptions

from rnn_helpers import assert_close_all, assert_engine_equals_torch, autograd_nodes, make_hx, run_and_grad

OPTION_SETS = {
    "layer_norm": dict(layer_norm=True),
    "peephole": dict(peephole=True),
    "cell_clip": dict(cell_clip=0.3),
    "zoneout": dict(zoneout=(0.2, 0.4)),
    "recurrent_dropout": dict(recurrent_dropout=0.3),
    "all": dict(layer_norm=True, peephole=True, cell_clip=0.5, zoneout=(0.1, 0.3), recurrent_dropout=0.2),
    "proj_clip": dict(proj_size=3, proj_clip=0.2),
    "all + proj": dict(layer_norm=True, peephole=True, cell_clip=0.5, zoneout=(0.1, 0.3), recurrent_dropout=0.2,
                       proj_size=3, proj_clip=0.3),
}


def _random_params(module):
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("ln_"):
                p.add_(0.2 * torch.randn_like(p))
            elif name.startswith("weight_peephole"):
                p.copy_(0.5 * torch.randn_like(p))


def _masks(module, steps, batch, dtype):
    dirs = 2 if module.bidirectional else 1
    h, p = module.hidden_size, module.proj_size or module.hidden_size
    z_h, z_c = module.options.zoneout
    keep = 1 - module.options.recurrent_dropout
    return [{"recurrent": torch.bernoulli(torch.full((dirs, batch, p), keep, dtype=dtype)) / keep,
             "zoneout_h": torch.bernoulli(torch.full((dirs, steps, batch, p), z_h, dtype=dtype)),
             "zoneout_c": torch.bernoulli(torch.full((dirs, steps, batch, h), z_c, dtype=dtype))}
            for _ in range(module.num_layers)]


def _compare(options, *, num_layers=2, bidirectional=True, lengths=(5, 2, 4, 1), training=False, with_hx=True,
             input_size=3, hidden_size=5, seed=0, steps=None):
    """fp64 engine vs fp64 reference on the module's parameters, with identical masks."""
    torch.manual_seed(seed)
    m = fastlayers.LSTM(input_size, hidden_size, num_layers=num_layers, bidirectional=bidirectional,
                        dtype=torch.float64, **options)
    _random_params(m)
    steps, batch = steps or max(lengths), len(lengths)
    x = torch.randn(steps, batch, input_size, dtype=torch.float64)
    layers = num_layers * (1 + bidirectional)
    hx = make_hx(m, batch, dtype=torch.float64) if with_hx else (
        torch.zeros(layers, batch, m.proj_size or hidden_size, dtype=torch.float64),
        torch.zeros(layers, batch, hidden_size, dtype=torch.float64))
    masks = _masks(m, steps, batch, torch.float64) if training else None
    lens = torch.tensor(lengths)

    def run(fn):
        return lambda x, h: fn(x, h, m._layer_parameters(), lens, m.options, training=training, masks=masks)

    got = run_and_grad(run(lstm_engine), m, x, hx)
    want = run_and_grad(run(lstm_reference), m, x, hx)
    assert_close_all(got, want, atol=1e-10, rtol=1e-10)
    return got


@pytest.mark.parametrize("name", list(OPTION_SETS))
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_options_match_reference(name, training, bidirectional):
    _compare(OPTION_SETS[name], training=training, bidirectional=bidirectional)


@pytest.mark.parametrize("training", [False, True])
def test_padding_beyond_the_longest_sequence(training):
    """T larger than every length: the steps nobody runs are zero in the output, gradients match."""
    out = _compare(OPTION_SETS["all"], training=training, lengths=(3, 1, 2), steps=6)
    output = out[0]
    assert output.shape[0] == 6 and output[3:].abs().max() == 0


@pytest.mark.parametrize("proj_size", [0, 4])
def test_engine_with_options_off_equals_torch_lstm_fp32(proj_size):
    """The engine itself (forced, all options off) == torch.nn.LSTM packed, fp32 1e-5, all grads."""
    assert_engine_equals_torch(lstm_engine, fastlayers.LSTM, torch.nn.LSTM, proj_size=proj_size)


@pytest.mark.parametrize("name", ["layer_norm", "all", "all + proj"])
def test_gradcheck_module_float64(name):
    torch.manual_seed(0)
    opts = {k: v for k, v in OPTION_SETS[name].items() if k != "recurrent_dropout"}
    if "proj_size" in opts:
        opts.update(proj_size=3, proj_clip=0.5)
    m = fastlayers.LSTM(2, 4 if "proj_size" in opts else 3, num_layers=2, bidirectional=True, batch_first=True,
                        dtype=torch.float64, **opts).eval()
    _random_params(m)
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in m.parameters()]
    x = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(4, 3, 3, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(4, 3, m.hidden_size, dtype=torch.float64, requires_grad=True)

    def f(x, h0, c0, *ps):
        out, (h, c) = torch.func.functional_call(m, dict(zip(names, ps)), (x, (h0, c0)), {"lengths": [4, 1, 3]})
        return out, h, c

    assert torch.autograd.gradcheck(f, (x, h0, c0, *params), eps=1e-6, atol=1e-6, rtol=1e-5)


@given(layer_norm=st.booleans(), peephole=st.booleans(), clip=st.sampled_from([None, 0.2, 1.0]),
       z_h=st.sampled_from([0.0, 0.3]), z_c=st.sampled_from([0.0, 0.5]), rd=st.sampled_from([0.0, 0.4]),
       training=st.booleans(), num_layers=st.integers(1, 2), bidirectional=st.booleans(),
       lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5), seed=st.integers(0, 1000),
       proj=st.sampled_from([(0, None), (3, None), (2, 0.3)]))
def test_hypothesis_option_combinations(layer_norm, peephole, clip, z_h, z_c, rd, training, num_layers, bidirectional,
                                        lengths, seed, proj):
    opts = dict(layer_norm=layer_norm, peephole=peephole, cell_clip=clip, zoneout=(z_h, z_c), recurrent_dropout=rd,
                proj_clip=proj[1])
    if CellOptions.make(**opts).plain:
        opts["peephole"] = True
    if proj[0]:
        opts["proj_size"] = proj[0]
    _compare(opts, num_layers=num_layers, bidirectional=bidirectional, lengths=tuple(lengths), training=training,
             seed=seed)


def test_module_dispatch_and_padding_zero():
    torch.manual_seed(0)
    m = fastlayers.LSTM(3, 4, bidirectional=True, batch_first=True, layer_norm=True, zoneout=0.1)
    x = torch.randn(3, 6, 3)
    out, (h, c) = m(x, lengths=[6, 2, 4])
    assert out.shape == (3, 6, 8) and h.shape == (2, 3, 4)
    assert out[1, 2:].abs().max() == 0 and out[2, 4:].abs().max() == 0
    assert "LSTMRecurrenceBackward" in autograd_nodes(out)  # the C engine's time loop, with the options
    out2, _ = m.eval()(x)  # no lengths: all steps valid (eval: no zoneout mask can keep a zero state)
    assert out2.abs().min() > 0
    assert "layer_norm=True" in repr(m) and "zoneout=(0.1, 0.1)" in repr(m)
    names = {n for n, _ in m.named_parameters()}
    assert {"ln_ih_weight_l0", "ln_hh_weight_l0_reverse", "ln_cell_bias_l0"} <= names


def test_training_is_stochastic_and_eval_deterministic():
    torch.manual_seed(0)
    m = fastlayers.LSTM(3, 4, zoneout=(0.3, 0.3), recurrent_dropout=0.3)
    x = torch.randn(5, 2, 3)
    m.train()
    assert not torch.equal(m(x)[0], m(x)[0])
    m.eval()
    assert torch.equal(m(x)[0], m(x)[0])


def test_step_cell_matches_layer():
    torch.manual_seed(0)
    m = fastlayers.LSTM(3, 4, num_layers=2, layer_norm=True, peephole=True, cell_clip=0.5, zoneout=(0.2, 0.1)).eval()
    _random_params(m)
    x = torch.randn(5, 2, 3)
    out, (h_n, c_n) = m(x)
    cell0, cell1 = m.cell(0), m.cell(1)
    s0 = s1 = None
    for t in range(5):
        s0 = cell0(x[t], s0)
        s1 = cell1(s0[0], s1)
        torch.testing.assert_close(s1[0], out[t], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s1[1], c_n[1], atol=1e-6, rtol=1e-5)
    assert cell0(x[0, 0]).__len__() == 2
    with pytest.raises(ValueError, match=r"layer: expected 0 <= layer < num_layers = 2, got 2"):
        m.cell(2)


def test_step_cell_matches_layer_with_projection():
    torch.manual_seed(0)
    m = fastlayers.LSTM(3, 5, proj_size=2, layer_norm=True, proj_clip=0.1).eval()
    x = torch.randn(4, 2, 3)
    out, (h_n, c_n) = m(x)
    assert out.shape == (4, 2, 2) and h_n.shape == (1, 2, 2) and c_n.shape == (1, 2, 5)
    assert out.abs().max() <= 0.1 + 1e-7
    state = None
    for t in range(4):
        state = m.cell(0)(x[t], state)
        torch.testing.assert_close(state[0], out[t], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state[1], c_n[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(cell_clip=-1.0), ValueError, r"cell_clip: expected None or a number > 0, got -1.0"),
    (dict(cell_clip=0), ValueError, r"cell_clip: expected None or a number > 0, got 0"),
    (dict(zoneout=1.0), ValueError, r"zoneout\[0\] \(z_h\): expected a probability in \[0, 1\), got 1.0"),
    (dict(zoneout=(0.1, -0.2)), ValueError, r"zoneout\[1\] \(z_c\): expected a probability in \[0, 1\), got -0.2"),
    (dict(zoneout=(0.1, 0.2, 0.3)), TypeError, r"zoneout: expected a probability or a pair"),
    (dict(recurrent_dropout=1.5), ValueError, r"recurrent_dropout: expected a probability in \[0, 1\), got 1.5"),
    (dict(layer_norm="rms"), ValueError, r"layer_norm: expected True or False .* got 'rms'"),
    (dict(peephole=1), TypeError, r"peephole: expected a bool, got 1"),
    (dict(proj_size=2, proj_clip=-1), ValueError, r"proj_clip: expected None or a number > 0, got -1"),
    (dict(layer_norm=True, proj_clip=0.5), ValueError, r"proj_clip: clips the projection, so it needs proj_size > 0"),
])
def test_bad_options(kwargs, err, msg):
    with pytest.raises(err, match=msg):
        fastlayers.LSTM(3, 4, **kwargs)


# the C time loops (lstm.c's lstm_forward_loop / lstm_backward_loop with gemm.h's step products): sizes
# past one register block of rows (13 sequences, ending at different steps), a partial panel of
# columns (H = 17, 70) and, in the backward product (k = 4H = 280), more than one block of k
@pytest.mark.parametrize("hidden_size", [17, 70])
@pytest.mark.parametrize("name", ["layer_norm", "peephole", "all"])
@pytest.mark.parametrize("training", [False, True])
def test_time_loop_sizes_match_reference(hidden_size, name, training):
    _compare(OPTION_SETS[name], training=training, hidden_size=hidden_size, input_size=6,
             lengths=(9, 3, 9, 1, 7, 8, 2, 9, 5, 6, 4, 9, 8))


@pytest.mark.parametrize("threads", [2, 3])
def test_time_loop_threads_match_reference(threads):
    """The loops split every step between the threads (panels of the product, rows, column blocks
    of the parameter sums; the suite's workers run one thread each): 2 and 3 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare(OPTION_SETS["all"], training=True, hidden_size=40, input_size=6, lengths=(7, 2, 7, 5, 1, 6, 7))
        _compare(OPTION_SETS["layer_norm"], hidden_size=23, input_size=4, lengths=(5, 5, 3))
    finally:
        torch.set_num_threads(before)


def _run_threads(m, x, lengths, threads, seed):
    """Outputs, input and parameter gradients of a training call, then a no_grad call's output."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        xx = x.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        y = m(xx, lengths=lengths)[0]
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        with torch.no_grad():
            return [y.detach(), xx.grad, *(p.grad for p in m.parameters()), m(x, lengths=lengths)[0]]
    finally:
        torch.set_num_threads(before)


def _option_layer(mode, hidden, layer_norm, peephole, rd, z, training, dtype, seed, bidirectional):
    """A fastlayers LSTM / GRU (input 4) with those options (peephole: LSTM only), seeded."""
    opts = dict(layer_norm=layer_norm, recurrent_dropout=rd, zoneout=z or None)
    if mode == "LSTM":
        opts["peephole"] = peephole
    torch.manual_seed(seed)
    return getattr(fastlayers, mode)(4, hidden, bidirectional=bidirectional, dtype=dtype, **opts).train(training)


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(["LSTM", "GRU"]), hidden=st.sampled_from([5, 40, 64]), layer_norm=st.booleans(),
       peephole=st.booleans(), rd=st.sampled_from([0.0, 0.3]), z=st.sampled_from([0.0, 0.2]),
       training=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
       lengths=st.lists(st.integers(1, 9), min_size=1, max_size=9), padded=st.booleans(), seed=st.integers(0, 999))
def test_time_loops_on_two_threads_equal_one_bitwise(mode, hidden, layer_norm, peephole, rd, z, training, dtype,
                                                     lengths, padded, seed):
    """Bidirectional on 2 threads, each thread runs one direction's whole time loop without waiting
    for the other (lstm.c / gru.c: no barrier where the threads divide D): with lengths the two run
    steps of different sizes at the same time, so any buffer laid out by the step's row count would
    be shared between them. Same values and gradients as on 1 thread, bit for bit. A layer without
    options always gets a padded step: with no padding it runs torch's own LSTM / GRU kernels, not
    these loops, and their rounding depends on the thread count (last bits, e.g. LSTM H=64, B=1)."""
    m = _option_layer(mode, hidden, layer_norm, peephole, rd, z, training, dtype, seed, bidirectional=True)
    x = torch.randn(max(lengths) + (padded or m.options.plain), len(lengths), 4, dtype=dtype)
    lens = torch.tensor(lengths)
    for a, b in zip(_run_threads(m, x, lens, 1, seed), _run_threads(m, x, lens, 2, seed)):
        assert torch.equal(a, b)


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(["LSTM", "GRU"]), hidden=st.sampled_from([5, 40, 64, 300]),
       layer_norm=st.booleans(), peephole=st.booleans(), rd=st.sampled_from([0.0, 0.3]),
       z=st.sampled_from([0.0, 0.2]), training=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
       lengths=st.lists(st.integers(1, 9), min_size=2, max_size=9), threads=st.sampled_from([2, 3]),
       seed=st.integers(0, 999))
def test_time_loops_one_direction_on_threads_match_one_thread(mode, hidden, layer_norm, peephole, rd, z, training,
                                                              dtype, lengths, threads, seed):
    """One direction on 2 or 3 threads: with a small weight the loops split each step by batch rows
    (each thread its rows by the whole weight, no barrier; gemm.h fl_by_rows) and sum the parameter
    gradients per thread; with a large one (H = 300) by panels and rows with barriers. Values and
    every gradient agree with the 1-thread run to rounding (not bit for bit: the partial sums add up
    in another order, and torch's BLAS products of one direction round differently on 1 and 2
    threads before this split existed)."""
    m = _option_layer(mode, hidden, layer_norm, peephole, rd, z, training, dtype, seed, bidirectional=False)
    x = torch.randn(max(lengths), len(lengths), 4, dtype=dtype)
    lens = torch.tensor(lengths)
    one, many = _run_threads(m, x, lens, 1, seed), _run_threads(m, x, lens, threads, seed)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(one, many):
        torch.testing.assert_close(b, a, **tol)


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_float32_c_engine_keeps_its_relative_accuracy_near_zero(mode):
    """Activations of about 1e-6 through the C engine (fastmath.h's float32 tanh, 2 / (1 + e^{-2x})
    - 1, had an error of one ulp of 1 there: 2% of LSTM outputs of 1e-5 relative, where torch.nn's
    float32 error is 1e-7), against the float64 reference."""
    torch.manual_seed(0)
    m = getattr(fastlayers, mode)(4, 6, num_layers=2, bidirectional=True, layer_norm=False)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1e-5)
    x, lengths = torch.randn(7, 3, 4), [7, 4, 2]
    with fastlayers.backend("reference"):
        want = m.double()(x.double(), lengths=lengths)[0]
    m.float()
    for grad in (True, False):  # (the autograd path and the C++ operator)
        with torch.set_grad_enabled(grad), fastlayers.backend("cpu"):
            got = m(x, lengths=lengths)[0]
        assert 1e-8 < want.abs().max() < 1e-4
        assert (got.double() - want).abs().max() / want.abs().max() < 1e-6, grad


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "operator"])
def test_a_cell_row_clipped_whole_normalises_to_zero(grad):
    """A cell row whose every unit clips to the same value is constant: its LayerNorm is exactly 0,
    as torch's layer_norm gives it. The C engine's mean, sum / len, left a rounding residue
    ((0.1 + 0.1 + 0.1) / 3 != 0.1), which each later LayerNorm multiplied by ~1 / sqrt(eps): outputs
    0.7 away from the reference's in float64 after three layers (a fuzzing find)."""
    torch.manual_seed(469401)
    m = fastlayers.LSTM(10, 3, num_layers=3, bias=False, dtype=torch.float64, layer_norm=True, cell_clip=0.1).eval()
    x = torch.randn(8, 11, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(469402))
    with fastlayers.backend("reference"), torch.no_grad():
        want, (h_want, _) = m(x, lengths=[8] * 11)
    with fastlayers.backend("cpu"), torch.set_grad_enabled(grad):
        got, (h_got, _) = m(x, lengths=[8] * 11)
    assert torch.equal(h_want[0, 8], torch.zeros(3, dtype=torch.float64))  # (the saturated row)
    assert torch.equal(h_got[0, 8], h_want[0, 8])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
