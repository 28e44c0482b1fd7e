"""A training-mode call draws the same zoneout / recurrent-dropout masks from a seed whether it
records gradients or not, on every backend, as torch.nn's dropout does. Without autograd, an eager
CPU call runs the C++ operators (._ops_export), which drew their masks in their own layout and order
(the padded (D, T, B) rows, h before c) instead of the C engine's (its packed rows): outputs differed
by up to 1.5 at these sizes. torch.utils.checkpoint's reentrant form runs the forward without
gradients and again with them in the backward, so its gradients belonged to other masks than its
output."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fastlayers
from module_cases import CASES, flat

BACKENDS = ["cpu", "reference", "triton"]  # triton: CPU tensors under the interpreter (tests/conftest.py)
OPTIONS = {
    "zoneout": ("LSTM", dict(zoneout=(0.2, 0.3))),
    "recurrent_dropout + layer_norm": ("LSTM", dict(recurrent_dropout=0.25, layer_norm=True)),
    "all + proj_size": ("LSTM", dict(zoneout=0.2, recurrent_dropout=0.2, proj_size=2)),
    "GRU zoneout + recurrent_dropout": ("GRU", dict(zoneout=0.2, recurrent_dropout=0.2, layer_norm=True)),
}
LENGTHS = torch.tensor([6, 3, 5])


def _layer(options, dtype):
    cell, kw = OPTIONS[options]
    torch.manual_seed(0)
    return getattr(fastlayers, cell)(3, 4, num_layers=2, bidirectional=True, dropout=0.3, dtype=dtype, **kw).train()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_training_draws_are_the_same_with_and_without_gradients(options, with_lengths, backend):
    dtype = torch.float32 if backend == "triton" else torch.float64
    m = _layer(options, dtype)
    x = torch.randn(6, 3, 3, dtype=dtype, generator=torch.Generator().manual_seed(1))
    lengths = LENGTHS if with_lengths else None
    results = []
    with fastlayers.backend(backend):
        for grad in (True, False):
            torch.manual_seed(5)
            with torch.set_grad_enabled(grad):
                results.append([t.detach() for t in flat(m(x, lengths=lengths))])
    with_grad, without = results
    for a, b in zip(with_grad, without, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)


@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_reentrant_checkpoint_gives_the_gradients_of_its_output(options, with_lengths):
    """torch.utils.checkpoint(use_reentrant=True) around a layer in training: its output and every
    gradient equal the call's without it (same seed), on the default (CPU) backend."""
    m = _layer(options, torch.float64)
    x = torch.randn(6, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    lengths = LENGTHS if with_lengths else None
    results = []
    for wrapped in (False, True):
        m.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(5)
        y = checkpoint(lambda v: m(v, lengths=lengths)[0], x, use_reentrant=True) if wrapped else m(x, lengths=lengths)[0]
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        results.append([y.detach(), x.grad, *(p.grad for p in m.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


CELLS = [c for c in CASES if c.stochastic and "Cell" in c.id]
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CELLS, ids=[c.id for c in CELLS])
def test_cells_draw_the_same_with_and_without_gradients(case, mode, backend):
    """The cells too. Without autograd, LSTMCell's step on CPU runs the layer's C++ operator over
    one step, which drew c's zoneout mask before h's, where the equations (with autograd) and the
    Triton step draw h's first: with proj_size the two masks differ in size, and every output did."""
    dtype = torch.float32 if backend == "triton" else torch.float64
    torch.manual_seed(0)
    m = case.build(dtype=dtype).train()
    args, kwargs = case.inputs(dtype)
    results = []
    with fastlayers.backend(backend):
        for context in (torch.enable_grad, MODES[mode]):
            torch.manual_seed(5)
            with context():
                results.append([t.detach().clone() for t in flat(m(*args, **kwargs))])
    with_grad, without = results
    for a, b in zip(with_grad, without, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-12)
