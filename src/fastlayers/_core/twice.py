"""Second derivatives of the hand-written backwards: recompute with a differentiable formulation.

The kernels' backwards (C, Triton) compute first derivatives only. When a backward is itself being
recorded (``create_graph=True``: ``torch.autograd.grad(..., create_graph=True)``, ``hvp``,
``gradgradcheck``, a gradient penalty), autograd runs it with grad mode on; the binding then calls
:func:`recorded_vjp` instead of its kernels: the layer's plain-PyTorch reference (the same
function, written with differentiable torch ops) is run again on the saved inputs, and its
vector-Jacobian product is taken with ``create_graph=True``. The result is the same first
derivative (up to rounding) and is differentiable again, to any order, in the inputs and in the
incoming gradients. The fast path is unchanged when the backward is not recorded.

The same recomputation serves a backward whose incoming gradients are batched by autograd's own
vmap (``torch.autograd.grad(..., is_grads_batched=True)``, ``torch.autograd.functional.jacobian(...,
vectorize=True)``): the kernels read raw memory and cannot take a batched tensor, the reference's
torch ops carry the batch dimension.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor


def graph_recorded() -> bool:
    """Whether torch ops record an autograd graph now: grad mode on, outside inference mode (where
    ``torch.enable_grad()`` records nothing either). While torch.compile / torch.export traces,
    grad mode alone (Dynamo cannot trace the inference-mode query; traced code runs outside it)."""
    if torch.compiler.is_compiling():
        return torch.is_grad_enabled()
    return torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def grad_mode_in_inference_mode() -> bool:
    """Whether grad mode is on inside ``torch.inference_mode`` (``torch.enable_grad()`` there): torch
    ops record nothing, and an autograd Function refuses to save inference tensors, so the layers
    run such a call under ``torch.no_grad()`` (the same values, nothing recorded either way). False
    while torch.compile / torch.export traces (Dynamo cannot trace the query)."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()


def recording(*grads: Tensor | None) -> bool:
    """Inside an autograd Function's backward, given its incoming gradients: True when the backward
    itself is being recorded (create_graph, outside inference mode: a recomputation there records
    nothing to differentiate), or when a gradient is batched by autograd's vmap
    (``is_grads_batched``); then the backward runs :func:`recorded_vjp` instead of the kernels."""
    return graph_recorded() or any(g is not None and _batched(g) for g in grads)


def _batched(t: Tensor) -> bool:
    return torch._C._functorch.is_legacy_batchedtensor(t)


def recorded_vjp(fn: Callable[..., Sequence[Tensor] | Tensor], inputs: Sequence[Tensor | None],
                 grad_outputs: Sequence[Tensor | None], needs: Sequence[bool]) -> tuple[Tensor | None, ...]:
    """Gradients of ``fn(*inputs)`` with respect to the inputs flagged in ``needs`` (None for the
    others, and for one the outputs do not depend on), weighted by ``grad_outputs`` (None: that
    output gets no gradient), with ``create_graph=True``. A tensor given as two inputs gets each
    input's own share in its slot."""
    with torch.enable_grad():
        # every input through an alias of its own (a view): a tensor passed in two places (attention
        # pooling's keys as its values) then gets each place's gradient in that place's slot, as the
        # kernels' backward returns them, not the sum of both in each slot (which autograd adds again)
        inputs = [t.view_as(t) if t is not None and t.requires_grad else t for t in inputs]
        outs = fn(*inputs)
        outs = (outs,) if isinstance(outs, Tensor) else tuple(outs)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
        targets = [t for t, need in zip(inputs, needs) if need and t is not None]
        if not pairs or not targets:
            return tuple(None for _ in inputs)
        grads = torch.autograd.grad([o for o, _ in pairs], targets, [g for _, g in pairs], create_graph=True,
                                    allow_unused=True)
    it = iter(grads)
    return tuple(next(it) if need and t is not None else None for t, need in zip(inputs, needs))
