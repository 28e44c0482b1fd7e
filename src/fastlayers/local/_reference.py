"""The locally connected layer's plain-PyTorch twin: the oracle of the tests, the path of devices and
dtypes without kernels, and what every kernel path's double backward differentiates
(:func:`recorded_backward`).

Legend: B batch, C in channels, O out channels, H x W input, KH x KW kernel, OH x OW output.
Arguments are validated by the caller: input (B, C, H, W), weight (O, C, KH, KW, OH, OW), bias
(O, OH, OW) or None, stride/padding/dilation as (h, w) pairs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

from .._core import precision, twice

Pair = tuple[int, int]


def locally_connected2d_reference(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Pair, padding: Pair,
                                  dilation: Pair) -> Tensor:
    """Plain PyTorch: one strided view of the padded input per kernel offset, contracted over C.

    Used on devices other than CPU (CUDA: cuBLAS/cuDNN through torch ops), where the C kernel is
    unavailable, and as the test oracle's independent twin. Memory: the output plus one (B, O, OH,
    OW) product per offset; no unfold copy. Low-precision calls (:mod:`fastlayers._core.precision`):
    products of low-precision operands summed in float32, output in the low dtype.
    """
    mm = precision.Products.of(input)
    out_h, out_w = weight.shape[-2:]
    # the operands rounded to the low dtype and multiplied in float32 (exact products), so every
    # tap's sum stays float32 (a hardware bf16 einsum would round each tap's result to bf16)
    operand = (lambda t: t.to(mm.low).to(mm.acc)) if mm.mixed else (lambda t: t)  # noqa: E731
    x = operand(pad(input, padding))
    w = operand(weight)
    out = None
    with torch.autocast(input.device.type, enabled=False) if precision.autocasting(input.device.type) \
            else contextlib.nullcontext():
        for p in range(weight.size(2)):
            for q in range(weight.size(3)):
                h0, w0 = p * dilation[0], q * dilation[1]
                xs = x[:, :, h0 : h0 + stride[0] * (out_h - 1) + 1 : stride[0], w0 : w0 + stride[1] * (out_w - 1) + 1 : stride[1]]
                term = torch.einsum("bcij,ocij->boij", xs, w[:, :, p, q])
                out = term if out is None else out + term
    if out is None:  # (an empty kernel: no tap)
        out = x.new_zeros(x.size(0), weight.size(0), out_h, out_w, dtype=mm.acc)
    out = out + bias.to(mm.acc) if bias is not None else out
    return out.to(mm.low)



def pad(x: Tensor, padding: list[int] | Pair) -> Tensor:
    """x (B, C, H, W) zero-padded by (ph, pw) on both sides of each spatial dimension."""
    return F.pad(x, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else x


def save(ctx, input: Tensor, weight: Tensor, bias: Tensor | None, geometry: tuple, low: torch.dtype) -> None:
    """What every kernel path's backward reads (and :func:`recorded_backward`): the inputs, the
    (stride, padding, dilation) geometry, whether there is a bias, the call's low dtype."""
    ctx.save_for_backward(input, weight, bias)
    ctx.geometry, ctx.has_bias, ctx.low = geometry, bias is not None, low


def needed_grads(ctx) -> list[bool]:
    """[d input, d weight, d bias] wanted (d bias only where there is a bias)."""
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    return [bool(need_x), bool(need_w), bool(need_b and ctx.has_bias)]


def recorded_backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
    """The backward while it is recorded (create_graph): the vector-Jacobian product of
    :func:`locally_connected2d_reference` in the forward's precision (:mod:`fastlayers._core.twice`)."""
    input, weight, bias = ctx.saved_tensors
    stride, padding, dilation = ctx.geometry

    def reference(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        with torch.autocast(x.device.type, dtype=ctx.low, enabled=ctx.low in precision.LOW and x.dtype != ctx.low):
            return locally_connected2d_reference(x, w, b, stride, padding, dilation)

    grads = twice.recorded_vjp(reference, (input, weight, bias), (grad,), ctx.needs_input_grad[:3])
    return (*grads, None, None, None)

