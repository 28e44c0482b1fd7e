"""Mixed precision, one rule for every layer: matrix products take low-precision operands, the rest
runs in float32, results come out in the low precision.

A call is *low precision* when its input is bfloat16/float16 (parameters in that dtype), or when it
is float32 under ``torch.autocast`` for the input's device (the autocast dtype). Then:

* every matrix product (input projection, recurrent product, weight gradients, the local layer's
  sum of products, attention scores and context) rounds its operands to the low dtype and
  accumulates in float32: a bf16/fp16 GEMM with float32 accumulation;
* everything else (cell state, gates, LayerNorm statistics, softmax, the local layer's kernel
  sums) is float32;
* outputs (and final states) are returned in the low dtype, gradients in each input's own dtype.

On a CPU without bf16 (fp16) instructions (no AVX512-BF16 / AMX; checked at run time) torch's
low-precision GEMM is emulated (1 vs 139 GFLOP/s for float32 at the seed's input-projection shape
on an AVX2 EPYC, ``benchmarks/bench_mixed_precision.py``), so there the
rounded operands are multiplied in float32 arithmetic: the same products (a product of two bf16
values is exact in float32) and float32 sums, at float32 GEMM speed.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

LOW = (torch.bfloat16, torch.float16)


def accumulator(low: torch.dtype) -> torch.dtype:
    """The dtype of sums and of everything but product operands when the operands are ``low``:
    float32 for bfloat16/float16, ``low`` itself otherwise."""
    return torch.float32 if low in LOW else low


def autocasting(device_type: str) -> bool:
    """Whether autocast is on for ``device_type``; False for a device autocast does not know (meta,
    where ``torch.is_autocast_enabled`` raises: shape inference and deferred initialisation run
    layers on meta tensors, as torch.nn's run)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def dtypes(x: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(operand dtype of matrix products, dtype of everything else) for a call on ``x``; the two
    are equal unless the call is low precision, so the first is also the dtype of the results."""
    low = x.dtype
    if x.dtype == torch.float32 and autocasting(x.device.type):
        autocast = torch.get_autocast_dtype(x.device.type)
        if autocast in LOW:
            low = autocast
    return low, accumulator(low)


def is_low(x: Tensor) -> bool:
    return dtypes(x)[0] in LOW


def autocast_operand(t: object, weight_dtype: torch.dtype) -> object:
    """An activation reaching parameters of another floating dtype while autocast is on for its
    device, converted as torch.nn's modules take it there (their dtype check is skipped under
    autocast, and autocast casts the products' operands):

    * a bfloat16 / float16 one (an autocast layer's bf16 output) reaching float32 parameters: to
      float32, so the call runs as a float32 call under autocast (products in the autocast dtype,
      results in it);
    * a float32 (or the other low-precision) one reaching bfloat16 / float16 parameters (a model
      converted with ``model.to(torch.bfloat16)`` run under autocast): to the parameters' dtype,
      so the call runs as that low-precision model's call, with autocast off
      (:func:`autocast_off_for`).

    The conversion is differentiable (the gradient comes back in ``t``'s dtype). Anything else
    (None, float64 anywhere, autocast off) passes through, itself; a tuple or list element-wise."""
    if isinstance(t, PackedSequence):
        target = _autocast_target(t.data, weight_dtype)
        return t if target is None else t.to(target)
    if isinstance(t, (tuple, list)):
        converted = [autocast_operand(e, weight_dtype) for e in t]
        return t if all(a is b for a, b in zip(converted, t)) else type(t)(converted)
    target = _autocast_target(t, weight_dtype)
    return t if target is None else t.to(target)  # type: ignore[union-attr]


def _autocast_target(t: object, weight_dtype: torch.dtype) -> torch.dtype | None:
    if not isinstance(t, Tensor) or t.dtype == weight_dtype or not autocasting(t.device.type):
        return None
    if weight_dtype == torch.float32 and t.dtype in LOW:
        return torch.float32
    if weight_dtype in LOW and t.dtype in (torch.float32, *LOW):
        return weight_dtype
    return None


def autocast_off_for(device_type: str, weight_dtype: torch.dtype) -> bool:
    """Whether a call on bfloat16 / float16 parameters runs with autocast off: when autocast is on
    for ``device_type``, its operands are in the parameters' dtype already (:func:`autocast_operand`),
    and autocast, whose dtype may be the other low one, would only mix dtypes inside the call: it
    runs as the low-precision model's call without autocast, results in the parameters' dtype."""
    return weight_dtype in LOW and autocasting(device_type)


def rounded(t: object, low: torch.dtype) -> object:
    """A product operand of a low-precision call that runs torch's float32 kernels: ``t`` rounded
    to ``low`` and back, a float32 tensor holding ``low`` values (a product of two is exact in
    float32); anything but a tensor (None, a tuple of states) passes through."""
    return t.to(low).float() if isinstance(t, Tensor) else t


class _RoundedOperand(torch.autograd.Function):
    """``t`` rounded to ``low`` and back (a product operand of a low-precision call), its gradient
    passed through as it comes (the gradient of the unrounded operand: what the eager kernels give)."""

    @staticmethod
    def forward(ctx, t: Tensor, low: torch.dtype) -> Tensor:
        return t.to(low).to(t.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def rounded_operand(t: Tensor, low: torch.dtype) -> Tensor:
    """:func:`rounded` for an operand whose gradient must not be rounded (straight through)."""
    return _RoundedOperand.apply(t, low)


_STATES_IN_ACC = contextvars.ContextVar("fastlayers_states_in_acc", default=False)


@contextlib.contextmanager
def states_in_acc() -> Iterator[None]:
    """Within it, the recurrent engines return their final states in the accumulator dtype (float32
    under bf16) instead of the low one: for ``checkpoint_every``'s segments, which hand them to the
    next segment, so that the cell state stays float32 across a segment's bound as it does across
    a step (a layer with the option then computes what the layer without it does)."""
    token = _STATES_IN_ACC.set(True)
    try:
        yield
    finally:
        _STATES_IN_ACC.reset(token)


def state_dtype(mm: "Products") -> torch.dtype:
    """The dtype of a recurrent engine's final states: ``mm.low`` (the output's), or ``mm.acc``
    within :func:`states_in_acc` (never while torch.compile traces: the option runs eagerly)."""
    if torch.compiler.is_compiling():
        return mm.low
    return mm.acc if _STATES_IN_ACC.get() else mm.low


_NATIVE: dict[tuple[str, torch.dtype], bool] = {}


def native(device_type: str, dtype: torch.dtype) -> bool:
    """True when ``device_type`` multiplies ``dtype`` matrices in hardware (CUDA: always); a
    constant for torch.compile (:mod:`fastlayers._core.compiling`)."""
    if torch.compiler.is_compiling():
        from .compiling import constant

        return constant(native_cached, device_type, dtype)
    return native_cached(device_type, dtype)


def native_cached(device_type: str, dtype: torch.dtype) -> bool:
    if (device_type, dtype) not in _NATIVE:
        _NATIVE[device_type, dtype] = _native(device_type, dtype)
    return _NATIVE[device_type, dtype]


def _native(device_type: str, dtype: torch.dtype) -> bool:
    if device_type != "cpu" or dtype not in LOW:
        return True
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)() or
                    getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    return bool(getattr(cpu, "_is_amx_fp16_supported", lambda: False)())


class Products:
    """Batched matrix products with operands rounded to ``low`` and results in ``acc``.

    ``operand(t)`` prepares an operand once (a weight used every step): rounded to ``low``, and
    back in ``acc`` where the hardware has no ``low`` GEMM. ``bmm``/``baddbmm`` take prepared or raw
    operands and write ``out`` (in ``acc``) when given. Runs with autocast off, so the operands are
    used exactly as prepared.
    """

    def __init__(self, low: torch.dtype, acc: torch.dtype, device: torch.device) -> None:
        self.low, self.acc = low, acc
        self.mixed = low != acc
        self.native = native(device.type, low)
        # operands multiplied in hardware low precision: worth keeping low copies of the ones used twice
        self.lowered = self.mixed and self.native
        # one dtype and no autocast: the products are torch's own, without the autocast guard (which
        # costs microseconds a call, per step in a time loop)
        self.plain = not self.mixed and not autocasting(device.type)

    @classmethod
    def of(cls, x: Tensor) -> "Products":
        """The products of a call on ``x`` (:func:`dtypes`)."""
        return cls(*dtypes(x), x.device)

    def operand(self, t: Tensor) -> Tensor:
        if not self.mixed:
            return t if t.dtype == self.acc else t.to(self.acc)
        t = t.to(self.low)
        return t if self.native else t.to(self.acc)

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """torch.matmul(a, b) (broadcasting, autograd) with both operands raw; result in ``acc``."""
        a, b = self.operand(a), self.operand(b)
        if self.plain:
            return torch.matmul(a, b)
        with torch.autocast(a.device.type, enabled=False):
            return torch.matmul(a, b).to(self.acc)

    def einsum(self, equation: str, a: Tensor, b: Tensor) -> Tensor:
        """torch.einsum of two raw operands (a sum of products); result in ``acc``."""
        a, b = self.operand(a), self.operand(b)
        if self.plain:
            return torch.einsum(equation, a, b)
        with torch.autocast(a.device.type, enabled=False):
            return torch.einsum(equation, a, b).to(self.acc)

    def bmm(self, a: Tensor, b: Tensor, out: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
        """a @ b, both operands raw. ``dtype``: the dtype wanted for the result when not ``out``
        (default ``acc``); a low ``dtype`` takes a hardware low-precision GEMM's result as it is."""
        return self.bmm_prepared(a, self.operand(b), out, dtype)

    def bmm_prepared(self, a: Tensor, b: Tensor, out: Tensor | None = None, dtype: torch.dtype | None = None) -> Tensor:
        """a @ b with ``b`` from :meth:`operand` (prepared once, used every step)."""
        a = self.operand(a)
        if self.plain:
            return torch.bmm(a, b, out=out) if out is not None else torch.bmm(a, b)
        with torch.autocast(a.device.type, enabled=False):
            if self.lowered:
                r = torch.bmm(a, b)
                return out.copy_(r) if out is not None else r.to(dtype or self.acc)
            return torch.bmm(a, b, out=out) if out is not None else torch.bmm(a, b)

    def baddbmm(self, bias: Tensor, a: Tensor, b: Tensor, out: Tensor) -> Tensor:
        if self.lowered:
            return self.bmm(a, b, out=out).add_(bias.to(self.acc))
        with torch.autocast(a.device.type, enabled=False):
            return torch.baddbmm(bias.to(self.acc), self.operand(a), self.operand(b), out=out)
