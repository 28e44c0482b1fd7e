"""Variable-length batches without padding: the varlen form (sequences concatenated, with
``cu_seqlens``) and jagged NestedTensors, shared by the recurrent layers and attention pooling.

Legend: B batch, N = total = sum of the lengths, T = the longest length, F features.

The varlen form is flash-attention's and ``torch.nn.attention.varlen_attn``'s: ``values`` (N, *)
holding the sequences one after another, ``cu_seqlens`` (B+1,) int32 / int64 with
``cu_seqlens[0] = 0``, ``cu_seqlens[b+1] - cu_seqlens[b]`` the length of sequence b (>= 1) and
``cu_seqlens[B] = N``. A jagged NestedTensor (``torch.nested``, ``layout=torch.jagged``) is that
pair as one object: ``values()`` and ``offsets()``.

Where a layer has no path of its own for the varlen form (the recurrent layers off the C engine,
attention pooling) it runs the padded path with lengths: :func:`varlen` maps every value row to
its row of the padded (T, B) (or (B, T)) layout, :func:`pad` and :func:`unpad` are one
``index_copy`` and one ``index_select`` (differentiable, twice too), so results and gradients equal
the padded call's exactly, at the padded call's memory. (The C engine reads the rows directly:
``fastlayers.rnn._lengths.make_plan(varlen=True)``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import DeviceError, LengthsError, ShapeError, is_int


@dataclass(frozen=True)
class Varlen:
    """A validated varlen batch: ``lengths`` (B,) CPU int64, ``steps`` T (the longest length), and
    ``rows`` (N,) int64 on the values' device, the padded row (time-major: ``t * B + b``; batch-first:
    ``b * T + t``) of every value row."""

    lengths: Tensor
    steps: int
    rows: Tensor

    @property
    def batch(self) -> int:
        return self.lengths.numel()


def check_form(cu_seqlens: object, device: torch.device, *, name: str = "cu_seqlens") -> Tensor:
    """The checks of ``cu_seqlens`` that read no value (type, dtype, shape, device): all that a traced
    call (torch.compile, torch.export) checks before its operators read the values at run time.
    Returns ``cu_seqlens`` (a tensor, once checked).

    Raises:
        TypeError: not a tensor, or not int32 / int64.
        ValueError (and RuntimeError: ShapeError, DeviceError): not 1-D with at least 2 entries, or on
            another device than the values (or the CPU).
    """
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"{name}: expected a 1-D int32 or int64 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype torch.int32 or torch.int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ShapeError(f"{name}: expected a 1-D tensor of shape (B+1,) with B >= 1, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device and cu_seqlens.device.type != "cpu":
        raise DeviceError(f"{name}: expected a tensor on {device} (the values' device) or on the CPU, got "
                          f"{cu_seqlens.device}")
    return cu_seqlens


def assert_values(cu_seqlens: Tensor, total, *, name: str = "cu_seqlens") -> None:
    """In a traced call (torch.compile, torch.export), where the values are not known: assertions
    the compiled or exported program runs on them (starting at 0, every sequence of length >= 1,
    ending at ``total``, the number of value rows), as :func:`check_cu_seqlens` checks eagerly."""
    cu = cu_seqlens.to(torch.int64)
    torch._assert_async(cu[0] == 0, f"{name}: expected cu_seqlens[0] = 0")
    torch._assert_async((cu[1:] > cu[:-1]).all(), f"{name}: every sequence must have length >= 1 (increasing offsets)")
    torch._assert_async(cu[-1] == total, f"{name}: expected cu_seqlens[-1] = N (the number of value rows)")


def check_max_seqlen(max_seqlen: object, cu_seqlens: Tensor | None = None) -> None:
    """TypeError unless ``max_seqlen`` is an int (not a bool); with ``cu_seqlens`` (a traced call),
    also an assertion the program runs: every length at most ``max_seqlen`` (as
    :func:`check_cu_seqlens` checks eagerly)."""
    if not is_int(max_seqlen):  # (NumPy's integers too, as the lengths take them)
        raise TypeError(f"max_seqlen: expected an int or None, got {type(max_seqlen).__name__}")
    if cu_seqlens is not None:
        cu = cu_seqlens.to(torch.int64)
        torch._assert_async((cu[1:] - cu[:-1] <= max_seqlen).all(),
                            "max_seqlen: expected at least the longest sequence")


def check_cu_seqlens(cu_seqlens: object, total: int, device: torch.device, *, name: str = "cu_seqlens",
                     max_seqlen: object = None) -> tuple[Tensor, int]:
    """Validate ``cu_seqlens`` against ``total`` value rows on ``device`` and return the lengths
    (B,) as a CPU int64 tensor and the longest length.

    Raises:
        TypeError: not a tensor, or not int32 / int64; ``max_seqlen`` not an int.
        ValueError (and RuntimeError, as for ``lengths``: ShapeError, DeviceError, LengthsError):
            not 1-D with at least 2 entries, on another device than the values (or the CPU), not
            starting at 0, decreasing, a zero-length sequence, not ending at ``total``;
            ``max_seqlen`` smaller than the longest sequence.
    """
    cu = check_form(cu_seqlens, device, name=name).to(device="cpu", dtype=torch.int64)
    if int(cu[0]) != 0:
        raise LengthsError(f"{name}: expected cu_seqlens[0] = 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        b = int(torch.nonzero(lengths < 0)[0])
        raise LengthsError(f"{name}: expected non-decreasing offsets, got cu_seqlens[{b + 1}] = {int(cu[b + 1])} < "
                           f"cu_seqlens[{b}] = {int(cu[b])}")
    if bool((lengths == 0).any()):
        b = int(torch.nonzero(lengths == 0)[0])
        raise LengthsError(f"{name}: every sequence must have length >= 1, got length 0 for sequence {b} "
                           f"(cu_seqlens[{b}] = cu_seqlens[{b + 1}] = {int(cu[b])})")
    if int(cu[-1]) != total:
        raise LengthsError(f"{name}: expected cu_seqlens[-1] = {total} (the number of value rows), got {int(cu[-1])}")
    longest = int(lengths.max())
    if max_seqlen is not None:
        check_max_seqlen(max_seqlen)
        if max_seqlen < longest:
            raise LengthsError(f"max_seqlen: expected at least the longest sequence ({longest}), got {max_seqlen}")
    return lengths, longest


def varlen(cu_seqlens: object, total: int, device: torch.device, *, batch_first: bool,
           name: str = "cu_seqlens", max_seqlen: object = None) -> Varlen:
    """Validate ``cu_seqlens`` (:func:`check_cu_seqlens`) and map each value row to its padded row."""
    lengths, steps = check_cu_seqlens(cu_seqlens, total, device, name=name, max_seqlen=max_seqlen)
    batch = lengths.numel()
    seq = torch.repeat_interleave(torch.arange(batch), lengths)  # (N,) sequence of each value row
    starts = torch.cumsum(lengths, 0) - lengths
    time = torch.arange(total) - starts[seq]
    rows = seq * steps + time if batch_first else time * batch + seq
    return Varlen(lengths=lengths, steps=steps, rows=rows.to(device))


def pad(values: Tensor, plan: Varlen, *, batch_first: bool) -> Tensor:
    """``values`` (N, *rest) -> padded (T, B, *rest) (or (B, T, *rest)), zeros past each length."""
    shape = (plan.batch, plan.steps) if batch_first else (plan.steps, plan.batch)
    flat = values.new_zeros(plan.steps * plan.batch, *values.shape[1:])
    return flat.index_copy(0, plan.rows, values).view(*shape, *values.shape[1:])


def unpad(padded: Tensor, plan: Varlen) -> Tensor:
    """Padded (T, B, *rest) (or (B, T, *rest), as :func:`pad` made it) -> (N, *rest)."""
    return padded.reshape(plan.steps * plan.batch, *padded.shape[2:]).index_select(0, plan.rows)


def unwrap(name: str, value: Tensor, features_dims: int = 1) -> tuple[Tensor, Tensor]:
    """A jagged NestedTensor (B, j, *features) -> (values (N, *features), offsets (B+1,)).

    Raises:
        ValueError: another layout (strided nested tensors: convert with ``layout=torch.jagged``),
            a ragged dimension other than 1, ragged features, or holes (a non-contiguous one:
            ``.contiguous()`` makes it one).
    """
    if value.layout != torch.jagged:
        raise ValueError(f"{name}: expected a jagged NestedTensor (layout=torch.jagged), got layout {value.layout}; "
                         "torch.nested.nested_tensor(..., layout=torch.jagged) makes one")
    if value.dim() != 2 + features_dims:
        raise ValueError(f"{name}: expected a (B, j{', F' * features_dims}) jagged NestedTensor, got {value.dim()} "
                         "dimensions")
    if value._ragged_idx != 1:  # type: ignore[attr-defined]
        raise ValueError(f"{name}: expected the ragged dimension at 1 (B, j, F), got it at {value._ragged_idx}")
    for d in range(2, value.dim()):
        if not isinstance(value.size(d), int):
            raise ValueError(f"{name}: expected regular feature dimensions, got a ragged dimension {d}")
    if value.lengths() is not None:  # (values() then holds rows between the sequences that are not theirs)
        raise ValueError(f"{name}: expected a contiguous jagged NestedTensor, got one with holes (lengths() set: "
                         f"from torch.nested.narrow or nested_tensor_from_jagged(..., lengths=)); {name}.contiguous() "
                         "makes one")
    return value.values(), value.offsets()


def rewrap(values: Tensor, offsets: Tensor) -> Tensor:
    """(N, *) values with the offsets of the input -> a jagged NestedTensor (B, j, *)."""
    return torch.nested.nested_tensor_from_jagged(values, offsets)
