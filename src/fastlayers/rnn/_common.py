"""Helpers every recurrent engine uses (the C engine, the GPU engine, the reference twin's callers):
the input bias, the masks drawn in training (drawn by :mod:`._masks`), dtype bookkeeping."""

from __future__ import annotations

import torch
from torch import Tensor

from ._masks import keep_mask
from ._options import CellOptions


def as_dtype(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t`` contiguous in ``dtype`` (None stays None)."""
    if t is None or (t.dtype == dtype and t.is_contiguous()):
        return t
    return t.to(dtype).contiguous()


def stack_directions(tensors: list[Tensor]) -> Tensor:
    """The directions' parameters stacked (D, ...). No copy where there is one tensor (a view) or
    where the D tensors are the rows 0..D-1 of one tensor (a caller that runs the layer many times
    stacks its parameters once, as :mod:`._remat`'s backward: that tensor then, so its gradient
    is the stacked one)."""
    if len(tensors) == 1:
        return tensors[0].unsqueeze(0)
    base = tensors[0]._base
    if (base is not None and base.dim() >= 1 and base.size(0) == len(tensors)
            and all(t._base is base and t.shape == base.shape[1:] and t.stride() == base.stride()[1:]
                    and t.storage_offset() == base.storage_offset() + d * base.stride(0)
                    for d, t in enumerate(tensors))):
        return base
    return torch.stack(tensors)


def in_dtypes(grads, dtypes) -> tuple[Tensor | None, ...]:
    """Each gradient in the dtype of its input (they are computed in float32 for bf16 / fp16 inputs)."""
    return tuple(g if g is None or d is None else g.to(d) for g, d in zip(grads, dtypes))


def draw_mask(key: str, options: CellOptions, shape, like: Tensor) -> Tensor:
    """One training mask of ``shape`` in ``like``'s dtype and device (:func:`keep_mask`): ``"recurrent"``
    the recurrent-dropout mask, kept with 1 - recurrent_dropout and scaled by its inverse; ``"zoneout_h"``
    / ``"zoneout_c"`` the zoneout keep-mask of h / c (ones with probability z_h / z_c)."""
    if key == "recurrent":
        keep = 1 - options.recurrent_dropout
        return keep_mask(shape, keep, like.dtype, like.device) / keep
    z_h, z_c = options.zoneout
    return keep_mask(shape, z_h if key == "zoneout_h" else z_c, like.dtype, like.device)


def input_bias(cell: str, dir_params: list[dict[str, Tensor]], stack) -> tuple[bool, Tensor | None]:
    """(whether the layer has biases, the bias added with the input projection, (D, G) | None):
    LSTM: b_ih + b_hh; GRU: b_ih (b_hh stays inside r * (W_hh h + b_hh))."""
    has_bias = "bias_ih" in dir_params[0]
    if not has_bias:
        return False, None
    if cell == "GRU":
        return True, stack("bias_ih")
    # LSTM: summed per direction, then stacked. Stacked first, b_ih and b_hh would each get a view
    # of the one gradient of the sum, and AccumulateGrad keeps such a view as .grad without a copy
    # (pytorch issue 34082): both .grad would be the same memory, so a second backward (gradient
    # accumulation) or an in-place clip would change each twice. Summed first, autograd passes the
    # sum's gradient to both as one tensor, which it copies for one of them.
    return True, stack_directions([p["bias_ih"] + p["bias_hh"] for p in dir_params])


def draws(options: CellOptions, training: bool) -> bool:
    """Whether a layer call draws masks: in training, with recurrent dropout or zoneout."""
    return training and (options.recurrent_dropout > 0 or any(z > 0 for z in options.zoneout))


def drawn_masks(cell: str, options: CellOptions, training: bool, given: dict[str, Tensor], recurrent_shape: tuple,
                zoneout_rows: tuple, hidden: int, out_size: int, like: Tensor) -> dict[str, Tensor]:
    """The masks of one layer that ``given`` lacks, drawn in training in the engines' order: the
    recurrent-dropout mask ``recurrent_shape`` (scaled by 1 / keep), then zoneout of c (LSTM) and of
    h, each (*zoneout_rows, width), in ``like``'s dtype and device. Every engine draws through this,
    each with its own shapes (the C engine: the packed rows; the Triton engine: the padded (D, T, B)),
    and :mod:`._remat` draws what the engine it runs would (the same calls, shapes and order)."""
    out: dict[str, Tensor] = {}
    if "recurrent" not in given and training and options.recurrent_dropout > 0:
        out["recurrent"] = draw_mask("recurrent", options, recurrent_shape, like)
    z_h, z_c = options.zoneout
    for key, prob, width in (("zoneout_c", z_c if cell == "LSTM" else 0.0, hidden), ("zoneout_h", z_h, out_size)):
        if key not in given and training and prob > 0:
            out[key] = draw_mask(key, options, (*zoneout_rows, width), like)
    return out
