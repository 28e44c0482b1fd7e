"""Input checks of the recurrent layers and cells: torch.nn's checks, in torch.nn's order, with
torch.nn's message first and ours after it.

torch's own tests (``test_modules.py::test_errors``) and user code match torch's wording with a
regular expression, so every error a check here raises for an input torch.nn's module also rejects
starts with the message torch 2.13's module raises for it (its Python checks, or the message its
C++ kernel raises where the check happens there: ``input has inconsistent input_size``, ``lstm
expects two hidden states``), then ``"; "`` and ours, naming the argument, expected vs got. Where
torch's own message differs by backend (a state of another dtype than the input), the message of
torch's device-independent check (``RNN.h``'s ``check_attributes``) is used. The classes are
those of :mod:`fastlayers._core.checks`: instances of torch's class for the same input and of ours.

Checks run in torch's order (the input's rank, the state's rank, the input's dtype, then sizes;
for the cells the sizes before the dtype, where the matrix product reports it), so an input with
two faults reports the one torch reports.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._core.checks import (DeviceError, DtypeError, InputDtypeError, NotATensorError, RankError, ShapeError,
                             StateTypeError, cpp_name, scalar_name)

_LAYER_SHAPES = "(T, B, F) or (B, T, F) if batch_first, or unbatched (T, F)"


def _rank(name: str, value: object) -> int:
    """``value.dim()`` as torch.nn's modules call it: a non-tensor raises AttributeError with
    Python's message for the missing attribute, as theirs does."""
    if not isinstance(value, Tensor):
        kind = type(value).__name__
        raise NotATensorError(f"'{kind}' object has no attribute 'dim'; {name}: expected a torch.Tensor, got {kind}")
    return value.dim()


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


# ---- layers (torch.nn.RNNBase / LSTM / GRU / RNN .forward for a padded or unbatched input)

def check_layer(mode: str, input: object, hx: object, *, input_size: int, weight_dtype: torch.dtype,
                expected: tuple[tuple[int, int, int], ...]) -> tuple[Tensor, tuple[Tensor, ...] | None]:
    """Validate a layer call; returns (input, hx as batched 3-D states or None).

    ``mode``: "LSTM", "GRU" or "RNN"; ``expected``: the batched state shapes (L*D, B, H_out) (and
    (L*D, B, H) for LSTM's c) for this input, B = 1 for an unbatched input.
    """
    rank = _rank("input", input)
    assert isinstance(input, Tensor)
    if rank not in (2, 3):
        raise ValueError(f"{mode}: Expected input to be 2D or 3D, got {rank}D{' tensor' if mode == 'RNN' else ''} "
                         f"instead; input: expected {_LAYER_SHAPES}, got shape {tuple(input.shape)}")
    batched = rank == 3
    states = None if hx is None else (_lstm_states(hx, batched) if mode == "LSTM" else _single_state(hx, batched))
    if input.dtype != weight_dtype:
        note = "" if input.is_floating_point() else " (input must be floating point)"
        raise InputDtypeError(
            f"RNN input dtype ({input.dtype}) does not match weight dtype ({weight_dtype}). Convert input: "
            f"input.to({weight_dtype}), or convert model: model.to({input.dtype}); input: expected dtype "
            f"{weight_dtype} (the parameters' dtype), got {input.dtype}{note}")
    if input.size(-1) != input_size:
        raise ShapeError(f"input.size(-1) must be equal to input_size. Expected {input_size}, got {input.size(-1)}; "
                         f"input: expected {_LAYER_SHAPES} with F = input_size = {input_size}, "
                         f"got shape {tuple(input.shape)}")
    if states is None:
        return input, None
    names = ("hx[0] (h_0)", "hx[1] (c_0)") if mode == "LSTM" else ("hx",)
    legend = f"(num_layers * D, {'B, ' if batched else ''}{'H_out' if mode == 'LSTM' else 'H'})"
    for i, (name, state, shape) in enumerate(zip(names, states, expected)):
        got = state if batched else state.unsqueeze(1)  # torch compares the unsqueezed state
        if tuple(got.shape) != shape:
            label = f"hidden[{i}]" if mode == "LSTM" else "hidden"
            want = shape if batched else (shape[0], shape[2])
            raise ShapeError(f"Expected {label} size {shape}, got {list(got.shape)}; {name}: expected shape {want} "
                             f"{legend.replace('H_out', 'H') if i else legend}, got {tuple(state.shape)}")
    if mode == "LSTM" and isinstance(hx, Tensor) and batched:  # torch's kernel takes a tuple, never a stacked
        # tensor (an unbatched input's state torch indexes itself: hx[0], hx[1] of a (2, L*D, H_out) tensor)
        raise StateTypeError(f"lstm() received an invalid combination of arguments - hx: expected a tuple (h_0, c_0) "
                             f"of two tensors, got {_describe(hx)}")
    if mode == "LSTM" and len(states) != 2:
        raise StateTypeError(f"lstm expects two hidden states; hx: expected a tuple (h_0, c_0) of two tensors, "
                             f"got {_describe(hx)}")
    for name, state in zip(names, states):
        _same_dtype_device(name, state, input)
    return input, tuple(s if batched else s.unsqueeze(1) for s in states)


def _lstm_states(hx: object, batched: bool) -> tuple[Tensor, ...]:
    """hx[0], hx[1] (and the rest) as torch.nn.LSTM reads them, with its errors for anything else."""
    try:  # in torch's order: hx[0].dim(), then hx[1].dim()
        h = hx[0]  # type: ignore[index]
        rank_h = h.dim()
        c = hx[1]  # type: ignore[index]
        ranks = (rank_h, c.dim())
    except (TypeError, IndexError, AttributeError) as e:
        raise StateTypeError(f"{e}; hx: expected a tuple (h_0, c_0) of two tensors, got {_describe(hx)}") from None
    want = 3 if batched else 2
    if ranks != (want, want):
        kind = "batched 3-D" if batched else "unbatched 2-D"
        raise ShapeError(f"For {kind} input, hx and cx should also be {want}-D but got ({ranks[0]}-D, {ranks[1]}-D) "
                         f"tensors; hx: expected (h_0, c_0) of {want}-D tensors, got {_describe(hx)} with shapes "
                         f"({tuple(h.shape)}, {tuple(c.shape)})")
    states = tuple(hx) if isinstance(hx, (tuple, list)) else tuple(hx.unbind(0))  # type: ignore[union-attr]
    for i, s in enumerate(states[2:], 2):
        if not isinstance(s, Tensor):
            raise StateTypeError(f"lstm expects two hidden states; hx[{i}]: expected no third element, got "
                                 f"{type(s).__name__}")
    return states


def _single_state(hx: object, batched: bool) -> tuple[Tensor]:
    rank = _rank("hx", hx)
    assert isinstance(hx, Tensor)
    want = 3 if batched else 2
    if rank != want:
        kind = "batched 3-D" if batched else "unbatched 2-D"
        raise ShapeError(f"For {kind} input, hx should also be {want}-D but got {rank}-D tensor; hx: expected "
                         f"{'(num_layers * D, B, H)' if batched else '(num_layers * D, H)'}, got shape {tuple(hx.shape)}")
    return (hx,)


def _same_dtype_device(name: str, state: Tensor, input: Tensor) -> None:
    if state.dtype != input.dtype:
        raise DtypeError(f"Input and hidden tensors are not the same dtype, found input tensor with "
                         f"{scalar_name(input.dtype)} and hidden tensor with {scalar_name(state.dtype)}; {name}: "
                         f"expected dtype {input.dtype} (that of input), got {state.dtype}")
    if state.device != input.device:
        raise DeviceError(f"Input and hidden tensors are not at the same device, found input tensor at {input.device} "
                          f"and hidden tensor at {state.device}; {name}: expected device {input.device} (that of "
                          f"input), got {state.device}")


def check_parameters_device(input: Tensor, weight: Tensor | None) -> None:
    """torch.nn's RNNs' error for parameters on another device than the input (their kernel's check,
    after the states'): the engines would otherwise copy across devices or read another device's
    memory."""
    if weight is not None and weight.device != input.device:
        raise DeviceError(f"Input and parameter tensors are not at the same device, found input tensor at "
                          f"{input.device} and parameter tensor at {weight.device}; the parameters: expected device "
                          f"{input.device} (that of input), got {weight.device}")


def check_parameter_dtypes(params: dict[str, Tensor], dtype: torch.dtype, first: str, suffix: str = "") -> None:
    """DtypeError (a TypeError and a RuntimeError, what torch.nn's layers and cells raise from
    their kernels) naming a parameter of another dtype than ``first``'s, ``dtype``: the option
    engines would convert it silently."""
    for key, t in params.items():
        if t.dtype != dtype:
            raise DtypeError(f"{key}{suffix}: expected dtype {dtype} (that of {first}: the parameters share one "
                             f"dtype), got {t.dtype}; convert the module: module.to({dtype})")


# ---- cells (torch.nn.LSTMCell / GRUCell / RNNCell .forward, then the checks of their ATen kernels)

def check_cell(cls: str, mode: str, input: object, hx: object, *, input_size: int, weight_dtype: torch.dtype,
               sizes: tuple[int, ...], bias: bool = True) -> tuple[Tensor, tuple[Tensor, ...], bool]:
    """Validate a cell call; returns (input (B, F), states as batched 2-D tensors, whether batched).

    ``cls``: the torch class name in messages ("LSTMCell", ...); ``mode``: "LSTM", "GRU" or "RNN";
    ``sizes``: the state sizes, (P, H) for LSTM (P = H without a projection), (H,) otherwise;
    ``bias``: whether the cell has biases (torch's message for a dtype differs without them).
    A missing state (None) is zeros.
    """
    fast = _cell_fast_path(mode, input, hx, input_size, weight_dtype, sizes)
    if fast is not None:
        return fast
    rank = _rank("input", input)
    assert isinstance(input, Tensor)
    if rank not in (1, 2):
        raise ValueError(f"{cls}: Expected input to be 1D or 2D, got {rank}D instead; input: expected (B, F) or (F,) "
                         f"with F = input_size = {input_size}, got shape {tuple(input.shape)}")
    batched = rank == 2
    lstm = mode == "LSTM"
    names = ("hx[0] (h)", "hx[1] (c)") if lstm else ("hx",)
    if hx is not None:
        states = _cell_lstm_states(cls, hx, batched) if lstm else _cell_single_state(cls, hx)
    x = input if batched else input.unsqueeze(0)
    if hx is None:
        states = tuple(x.new_zeros(x.size(0), size) for size in sizes)
    else:
        states = tuple(s if batched else s.unsqueeze(0) for s in states)
    if x.size(1) != input_size:
        raise ShapeError(f"input has inconsistent input_size: got {x.size(1)} expected {input_size}; input: expected "
                         f"feature size input_size = {input_size} in the last dimension, got shape {tuple(input.shape)}")
    for i, (name, state, size) in enumerate(zip(names, states, sizes)):
        want = (x.size(0), size) if batched else (size,)
        got = tuple(state.shape) if batched else tuple(state.shape[1:])
        if state.size(0) != x.size(0):
            raise ShapeError(f"Input batch size {x.size(0)} doesn't match hidden{i} batch size {state.size(0)}; {name}: "
                             f"expected shape {want}, got {got}")
        if batched and state.dim() == 1:  # torch reads its size(1)
            raise RankError(f"Dimension out of range (expected to be in range of [-1, 0], but got 1); {name}: "
                            f"expected shape {want} (B, H), got {got}")
        if state.dim() != 2 or state.size(1) != size:
            theirs = (f"hidden{i} has inconsistent hidden_size: got {state.size(1)}, expected {size}; "
                      if state.dim() > 1 and state.size(1) != size else "")
            raise ShapeError(f"{theirs}{name}: expected shape {want} {'(B, H)' if batched else '(H,)'}, got {got}")
    # torch's LSTM and RNN cells multiply the state first (its GRU cell the input): with both of
    # another dtype than the parameters, the state's is the one reported
    state_first = hx is not None and mode != "GRU" and states[0].dtype != weight_dtype
    if x.dtype != weight_dtype and not state_first:
        raise InputDtypeError(
            f"{_product_dtype_message(x.dtype, weight_dtype, bias)}; input: expected dtype {weight_dtype} (the "
            f"parameters' dtype), got {x.dtype}. Convert input: input.to({weight_dtype}), or convert model: "
            f"model.to({x.dtype})")
    for i, (name, state) in enumerate(zip(names, states)):
        if state.dtype != x.dtype or i == 0 and state_first:
            theirs = f"{_product_dtype_message(state.dtype, weight_dtype, bias)}; " if i == 0 else ""
            want = f"{x.dtype} (that of input)" if x.dtype == weight_dtype else f"{weight_dtype} (the parameters')"
            raise DtypeError(f"{theirs}{name}: expected dtype {want}, got {state.dtype}")
        if state.device != x.device:
            # (torch's cells fail in the matrix product with the dispatcher's message)
            raise DeviceError(f"Expected all tensors to be on the same device, but found at least two devices, "
                              f"{x.device} and {state.device}!; {name}: expected device {x.device} (that of input), "
                              f"got {state.device}")
    return x, states, batched


def _product_dtype_message(dtype: torch.dtype, weight_dtype: torch.dtype, bias: bool) -> str:
    """The message of the matrix product a torch cell runs on an operand of another dtype than its
    weights: addmm's with a bias, mm's (C++ type names) without."""
    if bias:
        return f"mat1 and mat2 must have the same dtype, but got {scalar_name(dtype)} and {scalar_name(weight_dtype)}"
    return f"expected m1 and m2 to have the same dtype, but got: {cpp_name(dtype)} != {cpp_name(weight_dtype)}"


def _cell_fast_path(mode: str, input: object, hx: object, input_size: int, weight_dtype: torch.dtype,
                    sizes: tuple[int, ...]) -> tuple[Tensor, tuple[Tensor, ...], bool] | None:
    """The common valid call, checked in a few operations: a batched (B, F) input of the parameters'
    dtype and no state or states of exactly the expected shapes, dtype and device. None: anything
    else, for the full checks (which also raise the errors)."""
    if type(input) is not Tensor or input.dim() != 2 or input.size(1) != input_size or input.dtype != weight_dtype:
        return None
    batch = input.size(0)
    if hx is None:
        return input, tuple(input.new_zeros(batch, size) for size in sizes), True
    if mode == "LSTM":
        if type(hx) not in (tuple, list) or len(hx) != 2:  # type: ignore[arg-type]
            return None
        states = hx
    elif type(hx) is Tensor:
        states = (hx,)
    else:
        return None
    for state, size in zip(states, sizes):
        if type(state) is not Tensor or state.shape != (batch, size) or state.dtype != input.dtype \
                or state.device != input.device:
            return None
    return input, tuple(states), True


def _cell_lstm_states(cls: str, hx: object, batched: bool) -> tuple[Tensor, ...]:
    """(h, c) as torch.nn.LSTMCell reads them: each element's rank, then a pair for its kernel."""
    if isinstance(hx, Tensor):  # torch iterates over it, then its kernel refuses a tensor
        if hx.dim() == 0:
            raise StateTypeError("iteration over a 0-d tensor; hx: expected a tuple (h, c) of two tensors, got a 0-d "
                                 "tensor")
        if hx.size(0) and hx.dim() - 1 not in (1, 2):
            raise ValueError(f"{cls}: Expected hx[0] to be 1D or 2D, got {hx.dim() - 1}D instead; hx: expected a tuple "
                             f"(h, c) of two tensors, got {_describe(hx)}")
        if not batched:  # torch indexes an unbatched input's state: hx[0], hx[1] of a stacked (2, H)
            if hx.size(0) == 2:
                return tuple(hx.unbind(0))
            if hx.size(0) < 2:
                raise StateTypeError(f"index {hx.size(0)} is out of bounds for dimension 0 with size {hx.size(0)}; "
                                     f"hx: expected a tuple (h, c) of two tensors, got {_describe(hx)}")
            raise StateTypeError(f"lstm_cell expects two hidden states; hx: expected a tuple (h, c) of two tensors "
                                 f"(or a stacked (2, H) tensor), got {_describe(hx)}")
        raise StateTypeError(f"lstm_cell(): argument 'hx' (position 2) must be tuple of Tensors, not Tensor; hx: "
                             f"expected a tuple (h, c) of two tensors, got {_describe(hx)}")
    kind = type(hx).__name__
    if not isinstance(hx, (tuple, list)) and not hasattr(hx, "__iter__"):
        raise StateTypeError(f"'{kind}' object is not iterable; hx: expected a tuple (h, c) of two tensors, got {kind}")
    for idx, value in enumerate(hx):  # type: ignore[arg-type]  (as torch's forward: an iterator is used up here)
        rank = _rank(f"hx[{idx}]", value)
        if rank not in (1, 2):
            raise ValueError(f"{cls}: Expected hx[{idx}] to be 1D or 2D, got {rank}D instead; hx[{idx}]: expected "
                             f"{'(B, H)' if batched else '(H,)'}, got shape {tuple(value.shape)}")
    if not isinstance(hx, (tuple, list)):  # then torch indexes it (unbatched) or hands it to its kernel
        theirs = (f"lstm_cell(): argument 'hx' (position 2) must be tuple of Tensors, not {kind}" if batched else
                  f"'{kind}' object is not subscriptable")
        raise StateTypeError(f"{theirs}; hx: expected a tuple (h, c) of two tensors, got {kind}")
    if not batched and len(hx) < 2:  # torch reads hx[0] and hx[1] to unsqueeze them
        raise StateTypeError(f"tuple index out of range; hx: expected a tuple (h, c) of two tensors, got {_describe(hx)}")
    if len(hx) != 2:
        raise StateTypeError(f"lstm_cell expects two hidden states; hx: expected a tuple (h, c) of two tensors, got "
                             f"{_describe(hx)}")
    return tuple(hx)


def _cell_single_state(cls: str, hx: object) -> tuple[Tensor]:
    rank = _rank("hx", hx)
    assert isinstance(hx, Tensor)
    if rank not in (1, 2):
        raise ValueError(f"{cls}: Expected hidden to be 1D or 2D, got {rank}D instead; hx: expected (B, H) or (H,), "
                         f"got shape {tuple(hx.shape)}")
    return (hx,)


def check_mask(name: str, mask: Any, batched: bool, batch: int, width: int, like: Tensor | None = None) -> Tensor:
    """A per-sequence mask (B, width) (or (width,) unbatched) on ``like``'s device -> batched 2-D."""
    _rank(name, mask)
    want = (batch, width) if batched else (width,)
    if tuple(mask.shape) != want:
        raise ShapeError(f"{name}: expected shape {want} ({'(B, P)' if batched else '(P,)'}), got {tuple(mask.shape)}")
    if like is not None and mask.device != like.device:
        raise DeviceError(f"{name}: expected device {like.device} (that of input), got {mask.device}")
    return mask if batched else mask.unsqueeze(0)
