"""The training masks' generator (rnn/_masks.py, _native/masks.c): the C kernel equals its torch-ops
twin bit for bit, keeps with the asked probability, independently, repeatably from a seed."""

from __future__ import annotations

import math

import pytest
import torch

from fastlayers.rnn import _masks


def _twin(shape, p, dtype, seed):
    torch.manual_seed(seed)
    drawn = torch.randint(0, (1 << 63) - 1, (), dtype=torch.int64)
    return _masks.counter_mask(shape, p, drawn, dtype, "cpu")


@pytest.mark.parametrize("shape,p,dtype", [((2, 1600, 128), 0.1, torch.float32), ((3, 5, 7), 0.5, torch.float64),
                                           ((40000,), 0.25, torch.bfloat16), ((7,), 1.0, torch.float32),
                                           ((7,), 0.0, torch.float64), ((0, 4), 0.3, torch.float32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_masks_equal_the_torch_twin(shape, p, dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(11)
        got = _masks.keep_mask(shape, p, dtype, "cpu")
    finally:
        torch.set_num_threads(before)
    want = _twin(shape, p, dtype, 11)
    assert got.shape == shape and got.dtype == dtype and torch.equal(got, want)
    assert ((got == 0) | (got == 1)).all()
    if p in (0.0, 1.0):
        assert (got == p).all()


def test_masks_without_the_native_library_are_the_same(monkeypatch):
    torch.manual_seed(5)
    native = _masks.keep_mask((4, 300, 64), 0.2, torch.float32, "cpu")
    monkeypatch.setattr(_masks, "_lib", lambda: None)
    torch.manual_seed(5)
    assert torch.equal(_masks.keep_mask((4, 300, 64), 0.2, torch.float32, "cpu"), native)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_masks_keep_with_probability_p_independently(p):
    torch.manual_seed(0)
    m = _masks.keep_mask((1 << 20,), p, torch.float64, "cpu")
    n = m.numel()
    assert abs(m.mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    both = (m[:-1] * m[1:]).mean().item()  # neighbours: kept together with probability p^2
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n)
    strided = (m[:-64] * m[64:]).mean().item()
    assert abs(strided - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / n)
    assert abs(_masks.threshold(p) / 2 ** 32 - p) <= 2 ** -33


def test_masks_are_repeatable_from_a_seed_and_differ_between_draws():
    torch.manual_seed(1)
    a, b = _masks.keep_mask((5000,), 0.5, torch.float32, "cpu"), _masks.keep_mask((5000,), 0.5, torch.float32, "cpu")
    torch.manual_seed(1)
    assert torch.equal(_masks.keep_mask((5000,), 0.5, torch.float32, "cpu"), a)
    assert not torch.equal(a, b)
    # one draw of torch's generator per mask, whatever its size
    torch.manual_seed(1)
    _masks.keep_mask((100000,), 0.5, torch.float32, "cpu")
    after_mask = torch.rand(3)
    torch.manual_seed(1)
    torch.randint(0, (1 << 63) - 1, (), dtype=torch.int64)
    assert torch.equal(torch.rand(3), after_mask)


def test_mask_operator_for_torch_compile():
    """fastlayers::counter_mask (what a torch.compile graph calls): the eager masks, a fake that
    matches (opcheck)."""
    seed = torch.tensor(123456789, dtype=torch.int64)
    got = _masks._counter_mask_op(seed, [3, 40], 0.4, torch.float32)
    assert torch.equal(got, _masks.counter_mask((3, 40), 0.4, seed, torch.float32, "cpu"))
    torch.library.opcheck(_masks._counter_mask_op, (seed, [3, 40], 0.4, torch.float64))
