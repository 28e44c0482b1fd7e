"""Drop-in torch.nn.LSTM / GRU / RNN with a per-sequence ``lengths`` argument.

The classes subclass the torch modules, so constructor arguments, parameter names
(``weight_ih_l{k}{_reverse}``, ...), ``state_dict`` and the forward contract without lengths
(padded Tensor, unbatched 2-D, PackedSequence, ``hx``) are torch's own, running torch's kernels.
``forward(input, hx=None, *, lengths=None)`` adds the lengths path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .._checks import as_lengths, check_floating, check_rank, check_same_dtype_device, check_shape, check_tensor
from ._reference import reference_varlen_rnn
from ._varlen import varlen_rnn

_SHAPES = "(T, B, F) or (B, T, F) if batch_first, or unbatched (T, F)"


class _LengthsMixin:
    """Validation and lengths dispatch shared by LSTM, GRU and RNN (mixed into torch's classes)."""

    mode: str
    input_size: int
    hidden_size: int
    num_layers: int
    bidirectional: bool
    batch_first: bool
    bias: bool
    dropout: float
    training: bool
    _flat_weights: list[Tensor]

    def _state_sizes(self) -> tuple[int, ...]:
        proj = getattr(self, "proj_size", 0)
        if self.mode == "LSTM":
            return (proj or self.hidden_size, self.hidden_size)
        return (self.hidden_size,)

    def _check_input(self, input: object) -> Tensor:
        check_tensor("input", input)
        assert isinstance(input, Tensor)
        check_rank("input", input, (2, 3), _SHAPES)
        check_floating("input", input)
        weight = self._flat_weights[0]
        if input.dtype != weight.dtype:
            raise TypeError(f"input: expected dtype {weight.dtype} (the parameters' dtype), got {input.dtype}")
        if input.size(-1) != self.input_size:
            raise ValueError(
                f"input: expected feature size input_size = {self.input_size} in the last dimension, "
                f"got {input.size(-1)} (shape {tuple(input.shape)})"
            )
        return input

    def _check_hx(self, hx: object, input: Tensor) -> tuple[Tensor, ...] | None:
        """Return hx as a tuple of batched 3-D tensors (or None); raise on bad shape/dtype."""
        if hx is None:
            return None
        names = ("hx[0] (h_0)", "hx[1] (c_0)") if self.mode == "LSTM" else ("hx",)
        if self.mode == "LSTM":
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise TypeError(f"hx: expected a tuple (h_0, c_0) of two tensors, got {type(hx).__name__}")
            states = tuple(hx)
        else:
            states = (hx,)
        batched = input.dim() == 3
        batch = input.size(0 if self.batch_first else 1) if batched else 1
        layers = self.num_layers * (2 if self.bidirectional else 1)
        out = []
        for name, state, size in zip(names, states, self._state_sizes()):
            check_tensor(name, state)
            expected = (layers, batch, size) if batched else (layers, size)
            check_shape(name, state, expected, "(num_layers * D, B, H)" if batched else "(num_layers * D, H)")
            check_same_dtype_device(name, state, "input", input)
            out.append(state if batched else state.unsqueeze(1))
        return tuple(out)

    def forward(self, input: Any, hx: Any = None, *, lengths: Any = None) -> Any:  # noqa: D102
        if isinstance(input, PackedSequence):
            if lengths is not None:
                raise ValueError("lengths: expected None for PackedSequence input (it carries its own lengths)")
            return super().forward(input, hx)  # type: ignore[misc]
        input = self._check_input(input)
        states = self._check_hx(hx, input)
        if lengths is None:
            return super().forward(input, hx)  # type: ignore[misc]
        batched = input.dim() == 3
        x = input if batched else input.unsqueeze(1 if not self.batch_first else 0)
        time_dim = 1 if self.batch_first else 0
        steps, batch = x.size(time_dim), x.size(1 - time_dim)
        lengths = as_lengths(lengths, batch, steps)
        if states is None:
            layers = self.num_layers * (2 if self.bidirectional else 1)
            states = tuple(x.new_zeros(layers, batch, size) for size in self._state_sizes())
        if batch and bool((lengths == steps).all()):
            # no padding anywhere: the padded fused call is exactly the packed semantics
            output, final = super().forward(x, states if self.mode == "LSTM" else states[0])  # type: ignore[misc]
            final = final if self.mode == "LSTM" else (final,)
        else:
            impl = varlen_rnn if x.device.type == "cpu" else reference_varlen_rnn
            output, final = impl(
                x,
                states,
                self._flat_weights,
                lengths,
                mode=self.mode,
                has_biases=self.bias,
                num_layers=self.num_layers,
                bidirectional=self.bidirectional,
                batch_first=self.batch_first,
                dropout=self.dropout,
                training=self.training,
            )
        if not batched:
            output = output.squeeze(time_dim ^ 1)
            final = tuple(s.squeeze(1) for s in final)
        return output, (final if self.mode == "LSTM" else final[0])


_COMMON_DOC = """
    Shape legend: T time steps, B batch, F = input_size, H = hidden_size (H_out = proj_size if
    proj_size > 0 else hidden_size), L = num_layers, D = 2 if bidirectional else 1.

    Forward: ``forward(input, hx=None, *, lengths=None)``.

    * ``input``: (T, B, F) float tensor, (B, T, F) if ``batch_first``, unbatched (T, F), or a
      PackedSequence (then the output is a PackedSequence, exactly as torch).
    * ``hx``: initial state{hx_doc}; zeros if omitted.
    * ``lengths``: optional per-sequence lengths, a 1-D integer tensor on any device or a sequence
      of B Python ints, ``1 <= lengths[b] <= T``, any order, duplicates allowed (for unbatched
      input: one length). Semantics are exactly those of torch's PackedSequence path: output
      rows at ``t >= lengths[b]`` are zero; the final state of the forward direction is taken
      after each sequence's own last step, that of the reverse direction after t = 0, and the
      reverse direction starts at each sequence's own last step.

    Returns ``(output, {ret_doc})``: output (T, B, D*H_out) (or (B, T, D*H_out), or (T, D*H_out)),
    {final_doc}

    On CPU the lengths path runs torch's fused kernels once per run of time steps with the same
    set of active sequences (no Python loop over steps, no PackedSequence slicing in autograd);
    on other devices it uses torch's packed path (cuDNN's variable-length kernel on CUDA).

    Errors: TypeError for a non-tensor or integer ``input``, float ``lengths``, or ``hx`` of the
    wrong dtype; ValueError for a wrong rank, a feature size other than input_size, lengths of
    the wrong size or outside [1, T], ``hx`` of the wrong shape, or ``lengths`` with PackedSequence
    input.

    Mirrors :class:`torch.nn.{name}` (same constructor arguments, parameter names and shapes;
    ``load_state_dict(strict=True)`` works in both directions).
"""


class LSTM(_LengthsMixin, nn.LSTM):
    __doc__ = (
        "Long short-term memory (Hochreiter & Schmidhuber 1997) as :class:`torch.nn.LSTM`, plus "
        "per-sequence lengths.\n"
        + _COMMON_DOC.format(
            name="LSTM",
            hx_doc=" ``(h_0, c_0)``, (L*D, B, H_out) and (L*D, B, H) (unbatched: no B dimension)",
            ret_doc="(h_n, c_n)",
            final_doc="h_n (L*D, B, H_out) and c_n (L*D, B, H), dtype of input.",
        )
    )


class GRU(_LengthsMixin, nn.GRU):
    __doc__ = (
        "Gated recurrent unit (Cho et al. 2014, cuDNN/torch form) as :class:`torch.nn.GRU`, plus "
        "per-sequence lengths.\n"
        + _COMMON_DOC.format(
            name="GRU", hx_doc=" ``h_0`` (L*D, B, H)", ret_doc="h_n", final_doc="h_n (L*D, B, H), dtype of input."
        )
    )


class RNN(_LengthsMixin, nn.RNN):
    __doc__ = (
        "Elman RNN with tanh or ReLU nonlinearity as :class:`torch.nn.RNN`, plus per-sequence lengths.\n"
        + _COMMON_DOC.format(
            name="RNN", hx_doc=" ``h_0`` (L*D, B, H)", ret_doc="h_n", final_doc="h_n (L*D, B, H), dtype of input."
        )
    )


__all__ = ["LSTM", "GRU", "RNN"]
