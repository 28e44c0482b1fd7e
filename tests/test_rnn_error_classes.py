"""Drop-in errors: for every bad input that torch.nn's LSTM / GRU / RNN rejects, ours raises an
instance of torch's exception class (and keeps its message naming the argument, expected vs got)."""

from __future__ import annotations

import pytest
import torch

import fastlayers


def _cases(mode: str) -> dict[str, tuple]:
    lstm = mode == "LSTM"

    def state(*shape, dtype=torch.float32):
        z = torch.zeros(*shape, dtype=dtype)
        return (z, z.clone()) if lstm else z

    x = torch.randn(6, 3, 4)
    cases = {
        "input dtype other than the parameters'": (x.double(), None, "input: expected dtype torch.float32"),
        "feature size other than input_size": (torch.randn(6, 3, 7), None, "input: expected feature size"),
        "integer input": (torch.ones(6, 3, 4, dtype=torch.int64), None, "input: expected a floating-point"),
        "hx of the wrong batch size": (x, state(1, 2, 5), r"expected shape \(1, 3, 5\)"),
        "hx of the wrong rank": (x, state(3, 5), r"expected shape \(1, 3, 5\)"),
        "hx of another dtype": (x, state(1, 3, 5, dtype=torch.float64), "expected dtype torch.float32"),
        "input of rank 4": (torch.randn(2, 6, 3, 4), None, "input: expected a 2-D or 3-D tensor"),
    }
    cases["input not a tensor"] = ([[1.0] * 4] * 3, None, "input: expected a torch.Tensor")
    if lstm:
        cases["LSTM hx as one tensor"] = (x, torch.zeros(1, 3, 5), "hx: expected a tuple")
        cases["LSTM hx of three tensors"] = (x, (torch.zeros(1, 3, 5),) * 3, "hx: expected a tuple")
        cases["LSTM hx not a tensor"] = (x, "h", "hx: expected a tuple")
    else:
        cases["hx not a tensor"] = (x, "h", "hx: expected a torch.Tensor")
        cases["hx a tuple"] = (x, (torch.zeros(1, 3, 5),), "hx: expected a torch.Tensor")
    return cases


CASES = [(mode, name) for mode in ("LSTM", "GRU", "RNN") for name in _cases(mode)]


@pytest.mark.parametrize("mode,name", CASES)
def test_exception_is_an_instance_of_torchs_class(mode, name):
    x, hx, message = _cases(mode)[name]
    torch.manual_seed(0)
    theirs = getattr(torch.nn, mode)(4, 5)
    ours = getattr(fastlayers, mode)(4, 5)
    with pytest.raises(Exception) as expected:
        theirs(x, hx)
    with pytest.raises(Exception, match=message) as got:
        ours(x, hx)
    assert isinstance(got.value, type(expected.value)), (type(got.value).__mro__, type(expected.value))


def test_dtype_error_keeps_torchs_hint():
    with pytest.raises(ValueError, match=r"Convert input: input.to\(torch.float32\), or convert model: "
                                         r"model.to\(torch.float64\)"):
        fastlayers.LSTM(4, 5)(torch.randn(6, 3, 4, dtype=torch.float64))
