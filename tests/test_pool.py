"""The engine's buffer pool: buffers are reused between calls and never handed out while a graph
that may still run its backward holds them."""

from __future__ import annotations

import gc

import pytest
import torch

import fastlayers
from fastlayers._core import pool as _pool


@pytest.fixture(autouse=True)
def _empty_pool():
    fastlayers.empty_cache()
    yield
    fastlayers.empty_cache()


def _grads(module, x, lengths, retain=False):
    out, (h, c) = module(x, lengths=lengths)
    loss = (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin()).sum() + h.sum() + c.sum()
    return torch.autograd.grad(loss, [x, *module.parameters()], retain_graph=retain), loss


def _make():
    torch.manual_seed(0)
    m = fastlayers.LSTM(4, 6, num_layers=2, bidirectional=True, layer_norm=True, peephole=True)
    x = torch.randn(7, 3, 4, requires_grad=True)
    return m, x, [7, 2, 5]


def test_backward_gives_buffers_back_and_the_next_call_reuses_them():
    m, x, lengths = _make()
    _grads(m, x, lengths)
    assert len(_pool._free) >= 2  # two layers' forward buffers, and the backward's work space
    pooled = {s.data_ptr() for s in _pool._free}
    out, _ = m(x, lengths=lengths)
    assert len({s.data_ptr() for s in _pool._free} & pooled) < len(pooled)  # taken again
    del out


def test_interleaved_graphs_keep_their_own_buffers():
    m, x, lengths = _make()
    alone_a, _ = _grads(m, x, lengths)
    x2 = (x.detach() * 0.5).requires_grad_(True)
    alone_b, _ = _grads(m, x2, lengths)
    out_a, (h_a, c_a) = m(x, lengths=lengths)  # two graphs alive at once
    out_b, (h_b, c_b) = m(x2, lengths=lengths)
    w = torch.arange(out_a.numel(), dtype=out_a.dtype).view_as(out_a).sin()
    both_b = torch.autograd.grad((out_b * w).sum() + h_b.sum() + c_b.sum(), [x2, *m.parameters()])
    out_c, _ = m(x * 2, lengths=lengths)  # a third call while graph a is still alive
    both_a = torch.autograd.grad((out_a * w).sum() + h_a.sum() + c_a.sum(), [x, *m.parameters()])
    for got, want in ((both_a, alone_a), (both_b, alone_b)):
        for g, e in zip(got, want):
            assert torch.equal(g, e)
    del out_c


def test_retained_graph_runs_its_backward_twice():
    m, x, lengths = _make()
    first, loss = _grads(m, x, lengths, retain=True)
    m(x * 3, lengths=lengths)[0].sum().backward()  # other calls in between may use the pool
    second = torch.autograd.grad(loss, [x, *m.parameters()])
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_no_grad_and_dropped_graphs_give_buffers_back():
    m, x, lengths = _make()
    fastlayers.empty_cache()
    with torch.no_grad():  # no autograd: the C++ operators (their own work space), no pooled buffer
        m(x, lengths=lengths)
    assert len(_pool._free) == 0
    m(x, lengths=lengths)  # the graph is dropped at once: both layers' saved buffers and the work space back
    assert len(_pool._free) == 3
    fastlayers.empty_cache()
    result = m(x, lengths=lengths)
    assert len(_pool._free) == 1  # the work space; both layers' saved buffers are held by the live graph
    del result
    gc.collect()
    assert len(_pool._free) == 3


def test_gru_reuses_buffers_with_the_same_results():
    torch.manual_seed(0)
    m = fastlayers.GRU(4, 6, bidirectional=True, layer_norm=True)
    x = torch.randn(7, 3, 4, requires_grad=True)
    runs = []
    for _ in range(3):
        out, h = m(x, lengths=[7, 2, 5])
        runs.append(torch.autograd.grad(out.sum() + h.sum(), [x, *m.parameters()]))
        assert _pool._free
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_capacity_and_empty_cache():
    for n in range(_pool.CAPACITY + 3):
        _pool.give(torch.empty(10 + n))
    assert len(_pool._free) == _pool.CAPACITY
    assert min(s.numel() for s in _pool._free) == 13  # the smallest went first
    fastlayers.empty_cache()
    assert _pool._free == []


def test_reused_slab_is_poisoned_like_fresh_memory(monkeypatch):
    _pool.give(torch.zeros(64))
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    slab, views = _pool.views({"a": (4, 8), "b": None, "c": (3,)}, torch.float32, torch.device("cpu"))
    assert slab.numel() == 64 and slab.isnan().all()
    assert views["b"] is None and views["a"].shape == (4, 8) and views["c"].data_ptr() % 64 == 0


def test_a_request_no_free_slab_fits_drops_the_smaller_ones_of_its_kind():
    small, other_dtype = torch.empty(16), torch.empty(8, dtype=torch.float64)
    _pool.give(small)
    _pool.give(other_dtype)
    slab, _ = _pool.views({"a": (32,)}, torch.float32, torch.device("cpu"))  # more than the float32 slab holds
    assert slab.numel() >= 32
    assert len(_pool._free) == 1 and _pool._free[0] is other_dtype  # the too-small float32 slab went
    _pool.give(slab)
    again, _ = _pool.views({"a": (16,)}, torch.float32, torch.device("cpu"))  # the new slab serves smaller requests
    assert again is slab
