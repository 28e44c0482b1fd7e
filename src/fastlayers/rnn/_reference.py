"""Reference twin of :func:`fastlayers.rnn._varlen.varlen_rnn` through torch's PackedSequence path.

Same signature and semantics; used as the test oracle on CPU and as the implementation on CUDA,
where torch's packed path is cuDNN's own variable-length kernel.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ._varlen import KERNELS


def reference_varlen_rnn(
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
    """See :func:`fastlayers.rnn._varlen.varlen_rnn`; computed with pack/pad_packed_sequence."""
    steps = input.size(1 if batch_first else 0)
    packed = pack_padded_sequence(input, lengths, batch_first=batch_first, enforce_sorted=False)
    state = tuple(s.index_select(1, packed.sorted_indices) for s in hx)
    result = KERNELS[mode](
        packed.data,
        packed.batch_sizes,
        state if mode == "LSTM" else state[0],
        list(weights),
        has_biases,
        num_layers,
        dropout,
        training,
        bidirectional,
    )
    output, _ = pad_packed_sequence(
        packed._replace(data=result[0]), batch_first=batch_first, total_length=steps
    )
    return output, tuple(s.index_select(1, packed.unsorted_indices) for s in result[1:])
