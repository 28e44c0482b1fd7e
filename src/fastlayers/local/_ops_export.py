"""The locally connected layer's operators: ``torch.ops.fastlayers.locally_connected2d`` and its
backward, defined in C++ (``_native/ops.cpp``, loaded by :mod:`fastlayers._native.ops_lib`) over
the C kernels of ``_native/local.c``, for torch.compile, torch.export and eager calls without
autograd. Here: the Python half, its fake functions and autograd (:func:`register_operators`, handed
to :func:`fastlayers._native.ops_lib.on_load`), and :func:`locally_connected2d_operator`, the call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import exporter, precision, twice
from .._native import ops_lib
from ._reference import needed_grads, recorded_backward, save


def locally_connected2d_operator(input: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                                 padding: list[int], dilation: list[int]) -> Tensor:
    """The C kernels as the operator ``torch.ops.fastlayers.locally_connected2d`` (torch.compile,
    torch.export). float32 under autocast, as the eager call: the products' operands rounded to the
    low dtype (their gradients passed through unrounded), the sums and the bias in float32, the
    result in the low dtype."""
    low = precision.dtypes(input)[0]
    if low != input.dtype:  # float32 under autocast
        input, weight = precision.rounded_operand(input, low), precision.rounded_operand(weight, low)
        return torch.ops.fastlayers.locally_connected2d(input, weight, bias, stride, padding, dilation).to(low)
    return torch.ops.fastlayers.locally_connected2d(input, weight, bias, stride, padding, dilation)


def register_operators() -> None:
    """Fake functions and autograd of the C++ operators (run once the library loads: the
    ``ops_lib.on_load`` call below)."""

    @torch.library.register_fake("fastlayers::locally_connected2d")
    def _(input, weight, bias, stride, padding, dilation):
        return input.new_empty(input.size(0), weight.size(0), weight.size(4), weight.size(5))

    @torch.library.register_fake("fastlayers::locally_connected2d_backward")
    def _(grad, input, weight, stride, padding, dilation, needs):
        return (input.new_empty(input.shape) if needs[0] else grad.new_empty(0),
                weight.new_empty(weight.shape) if needs[1] else grad.new_empty(0),
                weight.new_empty(weight.size(0), *weight.shape[-2:]) if needs[2] else grad.new_empty(0))

    def setup_context(ctx, inputs, output):
        input, weight, bias, stride, padding, dilation = inputs
        save(ctx, input, weight, bias, (stride, padding, dilation), input.dtype)

    def backward(ctx, grad):
        if twice.recording(grad):
            return recorded_backward(ctx, grad)
        input, weight, _ = ctx.saved_tensors
        needs = needed_grads(ctx)
        grads = torch.ops.fastlayers.locally_connected2d_backward(grad, input, weight, *ctx.geometry, needs)
        return (*(g if n else None for g, n in zip(grads, needs)), None, None, None)

    torch.library.register_autograd("fastlayers::locally_connected2d", backward, setup_context=setup_context)


ops_lib.on_load(register_operators)


def _onnx_translations() -> dict:
    """Called once onnxscript's registry is imported (this imports onnxscript too); loads the
    operators, which the registry must find when torch.onnx reads it; none where they cannot load."""
    from . import _ops_onnx

    return _ops_onnx.translations() if ops_lib.load() else {}


exporter.offer(_onnx_translations)  # torch.onnx.export finds the translation (fastlayers._core.exporter)
