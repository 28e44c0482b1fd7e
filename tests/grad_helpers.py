"""Gradient helpers shared by the Triton interpreter tests of several families."""

from __future__ import annotations

import torch


def grads(fn, *inputs):
    """(outputs, gradients of the floating inputs) of ``fn`` under a fixed random float64 projection
    of its outputs."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    g = torch.Generator().manual_seed(1)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in leaves if t.is_floating_point()]


def assert_close_all(got, want, tol):
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)
