"""Locally connected 2-D: the autograd binding of the C kernels and the pure-PyTorch reference twin.

Legend: B batch, C in channels, O out channels, H x W input, KH x KW kernel, OH x OW output.
Both functions take validated arguments: input (B, C, H, W), weight (O, C, KH, KW, OH, OW),
bias (O, OH, OW) or None, stride/padding/dilation as (h, w) pairs.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _native, _ops_lib, _precision, _twice
from ._native import address

Pair = tuple[int, int]
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def locally_connected2d_reference(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Pair, padding: Pair,
                                  dilation: Pair) -> Tensor:
    """Plain PyTorch: one strided view of the padded input per kernel offset, contracted over C.

    Used on devices other than CPU (CUDA: cuBLAS/cuDNN through torch ops), where the C kernel is
    unavailable, and as the test oracle's independent twin. Memory: the output plus one (B, O, OH,
    OW) product per offset; no unfold copy. Low-precision calls (:mod:`fastlayers._precision`):
    products of low-precision operands summed in float32, output in the low dtype.
    """
    mm = _precision.Products.of(input)
    out_h, out_w = weight.shape[-2:]
    x = F.pad(input, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else input
    out = None
    for p in range(weight.size(2)):
        for q in range(weight.size(3)):
            h0, w0 = p * dilation[0], q * dilation[1]
            xs = x[:, :, h0 : h0 + stride[0] * (out_h - 1) + 1 : stride[0], w0 : w0 + stride[1] * (out_w - 1) + 1 : stride[1]]
            term = mm.einsum("bcij,ocij->boij", xs, weight[:, :, p, q])
            out = term if out is None else out + term
    assert out is not None
    out = out + bias.to(mm.acc) if bias is not None else out
    return out.to(mm.low)


def _kernel_operand(mm: _precision.Products, t: Tensor) -> Tensor:
    """A product operand as the C kernels take it: contiguous, in float32/64 (rounded to the low
    dtype first for low-precision calls)."""
    t = t.to(mm.low).to(mm.acc) if mm.mixed else t
    return t.contiguous()


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the argument types of the kernels in a loaded local.c build (pointers, 13 int64
    sizes, the thread count); once per library."""
    if not getattr(lib, "_fastlayers_typed", False):
        ints = [ctypes.c_int64] * 13 + [ctypes.c_int]
        for suffix in _SUFFIX.values():
            for name in ("lc2d_forward", "lc2d_backward_input", "lc2d_backward_params"):
                fn = getattr(lib, f"{name}_{suffix}")
                fn.argtypes = [ctypes.c_void_p] * 4 + ints if name != "lc2d_backward_input" else [ctypes.c_void_p] * 3 + ints
                fn.restype = None
        lib._fastlayers_typed = True
    return lib


def _lib():
    lib = _native.load("local")
    return typed(lib) if lib is not None else None


def _geometry(padded: tuple[int, ...], weight: tuple[int, ...], stride: list[int], dilation: list[int]) -> tuple:
    """The 13 sizes every kernel takes: B, C, Hp, Wp, O, KH, KW, OH, OW, sh, sw, dh, dw."""
    (batch, chans, hp, wp), (out_ch, _, kh, kw, oh, ow) = padded, weight
    return (batch, chans, hp, wp, out_ch, kh, kw, oh, ow, stride[0], stride[1], dilation[0], dilation[1])


def _pad(x: Tensor, padding: list[int]) -> Tensor:
    return F.pad(x, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else x


# The C kernels. Eager calls: the autograd Function LocallyConnected2dNative (ctypes). torch.compile
# and torch.export: the operators torch.ops.fastlayers.locally_connected2d and its backward, defined
# in C++ (_native/ops.cpp, fastlayers._ops_lib) with the same kernels; their fake functions and
# autograd are registered here (register_operators). Low-precision calls (:mod:`fastlayers._precision`):
# the kernels take the operands rounded to the low dtype and sum in float32; the output comes back
# in the low dtype, every gradient in its input's dtype.

def _forward_kernel(input: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
                    dilation: list[int]) -> Tensor:
    """Forward kernel: input (B, C, H, W), weight (O, C, KH, KW, OH, OW), bias (O, OH, OW) | None."""
    mm = _precision.Products.of(input)
    x, w = _kernel_operand(mm, _pad(input, padding)), _kernel_operand(mm, weight)
    b = bias.to(mm.acc).contiguous() if bias is not None else None
    geometry = _geometry(tuple(x.shape), tuple(w.shape), stride, dilation)
    y = x.new_empty(x.size(0), w.size(0), w.size(4), w.size(5))
    _native.advise_huge_pages(y)
    getattr(_lib(), f"lc2d_forward_{_SUFFIX[x.dtype]}")(address(x), address(w), address(b), address(y), *geometry,
                                                       torch.get_num_threads())
    return y.to(mm.low)


def _backward_kernels(grad: Tensor, input: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                      dilation: list[int], low: torch.dtype, needs: list[bool]) -> tuple[Tensor | None, ...]:
    """Backward kernels: (d input, d weight, d bias), each None where ``needs`` says no."""
    acc = _precision.accumulator(low)
    mm = _precision.Products(low, acc, input.device)
    lib, suffix, threads = _lib(), _SUFFIX[acc], torch.get_num_threads()
    dy = grad.to(acc).contiguous()
    padded = _pad(input, padding)
    geometry = _geometry(tuple(padded.shape), tuple(weight.shape), stride, dilation)
    dx = dw = db = None
    if needs[0]:
        batch, chans, hp, wp = geometry[:4]
        dx_pad = dy.new_zeros(batch, chans, hp, wp)
        w = _kernel_operand(mm, weight)  # bound to a name: a temporary would be freed before the call
        getattr(lib, f"lc2d_backward_input_{suffix}")(address(dy), address(w), address(dx_pad), *geometry, threads)
        dx = dx_pad[:, :, padding[0]:hp - padding[0], padding[1]:wp - padding[1]] if any(padding) else dx_pad
        dx = dx.to(input.dtype).contiguous()
    if needs[1] or needs[2]:
        x = _kernel_operand(mm, padded)
        w_grad = torch.empty_like(weight, dtype=acc, memory_format=torch.contiguous_format) if needs[1] else None
        b_grad = dy.new_empty(weight.size(0), *weight.shape[-2:]) if needs[2] else None
        getattr(lib, f"lc2d_backward_params_{suffix}")(address(dy), address(x), address(w_grad), address(b_grad),
                                                      *geometry, threads)
        dw = w_grad.to(weight.dtype) if w_grad is not None else None
        db = b_grad.to(weight.dtype) if b_grad is not None else None
    return dx, dw, db


def _save(ctx, input: Tensor, weight: Tensor, bias: Tensor | None, geometry: tuple, low: torch.dtype) -> None:
    ctx.save_for_backward(input, weight, bias)
    ctx.geometry, ctx.has_bias, ctx.low = geometry, bias is not None, low


def _recorded(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
    """The backward while it is recorded (create_graph): the vector-Jacobian product of
    :func:`locally_connected2d_reference` in the forward's precision (:mod:`fastlayers._twice`)."""
    input, weight, bias = ctx.saved_tensors
    stride, padding, dilation = ctx.geometry

    def reference(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        with torch.autocast(x.device.type, dtype=ctx.low, enabled=ctx.low in _precision.LOW and x.dtype != ctx.low):
            return locally_connected2d_reference(x, w, b, stride, padding, dilation)

    grads = _twice.recorded_vjp(reference, (input, weight, bias), (grad,), ctx.needs_input_grad[:3])
    return (*grads, None, None, None)


def _needs(ctx) -> list[bool]:
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    return [bool(need_x), bool(need_w), bool(need_b and ctx.has_bias)]


class LocallyConnected2dNative(torch.autograd.Function):
    """The C kernels in eager calls (CPU tensors; see the comment above)."""

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
                dilation: list[int]) -> Tensor:
        _save(ctx, input, weight, bias, (stride, padding, dilation), _precision.dtypes(input)[0])
        return _forward_kernel(input, weight, bias, stride, padding, dilation)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if _twice.recording():
            return _recorded(ctx, grad)
        input, weight, _ = ctx.saved_tensors
        return (*_backward_kernels(grad, input, weight, *ctx.geometry, ctx.low, _needs(ctx)), None, None, None)


def locally_connected2d_operator(input: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int],
                                 padding: list[int], dilation: list[int]) -> Tensor:
    """The C kernels as the operator ``torch.ops.fastlayers.locally_connected2d`` (torch.compile,
    torch.export). A low-precision call passes its operands rounded to the low dtype (the operator
    computes in float32 and returns that dtype)."""
    low = _precision.dtypes(input)[0]
    if low != input.dtype:  # float32 under autocast
        input, weight = input.to(low), weight.to(low)
        bias = bias.to(low) if bias is not None else None
    return torch.ops.fastlayers.locally_connected2d(input, weight, bias, stride, padding, dilation)


def register_operators() -> None:
    """Fake functions and autograd of the C++ operators (run once the library loads: on_load below)."""

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
        _save(ctx, input, weight, bias, (stride, padding, dilation), input.dtype)

    def backward(ctx, grad):
        if _twice.recording():
            return _recorded(ctx, grad)
        input, weight, _ = ctx.saved_tensors
        needs = _needs(ctx)
        grads = torch.ops.fastlayers.locally_connected2d_backward(grad, input, weight, *ctx.geometry, needs)
        return (*(g if n else None for g, n in zip(grads, needs)), None, None, None)

    torch.library.register_autograd("fastlayers::locally_connected2d", backward, setup_context=setup_context)


def triton_forward(input: Tensor, weight: Tensor, bias: Tensor | None, stride: Pair, padding: Pair,
                   dilation: Pair, low: torch.dtype | None = None) -> Tensor:
    """The Triton kernels' forward, nothing recorded: (B, C_in, H, W) -> (B, C_out, OH, OW) in the
    call's low dtype ``low`` (default :func:`fastlayers._precision.dtypes`' for the input); what
    :class:`LocallyConnected2dTriton` runs, and what calls without autograd run directly (none of a
    Function's bookkeeping)."""
    from ._triton import local as kernels

    low = low or _precision.dtypes(input)[0]  # operands rounded to it, float32 sums, output in it
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
        low = _precision.dtypes(input)[0]
        ctx.save_for_backward(input, weight, bias)
        ctx.geometry, ctx.low, ctx.has_bias = (stride, padding, dilation), low, bias is not None
        return triton_forward(input, weight, bias, stride, padding, dilation, low)

    @staticmethod
    def backward(ctx, grad: Tensor):
        from ._triton import local as kernels

        if _twice.recording():
            return _recorded(ctx, grad)
        input, weight, _ = ctx.saved_tensors
        (stride, padding, dilation), low = ctx.geometry, ctx.low
        dy = grad.to(low).contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        batch, chans, height, width = input.shape
        hp, wp = height + 2 * padding[0], width + 2 * padding[1]
        if need_x:
            dx = kernels.input_grad(dy, weight.to(low).contiguous(), (batch, chans, hp, wp), stride, dilation,
                                    input.dtype)
            dx = dx[:, :, padding[0]:hp - padding[0], padding[1]:wp - padding[1]] if any(padding) else dx
        if need_w or (need_b and ctx.has_bias):
            padded = _pad(input, list(padding)).to(low).contiguous()
            dw, db = kernels.param_grads(dy, padded, tuple(weight.shape), stride, dilation, weight.dtype)
        return dx, dw if need_w else None, db if need_b and ctx.has_bias else None, None, None, None


_ops_lib.on_load(register_operators)
