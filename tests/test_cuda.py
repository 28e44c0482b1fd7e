"""On a CUDA GPU (``python3 -m pytest -m cuda``; skipped without one): the automatic backend picks the
Triton kernels for the local layers and attention pooling, which equal the plain-torch reference in
value and every gradient; every layer runs under CUDA autocast (fp16, bf16) and returns the low
dtype, close to its float32 result."""

from __future__ import annotations

import pytest
import torch

import fastlayers
from fastlayers._backend import select
from fastlayers.functional import attention_pool, locally_connected2d

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
    assert select("lstm", x) == "reference"  # the engine's GPU path is open work


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


LAYERS = {
    "LSTM options": lambda: (fastlayers.LSTM(8, 16, bidirectional=True, layer_norm=True, peephole=True, device=DEV),
                             lambda m, x: m(x, lengths=torch.tensor([9, 4, 7]))[0]),
    "LSTM plain": lambda: (fastlayers.LSTM(8, 16, bidirectional=True, device=DEV), lambda m, x: m(x)[0]),
    "GRU lengths": lambda: (fastlayers.GRU(8, 16, device=DEV), lambda m, x: m(x, lengths=[9, 4, 7])[0]),
    "RNN": lambda: (fastlayers.RNN(8, 16, device=DEV), lambda m, x: m(x)[0]),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(LAYERS))
def test_recurrent_layers_under_cuda_autocast(name, dtype):
    torch.manual_seed(0)
    m, fn = LAYERS[name]()
    x = torch.randn(9, 3, 8, device=DEV)
    with torch.autocast("cuda", dtype):
        low = fn(m, x)
    assert low.dtype == dtype
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
