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
from torch.autograd.function import once_differentiable

from . import _native, _precision
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
    mm = _precision.Products(*_precision.dtypes(input), input.device)
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
    return out.to(mm.low) if mm.mixed else out


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


class LocallyConnected2dFunction(torch.autograd.Function):
    """Forward and hand-written backward through the C kernels in ``_native/local.c``.

    Saves the (unpadded) input and the weight; returns None for the geometry arguments.
    Low-precision calls (:mod:`fastlayers._precision`): the kernels take the operands rounded to
    the low dtype, sum in float32 and the output is returned in the low dtype; every gradient
    comes back in its input's dtype.
    """

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor, bias: Tensor | None, stride: Pair, padding: Pair,
                dilation: Pair) -> Tensor:
        mm = _precision.Products(*_precision.dtypes(input), input.device)
        ctx.mm, ctx.dtypes = mm, (input.dtype, weight.dtype, bias.dtype if bias is not None else None)
        x = F.pad(input, (padding[1], padding[1], padding[0], padding[0])) if any(padding) else input
        x, w = _kernel_operand(mm, x), _kernel_operand(mm, weight)
        b = bias.to(mm.acc).contiguous() if bias is not None else None
        batch, chans, hp, wp = x.shape
        out_ch, _, kh, kw, oh, ow = w.shape
        y = x.new_empty(batch, out_ch, oh, ow)
        _native.advise_huge_pages(y)
        geometry = (batch, chans, hp, wp, out_ch, kh, kw, oh, ow, stride[0], stride[1], dilation[0], dilation[1])
        getattr(_lib(), f"lc2d_forward_{_SUFFIX[x.dtype]}")(address(x), address(w), address(b), address(y), *geometry,
                                                           torch.get_num_threads())
        ctx.save_for_backward(input, weight)
        ctx.geometry, ctx.padding, ctx.has_bias = geometry, padding, bias is not None
        return y.to(mm.low) if mm.mixed else y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        input, weight = ctx.saved_tensors
        mm = ctx.mm
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        lib, suffix, geometry, padding = _lib(), _SUFFIX[mm.acc], ctx.geometry, ctx.padding
        dy = grad.to(mm.acc).contiguous()
        threads = torch.get_num_threads()
        dx = dw = db = None
        if need_x:
            batch, chans, hp, wp = geometry[:4]
            dx_pad = dy.new_zeros(batch, chans, hp, wp)
            w = _kernel_operand(mm, weight)  # bound to a name: a temporary would be freed before the call
            getattr(lib, f"lc2d_backward_input_{suffix}")(address(dy), address(w), address(dx_pad), *geometry, threads)
            dx = dx_pad[:, :, padding[0] : hp - padding[0], padding[1] : wp - padding[1]] if any(padding) else dx_pad
        if need_w or need_b:
            x = _kernel_operand(mm, F.pad(input, (padding[1], padding[1], padding[0], padding[0])) if any(padding)
                                else input)
            dw = torch.empty_like(weight, dtype=mm.acc, memory_format=torch.contiguous_format) if need_w else None
            db = dy.new_empty(weight.size(0), *weight.shape[-2:]) if need_b else None
            getattr(lib, f"lc2d_backward_params_{suffix}")(address(dy), address(x), address(dw), address(db), *geometry,
                                                          threads)
        return (*(g if g is None else g.to(d) for g, d in zip((dx, dw, db), ctx.dtypes)), None, None, None)
