"""The locally connected Triton kernels on CPU tensors through Triton's interpreter
(TRITON_INTERPRET=1, set by conftest before any kernel is compiled), forced with
fastlayers.backend("triton"): values and every gradient against float64 references, every geometry
option, tied weights == conv, low precision.
make test runs this file poisoned under the newest Triton, the tests marked ``each_triton`` also
under Triton 3.6.0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import fastlayers  # noqa: E402
from fastlayers.functional import locally_connected1d, locally_connected2d  # noqa: E402

from grad_helpers import assert_close_all, grads  # noqa: E402
from test_local import GEOMETRIES, _random, loop_reference  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                                reason="no GPU and Triton's interpreter is off")



@pytest.mark.each_triton
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_locally_connected2d_matches_the_float64_loop(geometry, dtype):
    x, w, b, s, p, d = _random(geometry, dtype=dtype)
    with fastlayers.backend("triton"):
        got = grads(lambda x, w, b: locally_connected2d(x, w, b, s, p, d), x, w, b)
    want = grads(lambda x, w, b: loop_reference(x, w, b, s, p, d), x.double(), w.double(), b.double())
    assert_close_all(got, want, 1e-5 if dtype == torch.float32 else 1e-10)


_BLOCKS = [(1, 1, 1, 1, 1), (4, 2, 4, 8, 4), (8, 1, 8, 2, 2), (16, 4, 2, 4, 4)]


# blocks of one on two geometries (one tap, 3x3): the interpreter's slowest case
@pytest.mark.parametrize("geometry,config", [(g, c) for g in GEOMETRIES[0:3] for c in _BLOCKS
                                             if c != _BLOCKS[0] or g != GEOMETRIES[2]])
def test_locally_connected2d_forward_blocks(geometry, config, monkeypatch):
    """7 output channels and 11 sequences, 1x1 and larger kernels, with forward blocks of (sequences,
    rows, columns, output channels) that cover the output exactly, leave partial blocks at its
    edges (a partial chunk of sequences, a last group of one channel), or are larger than it.
    Blocks of one output each run on 2 channels of 3 sequences (Triton's interpreter runs a program
    at a time: 77 x the positions programs took 16 minutes of CI). Values only: the blocks are the
    forward kernel's (the backward kernels' are tested with the gradients above)."""
    from fastlayers._triton import local as kernels

    monkeypatch.setattr(kernels, "FORWARD_CONFIG", config)
    assert kernels.forward_config(11, 7, 5, 5, 9) == config
    c_out, batch = (2, 3) if config[:4] == (1, 1, 1, 1) else (7, 11)
    x, w, b, s, p, d = _random(geometry, c_in=2, c_out=c_out, batch=batch)
    with torch.no_grad():
        with fastlayers.backend("triton"):
            got = locally_connected2d(x, w, b, s, p, d)
        want = loop_reference(x, w, b, s, p, d)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_locally_connected2d_default_forward_block():
    """Up to 16 output channels and 16 sequences, rows of up to 64 columns, and for kernels of more
    than one tap as many rows as 8192 sums allow (at least one); 4 warps."""
    from fastlayers._triton import local as kernels

    assert kernels.forward_config(1024, 2, 256, 256, 1) == (16, 1, 64, 2, 4)
    assert kernels.forward_config(32, 2, 256, 256, 9) == (16, 4, 64, 2, 4)
    assert kernels.forward_config(64, 32, 64, 64, 9) == (16, 1, 64, 16, 4)
    assert kernels.forward_config(3, 2, 5, 6, 9) == (4, 8, 8, 2, 4)
    assert kernels.forward_config(1, 7, 4, 4, 1) == (1, 1, 4, 8, 4)


def test_locally_connected2d_runs_the_triton_function():
    x, w, b, s, p, d = _random(GEOMETRIES[1], dtype=torch.float32)
    with fastlayers.backend("triton"):
        y = locally_connected2d(x, w.requires_grad_(), b, s, p, d)
    assert type(y.grad_fn).__name__ == "LocallyConnected2dTritonBackward"


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_locally_connected2d_without_autograd_runs_the_kernels_directly(geometry, monkeypatch):
    """Under no_grad the kernels run without the autograd Function (its bookkeeping is host time of
    every inference call): the float64 loop's values, the Function never applied, and the kernels'
    forward run (a reference in its place passed every test before)."""
    from fastlayers.local import _gpu, _routing

    def refuse(*args):
        raise AssertionError("the autograd Function ran under no_grad")

    ran = []
    monkeypatch.setattr(_gpu.LocallyConnected2dTriton, "apply", refuse)
    monkeypatch.setattr(_routing, "triton_forward", lambda *a: ran.append(1) or _gpu.triton_forward(*a))
    x, w, b, s, p, d = _random(geometry, dtype=torch.float32)
    with fastlayers.backend("triton"), torch.no_grad():
        y = locally_connected2d(x, w.requires_grad_(), b, s, p, d)
        with torch.autocast("cpu", torch.bfloat16):
            y_low = locally_connected2d(x, w, b, s, p, d)
    assert y.grad_fn is None and y_low.dtype == torch.bfloat16 and len(ran) == 2
    want = loop_reference(x.double(), w.detach().double(), b.double(), s, p, d)
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y_low.double(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, True, False), (False, False, True)])
def test_locally_connected2d_gradient_subsets(needs):
    x, w, b, s, p, d = _random(GEOMETRIES[2], dtype=torch.float64)
    leaves = [t.clone().requires_grad_(n) for t, n in zip((x, w, b), needs)]
    with fastlayers.backend("triton"):
        y = locally_connected2d(*leaves, s, p, d)
    wanted = [t for t in leaves if t.requires_grad]
    got = torch.autograd.grad(y.sum(), wanted)
    ref_leaves = [t.clone().requires_grad_(n) for t, n in zip((x, w, b), needs)]
    want = torch.autograd.grad(loop_reference(*ref_leaves, s, p, d).sum(), [t for t in ref_leaves if t.requires_grad])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_tied_weights_equal_conv2d_and_conv1d():
    torch.manual_seed(0)
    x, conv = torch.randn(2, 3, 7, 6), torch.randn(4, 3, 3, 2)
    y_conv = F.conv2d(x, conv, stride=(2, 1), padding=1, dilation=(1, 2))
    w = conv[..., None, None].expand(*conv.shape, *y_conv.shape[2:]).contiguous()
    x1, conv1 = torch.randn(2, 3, 11), torch.randn(4, 3, 3)
    y1 = F.conv1d(x1, conv1, stride=2, padding=1)
    with fastlayers.backend("triton"):
        torch.testing.assert_close(locally_connected2d(x, w, None, (2, 1), 1, (1, 2)), y_conv, atol=1e-5, rtol=1e-5)
        w1 = conv1[..., None].expand(*conv1.shape, y1.size(2)).contiguous()
        torch.testing.assert_close(locally_connected1d(x1, w1, None, 2, 1), y1, atol=1e-5, rtol=1e-5)


@pytest.mark.each_triton
def test_locally_connected2d_low_precision_equals_the_c_kernels():
    """Rounded operands and float32 sums in both: the same bf16 results up to summation order."""
    x, w, b, s, p, d = _random(GEOMETRIES[3], dtype=torch.float32)
    fn = lambda x, w, b: locally_connected2d(x, w, b, s, p, d)  # noqa: E731
    results = {}
    for backend in ("triton", "cpu"):
        with fastlayers.backend(backend), torch.autocast("cpu", torch.bfloat16):
            results[backend] = grads(fn, x, w, b)
    assert results["triton"][0][0].dtype == torch.bfloat16
    assert_close_all(results["triton"], results["cpu"], 1e-2)



@pytest.mark.parametrize("batch, chans, kernel", [(70000, 1, 1), (2, 260, 16)])
def test_gradient_grids_stay_within_cudas_limits(batch, chans, kernel, monkeypatch):
    """CUDA grids stop at 65535 programs in y and z (2^31 - 1 in x): a batch of 70000, or C*KH*KW
    = 66560 filter taps, launched the gradient kernels on those axes (an invalid-argument launch on
    a GPU; the interpreter does not check). The launches are recorded here, not run (meta tensors)."""
    from fastlayers._triton import local as kernels

    grids = []
    monkeypatch.setattr(kernels, "launch", lambda kernel, grid, *args, **kwargs: grids.append(grid))
    size = kernel + 1
    out = (size - kernel + 1, size - kernel + 1)
    w_shape = (1, chans, kernel, kernel, *out)
    dy = torch.empty(batch, 1, *out, device="meta")
    kernels.input_grad(dy, torch.empty(w_shape, device="meta"), (batch, chans, size, size), (1, 1), (1, 1), dy.dtype)
    kernels.param_grads(dy, torch.empty(batch, chans, size, size, device="meta"), w_shape, (1, 1), (1, 1), dy.dtype)
    assert len(grids) == 2
    for grid in grids:
        assert grid[0] < 2**31 and all(g <= 65535 for g in grid[1:]), grid


@pytest.mark.parametrize("stride, padding, dilation", [(1, 0, 1), (2, 1, 2), (1, "same", 2)])
def test_locally_connected1d_values_and_gradients_equal_the_reference(stride, padding, dilation):
    torch.manual_seed(0)
    layer = fastlayers.LocallyConnected1d(3, 2, 13, 3, stride=stride, padding=padding, dilation=dilation,
                                          dtype=torch.float64)
    results = []
    for backend in ("triton", "reference"):
        x = torch.randn(4, 3, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        with fastlayers.backend(backend):
            y = layer(x)
        results.append((y, *torch.autograd.grad((y * y.detach().cos()).sum(), [x, *layer.parameters()])))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
