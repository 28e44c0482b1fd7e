"""Drop-in errors, to the letter: for every bad input torch.nn's LSTM / GRU / RNN and cells reject,
ours raise an instance of torch's exception class whose message starts with torch's own message
(so torch's regular expressions match), our details after it; torch's module_db error inputs pass
with their regexes (torch's ``test_modules.py::test_errors``), and torch's train/eval check passes
for every layer and cell (``test_if_train_and_eval_modes_differ``)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.testing._internal import common_modules  # (imports expecttest: in the [test] extra)

import fastlayers

pytestmark = pytest.mark.reference_only  # (see pyproject's markers)

OURS = {nn.LSTM: fastlayers.LSTM, nn.GRU: fastlayers.GRU, nn.RNN: fastlayers.RNN, nn.LSTMCell: fastlayers.LSTMCell,
        nn.GRUCell: fastlayers.GRUCell, nn.RNNCell: fastlayers.RNNCell}


def _error_inputs():
    for info in common_modules.module_db:
        if info.module_cls not in OURS:
            continue
        for dtype in (torch.float32, torch.float64):
            for training in (True, False):
                inputs = info.module_error_inputs_func(info, device="cpu", dtype=dtype, requires_grad=False,
                                                       training=training)
                for i, error_input in enumerate(inputs):
                    yield pytest.param(info.module_cls, error_input, id=f"{info.module_cls.__name__}-{dtype}-"
                                       f"{'train' if training else 'eval'}-{i}")


@pytest.mark.parametrize("torch_cls,error_input", list(_error_inputs()))
def test_torch_module_db_errors(torch_cls, error_input):
    """torch's test_errors, with our class in place of torch's."""
    mi = error_input.module_error_input
    c = mi.constructor_input
    with pytest.raises(error_input.error_type) as got:
        if error_input.error_on == common_modules.ModuleErrorEnum.CONSTRUCTION_ERROR:
            OURS[torch_cls](*c.args, **c.kwargs)
        else:
            module = OURS[torch_cls](*c.args, **c.kwargs)
            module(*mi.forward_input.args, **mi.forward_input.kwargs)
    assert re.search(error_input.error_regex, str(got.value)), (error_input.error_regex, str(got.value))


def _train_eval_inputs():
    for info in common_modules.module_db:
        if info.module_cls not in OURS:
            continue
        for training in (True, False):
            for i, mi in enumerate(info.module_inputs_func(info, device="cpu", dtype=torch.float32,
                                                           requires_grad=False, training=training)):
                yield pytest.param(info, mi, training, id=f"{info.module_cls.__name__}-{i}-{training}")


@pytest.mark.parametrize("info,module_input,training", list(_train_eval_inputs()))
def test_torch_train_and_eval_modes_differ(info, module_input, training):
    """torch's test_if_train_and_eval_modes_differ: without the ``training`` attribute, a forward of a
    module whose ModuleInfo says train and eval do not differ (the cells) must not read it."""
    c, f = module_input.constructor_input, module_input.forward_input
    module = OURS[info.module_cls](*c.args, **c.kwargs).train(training)
    delattr(module, "training")
    try:
        out = module(*f.args, **f.kwargs)
    except AttributeError as e:
        assert "'training'" in str(e) and info.train_and_eval_differ, e
    else:
        assert out is not None


def test_cells_read_training_only_for_options_that_use_it():
    x = torch.randn(3, 4)
    for cell in (fastlayers.LSTMCell(4, 5, layer_norm=True, peephole=True, recurrent_dropout=0.3),
                 fastlayers.GRUCell(4, 5, layer_norm=True, recurrent_dropout=0.3)):
        delattr(cell, "training")
        assert cell(x) is not None
    zoneout = fastlayers.GRUCell(4, 5, zoneout=0.2)
    delattr(zoneout, "training")
    with pytest.raises(AttributeError, match="'training'"):
        zoneout(x)


def _layer_cases(mode: str) -> dict[str, tuple]:
    lstm = mode == "LSTM"

    def st(*shape, dtype=torch.float32):
        z = torch.zeros(*shape, dtype=dtype)
        return (z, z.clone()) if lstm else z

    x = torch.randn(6, 3, 4)
    cases = {
        "input dtype": (x.double(), None), "feature size": (torch.randn(6, 3, 7), None),
        "input float16": (x.half(), None), "input bfloat16": (x.bfloat16(), None),  # (RNN once ran them)
        "integer input": (torch.ones(6, 3, 4, dtype=torch.int64), None),
        "feature size and dtype": (torch.randn(6, 3, 7).double(), None),
        "hx batch": (x, st(1, 2, 5)), "hx rank": (x, st(3, 5)), "hx size": (x, st(1, 3, 6)),
        "hx layers": (x, st(2, 3, 5)), "input rank 4": (torch.randn(2, 6, 3, 4), None),
        "input rank 1": (torch.randn(4), None), "input not a tensor": ([[1.0] * 4] * 3, None),
        "unbatched input, batched hx": (torch.randn(6, 4), st(1, 1, 5)), "hx not a tensor": (x, "h"),
    }
    if lstm:
        cases.update({"hx one tensor": (x, torch.zeros(1, 3, 5)), "hx one stacked tensor": (x, torch.zeros(4, 3, 5)),
                      "hx of three": (x, (torch.zeros(1, 3, 5),) * 3), "hx of one": (x, (torch.zeros(1, 3, 5),)),
                      "c size": (x, (torch.zeros(1, 3, 5), torch.zeros(1, 3, 6)))})
    else:
        cases["hx a tuple"] = (x, (torch.zeros(1, 3, 5),))
    return cases


def _cell_cases(name: str) -> dict[str, tuple]:
    lstm = name == "LSTMCell"

    def st(*shape, dtype=torch.float32):
        z = torch.zeros(*shape, dtype=dtype)
        return (z, z.clone()) if lstm else z

    x = torch.randn(3, 4)
    cases = {
        "input dtype": (x.double(), None), "feature size": (torch.randn(3, 7), None),
        "integer input": (torch.ones(3, 4, dtype=torch.int64), None),
        "feature size and dtype": (torch.randn(3, 7).double(), None), "hx batch": (x, st(2, 5)),
        "hx rank": (x, st(1, 3, 5)), "hx dtype": (x, st(3, 5, dtype=torch.float64)), "hx size": (x, st(3, 6)),
        "input rank 3": (torch.randn(2, 3, 4), None), "input rank 0": (torch.tensor(1.0), None),
        "unbatched input, batched hx": (torch.randn(4), st(1, 5)), "batched input, unbatched hx": (x, st(5)),
        "input not a tensor": ([[1.0] * 4] * 3, None), "hx not a tensor": (x, "h"),
        # two faults: torch's LSTM and RNN cells multiply the state first, its GRU cell the input
        "input and hx dtype": (x.double(), st(3, 5, dtype=torch.bfloat16)),
        "hx bfloat16": (x, st(3, 5, dtype=torch.bfloat16)),
    }
    if lstm:
        cases.update({"hx one tensor": (x, torch.zeros(3, 5)), "hx of three": (x, (torch.zeros(3, 5),) * 3),
                      "hx of one": (x, (torch.zeros(3, 5),)), "c size": (x, (torch.zeros(3, 5), torch.zeros(3, 6))),
                      "hx an iterator": (x, iter(st(3, 5))),  # (torch uses it up checking ranks, then refuses it)
                      "unbatched input, hx an iterator": (torch.randn(4), iter(st(5)))})
    else:
        cases["hx a tuple"] = (x, (torch.zeros(3, 5),))
    return cases


CASES = [(m, c) for m in ("LSTM", "GRU", "RNN") for c in _layer_cases(m)] + \
        [(m, c) for m in ("LSTMCell", "GRUCell", "RNNCell") for c in _cell_cases(m)]


@pytest.mark.parametrize("name,case", CASES)
def test_torchs_message_first(name, case):
    x, hx = (_cell_cases if name.endswith("Cell") else _layer_cases)(name)[case]
    torch.manual_seed(0)
    theirs = getattr(nn, name)(4, 5)
    ours = getattr(fastlayers, name)(4, 5)
    with pytest.raises(Exception) as expected:
        theirs(x, hx)
    with pytest.raises(Exception) as got:
        ours(x, hx)
    assert isinstance(got.value, type(expected.value)), (type(got.value).__mro__, type(expected.value))
    message = str(expected.value).splitlines()[0]
    assert str(got.value).startswith(message + "; "), (str(got.value), message)
    assert len(str(got.value)) > len(message) + 10  # our details follow


_DTYPE_CASES = ("input dtype", "integer input", "hx dtype", "input and hx dtype", "hx bfloat16")


@pytest.mark.parametrize("name", ["LSTMCell", "GRUCell", "RNNCell"])
@pytest.mark.parametrize("case", _DTYPE_CASES)
def test_cells_without_bias_report_the_products_message(name, case):
    """Without biases torch's cells multiply with mm, whose message differs from addmm's ("expected
    m1 and m2 to have the same dtype, but got: double != float"): ours starts with that one then."""
    x, hx = _cell_cases(name)[case]
    with pytest.raises(Exception) as expected:
        getattr(nn, name)(4, 5, bias=False)(x, hx)
    with pytest.raises(Exception) as got:
        getattr(fastlayers, name)(4, 5, bias=False)(x, hx)
    assert str(expected.value).startswith("expected m1 and m2 to have the same dtype")
    assert isinstance(got.value, type(expected.value))
    assert str(got.value).startswith(str(expected.value) + "; "), (str(got.value), str(expected.value))


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_layers_with_bf16_parameters_check_the_state_dtype(mode, dtype):
    """A bfloat16 layer given a state of another dtype: an error as torch's (fastlayers.RNN once
    rounded any state, an int64 one too, and ran)."""
    ours = getattr(fastlayers, mode)(4, 5, dtype=torch.bfloat16)
    x, h = torch.randn(6, 3, 4, dtype=torch.bfloat16), torch.ones(1, 3, 5, dtype=dtype)
    with pytest.raises(RuntimeError, match=r"^Input and hidden tensors are not the same dtype, found input tensor "
                                           r"with BFloat16 and hidden tensor with"):
        ours(x, (h, h) if mode == "LSTM" else h)


def test_lstm_cell_sizes_as_torchs_constructor():
    """LSTMCell(F, 0) is a valid torch cell (an empty state); a negative hidden_size is torch's own
    error (ours once refused both with a proj_size message)."""
    assert fastlayers.LSTMCell(3, 0)(torch.randn(2, 3))[0].shape == nn.LSTMCell(3, 0)(torch.randn(2, 3))[0].shape
    with pytest.raises(RuntimeError) as expected:
        nn.LSTMCell(3, -1)
    with pytest.raises(RuntimeError) as got:
        fastlayers.LSTMCell(3, -1)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
def test_hx_dtype_message(mode):
    """A state of another dtype than the input: torch's message depends on the kernel that runs (oneDNN,
    a matrix product, cuDNN); ours is the one of torch's device-independent check (check_attributes)."""
    x = torch.randn(6, 3, 4)
    h = torch.zeros(1, 3, 5, dtype=torch.float64)
    hx = (h, h.float()) if mode == "LSTM" else h
    with pytest.raises(RuntimeError) as expected:
        getattr(nn, mode)(4, 5)(x, hx)
    with pytest.raises(TypeError, match=r"^Input and hidden tensors are not the same dtype, found input tensor with "
                                        r"Float and hidden tensor with Double; hx.*: expected dtype torch.float32 "
                                        r"\(that of input\), got torch.float64$") as got:
        getattr(fastlayers, mode)(4, 5)(x, hx)
    assert isinstance(got.value, type(expected.value))


def test_lstm_cell_state_of_another_dtype():
    """torch.nn.LSTMCell takes a float64 cell state with float32 parameters (and mixes dtypes); ours
    refuses it rather than promote silently."""
    x = torch.randn(3, 4)
    nn.LSTMCell(4, 5)(x, (torch.zeros(3, 5), torch.zeros(3, 5, dtype=torch.float64)))
    with pytest.raises(TypeError, match=r"^hx\[1\] \(c\): expected dtype torch.float32 \(that of input\), got "
                                        r"torch.float64$"):
        fastlayers.LSTMCell(4, 5)(x, (torch.zeros(3, 5), torch.zeros(3, 5, dtype=torch.float64)))


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_cell_view_messages(mode):
    """A layer's step-wise cell view checks as torch's cells do."""
    cell = getattr(fastlayers, mode)(4, 5, layer_norm=True).cell()
    with pytest.raises(RuntimeError, match=r"^input has inconsistent input_size: got 7 expected 4; input: "):
        cell(torch.randn(3, 7))
    with pytest.raises(ValueError, match=rf"^{mode}Cell: Expected input to be 1D or 2D, got 3D instead; "):
        cell(torch.randn(2, 3, 4))


def test_stacked_lstm_state():
    """torch.nn.LSTM reads hx[0] and hx[1] for its checks, then its kernel refuses a tensor: a stacked
    (2, L*D, B, H) state is a TypeError there and here."""
    x, hx = torch.randn(6, 3, 4), torch.randn(2, 1, 3, 5)
    with pytest.raises(TypeError, match=r"^lstm\(\) received an invalid combination of arguments"):
        nn.LSTM(4, 5)(x, hx)
    with pytest.raises(TypeError, match=r"^lstm\(\) received an invalid combination of arguments - hx: expected a "
                                        r"tuple \(h_0, c_0\) of two tensors, got a tensor of shape \(2, 1, 3, 5\)$"):
        fastlayers.LSTM(4, 5)(x, hx)


@pytest.mark.parametrize("kind", ["LSTM", "LSTMCell"])
def test_an_unbatched_input_takes_a_stacked_lstm_state_as_torch(kind):
    """For an unbatched input torch.nn.LSTM and LSTMCell index the state themselves (hx[0], hx[1]),
    so a stacked tensor (2, L*D, H_out) (LSTMCell: (2, H)) runs there; ours refused it. Same results
    as the pair; one of another first size: torch's IndexError (size 1) or our two-state refusal."""
    cell = kind == "LSTMCell"
    torch.manual_seed(0)
    theirs = getattr(nn, kind)(4, 5)
    ours = getattr(fastlayers, kind)(4, 5)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4) if cell else torch.randn(6, 4)
    stacked = torch.randn(2, 5) if cell else torch.randn(2, 1, 5)
    want = theirs(x, stacked)
    got, pair = ours(x, stacked), ours(x, (stacked[0], stacked[1]))
    flat = lambda r: list(r) if cell else [r[0], *r[1]]  # noqa: E731
    for g, p, w in zip(flat(got), flat(pair), flat(want), strict=True):
        assert torch.equal(g, p)
        torch.testing.assert_close(g, w)
    one = stacked[:1]
    with pytest.raises(IndexError) as expected:
        theirs(x, one)
    with pytest.raises(IndexError) as raised:
        ours(x, one)
    assert str(raised.value).startswith(str(expected.value) if cell else "index 1 is out of bounds")
    with pytest.raises(RuntimeError, match="expects two hidden states"):
        ours(x, torch.cat([stacked, stacked[:1]]))


@pytest.mark.parametrize("name", ["LSTMCell", "GRUCell", "RNNCell"])
def test_a_one_dimensional_state_beside_a_batched_input_is_torchs_index_error(name):
    """A batched (B, F) input with a 1-D state (H,) where B == H: torch.nn's cells read the state's
    size(1) and raise IndexError; ours raised a ValueError / RuntimeError only."""
    hx = torch.randn(4)
    hx = (hx, hx.clone()) if name == "LSTMCell" else hx
    x = torch.randn(4, 3)
    with pytest.raises(IndexError) as expected:
        getattr(nn, name)(3, 4)(x, hx)
    with pytest.raises(IndexError) as got:
        getattr(fastlayers, name)(3, 4)(x, hx)
    assert str(got.value).startswith(f"{expected.value}; hx")


def test_rnn_cell_unknown_nonlinearity():
    """torch.nn.RNNCell takes any nonlinearity string at construction and refuses an unknown one at the
    call; ours too (it once ran ReLU for it)."""
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError) as expected:
        nn.RNNCell(4, 5, nonlinearity="gelu")(x)
    with pytest.raises(RuntimeError) as got:
        fastlayers.RNNCell(4, 5, nonlinearity="gelu")(x)
    assert str(got.value) == f"{expected.value}; nonlinearity: expected 'tanh' or 'relu', got 'gelu'"
    for nonlinearity in ("tanh", "relu"):
        torch.manual_seed(0)
        theirs = nn.RNNCell(4, 5, nonlinearity=nonlinearity)
        torch.manual_seed(0)
        torch.testing.assert_close(fastlayers.RNNCell(4, 5, nonlinearity=nonlinearity)(x), theirs(x))


def test_rnn_with_bf16_parameters_under_autocast_takes_a_float32_input():
    """torch.nn.RNN skips its dtype check under autocast: ours with bf16 parameters runs a float32
    input there too (the state-dtype check for bf16 parameters must not refuse it)."""
    m = fastlayers.RNN(4, 5, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, h = m(torch.randn(6, 3, 4))
        nn.RNN(4, 5, dtype=torch.bfloat16)(torch.randn(6, 3, 4))
    assert out.dtype == h.dtype == torch.bfloat16


_BAD_LENGTHS = {"zero": [6, 0, 3], "negative": [6, -1, 3], "0-D tensor": torch.tensor(5), "int": 5,
                "0-D int32 tensor": torch.tensor(5, dtype=torch.int32), "too many": [6, 2, 3, 4],
                "2-D": torch.tensor([[6], [2], [3]]), "str element": ["a", 2, 3], "None element": [None, 2, 3]}
_OWN_MESSAGE = ("zero", "negative", "0-D tensor", "int", "0-D int32 tensor")  # (torch's own check, not incidental)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("case", list(_BAD_LENGTHS))
@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN"])
def test_bad_lengths_raise_pack_padded_sequences_class(mode, case, batch_first):
    """lengths= stands for pack_padded_sequence(enforce_sorted=False) then torch's layer: each bad
    lengths raises an instance of the class torch raises there (measured here, side by side), with
    torch's message first where it is torch's own check."""
    lengths = _BAD_LENGTHS[case]
    x = torch.randn(3, 6, 4) if batch_first else torch.randn(6, 3, 4)
    theirs = getattr(nn, mode)(4, 5, batch_first=batch_first)
    ours = getattr(fastlayers, mode)(4, 5, batch_first=batch_first)
    with pytest.raises(Exception) as expected:
        theirs(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False))
    with pytest.raises(expected.type) as got:
        ours(x, lengths=lengths)
    if case in _OWN_MESSAGE:
        assert str(got.value).startswith(str(expected.value) + "; lengths: "), (str(expected.value), str(got.value))


def test_cell_state_on_another_device_names_both_devices():
    cell = fastlayers.LSTMCell(4, 5)
    with pytest.raises(RuntimeError, match=r"^Expected all tensors to be on the same device, but found at least two "
                                           r"devices, cpu and meta!; hx\[0\] \(h\): expected device cpu \(that of "
                                           r"input\), got meta$"):
        cell(torch.randn(3, 4), (torch.zeros(3, 5, device="meta"), torch.zeros(3, 5)))
