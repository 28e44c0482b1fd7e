"""Per-sequence lengths through torch's fused recurrent kernels, without PackedSequence.

Legend: T time (padded), B batch, F input features, H state features, L layers,
D directions (2 if bidirectional else 1), N = sum(lengths).

Each layer and direction runs as a few calls of the fused single-layer kernel (``_VF.lstm``,
``_VF.gru``, ``_VF.rnn_tanh``/``_VF.rnn_relu``: oneDNN or ATen's native loop on CPU, cuDNN on
CUDA), one per *segment* of time during which the set of running sequences does not change
(see :mod:`fastlayers.rnn._lengths`). State is carried between segments and narrowed to the
still-running prefix of the length-sorted batch; each sequence's final state is taken when it
stops. The valid rows are gathered with one ``index_select`` and the output written back with one
``index_copy`` into a zero tensor, so the backward pass does one scatter and one gather per layer
and direction instead of PackedSequence's per-step slice backward with its zero fills.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, _VF

from ._lengths import LengthPlan, make_plan

KERNELS = {
    "LSTM": _VF.lstm,
    "GRU": _VF.gru,
    "RNN_TANH": _VF.rnn_tanh,
    "RNN_RELU": _VF.rnn_relu,
}


def _run_segments(
    packed: Tensor,
    plan: LengthPlan,
    state: tuple[Tensor, ...],
    params: Sequence[Tensor],
    mode: str,
    has_biases: bool,
    training: bool,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """One layer, one direction over packed rows (N, F); state tensors are (1, B, *) sorted.

    Returns the packed output (N, H_out) and the final states (1, B, *) in sorted order.
    """
    kernel = KERNELS[mode]
    chunks = packed.split([steps * active for steps, active in plan.segments])
    following = [active for _, active in plan.segments[1:]] + [0]
    outputs: list[Tensor] = []
    finished: list[tuple[Tensor, ...]] = []
    for (steps, active), chunk, nxt in zip(plan.segments, chunks, following):
        state = tuple(s[:, :active] for s in state)
        result = kernel(
            chunk.view(steps, active, chunk.size(-1)),
            state if mode == "LSTM" else state[0],
            params,
            has_biases,
            1,
            0.0,
            training,
            False,
            False,
        )
        outputs.append(result[0].reshape(steps * active, -1))
        state = tuple(result[1:])
        if nxt < active:  # sequences nxt..active-1 (sorted order) end with this segment
            finished.append(tuple(s[:, nxt:active] for s in state))
    finals = tuple(torch.cat([f[i] for f in reversed(finished)], dim=1) for i in range(len(state)))
    return torch.cat(outputs), finals


def varlen_rnn(
    input: Tensor,
    hx: tuple[Tensor, ...],
    weights: Sequence[Tensor],
    lengths: Tensor,
    *,
    mode: str,
    has_biases: bool,
    num_layers: int,
    bidirectional: bool,
    batch_first: bool,
    dropout: float,
    training: bool,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Multi-layer (bidirectional) RNN/LSTM/GRU over a padded batch with per-sequence lengths.

    Args:
        input: (T, B, F), or (B, T, F) if ``batch_first``; floating point.
        hx: initial states in batch order, ``(h_0,)`` or ``(h_0, c_0)`` for LSTM, each
            (L*D, B, H_out) / (L*D, B, H) as in torch.nn.LSTM.
        weights: the flat parameter list in torch.nn.RNNBase order (``module._flat_weights``).
        lengths: (B,) CPU int64, validated: 1 <= len_b <= T.
        mode: "LSTM", "GRU", "RNN_TANH" or "RNN_RELU" (torch.nn.RNNBase.mode).

    Returns:
        output (T, B, D*H_out) (or batch-first) with zeros at t >= len_b, and the final states
        (L*D, B, *) as torch's packed path gives them: the forward direction after each
        sequence's own last step, the reverse direction after t = 0.
    """
    time_dim = 1 if batch_first else 0
    steps, batch = input.size(time_dim), input.size(1 - time_dim)
    plan = make_plan(lengths, steps, batch_first, input.device)
    directions = 2 if bidirectional else 1
    group = len(weights) // (num_layers * directions)
    state = tuple(s.index_select(1, plan.sorted_indices) for s in hx)
    layer_input = input.reshape(steps * batch, input.size(-1))
    finals: list[tuple[Tensor, ...]] = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            k = layer * directions + direction
            rows = plan.reverse_rows if direction else plan.forward_rows
            packed_out, final = _run_segments(
                layer_input.index_select(0, rows),
                plan,
                tuple(s[k : k + 1] for s in state),
                weights[k * group : (k + 1) * group],
                mode,
                has_biases,
                training,
            )
            out = packed_out.new_zeros(plan.num_rows, packed_out.size(1))
            outputs.append(out.index_copy(0, rows, packed_out))
            finals.append(final)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, dim=1)
        if dropout > 0 and training and layer < num_layers - 1:
            if batch_first:  # the mask drawn time-major, as the engines draw it (checkpoint_every's too)
                mask = F.dropout(layer_input.new_ones(steps, batch, layer_input.size(1)), dropout, True)
                layer_input = layer_input * mask.transpose(0, 1).reshape(layer_input.shape)
            else:
                layer_input = F.dropout(layer_input, dropout, True)
    output = layer_input.view(input.shape[:2] + (layer_input.size(1),))
    h_n = tuple(
        torch.cat([f[i] for f in finals], dim=0).index_select(1, plan.unsorted_indices) for i in range(len(hx))
    )
    return output, h_n
