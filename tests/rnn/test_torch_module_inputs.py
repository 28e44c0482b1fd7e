"""torch's own module inputs (torch.testing._internal.common_modules, shipped with torch) run
through fastlayers' drop-ins: every constructor / forward input torch's test_modules uses for
nn.LSTM / GRU / RNN and nn.LSTMCell / GRUCell / RNNCell, in float64, training and eval. Same seed:
the same parameters; the same inputs: bitwise the same outputs and gradients as torch's module."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastlayers
from torch.testing._internal import common_modules  # (imports expecttest: in the [test] extra)

from module_cases import flat

pytestmark = pytest.mark.reference_only  # (see pyproject's markers)


OURS = {nn.LSTM: fastlayers.LSTM, nn.GRU: fastlayers.GRU, nn.RNN: fastlayers.RNN, nn.LSTMCell: fastlayers.LSTMCell,
        nn.GRUCell: fastlayers.GRUCell, nn.RNNCell: fastlayers.RNNCell}


def _inputs():
    for info in common_modules.module_db:
        if info.module_cls not in OURS:
            continue
        for training in (True, False):
            for i, mi in enumerate(info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=True,
                                                           training=training)):
                yield pytest.param(info.module_cls, mi, training, id=f"{info.module_cls.__name__}-{i}-"
                                   f"{'train' if training else 'eval'}")


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


@pytest.mark.parametrize("torch_cls,module_input,training", list(_inputs()))
def test_torch_module_inputs(torch_cls, module_input, training):
    c = module_input.constructor_input
    torch.manual_seed(0)
    theirs = torch_cls(*c.args, **c.kwargs).double().train(training)
    torch.manual_seed(0)
    ours = OURS[torch_cls](*c.args, **c.kwargs).double().train(training)
    for (n, p), (m, q) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert n == m and torch.equal(p, q), n
    f = module_input.forward_input
    results = []
    for module in (theirs, ours):
        args, kwargs = _clone(f.args), _clone(f.kwargs)
        torch.manual_seed(1)  # the same dropout draws
        outs = flat(module(*args, **kwargs))
        leaves = [t for t in _tensors((args, kwargs)) if t.requires_grad] + list(module.parameters())
        grads = torch.autograd.grad(sum(o.sum() for o in outs), leaves, allow_unused=True)
        results.append((outs, grads))
    (outs_t, grads_t), (outs_o, grads_o) = results
    assert len(outs_t) == len(outs_o)
    for a, b in zip(outs_t, outs_o):
        assert torch.equal(a, b)
    for a, b in zip(grads_t, grads_o):
        assert (a is None and b is None) or torch.equal(a, b)
