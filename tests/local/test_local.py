"""Locally connected layers: tied weights == conv, explicit float64 loop, gradcheck, errors."""

import itertools
import re
import warnings

import pytest
import torch
from hypothesis import assume, given, strategies as st

from fastlayers import LocallyConnected1d, LocallyConnected2d
from fastlayers._core.backend import select
from fastlayers.local import locally_connected2d_reference
from fastlayers.functional import locally_connected1d, locally_connected2d
from fastlayers.local import output_size


def loop_reference(x, w, b, stride, padding, dilation):
    """Explicit float64 loop over every output element (independent of both implementations)."""
    x = x.double()
    bsz, c_in, h, wd = x.shape
    c_out, _, kh, kw, oh, ow = w.shape
    xp = torch.zeros(bsz, c_in, h + 2 * padding[0], wd + 2 * padding[1], dtype=torch.float64)
    xp[:, :, padding[0] : padding[0] + h, padding[1] : padding[1] + wd] = x
    y = torch.zeros(bsz, c_out, oh, ow, dtype=torch.float64)
    for i, j in itertools.product(range(oh), range(ow)):
        for p, q in itertools.product(range(kh), range(kw)):
            patch = xp[:, :, i * stride[0] + p * dilation[0], j * stride[1] + q * dilation[1]]  # (B, C)
            y[:, :, i, j] += patch @ w[:, :, p, q, i, j].double().T
        if b is not None:
            y[:, :, i, j] += b[:, i, j].double()
    return y


GEOMETRIES = [
    # (H, W, kernel, stride, padding, dilation)
    (5, 6, (1, 1), (1, 1), (0, 0), (1, 1)),
    (6, 5, (3, 3), (1, 1), (1, 1), (1, 1)),
    (7, 8, (3, 2), (2, 1), (0, 1), (1, 2)),
    (9, 7, (2, 3), (2, 3), (2, 0), (2, 1)),
]


def _random(geometry, c_in=3, c_out=2, batch=2, dtype=torch.float64, seed=0):
    h, w, k, s, p, d = geometry
    oh, ow = output_size((h, w), k, s, p, d)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, c_in, h, w, generator=g, dtype=dtype)
    weight = torch.randn(c_out, c_in, *k, oh, ow, generator=g, dtype=dtype)
    bias = torch.randn(c_out, oh, ow, generator=g, dtype=dtype)
    return x, weight, bias, s, p, d


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_explicit_loop(geometry, dtype):
    x, w, b, s, p, d = _random(geometry, dtype=dtype)
    want = loop_reference(x, w, b, s, p, d)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(locally_connected2d(x, w, b, s, p, d).double(), want, **tol)
    torch.testing.assert_close(locally_connected2d_reference(x, w, b, s, p, d).double(), want, **tol)


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_tied_weights_equal_conv2d(geometry):
    h, wd, k, s, p, d = geometry
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, k, s, p, d)
    oh, ow = output_size((h, wd), k, s, p, d)
    x = torch.randn(2, 3, h, wd)
    tied_w = conv.weight[..., None, None].expand(-1, -1, -1, -1, oh, ow)
    tied_b = conv.bias[:, None, None].expand(-1, oh, ow)
    torch.testing.assert_close(locally_connected2d(x, tied_w, tied_b, s, p, d), conv(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_large_output_with_streaming_stores_equals_reference(dtype):
    """Outputs of 8 MiB and more are written with streaming stores (x86): same values."""
    torch.manual_seed(0)
    x = torch.rand(32, 2, 128, 256, dtype=dtype)
    weight = torch.randn(2, 2, 1, 1, 128, 256, dtype=dtype)
    bias = torch.randn(2, 128, 256, dtype=dtype)
    y = locally_connected2d(x, weight, bias)
    assert y.numel() * y.element_size() >= 8 << 20
    want = torch.einsum("bchw,ochw->bohw", x, weight[:, :, 0, 0]) + bias
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def test_many_filter_elements_on_a_small_thread_stack():
    """C * KH * KW in the hundreds of thousands (one 8-byte input offset each): the kernels' table
    of offsets lives on the heap; as a stack array it overflowed a thread's stack (segfault: from
    about a million elements on an 8 MiB main thread, here 180000 on a 1 MiB thread), forward,
    the no-grad operator and the parameters' backward."""
    import threading

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 20000, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 20000, 3, 3, 1, 1, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 1, 1, generator=g, dtype=torch.float64, requires_grad=True)
    results = {}

    def run():
        with torch.no_grad():
            results["no_grad"] = locally_connected2d(x, weight, bias)
        y = locally_connected2d(x, weight, bias)
        results["grad"] = (y, *torch.autograd.grad(y.sum(), (x, weight, bias)))

    previous = threading.stack_size(1 << 20)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    finally:
        threading.stack_size(previous)
    want = torch.einsum("bchw,ochw->bo", x, weight[..., 0, 0]).reshape(2, 2, 1, 1) + bias
    torch.testing.assert_close(results["no_grad"], want, rtol=1e-10, atol=1e-10)
    y, dx, dw, db = results["grad"]
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dx, weight.detach()[..., 0, 0].sum(0).expand(2, -1, -1, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, x.detach().sum(0).expand(2, -1, -1, -1).unsqueeze(-1).unsqueeze(-1),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(db, torch.full((2, 1, 1), 2.0, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("c_out", [1, 2, 3, 5])
@pytest.mark.parametrize("geometry", [(6, 40, (1, 1), (1, 1), (0, 0), (1, 1)),
                                      (7, 37, (3, 3), (2, 1), (1, 1), (1, 2)),
                                      (5, 13, (3, 3), (1, 1), (1, 1), (1, 1))])
def test_vector_tiles_and_channel_pairs_match_reference(dtype, c_out, geometry):
    """Rows wide enough for the C kernels' tiles of four vectors, then single vectors, then a scalar
    tail (OW 40, 35 and 13: narrower than a tile), output channels in pairs and an odd one alone:
    values and all three gradients vs the float64 twin, and the values without a bias."""
    x, w, b, s, p, d = _random(geometry, c_in=3, c_out=c_out, batch=5, dtype=dtype, seed=c_out)
    torch.testing.assert_close(locally_connected2d(x, w, None, s, p, d).double(),
                               locally_connected2d_reference(x.double(), w.double(), None, s, p, d),
                               **(dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else {}))
    tensors = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
    wide = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    y = locally_connected2d(*tensors, s, p, d)
    want = locally_connected2d_reference(*wide, s, p, d)
    cot = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y.backward(cot.to(dtype))
    want.backward(cot)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(y.double(), want.detach(), **tol)
    for got, ref in zip(tensors, wide):
        torch.testing.assert_close(got.grad.double(), ref.grad, **tol)


def test_tied_weights_equal_conv1d():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(3, 2, 3, stride=2, padding=1, dilation=2)
    x = torch.randn(4, 3, 11)
    out_len = conv(x).size(-1)
    y = locally_connected1d(x, conv.weight[..., None].expand(-1, -1, -1, out_len),
                            conv.bias[:, None].expand(-1, out_len), 2, 1, 2)
    torch.testing.assert_close(y, conv(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("impl", ["dispatch", "reference"])
def test_gradcheck(geometry, impl):
    x, w, b, s, p, d = _random(geometry, c_in=2, batch=2)
    fn = locally_connected2d if impl == "dispatch" else locally_connected2d_reference
    inputs = tuple(t.requires_grad_(True) for t in (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: fn(x, w, b, s, p, d), inputs)


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, True, False), (True, True, True)])
def test_needs_input_grad_subsets(needs):
    x, w, b, s, p, d = _random(GEOMETRIES[2])
    leaves = [t.requires_grad_(n) for t, n in zip((x, w, b), needs)]
    y = locally_connected2d(*leaves, s, p, d)
    cot = torch.randn_like(y)
    got = torch.autograd.grad(y, [t for t in leaves if t.requires_grad], cot)
    ref_leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    y_ref = locally_connected2d_reference(*ref_leaves, s, p, d)
    want = torch.autograd.grad(y_ref, [t for t in ref_leaves if t.requires_grad], cot)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_native_kernel_is_used_on_cpu():
    x, w, b, s, p, d = _random(GEOMETRIES[0], dtype=torch.float32)
    assert select("local2d", x) == "cpu", "the C kernel should build on this machine (gcc is part of the set-up)"
    y = locally_connected2d(x, w.requires_grad_(True), b, s, p, d)
    assert type(y.grad_fn).__name__ == "LocallyConnected2dNativeBackward"  # the C kernels (eager)


@given(h=st.integers(1, 7), w=st.integers(1, 7), kh=st.integers(1, 3), kw=st.integers(1, 3), sh=st.integers(1, 3),
       sw=st.integers(1, 3), ph=st.integers(0, 2), pw=st.integers(0, 2), dh=st.integers(1, 2), dw=st.integers(1, 2),
       c_in=st.integers(1, 3), c_out=st.integers(1, 3), batch=st.integers(1, 3), seed=st.integers(0, 100))
def test_hypothesis_random_geometry(h, w, kh, kw, sh, sw, ph, pw, dh, dw, c_in, c_out, batch, seed):
    # a kernel larger than the padded input is refused (the error tests): not a geometry to run
    assume((h + 2 * ph - dh * (kh - 1) - 1) >= 0 and (w + 2 * pw - dw * (kw - 1) - 1) >= 0)
    output_size((h, w), (kh, kw), (sh, sw), (ph, pw), (dh, dw))
    x, wt, b, s, p, d = _random((h, w, (kh, kw), (sh, sw), (ph, pw), (dh, dw)), c_in, c_out, batch, seed=seed)
    torch.testing.assert_close(locally_connected2d(x, wt, b, s, p, d), loop_reference(x, wt, b, s, p, d))
    leaves = [t.clone().requires_grad_(True) for t in (x, wt, b)]
    ref = [t.clone().requires_grad_(True) for t in (x, wt, b)]
    cot = torch.randn(batch, c_out, *wt.shape[-2:], dtype=torch.float64)
    g1 = torch.autograd.grad(locally_connected2d(*leaves, s, p, d), leaves, cot)
    g2 = torch.autograd.grad(locally_connected2d_reference(*ref, s, p, d), ref, cot)
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e)


def test_modules_shapes_init_and_unbatched():
    torch.manual_seed(0)
    m = LocallyConnected2d(4, 2, (8, 6), kernel_size=3, padding=1, stride=(2, 1))
    assert m.weight.shape == (2, 4, 3, 3, 4, 6) and m.bias.shape == (2, 4, 6)
    bound = 1 / (4 * 9) ** 0.5
    assert m.weight.abs().max() <= bound and m.bias.abs().max() <= bound
    x = torch.randn(3, 4, 8, 6)
    y = m(x)
    assert y.shape == (3, 2, 4, 6)
    torch.testing.assert_close(m(x[0]), y[0])
    m1 = LocallyConnected1d(3, 5, 10, kernel_size=3)
    assert m1.weight.shape == (5, 3, 3, 8) and m1.bias.shape == (5, 8)
    x1 = torch.randn(2, 3, 10)
    w2 = m1.weight.detach().unsqueeze(2).unsqueeze(4)
    torch.testing.assert_close(m1(x1), loop_reference(x1.unsqueeze(2), w2, m1.bias.detach().unsqueeze(1), (1, 1),
                                                       (0, 0), (1, 1)).squeeze(2).float(), atol=1e-5, rtol=1e-5)


def test_errors():
    m = LocallyConnected2d(4, 2, (8, 6), kernel_size=3)
    with pytest.raises(ValueError, match=r"input: expected spatial size \(8, 6\) \(input_size\), got \(8, 7\)"):
        m(torch.randn(1, 4, 8, 7))
    with pytest.raises(ValueError, match=r"input: expected C_in = 4 channels .* got 3"):
        m(torch.randn(1, 3, 8, 6))
    with pytest.raises(ValueError, match=r"kernel_size: the dilated kernel spans 5 but the padded input is only 4"):
        LocallyConnected2d(1, 1, (4, 9), kernel_size=3, dilation=2)
    with pytest.raises(ValueError, match=r"stride: expected every value >= 1, got 0"):
        LocallyConnected2d(1, 1, 5, stride=0)
    with pytest.raises(ValueError, match=r"dilation: expected every value >= 1, got \(1, 0\)"):
        LocallyConnected2d(1, 1, 5, dilation=(1, 0))
    with pytest.raises(ValueError, match=r"padding: expected every value >= 0, got -1"):
        LocallyConnected2d(1, 1, 5, padding=-1)
    with pytest.raises(TypeError, match=r"kernel_size: expected an int or a tuple of 2 ints, got \(1, 2, 3\)"):
        LocallyConnected2d(1, 1, 5, kernel_size=(1, 2, 3))
    with pytest.raises(TypeError, match=r"stride: expected an int or a tuple of 2 ints, got 1.0"):  # (not "'float'
        LocallyConnected2d(1, 1, 5, stride=1.0)  # object is not iterable")
    with pytest.raises(TypeError, match=r"dilation: expected an int or a tuple of 1 ints, got 2.0"):
        LocallyConnected1d(1, 1, 5, dilation=2.0)
    x, w, b, s, p, d = _random(GEOMETRIES[1])
    with pytest.raises(ValueError, match=r"input: spatial size \(6, 6\) gives output size \(6, 6\) .* weight is for "
                                         r"output size \(6, 5\)"):
        locally_connected2d(torch.randn(2, 3, 6, 6, dtype=torch.float64), w, b, s, p, d)
    with pytest.raises(ValueError, match=r"bias: expected shape \(2, 6, 5\) \(C_out, OH, OW\), got \(2, 5\)"):
        locally_connected2d(x, w, b[:, 0], s, p, d)
    with pytest.raises(TypeError, match=r"weight: expected dtype torch.float64 .* got torch.float32"):
        locally_connected2d(x, w.float(), b, s, p, d)
    with pytest.raises(TypeError, match=r"input: expected a floating-point tensor"):
        locally_connected2d(x.long(), w, b, s, p, d)
    for module, shape in ((LocallyConnected2d(2, 3, (5, 4), 2, dtype=torch.complex64), (3, 2, 5, 4)),
                          (LocallyConnected1d(2, 3, 7, 3, dtype=torch.complex64), (3, 2, 7))):
        for z in (torch.randn(shape, dtype=torch.complex64), torch.randn(shape[1:], dtype=torch.complex64)):
            with pytest.raises(TypeError, match=r"input: expected a floating-point tensor, got dtype torch.complex64"):
                module(z)  # (a batched call took the module's fast path, which ran it)
    with pytest.raises(ValueError, match=r"weight: expected a 6-D tensor"):
        locally_connected2d(x, w[0], b, s, p, d)
    with pytest.raises(ValueError, match=r"input: expected a 3-D \(B, C_in, L\)"):
        LocallyConnected1d(1, 1, 5)(torch.randn(1, 1, 1, 5))
    # another rank gets the rank error, not a spatial-size one about its last dims
    with pytest.raises(ValueError, match=r"input: expected a 4-D \(B, C_in, H, W\) or 3-D \(C_in, H, W\) tensor, got 5-D"):
        m(torch.randn(1, 4, 8, 6, 1))
    with pytest.raises(ValueError, match=r"input: expected a 4-D \(B, C_in, H, W\) or 3-D \(C_in, H, W\) tensor, got 2-D"):
        m(torch.randn(8, 6))
    with pytest.raises(ValueError, match=r"input: expected a 3-D \(B, C_in, L\) or 2-D \(C_in, L\) tensor, got 1-D"):
        LocallyConnected1d(1, 1, 5)(torch.randn(5))


TORCH_MIRRORED = {  # bad input -> (ours, the same input to torch.nn's convolution)
    "rank 5-D": (lambda: LocallyConnected2d(4, 2, (8, 6), 3)(torch.randn(1, 4, 8, 6, 1)),
                 lambda: torch.nn.Conv2d(4, 2, 3)(torch.randn(1, 4, 8, 6, 1))),
    "rank 2-D": (lambda: LocallyConnected2d(4, 2, (8, 6), 3)(torch.randn(8, 6)),
                 lambda: torch.nn.Conv2d(4, 2, 3)(torch.randn(8, 6))),
    "channels": (lambda: LocallyConnected2d(4, 2, (8, 6), 3)(torch.randn(1, 3, 8, 6)),
                 lambda: torch.nn.Conv2d(4, 2, 3)(torch.randn(1, 3, 8, 6))),
    "channels unbatched": (lambda: LocallyConnected2d(4, 2, (8, 6), 3)(torch.randn(3, 8, 6)),
                           lambda: torch.nn.Conv2d(4, 2, 3)(torch.randn(3, 8, 6))),
    "kernel > padded input": (lambda: LocallyConnected2d(1, 1, (4, 9), kernel_size=3, dilation=2),
                              lambda: torch.nn.Conv2d(1, 1, 3, dilation=2)(torch.randn(1, 1, 4, 9))),
    "stride 0": (lambda: LocallyConnected2d(1, 1, 5, stride=0),
                 lambda: torch.nn.Conv2d(1, 1, 1, stride=0)(torch.randn(1, 1, 5, 5))),
    "padding -1": (lambda: LocallyConnected2d(1, 1, 5, padding=-1),
                   lambda: torch.nn.Conv2d(1, 1, 1, padding=-1)(torch.randn(1, 1, 5, 5))),
    "dilation (1, 0)": (lambda: LocallyConnected2d(1, 1, 5, dilation=(1, 0)),
                        lambda: torch.nn.Conv2d(1, 1, 1, dilation=(1, 0))(torch.randn(1, 1, 5, 5))),
    "1-D rank": (lambda: LocallyConnected1d(1, 1, 5)(torch.randn(1, 1, 1, 5)),
                 lambda: torch.nn.Conv1d(1, 1, 1)(torch.randn(1, 1, 1, 5))),
    "1-D channels": (lambda: LocallyConnected1d(2, 1, 5, 3)(torch.randn(1, 1, 5)),
                     lambda: torch.nn.Conv1d(2, 1, 3)(torch.randn(1, 1, 5))),
    "1-D kernel > padded input": (lambda: LocallyConnected1d(1, 1, 4, kernel_size=3, dilation=2),
                                  lambda: torch.nn.Conv1d(1, 1, 3, dilation=2)(torch.randn(1, 1, 4))),
    "1-D functional channels": (lambda: locally_connected1d(torch.randn(4, 3, 8), torch.randn(3, 2, 3, 6)),
                                lambda: torch.nn.functional.conv1d(torch.randn(4, 3, 8), torch.randn(3, 2, 3))),
}


@pytest.mark.parametrize("bad", list(TORCH_MIRRORED))
def test_errors_torch_convolutions_raise_too_carry_their_class_and_message(bad):
    """Where torch.nn's convolution refuses the same input, ours raises its class (RuntimeError, and
    ValueError as before) with its message first, ours after it. Two words differ: the operator's
    name (locally_connected2d for conv2d) and the weight's size, which is ours."""
    ours, theirs = TORCH_MIRRORED[bad]
    with pytest.raises(RuntimeError) as torch_error:
        theirs()
    with pytest.raises(RuntimeError) as our_error:
        ours()
    assert isinstance(our_error.value, ValueError)

    def torch_form(message: str) -> str:
        return re.sub(r"weight of size \[[^\]]*\]", "weight of size [...]", message).replace("locally_connected", "conv")

    assert torch_form(str(our_error.value)).startswith(torch_form(str(torch_error.value)) + "; ")


def _double(x):
    return x.double()


TORCH_MIRRORED_ANY_CLASS = {  # as TORCH_MIRRORED, for torch's other classes (dtype, argument and size errors)
    "float64 input, float32 bias": (lambda: LocallyConnected2d(2, 3, 5, 3)(torch.randn(1, 2, 5, 5).double()),
                                    lambda: torch.nn.Conv2d(2, 3, 3)(torch.randn(1, 2, 5, 5).double())),
    "float64 input, no bias": (lambda: LocallyConnected2d(2, 3, 5, 3, bias=False)(torch.randn(1, 2, 5, 5).double()),
                               lambda: torch.nn.Conv2d(2, 3, 3, bias=False)(torch.randn(1, 2, 5, 5).double())),
    "integer input": (lambda: LocallyConnected2d(2, 3, 5, 3)(torch.ones(1, 2, 5, 5, dtype=torch.long)),
                      lambda: torch.nn.Conv2d(2, 3, 3)(torch.ones(1, 2, 5, 5, dtype=torch.long))),
    "integer input, no bias": (lambda: LocallyConnected2d(2, 3, 5, 3, bias=False)(torch.ones(2, 5, 5, dtype=torch.long)),
                               lambda: torch.nn.Conv2d(2, 3, 3, bias=False)(torch.ones(2, 5, 5, dtype=torch.long))),
    "half input": (lambda: LocallyConnected2d(2, 3, 5, 3)(torch.randn(1, 2, 5, 5).half()),
                   lambda: torch.nn.Conv2d(2, 3, 3)(torch.randn(1, 2, 5, 5).half())),
    "float64 module, float32 input": (lambda: LocallyConnected2d(2, 3, 5, 3).double()(torch.randn(1, 2, 5, 5)),
                                      lambda: torch.nn.Conv2d(2, 3, 3).double()(torch.randn(1, 2, 5, 5))),
    "1-D float64 input": (lambda: LocallyConnected1d(2, 3, 7, 3)(torch.randn(1, 2, 7).double()),
                          lambda: torch.nn.Conv1d(2, 3, 3)(torch.randn(1, 2, 7).double())),
    "1-D functional channels before the weight's dtype": (
        lambda: locally_connected1d(torch.randn(4, 3, 8).double(), torch.randn(3, 2, 3, 6)),
        lambda: torch.nn.functional.conv1d(torch.randn(4, 3, 8).double(), torch.randn(3, 2, 3))),
    "bias dtype before the rank": (lambda: LocallyConnected2d(2, 3, 5, 3)(torch.randn(1, 2, 5, 5, 1).double()),
                                   lambda: torch.nn.Conv2d(2, 3, 3)(torch.randn(1, 2, 5, 5, 1).double())),
    "bias dtype before the kernel size": (lambda: LocallyConnected1d(2, 3, 5, 3)(torch.randn(1, 2, 2).double()),
                                          lambda: torch.nn.Conv1d(2, 3, 3)(torch.randn(1, 2, 2).double())),
    "the kernel size before the weight's dtype": (
        lambda: LocallyConnected2d(2, 3, 5, 3, bias=False)(torch.randn(1, 2, 2, 2).double()),
        lambda: torch.nn.Conv2d(2, 3, 3, bias=False)(torch.randn(1, 2, 2, 2).double())),
    "channels before spatial size": (lambda: LocallyConnected2d(4, 2, (8, 6), 3)(torch.randn(1, 3, 9, 9)),
                                     lambda: torch.nn.Conv2d(4, 2, 3)(torch.randn(1, 3, 9, 9))),
    "dtype before spatial size": (lambda: LocallyConnected2d(4, 2, (8, 6), 3, bias=False)(torch.randn(1, 4, 9, 9).double()),
                                  lambda: torch.nn.Conv2d(4, 2, 3, bias=False)(torch.randn(1, 4, 9, 9).double())),
    "input smaller than the kernel": (lambda: LocallyConnected2d(1, 1, 5, 3)(torch.randn(1, 1, 2, 2)),
                                      lambda: torch.nn.Conv2d(1, 1, 3)(torch.randn(1, 1, 2, 2))),
    "1-D input smaller than the kernel": (lambda: LocallyConnected1d(1, 1, 5, 3)(torch.randn(1, 1, 2)),
                                          lambda: torch.nn.Conv1d(1, 1, 3)(torch.randn(1, 1, 2))),
    "stride of 3 values": (lambda: LocallyConnected2d(1, 1, 5, stride=(1, 1, 1)),
                           lambda: torch.nn.Conv2d(1, 1, 1, stride=(1, 1, 1))(torch.randn(1, 1, 5, 5))),
    "functional padding of 3 values": (
        lambda: locally_connected2d(torch.randn(1, 1, 5, 5), torch.randn(1, 1, 1, 1, 5, 5), padding=[0, 0, 0]),
        lambda: torch.nn.functional.conv2d(torch.randn(1, 1, 5, 5), torch.randn(1, 1, 1, 1), padding=[0, 0, 0])),
    "1-D stride of 2 values": (lambda: LocallyConnected1d(1, 1, 5, stride=(1, 1)),
                               lambda: torch.nn.Conv1d(1, 1, 1, stride=(1, 1))(torch.randn(1, 1, 5))),
    "negative in_channels": (lambda: LocallyConnected2d(-1, 3, 5, 3), lambda: torch.nn.Conv2d(-1, 3, 3)),
    "negative out_channels": (lambda: LocallyConnected1d(2, -2, 5, 3), lambda: torch.nn.Conv1d(2, -2, 3)),
}


@pytest.mark.parametrize("bad", list(TORCH_MIRRORED_ANY_CLASS))
def test_errors_of_torchs_other_classes_carry_its_class_and_message(bad):
    """A wrong dtype (torch's "Input type (double) and bias type (float) should be the same" was not
    said), a stride of the wrong length, negative channels, and the checks' order (the module's
    spatial size was checked before the dtype and the channels)."""
    ours, theirs = TORCH_MIRRORED_ANY_CLASS[bad]
    with pytest.raises(Exception) as torch_error:
        theirs()
    with pytest.raises(torch_error.type) as our_error:
        ours()

    def torch_form(message: str) -> str:
        return re.sub(r"weight of size \[[^\]]*\]", "weight of size [...]", message).replace("locally_connected", "conv")

    assert torch_form(str(our_error.value)).startswith(torch_form(str(torch_error.value)) + "; ")


def test_one_value_tuples_expand_as_conv2ds_and_float_channels_are_a_type_error():
    """F.conv2d and nn.Conv2d take stride=(2,) (one value for both dims); ours raised TypeError."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(2, 3, 3, stride=(2,), padding=(1,), dilation=(1,), dtype=torch.float64)
    layer = LocallyConnected2d(2, 3, 7, 3, stride=(2,), padding=(1,), dilation=(1,), dtype=torch.float64)
    assert layer.stride == (2, 2) and layer.padding == (1, 1) and layer.dilation == (1, 1)
    x = torch.randn(2, 2, 7, 7, dtype=torch.float64)
    oh, ow = layer.output_size
    assert (oh, ow) == tuple(conv(x).shape[2:])
    with torch.no_grad():
        layer.weight.copy_(conv.weight[..., None, None].expand(-1, -1, -1, -1, oh, ow))
        layer.bias.copy_(conv.bias[:, None, None].expand(-1, oh, ow))
    torch.testing.assert_close(layer(x), conv(x))
    torch.testing.assert_close(locally_connected2d(x, layer.weight, layer.bias, [2], [1], [1]), conv(x))
    for channels in ((2.0, 3), (2, 3.0)):
        with pytest.raises(TypeError, match=r"_channels: expected an int >= 0, got 3?\.0|_channels: expected an int "
                                            r">= 0, got 2\.0"):
            LocallyConnected2d(*channels, 5, 3)


def test_1d_module_holds_no_replaced_parameters_memory_through_training_calls():
    """The kept 2-D views of a no-grad call held a replaced weight's memory until the next no-grad
    call: training calls (which make their own views) never dropped them (70.9 MiB held in one
    audit). A training call now drops kept views of parameters since replaced."""
    m = LocallyConnected1d(2, 3, 8, kernel_size=3)
    x = torch.randn(4, 2, 8)
    with torch.no_grad():
        m(x)
    old = {p.untyped_storage().data_ptr() for p in (m.weight, m.bias)}

    def held():
        return {t.untyped_storage().data_ptr() for v in m.__dict__.values() if isinstance(v, tuple)
                for t in v if isinstance(t, torch.Tensor)}

    assert held() & old  # (the premise: the views are kept)
    m.weight = torch.nn.Parameter(m.weight.detach().clone())
    m.bias = torch.nn.Parameter(m.bias.detach().clone())
    m(x).sum().backward()
    assert not held() & old
    with torch.no_grad():  # (and kept again, of the new parameters, by the next no-grad call)
        torch.testing.assert_close(m(x), locally_connected1d(x, m.weight, m.bias))
    assert held() == {p.untyped_storage().data_ptr() for p in (m.weight, m.bias)}


def test_1d_module_follows_its_parameters_between_no_grad_calls():
    """The module's 2-D views of its parameters (kept between calls without autograd) follow in-place
    updates, a replaced parameter and a replaced ``.data``; gradients still reach the parameters."""
    torch.manual_seed(0)
    m = LocallyConnected1d(2, 3, 8, kernel_size=3)
    x = torch.randn(4, 2, 8)

    def expected():
        return locally_connected2d_reference(x.unsqueeze(-2), m.weight.detach().unsqueeze(2).unsqueeze(4),
                                             m.bias.detach().unsqueeze(1), (1, 1), (0, 0), (1, 1)).squeeze(-2)

    with torch.no_grad():
        torch.testing.assert_close(m(x), expected())
        m.weight.mul_(2)
        torch.testing.assert_close(m(x), expected())
        m.weight = torch.nn.Parameter(torch.randn_like(m.weight))
        torch.testing.assert_close(m(x), expected())
        m.bias.data = torch.randn_like(m.bias)
        torch.testing.assert_close(m(x), expected())
        m.weight.data = torch.randn_like(m.weight)  # (the same Parameter, new memory)
        torch.testing.assert_close(m(x), expected())
    m(x).sum().backward()
    assert m.weight.grad is not None and m.bias.grad is not None and bool(m.bias.grad.abs().sum() > 0)


def test_1d_module_views_survive_transforms_compile_conversion_and_pickling():
    """The 2-D views LocallyConnected1d keeps between calls without autograd (after one such call):
    torch.func over its parameters under no_grad ("Cannot access data pointer of Tensor that doesn't
    have storage"), torch.compile fullgraph ("Data pointer comparison"), a conversion with
    parameter swapping (the kept reference failed swap_tensors' use-count check), a replaced weight
    (kept alive), and pickling the module: each as without the views, as LocallyConnected2d."""
    import copy
    import gc
    import pickle
    import weakref

    from torch.func import functional_call, stack_module_state, vmap

    torch.manual_seed(0)
    models = [LocallyConnected1d(2, 3, 9, kernel_size=3) for _ in range(2)]
    m, x = models[0], torch.randn(4, 2, 9)
    with torch.no_grad():
        want = m(x)
        params, _ = stack_module_state(models)
        got = vmap(lambda p, x: functional_call(m, p, (x,)), in_dims=(0, None))(params, x)
        torch.testing.assert_close(got, torch.stack([models[0](x), models[1](x)]))
        compiled = torch.compile(m, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x), want)
        torch.testing.assert_close(compiled(torch.randn(5, 2, 9)).shape, (5, 3, 7))
    torch.testing.assert_close(pickle.loads(pickle.dumps(m))(x), want)
    torch.testing.assert_close(copy.deepcopy(m)(x), want)
    old = weakref.ref(m.weight)
    m.weight = torch.nn.Parameter(torch.randn_like(m.weight))
    with torch.no_grad():
        m(x)
    gc.collect()
    assert old() is None, "the replaced weight is kept alive"
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.double()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        torch.testing.assert_close(m(x.double()), functional_call(m, dict(m.named_parameters()), (x.double(),)))
    assert m.weight.dtype == torch.float64


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
@pytest.mark.parametrize("kernel, dilation", [((3, 3), (1, 1)), ((2, 4), (1, 1)), ((2, 3), (3, 2)), ((1, 1), (1, 1))])
def test_padding_strings_as_conv2d(kernel, dilation, backend):
    """padding="same" / "valid" as nn.Conv2d and F.conv2d take them: tied weights give the
    convolution's values and gradients, an odd total padding's extra row / column after the input."""
    import fastlayers

    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64)
    for padding in ("same", "valid"):
        conv = torch.nn.Conv2d(3, 4, kernel, padding=padding, dilation=dilation, dtype=torch.float64)
        layer = LocallyConnected2d(3, 4, (7, 6), kernel, padding=padding, dilation=dilation, dtype=torch.float64)
        assert layer.padding == padding == conv.padding and f"padding={padding}," in repr(layer)
        oh, ow = layer.output_size
        assert (oh, ow) == tuple(conv(x).shape[2:])
        with torch.no_grad():
            layer.weight.copy_(conv.weight[..., None, None].expand(-1, -1, -1, -1, oh, ow))
            layer.bias.copy_(conv.bias[:, None, None].expand(-1, oh, ow))
        want_x = x.clone().requires_grad_()
        want = conv(want_x)
        want.square().sum().backward()
        with fastlayers.backend(backend):
            for call in (layer, lambda t: locally_connected2d(t, layer.weight, layer.bias, 1, padding, dilation)):
                got_x = x.clone().requires_grad_()
                got = call(got_x)
                torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
                got.square().sum().backward()
                torch.testing.assert_close(got_x.grad, want_x.grad, atol=1e-12, rtol=1e-12)
            # unbatched: the module's full checks
            torch.testing.assert_close(layer(x[1]), want[1], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kernel, dilation", [(4, 1), (3, 2), (2, 3)])
def test_padding_strings_as_conv1d(kernel, dilation):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, dtype=torch.float64)
    conv = torch.nn.Conv1d(3, 2, kernel, padding="same", dilation=dilation, dtype=torch.float64)
    layer = LocallyConnected1d(3, 2, 11, kernel, padding="same", dilation=dilation, dtype=torch.float64)
    assert layer.padding == "same" and layer.output_size == (11,)
    with torch.no_grad():
        layer.weight.copy_(conv.weight[..., None].expand(-1, -1, -1, 11))
        layer.bias.copy_(conv.bias[:, None].expand(-1, 11))
    torch.testing.assert_close(layer(x), conv(x), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(layer(x[0]), conv(x[0]), atol=1e-12, rtol=1e-12)  # (the full checks' path)
    torch.testing.assert_close(locally_connected1d(x, layer.weight, layer.bias, 1, "same", dilation), conv(x),
                               atol=1e-12, rtol=1e-12)


def test_padding_string_errors_as_torchs():
    for ours, theirs in ((lambda: LocallyConnected2d(1, 1, 5, 2, stride=2, padding="same"),
                          lambda: torch.nn.Conv2d(1, 1, 2, stride=2, padding="same")),
                         (lambda: LocallyConnected1d(1, 1, 5, 2, padding="full"),
                          lambda: torch.nn.Conv1d(1, 1, 2, padding="full"))):
        with pytest.raises(ValueError) as torch_error:
            theirs()
        with pytest.raises(ValueError) as our_error:
            ours()
        # (torch prints a set of the two strings: their order follows the process's string hashing)
        same_set = "{'same', 'valid'}"
        assert str(our_error.value) == str(torch_error.value).replace("{'valid', 'same'}", same_set)
    x, w = torch.randn(1, 1, 5, 5), torch.randn(1, 1, 2, 2)
    for kwargs in (dict(stride=2, padding="same"), dict(padding="SAME")):
        with pytest.raises(RuntimeError) as torch_error:
            torch.nn.functional.conv2d(x, w, **kwargs)
        with pytest.raises(RuntimeError, match=re.escape(str(torch_error.value))):
            locally_connected2d(x, torch.randn(1, 1, 2, 2, 5, 5), **kwargs)


@pytest.mark.parametrize("c_in,c_out", [(0, 2), (2, 0)])
@pytest.mark.parametrize("grad", [False, True])
def test_no_channel_in_or_out(c_in, c_out, grad):
    """A weight with no input or no output channel: the bias broadcast, or an empty output, as the
    reference gives (the C kernel divided by a zero row size and the process died of SIGFPE)."""
    x, w, b = torch.randn(2, c_in, 5, 5), torch.randn(c_out, c_in, 3, 3, 3, 3), torch.randn(c_out, 3, 3)
    with torch.set_grad_enabled(grad):
        y = locally_connected2d(x.requires_grad_(grad), w, b)
    assert y.shape == (2, c_out, 3, 3) and torch.equal(y, b.expand(2, c_out, 3, 3))


def test_module_bias_on_another_device_is_refused():
    """The module's fast path checked the bias's shape and dtype, not its device: a bias elsewhere
    reached the kernels (dropped with autograd, uninitialised output without)."""
    m = LocallyConnected2d(3, 4, (6, 6), 3)
    m.bias = torch.nn.Parameter(torch.empty(4, 4, 4, device="meta"))
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=r"bias: expected device cpu"):
            m(torch.randn(2, 3, 6, 6))


def test_reference_sums_low_precision_taps_in_float32():
    """bf16 operands on the reference backend: the products and the sum over taps in float32, one
    rounding at the end (a hardware bf16 einsum per tap rounded each tap's sum: 42% of the outputs
    were off the correctly rounded value on an AVX512-BF16 CPU)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 9, 9, generator=g).bfloat16()
    w, b = torch.randn(4, 8, 3, 3, 7, 7, generator=g).bfloat16(), torch.randn(4, 7, 7, generator=g).bfloat16()
    exact = locally_connected2d_reference(x.double(), w.double(), b.double(), (1, 1), (0, 0), (1, 1))
    got = locally_connected2d_reference(x, w, b, (1, 1), (0, 0), (1, 1))
    off = (got != exact.bfloat16()).float().mean().item()
    assert got.dtype == torch.bfloat16 and off <= 0.01, off


def test_a_trace_records_torch_ops_and_saves():
    """torch.jit.trace of the layers on the default backend records torch ops (it recorded the C
    kernels' Python autograd Function, which torch.jit.save refuses); the loaded trace computes the
    module's values."""
    import io

    torch.manual_seed(0)
    w, b = torch.randn(3, 2, 4, 7), torch.randn(3, 7)
    for m, x in ((LocallyConnected2d(2, 3, (6, 6), 3, padding=1), torch.randn(2, 2, 6, 6)),
                 (LocallyConnected1d(2, 3, 7, 3), torch.randn(2, 2, 7)),
                 # padding="same": the traced weight sizes are tensors (the 1-D call's "same" padding
                 # was one, refused by the 2-D call it makes: "expected an int ..., got (0, tensor(1))")
                 (LocallyConnected1d(2, 3, 7, 3, padding="same"), torch.randn(2, 7)),
                 (lambda x: locally_connected1d(x, w, b, padding="same"), torch.randn(2, 2, 7))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            traced = torch.jit.trace(m, (x,))
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
        buffer.seek(0)
        loaded = torch.jit.load(buffer)
        x2 = torch.randn_like(x)
        torch.testing.assert_close(loaded(x2), m(x2))


def test_an_autocast_activation_feeds_the_layers():
    """Under CPU autocast a bf16 activation (an autocast nn.Conv2d's output) reaching float32
    parameters runs as the float32 call, bitwise (it was refused as a dtype mismatch)."""
    torch.manual_seed(0)
    conv, local2d, local1d = torch.nn.Conv2d(3, 2, 3), LocallyConnected2d(2, 4, (6, 6), 3), LocallyConnected1d(2, 4, 6, 3)
    x = torch.randn(2, 3, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = conv(x)
        assert a.dtype == torch.bfloat16
        y, y32 = local2d(a), local2d(a.float())
        z, z32 = local1d(a[:, :, 0]), local1d(a[:, :, 0].float())
    assert y.dtype == z.dtype == torch.bfloat16 and torch.equal(y, y32) and torch.equal(z, z32)


def test_messages_as_torchs_for_dilation_and_a_1d_bias():
    """dilation < 1: torch 2.13's message by batch size ("non-positive dilation is not supported"
    for B > 1; F.conv1d's with the 2-D pair); a 1-D bias of the wrong length named in 1-D shapes."""
    import torch.nn.functional as F

    for x, w, ours in ((torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3, 6, 6), locally_connected2d),
                       (torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3, 6, 6), locally_connected2d),
                       (torch.randn(2, 3, 8), torch.randn(4, 3, 3, 6), locally_connected1d),
                       (torch.randn(1, 3, 8), torch.randn(4, 3, 3, 6), locally_connected1d)):
        conv = F.conv2d if x.dim() == 4 else F.conv1d
        with pytest.raises(RuntimeError) as theirs:
            conv(x, w[..., 0, 0] if x.dim() == 4 else w[..., 0], dilation=0)
        with pytest.raises(RuntimeError) as got:
            ours(x, w, dilation=0)
        assert str(got.value).startswith(str(theirs.value) + "; "), (str(got.value), str(theirs.value))
    with pytest.raises(ValueError, match=r"^bias: expected shape \(4, 6\) \(C_out, OL\), got \(4, 5\)$"):
        locally_connected1d(torch.randn(2, 3, 8), torch.randn(4, 3, 3, 6), torch.randn(4, 5))


@pytest.mark.compile
def test_compiled_under_autocast_equals_eager():
    """torch.compile under CPU bf16 autocast: the eager call's values and gradients (the operator
    once got its bias rounded to bf16 and returned bf16-rounded gradients)."""
    torch.manual_seed(0)
    m = LocallyConnected2d(3, 4, (8, 8), 3, padding=1)
    x = torch.randn(2, 3, 8, 8)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (m, compiled):
        xi = x.clone().requires_grad_()
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xi)
        y.float().square().sum().backward()
        results.append((y, xi.grad, m.weight.grad.clone(), m.bias.grad.clone()))
    for eager, traced in zip(*results):
        assert eager.dtype == traced.dtype
        torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-6)


def test_sizes_as_nn_conv2d_takes_them():
    """NumPy integers and zero channels, as nn.Conv2d takes them (they were refused: "in_channels:
    expected a positive int, got np.int64(2)"); no input channels: the output is the bias, which is
    zero (nn.Conv2d leaves it uninitialised there)."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    m = LocallyConnected2d(np.int64(2), np.int32(3), (np.int64(5), 5), np.int64(3), stride=np.int64(1))
    x = torch.randn(2, 2, 5, 5)
    assert m.weight.shape == (3, 2, 3, 3, 3, 3) and type(m.in_channels) is int and type(m.kernel_size[0]) is int
    torch.testing.assert_close(m(x), locally_connected2d(x, m.weight, m.bias))
    assert LocallyConnected1d(np.int64(2), 3, np.int64(7), 3).output_size == (5,)
    empty_in = LocallyConnected2d(0, 3, 5, 3)
    y = empty_in(torch.randn(2, 0, 5, 5))
    assert y.shape == (2, 3, 3, 3) and not y.any() and not empty_in.bias.any()
    x = torch.randn(2, 2, 5, 5, requires_grad=True)
    y = LocallyConnected2d(2, 0, 5, 3)(x)
    assert y.shape == (2, 0, 3, 3)
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    for bad, message in ((-1, "in_channels: expected an int >= 0, got -1"), (True, "in_channels: expected an int >= 0, got True"),
                         (2.0, "in_channels: expected an int >= 0, got 2.0")):
        with pytest.raises(ValueError, match=re.escape(message)):
            LocallyConnected2d(bad, 3, 5, 3)
