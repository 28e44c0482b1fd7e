"""The one place a locally connected call picks its backend (:func:`fastlayers._core.backend.select`)
and its path on it: the C kernels (an autograd Function eagerly, the C++ operator without autograd or
while compiling), the Triton kernels, or the plain-PyTorch reference."""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import twice
from .._core.backend import cpu_kernels, select, triton_kernels
from .._core.jit import TRITON, refuse_trace
from .._native import ops_lib
from ._cpu import LocallyConnected2dNative
from ._gpu import LocallyConnected2dTriton, triton_forward
from ._ops_export import locally_connected2d_operator
from ._reference import Pair, locally_connected2d_reference

__all__ = ["run"]

def run(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Pair, padding: Pair, dilation: Pair) -> Tensor:
    """Validated (B, C_in, H, W) input, weight, bias and pairs -> (B, C_out, OH, OW), on the backend
    of :func:`fastlayers._core.backend.select`: on CPU the C kernels (eager with autograd: an autograd
    Function; without autograd, torch.compile or torch.export: the C++ operator). Under
    torch.jit.trace, and for no channel in or out, the plain-PyTorch reference (a trace records
    torch ops only; the kernels take at least one channel)."""
    if twice.grad_mode_in_inference_mode():  # (nothing is recorded there: no autograd Function either)
        with torch.no_grad():
            return run(x, weight, bias, stride, padding, dilation)
    if torch.jit.is_tracing() or weight.size(0) == 0 or weight.size(1) == 0:
        return locally_connected2d_reference(x, weight, bias, stride, padding, dilation)
    if triton_kernels("local2d", x):  # CUDA: the Triton kernels, decided in a few lookups
        return _triton(x, weight, bias, stride, padding, dilation)
    if cpu_kernels("local2d", x) and ops_lib.serves(x):  # no autograd: one dispatcher call (never while compiling)
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.fastlayers.locally_connected2d.default(x, weight, bias, list(stride), list(padding),
                                                                    list(dilation))
    which = select("local2d", x)
    if which == "cpu":
        args = (x, weight, bias, list(stride), list(padding), list(dilation))
        if torch.compiler.is_compiling():  # the C++ operator (fastlayers._native.ops_lib)
            from .._core.compiling import constant

            if constant(ops_lib.load):
                return locally_connected2d_operator(*args)
            return locally_connected2d_reference(x, weight, bias, stride, padding, dilation)
        return LocallyConnected2dNative.apply(*args)
    if which == "triton":
        return _triton(x, weight, bias, stride, padding, dilation)
    return locally_connected2d_reference(x, weight, bias, stride, padding, dilation)


def _triton(x: Tensor, weight: Tensor, bias: Tensor | None, stride: Pair, padding: Pair, dilation: Pair) -> Tensor:
    refuse_trace("fastlayers.functional.locally_connected2d on the Triton backend", TRITON)
    if not twice.graph_recorded():  # nothing to record: the kernels without a Function's bookkeeping
        return triton_forward(x, weight, bias, stride, padding, dilation)
    return LocallyConnected2dTriton.apply(x, weight, bias, stride, padding, dilation)
