"""The locally connected layer's Triton kernels (``fastlayers._triton.local``) bound for eager calls:
:func:`triton_forward` (no autograd) and the autograd Function :class:`LocallyConnected2dTriton`
(CUDA tensors, or CPU tensors under Triton's interpreter). Low-precision calls as the C kernels:
operands rounded to the low dtype, float32 sums, output in the low dtype, gradients in their
inputs' dtypes; the double backward differentiates the reference twin.

Legend: B batch, C_in / C_out channels, H x W input, OH x OW output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._core import precision, twice
from ._reference import Pair, needed_grads, pad, recorded_backward, save


def triton_forward(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Pair, padding: Pair,
                   dilation: Pair, low: torch.dtype | None = None) -> Tensor:
    """The Triton kernels' forward, nothing recorded: (B, C_in, H, W) -> (B, C_out, OH, OW) in the
    call's low dtype ``low`` (default :func:`fastlayers._core.precision.dtypes`' for the input); what
    :class:`LocallyConnected2dTriton` runs, and what calls without autograd run directly (none of a
    Function's bookkeeping)."""
    from .._triton import local as kernels

    low = low or precision.dtypes(input)[0]  # operands rounded to it, float32 sums, output in it
    x = input if input.dtype == low and input.is_contiguous() else input.to(low).contiguous()
    w = weight if weight.dtype == low and weight.is_contiguous() else weight.to(low).contiguous()
    return kernels.forward(x, w, bias.contiguous() if bias is not None else None, stride, padding, dilation, low)


class LocallyConnected2dTriton(torch.autograd.Function):
    """The Triton kernels (``fastlayers._triton.local``): CUDA tensors, or CPU tensors under
    Triton's interpreter. Low-precision calls as the C kernels: operands rounded to the low dtype,
    float32 sums, output in the low dtype, gradients in their inputs' dtypes."""

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor, bias: Tensor | None, stride: Pair, padding: Pair,
                dilation: Pair) -> Tensor:
        low = precision.dtypes(input)[0]
        save(ctx, input, weight, bias, (stride, padding, dilation), low)
        return triton_forward(input, weight, bias, stride, padding, dilation, low)

    @staticmethod
    def backward(ctx, grad: Tensor):
        from .._triton import local as kernels

        if twice.recording(grad):
            return recorded_backward(ctx, grad)
        input, weight, _ = ctx.saved_tensors
        (stride, padding, dilation), low = ctx.geometry, ctx.low
        dy = grad.to(low).contiguous()
        need_x, need_w, need_b = needed_grads(ctx)  # (need_b: only where there is a bias)
        dx = dw = db = None
        batch, chans, height, width = input.shape
        hp, wp = height + 2 * padding[0], width + 2 * padding[1]
        if need_x:
            dx = kernels.input_grad(dy, weight.to(low).contiguous(), (batch, chans, hp, wp), stride, dilation,
                                    input.dtype)
            dx = dx[:, :, padding[0]:hp - padding[0], padding[1]:wp - padding[1]] if any(padding) else dx
        if need_w or need_b:
            padded = pad(input, list(padding)).to(low).contiguous()
            dw, db = kernels.param_grads(dy, padded, tuple(weight.shape), stride, dilation, weight.dtype)
        return dx, dw if need_w else None, db if need_b else None, None, None, None

