"""Bad input gets a clear error: torch.nn's message first (see test_torch_errors.py), then ours naming the
argument, with expected vs got."""

import copy

import pytest
import torch
from torch import nn

import fastlayers
from module_cases import flat


@pytest.fixture
def lstm():
    return fastlayers.LSTM(4, 5, num_layers=2, bidirectional=True)


def test_wrong_rank(lstm):
    with pytest.raises(ValueError, match=r"^LSTM: Expected input to be 2D or 3D, got 4D instead; input: expected \(T, B, F\) .* got shape \(2, 3, 4, 4\)"):
        lstm(torch.randn(2, 3, 4, 4))


def test_feature_size_mismatch(lstm):
    with pytest.raises(ValueError, match=r"^input.size\(-1\) must be equal to input_size. Expected 4, got 7; input: .* F = input_size = 4, "
                                         r"got shape \(6, 3, 7\)"):
        lstm(torch.randn(6, 3, 7))


def test_integer_input(lstm):
    with pytest.raises(TypeError, match=r"^RNN input dtype \(torch.int64\) does not match weight dtype .*; input: expected dtype "
                                        r"torch.float32 \(the parameters' dtype\), got torch.int64 \(input must be floating point\)"):
        lstm(torch.ones(6, 3, 4, dtype=torch.int64))


def test_input_dtype_vs_parameters(lstm):
    with pytest.raises(TypeError, match=r"^RNN input dtype .*; input: expected dtype torch.float32 .* got torch.float64"):
        lstm(torch.randn(6, 3, 4, dtype=torch.float64))


def test_non_tensor_input(lstm):
    with pytest.raises(TypeError, match=r"^'list' object has no attribute 'dim'; input: expected a torch.Tensor, got list"):
        lstm([[1.0, 2.0]])


def test_float_lengths(lstm):
    with pytest.raises(TypeError, match=r"lengths: expected an integer tensor, got dtype torch.float32"):
        lstm(torch.randn(6, 3, 4), lengths=torch.tensor([6.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match=r"lengths: expected a sequence of ints, got an element of type float"):
        lstm(torch.randn(6, 3, 4), lengths=[6, 2.0, 3])


def test_numpy_lengths_as_torch_takes_them(lstm):
    """torch's pack_padded_sequence takes a NumPy array or NumPy ints as lengths; so do we (integer
    ones: a float or bool array is the TypeError float lengths get)."""
    import numpy as np

    x = torch.randn(6, 3, 4)
    expected = lstm(x, lengths=[6, 2, 3])
    for lengths in (np.array([6, 2, 3]), np.array([6, 2, 3], dtype=np.uint8), np.array([3, 2, 6])[::-1],
                    [np.int64(6), np.int32(2), 3]):
        for a, b in zip(flat(lstm(x, lengths=lengths)), flat(expected), strict=True):
            assert torch.equal(a, b)
    pool = fastlayers.attention_pool(x[0], x.transpose(0, 1), lengths=np.array([6, 2, 3]))
    torch.testing.assert_close(pool, fastlayers.attention_pool(x[0], x.transpose(0, 1), lengths=[6, 2, 3]), rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"lengths: expected an integer array, got dtype float64"):
        lstm(x, lengths=np.array([6.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match=r"lengths: expected an integer array, got dtype bool"):
        lstm(x, lengths=np.array([True, True, True]))
    with pytest.raises(TypeError, match=r"lengths: expected a sequence of ints, got an element of type bool"):
        lstm(x, lengths=[np.True_] * 3)
    with pytest.raises(ValueError, match=r"lengths: expected a 1-D tensor of shape \(3,\), got shape \(1, 3\)"):
        lstm(x, lengths=np.array([[6, 2, 3]]))


def test_lengths_wrong_size(lstm):
    with pytest.raises(ValueError, match=r"lengths: expected 3 lengths .* got 2"):
        lstm(torch.randn(6, 3, 4), lengths=[6, 2])
    with pytest.raises(ValueError, match=r"lengths: expected a 1-D tensor of shape \(3,\), got shape \(3, 1\)"):
        lstm(torch.randn(6, 3, 4), lengths=torch.tensor([[6], [2], [3]]))


@pytest.mark.parametrize("bad,msg", [(0, r"must be >= 1, got 0"), (-2, r"must be >= 1, got -2"),
                                     (7, r"must be <= T = 6 .* got 7")])
def test_lengths_out_of_range(lstm, bad, msg):
    with pytest.raises(ValueError, match="lengths: every length " + msg):
        lstm(torch.randn(6, 3, 4), lengths=[6, bad, 3])


def test_lengths_with_packed_sequence(lstm):
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.randn(6, 3, 4), [6, 5, 2])
    with pytest.raises(ValueError, match=r"lengths: expected None for PackedSequence input"):
        lstm(packed, lengths=[6, 5, 2])


def test_hx_wrong_shape(lstm):
    x = torch.randn(6, 3, 4)
    with pytest.raises(ValueError, match=r"^Expected hidden\[0\] size \(4, 3, 5\), got \[2, 3, 5\]; hx\[0\] \(h_0\): expected "
                                         r"shape \(4, 3, 5\) .* got \(2, 3, 5\)"):
        lstm(x, (torch.zeros(2, 3, 5), torch.zeros(4, 3, 5)), lengths=[6, 5, 2])
    with pytest.raises(ValueError, match=r"^Expected hidden\[1\] size .*; hx\[1\] \(c_0\): expected shape \(4, 3, 5\) .* got \(4, 3, 6\)"):
        lstm(x, (torch.zeros(4, 3, 5), torch.zeros(4, 3, 6)))
    with pytest.raises(RuntimeError, match=r"^For batched 3-D input, hx and cx should also be 3-D but got \(2-D, 2-D\) "
                                        r"tensors; hx: expected \(h_0, c_0\) of 3-D tensors, got a tensor of shape \(4, 3, 5\)"):
        lstm(x, torch.zeros(4, 3, 5))
    gru = fastlayers.GRU(4, 5)
    with pytest.raises(ValueError, match=r"^Expected hidden size \(1, 3, 5\), got \[1, 2, 5\]; hx: expected shape \(1, 3, 5\) .* "
                                         r"got \(1, 2, 5\)"):
        gru(x, torch.zeros(1, 2, 5), lengths=[6, 5, 2])


def test_hx_wrong_dtype(lstm):
    x = torch.randn(6, 3, 4)
    with pytest.raises(TypeError, match=r"^Input and hidden tensors are not the same dtype, found input tensor with "
                                        r"Float and hidden tensor with Double; hx\[0\] \(h_0\): expected dtype torch.float32 .* "
                                        r"got torch.float64"):
        lstm(x, (torch.zeros(4, 3, 5, dtype=torch.float64), torch.zeros(4, 3, 5)), lengths=[6, 5, 2])


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
@pytest.mark.parametrize("options", [{}, {"layer_norm": True}], ids=["plain", "layer_norm"])
@pytest.mark.parametrize("lengths", [None, [6, 5, 2]], ids=["no lengths", "lengths"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_hx_on_another_device(mode, options, lengths, grad):
    """A state on another device than the input (here meta, which has no data): torch's message and
    ours naming it, on every path (without this check, three of them ran on unwritten memory)."""
    m = getattr(fastlayers, mode)(4, 5, **options)
    x = torch.randn(6, 3, 4)
    h = torch.zeros(1, 3, 5, device="meta")
    hx = (h, torch.zeros(1, 3, 5)) if mode == "LSTM" else h
    name = r"hx\[0\] \(h_0\)" if mode == "LSTM" else "hx"
    with torch.set_grad_enabled(grad), pytest.raises(
            RuntimeError, match=rf"^Input and hidden tensors are not at the same device, found input tensor at cpu and "
                                rf"hidden tensor at meta; {name}: expected device cpu \(that of input\), got meta$"):
        m(x, hx, lengths=lengths)


def test_bad_lengths_type(lstm):
    with pytest.raises(TypeError, match=r"lengths: expected a 1-D integer tensor or a sequence of ints, got str"):
        lstm(torch.randn(6, 3, 4), lengths="6,5,2")
    with pytest.raises(TypeError, match=r"lengths: expected an integer tensor, got dtype torch.bool"):
        lstm(torch.randn(6, 3, 4), lengths=torch.tensor([True, True, True]))


@pytest.mark.parametrize("mode,options", [("LSTM", {}), ("LSTM", {"layer_norm": True}), ("GRU", {}),
                                          ("GRU", {"layer_norm": True}), ("RNN", {})],
                         ids=["LSTM", "LSTM layer_norm", "GRU", "GRU layer_norm", "RNN"])
@pytest.mark.parametrize("lengths", [None, [6, 5, 2]], ids=["no lengths", "lengths"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("where", ["parameters", "input"])
def test_parameters_on_another_device(mode, options, lengths, grad, where):
    """Parameters on another device than the input (meta here): torch.nn's message first, on every
    path (the engine paths raised a copy error of their own, or read the other device's memory)."""
    m = getattr(fastlayers, mode)(4, 5, **options)
    x = torch.randn(6, 3, 4)
    if where == "parameters":
        m = m.to("meta")
    else:
        x = x.to("meta")
    want = (r"^Input and parameter tensors are not at the same device, found input tensor at "
            rf"{x.device} and parameter tensor at {m.weight_ih_l0.device}")
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=want):
        getattr(torch.nn, mode)(4, 5).to(m.weight_ih_l0.device)(x)  # (torch's own wording)
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match=want):
        m(x, lengths=lengths)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("mode,options", [
    ("LSTM", dict(layer_norm=True, peephole=True, proj_size=3)), ("GRU", dict(layer_norm=True))], ids=["LSTM", "GRU"])
def test_a_parameter_of_another_shape_is_named(backend, mode, options):
    """A parameter of another shape than the module's (torch.func.functional_call's tensors): a
    RuntimeError naming it, on every backend (the C engine read the shapes the module says, past the
    end of the smaller tensor, and returned values)."""
    from torch.func import functional_call

    m = getattr(fastlayers, mode)(4, 5, num_layers=2, bidirectional=True, **options)
    x = torch.randn(6, 3, 4)
    for name, p in m.named_parameters():
        params = dict(m.named_parameters())
        params[name] = torch.randn(*p.shape[:-1], p.shape[-1] - 1)
        with fastlayers.backend(backend), pytest.raises(RuntimeError, match=rf"{name}: expected shape .*got "
                                                                            rf"\({', '.join(map(str, params[name].shape))},?\)"):
            functional_call(m, params, (x,), {"lengths": [6, 5, 2]})


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("make", [lambda: fastlayers.LSTM(4, 5, num_layers=2, bidirectional=True, layer_norm=True,
                                                          peephole=True, proj_size=3),
                                  lambda: fastlayers.GRU(4, 5, num_layers=2, layer_norm=True),
                                  lambda: fastlayers.LSTMCell(4, 5, layer_norm=True, peephole=True),
                                  lambda: fastlayers.GRUCell(4, 5, layer_norm=True)],
                         ids=["LSTM", "GRU", "LSTMCell", "GRUCell"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_parameter_of_another_dtype_is_named(backend, make, dtype):
    """One parameter of another dtype than the rest (torch.nn's layers and cells refuse it in their
    kernels): the option engines converted it silently and gave it a gradient in its own dtype."""
    m = make()
    cell = isinstance(m, nn.RNNCellBase)
    x = torch.randn(3, 4) if cell else torch.randn(6, 3, 4)
    for name, p in m.named_parameters():
        if name in ("weight_ih", "weight_ih_l0"):
            continue  # (the dtype the others are held to)
        changed = copy.deepcopy(m)
        setattr(changed, name, nn.Parameter(p.detach().to(dtype)))
        with fastlayers.backend(backend), pytest.raises(RuntimeError, match=rf"^{name}: expected dtype torch.float32 "
                                                                           rf"\(that of weight_ih(_l0)?: .*got {dtype}"):
            changed(x) if cell else changed(x, lengths=[6, 5, 2])
