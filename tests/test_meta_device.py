"""Every module, as constructed on the meta device (``device="meta"``, deferred initialisation and
shape inference), runs forward and backward on meta inputs as torch.nn's modules do: outputs,
final states and gradients of the shapes and dtypes a CPU call gives.
A plain layer's call with ``lengths``, which runs torch's packed path there, raises torch's own
NotImplementedError (``pad_packed_sequence`` copies the lengths out of its meta tensors), as
torch.nn's packed equivalent does."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fastlayers

from module_cases import CASES, LENGTHS, Case, flat, leaves_like

PACKED = {"LSTM-lengths", "LSTM-proj", "GRU-lengths", "RNN_TANH-lengths"}  # plain layers with lengths
assert PACKED <= {c.id for c in CASES}
# the default choice and the reference (a forced "cpu" or "triton" refuses meta tensors, saying so)
BACKENDS = ["auto", "reference"]


def _on_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_on_meta(v) for v in value)
    return value


def _meta_inputs(case: Case) -> tuple[tuple, dict]:
    args, kwargs = case.inputs(torch.float32)
    return _on_meta(args), {k: v if k == "lengths" else _on_meta(v) for k, v in kwargs.items()}


def _shapes(tensors) -> list:
    return [None if t is None else (tuple(t.shape), t.dtype) for t in tensors]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_modules_run_on_the_meta_device(case, backend):
    torch.manual_seed(0)
    cpu, meta = case.build().train(), case.build(device="meta").train()
    inputs = _meta_inputs(case)
    assert all(p.is_meta for p in meta.parameters())
    with fastlayers.backend(backend) if backend != "auto" else contextlib.nullcontext():
        if case.id in PACKED:
            with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
                meta(*inputs[0], **inputs[1])
            return
        want_outs, want_grads = _run(cpu, case.inputs(torch.float32))
        outs, grads = _run(meta, inputs)
    assert all(o.is_meta for o in outs) and all(g is None or g.is_meta for g in grads)
    assert _shapes(outs) == _shapes(want_outs)
    assert _shapes(grads) == _shapes(want_grads)


def _run(module, inputs):
    """outputs, then the gradients of the inputs and the parameters, of a forward and backward"""
    args = leaves_like(inputs[0], lambda a: a.detach().requires_grad_())
    outs = flat(module(*args, **inputs[1]))
    sum(o.sum() for o in outs).backward()
    return outs, [a.grad for a in flat(args)] + [p.grad for p in module.parameters()]


def test_torchs_packed_path_refuses_lengths_on_meta_too():
    """The reason the lengths calls above raise: torch.nn's own equivalent does."""
    lstm = torch.nn.LSTM(3, 4, device="meta")
    packed = pack_padded_sequence(torch.zeros(9, len(LENGTHS), 3, device="meta"), torch.tensor(LENGTHS),
                                  enforce_sorted=False)
    out, _ = lstm(packed)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        pad_packed_sequence(out)
