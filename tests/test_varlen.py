"""Variable-length batches without padding (issue 66): the varlen form (``cu_seqlens``) and jagged
NestedTensors on the recurrent layers and attention pooling give the padded call's results with
lengths (values, final states, gradients of the input and every parameter, float64), on the C
engine and the reference backend, for modules as constructed; every bad input is refused with a
clear error (:mod:`fastlayers._core.jagged`)."""

from __future__ import annotations

import pytest
import torch

import fastlayers
from fastlayers.rnn._remat_segments import value_maps

LENGTHS = [4, 1, 7, 3]
CU = [0, 4, 5, 12, 15]


def _split(x: torch.Tensor) -> list[torch.Tensor]:
    return list(x.split(LENGTHS))


def _pad(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(_split(x), batch_first=batch_first)


def _unpad(y: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return torch.cat([y[b, :n] if batch_first else y[:n, b] for b, n in enumerate(LENGTHS)])


def _states(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _assert_like_padded(layer, x, y, final, padded, y_pad, final_pad) -> None:
    """The varlen call's values, final states and gradients (input, every parameter) equal the padded
    call's with lengths, float64, to 1e-12."""
    want = _unpad(y_pad, layer.batch_first)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    for got, exp in zip(_states(final), _states(final_pad)):
        torch.testing.assert_close(got, exp, rtol=0, atol=1e-12)
    cotangent = torch.randn_like(y)
    loss = (y * cotangent).sum() + sum(s.square().sum() for s in _states(final))
    loss_pad = (want * cotangent).sum() + sum(s.square().sum() for s in _states(final_pad))
    params = list(layer.parameters())
    grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
    grads_pad = torch.autograd.grad(loss_pad, [padded, *params], allow_unused=True)
    torch.testing.assert_close(grads[0], _unpad(grads_pad[0], layer.batch_first), rtol=0, atol=1e-12)
    for name, g, g_pad in zip([n for n, _ in layer.named_parameters()], grads[1:], grads_pad[1:]):
        assert (g is None) == (g_pad is None), name
        if g is not None:
            torch.testing.assert_close(g, g_pad, rtol=0, atol=1e-12, msg=name)


LAYERS = [
    (fastlayers.LSTM, {}),
    (fastlayers.LSTM, {"bidirectional": True, "num_layers": 2, "layer_norm": True, "peephole": True}),
    (fastlayers.LSTM, {"bidirectional": True, "proj_size": 3, "cell_clip": 0.5, "batch_first": True}),
    (fastlayers.LSTM, {"zoneout": 0.2, "recurrent_dropout": 0.1}),  # eval below: expectations
    (fastlayers.GRU, {"bidirectional": True, "layer_norm": True, "zoneout": 0.1}),
    (fastlayers.GRU, {"num_layers": 2}),
    (fastlayers.RNN, {"bidirectional": True, "nonlinearity": "relu"}),
]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("cls, options", LAYERS, ids=lambda v: getattr(v, "__name__", None) or
                         ",".join(f"{k}={w}" for k, w in v.items()) or "plain")
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_hx", [False, True])
def test_varlen_equals_padded_with_lengths(backend, cls, options, cu_dtype, with_hx):
    torch.manual_seed(0)
    layer = cls(5, 6, dtype=torch.float64, **options).eval()  # as constructed
    x = torch.randn(sum(LENGTHS), 5, dtype=torch.float64, requires_grad=True)
    padded = _pad(x.detach(), layer.batch_first).requires_grad_()
    dirs = 2 if layer.bidirectional else 1
    hx = None
    if with_hx:
        sizes = layer._state_sizes()
        hx = tuple(torch.randn(layer.num_layers * dirs, len(LENGTHS), s, dtype=torch.float64) for s in sizes)
        hx = hx if cls is fastlayers.LSTM else hx[0]
    with fastlayers.backend(backend):
        y, final = layer(x, hx, cu_seqlens=torch.tensor(CU, dtype=cu_dtype))
        y_pad, final_pad = layer(padded, hx, lengths=torch.tensor(LENGTHS))
    assert y.shape == (sum(LENGTHS), dirs * (options.get("proj_size") or 6))
    _assert_like_padded(layer, x, y, final, padded, y_pad, final_pad)


def test_varlen_in_training_mode_draws_the_padded_calls_masks():
    """Zoneout and recurrent dropout in training: the same seed gives the same masks, as the varlen
    call is the padded call inside."""
    layer = fastlayers.LSTM(5, 6, bidirectional=True, zoneout=0.3, recurrent_dropout=0.2, dtype=torch.float64)
    x = torch.randn(sum(LENGTHS), 5, dtype=torch.float64)
    torch.manual_seed(3)
    y, _ = layer(x, cu_seqlens=torch.tensor(CU))
    torch.manual_seed(3)
    y_pad, _ = layer(_pad(x, False), lengths=torch.tensor(LENGTHS))
    torch.testing.assert_close(y, _unpad(y_pad, False), rtol=0, atol=0)


@pytest.mark.parametrize("cls, options", [layer for layer in LAYERS if layer[0] is not fastlayers.RNN],
                         ids=lambda v: getattr(v, "__name__", None) or ",".join(f"{k}={w}" for k, w in v.items())
                         or "plain")
@pytest.mark.parametrize("training", [False, True])
def test_varlen_with_checkpoint_every_runs_on_the_value_rows(cls, options, training, monkeypatch):
    """checkpoint_every on the C engine: the segments read and write the values (N, F) through their
    rows (no padded tensor), with the padded call's results with lengths (values, final states,
    gradients; in training the same masks from the same seed)."""
    from fastlayers.rnn import _remat

    calls = []
    monkeypatch.setattr(_remat, "value_maps", lambda *a: calls.append(1) or value_maps(*a))
    torch.manual_seed(0)
    layer = cls(5, 6, dtype=torch.float64, checkpoint_every=2, **options).train(training)
    x = torch.randn(sum(LENGTHS), 5, dtype=torch.float64, requires_grad=True)
    padded = _pad(x.detach(), layer.batch_first).requires_grad_()
    torch.manual_seed(7)
    y, final = layer(x, cu_seqlens=torch.tensor(CU))
    assert calls == [1]  # once a call, every layer on the value rows
    torch.manual_seed(7)
    y_pad, final_pad = layer(padded, lengths=torch.tensor(LENGTHS))
    _assert_like_padded(layer, x, y, final, padded, y_pad, final_pad)


def test_varlen_with_checkpoint_every_differentiates_twice():
    """A recorded backward (create_graph) of the varlen segments: the second derivatives of the
    layer without checkpoint_every."""
    torch.manual_seed(0)
    layer = fastlayers.LSTM(5, 6, bidirectional=True, layer_norm=True, dtype=torch.float64, checkpoint_every=3)
    plain = fastlayers.LSTM(5, 6, bidirectional=True, layer_norm=True, dtype=torch.float64)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(sum(LENGTHS), 5, dtype=torch.float64, requires_grad=True)
    results = []
    for m in (layer, plain):
        y, _ = m(x, cu_seqlens=torch.tensor(CU))
        g, = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        results.append((g, *torch.autograd.grad(g.square().sum(), [x, *m.parameters()])))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cls", [fastlayers.LSTM, fastlayers.GRU, fastlayers.RNN])
def test_jagged_nested_tensor_in_and_out(cls):
    torch.manual_seed(0)
    layer = cls(5, 6, bidirectional=True, dtype=torch.float64)
    parts = [torch.randn(n, 5, dtype=torch.float64) for n in LENGTHS]
    nested = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
    out, final = layer(nested)
    assert out.is_nested and out.layout == torch.jagged
    torch.testing.assert_close(out.offsets(), nested.offsets())
    y_pad, final_pad = layer(torch.nn.utils.rnn.pad_sequence(parts), lengths=torch.tensor(LENGTHS))
    torch.testing.assert_close(out.values(), _unpad(y_pad, False), rtol=0, atol=1e-12)
    for got, exp in zip(_states(final), _states(final_pad)):
        torch.testing.assert_close(got, exp, rtol=0, atol=1e-12)
    out.values().sum().backward()
    assert nested.grad is not None and nested.grad.values().shape == (sum(LENGTHS), 5)
    x = torch.cat(parts).requires_grad_()
    layer(x, cu_seqlens=torch.tensor(CU))[0].sum().backward()
    torch.testing.assert_close(nested.grad.values(), x.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "additive"])
def test_attention_pool_varlen_and_nested(score):
    torch.manual_seed(0)
    pool = fastlayers.AttentionPooling(6, score=score, attention_size=4 if score == "additive" else None,
                                       dtype=torch.float64)
    q = torch.randn(len(LENGTHS), 6, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(LENGTHS), 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(LENGTHS), 3, dtype=torch.float64, requires_grad=True)
    context, weights = pool(q, k, v, cu_seqlens=torch.tensor(CU, dtype=torch.int32))
    kp, vp = _pad(k, True), _pad(v, True)
    context_pad, weights_pad = pool(q, kp, vp, torch.tensor(LENGTHS))
    torch.testing.assert_close(context, context_pad, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, _unpad(weights_pad, True), rtol=0, atol=1e-12)
    grads = torch.autograd.grad(context.square().sum(), [q, k, v, *pool.parameters()])
    grads_pad = torch.autograd.grad(context_pad.square().sum(), [q, kp, vp, *pool.parameters()])
    for g, g_pad, padded in zip(grads, grads_pad, [False, True, True] + [False] * len(list(pool.parameters()))):
        torch.testing.assert_close(g, _unpad(g_pad, True) if padded else g_pad, rtol=0, atol=1e-12)
    # the segment operations a traced call runs (torch.compile, torch.export): the same, in value and gradient
    from fastlayers.attention._reference import attention_pool_varlen_reference

    additive = (pool.weight_query, pool.weight_key, pool.v, pool.bias) if score == "additive" else None
    context_seg, weights_seg = attention_pool_varlen_reference(q, k, v, torch.tensor(CU, dtype=torch.int32),
                                                               score=score, additive=additive)
    torch.testing.assert_close(context_seg, context, rtol=0, atol=1e-12)
    torch.testing.assert_close(weights_seg, weights, rtol=0, atol=1e-12)
    grads_seg = torch.autograd.grad(context_seg.square().sum(), [q, k, v, *pool.parameters()])
    for g, g_seg in zip(grads, grads_seg, strict=True):
        torch.testing.assert_close(g_seg, g, rtol=0, atol=1e-12)
    nk = torch.nested.nested_tensor_from_jagged(k, torch.tensor(CU))
    nv = torch.nested.nested_tensor_from_jagged(v, torch.tensor(CU))
    context_nested, weights_nested = pool(q, nk, nv)
    assert weights_nested.is_nested
    torch.testing.assert_close(context_nested, context, rtol=0, atol=0)
    torch.testing.assert_close(weights_nested.values(), weights, rtol=0, atol=0)


BAD_CU = [
    (torch.tensor([1, 4, 5, 12, 15]), ValueError, r"cu_seqlens: expected cu_seqlens\[0\] = 0, got 1"),
    (torch.tensor([0, 4, 3, 12, 15]), ValueError, r"cu_seqlens: expected non-decreasing offsets, got cu_seqlens\[2\] = 3 < "
                                                  r"cu_seqlens\[1\] = 4"),
    (torch.tensor([0, 4, 4, 12, 15]), ValueError, r"cu_seqlens: every sequence must have length >= 1, got length 0 "
                                                  r"for sequence 1"),
    (torch.tensor([0, 4, 5, 12, 14]), ValueError, r"cu_seqlens: expected cu_seqlens\[-1\] = 15 \(the number of value "
                                                  r"rows\), got 14"),
    (torch.tensor([0.0, 4, 5, 12, 15]), TypeError, r"cu_seqlens: expected dtype torch.int32 or torch.int64, got "
                                                   r"torch.float32"),
    (torch.tensor([[0, 15]]), ValueError, r"cu_seqlens: expected a 1-D tensor of shape \(B\+1,\) with B >= 1, got "
                                          r"shape \(1, 2\)"),
    (torch.tensor([0, 4, 5, 12, 15], device="meta"), ValueError, r"cu_seqlens: expected a tensor on cpu \(the values' "
                                                                  r"device\) or on the CPU, got meta"),
    ([0, 4, 5, 12, 15], TypeError, r"cu_seqlens: expected a 1-D int32 or int64 tensor, got list"),
]


@pytest.mark.parametrize("cu, error, message", BAD_CU, ids=[m[:30] for _, _, m in BAD_CU])
@pytest.mark.parametrize("layer", ["LSTM", "attention"])
def test_bad_cu_seqlens_is_refused(layer, cu, error, message):
    """... and every ValueError is a RuntimeError too, as the lengths' are (torch's
    pack_padded_sequence class): code catching either one catches both forms."""
    x = torch.randn(15, 5)
    with pytest.raises(error, match=message) as info:
        if layer == "LSTM":
            fastlayers.LSTM(5, 6, layer_norm=True)(x, cu_seqlens=cu)
        else:
            fastlayers.attention_pool(torch.randn(4, 5), x, cu_seqlens=cu)
    assert error is TypeError or isinstance(info.value, RuntimeError)


def test_max_seqlen_takes_numpy_integers():
    np = pytest.importorskip("numpy")
    lstm, x, cu = fastlayers.LSTM(5, 6), torch.randn(15, 5), torch.tensor(CU)
    want = lstm(x, cu_seqlens=cu)
    got = lstm(x, cu_seqlens=cu, max_seqlen=np.int64(max(LENGTHS)))
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"max_seqlen: expected at least the longest sequence"):
        lstm(x, cu_seqlens=cu, max_seqlen=np.int32(1))


def test_other_bad_varlen_input_is_refused():
    lstm, x, cu = fastlayers.LSTM(5, 6), torch.randn(15, 5), torch.tensor(CU)
    with pytest.raises(ValueError, match=r"lengths: expected None with cu_seqlens"):
        lstm(x, cu_seqlens=cu, lengths=torch.tensor(LENGTHS))
    with pytest.raises(ValueError, match=r"input: expected a 2-D tensor \(N, F\) with cu_seqlens .*got shape \(15, 1, 5\)"):
        lstm(x.unsqueeze(1), cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"max_seqlen: expected at least the longest sequence \(7\), got 6"):
        lstm(x, cu_seqlens=cu, max_seqlen=6)
    lstm(x, cu_seqlens=cu, max_seqlen=7)  # the longest: fine
    with pytest.raises(ValueError, match=r"max_seqlen: expected None without cu_seqlens"):
        lstm(torch.randn(7, 4, 5), max_seqlen=7)
    with pytest.raises(ValueError, match=r"input \(torch.Size\(\[15, 4\]\)\)|input size|input.size\(-1\) must be equal"):
        lstm(torch.randn(15, 4), cu_seqlens=cu)  # the feature size: torch's own check, as for padded input
    strided = torch.nested.nested_tensor([torch.randn(3, 5), torch.randn(4, 5)])
    with pytest.raises(ValueError, match=r"input: expected a jagged NestedTensor \(layout=torch.jagged\), got layout "
                                         r"torch.strided"):
        lstm(strided)
    jagged = torch.nested.nested_tensor([torch.randn(3, 5), torch.randn(4, 5)], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"input: expected the ragged dimension at 1 \(B, j, F\), got it at 2"):
        lstm(jagged.transpose(1, 2))  # (B, F, j): the features ragged
    with pytest.raises(ValueError, match=r"cu_seqlens, lengths: expected None for a NestedTensor input"):
        lstm(jagged, cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(ValueError, match=r"values: expected the same offsets \(sequence lengths\) as keys"):
        other = torch.nested.nested_tensor([torch.randn(4, 5), torch.randn(3, 5)], layout=torch.jagged)
        fastlayers.attention_pool(torch.randn(2, 5), jagged, other)


def test_jagged_nested_tensors_with_holes_are_refused():
    """A NestedTensor with holes (torch.nested.narrow, or offsets with lengths) holds rows between
    its sequences that are not theirs: refused, naming .contiguous() (attention pooling once used
    those rows, and the layers reported a cu_seqlens they were never given)."""
    values, offsets = torch.randn(10, 5), torch.tensor([0, 4, 10])
    holes = torch.nested.nested_tensor_from_jagged(values, offsets, lengths=torch.tensor([2, 3]))
    message = r"expected a contiguous jagged NestedTensor, got one with holes .*\.contiguous\(\) makes one"
    with pytest.raises(ValueError, match="input: " + message):
        fastlayers.LSTM(5, 6)(holes)
    with pytest.raises(ValueError, match="keys: " + message):
        fastlayers.attention_pool(torch.randn(2, 5), holes)
    context, _ = fastlayers.attention_pool(torch.randn(2, 5, generator=torch.Generator().manual_seed(0)),
                                           holes.contiguous())
    want, _ = fastlayers.attention_pool(torch.randn(2, 5, generator=torch.Generator().manual_seed(0)),
                                        torch.cat([values[0:2], values[4:7]]), cu_seqlens=torch.tensor([0, 2, 5]))
    torch.testing.assert_close(context, want)


def test_attention_varlen_input_checks():
    """The varlen form's checks as the padded call's: a non-tensor is a TypeError, max_seqlen is
    checked for NestedTensors too (it was ignored), and torch.jit.trace is refused (a trace fixes
    the rows' layout; a longer sequence later failed inside index_copy_)."""
    q, k, cu = torch.randn(2, 5), torch.randn(7, 5), torch.tensor([0, 3, 7])
    with pytest.raises(TypeError, match=r"keys: expected a torch.Tensor, got list"):
        fastlayers.attention_pool(q, k.tolist(), cu_seqlens=cu)
    nested = torch.nested.nested_tensor([k[:3], k[3:]], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"max_seqlen: expected at least the longest sequence \(4\), got 2"):
        fastlayers.attention_pool(q, nested, max_seqlen=2)

    class Pool(torch.nn.Module):
        def forward(self, q, k, cu):
            return fastlayers.attention_pool(q, k, cu_seqlens=cu)[0]

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = fastlayers.LSTM(5, 4)

        def forward(self, x, cu):
            return self.lstm(x, cu_seqlens=cu)[0]

    for module, args in ((Pool(), (q, k, cu)), (Layer(), (k, cu))):
        with pytest.raises(RuntimeError, match=r"torch.jit.trace cannot record fastlayers\.\w+'s varlen form: .*"
                                               r"torch.export"):
            torch.jit.trace(module, args)


@pytest.mark.compile
def test_traced_attention_varlen_checks_and_rounds_as_eager():
    """Traced (torch.compile), the varlen form refuses what the eager call refuses (additive
    parameters with a dot score, a max_seqlen below the longest sequence: both once passed) and
    rounds the products' operands under autocast as the eager call does (its weights differed)."""
    q, k, cu = torch.randn(2, 5), torch.randn(7, 5), torch.tensor([0, 3, 7])
    additive = (torch.randn(4, 5), torch.randn(4, 5), torch.randn(4), None)
    def compiled(**options):
        torch._dynamo.reset()  # (the lambda's code object is one: no compiled entry of another setting reused)
        return torch.compile(lambda q, k, cu, **kw: fastlayers.attention_pool(q, k, cu_seqlens=cu, **kw),
                             backend="aot_eager", dynamic=False, **options)

    with pytest.raises(ValueError, match=r"additive: expected None for score='dot'"):
        compiled()(q, k, cu, additive=additive)
    with pytest.raises(RuntimeError, match=r"^max_seqlen: expected at least the longest sequence$"):  # (the graph's)
        compiled(fullgraph=True)(q, k, cu, max_seqlen=2)
    pool = compiled(fullgraph=True)
    q1, k1 = torch.tensor([[64.0]]), torch.tensor([[1.0], [1.0 + 2 ** -9]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = fastlayers.attention_pool(q1, k1, cu_seqlens=torch.tensor([0, 2]))[1]
        traced = pool(q1, k1, torch.tensor([0, 2]))[1]
    assert torch.equal(eager, torch.tensor([0.5, 0.5], dtype=eager.dtype)) and torch.equal(traced, eager)


@pytest.mark.compile
@pytest.mark.parametrize("make", [lambda: fastlayers.LSTM(5, 4, layer_norm=True, bidirectional=True),
                                  lambda: fastlayers.GRU(5, 4, num_layers=2), lambda: fastlayers.RNN(5, 4)],
                         ids=["LSTM layer_norm", "GRU", "RNN"])
@torch._dynamo.config.patch(allow_rnn=True)
def test_traced_recurrent_varlen_under_autocast_is_the_eager_call(make):
    """Compiled, a recurrent layer's varlen form under CPU autocast returns the autocast dtype and
    the eager call's values (its operators ran in float32 on unrounded operands: the float32 call,
    in float32)."""
    torch.manual_seed(0)
    layer = make()
    x, cu = torch.randn(9, 5), torch.tensor([0, 4, 5, 9])
    compiled = torch.compile(lambda x, cu: layer(x, cu_seqlens=cu), backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x, cu), layer(x, cu_seqlens=cu)
    for a, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        assert a.dtype == w.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), w.float(), rtol=0.02, atol=0.02)  # (bf16: eager rounds h per step)
    with torch.no_grad():
        full = layer(x, cu_seqlens=cu)[0]
    assert (got[0].float() - full).abs().max() > 1e-4  # (not the float32 call)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("cls,torch_cls", [(fastlayers.LSTM, torch.nn.LSTM), (fastlayers.GRU, torch.nn.GRU),
                                           (fastlayers.RNN, torch.nn.RNN)], ids=["LSTM", "GRU", "RNN"])
def test_varlen_equals_torchs_packed_call(cls, torch_cls, backend):
    """Against torch.nn's PackedSequence call, not only our padded call (on the reference backend
    the varlen call is the padded call, so that comparison could not see, e.g., final states
    returned in the length-sorted order): outputs, final states and every gradient, float64."""
    from rnn_helpers import torch_packed

    torch.manual_seed(0)
    ours = cls(5, 6, num_layers=2, bidirectional=True).double()
    theirs = torch_cls(5, 6, num_layers=2, bidirectional=True).double()
    theirs.load_state_dict(ours.state_dict())
    values = torch.randn(CU[-1], 5, dtype=torch.float64)
    lengths = torch.tensor(LENGTHS)
    padded = torch.zeros(max(LENGTHS), len(LENGTHS), 5, dtype=torch.float64)
    for b, (start, stop) in enumerate(zip(CU[:-1], CU[1:])):
        padded[:stop - start, b] = values[start:stop]
    with fastlayers.backend(backend):
        out, state = ours(values.requires_grad_(), cu_seqlens=torch.tensor(CU))
    want_out, want_state = torch_packed(theirs, padded.requires_grad_(), None, lengths)
    rows = torch.cat([want_out[:n, b] for b, n in enumerate(LENGTHS)])  # the packed outputs, sequence by sequence
    got, want = [out, *torch.utils._pytree.tree_leaves(state)], [rows, *torch.utils._pytree.tree_leaves(want_state)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    cot = [torch.randn_like(t) for t in got]
    g_ours = torch.autograd.grad(got, [values, *ours.parameters()], cot)
    g_theirs = torch.autograd.grad(want, [padded, *theirs.parameters()], cot)
    g_values = torch.cat([g_theirs[0][:n, b] for b, n in enumerate(LENGTHS)])
    for a, b in zip((g_values, *g_theirs[1:]), g_ours, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10)
