"""Input validation shared by every layer: errors name the argument, expected vs got."""

from __future__ import annotations

import numbers

import torch
from torch import Tensor


# Errors are instances of the class torch.nn raises for the same bad input *and* of the class our
# messages have always used, so code that catches either one keeps working (issue: drop-in contract).
class ShapeError(ValueError, RuntimeError):
    """A size or shape other than expected (torch.nn's RNNs raise RuntimeError for these)."""


class DtypeError(TypeError, RuntimeError):
    """A tensor of another dtype than the one it must match (torch.nn's RNNs: RuntimeError for hx)."""


class InputDtypeError(TypeError, ValueError, RuntimeError):
    """Input of another dtype than the parameters, or not floating point (torch.nn's RNNs: ValueError;
    its cells: RuntimeError from the matrix product)."""


class StateTypeError(TypeError, IndexError, RuntimeError, AttributeError):
    """An LSTM state that is not a pair (h_0, c_0) (torch.nn.LSTM: IndexError for one tensor,
    RuntimeError for three, AttributeError for a non-tensor)."""


class RankError(ShapeError, IndexError):
    """A tensor of too few dimensions where torch indexes a dimension it lacks (torch.nn's cells:
    IndexError "Dimension out of range" for a 1-D state beside a batched input)."""


class DeviceError(ValueError, RuntimeError):
    """A tensor on another device than the one it must match (torch.nn's RNNs: RuntimeError)."""


class LengthsError(ValueError, RuntimeError):
    """A length outside [1, T] (torch's pack_padded_sequence: RuntimeError; traced calls check the
    lengths in the graph, which raises RuntimeError too)."""


class LengthsShapeError(LengthsError, IndexError):
    """Lengths of another rank or count than (B,) (torch's pack_padded_sequence: RuntimeError for a
    0-D tensor or an int, IndexError or RuntimeError from its indexing for the others)."""


class ArgumentError(TypeError, ValueError, RuntimeError):
    """An argument of the wrong type or length where torch raises any of these: lengths that are not
    integers (torch: TypeError for None, ValueError for a str), a convolution's stride / padding /
    dilation of another length than its spatial dims (F.conv2d: RuntimeError)."""


class MetaLengthsError(ValueError, NotImplementedError):
    """Lengths on the meta device, whose values cannot be read (torch: NotImplementedError)."""


# (torch's pack_padded_sequence's message, which torch's tests match; ours follows it)
_NOT_POSITIVE = "Length of all samples has to be greater than 0, but found an element in 'lengths' that is <= 0"


class NotATensorError(TypeError, AttributeError):
    """A non-tensor where a tensor goes (torch.nn's RNNs call .dim() on it: AttributeError)."""


_SCALAR = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
           torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
           torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}
_CPP = {torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16",
        torch.int64: "long int", torch.int32: "int", torch.int16: "short int", torch.int8: "signed char",
        torch.uint8: "unsigned char", torch.bool: "bool", torch.complex64: "c10::complex<float>",
        torch.complex128: "c10::complex<double>"}


def scalar_name(dtype: torch.dtype) -> str:
    """A dtype as ATen's messages print its ScalarType (torch.float32 -> Float)."""
    return _SCALAR.get(dtype, str(dtype).removeprefix("torch."))


def cpp_name(dtype: torch.dtype) -> str:
    """A dtype as ATen's messages print its C++ type (torch.float32 -> float, float16 -> c10::Half)."""
    return _CPP.get(dtype, str(dtype).removeprefix("torch."))


def is_int(value: object) -> bool:
    """An integer size as torch.nn's Conv / Linear take one: a Python or NumPy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise NotATensorError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_floating(name: str, value: Tensor) -> None:
    if not value.is_floating_point():
        raise InputDtypeError(f"{name}: expected a floating-point tensor, got dtype {value.dtype}")


def check_rank(name: str, value: Tensor, allowed: tuple[int, ...], legend: str) -> None:
    if value.dim() not in allowed:
        want = " or ".join(f"{r}-D" for r in allowed)
        raise ValueError(f"{name}: expected a {want} tensor {legend}, got {value.dim()}-D with shape {tuple(value.shape)}")


def check_shape(name: str, value: Tensor, expected: tuple[int, ...], legend: str = "") -> None:
    if tuple(value.shape) != tuple(expected):
        extra = f" {legend}" if legend else ""
        raise ShapeError(f"{name}: expected shape {tuple(expected)}{extra}, got {tuple(value.shape)}")


def check_same_dtype_device(name: str, value: Tensor, ref_name: str, ref: Tensor) -> None:
    if value.dtype != ref.dtype:
        raise DtypeError(f"{name}: expected dtype {ref.dtype} (that of {ref_name}), got {value.dtype}")
    if value.device != ref.device:
        raise DeviceError(f"{name}: expected device {ref.device} (that of {ref_name}), got {value.device}")


def as_lengths(lengths: object, batch: int, max_len: int, name: str = "lengths") -> Tensor:
    """Validate a per-sequence lengths argument and return it as a CPU int64 tensor of shape (B,).

    Accepts a 1-D integer tensor on any device, a 1-D integer NumPy array, or a sequence (list,
    tuple, range) of ints (Python's or NumPy's, or one-element integer tensors), as torch's
    ``pack_padded_sequence`` does (which also takes floats and
    truncates them; here they are a TypeError). Every value must satisfy 1 <= length <= max_len.
    The errors are instances of the class torch's ``pack_padded_sequence`` raises for the same
    lengths and start with its message where it has one of its own (a 0-D tensor or an int, a
    length < 1).
    """
    if isinstance(lengths, Tensor):
        t = lengths
        if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
            raise ArgumentError(f"{name}: expected an integer tensor, got dtype {t.dtype}")
    elif isinstance(lengths, (list, tuple, range)):
        plain = True  # Python ints only (checked first: the ABC check costs ten times as much)
        for v in lengths:
            if type(v) is int:
                continue
            if isinstance(v, Tensor) and v.numel() == 1 and not (v.dtype == torch.bool or v.is_floating_point()
                                                                 or v.is_complex()):
                plain = False  # (list(a lengths tensor): one-element integer tensors, as pack_padded_sequence takes)
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ArgumentError(f"{name}: expected a sequence of ints, got an element of type "
                                    f"{type(v).__name__} ({v!r})")
            plain = False
        t = torch.tensor(list(lengths) if plain else [int(v) for v in lengths], dtype=torch.int64)
    elif type(lengths).__module__ == "numpy" and hasattr(lengths, "dtype") and hasattr(lengths, "shape"):
        if getattr(lengths.dtype, "kind", None) not in ("i", "u"):  # (bool is kind "b", floats "f")
            raise ArgumentError(f"{name}: expected an integer array, got dtype {lengths.dtype}")
        t = torch.tensor(lengths.tolist(), dtype=torch.int64)  # (any strides, a reversed view too)
    elif is_int(lengths):  # (torch makes it a 0-D tensor, refused below with its message)
        t = torch.tensor(int(lengths), dtype=torch.int64)
    else:
        raise ArgumentError(f"{name}: expected a 1-D integer tensor or a sequence of ints, got "
                            f"{type(lengths).__name__}")
    if t.dim() != 1:
        raise LengthsShapeError(f"'lengths' argument should be a 1D CPU int64 tensor, but got {t.dim()}D "
                                f"{t.device} Long tensor; {name}: expected a 1-D tensor of shape ({batch},), got "
                                f"shape {tuple(t.shape)}")
    if t.numel() != batch:
        raise LengthsShapeError(f"{name}: expected {batch} lengths (one per sequence in the batch), got {t.numel()}")
    if torch.compiler.is_compiling():  # the values are not known when tracing: checked in the graph
        t = t.to(torch.int64).contiguous()
        # (a constant message each: the values are not known, and T may be a symbol: formatting it
        # would specialise a dynamic size)
        torch._assert_async((t >= 1).all(), f"{_NOT_POSITIVE}; {name}: every length must be >= 1, got a smaller one")
        torch._assert_async((t <= max_len).all(),
                            f"{name}: every length must be <= T (the padded time size), got a larger one")
        return t
    if t.device.type == "meta":  # (no values to read: shape inference of a call with lengths)
        raise MetaLengthsError(f"{name}: expected a tensor with values (on the CPU or the input's device) or a "
                               f"sequence of ints, got a meta tensor")
    t = t.to(device="cpu", dtype=torch.int64).contiguous()  # kernels read lengths[b] (a strided view: a copy)
    if batch:
        lo, hi = (int(v) for v in torch.aminmax(t))
        if lo < 1:
            raise LengthsError(f"{_NOT_POSITIVE}; {name}: every length must be >= 1, got {lo}")
        if hi > max_len:
            raise LengthsError(f"{name}: every length must be <= T = {max_len} (the padded time size), got {hi}")
    return t
