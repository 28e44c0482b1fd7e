"""ONNX export (fastlayers.onnx) run in ONNX Runtime against eager fastlayers: every recurrent layer and
cell option with dynamic batch and time, with and without lengths and hx, at shapes other than the
export's; the plain layers as ONNX's own LSTM / GRU / RNN, the options as a Scan; cells, locally
connected layers and attention pooling.

Equality: each output of ONNX Runtime against the eager call in float32 (torch.no_grad) has relative
error ||onnx - eager|| / ||eager|| <= 1e-5, the same shape, and exact zeros where eager's padded
steps are zero."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.export import Dim
from torch.utils._pytree import tree_leaves

import fastlayers
import fastlayers.onnx
from rnn_helpers import CallAsUser

ort = pytest.importorskip("onnxruntime")  # (make test installs them: the test extra)
onnx = pytest.importorskip("onnx")  # (onnxscript's dependency)
pytest.importorskip("onnxscript")

pytestmark = [
    pytest.mark.compile,  # (tracing, no kernel path of its own: the poisoned-memory pass leaves it out)
    # torch.onnx's note when one Dim names the batch of several inputs (as here: x, lengths, h0, c0)
    pytest.mark.filterwarnings("ignore:# The axis name:UserWarning"),
]

B, T = Dim("B"), Dim("T")
EXPORT = (4, 7)  # (batch, time) of the export; every run below uses other shapes
SHAPES = [(3, 9), (6, 2), (1, 12), (5, 1)]
RTOL = 1e-5

LSTM = {
    "plain": {}, "layer_norm": dict(layer_norm=True), "peephole": dict(peephole=True), "cell_clip": dict(cell_clip=0.3),
    "zoneout": dict(zoneout=(0.2, 0.4)), "recurrent_dropout": dict(recurrent_dropout=0.3),
    "proj": dict(proj_size=3), "proj_clip": dict(proj_size=3, proj_clip=0.2), "no bias": dict(bias=False),
    "all + proj": dict(layer_norm=True, peephole=True, cell_clip=0.5, zoneout=(0.1, 0.3), recurrent_dropout=0.2,
                       proj_size=3, proj_clip=0.3),
}
GRU = {"plain": {}, "layer_norm": dict(layer_norm=True), "zoneout": dict(zoneout=0.3),
       "all": dict(layer_norm=True, zoneout=0.2, recurrent_dropout=0.2), "no bias": dict(bias=False),
       "layer_norm, no bias": dict(layer_norm=True, bias=False)}
RNN = {"tanh": {}, "relu": dict(nonlinearity="relu"), "relu, no bias": dict(nonlinearity="relu", bias=False)}
OPTIONS = {"LSTM": LSTM, "GRU": GRU, "RNN": RNN}
# the layers without cell options (in eval mode: recurrent dropout is the identity) run ONNX's own operator
NATIVE = {("LSTM", "plain"), ("LSTM", "peephole"), ("LSTM", "recurrent_dropout"), ("LSTM", "no bias"), ("GRU", "plain"),
          ("GRU", "no bias"), ("RNN", "tanh"), ("RNN", "relu"), ("RNN", "relu, no bias")}


def _build(mode, name, batch_first, layers=2, bidirectional=True, dtype=torch.float32):
    torch.manual_seed(0)
    return getattr(fastlayers, mode)(5, 6, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                                     dtype=dtype, **OPTIONS[mode][name]).eval()


def _inputs(layer, batch, steps, seed, dtype=torch.float32):
    """x, lengths (one full length, one of 1 where B > 2, the rest random, in no order), h0, c0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, steps, 5) if layer.batch_first else (steps, batch, 5), generator=g, dtype=dtype)
    lengths = torch.randint(1, steps + 1, (batch,), generator=g)
    lengths[batch // 2] = steps
    if batch > 2:
        lengths[-1] = 1
    states = layer.num_layers * (2 if layer.bidirectional else 1)
    h0 = torch.randn(states, batch, getattr(layer, "proj_size", 0) or 6, generator=g, dtype=dtype)
    c0 = torch.randn(states, batch, 6, generator=g, dtype=dtype)
    return {"x": x, "lengths": lengths, "h0": h0, "c0": c0}


def _session(program):
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(program.model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _run(session, inputs: dict) -> list[np.ndarray]:
    """The session on the named inputs it takes (an input the model does not use is not one)."""
    return session.run(None, {i.name: inputs[i.name].numpy() for i in session.get_inputs()})


def _assert_equal(got: list[np.ndarray], want, what: str, rtol: float = RTOL, dtype=np.float32) -> None:
    want = [t.numpy() for t in tree_leaves(want)]
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype, (what, i, a.shape, b.shape, a.dtype)
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert err <= rtol, f"{what}: output {i}: relative error {err:.2e} > {rtol:.0e}"
        assert (a[b == 0] == 0).all(), f"{what}: output {i}: nonzero where eager's is zero (padding)"


def _ops(program) -> set[str]:
    return {node.op_type for node in program.model_proto.graph.node}


def _export_call(model, dtype=torch.float32, **options):
    time_dim = 1 if model.layer.batch_first else 0
    dynamic = {"x": {time_dim: T, 1 - time_dim: B}, "lengths": {0: B}, "h0": {1: B}, "c0": {1: B}}
    args = _inputs(model.layer, *EXPORT, 0, dtype)
    return fastlayers.onnx.export(model, (), kwargs=args, dynamic_shapes=dynamic, verbose=False, **options)


CASES = [(m, k) for m in OPTIONS for k in OPTIONS[m]]


@pytest.mark.parametrize("mode,name", CASES)
def test_layer_equals_eager(mode, name):
    """Each layer and option (bidirectional, 2 layers) with lengths and hx; batch_first in half the cases."""
    batch_first = CASES.index((mode, name)) % 2 == 1
    model = CallAsUser(_build(mode, name, batch_first), lengths=True, hx=True).eval()
    program = _export_call(model)
    onnx.checker.check_model(program.model_proto, full_check=True)  # a valid model, ONNX's shape inference included
    ops = _ops(program)
    if (mode, name) in NATIVE:
        assert mode in ops and "Scan" not in ops, ops
    else:
        assert "Scan" in ops and not ops & {"LSTM", "GRU", "RNN"}, ops
    session = _session(program)
    for i, (batch, steps) in enumerate(SHAPES):
        inputs = _inputs(model.layer, batch, steps, i + 1)
        with torch.no_grad():
            want = model(**inputs)
        _assert_equal(_run(session, inputs), want, f"{mode} {name} (B, T) = {(batch, steps)}")


@pytest.mark.parametrize("mode,name", [case for case in CASES if case not in NATIVE])
def test_scan_in_float64_equals_eager(mode, name):
    """The Scan's step is the layer's math: in float64 (ONNX Runtime's LSTM / GRU / RNN kernels are
    float32 only, its Scan ops are not) it equals eager to 1e-9 (the LayerNorms' epsilon is an ONNX
    float attribute: 1e-5 rounded to float32)."""
    model = CallAsUser(_build(mode, name, False, dtype=torch.float64), lengths=True, hx=True).eval()
    session = _session(_export_call(model, torch.float64))
    for i, (batch, steps) in enumerate(SHAPES[:2]):
        inputs = _inputs(model.layer, batch, steps, i + 1, torch.float64)
        with torch.no_grad():
            want = model(**inputs)
        _assert_equal(_run(session, inputs), want, f"{mode} {name} float64", rtol=1e-9, dtype=np.float64)


@pytest.mark.parametrize("mode,name,lengths,hx,layers,bidirectional,batch_first", [
    ("LSTM", "plain", False, False, 2, True, False),
    ("LSTM", "plain", True, False, 1, False, True),
    ("LSTM", "all + proj", False, False, 2, True, True),
    ("LSTM", "all + proj", True, False, 1, False, False),
    ("LSTM", "layer_norm", False, True, 1, True, False),
    ("GRU", "plain", False, True, 1, False, False),
    ("GRU", "all", False, False, 2, True, False),
    ("GRU", "all", True, False, 1, False, True),
    ("RNN", "tanh", False, False, 2, True, True),
    ("RNN", "relu", True, False, 1, False, False),
])
def test_variants_equal_eager(mode, name, lengths, hx, layers, bidirectional, batch_first):
    """Without lengths and / or hx, one direction, one layer."""
    model = CallAsUser(_build(mode, name, batch_first, layers, bidirectional), lengths, hx).eval()
    session = _session(_export_call(model))
    for i, (batch, steps) in enumerate(SHAPES[:3]):
        inputs = _inputs(model.layer, batch, steps, i + 1)
        with torch.no_grad():
            want = model(**inputs)
        _assert_equal(_run(session, inputs), want, f"{mode} {name} (B, T) = {(batch, steps)}")


def test_torch_onnx_export_with_the_table_and_unbatched_input():
    """The table route (torch.onnx.export itself) and an unbatched (T, F) input with a dynamic T."""
    layer = _build("LSTM", "layer_norm", False, layers=1, bidirectional=False)
    program = torch.onnx.export(layer, (torch.randn(7, 5),), dynamo=True, dynamic_shapes={"input": {0: T}},
                                custom_translation_table=fastlayers.onnx.translations(), verbose=False)
    session = _session(program)
    for steps in (3, 11):
        x = torch.randn(steps, 5)
        with torch.no_grad():
            want = layer(x)
        _assert_equal(_run_positional(session, [x]), want, f"unbatched T = {steps}")


def _run_positional(session, tensors) -> list[np.ndarray]:
    return session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), tensors)})


def test_translations_table():
    table = fastlayers.onnx.translations()
    ops = torch.ops.fastlayers
    assert set(table) == {ops.lstm_padded.default, ops.gru_padded.default, ops.rnn_padded.default,
                          ops.locally_connected2d.default}


@pytest.mark.parametrize("build,drawn", [
    (lambda: fastlayers.LSTM(5, 6, zoneout=0.1), r"zoneout=\(0\.1, 0\.1\)"),
    (lambda: torch.nn.Sequential(fastlayers.GRUCell(5, 6, recurrent_dropout=0.2)), r"recurrent_dropout=0\.2"),
    (lambda: fastlayers.GRU(5, 6, zoneout=0.2), r"zoneout=0\.2"),  # (as its repr: once "(0.2, 0.0)")
])
def test_training_mode_masks_are_refused(build, drawn):
    model = build().train()
    x = torch.randn(3, 5)
    with pytest.raises(ValueError, match=r"model(\.0)?: fastlayers\.(LSTM|GRUCell|GRU) in training mode draws random "
                                         r"masks \(" + drawn + r"\), .* call model\.eval\(\)"):
        fastlayers.onnx.export(model, (x,))


@pytest.mark.parametrize("build,x", [
    (lambda: torch.nn.Sequential(fastlayers.LSTMCell(5, 6, zoneout=0.5)), torch.randn(4, 5)),
    (lambda: fastlayers.LSTM(5, 6, recurrent_dropout=0.2), torch.randn(3, 4, 5)),
])
def test_an_exported_program_traced_in_training_mode_is_refused_too(build, x):
    """An ExportedProgram has no modules to ask: a cell traced in training mode exported its mask
    draws (RandomUniformLike: each ONNX Runtime run gave other outputs), and a layer's refusal came
    as torch's ConversionError. A mask draw in the graph is now the same ValueError; an
    ExportedProgram in eval mode, or with torch's own dropout between layers, still exports."""
    with pytest.raises(ValueError, match=r"^model(\.0)?: the ExportedProgram's fastlayers\.(LSTMCell|LSTM) was traced in "
                                         r"training mode and draws random masks .* call model\.eval\(\) before "
                                         r"torch\.export\.export"):
        fastlayers.onnx.export(torch.export.export(build().train(), (x,)))
    model = build().eval()
    program = fastlayers.onnx.export(torch.export.export(model, (x,)))
    torch.testing.assert_close(torch.as_tensor(program(x)[0]), tree_leaves(model(x))[0], rtol=1e-5, atol=1e-5)
    stacked = fastlayers.LSTM(5, 6, num_layers=2, dropout=0.3).train()  # (torch.nn.LSTM's dropout: as torch's)
    fastlayers.onnx.export(torch.export.export(stacked, (torch.randn(3, 4, 5),)))


def test_training_mode_masks_refused_by_the_translation():
    """torch.onnx.export with the table of a model traced in training mode: the translation refuses."""
    layer = fastlayers.LSTM(5, 6, recurrent_dropout=0.2).train()
    with pytest.raises(Exception) as info:
        torch.onnx.export(layer, (torch.randn(3, 2, 5),), dynamo=True, verbose=False,
                          custom_translation_table=fastlayers.onnx.translations())
    chain, e = [], info.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__ or e.__context__
    assert any("call model.eval() before exporting to ONNX" in m for m in chain), chain


def test_missing_onnxscript_is_named(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"fastlayers\.onnx needs onnxscript .*pip install onnxscript"):
        fastlayers.onnx.export(fastlayers.LSTM(5, 6).eval(), (torch.randn(3, 2, 5),))


@pytest.mark.subprocess
def test_import_leaves_onnx_packages_out():
    """import fastlayers (and fastlayers.onnx) imports neither onnxscript nor onnxruntime: export does."""
    probe = ("import sys, fastlayers; fastlayers.onnx.export; "
             "print(sorted(m for m in ('onnxscript', 'onnxruntime', 'onnx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


_PLAIN_EXPORT = """
import sys, warnings
warnings.simplefilter("error", RuntimeWarning)  # a failed registration warns: fail here instead
if sys.argv[1] == "onnxscript-first":
    import onnxscript.function_libs.torch_lib.registration
import numpy as np, torch, onnxruntime as ort
from torch.export import Dim
import fastlayers
assert "fastlayers.onnx" not in sys.modules
torch.manual_seed(0)
B, T = Dim("B"), Dim("T")
cases = [  # (model, example input, dynamic shapes of input, new input): one per translation
    (fastlayers.LSTM(5, 6, bidirectional=True).eval(), torch.randn(4, 3, 5), {0: T, 1: B}, torch.randn(7, 2, 5)),
    (fastlayers.GRU(5, 6, layer_norm=True, batch_first=True).eval(), torch.randn(3, 4, 5), {0: B, 1: T},
     torch.randn(2, 6, 5)),
    (fastlayers.RNN(5, 6, nonlinearity="relu").eval(), torch.randn(4, 3, 5), {0: T, 1: B}, torch.randn(6, 5, 5)),
    (fastlayers.LocallyConnected2d(2, 3, (6, 6), 3, padding=1).eval(), torch.randn(2, 2, 6, 6), {0: B},
     torch.randn(5, 2, 6, 6)),
]
# the import order matters to the registration, not to the translations: one case after onnxscript
for k, (model, x, dims, x2) in enumerate(cases[:1] if sys.argv[1] == "onnxscript-first" else cases):
    if k == 3:  # an ExportedProgram traced first, then exported
        model = torch.export.export(model, (x,), dynamic_shapes=({0: B},))
    program = torch.onnx.export(model, (x,), dynamo=True, dynamic_shapes=None if k == 3 else {"input": dims},
                                verbose=False)
    session = ort.InferenceSession(program.model_proto.SerializeToString())
    got = session.run(None, {session.get_inputs()[0].name: x2.numpy()})[0]
    with torch.no_grad():
        want = model.module()(x2) if k == 3 else model(x2)
    np.testing.assert_allclose(got, (want[0] if isinstance(want, tuple) else want).numpy(), rtol=1e-4, atol=1e-5)
    types = {n.op_type for n in program.model_proto.graph.node}
    assert {0: "LSTM", 1: "Scan", 2: "RNN", 3: "MatMul"}[k] in types, (k, types)
print("ok")
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("order", ["fastlayers-first", "onnxscript-first"])
def test_plain_torch_onnx_export_finds_the_translations(order):
    """``torch.onnx.export(model, args, dynamo=True)`` with no table of ours, in a fresh process
    (the registration is per process): each operator's translation and an ExportedProgram with
    onnxscript's registry imported after fastlayers, one translation with it imported before."""
    proc = subprocess.run([sys.executable, "-c", _PLAIN_EXPORT, order], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


def test_registration_that_fails_warns_and_a_users_own_is_kept():
    from onnxscript.function_libs.torch_lib import registration

    from fastlayers._core import exporter

    class Broken:
        default_registry = None

    with pytest.warns(RuntimeWarning, match=r"could not register its ONNX translations .*"
                                            r"custom_translation_table=fastlayers\.onnx\.translations\(\)"):
        exporter._register(Broken, [lambda: {"fastlayers::lstm_padded": lambda x: x}])

    class Fresh:
        default_registry = registration.Registry()

    def mine(x):
        return x

    Fresh.default_registry.register(mine, "fastlayers::rnn_padded")
    from fastlayers.rnn import _ops_onnx

    exporter._register(Fresh, [_ops_onnx.translations])
    assert Fresh.default_registry["fastlayers::rnn_padded"].overloads == [mine]
    assert Fresh.default_registry["fastlayers::lstm_padded"].overloads[0].func is _ops_onnx.lstm_padded


def test_dynamo_false_is_refused():
    with pytest.raises(ValueError, match="dynamo"):
        fastlayers.onnx.export(fastlayers.LSTM(5, 6).eval(), (torch.randn(3, 2, 5),), dynamo=False)


@pytest.mark.parametrize("build,args,dynamic,others", [
    (lambda: fastlayers.LSTMCell(4, 5, layer_norm=True, peephole=True, proj_size=3, zoneout=0.2), (torch.randn(3, 4),),
     ({0: B},), [(torch.randn(6, 4),), (torch.randn(1, 4),)]),
    (lambda: fastlayers.GRUCell(4, 5, layer_norm=True, zoneout=0.2), (torch.randn(3, 4),), ({0: B},),
     [(torch.randn(6, 4),), (torch.randn(1, 4),)]),
    (lambda: fastlayers.RNNCell(4, 5, nonlinearity="relu"), (torch.randn(3, 4),), ({0: B},),
     [(torch.randn(6, 4),), (torch.randn(1, 4),)]),
    (lambda: fastlayers.LocallyConnected2d(2, 3, (6, 6), 3, padding=1), (torch.randn(2, 2, 6, 6),), ({0: B},),
     [(torch.randn(5, 2, 6, 6),), (torch.randn(1, 2, 6, 6),)]),
    (lambda: fastlayers.LocallyConnected2d(2, 3, (7, 9), (2, 3), stride=(2, 1), padding=(0, 1), dilation=(1, 2)),
     (torch.randn(2, 2, 7, 9),), ({0: B},), [(torch.randn(5, 2, 7, 9),), (torch.randn(1, 2, 7, 9),)]),
    (lambda: fastlayers.LocallyConnected1d(2, 3, 9, 3, stride=2, padding=1, bias=False), (torch.randn(2, 2, 9),),
     ({0: B},), [(torch.randn(5, 2, 9),), (torch.randn(1, 2, 9),)]),
    (lambda: fastlayers.AttentionPooling(4, score="additive"), (torch.randn(3, 4), torch.randn(3, 7, 4)),
     ({0: B}, {0: B, 1: T}), [(torch.randn(5, 4), torch.randn(5, 9, 4)), (torch.randn(1, 4), torch.randn(1, 2, 4))]),
])
def test_cells_local_and_attention(build, args, dynamic, others):
    torch.manual_seed(0)
    module = build().eval()
    session = _session(fastlayers.onnx.export(module, args, dynamic_shapes=dynamic, verbose=False))
    for other in others:
        with torch.no_grad():
            want = module(*other)
        _assert_equal(_run_positional(session, other), want, f"{type(module).__name__} {other[0].shape}")


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
def test_attention_pool_with_lengths(score):
    """fastlayers.attention_pool (functional) and AttentionPooling with lengths: dynamic B, T, lengths."""
    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = fastlayers.AttentionPooling(4, score=score) if score == "additive" else None

        def forward(self, q, k, v, lengths):
            if self.pool is not None:
                return self.pool(q, k, v, lengths=lengths)
            return fastlayers.attention_pool(q, k, v, lengths, score=score)

    torch.manual_seed(0)
    module = Pool().eval()
    args = (torch.randn(3, 4), torch.randn(3, 7, 4), torch.randn(3, 7, 2), torch.tensor([7, 2, 5]))
    session = _session(fastlayers.onnx.export(module, args, dynamic_shapes=({0: B}, {0: B, 1: T}, {0: B, 1: T}, {0: B}),
                                              verbose=False))
    for batch, steps in SHAPES[:3]:
        lengths = torch.randint(1, steps + 1, (batch,))
        lengths[0] = steps
        other = (torch.randn(batch, 4), torch.randn(batch, steps, 4), torch.randn(batch, steps, 2), lengths)
        with torch.no_grad():
            want = module(*other)
        _assert_equal(_run_positional(session, other), want, f"attention {score} (B, T) = {(batch, steps)}")
