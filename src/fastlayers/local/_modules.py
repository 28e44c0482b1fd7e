"""The locally connected layers' public half: the functional forms and the modules, which validate
their arguments and hand the call to :func:`fastlayers.local._routing.run` (the backend choice).

Legend and formula: :mod:`fastlayers.local`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn

from .._core import precision, twice
from .._core.checks import (ArgumentError, DtypeError, InputDtypeError, ShapeError, check_same_dtype_device,
                             check_tensor, cpp_name, is_int, scalar_name)
from .._core.jit import NotScriptable
from ._reference import Pair
from ._routing import run


# what F.conv1d / F.conv2d raise (RuntimeError) for the same geometry: our errors start with it
_TORCH_REFUSES = {
    "stride": lambda values: "non-positive stride is not supported",
    "padding": lambda values: "negative padding is not supported",
}


def _dilation_refusal(values: tuple[int, ...], batch: int, view: tuple[int, ...] = ()) -> str:
    """F.conv1d / F.conv2d's message for a dilation < 1, which torch 2.13 words by the batch size
    (and F.conv1d with the 2-D view's pair, ``view`` = (1,))."""
    if batch > 1:
        return "non-positive dilation is not supported"
    return f"dilation should be greater than zero, but got {[*view, *values]}"


def _pair(name: str, value: int | tuple[int, ...], minimum: int, dims: int = 2,
          refusal: Callable[[], str] | None = None) -> tuple[int, ...]:
    if is_int(value):  # (NumPy's integers too, as nn.Conv2d takes them)
        values = (value,) * dims
    elif isinstance(value, (tuple, list)):
        values = tuple(value)
        if len(values) == 1 and name in _CONV_ARGUMENTS:  # (F.conv2d expands a one-element stride=(2,))
            values = values * dims
    else:  # (a float, a tensor, ...: named here, not "'float' object is not iterable")
        raise TypeError(f"{name}: expected an int or a tuple of {dims} ints, got {value!r}")
    if not all(is_int(v) for v in values):
        raise TypeError(f"{name}: expected an int or a tuple of {dims} ints, got {value!r}")
    if len(values) != dims:
        theirs = (f"expected {name} to be a single integer value or a list of {dims} values to match the convolution "
                  f"dimensions, but got {name}={list(values)}; " if name in _CONV_ARGUMENTS else "")
        raise ArgumentError(f"{theirs}{name}: expected an int or a tuple of {dims} ints, got {value!r}")
    values = tuple(int(v) for v in values)
    if any(v < minimum for v in values):
        if refusal is not None:  # (the caller's message, built only here)
            torch_says = refusal() + "; "
        elif name == "dilation":
            torch_says = _dilation_refusal(values, 1) + "; "
        else:
            torch_says = _TORCH_REFUSES[name](values) + "; " if name in _TORCH_REFUSES else ""
        raise ShapeError(f"{torch_says}{name}: expected every value >= {minimum}, got {value!r}")
    return values


_CONV_ARGUMENTS = ("stride", "padding", "dilation")  # (F.conv2d's per-dimension arguments)


def _values(value: object, dims: int) -> tuple:
    """``value`` as a tuple of ``dims`` entries for a message (anything malformed: as given)."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * dims


_PADDING_STRINGS = ("same", "valid")


def _padding(value: object, kernel_size: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...],
             dims: int, module: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(symmetric padding, extra padding after the input) per spatial dim, from an int, a tuple or
    nn.Conv2d's strings: ``"valid"`` (none) and ``"same"`` (an output the input's size; stride 1;
    total dilation * (k - 1), its odd remainder after: right / bottom, as F.conv2d pads). Errors
    as nn.Conv2d (``module``: ValueError) and F.conv2d (RuntimeError) raise them, ShapeError being both."""
    if not isinstance(value, str):
        return _pair("padding", value, 0, dims), (0,) * dims
    if value not in _PADDING_STRINGS:
        raise ShapeError(f"Invalid padding string {value!r}, should be one of {{'same', 'valid'}}" if module
                         else f"Invalid padding string: {value!r}")
    if value == "valid":
        return (0,) * dims, (0,) * dims
    if any(s != 1 for s in stride):
        raise ShapeError("padding='same' is not supported for strided convolutions")
    # (int(): torch.jit.trace records a weight's sizes as tensors; the padding is a constant of the trace)
    totals = [d * (int(k) - 1) for k, d in zip(kernel_size, dilation)]
    return tuple(t // 2 for t in totals), tuple(t % 2 for t in totals)


def _pad_after(x: Tensor, extra: tuple[int, ...]) -> Tensor:
    """x zero-padded by ``extra`` after its last len(extra) dims (the odd part of padding='same')."""
    if not any(extra):
        return x
    return torch.nn.functional.pad(x, [v for e in reversed(extra) for v in (0, e)])


def _check_channels(input: Tensor, batched: tuple[int, ...], weight: Tensor) -> None:
    """F.conv1d / F.conv2d's channel check and message (theirs, then ours): ``batched`` is the
    input's shape with a batch dimension (1 for an unbatched input), channels at index 1."""
    want, got = weight.size(1), batched[1]
    if got != want:
        raise ShapeError(f"Given groups=1, weight of size {list(weight.shape)}, expected input{list(batched)} to "
                         f"have {want} channels, but got {got} channels instead; input: expected C_in = {want} "
                         f"channels (weight.shape[1]), got {got} (input shape {tuple(input.shape)})")


def _check_bias_dtype(input: Tensor, bias: Tensor | None) -> None:
    """F.conv1d / F.conv2d's first check and message (theirs, then ours): the bias's dtype against
    the input's."""
    if bias is not None and bias.dtype != input.dtype:
        theirs = f"Input type ({cpp_name(input.dtype)}) and bias type ({cpp_name(bias.dtype)}) should be the same; "
        if not input.is_floating_point():
            raise InputDtypeError(f"{theirs}input: expected a floating-point tensor, got dtype {input.dtype}")
        raise DtypeError(f"{theirs}bias: expected dtype {input.dtype} (that of input), got {bias.dtype}")


def _check_dtypes(input: Tensor, weight: Tensor) -> None:
    """F.conv1d / F.conv2d's weight dtype check and message, after their shape checks (theirs,
    then ours); a non-floating input is refused here too."""
    theirs = (f"expected scalar type {scalar_name(input.dtype)} but found {scalar_name(weight.dtype)}; "
              if weight.dtype != input.dtype else "")
    if not input.is_floating_point():
        raise InputDtypeError(f"{theirs}input: expected a floating-point tensor, got dtype {input.dtype}")
    if weight.dtype != input.dtype:
        raise DtypeError(f"{theirs}weight: expected dtype {input.dtype} (that of input), got {weight.dtype}")


def _check_input_size(input: Tensor, input_size: tuple[int, ...] | None) -> None:
    """A module's input_size against the input's last dims (after F.conv2d's own checks, whose
    errors come first)."""
    if input_size is None:
        return
    spatial = tuple(input.shape[input.dim() - len(input_size):])
    if spatial != input_size:
        raise ShapeError(f"input: expected spatial size {input_size} (input_size), got {spatial} "
                         f"(input shape {tuple(input.shape)})")


def _sizes(values) -> str:
    return "(" + " x ".join(str(v) for v in values) + ")"


def output_size(input_size: tuple[int, ...], kernel_size: tuple[int, ...], stride: tuple[int, ...],
                padding: tuple[int, ...], dilation: tuple[int, ...]) -> tuple[int, ...]:
    """nn.Conv2d's output size; ShapeError (ValueError, RuntimeError: F.conv2d's) if the (dilated)
    kernel is larger than the padded input."""
    out = []
    for n, k, s, p, d in zip(input_size, kernel_size, stride, padding, dilation):
        span = d * (k - 1) + 1
        if span > n + 2 * p:
            padded = [m + 2 * q for m, q in zip(input_size, padding)]
            spans = [e * (j - 1) + 1 for j, e in zip(kernel_size, dilation)]
            raise ShapeError(
                f"Calculated padded input size per channel: {_sizes(padded)}. Kernel size: {_sizes(spans)}. "
                "Kernel size can't be greater than actual input size; "
                f"kernel_size: the dilated kernel spans {span} but the padded input is only {n + 2 * p} "
                f"(input_size {tuple(input_size)}, padding {tuple(padding)}, kernel_size {tuple(kernel_size)}, "
                f"dilation {tuple(dilation)})"
            )
        out.append((n + 2 * p - span) // s + 1)
    return tuple(out)


def locally_connected2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int | Pair = 1,
                        padding: int | Pair | str = 0, dilation: int | Pair = 1) -> Tensor:
    """Locally connected 2-D layer (unshared convolution), functional form.

    Args:
        input: (B, C_in, H, W) or unbatched (C_in, H, W), floating point.
        weight: (C_out, C_in, KH, KW, OH, OW), same dtype and device.
        bias: (C_out, OH, OW) or None.
        stride, padding, dilation: int or (h, w) pair as in F.conv2d (zero padding); padding also
            ``"valid"`` (none) or ``"same"`` (output of the input's size, stride 1; an odd total
            padding puts its extra row / column after the input, as F.conv2d does).

    Returns:
        (B, C_out, OH, OW) (unbatched: (C_out, OH, OW)).

    Raises:
        TypeError: non-tensor or integer input, dtype mismatch, malformed stride/padding/dilation
            (a stride / padding / dilation of one value is both dims', as F.conv2d takes it).
        ValueError: wrong ranks, channel count, an (OH, OW) in weight that the geometry does not
            produce from the input, a kernel larger than the padded input, stride/dilation < 1,
            padding < 0, a bias of the wrong shape. These and the dtype errors are RuntimeError
            too (what F.conv2d raises), checked in F.conv2d's order (the bias's dtype, the ranks,
            the geometry, the weight's dtype), and where F.conv2d refuses the same input (the
            bias's or the weight's dtype, the input's rank, its channel count, the kernel against
            the padded input, stride, padding, dilation and their number of values) the message
            starts with F.conv2d's (naming locally_connected2d where it says conv2d, and our
            weight's size), ours after it.

    A NaN or inf in the input reaches exactly the outputs whose receptive field holds it (as
    F.conv2d); the kernels assume nothing about finiteness.
    """
    return _locally_connected2d(input, weight, bias, stride, padding, dilation)


def _locally_connected2d(input: Tensor, weight: Tensor, bias: Tensor | None, stride: int | Pair,
                         padding: int | Pair | str, dilation: int | Pair,
                         input_size: tuple[int, ...] | None = None) -> Tensor:
    """:func:`locally_connected2d`; ``input_size``: a module's (H, W), checked after F.conv2d's
    checks (the geometry's included: an input smaller than the kernel gets its message)."""
    check_tensor("input", input)
    check_tensor("weight", weight)
    if bias is not None:
        check_tensor("bias", bias)
    input = precision.autocast_operand(input, weight.dtype)  # (an autocast layer's bf16 output: as F.conv2d takes it)
    _check_bias_dtype(input, bias)  # (F.conv2d's order: the bias's dtype, the ranks, the geometry, the weight's dtype)
    if input.dim() not in (3, 4):
        raise ShapeError("Expected 3D (unbatched) or 4D (batched) input to locally_connected2d, but got input of "
                         f"size: {list(input.shape)}; input: expected a 4-D (B, C_in, H, W) or 3-D (C_in, H, W) "
                         f"tensor, got {input.dim()}-D with shape {tuple(input.shape)}")
    if weight.dim() != 6:
        raise ShapeError(f"weight: expected a 6-D tensor (C_out, C_in, KH, KW, OH, OW), got {weight.dim()}-D "
                         f"with shape {tuple(weight.shape)}")
    batch = input.size(0) if input.dim() == 4 else 1
    stride2 = _pair("stride", stride, 1)
    dilation2 = _pair("dilation", dilation, 1, refusal=lambda: _dilation_refusal(_values(dilation, 2), batch))
    padding2, extra = _padding(padding, tuple(weight.shape[2:4]), stride2, dilation2, 2)
    batched = input.dim() == 4
    x = input if batched else input.unsqueeze(0)
    _check_channels(input, tuple(x.shape), weight)
    x = _pad_after(x, extra)
    expected = output_size(tuple(x.shape[2:]), tuple(weight.shape[2:4]), stride2, padding2, dilation2)
    _check_dtypes(input, weight)
    check_same_dtype_device("weight", weight, "input", input)
    _check_input_size(input, input_size)
    if tuple(weight.shape[4:]) != expected:
        raise ShapeError(
            f"input: spatial size {tuple(x.shape[2:])} gives output size {expected} with kernel_size "
            f"{tuple(weight.shape[2:4])}, stride {stride2}, padding {padding2}, dilation {dilation2}, but weight is for "
            f"output size {tuple(weight.shape[4:])} (weight.shape[4:])"
        )
    if bias is not None:
        check_same_dtype_device("bias", bias, "input", input)
        want = (weight.size(0), *expected)
        if tuple(bias.shape) != want:
            raise ShapeError(f"bias: expected shape {want} (C_out, OH, OW), got {tuple(bias.shape)}")
    y = run(x, weight, bias, stride2, padding2, dilation2)
    return y if batched else y.squeeze(0)


def locally_connected1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int = 1,
                        padding: int | str = 0, dilation: int = 1) -> Tensor:
    """Locally connected 1-D layer, functional form (as :func:`locally_connected2d` with H = 1;
    unshared convolution, Keras' ``LocallyConnected1D``). Legend: B batch, C_in / C_out channels,
    L input positions, K kernel, OL output positions (F.conv1d's formula). Any floating dtype (that
    of ``input``, ``weight`` and ``bias`` alike); low precision sums in float32.

    Args:
        input: (B, C_in, L) or unbatched (C_in, L). weight: (C_out, C_in, K, OL). bias: (C_out, OL) or None.
        stride, padding, dilation: ints as in F.conv1d (padding also ``"valid"`` or ``"same"``).

    Returns:
        (B, C_out, OL) (unbatched: (C_out, OL)). Raises as :func:`locally_connected2d`.
    """
    return _locally_connected1d(input, weight, bias, stride, padding, dilation)


def _locally_connected1d(input: Tensor, weight: Tensor, bias: Tensor | None, stride: int, padding: int | str,
                         dilation: int, input_size: tuple[int] | None = None) -> Tensor:
    """:func:`locally_connected1d`; ``input_size``: a module's (L,), as :func:`_locally_connected2d`'s."""
    check_tensor("input", input)
    check_tensor("weight", weight)
    if bias is not None:
        check_tensor("bias", bias)
    input = precision.autocast_operand(input, weight.dtype)
    _check_bias_dtype(input, bias)  # (F.conv1d's order, as the 2-D form's)
    if input.dim() not in (2, 3):
        raise ShapeError("Expected 2D (unbatched) or 3D (batched) input to locally_connected1d, but got input of "
                         f"size: {list(input.shape)}; input: expected a 3-D (B, C_in, L) or 2-D (C_in, L) tensor, "
                         f"got {input.dim()}-D with shape {tuple(input.shape)}")
    if weight.dim() != 4:
        raise ShapeError(f"weight: expected a 4-D tensor (C_out, C_in, K, OL), got {weight.dim()}-D "
                         f"with shape {tuple(weight.shape)}")
    batch = input.size(0) if input.dim() == 3 else 1
    (s,) = _pair("stride", stride, 1, 1)
    (d,) = _pair("dilation", dilation, 1, 1, refusal=lambda: _dilation_refusal(_values(dilation, 1), batch, view=(1,)))
    (p,), extra = _padding(padding, (weight.size(2),), (s,), (d,), 1)
    # (checked here, before the 2-D call, for F.conv1d's message with the 1-D shapes)
    _check_channels(input, tuple(input.shape) if input.dim() == 3 else (1, *input.shape), weight)
    given, input = input, _pad_after(input, extra)
    (length,) = output_size((input.size(-1),), (weight.size(2),), (s,), (p,), (d,))
    _check_dtypes(input, weight)
    check_same_dtype_device("weight", weight, "input", input)
    _check_input_size(given, input_size)
    if weight.size(3) != length:
        raise ShapeError(f"input: length {input.size(-1)} gives output length {length} with kernel_size "
                         f"{weight.size(2)}, stride {s}, padding {p}, dilation {d}, but weight is for output length "
                         f"{weight.size(3)} (weight.shape[3])")
    if bias is not None:
        if tuple(bias.shape) != (weight.size(0), weight.size(3)):
            raise ShapeError(f"bias: expected shape ({weight.size(0)}, {weight.size(3)}) (C_out, OL), "
                             f"got {tuple(bias.shape)}")
        bias = bias.unsqueeze(1)  # (O, 1, OL)
    y = locally_connected2d(input.unsqueeze(-2), weight.unsqueeze(2).unsqueeze(4), bias, (1, s), (0, p), (1, d))
    return y.squeeze(-2)


class _LocallyConnectedNd(NotScriptable, nn.Module):
    def __init__(self, dims, in_channels, out_channels, input_size, kernel_size, stride, padding, dilation, bias,
                 device, dtype):
        super().__init__()
        channels = (("out_channels", out_channels), ("in_channels", in_channels))  # (the weight's order)
        for name, value in channels:
            if not is_int(value):  # (zero channels and NumPy integers: as nn.Conv2d takes them)
                raise ArgumentError(f"{name}: expected an int >= 0, got {value!r}")
        in_channels, out_channels = int(in_channels), int(out_channels)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.input_size = _pair("input_size", input_size, 1, dims)
        self.kernel_size = _pair("kernel_size", kernel_size, 1, dims)
        for name, value in channels:
            if value < 0:  # (nn.Conv2d's weight allocation refuses it)
                raise ShapeError(f"Trying to create tensor with negative dimension {int(value)}: "
                                 f"{[out_channels, in_channels, *self.kernel_size]}; {name}: expected an int >= 0, "
                                 f"got {value!r}")
        self.stride = _pair("stride", stride, 1, dims)
        self.dilation = _pair("dilation", dilation, 1, dims)
        # padding: as given when a string (nn.Conv2d keeps "same" / "valid"), else the tuple; the
        # kernels take the symmetric part, the odd rest of "same" pads the input after it
        self._padding, self._extra = _padding(padding, self.kernel_size, self.stride, self.dilation, dims, module=True)
        self.padding: tuple[int, ...] | str = padding if isinstance(padding, str) else self._padding
        padded = tuple(n + e for n, e in zip(self.input_size, self._extra))
        self.output_size = output_size(padded, self.kernel_size, self.stride, self._padding, self.dilation)
        kw = {"device": device, "dtype": dtype}
        self._weight_shape = (out_channels, in_channels, *self.kernel_size, *self.output_size)
        self._bias_shape, self._input_shape = (out_channels, *self.output_size), (in_channels, *self.input_size)
        self.weight = nn.Parameter(torch.empty(self._weight_shape, **kw))
        self.bias = nn.Parameter(torch.empty(out_channels, *self.output_size, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Conv2d's rule: weight and bias uniform in +-1/sqrt(fan_in), fan_in = C_in * prod(kernel_size)
        (no input channels: a zero bias, where nn.Conv2d leaves its bias uninitialised)."""
        fan_in = self.in_channels * math.prod(self.kernel_size)
        bound = 1 / math.sqrt(fan_in) if fan_in else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def _common(self, input: object, rank: int) -> bool:
        """The common valid call, checked in a few operations: a batched input of the weight's dtype
        (a floating one) and device, C_in channels and input_size, and the weight and bias of the
        construction's shapes. False: anything else, for the full checks (which also raise the
        errors)."""
        w, b = self.weight, self.bias
        return (type(input) is Tensor and input.dim() == rank and input.dtype == w.dtype
                and w.dtype.is_floating_point and input.device == w.device and input.shape[1:] == self._input_shape
                and w.shape == self._weight_shape
                and (b is None or (b.shape == self._bias_shape and b.dtype == w.dtype and b.device == w.device)))

    def extra_repr(self) -> str:
        """nn.Conv2d's (padding, dilation and bias shown where not the default), with input_size
        and output_size."""
        dims = len(self.kernel_size)
        text = (f"{self.in_channels}, {self.out_channels}, input_size={self.input_size}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}")
        if self.padding != (0,) * dims:
            text += f", padding={self.padding}"
        if self.dilation != (1,) * dims:
            text += f", dilation={self.dilation}"
        text += f", output_size={self.output_size}"
        return text + (", bias=False" if self.bias is None else "")


class LocallyConnected2d(_LocallyConnectedNd):
    """Locally connected 2-D layer: nn.Conv2d with a separate filter and bias per output location
    (unshared convolution: Taigman et al. 2014; Keras' ``LocallyConnected2D``). Any floating dtype
    (``device`` / ``dtype`` as torch.nn modules); low precision sums in float32.

    Args:
        in_channels, out_channels: C_in, C_out.
        input_size: (H, W) (or int) of the inputs this layer takes; fixes the output size.
        kernel_size, stride, padding, dilation: as nn.Conv2d (zero padding; padding also
            ``"valid"`` or ``"same"``, stride 1, as nn.Conv2d, which keeps the string in ``padding``).
        bias: learn a bias per output channel and location.

    Parameters: ``weight`` (C_out, C_in, KH, KW, OH, OW), ``bias`` (C_out, OH, OW); initialised
    with nn.Conv2d's fan-in rule.

    Legend: B batch, C_in / C_out channels, (H, W) = ``input_size``, (KH, KW) the kernel, (OH, OW)
    the output size (nn.Conv2d's formula).

    Forward: input (B, C_in, H, W) or (C_in, H, W) -> (B, C_out, OH, OW) or (C_out, OH, OW).
    ValueError for a spatial size other than ``input_size`` or a wrong channel count, TypeError
    for integer input or another dtype; see
    :func:`fastlayers.functional.locally_connected2d` (also for non-finite input: NaN / inf reach
    exactly the outputs whose receptive field holds them).
    """

    def __init__(self, in_channels: int, out_channels: int, input_size: int | Pair, kernel_size: int | Pair = 1,
                 stride: int | Pair = 1, padding: int | Pair | str = 0, dilation: int | Pair = 1, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__(2, in_channels, out_channels, input_size, kernel_size, stride, padding, dilation, bias,
                         device, dtype)

    def forward(self, input: Tensor) -> Tensor:
        """``input`` (B, C_in, H, W) or (C_in, H, W), (H, W) = ``input_size``, the weight's dtype
        and device -> (B, C_out, OH, OW) or (C_out, OH, OW). ValueError for another spatial size
        or channel count, TypeError for integer input or another dtype."""
        if self._common(input, 4):  # the module's own weight: its geometry was checked at construction
            return run(_pad_after(input, self._extra), self.weight, self.bias, self.stride, self._padding,
                       self.dilation)
        return _locally_connected2d(input, self.weight, self.bias, self.stride, self.padding, self.dilation,
                                    self.input_size)


class LocallyConnected1d(_LocallyConnectedNd):
    """Locally connected 1-D layer: nn.Conv1d with a separate filter and bias per output position
    (Keras' ``LocallyConnected1D``). Legend: B batch, C_in / C_out channels, L = ``input_size``
    positions, K kernel, OL output positions.

    Parameters: ``weight`` (C_out, C_in, K, OL), ``bias`` (C_out, OL). Forward: (B, C_in, L) or
    (C_in, L) -> (B, C_out, OL) or (C_out, OL), the weight's floating dtype. Arguments, dtypes and
    errors (ValueError for another length or channel count, TypeError for integer input or another
    dtype) as :class:`LocallyConnected2d`.
    """

    def __init__(self, in_channels: int, out_channels: int, input_size: int, kernel_size: int = 1, stride: int = 1,
                 padding: int | str = 0, dilation: int = 1, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(1, in_channels, out_channels, input_size, kernel_size, stride, padding, dilation, bias,
                         device, dtype)

    def _as_2d(self) -> tuple[Tensor, Tensor | None]:
        """weight (C_out, C_in, 1, K, 1, OL) and bias (C_out, 1, OL) as views of the parameters. Eager
        calls without autograd keep views of detached aliases while the parameters are the same
        tensors on the same memory (an in-place update shows through a view; a replaced parameter
        or ``.data`` makes new ones), holding no reference to the parameters (a replaced one is
        freed, and ``torch.utils.swap_tensors`` conversions see no extra one); calls with autograd,
        traced or compiled ones, and those under torch.func transforms (whose tensors have no
        memory to compare) make them each time, and drop kept views of parameters since replaced
        (whose memory they held through any number of training calls)."""
        w, b = self.weight, self.bias
        traced = torch.compiler.is_compiling() or torch.jit.is_tracing()
        key = None
        if not traced:
            try:
                key = (id(w), w.data_ptr(), w.stride(), id(b), b.data_ptr() if b is not None else 0)
            except RuntimeError:  # a torch.func transform's wrapper (vmap over the parameters): no memory
                pass
        cached = self.__dict__.get("_views_2d")
        if key is None or twice.graph_recorded():
            if cached is not None and cached[0] != key and not traced:  # (a replaced parameter's memory:
                del self.__dict__["_views_2d"]  # not held by stale views through training calls)
            return w.unsqueeze(2).unsqueeze(4), b.unsqueeze(1) if b is not None else None
        if cached is None or cached[0] != key:  # (an id is reused only once its tensor is freed: the kept
            cached = (key, w.detach().unsqueeze(2).unsqueeze(4),  # views keep the memory, so the address differs)
                      b.detach().unsqueeze(1) if b is not None else None)
            self.__dict__["_views_2d"] = cached
        return cached[1], cached[2]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_views_2d", None)  # (keyed by ids: a pickled or copied module makes its own)
        return state

    def forward(self, input: Tensor) -> Tensor:
        """``input`` (B, C_in, L) or (C_in, L), L = ``input_size``, the weight's dtype and device
        -> (B, C_out, OL) or (C_out, OL); errors as :meth:`LocallyConnected2d.forward`."""
        if self._common(input, 3):  # as LocallyConnected2d's, with H = 1
            weight, bias = self._as_2d()
            y = run(_pad_after(input, self._extra).unsqueeze(-2), weight, bias, (1, self.stride[0]),
                    (0, self._padding[0]), (1, self.dilation[0]))
            return y.squeeze(-2)
        padding = self.padding if isinstance(self.padding, str) else self.padding[0]
        return _locally_connected1d(input, self.weight, self.bias, self.stride[0], padding, self.dilation[0],
                                    self.input_size)
