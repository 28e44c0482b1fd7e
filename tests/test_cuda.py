"""On a CUDA GPU (``python3 -m pytest -m cuda``; skipped without one): the automatic backend picks the
Triton kernels for the local layers, attention pooling and the recurrent engine, which equal the
plain-torch / float64 per-step reference in value and every gradient (the engine eagerly and with its
time loops as chunks captured in CUDA graphs, replayed for new lengths and new T); plain LSTM / GRU
run the engine only where its graphs are captured already (cuDNN otherwise); every layer runs under
CUDA autocast (fp16, bf16) and returns the low dtype, close to its float32 result."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastlayers
from fastlayers._core.backend import select
from fastlayers.functional import attention_pool, locally_connected2d
from rnn_helpers import torch_packed

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _grads(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    g = torch.Generator(device=DEV).manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=g, device=DEV)).sum() for o in outs)
    loss.backward()
    return [o.detach().float() for o in outs] + [t.grad.float() for t in leaves]


def test_automatic_backend_on_cuda():
    x = torch.zeros(2, device=DEV)
    assert select("local2d", x) == "triton" and select("attention", x) == "triton"
    assert select("lstm", x) == "triton" and select("gru", x) == "triton"


@pytest.mark.parametrize("kernel,stride,padding,dilation", [(1, 1, 0, 1), (3, 1, 1, 1), (3, 2, 2, 2)])
def test_local_triton_equals_reference(kernel, stride, padding, dilation):
    torch.manual_seed(0)
    m = fastlayers.LocallyConnected2d(3, 4, (17, 15), kernel, stride=stride, padding=padding, dilation=dilation,
                                      device=DEV)
    x = torch.randn(5, 3, 17, 15, device=DEV)
    fn = lambda x, w, b: locally_connected2d(x, w, b, m.stride, m.padding, m.dilation)  # noqa: E731
    got = _grads(fn, x, m.weight, m.bias)
    with fastlayers.backend("reference"):
        want = _grads(fn, x, m.weight, m.bias)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("context", [None, "triton", "reference"])
def test_triton_kernels_shortcut_agrees_with_select(context):
    from fastlayers._core import backend as _backend

    x = torch.zeros(2, device=DEV)
    with fastlayers.backend(context) if context else torch.no_grad():
        for t in (x, x.double(), x.half(), *((x.long(),) if context != "triton" else ())):  # (forced: raises)
            assert _backend.triton_kernels("local2d", t) == (select("local2d", t) == "triton"), (context, t.dtype)


def test_local_and_attention_repeated_calls_reuse_the_launch_and_stay_right():
    """Calls after the first launch the compiled kernels directly (fastlayers._triton._launch): the
    local layer's forward and gradients for the same input, for an input 4 bytes off a 16-byte
    boundary and for another batch, and attention pooling's, each against the reference."""
    from fastlayers._triton import _launch, local as kernels

    torch.manual_seed(0)
    m = fastlayers.LocallyConnected2d(3, 4, (17, 15), 3, padding=1, device=DEV)
    flat = torch.randn(6 * 3 * 17 * 15 + 1, device=DEV)
    inputs = [flat[:5 * 3 * 17 * 15].view(5, 3, 17, 15), flat[1:1 + 5 * 3 * 17 * 15].view(5, 3, 17, 15),
              flat[:6 * 3 * 17 * 15].view(6, 3, 17, 15)]
    fn = lambda x, w, b: locally_connected2d(x, w, b, m.stride, m.padding, m.dilation)  # noqa: E731
    for x in inputs + inputs:
        with torch.no_grad():
            with fastlayers.backend("reference"):
                want = m(x)
            torch.testing.assert_close(m(x), want, atol=1e-4, rtol=1e-4)
        got = _grads(fn, x, m.weight, m.bias)
        with fastlayers.backend("reference"):
            expected = _grads(fn, x, m.weight, m.bias)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert not _launch.SUPPORTED or len(_launch._CACHE[kernels._forward_kernel]) >= 3
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(6, 8, generator=g).to(DEV), torch.randn(6, 11, 8, generator=g).to(DEV)
    lengths = torch.tensor([11, 3, 7, 11, 1, 5])
    pool = lambda q, k, v: attention_pool(q, k, v, lengths)  # noqa: E731
    for _ in range(3):
        got = _grads(pool, q, k, k)
        with fastlayers.backend("reference"):
            expected = _grads(pool, q, k, k)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("score", ["dot", "scaled_dot"])
def test_attention_triton_equals_reference(score):
    torch.manual_seed(0)
    q, k, v = torch.randn(16, 32, device=DEV), torch.randn(16, 300, 32, device=DEV), torch.randn(16, 300, 100, device=DEV)
    lengths = torch.randint(1, 301, (16,))
    fn = lambda q, k, v: attention_pool(q, k, v, lengths, score=score)  # noqa: E731
    got = _grads(fn, q, k, v)
    with fastlayers.backend("reference"):
        want = _grads(fn, q, k, v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_attention_triton_float64_scaled_dot_is_exact():
    """The scaled-dot scale reached the kernels as a float argument, which a compiled kernel takes
    as float32: float64 weights were off by about 5e-9. The kernels form 1 / sqrt(Dk) in float64."""
    g = torch.Generator().manual_seed(0)
    q, k = (3 * torch.randn(*s, generator=g, dtype=torch.float64) for s in ((8, 3), (8, 40, 3)))
    lengths = torch.tensor([40, 3, 17, 1, 40, 9, 22, 30])

    def run():
        q_, k_ = q.to(DEV).requires_grad_(), k.to(DEV).requires_grad_()
        context, weights = attention_pool(q_, k_, k_, lengths, score="scaled_dot")
        (context.sum() + (weights * weights).sum()).backward()
        return context, weights, q_.grad, k_.grad

    got = run()
    with fastlayers.backend("reference"):
        want = run()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-13, rtol=1e-13)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_loops_captured_on_a_second_gpu_after_the_first():
    """torch's default capture stream is made on the device of the process's first capture: loops
    on cuda:1 captured after loops on cuda:0 are captured on cuda:1's own stream (on the default
    one, its launches ran uncaptured and the replays did nothing)."""
    from fastlayers.rnn import _gpu_graphs

    for index in (0, 1):
        dev = torch.device("cuda", index)
        torch.manual_seed(0)
        layer = fastlayers.LSTM(8, 16, bidirectional=True, layer_norm=True, device=dev)
        captures = _gpu_graphs.stats["captures"]
        for _ in range(2):  # the first captures, the second replays; each on new values
            x = torch.randn(40, 3, 8, device=dev)
            with fastlayers.backend("triton"):
                got = layer(x)[0]
            with fastlayers.backend("reference"):
                torch.testing.assert_close(got, layer(x)[0], atol=1e-4, rtol=1e-4, msg=str(dev))
        assert _gpu_graphs.stats["captures"] > captures


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_layers_on_a_second_gpu_run_there_while_the_first_is_current():
    """Triton launches on the current device; the layers' kernels launch on their tensors' device."""
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    cases = {
        "LSTM": (fastlayers.LSTM(8, 16, bidirectional=True, layer_norm=True, device=dev),
                 lambda m, x: m(x, lengths=[9, 4, 7])[0], torch.randn(9, 3, 8, device=dev)),
        "GRU": (fastlayers.GRU(8, 16, layer_norm=True, device=dev), lambda m, x: m(x)[0],
                torch.randn(9, 3, 8, device=dev)),
        "local": (fastlayers.LocallyConnected2d(3, 4, (9, 7), 3, padding=1, device=dev), lambda m, x: m(x),
                  torch.randn(2, 3, 9, 7, device=dev)),
        "attention": (nn.Identity(), lambda m, x: attention_pool(x[:, 0], x, lengths=[9, 4, 7])[0],
                      torch.randn(3, 9, 8, device=dev)),
    }
    for name, (module, call, x) in cases.items():
        results = []
        for backend in ("triton", "reference"):
            leaf = x.clone().requires_grad_(True)
            with fastlayers.backend(backend):
                out = call(module, leaf)
            grads = torch.autograd.grad(out.square().sum(), [leaf, *module.parameters()])
            results.append([out, *grads])
        assert torch.cuda.current_device() == 0
        for a, b in zip(*results, strict=True):
            assert a.device == dev
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)


LAYERS = {  # name -> (module, call, torch.nn counterpart call or None: the engine's own path, plain ones too)
    "LSTM options": lambda: (fastlayers.LSTM(8, 16, bidirectional=True, layer_norm=True, peephole=True, device=DEV),
                             lambda m, x: m(x, lengths=torch.tensor([9, 4, 7]))[0], None),
    "LSTM plain": lambda: (fastlayers.LSTM(8, 256, bidirectional=True, device=DEV), lambda m, x: m(x)[0], None),
    "GRU lengths": lambda: (fastlayers.GRU(8, 256, device=DEV), lambda m, x: m(x, lengths=[9, 4, 7])[0], None),
    "GRU small (cuDNN)": lambda: (fastlayers.GRU(8, 16, device=DEV), lambda m, x: m(x, lengths=[9, 4, 7])[0],
                                  lambda m, x: torch_packed(m, x, None, [9, 4, 7])[0]),  # PackedSequence: torch's GRU
    "RNN": lambda: (fastlayers.RNN(8, 16, device=DEV), lambda m, x: m(x)[0], lambda m, x: nn.RNN.forward(m, x)[0]),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(LAYERS))
def test_recurrent_layers_under_cuda_autocast(name, dtype):
    torch.manual_seed(0)
    m, fn, torch_fn = LAYERS[name]()
    x = torch.randn(9, 3, 8, device=DEV)
    with torch.autocast("cuda", dtype):
        fn(m, x)  # a plain layer's first call runs on cuDNN while its loops are captured for the next
        low = fn(m, x)
        # layers on torch's cuDNN path return what torch.nn's module returns under the same autocast
        # (torch 2.11's cuDNN RNN autocasts to float16 even under bfloat16 autocast); the engine: dtype
        expected = torch_fn(m, x).dtype if torch_fn is not None else dtype
    assert low.dtype == expected
    torch.testing.assert_close(low.float(), fn(m, x), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_local_and_attention_under_cuda_autocast(dtype):
    torch.manual_seed(0)
    m = fastlayers.LocallyConnected2d(3, 4, 9, 3, padding=1, device=DEV)
    x = torch.randn(2, 3, 9, 9, device=DEV)
    q, k = torch.randn(3, 8, device=DEV), torch.randn(3, 10, 8, device=DEV)
    with torch.autocast("cuda", dtype):
        y, (c, w) = m(x), attention_pool(q, k, lengths=[10, 3, 6], score="scaled_dot")
    assert y.dtype == c.dtype == w.dtype == dtype
    torch.testing.assert_close(y.float(), m(x), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(c.float(), attention_pool(q, k, lengths=[10, 3, 6], score="scaled_dot")[0],
                               atol=3e-2, rtol=3e-2)


ENGINE_MODULES = {
    "lstm-ln-peephole-clip": lambda: fastlayers.LSTM(6, 5, num_layers=2, bidirectional=True, layer_norm=True,
                                                     peephole=True, cell_clip=0.8),
    "lstm-proj-zoneout": lambda: fastlayers.LSTM(6, 5, proj_size=3, bidirectional=True, zoneout=(0.1, 0.2),
                                                 proj_clip=0.5, layer_norm=True),
    "gru-ln-zoneout": lambda: fastlayers.GRU(6, 5, num_layers=2, bidirectional=True, layer_norm=True, zoneout=0.1),
}


def _module_grads(module, x, lengths):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out, h = module(x, lengths=lengths)
    states = h if isinstance(h, tuple) else (h,)
    g = torch.Generator().manual_seed(1)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
               for o in (out, *states))
    loss.backward()
    # copies: .cpu() of a CPU tensor is the tensor itself, and module.to() later moves a parameter's .grad in place
    return [t.detach().to("cpu", copy=True) for t in (out, *states, x.grad, *(p.grad for p in module.parameters()))]


@pytest.mark.parametrize("graphs", ["eager", "cuda-graphs"])
@pytest.mark.parametrize("name", list(ENGINE_MODULES))
def test_engine_on_cuda_equals_the_float64_reference(name, graphs, monkeypatch):
    from fastlayers.rnn import _gpu_graphs

    monkeypatch.setenv(_gpu_graphs.ENV, "1" if graphs == "cuda-graphs" else "0")
    torch.manual_seed(0)
    module = ENGINE_MODULES[name]().double().eval()
    x = torch.randn(7, 3, 6, dtype=torch.float64)
    # a second lengths vector and shorter T replay the same captures
    for steps, lengths in ((7, [4, 7, 1]), (7, [7, 2, 5]), (5, [5, 2, 5]), (6, None)):
        want = _module_grads(module, x[:steps], lengths)  # CPU float64: the C engine; the reference below
        with fastlayers.backend("reference"):
            ref = _module_grads(module, x[:steps], lengths)
        gpu = _module_grads(module.to(DEV), x[:steps].to(DEV), lengths)
        module.cpu()
        for a, b, c in zip(gpu, want, ref, strict=True):
            torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)
            torch.testing.assert_close(b, c, atol=1e-10, rtol=1e-10)
    if graphs == "cuda-graphs":
        assert _gpu_graphs._entries, "no loop was captured"
        _gpu_graphs.clear()


def test_cuda_graphs_by_default_capture_once_and_replay_for_any_t(monkeypatch):
    """The default (auto): the first call (T=20) captures the loops' chunks, calls with other T and
    lengths replay them; T=40, longer than the buffers (32 steps), captures once more with larger
    ones (64), and runs in two replays of 32 steps, the second with 8 steps and 24 launches that do
    nothing; equal lengths of 9 in T=40 run 9 steps."""
    from fastlayers.rnn import _gpu_graphs

    monkeypatch.delenv(_gpu_graphs.ENV, raising=False)
    _gpu_graphs.clear()
    torch.manual_seed(0)
    module = fastlayers.GRU(6, 5, bidirectional=True, layer_norm=True, device=DEV).double()
    x = torch.randn(40, 3, 6, dtype=torch.float64, device=DEV)
    captures = []
    for steps, lengths in ((20, [20, 13, 1]), (7, [4, 7, 1]), (40, [40, 3, 17]), (12, None), (40, [9, 9, 9])):
        with fastlayers.backend("reference"):
            want = _module_grads(module, x[:steps], lengths)
        got = _module_grads(module, x[:steps], lengths)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        captures.append(_gpu_graphs.stats["captures"])
    assert captures[1] == captures[0] and captures[2] == captures[1] + 2 and captures[4] == captures[2]
    _gpu_graphs.clear()


def test_plain_layers_on_cuda_run_the_engine_where_loops_are_captured_else_cudnn(monkeypatch):
    from fastlayers.rnn import _gpu_graphs

    ours = fastlayers.LSTM(6, 5, layer_norm=True, device=DEV)
    plain = fastlayers.LSTM(6, 256, device=DEV)
    x = torch.randn(7, 3, 6, device=DEV)
    assert type(ours(x, lengths=[7, 3, 5])[0].grad_fn).__name__ == "LSTMLayerBackward"
    # the first call runs on cuDNN while the engine's loops are captured; then the engine, for
    # any T up to the captured one, with or without lengths
    assert type(plain(x)[0].grad_fn).__name__ != "LSTMLayerBackward"
    for lengths in ([7, 3, 5], None):
        assert type(plain(x, lengths=lengths)[0].grad_fn).__name__ == "LSTMLayerBackward"
        assert type(plain(x[:5], lengths=None if lengths is None else [5, 3, 1])[0].grad_fn).__name__ == "LSTMLayerBackward"
        # a call of at most EAGER_STEPS steps is cuDNN's (the engine would run its loops eagerly)
        short = x[:_gpu_graphs.EAGER_STEPS]
        assert type(plain(short)[0].grad_fn).__name__ != "LSTMLayerBackward"
        assert type(plain.double()(x.double(), lengths=lengths)[0].grad_fn).__name__ != "LSTMLayerBackward"
        plain.float()
        monkeypatch.setenv(_gpu_graphs.ENV, "0")  # eager loops: cuDNN is faster
        assert type(plain(x, lengths=lengths)[0].grad_fn).__name__ != "LSTMLayerBackward"
        monkeypatch.delenv(_gpu_graphs.ENV)
    long = torch.randn(40, 3, 6, device=DEV)  # longer than the captured buffers: cuDNN, then the engine
    assert type(plain(long)[0].grad_fn).__name__ != "LSTMLayerBackward"
    assert type(plain(long)[0].grad_fn).__name__ == "LSTMLayerBackward"
    gru = fastlayers.GRU(6, 256, device=DEV)
    gru(x)
    assert type(gru(x)[0].grad_fn).__name__ == "GRULayerBackward"
    with fastlayers.backend("reference"):
        assert type(gru(x)[0].grad_fn).__name__ != "GRULayerBackward"
    # where cuDNN measured faster: hidden_size < 256, or batch * hidden_size > 2**17
    assert type(fastlayers.GRU(6, 128, device=DEV)(x)[0].grad_fn).__name__ != "GRULayerBackward"
    assert type(gru(torch.randn(7, 513, 6, device=DEV))[0].grad_fn).__name__ != "GRULayerBackward"


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.parametrize("lengths", [None, [40, 17, 33, 1, 40]], ids=["padded", "lengths"])
def test_plain_layers_on_cuda_equal_torch_nn_as_constructed(cell, lengths):
    """Plain modules as constructed (the engine, captured after the first call) against torch.nn
    (cuDNN; PackedSequence with lengths) with the same weights, float32 TF32 off: outputs, final
    states and every gradient; hidden 256, so the backward's recurrent product runs in slices.
    Both are float32: gradients summed over T*B rows in different orders differ by ~1e-5."""
    flags = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        ours = getattr(fastlayers, cell)(48, 256, num_layers=2, bidirectional=True, device=DEV)
        theirs = getattr(nn, cell)(48, 256, num_layers=2, bidirectional=True, device=DEV)
        theirs.load_state_dict(ours.state_dict())
        x = torch.randn(40, 5, 48, device=DEV)

        def grads(module, fn):
            module.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            out, h = fn(module, xi)
            states = h if isinstance(h, tuple) else (h,)
            g = torch.Generator(device=DEV).manual_seed(1)
            sum((o * torch.randn(o.shape, generator=g, device=DEV)).sum() for o in (out, *states)).backward()
            return [t.detach().clone() for t in (out, *states, xi.grad, *(p.grad for p in module.parameters()))]

        for _ in range(3):  # cuDNN (while the engine's loops are captured), then the engine's replays
            got = grads(ours, lambda m, x: m(x, lengths=lengths))
        want = grads(theirs, (lambda m, x: m(x)) if lengths is None else (lambda m, x: torch_packed(m, x, None, lengths)))
        assert type(ours(x, lengths=lengths)[0].grad_fn).__name__ == f"{cell}LayerBackward"
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_engine_float32_on_cuda_honours_tf32_off():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    module = fastlayers.LSTM(64, 32, bidirectional=True, layer_norm=True, device=DEV)
    x = torch.randn(20, 4, 64, device=DEV)
    got = module(x, lengths=[20, 9, 14, 1])[0]
    with fastlayers.backend("reference"):
        want = module.double()(x.double(), lengths=[20, 9, 14, 1])[0]
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("graphs", ["eager", "cuda-graphs"])
@pytest.mark.parametrize("name", list(ENGINE_MODULES))
def test_checkpoint_every_on_cuda_equals_the_run_without_it(name, graphs, monkeypatch):
    """checkpoint_every through the GPU engine (issue 40): outputs and every gradient equal the layer
    without the option in float64, T not a multiple of k, lengths (one of 1), and both on CUDA
    graphs and eagerly; the recomputation's peak memory (eager) stays below the run without it."""
    from fastlayers.rnn import _gpu_graphs

    monkeypatch.setenv(_gpu_graphs.ENV, "1" if graphs == "cuda-graphs" else "0")
    torch.manual_seed(0)
    plain = ENGINE_MODULES[name]().double().to(DEV).eval()  # (eval: no masks drawn, both runs see one cell)
    remat = ENGINE_MODULES[name]().double().to(DEV).eval()
    remat.load_state_dict(plain.state_dict())
    remat.checkpoint_every = 3
    x = torch.randn(11, 3, 6, dtype=torch.float64, device=DEV)
    for lengths in ([11, 4, 1], None):
        for a, b in zip(_module_grads(remat, x, lengths), _module_grads(plain, x, lengths), strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    _gpu_graphs.clear()
    monkeypatch.setenv(_gpu_graphs.ENV, "0")  # the peaks below without captures (they hold memory of their own)

    def peak(module):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = module(big)[0]
        out.sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    big = torch.randn(400, 16, 6, dtype=torch.float64, device=DEV, requires_grad=True)
    remat.checkpoint_every = "auto"
    assert peak(remat) < peak(plain)



def test_small_layer_calls_on_cuda_run_eagerly_and_equal_the_reference():
    """LSTM / GRU with options at T <= _gpu_graphs.EAGER_STEPS (issue 42's T = 2 rows): no capture, the
    reference's values and gradients; a longer T is captured as before."""
    from fastlayers.rnn import _gpu_graphs

    torch.manual_seed(0)
    for module in (fastlayers.LSTM(4, 4, layer_norm=True).double(), fastlayers.GRU(4, 4, layer_norm=True).double()):
        x = torch.randn(_gpu_graphs.EAGER_STEPS, 2, 4, dtype=torch.float64)
        with fastlayers.backend("reference"):
            want = _module_grads(module, x, [_gpu_graphs.EAGER_STEPS, 1])
        captures = _gpu_graphs.stats["captures"]
        got = _module_grads(module.to(DEV), x.to(DEV), [_gpu_graphs.EAGER_STEPS, 1])
        assert _gpu_graphs.stats["captures"] == captures
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
        module(torch.randn(_gpu_graphs.EAGER_STEPS + 1, 2, 4, dtype=torch.float64, device=DEV))
        assert _gpu_graphs.stats["captures"] > captures
        module.cpu()


@pytest.mark.parametrize("mode,opts", [
    ("LSTM", dict(layer_norm=True)),
    ("LSTM", dict(proj_size=3, proj_clip=0.2, layer_norm=True, peephole=True, cell_clip=0.3, zoneout=(0.1, 0.2))),
    ("GRU", dict(layer_norm=True, zoneout=0.3)),
])
def test_cells_with_options_on_cuda_run_the_step_kernels_and_equal_the_equations(mode, opts, monkeypatch):
    """LSTMCell / GRUCell with options on CUDA (issue 42's cell rows): one step on the layers' step
    kernels (rnn/_gpu_cell.py), the per-step equations' values and gradients in float64; float32
    without autograd close to them."""
    from fastlayers.rnn import _gpu_cell

    calls = []
    original = _gpu_cell.step
    monkeypatch.setattr(_gpu_cell, "step", lambda *a, **k: calls.append(1) or original(*a, **k))
    torch.manual_seed(0)
    cell = getattr(fastlayers, mode + "Cell")(6, 5, **opts).double().to(DEV).eval()
    size = opts.get("proj_size", 0) or 5
    x = torch.randn(4, 6, dtype=torch.float64, device=DEV)
    hx = (torch.randn(4, size, dtype=torch.float64, device=DEV), torch.randn(4, 5, dtype=torch.float64, device=DEV))
    hx = hx if mode == "LSTM" else hx[1]
    params = dict(cell.named_parameters())

    def fn(x, *states_and_params):
        states, values = states_and_params[:len(hx) if mode == "LSTM" else 1], states_and_params[-len(params):]
        return torch.func.functional_call(cell, dict(zip(params, values)), (x, states if mode == "LSTM" else states[0]))

    inputs = (x, *(hx if mode == "LSTM" else (hx,)), *params.values())
    got = _grads(fn, *inputs)
    assert len(calls) == 1
    with fastlayers.backend("reference"):
        want = _grads(fn, *inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    cell.float()
    with torch.no_grad():
        got = cell(x.float())
        with fastlayers.backend("reference"):
            want = cell(x.float())
    for a, b in zip(got if mode == "LSTM" else (got,), want if mode == "LSTM" else (want,)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cells_and_layers_with_options_inside_a_callers_cuda_graph():
    """A caller's own CUDA graph (a decoding step captured whole): LSTMCell and GRU with options run
    eagerly inside the capture, with their constants (clock, scalars) made by fills the graph owns,
    and replays on new input values equal eager calls."""
    torch.manual_seed(0)
    cell = fastlayers.LSTMCell(6, 5, layer_norm=True, peephole=True).to(DEV).eval()
    layer = fastlayers.GRU(6, 5, layer_norm=True).to(DEV).eval()
    x, seq = torch.randn(4, 6, device=DEV), torch.randn(7, 4, 6, device=DEV)
    hx = (torch.randn(4, 5, device=DEV), torch.randn(4, 5, device=DEV))
    with torch.no_grad():
        side = torch.cuda.Stream()  # warm-up on a side stream, as torch's CUDA graph notes advise
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                cell(x, hx), layer(seq)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (h, c), (y, h_n) = cell(x, hx), layer(seq)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            seq.copy_(torch.randn_like(seq))
            graph.replay()
            want = (*cell(x, hx), *layer(seq))
            for a, b in zip((h, c, y, h_n), want, strict=True):
                torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


DETERMINISTIC_OPTIONS = {
    "LSTM layer_norm + peephole + cell_clip": ("LSTM", dict(layer_norm=True, peephole=True, cell_clip=3.0)),
    "LSTM zoneout + recurrent_dropout": ("LSTM", dict(zoneout=(0.1, 0.2), recurrent_dropout=0.25)),
    "LSTM proj_size + layer_norm": ("LSTM", dict(proj_size=3, layer_norm=True)),
    "LSTM 2 layers, dropout, layer_norm + zoneout": ("LSTM", dict(num_layers=2, dropout=0.3, layer_norm=True,
                                                                  zoneout=0.1)),
    "GRU zoneout + recurrent_dropout": ("GRU", dict(zoneout=0.1, recurrent_dropout=0.2)),
    "GRU layer_norm + zoneout + recurrent_dropout": ("GRU", dict(layer_norm=True, zoneout=0.1, recurrent_dropout=0.2)),
}


@pytest.mark.parametrize("graphs", ["eager", "cuda-graphs"])
@pytest.mark.parametrize("label", list(DETERMINISTIC_OPTIONS))
def test_training_under_deterministic_algorithms_is_bitwise_repeatable(label, graphs, monkeypatch):
    """Issue 67: with torch.use_deterministic_algorithms(True), two runs of two SGD steps from one
    seed (modules as constructed, training mode: recurrent dropout and zoneout drawn, lengths, T
    over one captured chunk) give bitwise-equal outputs, input gradients and parameter gradients."""
    from fastlayers.rnn import _gpu_graphs

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv(_gpu_graphs.ENV, "1" if graphs == "cuda-graphs" else "0")
    cell, kwargs = DETERMINISTIC_OPTIONS[label]

    def two_steps():
        torch.manual_seed(0)
        m = getattr(fastlayers, cell)(6, 16, bidirectional=True, device=DEV, **kwargs).train()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        lengths = torch.tensor([45, 17, 33, 1, 40], device=DEV)
        seen = []
        for _ in range(2):
            x = torch.randn(45, 5, 6, device=DEV, requires_grad=True)
            y, _ = m(x, lengths=lengths)
            opt.zero_grad(set_to_none=True)
            (y * torch.randn_like(y)).sum().backward()
            seen += [y.detach(), x.grad] + [p.grad for p in m.parameters()]
            opt.step()
        return seen

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        first, second = two_steps(), two_steps()
    finally:
        torch.use_deterministic_algorithms(before)
    assert len(first) == len(second) and all(p is not None and bool(torch.isfinite(p).all()) for p in first)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), (label, i)


VARLEN_LENGTHS = [9, 1, 33, 4]  # T over one captured chunk (32 steps) in the third sequence


def _cu_seqlens(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


@pytest.mark.parametrize("cu_device", ["cuda", "cpu"])
@pytest.mark.parametrize("cls, kwargs", [
    (fastlayers.LSTM, dict(num_layers=2, bidirectional=True, layer_norm=True, peephole=True)),
    (fastlayers.GRU, dict(bidirectional=True, layer_norm=True, zoneout=0.1)),
    (fastlayers.LSTM, dict(bidirectional=True, batch_first=True)),
], ids=["LSTM-ln-peephole-2x2", "GRU-ln-zoneout", "LSTM-plain"])
def test_varlen_on_cuda_equals_the_padded_call_and_the_reference(cls, kwargs, cu_device):
    """Issue 66 on the GPU: the varlen form (cu_seqlens on the GPU or on the CPU) equals the padded
    call with lengths on CUDA and the float64 reference on the CPU, in value, final states and the
    gradients of the input and every parameter (modules as constructed, eval mode)."""
    torch.manual_seed(0)
    # the plain layer runs cuDNN on CUDA, whose backward needs training mode (as torch.nn.LSTM's); no dropout here
    m = cls(5, 8, dtype=torch.float64, **kwargs).train("layer_norm" not in kwargs)
    x = torch.randn(sum(VARLEN_LENGTHS), 5, dtype=torch.float64)
    cu = _cu_seqlens(VARLEN_LENGTHS)

    def run(module, values, padded):
        module.zero_grad(set_to_none=True)
        leaf = values.detach().clone().requires_grad_(True)
        if padded:
            inp = torch.nn.utils.rnn.pad_sequence(list(leaf.split(VARLEN_LENGTHS)), batch_first=module.batch_first)
            out, h = module(inp, lengths=torch.tensor(VARLEN_LENGTHS))
            out = torch.cat([out[b, :n] if module.batch_first else out[:n, b] for b, n in enumerate(VARLEN_LENGTHS)])
        else:
            out, h = module(leaf, cu_seqlens=cu.to(cu_device if values.is_cuda else "cpu"))
        states = h if isinstance(h, tuple) else (h,)
        g = torch.Generator().manual_seed(1)
        loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)).sum() for o in (out, *states))
        loss.backward()
        return [t.detach().cpu() for t in (out, *states, leaf.grad, *(p.grad for p in module.parameters()))]

    with fastlayers.backend("reference"):
        want = run(m, x, padded=False)
    m.to(DEV)
    got = run(m, x.to(DEV), padded=False)
    got_padded = run(m, x.to(DEV), padded=True)
    for a, b, c in zip(got, got_padded, want, strict=True):
        torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(b, c, atol=1e-10, rtol=1e-10)


@torch._dynamo.config.patch(allow_rnn=True)
def test_varlen_on_cuda_compiles_fullgraph_once_for_every_batch():
    """Issue 66 on the GPU: the varlen operators trace on CUDA tensors (aot_eager, dynamic shapes):
    one graph for batches of other lengths, N and B; outputs and gradients equal eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    m = fastlayers.LSTM(6, 5, bidirectional=True, layer_norm=True, device=DEV).eval()

    def call(x, cu):
        out, (h, c) = m(x, cu_seqlens=cu)
        return out, h, c

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(call, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for seed, lengths in enumerate(([3, 7, 1], [5, 2, 2, 6], [40, 4])):
        torch.manual_seed(seed)
        x = torch.randn(sum(lengths), 6, device=DEV)
        cu = _cu_seqlens(lengths, DEV)
        results = []
        for fn in (call, compiled):
            leaf = x.clone().requires_grad_(True)
            m.zero_grad(set_to_none=True)
            outs = fn(leaf, cu)
            sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
            results.append([o.detach() for o in outs] + [leaf.grad] + [p.grad for p in m.parameters()])
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == frames[:1] * 3, frames


@pytest.mark.parametrize("score", ["dot", "additive"])
def test_attention_pool_varlen_on_cuda_equals_the_padded_call(score):
    """Issue 66 on the GPU: attention pooling's varlen form on CUDA equals the padded call with
    lengths (values, weights and every gradient, float64)."""
    torch.manual_seed(0)
    pool = fastlayers.AttentionPooling(6, score=score, dtype=torch.float64, device=DEV)
    q = torch.randn(len(VARLEN_LENGTHS), 6, dtype=torch.float64, device=DEV, requires_grad=True)
    k = torch.randn(sum(VARLEN_LENGTHS), 6, dtype=torch.float64, device=DEV, requires_grad=True)
    cu = _cu_seqlens(VARLEN_LENGTHS, DEV)
    context, weights = pool(q, k, cu_seqlens=cu)
    kp = torch.nn.utils.rnn.pad_sequence(list(k.split(VARLEN_LENGTHS)), batch_first=True)
    context_pad, weights_pad = pool(q, kp, lengths=torch.tensor(VARLEN_LENGTHS, device=DEV))
    torch.testing.assert_close(context, context_pad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights, torch.cat([weights_pad[b, :n] for b, n in enumerate(VARLEN_LENGTHS)]),
                               rtol=1e-10, atol=1e-10)
    grads = torch.autograd.grad(context.square().sum(), [q, k, *pool.parameters()])
    grads_pad = torch.autograd.grad(context_pad.square().sum(), [q, k, *pool.parameters()])
    for g, g_pad in zip(grads, grads_pad, strict=True):
        torch.testing.assert_close(g, g_pad, rtol=1e-10, atol=1e-10)


def test_checkpoint_every_with_lengths_on_cuda_makes_no_more_host_syncs_than_without():
    """Issue 67: a checkpointed call's segments take their running rows and flip indices from one
    asynchronous copy per call (``_remat_segments.to_device``), so the segments add no
    synchronizing operation (before: one blocking copy per flipped segment, 101 in one call of the
    seed shape with lengths)."""
    import warnings

    def syncs(every):
        torch.manual_seed(0)
        m = fastlayers.LSTM(6, 8, bidirectional=True, layer_norm=True, checkpoint_every=every, device=DEV)
        x = torch.randn(40, 5, 6, device=DEV, requires_grad=True)
        lengths = torch.tensor([40, 17, 33, 3, 25])
        m(x, lengths=lengths)[0].sum().backward()  # the loops' captures
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                m(x, lengths=lengths)[0].sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return sum("synchronizing" in str(w.message) for w in caught)

    assert syncs(4) <= syncs(None)
