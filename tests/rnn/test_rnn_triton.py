"""The recurrent engine's Triton path (fastlayers.rnn._gpu, kernels in fastlayers._triton.lstm /
gru) on CPU tensors through Triton's interpreter: values, final states and every gradient against
the float64 per-step reference (every cell option, training masks passed in, eval-mode zoneout,
unsorted lengths with a length-1 sequence, hx, both directions, 2 layers, projection), torch.nn
equality with the options off, and the modules as constructed with the backend forced; its loops
eagerly and as captured chunks of steps replayed for any T (rnn/_gpu_graphs.py, replays run on CPU);
the cells with options on the same step kernels (rnn/_gpu_cell.py). make test runs this file
poisoned under the newest Triton, the tests marked ``each_triton`` also under Triton 3.6.0."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

pytest.importorskip("triton")

import fastlayers  # noqa: E402
from fastlayers.rnn._gpu import gru_engine_gpu, lstm_engine_gpu  # noqa: E402
from fastlayers.rnn._reference import gru_reference, lstm_reference  # noqa: E402
from fastlayers.rnn._options import CellOptions  # noqa: E402

from rnn_helpers import assert_close_all, make_hx, make_pair, on_the_triton_engine, run_and_grad, torch_packed  # noqa: E402
from module_cases import weighted_sum  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and Triton's interpreter is off")

T, B, F, H, D, L = 5, 3, 4, 5, 2, 2
LENGTHS = torch.tensor([3, 5, 1])  # unsorted, one sequence of length 1
ENGINES = {"LSTM": (lstm_engine_gpu, lstm_reference), "GRU": (gru_engine_gpu, gru_reference)}


def _parameters(cell, opts, proj, layers=L, dirs=D, bias=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3, shift=0.0):
        return shift + scale * torch.randn(*shape, generator=g, dtype=dtype)

    gsize = (4 if cell == "LSTM" else 3) * H
    out = proj or H
    result = []
    for li in range(layers):
        per_dir = []
        for _ in range(dirs):
            p = {"weight_ih": rand(gsize, F if li == 0 else dirs * out), "weight_hh": rand(gsize, out)}
            if bias:
                p.update(bias_ih=rand(gsize, scale=0.1), bias_hh=rand(gsize, scale=0.1))
            if opts.layer_norm:
                p.update(ln_ih_weight=rand(gsize, scale=0.1, shift=1.0), ln_hh_weight=rand(gsize, scale=0.1, shift=1.0))
                if cell == "LSTM":
                    p.update(ln_cell_weight=rand(H, scale=0.1, shift=1.0), ln_cell_bias=rand(H, scale=0.1))
            if opts.peephole:
                p["weight_peephole"] = rand(3 * H, scale=0.2)
            if proj:
                p["weight_hr"] = rand(proj, H)
            per_dir.append(p)
        result.append(per_dir)
    return result


def _masks(cell, proj, layers=L, dirs=D, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    out = proj or H
    keep = lambda *shape, p: torch.bernoulli(torch.full(shape, p, dtype=dtype), generator=g)  # noqa: E731
    masks = []
    for _ in range(layers):
        m = {"recurrent": keep(dirs, B, out, p=0.7) / 0.7, "zoneout_h": keep(dirs, T, B, out, p=0.3)}
        if cell == "LSTM":
            m["zoneout_c"] = keep(dirs, T, B, H, p=0.4)
        masks.append(m)
    return masks


def _run(fn, x, hx, layers, lengths, opts, training=False, masks=None, needs=None):
    """Outputs and gradients of a random linear function of (y, final states)."""
    x = x.clone().requires_grad_(needs is None or needs[0])
    hx = tuple(h.clone().requires_grad_(needs is None) for h in hx)
    layers = [[{k: v.clone().requires_grad_(needs is None or needs[1]) for k, v in p.items()} for p in d]
              for d in layers]
    y, final = fn(x, hx, layers, lengths, opts, training=training, masks=masks)
    g = torch.Generator().manual_seed(1)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in (y, *final))
    loss.backward()
    leaves = [x, *hx, *(p[k] for d in layers for p in d for k in sorted(p))]
    return [y.detach(), *(f.detach() for f in final)], [t.grad for t in leaves]


def _inputs(cell, proj, dtype=torch.float64, layers=L, dirs=D):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, B, F, generator=g, dtype=dtype)
    hx = (torch.randn(layers * dirs, B, proj or H, generator=g, dtype=dtype),)
    if cell == "LSTM":
        hx += (torch.randn(layers * dirs, B, H, generator=g, dtype=dtype),)
    return x, hx


def _assert_same(got, want, tol):
    (outs, grads), (ref_outs, ref_grads) = got, want
    for a, b in zip(outs + grads, ref_outs + ref_grads, strict=True):
        if b is None:
            assert a is None
            continue
        assert a is not None
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


CASES = [  # (cell, options, proj_size, training with masks)
    ("LSTM", CellOptions(), None, False),
    ("LSTM", CellOptions.make(layer_norm=True, peephole=True, cell_clip=0.5), None, False),
    ("LSTM", CellOptions.make(zoneout=(0.2, 0.3), recurrent_dropout=0.3, proj_clip=0.3), 3, True),
    ("LSTM", CellOptions.make(layer_norm=True, peephole=True, zoneout=(0.1, 0.2)), 3, False),  # eval zoneout
    ("LSTM", CellOptions.make(layer_norm=True, cell_clip=0.4, zoneout=(0.2, 0.3), recurrent_dropout=0.2), None, True),
    ("GRU", CellOptions(), None, False),
    ("GRU", CellOptions.make(layer_norm=True, zoneout=(0.2, 0.0), recurrent_dropout=0.2), None, True),
    ("GRU", CellOptions.make(layer_norm=True, zoneout=(0.3, 0.0)), None, False),
]


@pytest.mark.each_triton
@pytest.mark.parametrize("cell, opts, proj, training", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_engine_matches_the_float64_reference(cell, opts, proj, training):
    engine, reference = ENGINES[cell]
    layers = _parameters(cell, opts, proj)
    x, hx = _inputs(cell, proj)
    masks = _masks(cell, proj) if training else None
    want = _run(reference, x, hx, layers, LENGTHS, opts, training, masks)
    got = _run(engine, x, hx, layers, LENGTHS, opts, training, masks)
    _assert_same(got, want, 1e-10)
    y = got[0][0]
    assert torch.equal(y[3:, 0], torch.zeros_like(y[3:, 0])) and torch.equal(y[1:, 2], torch.zeros_like(y[1:, 2]))


@pytest.mark.parametrize("case, k", [(4, 2), (1, 7), (6, 2)],
                         ids=["LSTM-training-masks-k2", "LSTM-options-k7", "GRU-training-masks-k2"])
def test_checkpoint_every_through_the_triton_engine(case, k):
    """checkpoint_every (rnn/_remat.py) runs the GPU engine's segments: outputs and every gradient
    equal the engine without segments (float64), for k not dividing T and k > T, with lengths
    (a sequence of length 1), hx, both directions, 2 layers and the training masks passed in."""
    from fastlayers.rnn._remat import checkpointed

    cell, opts, proj, training = CASES[case]
    engine, _ = ENGINES[cell]
    layers = _parameters(cell, opts, proj)
    x, hx = _inputs(cell, proj)
    masks = _masks(cell, proj) if training else None

    def remat(*args, **kwargs):
        return checkpointed(engine, k, *args, cell=cell, **kwargs)

    _assert_same(_run(remat, x, hx, layers, LENGTHS, opts, training, masks),
                 _run(engine, x, hx, layers, LENGTHS, opts, training, masks), 1e-12)


@pytest.mark.parametrize("case, k, lengths, needs", [(2, 3, None, None), (3, 2, LENGTHS, (False, True)),
                                                    (7, 4, None, (True, False))],
                         ids=["LSTM-proj-training-masks-k3-no-lengths", "LSTM-proj-eval-zoneout-k2-no-x-grad",
                              "GRU-eval-zoneout-k4-no-weight-grads"])
def test_checkpoint_every_runs_both_directions_in_one_triton_call(case, k, lengths, needs, monkeypatch):
    """A bidirectional layer's segments on the Triton engine run both directions in one engine call
    (the reverse direction's rows flipped within each sequence's length, rnn/_remat.py _paired):
    every engine call of the layer's forward and backward takes (D, k, B, F) inputs, one per
    segment, and the outputs and every gradient wanted equal the engine without segments (float64),
    with a projection, the training masks passed in, eval-mode zoneout, with and without lengths."""
    from fastlayers.rnn import _remat
    from fastlayers.rnn._remat import checkpointed

    cell, opts, proj, training = CASES[case]
    engine, _ = ENGINES[cell]
    shapes = []

    def counting(x, *args, **kwargs):
        shapes.append(tuple(x.shape))
        return engine(x, *args, **kwargs)

    monkeypatch.setattr(_remat, "lstm_engine_gpu" if cell == "LSTM" else "gru_engine_gpu", counting)
    layers = _parameters(cell, opts, proj, layers=1)
    x, hx = _inputs(cell, proj, layers=1)
    masks = _masks(cell, proj, layers=1) if training else None

    def remat(*args, **kwargs):
        return checkpointed(counting, k, *args, cell=cell, **kwargs)

    got = _run(remat, x, hx, layers, lengths, opts, training, masks, needs)
    want = _run(engine, x, hx, layers, lengths, opts, training, masks, needs)
    _assert_same(got, want, 1e-12)
    segments = -(-(T if lengths is None else int(lengths.max())) // k)
    assert len(shapes) == 2 * segments and all(len(shape) == 4 and shape[0] == D for shape in shapes)


def test_per_direction_inputs_refuse_second_derivatives():
    """The engine with an input per direction (what checkpoint_every's segments run) says it cannot
    differentiate twice rather than returning a wrong or zero second derivative."""
    opts = CellOptions()
    layers = _parameters("LSTM", opts, None, layers=1)
    x, hx = _inputs("LSTM", None, layers=1)
    x2 = torch.stack([x, x.flip(0)]).requires_grad_()
    y, _ = lstm_engine_gpu(x2, hx, layers, None, opts)
    (g,) = torch.autograd.grad(y.sum(), x2, retain_graph=True)  # first derivatives: fine
    assert g.shape == x2.shape
    with pytest.raises(RuntimeError, match="cannot differentiate twice"):
        torch.autograd.grad(y.sum(), x2, create_graph=True)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_float32_engine_matches_the_float64_reference(cell):
    opts = CellOptions.make(layer_norm=True, peephole=cell == "LSTM", zoneout=(0.1, 0.1))
    engine, reference = ENGINES[cell]
    layers = _parameters(cell, opts, None)
    x, hx = _inputs(cell, None)
    want = _run(reference, x, hx, layers, LENGTHS, opts)
    f32 = [[{k: v.float() for k, v in p.items()} for p in d] for d in layers]
    got = _run(engine, x.float(), tuple(h.float() for h in hx), f32, LENGTHS, opts)
    assert got[0][0].dtype == torch.float32 and got[1][0].dtype == torch.float32
    _assert_same(got, want, 2e-5)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_float32_engine_with_the_recurrent_product_in_slices(cell, monkeypatch):
    """The backward's product split into partial sums over slices of its inner size (the step
    kernels add them): 4H = 20 in two non-empty slices of 16 and an empty one; 3H = 15 in one
    slice and an empty one (16 is the least tile of tl.dot)."""
    from fastlayers._triton import step_matmul

    monkeypatch.setattr(step_matmul, "BLOCK_K", 16)
    monkeypatch.setattr(step_matmul, "K_PER_SLICE", 8)
    assert step_matmul.slices((4 if cell == "LSTM" else 3) * H) == (3 if cell == "LSTM" else 2)
    opts = CellOptions.make(layer_norm=True, zoneout=(0.1, 0.1), recurrent_dropout=0.2)
    engine, reference = ENGINES[cell]
    layers = _parameters(cell, opts, None)
    x, hx = _inputs(cell, None)
    masks = _masks(cell, None)
    want = _run(reference, x, hx, layers, LENGTHS, opts, True, masks)
    f32 = [[{k: v.float() for k, v in p.items()} for p in d] for d in layers]
    m32 = [{k: v.float() for k, v in m.items()} for m in masks]
    got = _run(engine, x.float(), tuple(h.float() for h in hx), f32, LENGTHS, opts, True, m32)
    _assert_same(got, want, 2e-5)


@pytest.mark.each_triton
@pytest.mark.parametrize("slices, dtype", [(1, torch.float32), (3, torch.float32), (2, torch.bfloat16)])
def test_step_matmul_partial_sums_add_up_to_the_product(slices, dtype):
    """out (S, D, M, N): S partial products of a step of a (D, T, M, K) buffer and w (D, K, N), the
    step clock[0] + j = 1 + 1, M and N not multiples of the tiles, every slice non-empty; a
    bfloat16 w takes a in bfloat16 (a holds bfloat16 values here: Triton 3.6's interpreter rounds
    float32 to bfloat16 toward zero, the GPU to nearest; test_cuda checks the engine's bfloat16
    results on the GPU)."""
    from fastlayers._triton import step_matmul

    g = torch.Generator().manual_seed(0)
    buf = torch.randn(2, 4, 35, 400, generator=g).to(dtype).float()
    a = buf[:, 2]
    w = torch.randn(2, 400, 70, generator=g).to(dtype)
    out = torch.full((slices, 2, 35, 70), float("nan"))
    step_matmul.matmul(buf, w, out, (torch.tensor([1, 4], dtype=torch.int32), 1))
    want = torch.bmm(a.to(dtype).double(), w.double())
    torch.testing.assert_close(out.double().sum(0), want, atol=1e-3, rtol=1e-5)
    assert bool((out.abs().sum((1, 2, 3)) > 0).all())


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_one_direction_no_bias_no_lengths(cell):
    opts = CellOptions.make(layer_norm=True)
    engine, reference = ENGINES[cell]
    layers = _parameters(cell, opts, None, layers=1, dirs=1, bias=False)
    x, hx = _inputs(cell, None, layers=1, dirs=1)
    _assert_same(_run(engine, x, hx, layers, None, opts), _run(reference, x, hx, layers, None, opts), 1e-10)


@pytest.mark.parametrize("needs", [(True, False), (False, True)], ids=["input-only", "parameters-only"])
def test_gradient_subsets(needs):
    opts = CellOptions.make(layer_norm=True, peephole=True)
    layers = _parameters("LSTM", opts, 3)
    x, hx = _inputs("LSTM", 3)
    got = _run(lstm_engine_gpu, x, hx, layers, LENGTHS, opts, needs=needs)
    want = _run(lstm_reference, x, hx, layers, LENGTHS, opts)
    for a, b in zip(got[1], want[1], strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert (got[1][0] is not None) == needs[0] and (got[1][-1] is not None) == needs[1]


@pytest.mark.parametrize("mode", ["LSTM", "LSTM-proj", "GRU"])
def test_options_off_equal_torch_nn_with_lengths(mode):
    torch.manual_seed(0)
    ours, ref = make_pair(mode, F, H, dtype=torch.float64, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, F, dtype=torch.float64)
    hx = make_hx(ref, B, dtype=torch.float64)
    engine = lstm_engine_gpu if mode.startswith("LSTM") else gru_engine_gpu
    states = hx if isinstance(hx, tuple) else (hx,)

    def fastlayers_engine(x, h):
        out, final = engine(x, h if isinstance(h, tuple) else (h,), ours._layer_parameters(), LENGTHS, ours.options)
        return out, (final if len(final) == 2 else final[0])

    got = run_and_grad(fastlayers_engine, ours, x, states if len(states) == 2 else states[0])
    want = run_and_grad(lambda x, h: torch_packed(ref, x, h, LENGTHS), ref, x, hx)
    assert_close_all(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("cls, kwargs", [
    (fastlayers.LSTM, dict(layer_norm=True, peephole=True, cell_clip=1.0, batch_first=True, bidirectional=True)),
    (fastlayers.LSTM, dict(layer_norm=True, proj_size=3, num_layers=2, zoneout=0.1)),
    (fastlayers.GRU, dict(layer_norm=True, batch_first=True, bidirectional=True, num_layers=2)),
], ids=["lstm-ln-peephole-bf", "lstm-proj-2layer", "gru-ln-bi"])
def test_module_as_constructed_forced_triton_equals_reference(cls, kwargs):
    torch.manual_seed(0)
    module = cls(F, H, **kwargs).double().eval()
    shape = (B, T, F) if kwargs.get("batch_first") else (T, B, F)
    x = torch.randn(*shape, dtype=torch.float64)
    with fastlayers.backend("triton"), on_the_triton_engine():
        got = run_and_grad(lambda x, h: module(x, h, lengths=LENGTHS), module, x, None)
    with fastlayers.backend("reference"):
        want = run_and_grad(lambda x, h: module(x, h, lengths=LENGTHS), module, x, None)
    assert_close_all(got, want, atol=1e-10, rtol=1e-10)


SIZE_ONE = {  # (class, input_size, hidden_size, options): an operand of the step products 1 wide
    "lstm-proj1-ln": (fastlayers.LSTM, F, H, dict(proj_size=1, layer_norm=True, bidirectional=True, num_layers=2)),
    "lstm-proj1-clip": (fastlayers.LSTM, F, H, dict(proj_size=1, cell_clip=0.3, proj_clip=0.2, num_layers=2)),
    "lstm-proj1-checkpoint": (fastlayers.LSTM, F, H, dict(proj_size=1, peephole=True, checkpoint_every=2)),
    "lstm-h1": (fastlayers.LSTM, 1, 1, dict(layer_norm=True, bidirectional=True, num_layers=2)),
    "gru-h1": (fastlayers.GRU, 1, 1, dict(layer_norm=True, bidirectional=True, num_layers=2)),
}


@pytest.mark.parametrize("case", list(SIZE_ONE))
def test_size_one_projection_and_hidden_on_the_triton_engine(case):
    """proj_size=1 made the projection's weight a (D, H, 1) view whose last stride is H, which
    torch calls contiguous (a size-1 dimension); the step product asserted unit stride there and
    every LSTM with proj_size=1 and an option raised AssertionError on the Triton engine."""
    cls, f, h, kwargs = SIZE_ONE[case]
    torch.manual_seed(0)
    module = cls(f, h, **kwargs).double().eval()
    _assert_triton_equals_reference(module, torch.randn(T, B, f, dtype=torch.float64), LENGTHS)


def _assert_triton_equals_reference(module, x, lengths, reference_lengths=LENGTHS):
    """The module's outputs and every gradient on the Triton engine (given ``lengths``) equal the
    reference's (given ``reference_lengths``, the same values) in float64."""
    with fastlayers.backend("triton"), on_the_triton_engine():
        got = run_and_grad(lambda x, h: module(x, h, lengths=lengths), module, x, None)
    with fastlayers.backend("reference"):
        want = run_and_grad(lambda x, h: module(x, h, lengths=reference_lengths), module, x, None)
    assert_close_all(got, want, atol=1e-10, rtol=1e-10)


HX_VIEWS = {
    "lstm-ln": (fastlayers.LSTM, dict(layer_norm=True)),
    "gru-ln": (fastlayers.GRU, dict(layer_norm=True)),
    "lstm-proj-peephole": (fastlayers.LSTM, dict(proj_size=2, peephole=True)),
}


@pytest.mark.parametrize("checkpoint_every", [None, 2])
@pytest.mark.parametrize("view", ["transposed", "expanded"])
@pytest.mark.parametrize("case", list(HX_VIEWS))
def test_initial_states_given_as_views_on_the_triton_engine(case, view, checkpoint_every):
    """hx as torch.nn takes it: a view of a batch-major tensor (h.transpose(0, 1)) or one learned
    state expanded over the batch (h0.expand(-1, B, -1), stride 0). The Triton engine copied the
    states with to(copy=True), which keeps a transposed view's strides, into buffers its kernels
    index as contiguous (every output wrong), and its backward read the saved c0 as contiguous
    (an expanded c0's gradients came back as NaN or 1e35)."""
    cls, kwargs = HX_VIEWS[case]
    torch.manual_seed(0)
    module = cls(F, H, num_layers=2, bidirectional=True, checkpoint_every=checkpoint_every, **kwargs).eval()
    out = kwargs.get("proj_size") or H
    g = torch.Generator().manual_seed(1)
    shapes = ((B, L * D, out), (B, L * D, H)) if view == "transposed" else ((L * D, 1, out), (L * D, 1, H))
    bases = [torch.randn(*shape, generator=g) for shape in shapes[:2 if cls is fastlayers.LSTM else 1]]
    x = torch.randn(T, B, F, generator=g)
    results = []
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_(True) for t in bases]
        views = [t.transpose(0, 1) if view == "transposed" else t.expand(-1, B, -1) for t in leaves]
        engine = on_the_triton_engine() if backend == "triton" else contextlib.nullcontext()
        with fastlayers.backend(backend), engine:  # (a triton quietly run as the reference: itself)
            y, finals = module(x, tuple(views) if cls is fastlayers.LSTM else views[0], lengths=LENGTHS)
            outs = [y, *(finals if isinstance(finals, tuple) else (finals,))]
            grads = torch.autograd.grad(weighted_sum(outs), [*leaves, *module.parameters()])
        results.append([o.detach() for o in outs] + list(grads))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layers,checkpoint_every", [(1, None), (2, 2)])
@pytest.mark.parametrize("case", list(HX_VIEWS))
def test_column_major_weights_and_strided_lengths_on_the_triton_engine(case, layers, checkpoint_every):
    """A one-direction layer whose recurrent weights are column-major (a transposed checkpoint
    tensor, w.t().contiguous().t()) ran its forward and then raised AssertionError in the step
    product of its backward, which read the weights as given; lengths given as a strided view
    (t[:, 0]) were read by the kernels as contiguous (outputs off by 0.6)."""
    cls, kwargs = HX_VIEWS[case]
    torch.manual_seed(0)
    module = cls(F, H, num_layers=layers, checkpoint_every=checkpoint_every, **kwargs).double().eval()
    with torch.no_grad():
        for name, p in list(module.named_parameters()):
            if name.startswith(("weight_hh", "weight_hr")):
                setattr(module, name, torch.nn.Parameter(p.t().contiguous().t()))  # same values, column-major
    assert not module.weight_hh_l0.is_contiguous()
    lengths = torch.stack([LENGTHS, LENGTHS], 1)[:, 0]  # stride 2
    _assert_triton_equals_reference(module, torch.randn(T, B, F, dtype=torch.float64), lengths)


def test_module_forced_triton_runs_the_triton_layer():
    module = fastlayers.LSTM(F, H, layer_norm=True).double()
    x = torch.randn(T, B, F, dtype=torch.float64)
    with fastlayers.backend("triton"):
        out, _ = module(x, lengths=LENGTHS)
    assert type(out.grad_fn).__name__ == "LSTMLayerBackward"


def test_plain_module_with_lengths_stays_on_torch_when_triton_is_forced():
    ours, ref = make_pair("LSTM", F, H, dtype=torch.float64)
    x = torch.randn(T, B, F, dtype=torch.float64)
    with fastlayers.backend("triton"):
        out, _ = ours(x, lengths=LENGTHS)
    torch.testing.assert_close(out, torch_packed(ref, x, None, LENGTHS)[0], atol=1e-12, rtol=1e-12)
    assert type(out.grad_fn).__name__ != "LSTMLayerBackward"


def test_dropout_between_layers_is_drawn_from_the_seed():
    """dropout between layers in training: F.dropout of the layer output (the global generator)."""
    module = fastlayers.GRU(F, H, num_layers=2, dropout=0.5, layer_norm=True).double().train()
    x = torch.randn(T, B, F, dtype=torch.float64)
    with fastlayers.backend("triton"), on_the_triton_engine():
        torch.manual_seed(5)
        a, _ = module(x, lengths=LENGTHS)
        torch.manual_seed(5)
        b, _ = module(x, lengths=LENGTHS)
        c, _ = module.eval()(x, lengths=LENGTHS)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_values_at_padded_steps_are_never_read(cell):
    opts = CellOptions.make(layer_norm=True)
    engine, reference = ENGINES[cell]
    layers = _parameters(cell, opts, None)
    x, hx = _inputs(cell, None)
    padded = torch.arange(T).unsqueeze(1) >= LENGTHS
    want = _run(reference, x.masked_fill(padded.unsqueeze(2), 0), hx, layers, LENGTHS, opts)
    got = _run(engine, x.masked_fill(padded.unsqueeze(2), float("nan")), hx, layers, LENGTHS, opts)
    _assert_same(got, want, 1e-10)


# ---- the loops as captured chunks of steps (rnn/_gpu_graphs.py), replays run eagerly (_gpu_graphs.emulated)

@pytest.fixture
def chunked(monkeypatch):
    """The engine's loops "captured" in chunks of 2 steps (T = 5: three replays, half the last one
    past T), replays running the chunk on the entry's buffers."""
    from fastlayers.rnn import _gpu_graphs

    monkeypatch.setattr(_gpu_graphs, "CHUNK", 2)
    monkeypatch.setattr(_gpu_graphs, "EAGER_STEPS", 0)  # T = 1 is captured too (test_small_calls_...: not)
    monkeypatch.setattr(_gpu_graphs, "stats", dict.fromkeys(_gpu_graphs.stats, 0))
    _gpu_graphs.clear()
    with _gpu_graphs.emulated():
        yield _gpu_graphs
    _gpu_graphs.clear()


@pytest.mark.parametrize("cell, opts, proj, training", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_chunked_loops_match_the_float64_reference(cell, opts, proj, training, chunked):
    """Every option set, both directions, projection, lengths (one layer: the layers' loops are
    independent; two share a key in test_a_plain_call_is_served_only_where_its_loops_replay): the
    chunks captured and replayed (3 times per loop), equal to the reference (later calls: the
    tests below)."""
    engine, reference = ENGINES[cell]
    layers = _parameters(cell, opts, proj, layers=1)
    x, hx = _inputs(cell, proj, layers=1)
    masks = _masks(cell, proj, layers=1) if training else None
    want = _run(reference, x, hx, layers, LENGTHS, opts, training, masks)
    _assert_same(_run(engine, x, hx, layers, LENGTHS, opts, training, masks), want, 1e-10)
    # the forward's and the backward's chunk, replayed 3 times each
    assert chunked.stats["captures"] == 2 and chunked.stats["replays"] == 3 * 2
    assert all(not e.busy for es in chunked._entries.values() for e in es)  # given back after the backward


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_a_chunk_longer_than_t(cell, chunked, monkeypatch):
    monkeypatch.setattr(chunked, "CHUNK", 8)
    opts = CellOptions.make(layer_norm=True, zoneout=(0.1, 0.2) if cell == "LSTM" else None)
    engine, reference = ENGINES[cell]
    layers = _parameters(cell, opts, None, layers=1)
    x, hx = _inputs(cell, None, layers=1)
    want = _run(reference, x, hx, layers, LENGTHS, opts)
    _assert_same(_run(engine, x, hx, layers, LENGTHS, opts), want, 1e-10)
    assert chunked.stats["replays"] == 2  # one replay per loop


@pytest.mark.parametrize("cell, proj", [("LSTM", 3), ("GRU", None)])
def test_distinct_t_replay_the_same_captures(cell, proj, chunked):
    """T = 5, 3, 4, 5 (with lengths, without, equal lengths shorter than T): one capture per
    loop, made by the first call, then replays only; every call equal to the reference (so the
    parameter gradients' per-row sums start from zero at every replay). Those sums are (D, B, X):
    no buffer of the entry that holds them has a time dimension."""
    opts = CellOptions.make(layer_norm=True, peephole=True, cell_clip=0.5) if cell == "LSTM" else \
        CellOptions.make(layer_norm=True, zoneout=(0.2, 0.0))
    engine, reference = ENGINES[cell]
    layers = _parameters(cell, opts, proj, layers=1)
    x, hx = _inputs(cell, proj, layers=1)
    for steps, lengths in ((5, LENGTHS), (3, torch.tensor([2, 3, 1])), (4, None), (5, torch.tensor([4, 4, 4]))):
        want = _run(reference, x[:steps], hx, layers, lengths, opts)
        _assert_same(_run(engine, x[:steps], hx, layers, lengths, opts), want, 1e-10)
    assert chunked.stats["captures"] == 2 and chunked.stats["grown"] == 0
    entries = [e for es in chunked._entries.values() for e in es]
    assert len(entries) == 1 and entries[0].capacity == 6
    gates = (4 if cell == "LSTM" else 3) * H
    sums = {"pgx": gates, "pb": gates, "pgh": gates, **({"pgc": H, "pbc": H, "ppeep": 3 * H} if cell == "LSTM" else
                                                       {"dhb": gates})}
    assert {k: tuple(entries[0].buffers[k].shape) for k in sums} == {k: (D, B, n) for k, n in sums.items()}


def test_steps_after_the_longest_sequence_are_not_run(chunked):
    """Lengths [3, 2, 3] in T = 5: the loops run 3 steps (2 replays of 2 steps each way), the
    output's last two rows are zeros, and all equals the reference."""
    opts = CellOptions.make(layer_norm=True)
    layers = _parameters("GRU", opts, None, layers=1)
    x, hx = _inputs("GRU", None, layers=1)
    lengths = torch.tensor([3, 2, 3])
    want = _run(gru_reference, x, hx, layers, lengths, opts)
    got = _run(gru_engine_gpu, x, hx, layers, lengths, opts)
    _assert_same(got, want, 1e-10)
    assert chunked.stats["replays"] == 4 and not got[0][0][3:].any()


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_a_plain_call_is_served_only_where_its_loops_replay(cell, chunked):
    """rnn._gpu.replays (the dispatch of plain calls on CUDA): False for a call whose loops
    are not captured yet, which it captures (forward and backward, no step run); True for the same
    configuration up to that T, whose engine call then only replays; False again for a longer T;
    the engine's results equal torch.nn's."""
    from fastlayers.rnn._gpu import replays

    torch.manual_seed(0)
    ours, ref = make_pair(cell, F, H, dtype=torch.float64, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, F, dtype=torch.float64, requires_grad=True)
    assert not replays(ours, x)
    captured = chunked.stats["captures"]
    assert captured == 2 * 2 and chunked.stats["replays"] == 0  # 2 layers, forward and backward
    assert replays(ours, x) and replays(ours, x[:3])
    engine = lstm_engine_gpu if cell == "LSTM" else gru_engine_gpu
    states = tuple(torch.zeros(4, B, H, dtype=torch.float64) for _ in range(2 if cell == "LSTM" else 1))

    def fastlayers_engine(x, h):
        out, final = engine(x, states, ours._layer_parameters(), LENGTHS, ours.options)
        return out, (final if len(final) == 2 else final[0])

    got = run_and_grad(fastlayers_engine, ours, x.detach(), None)
    want = run_and_grad(lambda x, h: torch_packed(ref, x, h, LENGTHS), ref, x.detach(), None)
    assert_close_all(got, want, atol=1e-10, rtol=1e-10)
    assert chunked.stats["captures"] == captured and chunked.stats["replays"] > 0
    assert not replays(ours, torch.randn(20, B, F, dtype=torch.float64))  # longer than the buffers: captures
    assert replays(ours, torch.randn(20, B, F, dtype=torch.float64))


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_small_calls_run_eagerly(cell, chunked, monkeypatch):
    """Loops of at most _gpu_graphs.EAGER_STEPS steps run eagerly where capture is on: no capture, no
    replay, results equal to the float64 reference, and each call's results its own (an eager
    call returns its buffers, not copies); a plain call that short is torch's (replays() is
    False and captures nothing)."""
    from fastlayers.rnn._gpu import replays

    monkeypatch.setattr(chunked, "EAGER_STEPS", 4)
    opts = CellOptions.make(layer_norm=True)
    engine, reference = ENGINES[cell]
    layers = _parameters(cell, opts, None, layers=1)
    x, hx = _inputs(cell, None, layers=1)
    lengths = torch.tensor([3, 4, 1])
    want = _run(reference, x[:4], hx, layers, lengths, opts)
    got = _run(engine, x[:4], hx, layers, lengths, opts)
    _assert_same(got, want, 1e-10)
    again = _run(engine, x[:4] + 1, hx, layers, lengths, opts)
    _assert_same(got, want, 1e-10)
    assert not torch.equal(again[0][0], got[0][0])
    assert chunked.stats["captures"] == 0 and chunked.stats["replays"] == 0
    ours, _ = make_pair(cell, F, H, dtype=torch.float64)
    assert not replays(ours, torch.randn(4, B, F, dtype=torch.float64))
    assert chunked.stats["captures"] == 0



CELL_OPTIONS = [
    ("LSTM", dict(layer_norm=True)),
    ("LSTM", dict(peephole=True, cell_clip=0.3, zoneout=(0.2, 0.3))),
    ("LSTM", dict(proj_size=3, proj_clip=0.2, layer_norm=True, peephole=True, zoneout=(0.1, 0.2))),
    ("LSTM", dict(layer_norm=True, peephole=True, cell_clip=0.2, zoneout=(0.3, 0.1), recurrent_dropout=0.2)),
    ("GRU", dict(layer_norm=True)),
    ("GRU", dict(layer_norm=True, zoneout=0.3, recurrent_dropout=0.3)),
]


@pytest.mark.each_triton
@pytest.mark.parametrize("mode,opts", CELL_OPTIONS)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_cells_with_options_on_the_step_kernels_equal_the_equations(mode, opts, training, monkeypatch):
    """LSTMCell / GRUCell with options and the backend "triton": one step on the layers' step
    kernels (rnn/_gpu_cell.py), equal to the per-step equations (backend "reference") in the new
    states and the gradients of the input, both states and every parameter; training zoneout
    draws the same masks from the same seed; a recurrent mask; bias on and off."""
    from fastlayers.rnn import _gpu_cell

    calls = []
    original = _gpu_cell.step
    monkeypatch.setattr(_gpu_cell, "step", lambda *a, **k: calls.append(1) or original(*a, **k))
    for bias in (True, False):
        torch.manual_seed(0)
        cell = getattr(fastlayers, mode + "Cell")(F, H, bias=bias, **opts).double().train(training)
        with torch.no_grad():  # LayerNorm gains and biases off their initial 1 / 0
            for p in cell.parameters():
                p.add_(0.1 * torch.randn_like(p))
        size = opts.get("proj_size", 0) or H
        x = torch.randn(B, F, dtype=torch.float64, requires_grad=True)
        states = [torch.randn(B, size, dtype=torch.float64, requires_grad=True)]
        if mode == "LSTM":
            states.append(torch.randn(B, H, dtype=torch.float64, requires_grad=True))
        hx = tuple(states) if mode == "LSTM" else states[0]
        mask = cell.recurrent_mask(B)
        assert (mask is not None) == (training and "recurrent_dropout" in opts)
        results = []
        for backend in ("triton", "reference"):
            with fastlayers.backend(backend):
                torch.manual_seed(5)
                out = cell(x, hx, recurrent_mask=mask)
            outs = out if isinstance(out, tuple) else (out,)
            loss = sum((s * torch.linspace(-1, 1, s.numel(), dtype=s.dtype).view_as(s)).sum() for s in outs)
            results.append([*outs, *torch.autograd.grad(loss, [x, *states, *cell.parameters()])])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert len(calls) == 2


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_cells_on_the_step_kernels_differentiate_twice_and_serve_no_grad_calls(mode):
    """gradcheck and gradgradcheck of a cell with options on the step kernels (a recorded backward
    differentiates the equations); without autograd, float32, the same states as the equations."""
    from torch.autograd import gradcheck, gradgradcheck

    torch.manual_seed(0)
    opts = dict(layer_norm=True, peephole=True, cell_clip=0.5, proj_size=2, zoneout=(0.2, 0.1)) if mode == "LSTM" \
        else dict(layer_norm=True, zoneout=0.2)
    cell = getattr(fastlayers, mode + "Cell")(3, 4, **opts).double().eval()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = cell.weight_hh.detach().clone().requires_grad_(True)
    fn = lambda x, w: torch.func.functional_call(cell, {"weight_hh": w}, (x,))  # noqa: E731
    with fastlayers.backend("triton"):
        assert gradcheck(fn, (x, w), fast_mode=True) and gradgradcheck(fn, (x, w), fast_mode=True)
    cell = cell.float()
    x = torch.randn(2, 3)
    with torch.no_grad():
        with fastlayers.backend("triton"):
            got = cell(x)
        with fastlayers.backend("reference"):
            want = cell(x)
    for a, b in zip(got if mode == "LSTM" else (got,), want if mode == "LSTM" else (want,)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- the varlen form (issue 66): the engine on the value rows (N, F), every buffer sized by N

def _varlen_run(fn, plan, values, hx, layers, opts, training=False, masks=None, padded=False, twice=False):
    """Outputs and gradients (of values, hx, every parameter) of a random linear function of the
    varlen results; ``padded``: the same call through the padded engine with lengths (values padded
    and the output unpadded with index ops, masks (D, N, X) padded per direction); ``twice``: the
    gradients of the gradients' weighted sum too (create_graph)."""
    from fastlayers._core import jagged

    values = values.clone().requires_grad_()
    hx = tuple(h.clone().requires_grad_() for h in hx)
    layers = [[{k: v.clone().requires_grad_() for k, v in p.items()} for p in d] for d in layers]
    if padded:
        if masks is not None:
            masks = [{k: torch.stack([jagged.pad(v, plan, batch_first=False) for v in m[k]]) if k.startswith("zoneout")
                      else m[k] for k in m} for m in masks]
        y, final = fn(jagged.pad(values, plan, batch_first=False), hx, layers, plan.lengths, opts, training=training,
                      masks=masks)
        y = jagged.unpad(y, plan)
    else:
        y, final = fn(values, hx, layers, plan.lengths, opts, training=training, masks=masks, varlen=plan)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in (y, *final))
    leaves = [values, *hx, *(p[k] for d in layers for p in d for k in sorted(p))]
    grads = torch.autograd.grad(loss, leaves, create_graph=twice)
    if twice:
        total = sum((gr * torch.randn(gr.shape, generator=g, dtype=gr.dtype)).sum() for gr in grads)
        grads = grads + torch.autograd.grad(total, leaves)
    return [y.detach(), *(f.detach() for f in final)], [gr.detach() for gr in grads]


def _varlen_case(cell, proj, training, lengths=LENGTHS, layers=1):
    """(plan, values (N, F), hx, masks on the value rows (D, N, X) or None) for ``lengths``."""
    from fastlayers._core import jagged

    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    plan = jagged.varlen(cu, int(cu[-1]), torch.device("cpu"), batch_first=False)
    x, hx = _inputs(cell, proj, layers=layers)
    values = jagged.unpad(x[:plan.steps], plan)
    masks = None
    if training:
        masks = [{k: torch.stack([jagged.unpad(v[:plan.steps], plan) for v in m[k]]) if k.startswith("zoneout")
                  else m[k] for k in m} for m in _masks(cell, proj, layers=layers)]
    return plan, values, hx, masks


VARLEN_CASES = [(1, L), (2, 1), (3, 1), (6, 1)]  # (CASES index, layers): every kernel path of the varlen layout


@pytest.mark.parametrize("case, layers", VARLEN_CASES, ids=[f"{CASES[c][0]}-{c}-{n}layer" for c, n in VARLEN_CASES])
def test_varlen_engine_equals_the_padded_engine(case, layers):
    """The engine on the value rows (varlen) gives the padded call with lengths' outputs, final
    states and every gradient (float64, 1e-12), both directions, hx, a sequence of length 1 and
    the longest one in the middle of the batch, for the option sets that take every path of the
    varlen kernels: LayerNorm, peepholes and cell clip (the cell state before a step read from
    the step before's row) over two layers; projection with proj_clip, zoneout and recurrent
    dropout in training (the masks passed in, on the value rows); eval-mode zoneout with a
    projection (the saved cell history); the LayerNorm GRU in training."""
    cell, opts, proj, training = CASES[case]
    engine, _ = ENGINES[cell]
    params = _parameters(cell, opts, proj, layers=layers)
    plan, values, hx, masks = _varlen_case(cell, proj, training, layers=layers)
    got = _varlen_run(engine, plan, values, hx, params, opts, training, masks)
    want = _varlen_run(engine, plan, values, hx, params, opts, training, masks, padded=True)
    assert got[0][0].shape == (int(LENGTHS.sum()), D * (proj or H))
    _assert_same(got, want, 1e-12)


def test_varlen_engine_differentiates_twice():
    """create_graph through the varlen layer (LSTM and GRU share the code): its backward is the
    padded reference's, between pad and unpad; the second derivatives equal the padded engine's."""
    cell, opts, proj = "LSTM", CellOptions.make(layer_norm=True, peephole=True), 3
    engine, _ = ENGINES[cell]
    layers = _parameters(cell, opts, proj, layers=1)
    plan, values, hx, _ = _varlen_case(cell, proj, False)
    got = _varlen_run(engine, plan, values, hx, layers, opts, twice=True)
    want = _varlen_run(engine, plan, values, hx, layers, opts, padded=True, twice=True)
    _assert_same(got, want, 1e-12)


def test_varlen_buffers_hold_value_rows_and_replay_for_any_lengths(chunked):
    """Captured (emulated) varlen loops (the LSTM with a projection; the GRU's share the driver):
    every buffer of the entry with a time dimension holds value rows, (D, rows, X) or (rows, D, X),
    with no batch dimension (memory follows N, not T x B), its capacity counts rows; a batch of other
    lengths (other N and T) replays the same captures; both equal the padded engine."""
    cell, proj = "LSTM", 3
    opts = CellOptions.make(layer_norm=True, peephole=True, cell_clip=0.5)
    engine, _ = ENGINES[cell]
    layers = _parameters(cell, opts, proj, layers=1)
    for lengths in (LENGTHS, torch.tensor([2, 1, 2])):
        plan, values, hx, _ = _varlen_case(cell, proj, False, lengths)
        got = _varlen_run(engine, plan, values, hx, layers, opts)
        with pytest.MonkeyPatch.context() as mp:  # the padded engine eagerly: no entry of its own
            mp.setenv("FASTLAYERS_CUDA_GRAPHS", "0")
            want = _varlen_run(engine, plan, values, hx, layers, opts, padded=True)
        _assert_same(got, want, 1e-12)
    assert chunked.stats["captures"] == 2 and chunked.stats["grown"] == 0
    entries = [e for es in chunked._entries.values() for e in es]
    assert len(entries) == 1 and entries[0].capacity == 10  # 9 rows, rounded up to the chunk (2)
    gates = 4 * H
    timed = {"xp": (10, D, gates), "dpre": (10, D, gates), "y": (10, D, proj or H), "gates": (D, 10, gates),
             "dr": (D, 10, gates), "hd": (D, 10, proj or H), "rhat": (D, 10, gates), "rrstd": (D, 10)}
    assert {k: tuple(entries[0].buffers[k].shape) for k in timed} == timed


def test_module_varlen_runs_the_engine_on_value_rows():
    """A module with cell options and the Triton backend forced: the varlen call runs the engine's
    layer on the value rows (no padded tensor), equal to the padded call with lengths."""
    torch.manual_seed(0)
    lengths, cu = [3, 1, 5], torch.tensor([0, 3, 4, 9])
    layer = fastlayers.LSTM(3, 4, bidirectional=True, layer_norm=True, dtype=torch.float64)
    x = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    padded = torch.nn.utils.rnn.pad_sequence(list(x.detach().split(lengths))).requires_grad_()
    with fastlayers.backend("triton"):
        y, (h, c) = layer(x, cu_seqlens=cu)
        y_pad, (h_pad, c_pad) = layer(padded, lengths=torch.tensor(lengths))
    assert type(y.grad_fn).__name__ == "LSTMLayerBackward"
    want = torch.cat([y_pad[:n, b] for b, n in enumerate(lengths)])
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h_pad, rtol=0, atol=1e-12)
    torch.testing.assert_close(c, c_pad, rtol=0, atol=1e-12)
    g, = torch.autograd.grad(y.square().sum(), x)
    g_pad, = torch.autograd.grad(want.square().sum(), padded)
    torch.testing.assert_close(g, torch.cat([g_pad[:n, b] for b, n in enumerate(lengths)]), rtol=0, atol=1e-12)


def test_module_varlen_in_training_draws_the_padded_calls_masks():
    """Zoneout and recurrent dropout in training on the Triton engine: the same seed gives the
    varlen call the padded call's masks (drawn (D, T, B, width), kept on the value rows; the GRU's
    through the same code), so the same outputs."""
    mode = "LSTM"
    lengths, cu = [3, 1, 5], torch.tensor([0, 3, 4, 9])
    layer = getattr(fastlayers, mode)(3, 4, bidirectional=True, layer_norm=True, zoneout=0.3, recurrent_dropout=0.2,
                                      dtype=torch.float64)
    x = torch.randn(9, 3, dtype=torch.float64)
    padded = torch.nn.utils.rnn.pad_sequence(list(x.split(lengths)))
    with fastlayers.backend("triton"):
        torch.manual_seed(3)
        y, _ = layer(x, cu_seqlens=cu)
        torch.manual_seed(3)
        y_pad, _ = layer(padded, lengths=torch.tensor(lengths))
    assert type(y.grad_fn).__name__ == f"{mode}LayerBackward"
    torch.testing.assert_close(y, torch.cat([y_pad[:n, b] for b, n in enumerate(lengths)]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_float32_engine_keeps_its_relative_accuracy_near_zero(cell):
    """Activations of about 1e-6: the step kernels' float32 tanh, 1 - 2 / (e^{2v} + 1), had an error
    of one ulp of 1 there (7e-8), 20% of LSTM outputs that small; torch.tanh's is relative."""
    opts = CellOptions()
    engine, reference = ENGINES[cell]
    layers = [[{k: v * 1e-5 for k, v in p.items()} for p in d] for d in _parameters(cell, opts, None)]
    x, hx = _inputs(cell, None)
    hx = tuple(h * 1e-6 for h in hx)
    want = reference(x, hx, layers, LENGTHS, opts)[0]
    f32 = [[{k: v.float() for k, v in p.items()} for p in d] for d in layers]
    got = engine(x.float(), tuple(h.float() for h in hx), f32, LENGTHS, opts)[0]
    assert 1e-7 < want.abs().max() < 1e-5
    assert (got.double() - want).abs().max() / want.abs().max() < 1e-6


def test_a_cell_row_clipped_whole_normalises_to_zero_on_the_triton_engine():
    """The C engine's constant-row case (test_rnn_options.py) on the Triton engine, whose LayerNorm
    mean (sum / n) left the same residue: outputs 0.70 away from the reference's in float64 after
    three layers. Its statistics are the C engine's corrected two-pass ones now."""
    torch.manual_seed(469401)
    m = fastlayers.LSTM(10, 3, num_layers=3, bias=False, dtype=torch.float64, layer_norm=True, cell_clip=0.1).eval()
    x = torch.randn(8, 11, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(469402))
    if torch.cuda.is_available():
        m, x = m.cuda(), x.cuda()
    with fastlayers.backend("reference"), torch.no_grad():
        want, (h_want, _) = m(x, lengths=[8] * 11)
    x.requires_grad_()
    with fastlayers.backend("triton"), on_the_triton_engine():
        got, (h_got, _) = m(x, lengths=[8] * 11)
    assert torch.equal(h_want[0, 8], torch.zeros_like(h_want[0, 8]))  # (the saturated row)
    assert torch.equal(h_got[0, 8].detach(), h_want[0, 8])
    torch.testing.assert_close(got.detach(), want, rtol=1e-9, atol=1e-9)


@pytest.mark.each_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's patching (no GPU run)")
def test_the_test_suites_interpreter_patching_changes_no_result(monkeypatch):
    """tests/triton_interpreter.py (the language patched once per launch, not again in every helper
    call) installed by conftest.py: a layer with every option, trained one step, gives the same
    outputs and gradients bit for bit as under Triton's own patching, in this Triton."""
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "once_per_launch", False)

    def run():
        torch.manual_seed(0)
        m = fastlayers.LSTM(F, H, num_layers=2, bidirectional=True, proj_size=3, layer_norm=True, peephole=True,
                            cell_clip=1.5, zoneout=0.1, recurrent_dropout=0.2).train()
        x = torch.randn(T, B, F, requires_grad=True)
        with fastlayers.backend("triton"), on_the_triton_engine():
            out, (h, c) = m(x, lengths=LENGTHS)
        loss = weighted_sum([out, h, c])
        return [out, h, c, *torch.autograd.grad(loss, [x, *m.parameters()])]

    patched_once = run()
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.original)
    for a, b in zip(patched_once, run(), strict=True):
        assert torch.equal(a, b)
