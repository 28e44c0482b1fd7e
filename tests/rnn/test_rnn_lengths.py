"""fastlayers LSTM/GRU/RNN with lengths == torch's PackedSequence path (outputs, states, all grads)."""

import itertools

import pytest
import torch
from hypothesis import given, strategies as st

import fastlayers
from fastlayers.rnn import reference_varlen_rnn, varlen_rnn

from rnn_helpers import MODES, assert_close_all, compare_with_torch, make_pair, run_and_grad, torch_packed

LENGTH_CASES = {
    "all-equal": [6, 6, 6],
    "some-one": [1, 6, 1, 3],
    "unsorted": [2, 5, 3, 6, 4],
    "duplicates": [4, 2, 4, 2, 6, 6],
}

GRID = list(itertools.product(MODES, (1, 2, 3), (False, True), (False, True), (False, True), LENGTH_CASES))


@pytest.mark.parametrize("mode,num_layers,bidirectional,batch_first,with_hx,case", GRID)
def test_matches_torch_packed(mode, num_layers, bidirectional, batch_first, with_hx, case):
    compare_with_torch(mode, LENGTH_CASES[case], num_layers=num_layers, bidirectional=bidirectional,
                       batch_first=batch_first, with_hx=with_hx)


@pytest.mark.parametrize("mode", list(MODES))
def test_padding_beyond_longest_is_zero(mode):
    # T = 9 while the longest sequence has 5 steps: rows 5..8 must be zero, like pad_packed_sequence
    out, _, _ = compare_with_torch(mode, [5, 2, 3], bidirectional=True, steps=9)
    assert out[5:].abs().max() == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_padded_rows_are_exactly_zero(mode):
    lengths = [3, 7, 1, 5]
    out, _, _ = compare_with_torch(mode, lengths, num_layers=2, bidirectional=True, batch_first=True)
    for b, n in enumerate(lengths):
        if n < 7:
            assert out[b, n:].abs().max() == 0


def test_lengths_accepts_list_int32_and_matches_tensor():
    torch.manual_seed(0)
    m = fastlayers.LSTM(3, 4, bidirectional=True).eval()
    x = torch.randn(5, 3, 3)
    a = m(x, lengths=[5, 2, 3])
    b = m(x, lengths=torch.tensor([5, 2, 3], dtype=torch.int32))
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1][0], b[1][0], rtol=0, atol=0)


@pytest.mark.parametrize("form", [
    range(5, 2, -1), list(torch.tensor([5, 4, 3])), tuple(torch.tensor([5, 4, 3], dtype=torch.int32)),
    [torch.tensor([5]), torch.tensor([4]), torch.tensor([3])]], ids=["range", "0-d tensors", "int32 0-d", "1-element"])
def test_lengths_in_the_forms_pack_padded_sequence_takes(form):
    """A range and sequences of one-element integer tensors (``list(lengths)``), which torch's
    pack_padded_sequence takes, give what the tensor gives (they were a TypeError)."""
    m = fastlayers.GRU(3, 4).eval()
    x = torch.randn(5, 3, 3)
    torch.testing.assert_close(m(x, lengths=form)[0], m(x, lengths=torch.tensor([5, 4, 3]))[0], rtol=0, atol=0)


@pytest.mark.parametrize("batch_first", [False, True])
def test_unbatched_input_with_lengths(batch_first):
    torch.manual_seed(0)
    ours, ref = make_pair("LSTM", 3, 4, bidirectional=True, batch_first=batch_first)
    x = torch.randn(6, 3)
    out, (h, c) = ours(x, lengths=[4])
    out_b, (h_b, c_b) = ours(x.unsqueeze(0 if batch_first else 1), lengths=[4])
    assert out.shape == (6, 8) and h.shape == (2, 4) and c.shape == (2, 4)
    torch.testing.assert_close(out, out_b.squeeze(0 if batch_first else 1))
    torch.testing.assert_close(h, h_b.squeeze(1))
    ref_out, (ref_h, _) = ref(x[:4])
    torch.testing.assert_close(out[:4], ref_out, atol=1e-6, rtol=1e-5)
    assert out[4:].abs().max() == 0
    torch.testing.assert_close(h, ref_h, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", list(MODES))
def test_functional_twins_agree(mode):
    torch.manual_seed(1)
    ours, _ = make_pair(mode, 4, 5, num_layers=2, bidirectional=True)
    x = torch.randn(7, 5, 4)
    lengths = torch.tensor([7, 3, 3, 1, 6])
    hx = tuple(torch.randn(4, 5, s) for s in ours._state_sizes())
    kw = dict(mode=ours.mode, has_biases=True, num_layers=2, bidirectional=True, batch_first=False,
              dropout=0.0, training=False)
    a = varlen_rnn(x, hx, ours._flat_weights, lengths, **kw)
    b = reference_varlen_rnn(x, hx, ours._flat_weights, lengths, **kw)
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-5)
    for s, t in zip(a[1], b[1]):
        torch.testing.assert_close(s, t, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("mode", list(MODES))
def test_no_bias(mode, backend):
    torch.manual_seed(0)
    ours, ref = make_pair(mode, 3, 4, bias=False, num_layers=2, bidirectional=True)
    assert not any("bias" in n for n, _ in ours.named_parameters())
    x = torch.randn(5, 3, 3)
    lengths = [5, 2, 4]
    with fastlayers.backend(backend):
        got = run_and_grad(lambda x, h: ours(x, h, lengths=lengths), ours, x, None)
    want = run_and_grad(lambda x, h: torch_packed(ref, x, h, lengths), ref, x, None)
    assert_close_all(got, want)


@given(
    mode=st.sampled_from(list(MODES)),
    num_layers=st.integers(1, 3),
    bidirectional=st.booleans(),
    batch_first=st.booleans(),
    with_hx=st.booleans(),
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=7),
    extra_steps=st.integers(0, 2),
    input_size=st.integers(1, 6),
    hidden_size=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_random_configs(mode, num_layers, bidirectional, batch_first, with_hx, lengths, extra_steps,
                                   input_size, hidden_size, seed):
    if mode == "LSTM-proj" and hidden_size <= 3:
        hidden_size = 4  # proj_size (3) must be smaller than hidden_size
    compare_with_torch(mode, lengths, num_layers=num_layers, bidirectional=bidirectional, batch_first=batch_first,
                       with_hx=with_hx, input_size=input_size, hidden_size=hidden_size,
                       steps=max(lengths) + extra_steps, seed=seed)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("mode, options", [("LSTM", dict(layer_norm=True, peephole=True)), ("LSTM", dict(proj_size=2,
                                           layer_norm=True)), ("GRU", dict(layer_norm=True))])
def test_no_bias_with_options_equals_the_reference(mode, options, backend):
    """bias=False with cell options (no torch counterpart): the engines against the reference backend."""
    torch.manual_seed(0)
    layer = getattr(fastlayers, mode)(3, 4, bias=False, num_layers=2, bidirectional=True, dtype=torch.float64,
                                      **options)
    assert not any("bias" in n and "ln_" not in n for n, _ in layer.named_parameters())
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    results = []
    for name in (backend, "reference"):
        with fastlayers.backend(name):
            results.append(run_and_grad(lambda x, h: layer(x, h, lengths=[5, 2, 4]), layer, x, None))
    assert_close_all(*results, atol=1e-12, rtol=1e-10)
