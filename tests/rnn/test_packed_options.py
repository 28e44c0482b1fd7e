"""PackedSequence input with every cell option: the same numbers as the padded batch with
``lengths=`` (it is that call), the output packed again as torch returns a packed output (the input's
batch_sizes, sorted_indices and unsorted_indices), h_n / c_n in the original batch order."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import fastlayers

LSTM_OPTIONS = {
    "layer_norm": dict(layer_norm=True), "peephole": dict(peephole=True), "cell_clip": dict(cell_clip=0.3),
    "zoneout": dict(zoneout=(0.2, 0.4)), "recurrent_dropout": dict(recurrent_dropout=0.3),
    "proj_clip": dict(proj_size=3, proj_clip=0.2),
    "all + proj": dict(layer_norm=True, peephole=True, cell_clip=0.5, zoneout=(0.1, 0.3), recurrent_dropout=0.2,
                       proj_size=3, proj_clip=0.3),
}
GRU_OPTIONS = {"layer_norm": dict(layer_norm=True), "zoneout": dict(zoneout=0.3),
               "recurrent_dropout": dict(recurrent_dropout=0.3),
               "all": dict(layer_norm=True, zoneout=0.2, recurrent_dropout=0.2)}
CASES = [("LSTM", k) for k in LSTM_OPTIONS] + [("GRU", k) for k in GRU_OPTIONS]
LENGTHS = [5, 2, 7, 2, 1]  # unsorted, ties, the longest in the middle


def _module(mode, name, batch_first):
    options = (LSTM_OPTIONS if mode == "LSTM" else GRU_OPTIONS)[name]
    torch.manual_seed(0)
    return getattr(fastlayers, mode)(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first, **options)


def _grads(outputs, leaves):
    torch.manual_seed(3)
    loss = sum((o * torch.randn_like(o)).sum() for o in outputs)
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("mode,name", CASES)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("enforce_sorted", [False, True])
def test_packed_equals_padded_with_lengths(mode, name, batch_first, training, enforce_sorted):
    module = _module(mode, name, batch_first).train(training)
    lengths = sorted(LENGTHS, reverse=True) if enforce_sorted else LENGTHS
    batch, steps = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(1)
    x = torch.randn((batch, steps, 3) if batch_first else (steps, batch, 3), generator=g, requires_grad=True)
    layers = 2 * 2
    out_size = (module.proj_size or 4) if mode == "LSTM" else 4
    h0 = torch.randn(layers, batch, out_size, generator=g, requires_grad=True)
    hx = (h0, torch.randn(layers, batch, 4, generator=g)) if mode == "LSTM" else h0
    packed = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=enforce_sorted)

    torch.manual_seed(2)  # the same training masks in both calls
    out_p, final_p = module(packed, hx)
    torch.manual_seed(2)
    out_l, final_l = module(x, hx, lengths=lengths)

    assert isinstance(out_p, PackedSequence)
    assert torch.equal(out_p.batch_sizes, packed.batch_sizes)
    for got, want in ((out_p.sorted_indices, packed.sorted_indices), (out_p.unsorted_indices, packed.unsorted_indices)):
        assert (got is None and want is None) or torch.equal(got, want)
    padded, got_lengths = pad_packed_sequence(out_p, batch_first=batch_first, total_length=steps)
    assert got_lengths.tolist() == lengths
    assert torch.equal(padded, out_l)
    finals_p = final_p if mode == "LSTM" else (final_p,)
    finals_l = final_l if mode == "LSTM" else (final_l,)
    for a, b in zip(finals_p, finals_l):
        assert torch.equal(a, b)
    leaves = [x, h0, *module.parameters()]
    for a, b in zip(_grads([out_p.data, *finals_p], leaves), _grads([pack_padded_sequence(
            out_l, lengths, batch_first=batch_first, enforce_sorted=enforce_sorted).data, *finals_l], leaves)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_packed_with_options_off_is_torchs_packed_path(mode):
    """With the options off the packed call stays torch's own (bitwise)."""
    torch.manual_seed(0)
    ours = getattr(fastlayers, mode)(3, 4, bidirectional=True)
    theirs = getattr(torch.nn, mode)(3, 4, bidirectional=True)
    theirs.load_state_dict(ours.state_dict())
    packed = pack_padded_sequence(torch.randn(7, 5, 3), LENGTHS, enforce_sorted=False)
    (a, fa), (b, fb) = ours(packed), theirs(packed)
    assert torch.equal(a.data, b.data) and torch.equal(a.batch_sizes, b.batch_sizes)
    for s, t in zip(fa if mode == "LSTM" else (fa,), fb if mode == "LSTM" else (fb,)):
        assert torch.equal(s, t)
