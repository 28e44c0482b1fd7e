"""The locally connected layer's C kernels (``_native/local.c``) bound for eager calls: the ctypes
signatures, the kernel calls, and the autograd Function :class:`LocallyConnected2dNative` (CPU
tensors, float32 / float64; low-precision calls take their operands rounded to the low dtype and sum
in float32, the output comes back in the low dtype, every gradient in its input's dtype,
:mod:`fastlayers._core.precision`). The same kernels serve the C++ operator
(:mod:`fastlayers.local._ops_export`).

Legend: B batch, C in channels, O out channels, Hp x Wp padded input, KH x KW kernel, OH x OW output.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from .. import _native
from .._core import precision, twice
from .._native import address
from ._reference import needed_grads, pad, recorded_backward, save

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _kernel_operand(mm: precision.Products, t: Tensor) -> Tensor:
    """A product operand as the C kernels take it: contiguous, in float32/64 (rounded to the low
    dtype first for low-precision calls)."""
    t = t.to(mm.low).to(mm.acc) if mm.mixed else t
    return t.contiguous()


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with the argument types of local.c's kernels declared (pointers, 13 int64 sizes, the
    thread count; the forward and the parameters' backward then their work space, a table of C *
    KH * KW int64 input offsets: :func:`_offsets_table`; :func:`fastlayers._native.declare`)."""
    ints = [ctypes.c_int64] * 13 + [ctypes.c_int]
    return _native.declare(lib, "local", lambda real: {"lc2d_forward": [ctypes.c_void_p] * 4 + ints + [ctypes.c_void_p],
                                                       "lc2d_backward_input": [ctypes.c_void_p] * 3 + ints,
                                                       "lc2d_backward_params": [ctypes.c_void_p] * 4 + ints
                                                       + [ctypes.c_void_p]})


def _offsets_table(geometry: tuple[int, ...]) -> Tensor:
    """The work space of the forward and the parameters' backward: C * KH * KW int64."""
    return torch.empty(geometry[1] * geometry[5] * geometry[6], dtype=torch.int64)


def _lib():
    lib = _native.load("local")
    return typed(lib) if lib is not None else None


def _geometry(padded: tuple[int, ...], weight: tuple[int, ...], stride: list[int], dilation: list[int]) -> tuple:
    """The 13 sizes every kernel takes: B, C, Hp, Wp, O, KH, KW, OH, OW, sh, sw, dh, dw."""
    (batch, chans, hp, wp), (out_ch, _, kh, kw, oh, ow) = padded, weight
    return (batch, chans, hp, wp, out_ch, kh, kw, oh, ow, stride[0], stride[1], dilation[0], dilation[1])



def _forward_kernel(input: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
                    dilation: list[int]) -> Tensor:
    """Forward kernel: input (B, C, H, W), weight (O, C, KH, KW, OH, OW), bias (O, OH, OW) | None."""
    mm = precision.Products.of(input)
    x, w = _kernel_operand(mm, pad(input, padding)), _kernel_operand(mm, weight)
    b = bias.to(mm.acc).contiguous() if bias is not None else None
    geometry = _geometry(tuple(x.shape), tuple(w.shape), stride, dilation)
    y = x.new_empty(x.size(0), w.size(0), w.size(4), w.size(5))
    _native.advise_huge_pages(y)
    table = _offsets_table(geometry)
    getattr(_lib(), f"lc2d_forward_{_SUFFIX[x.dtype]}")(address(x), address(w), address(b), address(y), *geometry,
                                                       torch.get_num_threads(), address(table))
    return y.to(mm.low)


def _backward_kernels(grad: Tensor, input: Tensor, weight: Tensor, stride: list[int], padding: list[int],
                      dilation: list[int], low: torch.dtype, needs: list[bool]) -> tuple[Tensor | None, ...]:
    """Backward kernels: (d input, d weight, d bias), each None where ``needs`` says no."""
    acc = precision.accumulator(low)
    mm = precision.Products(low, acc, input.device)
    lib, suffix, threads = _lib(), _SUFFIX[acc], torch.get_num_threads()
    dy = grad.to(acc).contiguous()
    padded = pad(input, padding)
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
        table = _offsets_table(geometry)
        getattr(lib, f"lc2d_backward_params_{suffix}")(address(dy), address(x), address(w_grad), address(b_grad),
                                                      *geometry, threads, address(table))
        dw = w_grad.to(weight.dtype) if w_grad is not None else None
        db = b_grad.to(weight.dtype) if b_grad is not None else None
    return dx, dw, db


class LocallyConnected2dNative(torch.autograd.Function):
    """The C kernels in eager calls (CPU tensors; see the comment above)."""

    @staticmethod
    def forward(ctx, input: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
                dilation: list[int]) -> Tensor:
        save(ctx, input, weight, bias, (stride, padding, dilation), precision.dtypes(input)[0])
        return _forward_kernel(input, weight, bias, stride, padding, dilation)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if twice.recording(grad):
            return recorded_backward(ctx, grad)
        input, weight, _ = ctx.saved_tensors
        return (*_backward_kernels(grad, input, weight, *ctx.geometry, ctx.low, needed_grads(ctx)), None, None, None)

