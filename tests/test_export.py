"""torch.export of every layer: dynamic batch and time (and lengths as data), the exported program
equal to eager at shapes other than the export's, in value and gradient (the operators' opcheck and
second derivatives: test_compile.py). Every test runs in torch.export's default non-strict mode and with
``strict=True`` (Dynamo's tracing: the recurrent layers' export stopped at the operator library's
loader, ``Unsupported context manager``)."""

from __future__ import annotations

import contextlib
import pytest
import torch
from torch.export import Dim
from torch.utils._pytree import tree_leaves

import fastlayers
from rnn_helpers import CallAsUser

pytestmark = pytest.mark.compile  # (see pyproject's markers: tracing, no kernel path of its own)


@pytest.fixture(autouse=True, params=[False, True], ids=["nonstrict", "strict"])
def strict(request, monkeypatch):
    """torch.export.export in this module's tests: in the default non-strict mode, then strict."""
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *args, **kwargs: export(*args, strict=request.param, **kwargs))
    return request.param


def _parameters(module) -> list[torch.Tensor]:
    """The parameters by name, in the eager module's order (a strict export lists them as used)."""
    named = dict(module.named_parameters())
    return [named[k] for k in sorted(named)]

B, T = Dim("B"), Dim("T")
SHAPES = [(3, 9), (6, 2), (1, 12)]  # (batch, time), none of them the export's (4, 7)

LSTM = {
    "plain": {}, "layer_norm": dict(layer_norm=True), "peephole": dict(peephole=True), "cell_clip": dict(cell_clip=0.3),
    "zoneout": dict(zoneout=(0.2, 0.4)), "recurrent_dropout": dict(recurrent_dropout=0.3),
    "proj_clip": dict(proj_size=3, proj_clip=0.2),
    "all + proj": dict(layer_norm=True, peephole=True, cell_clip=0.5, zoneout=(0.1, 0.3), recurrent_dropout=0.2,
                       proj_size=3, proj_clip=0.3),
}
GRU = {"plain": {}, "layer_norm": dict(layer_norm=True), "zoneout": dict(zoneout=0.3),
       "all": dict(layer_norm=True, zoneout=0.2, recurrent_dropout=0.2)}
RNN = {"tanh": {}, "relu": dict(nonlinearity="relu")}
CASES = [("LSTM", k) for k in LSTM] + [("GRU", k) for k in GRU] + [("RNN", k) for k in RNN]


def _build(mode, name, batch_first, layers=2, bidirectional=True, dtype=torch.float32):
    kwargs = {"LSTM": LSTM, "GRU": GRU, "RNN": RNN}[mode][name]
    torch.manual_seed(0)
    return getattr(fastlayers, mode)(5, 6, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                                     dtype=dtype, **kwargs).eval()


def _inputs(layer, batch, steps, dtype, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, steps, 5) if layer.batch_first else (steps, batch, 5)
    x = torch.randn(shape, generator=g, dtype=dtype)
    lengths = torch.randint(1, steps + 1, (batch,), generator=g)
    lengths[0] = steps
    states = 2 * layer.num_layers if layer.bidirectional else layer.num_layers
    h0 = torch.randn(states, batch, getattr(layer, "proj_size", 0) or 6, generator=g, dtype=dtype)
    c0 = torch.randn(states, batch, 6, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) if t.is_floating_point() else t for t in (x, lengths, h0, c0)]


def _export(model, dtype):
    time_dim = 1 if model.layer.batch_first else 0
    dynamic = ({time_dim: T, 1 - time_dim: B}, {0: B}, {1: B}, {1: B})
    return torch.export.export(model, tuple(_inputs(model.layer, 4, 7, dtype, 0)), dynamic_shapes=dynamic)


@pytest.mark.parametrize("mode,name", CASES)
@pytest.mark.parametrize("lengths,hx", [(True, True), (False, False), (True, False)])
def test_exported_equals_eager(mode, name, lengths, hx):
    batch_first = (CASES.index((mode, name)) + lengths) % 2 == 0  # both layouts over the cases, the same each run
    model = CallAsUser(_build(mode, name, batch_first), lengths, hx)
    exported = _export(model, torch.float32).module()
    for i, (batch, steps) in enumerate(SHAPES):
        args = _inputs(model.layer, batch, steps, torch.float32, i + 1)
        got, want = exported(*args), model(*args)
        for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,name", [("LSTM", "plain"), ("LSTM", "all + proj"), ("GRU", "all"), ("RNN", "relu")])
def test_exported_gradients_equal_eager(mode, name):
    """The exported program trains: its gradients (the operators' autograd) equal those of the
    plain-PyTorch reference backend's autograd in eager (float64): an oracle the program does not share."""
    model = CallAsUser(_build(mode, name, False, dtype=torch.float64), True, True)
    exported = _export(model, torch.float64).module()
    for i, (batch, steps) in enumerate(SHAPES):
        grads = []
        for module, backend in ((exported, None), (model, "reference")):
            args = _inputs(model.layer, batch, steps, torch.float64, i + 1, grad=True)
            with fastlayers.backend(backend) if backend else contextlib.nullcontext():
                outs = tree_leaves(module(*args))
            leaves = [args[0], args[2], args[3]] + _parameters(module)
            torch.manual_seed(5)
            loss = sum((o * torch.randn_like(o)).sum() for o in outs)
            grads.append(torch.autograd.grad(loss, leaves, allow_unused=True))
        for a, b in zip(*grads):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_unbatched_and_single_direction():
    layer = _build("LSTM", "layer_norm", False, layers=1, bidirectional=False)
    x = torch.randn(7, 5)
    ep = torch.export.export(layer, (x,), dynamic_shapes={"input": {0: T}})
    for steps in (3, 11):
        x = torch.randn(steps, 5)
        for a, b in zip(tree_leaves(ep.module()(x)), tree_leaves(layer(x))):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_training_mode_export_draws_masks_and_trains():
    layer = _build("LSTM", "all + proj", True).train()
    model = CallAsUser(layer, True, False)
    exported = _export(model, torch.float32).module()  # (captured in training mode: masks drawn in the graph)
    args = _inputs(layer, 3, 9, torch.float32, 1, grad=True)
    out, (h, c) = exported(*args)
    (out.sum() + h.sum()).backward()
    assert torch.isfinite(out).all() and args[0].grad is not None and bool(args[0].grad.abs().sum() > 0)
    targets = [n for n, _ in exported.named_parameters()]
    assert all(p.grad is not None for p in exported.parameters()), targets
    plain = [a.detach() for a in args]  # the masks: drawn at each call, from torch's generator
    torch.manual_seed(3)
    first = exported(*plain)[0]
    torch.manual_seed(3)
    assert torch.equal(exported(*plain)[0], first)  # the same seed, the same masks
    assert not torch.equal(exported(*plain)[0], first)  # the next draw, others
    layer.eval()
    assert not torch.equal(_export(model, torch.float32).module()(*plain)[0], first)  # eval: the expectation


@pytest.mark.parametrize("build,args,dynamic,others", [
    (lambda: fastlayers.LSTMCell(4, 5, layer_norm=True, proj_size=3).eval(), (torch.randn(3, 4),), ({0: B},),
     [(torch.randn(6, 4),), (torch.randn(1, 4),)]),
    (lambda: fastlayers.GRUCell(4, 5, zoneout=0.2).eval(), (torch.randn(3, 4),), ({0: B},), [(torch.randn(6, 4),)]),
    (lambda: fastlayers.RNNCell(4, 5), (torch.randn(3, 4),), ({0: B},), [(torch.randn(6, 4),)]),
    (lambda: fastlayers.LocallyConnected2d(2, 3, (6, 6), 3, padding=1), (torch.randn(2, 2, 6, 6),), ({0: B},),
     [(torch.randn(5, 2, 6, 6),), (torch.randn(1, 2, 6, 6),)]),
    (lambda: fastlayers.LocallyConnected1d(2, 3, 6, 3), (torch.randn(2, 2, 6),), ({0: B},), [(torch.randn(5, 2, 6),)]),
    (lambda: fastlayers.AttentionPooling(4, score="additive"), (torch.randn(3, 4), torch.randn(3, 7, 4)),
     ({0: B}, {0: B, 1: T}), [(torch.randn(5, 4), torch.randn(5, 9, 4)), (torch.randn(1, 4), torch.randn(1, 2, 4))]),
])
def test_cells_local_and_attention_export(build, args, dynamic, others):
    torch.manual_seed(0)
    module = build()
    ep = torch.export.export(module, args, dynamic_shapes=dynamic)
    for other in others:
        for a, b in zip(tree_leaves(ep.module()(*other)), tree_leaves(module(*other))):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_attention_pooling_with_lengths_exports():
    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = fastlayers.AttentionPooling(4)

        def forward(self, q, k, lengths):
            return self.pool(q, k, lengths=lengths)

    module = Pool()
    ep = torch.export.export(module, (torch.randn(3, 4), torch.randn(3, 7, 4), torch.tensor([7, 2, 5])),
                             dynamic_shapes=({0: B}, {0: B, 1: T}, {0: B}))
    q, k, lengths = torch.randn(5, 4), torch.randn(5, 9, 4), torch.tensor([9, 1, 3, 4, 2])
    torch.testing.assert_close(ep.module()(q, k, lengths), module(q, k, lengths), rtol=1e-6, atol=1e-6)


class _Varlen(torch.nn.Module):
    """A recurrent layer's varlen call (issue 66): (values (N, F), cu_seqlens (B+1,), h_0 [, c_0])."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, cu_seqlens, h0, c0=None):
        return self.layer(x, (h0, c0) if c0 is not None else h0, cu_seqlens=cu_seqlens)


def _varlen_inputs(layer, lengths, dtype, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), 5, generator=g, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    states = 2 * layer.num_layers if layer.bidirectional else layer.num_layers
    hx = [torch.randn(states, len(lengths), getattr(layer, "proj_size", 0) or 6, generator=g, dtype=dtype)]
    if isinstance(layer, fastlayers.LSTM):
        hx.append(torch.randn(states, len(lengths), 6, generator=g, dtype=dtype))
    return [x.requires_grad_(grad), cu, *(h.requires_grad_(grad) for h in hx)]


@pytest.mark.parametrize("mode,name", [("LSTM", "all + proj"), ("GRU", "all"), ("RNN", "relu")])
def test_varlen_export_keeps_the_total_length_and_batch_dynamic(mode, name):
    """The varlen form exports (one operator per layer: lengths are data, N and B dynamic, B + 1 the
    length of cu_seqlens); the program equals eager in value and gradient (float64) at other lengths."""
    model = _Varlen(_build(mode, name, False, dtype=torch.float64))
    n, b = Dim("N"), Dim("Bv")
    args = _varlen_inputs(model.layer, [4, 7, 2], torch.float64, 0)
    dynamic = ({0: n}, {0: b + 1}, *[{1: b}] * len(args[2:]))
    exported = torch.export.export(model, tuple(args), dynamic_shapes=dynamic).module()
    for i, lengths in enumerate(([3, 9, 1, 5], [2, 6], [8, 1, 1, 4, 2, 7])):
        grads = []
        for module, backend in ((exported, None), (model, "reference")):  # (an oracle it does not share)
            a = _varlen_inputs(model.layer, lengths, torch.float64, i + 1, grad=True)
            with fastlayers.backend(backend) if backend else contextlib.nullcontext():
                outs = tree_leaves(module(*a))
            assert outs[0].shape == (sum(lengths), 6 if mode == "LSTM" else 12)  # (proj_size 3 with LSTM)
            leaves = [a[0], *a[2:], *_parameters(module)]
            torch.manual_seed(5)
            loss = sum((o * torch.randn_like(o)).sum() for o in outs)
            grads.append((outs, torch.autograd.grad(loss, leaves, allow_unused=True)))
        (got, got_grads), (want, want_grads) = grads
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
        for x, y in zip(got_grads, want_grads, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


def test_attention_pool_varlen_exports_with_n_and_b_dynamic():
    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = fastlayers.AttentionPooling(4, score="additive")

        def forward(self, q, k, cu_seqlens):
            return self.pool(q, k, cu_seqlens=cu_seqlens)

    torch.manual_seed(0)
    model = Pool()
    b = Dim("Bv")
    example = (torch.randn(3, 4), torch.randn(9, 4), torch.tensor([0, 2, 7, 9]))
    ep = torch.export.export(model, example, dynamic_shapes=({0: b}, {0: Dim("N")}, {0: b + 1}))
    for lengths in ([4, 1, 6, 2], [5, 3]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        args = (torch.randn(len(lengths), 4), torch.randn(sum(lengths), 4), cu)
        for a, w in zip(ep.module()(*args), model(*args), strict=True):
            torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-6)


    for bad in ([0, 2, 2, 9], [0, 7, 2, 9], [1, 2, 7, 9], [0, 2, 7, 8]):  # eager: ValueError for each
        with pytest.raises(RuntimeError, match=r"^cu_seqlens: "):  # (exported, they gave weights summing to 2 or 3)
            ep.module()(*example[:2], torch.tensor(bad))


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_exported_layers_under_autocast_return_the_low_dtype(mode):
    """A layer called under torch.autocast in the exported model: the operators ran in float32 and
    returned float32 where eager returns bfloat16 (the mixed-precision rule: operands rounded)."""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = _build(mode, "layer_norm", False)

        def forward(self, x, lengths):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.rnn(x, lengths=lengths)

    model = Model()
    ep = torch.export.export(model, (torch.randn(7, 4, 5), torch.tensor([7, 2, 5, 3])),
                             dynamic_shapes=({0: T, 1: B}, {0: B}))
    x, lengths = torch.randn(9, 3, 5), torch.tensor([4, 9, 1])
    got, want = tree_leaves(ep.module()(x, lengths)), tree_leaves(model(x, lengths))
    for a, w in zip(got, want, strict=True):
        assert a.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), w.float(), rtol=0.02, atol=0.02)  # (bf16: eager rounds h per step)


def test_exported_layer_refuses_t_0_and_names_no_symbol():
    """Eager raises torch's error for T = 0; the exported program returned h_0 (tracing takes a
    dynamic size as >= 2). Its lengths assertion named a symbol ("T = s81") for T."""
    model = _build("GRU", "plain", False)
    ep = torch.export.export(model, (torch.randn(7, 4, 5),), dynamic_shapes=({0: T, 1: B},))
    with pytest.raises(RuntimeError, match=r"^Expected sequence length to be larger than 0 in RNN$"):
        ep.module()(torch.randn(0, 2, 5))
    assert ep.module()(torch.randn(1, 2, 5))[0].shape == (1, 2, 12)
    lstm = _build("LSTM", "plain", False)
    ep = torch.export.export(lstm, (torch.randn(7, 4, 5),), {"lengths": torch.tensor([7, 2, 5, 3])},
                             dynamic_shapes={"input": {0: T, 1: B}, "lengths": {0: B}})
    with pytest.raises(RuntimeError, match=r"^lengths: every length must be <= T \(the padded time size\), got a "
                                           r"larger one$"):
        ep.module()(torch.randn(5, 2, 5), lengths=torch.tensor([9, 1]))
    with pytest.raises(RuntimeError, match=r"^Length of all samples has to be greater than 0, but found an element in "
                                           r"'lengths' that is <= 0; lengths: every length must be >= 1, got a "
                                           r"smaller one$"):
        ep.module()(torch.randn(5, 2, 5), lengths=torch.tensor([0, 1]))


@pytest.mark.subprocess
def test_a_fresh_process_exports_a_recurrent_layer_first(strict):
    """The first thing a process does is export (the operator library not loaded yet): strict export
    traced the loader's lock and failed ("Unsupported context manager"); the loader runs for real."""
    import subprocess
    import sys

    code = ("import torch, fastlayers\n"
            "m = fastlayers.LSTM(4, 5, layer_norm=True).eval()\n"
            "x = torch.randn(6, 2, 4)\n"
            f"ep = torch.export.export(m, (x,), strict={strict})\n"
            "torch.testing.assert_close(ep.module()(x)[0], m(x)[0])\n"
            "print('exported')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "exported", proc.stderr[-3000:]


@pytest.mark.subprocess
def test_a_saved_program_loads_in_a_fresh_process_as_documented(tmp_path):
    """torch.export.save, then torch.export.load in another process after the step docs/deploy.md
    gives (the operators loaded first): the loaded program computes the eager call's values, and
    trains (its gradients were None there: the step loaded the C++ operators without their
    autograd and fake functions, so run_decompositions / AOTInductor refused the program too)."""
    import subprocess
    import sys

    torch.manual_seed(0)
    m = fastlayers.LSTM(4, 5, layer_norm=True).eval()
    x, lengths = torch.randn(6, 3, 4), torch.tensor([6, 2, 4])
    torch.export.save(torch.export.export(m, (x,), {"lengths": lengths}), tmp_path / "m.pt2")
    leaf = x.clone().requires_grad_()
    want = m(leaf, lengths=lengths)[0]
    grad, = torch.autograd.grad(want.sum(), leaf)
    torch.save({"x": x, "lengths": lengths, "want": want.detach(), "grad": grad}, tmp_path / "io.pt")
    code = ("import sys, warnings, torch, fastlayers\n"
            "warnings.filterwarnings('error', message='.*autograd kernel was not registered')\n"
            "torch.ops.load_library(fastlayers.ops_library())\n"
            "ep = torch.export.load(sys.argv[1])\n"
            "io = torch.load(sys.argv[2])\n"
            "x = io['x'].clone().requires_grad_()\n"
            "out = ep.module()(x, lengths=io['lengths'])[0]\n"
            "torch.testing.assert_close(out, io['want'])\n"
            "out.sum().backward()\n"
            "torch.testing.assert_close(x.grad, io['grad'])\n"
            "ep.run_decompositions()\n"
            "print('loaded')\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.pt2"), str(tmp_path / "io.pt")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip() == "loaded", proc.stderr[-3000:]
