"""fastlayers.LSTM/GRU/RNN are drop-ins for the torch modules: weights, padded, unbatched, packed, hx, dropout."""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import fastlayers

from rnn_helpers import MODES, assert_close_all, make_hx, make_pair, run_and_grad


@pytest.mark.parametrize("mode", list(MODES))
def test_state_dict_round_trip_both_directions(mode):
    ours, ref = make_pair(mode, 5, 6, num_layers=2, bidirectional=True)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert p.shape == q.shape, n
    fresh_torch = type(ref)(5, 6, num_layers=2, bidirectional=True, **MODES[mode][2])
    fresh_torch.load_state_dict(ours.state_dict(), strict=True)
    for (n, p), (_, q) in zip(fresh_torch.named_parameters(), ours.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("with_hx", [False, True])
def test_padded_without_lengths_matches_torch(mode, batch_first, with_hx):
    torch.manual_seed(0)
    ours, ref = make_pair(mode, 4, 5, num_layers=2, bidirectional=True, batch_first=batch_first)
    x = torch.randn((3, 6, 4) if batch_first else (6, 3, 4))
    hx = make_hx(ref, 3) if with_hx else None
    got = run_and_grad(lambda x, h: ours(x, h), ours, x, hx)
    want = run_and_grad(lambda x, h: ref(x, h), ref, x, hx)
    assert_close_all(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("mode", list(MODES))
def test_unbatched_without_lengths_matches_torch(mode):
    torch.manual_seed(0)
    ours, ref = make_pair(mode, 4, 5, bidirectional=True)
    x = torch.randn(6, 4)
    hx = make_hx(ref, 1)
    hx = tuple(s[:, 0] for s in hx) if isinstance(hx, tuple) else hx[:, 0]
    a, b = ours(x, hx), ref(x, hx)
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    for s, t in zip(a[1] if isinstance(a[1], tuple) else (a[1],), b[1] if isinstance(b[1], tuple) else (b[1],)):
        torch.testing.assert_close(s, t, atol=0, rtol=0)


@pytest.mark.parametrize("mode", list(MODES))
def test_packed_sequence_round_trip(mode):
    torch.manual_seed(0)
    ours, ref = make_pair(mode, 4, 5, num_layers=2, bidirectional=True)
    x = torch.randn(6, 3, 4)
    packed = pack_padded_sequence(x, torch.tensor([6, 2, 4]), enforce_sorted=False)
    hx = make_hx(ref, 3)
    out_a, h_a = ours(packed, hx)
    out_b, h_b = ref(packed, hx)
    assert isinstance(out_a, nn.utils.rnn.PackedSequence)
    torch.testing.assert_close(out_a.data, out_b.data, atol=0, rtol=0)
    assert torch.equal(out_a.batch_sizes, out_b.batch_sizes)
    assert torch.equal(out_a.unsorted_indices, out_b.unsorted_indices)
    for s, t in zip(h_a if isinstance(h_a, tuple) else (h_a,), h_b if isinstance(h_b, tuple) else (h_b,)):
        torch.testing.assert_close(s, t, atol=0, rtol=0)


@pytest.mark.parametrize("mode", ["LSTM", "GRU", "RNN_TANH"])
def test_dropout_train_stochastic_eval_deterministic(mode):
    torch.manual_seed(0)
    ours, ref = make_pair(mode, 4, 6, num_layers=3, bidirectional=True, dropout=0.5)
    x = torch.randn(7, 4, 4)
    lengths = [7, 3, 5, 1]
    ours.train()
    a, b = ours(x, lengths=lengths)[0], ours(x, lengths=lengths)[0]
    assert not torch.allclose(a, b), "train mode with dropout=0.5 should be stochastic"
    for out in (a, b):
        for i, n in enumerate(lengths):
            if n < 7:
                assert out[n:, i].abs().max() == 0
    ours.eval()
    ref.eval()
    c, d = ours(x, lengths=lengths)[0], ours(x, lengths=lengths)[0]
    assert torch.equal(c, d)
    packed = pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)
    want, _ = nn.utils.rnn.pad_packed_sequence(ref(packed)[0], total_length=7)
    torch.testing.assert_close(c, want, atol=1e-6, rtol=1e-5)


def test_dropout_gradients_flow_in_train_mode():
    torch.manual_seed(0)
    m = fastlayers.LSTM(4, 5, num_layers=2, dropout=0.3, bidirectional=True).train()
    x = torch.randn(6, 3, 4, requires_grad=True)
    out, (h, c) = m(x, lengths=[6, 4, 2])
    (out.sum() + h.sum() + c.sum()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_module_shapes_and_repr_follow_torch():
    m = fastlayers.LSTM(10, 20, num_layers=2, bidirectional=True, proj_size=5, batch_first=True)
    out, (h, c) = m(torch.randn(3, 7, 10), lengths=[7, 2, 5])
    assert out.shape == (3, 7, 10)
    assert h.shape == (4, 3, 5) and c.shape == (4, 3, 20)
    assert repr(m).startswith("LSTM(10, 20")
