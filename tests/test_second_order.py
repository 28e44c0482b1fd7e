"""Second derivatives on every kernel path (fastlayers._core.twice): a backward that is itself recorded
(create_graph=True) recomputes with the differentiable reference instead of returning zeros.

gradgradcheck in float64 on tiny shapes for the CPU engine (LSTM / GRU, lengths, every cell
option, training masks, projection), the Triton engine, local layers and attention pooling under
Triton's interpreter; hvp equal to torch's PackedSequence path; mixed precision against float64;
a gradient-penalty training step."""

from __future__ import annotations

import os

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.autograd.functional import hvp
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fastlayers
from fastlayers.rnn import _cpu_recurrence

pytestmark = pytest.mark.reference_only  # (see pyproject's markers)

LENGTHS = [4, 2, 3]
OPTIONS = {
    "plain": {},
    "layer_norm": {"layer_norm": True},
    "peephole+clip": {"peephole": True, "cell_clip": 0.5},
    "zoneout": {"zoneout": (0.2, 0.3)},
    "proj+clip": {"proj_size": 2, "proj_clip": 0.4},
}
triton = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                            reason="no GPU and Triton's interpreter is off")


def _module(cls, options, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(3, 3, **options, **kw).double()


def _check(fn, *inputs, fast_mode=False):
    """gradcheck and gradgradcheck in float64; ``fast_mode`` (a random projection of the Jacobians:
    a few evaluations instead of one per element) for the kernels run by Triton's interpreter."""
    assert gradcheck(fn, inputs, fast_mode=fast_mode)
    assert gradgradcheck(fn, inputs, fast_mode=fast_mode)


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_engine_gradgradcheck(name, bidirectional):
    m = _module(fastlayers.LSTM, OPTIONS[name], bidirectional=bidirectional).eval()
    x = torch.randn(4, 3, 3, dtype=torch.double, requires_grad=True)
    weight = m.weight_hh_l0

    def f(x, w):
        out, (h, c) = torch.func.functional_call(m, {"weight_hh_l0": w}, (x,), {"lengths": LENGTHS})
        return out, h, c

    _check(f, x, weight.detach().clone().requires_grad_(True))


@pytest.mark.parametrize("name", ["plain", "layer_norm", "zoneout"])
def test_gru_engine_gradgradcheck(name):
    opts = dict(OPTIONS[name])
    if "zoneout" in opts:
        opts["zoneout"] = 0.25
    layers = 2 if name == "plain" else 1
    m = _module(fastlayers.GRU, opts, bidirectional=True, num_layers=layers).eval()
    x = torch.randn(4, 3, 3, dtype=torch.double, requires_grad=True)
    key = f"weight_ih_l{layers - 1}"
    w = getattr(m, key).detach().clone().requires_grad_(True)

    def f(x, w):
        out, h = torch.func.functional_call(m, {key: w}, (x,), {"lengths": LENGTHS})
        return out, h

    _check(f, x, w)


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_training_masks_gradgradcheck(cls):
    """Training: recurrent dropout and zoneout masks are sampled once per call; the recorded
    backward reuses the call's masks (seeded so that every gradcheck call draws the same)."""
    opts = {"recurrent_dropout": 0.3, "zoneout": 0.2 if cls == "GRU" else (0.2, 0.3)}
    m = _module(getattr(fastlayers, cls), opts, bidirectional=True).train()
    x = torch.randn(4, 3, 3, dtype=torch.double, requires_grad=True)

    def f(x):
        torch.manual_seed(5)
        return m(x, lengths=LENGTHS)[0]

    _check(f, x)


def test_engine_takes_the_recorded_path_only_when_recording(monkeypatch):
    calls = []
    original = _cpu_recurrence._recorded_backward
    monkeypatch.setattr(_cpu_recurrence, "_recorded_backward", lambda *a: calls.append(1) or original(*a))
    m = _module(fastlayers.LSTM, {"layer_norm": True})
    x = torch.randn(4, 3, 3, dtype=torch.double, requires_grad=True)
    m(x, lengths=LENGTHS)[0].sum().backward()
    assert calls == []
    g, = torch.autograd.grad(m(x, lengths=LENGTHS)[0].pow(2).sum(), x, create_graph=True)
    assert calls == [1] and g.requires_grad


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_hvp_equals_torch_packed_path(cls):
    torch.manual_seed(0)
    ours = getattr(fastlayers, cls)(3, 4, bidirectional=True).double()
    ref = getattr(torch.nn, cls)(3, 4, bidirectional=True).double()
    ref.load_state_dict(ours.state_dict())
    x, v = torch.randn(4, 3, 3, dtype=torch.double), torch.randn(4, 3, 3, dtype=torch.double)
    lengths = [4, 2, 1]

    def f_torch(x):
        out = ref(pack_padded_sequence(x, lengths))[0]
        return pad_packed_sequence(out, total_length=4)[0].pow(2).sum()

    def f_ours(x):
        return ours(x, lengths=lengths)[0].pow(2).sum()

    expected, got = hvp(f_torch, x, v)[1], hvp(f_ours, x, v)[1]
    assert expected.norm() > 0
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_bf16_second_derivative_close_to_float64():
    """Low precision (bf16 parameters and input, the engine): the Hessian-vector product is the
    float64 one within bf16 rounding, not zero."""
    torch.manual_seed(0)
    m = fastlayers.LSTM(3, 4, layer_norm=True).double()
    x, v = torch.randn(6, 2, 3, dtype=torch.double), torch.randn(6, 2, 3, dtype=torch.double)
    lengths = [6, 3]
    expected = hvp(lambda x: m(x, lengths=lengths)[0].pow(2).sum(), x, v)[1]
    low = m.to(torch.bfloat16)
    got = hvp(lambda x: low(x, lengths=lengths)[0].float().pow(2).sum(), x.bfloat16(), v.bfloat16())[1]
    assert got.dtype == torch.bfloat16
    err = (got.double() - expected).norm() / expected.norm()
    assert err < 0.06, err  # (0.026 measured on an AMD EPYC Zen 5; bf16's unit roundoff 0.004)


def test_gradient_penalty_training_step():
    """WGAN-GP style: loss + ||d loss / d x||^2 trains the weights through the second derivative; the
    step equals the same step through torch's PackedSequence path."""
    torch.manual_seed(0)
    ours = fastlayers.LSTM(3, 4).double()
    ref = torch.nn.LSTM(3, 4).double()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(5, 3, 3, dtype=torch.double)
    lengths = [5, 2, 4]

    def step(model, run):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        xi = x.clone().requires_grad_(True)
        loss = run(model, xi).sum()
        g, = torch.autograd.grad(loss, xi, create_graph=True)
        (loss + g.pow(2).sum()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return grads

    def run_ref(model, xi):
        out = model(pack_padded_sequence(xi, lengths, enforce_sorted=False))[0]
        return pad_packed_sequence(out, total_length=5)[0].tanh()

    g_ours = step(ours, lambda model, xi: model(xi, lengths=lengths)[0].tanh())
    g_ref = step(ref, run_ref)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(dict(ours.named_parameters())["weight_hh_l0"], ref.weight_hh_l0, rtol=1e-9, atol=1e-11)


def test_local_gradgradcheck_cpu_kernel():
    torch.manual_seed(0)
    m = fastlayers.LocallyConnected2d(2, 2, (4, 4), kernel_size=2, stride=1, padding=1).double()
    x = torch.randn(2, 2, 4, 4, dtype=torch.double, requires_grad=True)
    w = m.weight.detach().clone().requires_grad_(True)
    b = m.bias.detach().clone().requires_grad_(True)
    with fastlayers.backend("cpu"):
        _check(lambda x, w, b: torch.func.functional_call(m, {"weight": w, "bias": b}, (x,)), x, w, b)


@triton
def test_local_gradgradcheck_triton():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 3, 3, dtype=torch.double, requires_grad=True)
    m = fastlayers.LocallyConnected2d(2, 2, (3, 3), kernel_size=1).double()
    w = m.weight.detach().clone().requires_grad_(True)
    with fastlayers.backend("triton"):
        _check(lambda x, w: torch.func.functional_call(m, {"weight": w}, (x,)), x, w, fast_mode=True)


@triton
@pytest.mark.parametrize("score", ["dot", "scaled_dot"])
def test_attention_gradgradcheck_triton(score):
    torch.manual_seed(0)
    q = torch.randn(2, 3, dtype=torch.double, requires_grad=True)
    k = torch.randn(2, 4, 3, dtype=torch.double, requires_grad=True)
    v = torch.randn(2, 4, 2, dtype=torch.double, requires_grad=True)
    with fastlayers.backend("triton"):
        _check(lambda q, k, v: fastlayers.attention_pool(q, k, v, [4, 2], score=score), q, k, v, fast_mode=True)


@triton
@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_triton_engine_gradgradcheck(cls):
    opts = {"layer_norm": True}
    m = _module(getattr(fastlayers, cls), opts, bidirectional=True).eval()
    x = torch.randn(3, 2, 3, dtype=torch.double, requires_grad=True)
    with fastlayers.backend("triton"):
        _check(lambda x: m(x, lengths=[3, 2])[0], x, fast_mode=True)


def test_rnn_with_lengths_gradgradcheck():
    """RNN with lengths runs torch's fused kernels per segment: differentiable twice as they are."""
    m = _module(fastlayers.RNN, {}, bidirectional=True)
    x = torch.randn(4, 3, 3, dtype=torch.double, requires_grad=True)
    _check(lambda x: m(x, lengths=LENGTHS), x)


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_reference_backend_gradgradcheck(cls):
    m = _module(getattr(fastlayers, cls), {"layer_norm": True}).eval()
    x = torch.randn(4, 3, 3, dtype=torch.double, requires_grad=True)
    with fastlayers.backend("reference"):
        _check(lambda x: m(x, lengths=LENGTHS)[0], x)


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_bf16_plain_call_without_lengths_has_second_derivatives(cls):
    """A plain bf16 call on CPU runs the engine (float32 cell state): its Hessian-vector product is
    float64's within bf16 rounding."""
    torch.manual_seed(0)
    m = getattr(fastlayers, cls)(3, 4).double()
    x, v = torch.randn(5, 2, 3, dtype=torch.double), torch.randn(5, 2, 3, dtype=torch.double)
    expected = hvp(lambda x: m(x)[0].pow(2).sum(), x, v)[1]
    low = m.to(torch.bfloat16)
    got = hvp(lambda x: low(x)[0].float().pow(2).sum(), x.bfloat16(), v.bfloat16())[1]
    err = (got.double() - expected).norm() / expected.norm()
    assert err < 0.02, err  # (0.0055 measured on an AMD EPYC Zen 5)


def _aliased_cases():
    """Calls that pass one tensor in two places: attention pooling's values defaulting to its keys
    (every score), an LSTM whose h_0 and c_0 are one tensor."""
    torch.manual_seed(0)
    q, k, h = torch.randn(3, 4).double(), torch.randn(3, 5, 4).double(), torch.randn(1, 3, 3).double()
    x = torch.randn(5, 3, 3).double()
    additive = fastlayers.AttentionPooling(4, 4, score="additive").double()
    lstm = _module(fastlayers.LSTM, {"layer_norm": True})
    return {
        "dot": ((q, k), lambda q, k: fastlayers.attention_pool(q, k, lengths=[5, 2, 4])[0]),
        "scaled_dot": ((q, k), lambda q, k: fastlayers.attention_pool(q, k, score="scaled_dot")[0]),
        "additive": ((q, k), lambda q, k: additive(q, k, lengths=[5, 2, 4])[0]),
        "lstm h_0 = c_0": ((x, h), lambda x, h: lstm(x, (h, h), lengths=[5, 2, 4])[0]),
    }


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=triton)])
@pytest.mark.parametrize("case", ["dot", "scaled_dot", "additive", "lstm h_0 = c_0"])
def test_a_recorded_backward_of_a_tensor_passed_twice(case, backend):
    """create_graph=True gives the first derivatives of the plain backward (each use of the tensor
    counted once: the recorded path gave the keys' gradient twice), and its derivative in the
    incoming gradient (a Jacobian-vector product, torch.autograd.functional.jvp) equals the
    reference backend's and central differences."""
    inputs, call = _aliased_cases()[case]
    inputs = tuple(t.requires_grad_() for t in inputs)

    def fn(*args):
        with fastlayers.backend(backend):
            return call(*args)

    out = fn(*inputs)
    weight = torch.randn_like(out)
    plain = torch.autograd.grad(out, inputs, weight)
    recorded = torch.autograd.grad(fn(*inputs), inputs, weight, create_graph=True)
    for a, b in zip(recorded, plain):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    tangents = tuple(torch.randn_like(t) for t in inputs)
    got = torch.autograd.functional.jvp(fn, inputs, tangents)[1]
    with fastlayers.backend("reference"):
        want = torch.autograd.functional.jvp(call, inputs, tangents)[1]
    eps = 1e-6
    with torch.no_grad():
        central = (fn(*(t + eps * d for t, d in zip(inputs, tangents)))
                   - fn(*(t - eps * d for t, d in zip(inputs, tangents)))) / (2 * eps)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(got, central, rtol=1e-5, atol=1e-7)


RECORDED_LAYERS = {
    **{f"LSTM-{k}": (fastlayers.LSTM, v) for k, v in OPTIONS.items()},
    "LSTM-all": (fastlayers.LSTM, {"layer_norm": True, "peephole": True, "cell_clip": 0.5, "zoneout": (0.2, 0.3),
                                   "proj_size": 2, "proj_clip": 0.4}),
    "LSTM-checkpoint_every": (fastlayers.LSTM, {"layer_norm": True, "zoneout": (0.2, 0.3), "checkpoint_every": 2}),
    "GRU-plain": (fastlayers.GRU, {}),
    "GRU-all": (fastlayers.GRU, {"layer_norm": True, "zoneout": 0.25}),
    "RNN-relu": (fastlayers.RNN, {"nonlinearity": "relu"}),
}


def _recorded_cases():
    """every layer x call x backend, but checkpoint_every on Triton's interpreter with lengths only
    (its segments are the same code for the three call forms; 12-14 s each under the interpreter)"""
    for name in RECORDED_LAYERS:
        for call in ("lengths", "padded", "varlen"):
            for backend in ("cpu", "triton", "reference"):
                if backend == "triton" and "checkpoint_every" in name and call != "lengths":
                    continue
                yield pytest.param(name, call, backend, id=f"{name}-{call}-{backend}",
                                   marks=triton if backend == "triton" else ())


@pytest.mark.parametrize("name, call, backend", list(_recorded_cases()))
def test_recorded_first_derivatives_equal_the_plain_backward(name, call, backend):
    """A backward recorded for a second derivative (create_graph=True: the differentiable
    reference recomputes, with the layer's options) gives the plain backward's first derivatives,
    for the input, the initial states and every parameter (gradgradcheck differentiates the
    recorded backward against itself: options read wrongly there passed it)."""
    cls, options = RECORDED_LAYERS[name]
    m = _module(cls, options, bidirectional=True, num_layers=2).eval()
    torch.manual_seed(1)
    x = torch.randn(4, 3, 3, dtype=torch.double, requires_grad=True)
    h0 = torch.randn(4, 3, m.proj_size or 3 if cls is fastlayers.LSTM else 3, dtype=torch.double, requires_grad=True)
    states = [h0] + ([torch.randn(4, 3, 3, dtype=torch.double, requires_grad=True)] if cls is fastlayers.LSTM else [])
    hx = tuple(states) if cls is fastlayers.LSTM else h0

    def run():
        with fastlayers.backend(backend):
            if call == "varlen":
                values = torch.cat([x[:n, b] for b, n in enumerate(LENGTHS)])
                cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
                return m(values, hx, cu_seqlens=cu)
            return m(x, hx, lengths=LENGTHS if call == "lengths" else None)

    inputs = [x, *states, *m.parameters()]
    outs = torch.utils._pytree.tree_leaves(run())
    weights = [torch.randn_like(o) for o in outs]
    plain = torch.autograd.grad(outs, inputs, weights)
    recorded = torch.autograd.grad(torch.utils._pytree.tree_leaves(run()), inputs, weights, create_graph=True)
    for (pname, _), a, b in zip([("input", x)] * (1 + len(states)) + list(m.named_parameters()), recorded, plain,
                                strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=pname)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("triton", marks=triton), "reference"])
@pytest.mark.parametrize("cls, options", [
    (fastlayers.LSTMCell, {"layer_norm": True, "peephole": True, "cell_clip": 0.5, "zoneout": (0.2, 0.3)}),
    (fastlayers.LSTMCell, {"proj_size": 2, "proj_clip": 0.4}),
    (fastlayers.GRUCell, {"layer_norm": True, "zoneout": 0.25}),
], ids=["LSTMCell-all", "LSTMCell-proj", "GRUCell-all"])
def test_recorded_first_derivatives_of_a_cell_equal_the_plain_backward(cls, options, backend):
    m = _module(cls, options).eval()
    torch.manual_seed(1)
    x = torch.randn(3, 3, dtype=torch.double, requires_grad=True)
    width = options.get("proj_size", 3)
    states = [torch.randn(3, width, dtype=torch.double, requires_grad=True)]
    if cls is fastlayers.LSTMCell:
        states.append(torch.randn(3, 3, dtype=torch.double, requires_grad=True))

    def run():
        with fastlayers.backend(backend):
            return torch.utils._pytree.tree_leaves(m(x, tuple(states) if len(states) == 2 else states[0]))

    inputs = [x, *states, *m.parameters()]
    outs = run()
    weights = [torch.randn_like(o) for o in outs]
    plain = torch.autograd.grad(outs, inputs, weights)
    recorded = torch.autograd.grad(run(), inputs, weights, create_graph=True)
    for a, b in zip(recorded, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _inference_cases():
    x = torch.randn(4, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([4, 2, 3])
    return x, {
        "LSTM lengths": (lambda: fastlayers.LSTM(3, 3), lambda m, x: m(x, lengths=lengths)[0]),
        "LSTM layer_norm": (lambda: fastlayers.LSTM(3, 3, layer_norm=True), lambda m, x: m(x)[0]),
        "GRU lengths": (lambda: fastlayers.GRU(3, 3), lambda m, x: m(x, lengths=lengths)[0]),
        "AttentionPooling additive": (lambda: fastlayers.AttentionPooling(3, 3, score="additive"),
                                      lambda m, x: m(x[0], x.transpose(0, 1))[0]),
        "LocallyConnected2d": (lambda: fastlayers.LocallyConnected2d(4, 2, (3, 3), 2), lambda m, x: m(x.unsqueeze(0))),
        "AttentionPooling dot": (lambda: torch.nn.Linear(3, 3),  # (its weight: a parameter for the test's w)
                                 lambda m, x: fastlayers.attention_pool(m(x[0]), x.transpose(0, 1), lengths=[4, 2, 3])[0]),
        "LSTMCell layer_norm": (lambda: fastlayers.LSTMCell(3, 3, layer_norm=True), lambda m, x: m(x[0])[0]),
        # (checkpoint_every: the backward recomputes its segments with a graph of their own; inside
        # inference mode that raised "Inference tensors cannot be saved for backward")
        "LSTM checkpoint_every lengths": (lambda: fastlayers.LSTM(3, 3, bidirectional=True, checkpoint_every=2),
                                          lambda m, x: m(x, lengths=lengths)[0]),
        "GRU layer_norm checkpoint_every": (lambda: fastlayers.GRU(3, 3, layer_norm=True, checkpoint_every=2),
                                            lambda m, x: m(x)[0]),
    }


@pytest.mark.parametrize("name", list(_inference_cases()[1]))
@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_create_graph_inside_inference_mode_gives_the_first_order_gradients(name, backend):
    """A backward with create_graph=True run inside torch.inference_mode records nothing: the
    first-order gradients, as torch.nn's layers give them (the recorded path ran and returned None
    or wrong gradients without an error); a forward there under enable_grad runs (it raised
    "Inference tensors cannot be saved for backward"), and the engine's buffers made there are not
    reused outside it."""
    x, cases = _inference_cases()
    build, call = cases[name]
    torch.manual_seed(0)
    m = build().double()
    w = next(m.parameters())
    x = x.requires_grad_()
    with fastlayers.backend(backend):
        want = torch.autograd.grad((call(m, x) ** 2).sum(), [x, w])
        loss = (call(m, x) ** 2).sum()
        with torch.inference_mode():
            got = torch.autograd.grad(loss, [x, w], create_graph=True)
            with torch.enable_grad():
                assert not call(m, x.detach()).requires_grad
        again = torch.autograd.grad((call(m, x) ** 2).sum(), [x, w])  # (after buffers made in inference mode)
    assert not any(g.requires_grad for g in got)  # nothing recorded
    for g, a, e in zip(got, again, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_inference_mode_with_grad_mode_in_low_precision_and_subclasses():
    """enable_grad inside inference_mode: low-precision locally connected calls (their autograd
    Function path) and a layer's cell view run too; a subclass's own forward runs once (the layers
    re-enter their own forward under no_grad, not the subclass's); the engine's buffers made there
    are ordinary tensors, reused afterwards."""
    from fastlayers._core import pool

    class Doubled(fastlayers.LSTM):
        calls = 0

        def forward(self, x, hx=None, **kwargs):
            Doubled.calls += 1
            return super().forward(x * 2, hx, **kwargs)

    lc = fastlayers.LocallyConnected2d(2, 3, (5, 5), 3).bfloat16()
    lstm = Doubled(3, 4, layer_norm=True)
    with torch.inference_mode(), torch.enable_grad():
        assert lc(torch.randn(2, 2, 5, 5, dtype=torch.bfloat16)).dtype == torch.bfloat16
        assert lstm.cell(0)(torch.randn(2, 3))[0].shape == (2, 4)
        lstm(torch.randn(5, 2, 3))
    assert Doubled.calls == 1
    pool.empty_cache()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        fastlayers.LSTM(3, 4, layer_norm=True)(torch.randn(5, 2, 3))  # (a low-precision call: pooled slabs)
    assert pool._free and not any(s.is_inference() for s in pool._free)  # (they were made, then dropped)
