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


# The CPU block cache (_native/ops_cache.h through _pool.empty): the tensors that leave the engine.

needs_cache = pytest.mark.skipif(not _pool._cache_on(), reason="the native library is unavailable")


def _info():
    return dict(zip(("idle", "used", "hits", "misses", "limit"), torch.ops.fastlayers.cache_info()))


@needs_cache
def test_cache_gives_a_dead_tensors_block_to_the_next_request_it_fits():
    like = torch.empty(0)
    t = _pool.empty((512, 1024), torch.float32, like)
    assert t.shape == (512, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    address, before = t.data_ptr(), _info()
    del t
    assert _info()["idle"] >= before["idle"] + 512 * 1024 * 4
    u = _pool.empty((500, 1024), torch.float32, like)  # smaller, within 1.5x: the same block
    assert u.data_ptr() == address and _info()["hits"] == before["hits"] + 1
    d = _pool.empty((256, 1024), torch.float64, like)  # another dtype of the same bytes: a new block
    assert d.data_ptr() != address and d.dtype == torch.float64


@needs_cache
def test_cache_leaves_small_tensors_and_other_devices_to_torch():
    before = _info()
    small = _pool.empty((100,), torch.float32, torch.empty(0))
    meta = _pool.empty((1024, 1024), torch.float32, torch.empty(0, device="meta"))
    assert small.shape == (100,) and meta.device.type == "meta" and meta.shape == (1024, 1024)
    assert _info()["misses"] == before["misses"] and _info()["hits"] == before["hits"]


@needs_cache
def test_cache_limit_and_empty_cache_release_idle_blocks():
    limit = _info()["limit"]
    try:
        t = _pool.empty((1024, 1024), torch.float32, torch.empty(0))
        torch.ops.fastlayers.cache_limit(0)  # keeps nothing: the block is freed when its tensor dies
        del t
        assert _info()["idle"] == 0
        torch.ops.fastlayers.cache_limit(limit)
        t = _pool.empty((1024, 1024), torch.float32, torch.empty(0))
        del t
        assert _info()["idle"] > 0
        fastlayers.empty_cache()
        assert _info()["idle"] == 0
        with pytest.raises(RuntimeError, match="cache_limit: expected a number of bytes >= 0, got -1"):
            torch.ops.fastlayers.cache_limit(-1)
    finally:
        torch.ops.fastlayers.cache_limit(limit)


@needs_cache
def test_cached_tensors_are_ordinary_tensors():
    t = _pool.empty((512, 1024), torch.float32, torch.empty(0))
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t))
    want = t.clone()
    t.resize_(2048, 1024)  # resizable: a new block, the values kept
    assert torch.equal(t[:512], want)
    assert torch.equal(torch.load(_saved(t[:512])), want)


def _saved(t):
    import io

    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    return buffer


@needs_cache
def test_cached_tensor_is_poisoned_like_fresh_memory():
    """The poisoning as torch sets it (the operator reads torch's own flags, in C++)."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.use_deterministic_algorithms(True)
    try:
        assert _pool.empty((512, 1024), torch.float32, torch.empty(0)).isnan().all()
        assert (_pool.empty((512, 1024), torch.int64, torch.empty(0)) == 0).all()
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(deterministic)


@needs_cache
def test_profiler_sees_cached_blocks():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t = _pool.empty((1024, 1024), torch.float32, torch.empty(0))
        del t
    grown = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert max(grown) >= 1024 * 1024 * 4


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.parametrize("lengths", [None, [9, 3, 6, 9]])
def test_engine_tensors_from_the_cache_are_never_shared(monkeypatch, cell, lengths):
    """Every tensor of the engine through the cache (no size floor): a second call and its backward,
    while the first call's outputs and gradients are alive, leave them as they were, and every result
    equals the same calls with the cache off."""
    monkeypatch.setattr(_pool, "CACHE_MIN_BYTES", 0)

    def calls():
        torch.manual_seed(0)
        m = getattr(fastlayers, cell)(5, 6, num_layers=2, bidirectional=True, layer_norm=True)
        results = []
        for scale in (1.0, -2.0, 0.5):
            x = (torch.randn(9, 4, 5) * scale).requires_grad_(True)
            out, state = m(x, lengths=lengths)
            state = state if isinstance(state, tuple) else (state,)
            grads = torch.autograd.grad((out * out.detach().cos()).sum() + sum(s.sum() for s in state),
                                        [x, *m.parameters()])
            results.append((out.detach(), *state, *grads))
        return results

    fastlayers.empty_cache()
    with_cache = calls()
    copies = [[t.clone() for t in r] for r in with_cache]
    if _pool._cache_on():
        assert _info()["hits"] > 0
    monkeypatch.setitem(_pool._cache, "on", False)
    without = calls()
    for got, kept, want in zip(with_cache, copies, without):
        for a, b, c in zip(got, kept, want):
            assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("covers", [True, False])
def test_gather_and_scatter_rows_gradients(monkeypatch, covers):
    from fastlayers.rnn._rows import gather, scatter

    monkeypatch.setattr(_pool, "CACHE_MIN_BYTES", 0)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([3, 0, 4, 1, 2, 4, 0, 2] if covers else [3, 0, 4, 0, 2])
    torch.autograd.gradcheck(lambda v: gather(v, index, covers), (x,))
    torch.autograd.gradgradcheck(lambda v: gather(v, index, covers), (x,))
    y = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([6, 1, 3, 0, 4]) if not covers else torch.tensor([2, 0, 4, 1, 3])
    out = scatter(y, rows, 7 if not covers else 5, covers)
    want = torch.zeros(7 if not covers else 5, 3, dtype=torch.float64).index_copy(0, rows, y.detach())
    assert torch.equal(out.detach(), want)
    torch.autograd.gradcheck(lambda v: scatter(v, rows, 7 if not covers else 5, covers), (y,))
    torch.autograd.gradgradcheck(lambda v: scatter(v, rows, 7 if not covers else 5, covers), (y,))


@pytest.mark.subprocess
@pytest.mark.parametrize("value,limit,warns", [("0", 0, False), ("64", 64 << 20, False), ("many", 1024 << 20, True),
                                               ("512 ", 512 << 20, False), (" 0\n", 0, False), ("+5", 1024 << 20, True),
                                               ("-1", 1024 << 20, True), ("8 MB", 1024 << 20, True)])
def test_cache_limit_from_the_environment(value, limit, warns):
    """The limit the library reads is the one the Python side reports and warns about (white space
    around the digits taken by both: '512 ' was the default silently in the library, and '+5' 5 MiB
    where the warning said the default)."""
    import os
    import subprocess
    import sys

    code = ("import warnings, torch, fastlayers\n"
            "from fastlayers._core import pool\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    on = pool._cache_on()\n"
            "print(torch.ops.fastlayers.cache_info()[4], on, pool.cache_info() is None,\n"
            "      any('FASTLAYERS_CPU_CACHE_MB' in str(x.message) for x in w))\n"
            "m = fastlayers.LSTM(64, 128, bidirectional=True, layer_norm=True)\n"
            "out, _ = m(torch.randn(50, 32, 64, requires_grad=True)); out.sum().backward()\n")
    env = {**os.environ, "FASTLAYERS_CPU_CACHE_MB": value}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got, on, off, warned = done.stdout.split()
    assert int(got) == limit and on == str(limit > 0) and off == str(limit == 0) and warned == str(warns)


@needs_cache
@pytest.mark.subprocess
def test_empty_cache_releases_what_no_grad_calls_and_their_threads_left():
    """A process of no-grad calls (the C++ operators) filled the block cache that empty_cache() then
    skipped, and each thread's operator work space kept its largest call's buffers until the thread
    ended, out of empty_cache's reach (about 96 MiB per thread at this shape): a fresh process runs
    no-grad calls on the main thread and four others, and empty_cache() leaves no idle block."""
    import subprocess
    import sys

    code = ("import threading, torch, fastlayers\n"
            "torch.manual_seed(0)\n"
            "m = fastlayers.LSTM(64, 256, layer_norm=True, bidirectional=True)\n"
            "x, lengths = torch.randn(300, 32, 64), torch.randint(150, 301, (32,))\n"
            "def call():\n"
            "    with torch.no_grad():\n"
            "        m(x, lengths=lengths)\n"
            "call()\n"
            "threads = [threading.Thread(target=call) for _ in range(4)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "before = torch.ops.fastlayers.cache_info()\n"
            "fastlayers.empty_cache()\n"
            "after = torch.ops.fastlayers.cache_info()\n"
            "print(before[0], after[0], after[1])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    idle_before, idle_after, used_after = map(int, done.stdout.split())
    assert idle_before > 0 and idle_after == 0 and used_after == 0  # (the work spaces too: idle blocks)


@needs_cache
def test_cache_serves_threads_at_once():
    """Blocks taken and given back from several threads at once: every tensor keeps its own values
    and the cache's books balance (no block in use twice, none lost)."""
    import threading

    fastlayers.empty_cache()
    used_before = _info()["used"]
    errors = []

    def work(seed):
        live = []  # a few tensors alive at once, written, then read back after the others ran
        for i in range(40):
            t = _pool.empty((256 + (seed * 7 + i) % 64, 1024), torch.float32, torch.empty(0))
            live.append((t.fill_(seed * 1000 + i), seed * 1000 + i))
            if len(live) == 4:
                errors.extend((seed, v) for t, v in live if not bool((t == v).all()))
                live.clear()

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    info = _info()
    assert info["used"] == used_before and info["idle"] <= info["limit"] and info["hits"] > 0



# The backward that frees the graph writes its gradients over saved buffers (dpre over the gates, dr
# over the recurrent LayerNorm's rhat; without the input LayerNorm the projection goes into the
# gates' rows): the same gradients, bit for bit, as a backward that keeps the graph (its own
# buffers), on each split of the C loop's work between two threads (by directions; one direction
# of batch 1: by weight panels, with barriers; a small weight over a batch: by rows).

@pytest.mark.parametrize("cell, options", [
    ("LSTM", {}), ("LSTM", {"layer_norm": True}), ("LSTM", {"peephole": True, "cell_clip": 0.4}),
    ("LSTM", {"layer_norm": True, "peephole": True, "zoneout": 0.3}), ("GRU", {}), ("GRU", {"layer_norm": True}),
    ("GRU", {"layer_norm": True, "zoneout": 0.3})], ids=lambda v: v if isinstance(v, str) else "-".join(v) or "plain")
@pytest.mark.parametrize("batch, bidirectional", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_graph_freeing_backward_writes_over_saved_buffers_with_the_same_gradients(cell, options, batch, bidirectional,
                                                                                    dtype):
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        low = dtype == torch.bfloat16  # bf16 products under autocast: the C loops round dr, its own buffer
        m = getattr(fastlayers, cell)(5, 40, bidirectional=bidirectional, **options)
        m = m.to(torch.float32 if low else dtype).eval()
        x = torch.randn(9, batch, 5, dtype=torch.float32 if low else dtype, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
            out, state = m(x, lengths=[9, 4, 7][:batch])
        loss = (out.float() * torch.arange(out.numel()).view_as(out).sin()).sum()
        loss = loss + sum(s.float().sum() for s in (state if cell == "LSTM" else (state,)))
        wrt = [x, *m.parameters()]
        kept = torch.autograd.grad(loss, wrt, retain_graph=True)
        freed = torch.autograd.grad(loss, wrt)
    finally:
        torch.set_num_threads(threads)
    for name, a, b in zip(["x", *dict(m.named_parameters())], kept, freed):
        assert torch.equal(a, b), name
        assert a.abs().sum() > 0, name
