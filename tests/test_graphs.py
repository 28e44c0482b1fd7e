"""The CUDA-graph policy of the GPU engine's time loops (rnn/_graphs.py) without a GPU: when a key
is captured (warm-up), which entries are dropped at the memory limit, the environment switch.
Capture and replay themselves are in test_cuda.py (cuda marker)."""

import pytest
import torch

from fastlayers.rnn import _graphs


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    _graphs.clear()
    monkeypatch.setenv(_graphs.MAX_MB, "1")  # 1 MiB: the limit is read from here, never from a GPU
    yield
    _graphs.clear()


def _call(n: int, key: str = "k"):
    """_graphs._claim for a loop on a CPU 'numbers' tensor and one float32 output of n elements."""
    return _graphs._claim((key,), {"numbers": torch.zeros(2)}, {"out": (n,)})


@pytest.mark.parametrize("value, want", [(None, "auto"), ("auto", "auto"), ("", "auto"), ("0", "off"),
                                         ("1", "always"), ("off", "off"), ("ON", "always")])
def test_mode_reads_the_environment(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(_graphs.ENV, raising=False)
    else:
        monkeypatch.setenv(_graphs.ENV, value)
    assert _graphs.mode() == want


def test_a_bad_mode_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(_graphs.ENV, "sometimes")
    with pytest.raises(ValueError, match="FASTLAYERS_CUDA_GRAPHS must be 0, 1 or auto, got 'sometimes'"):
        _graphs.mode()


@pytest.mark.parametrize("value", ["lots", "-1", "nan"])
def test_a_bad_memory_limit_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(_graphs.MAX_MB, value)
    with pytest.raises(ValueError, match=f"FASTLAYERS_CUDA_GRAPHS_MAX_MB must be a number of MiB >= 0, got '{value}'"):
        _graphs.limit_bytes(torch.device("cpu"))


def test_cpu_tensors_never_capture(monkeypatch):
    monkeypatch.setenv(_graphs.ENV, "1")
    assert not _graphs.enabled(torch.zeros(1))


def test_auto_runs_the_first_call_eagerly_and_captures_the_second(monkeypatch):
    monkeypatch.delenv(_graphs.ENV, raising=False)
    assert _call(10) is None  # warm-up: eager
    entry = _call(10)
    assert entry is not None and entry.busy and entry.nbytes == 10 * 4 + 2 * 4
    _graphs._free(entry)
    assert _call(10) is entry  # the same entry, replayed
    second = _call(10)  # while the first is busy (a backward pending): a second entry, no warm-up
    assert second is not None and second is not entry
    assert _call(11) is None  # another shape warms up on its own


def test_always_captures_the_first_call(monkeypatch):
    monkeypatch.setenv(_graphs.ENV, "1")
    assert _call(10) is not None


def test_idle_entries_are_dropped_least_recently_used_first(monkeypatch):
    monkeypatch.setenv(_graphs.ENV, "1")
    quarter = 2**20 // 4 // 4  # float32 elements in a quarter of the 1 MiB limit
    a, b = _call(quarter, "a"), _call(quarter, "b")
    for e in (a, b):
        _graphs._free(e)
    assert _call(quarter, "a") is a  # a is now the most recently used
    _graphs._free(a)
    _call(2 * quarter, "c")  # 1 MiB + 24 bytes in all: the least recently used idle entry (b) goes
    assert [k[0] for k in _graphs._entries] == [("a",), ("c",)]


def test_busy_entries_are_kept_over_the_limit(monkeypatch):
    monkeypatch.setenv(_graphs.ENV, "1")
    half = 2**20 // 2 // 4
    a = _call(half, "a")
    b = _call(half, "b")  # a is busy: kept, the limit is exceeded for now
    assert a.busy and b.busy and len(_graphs._entries) == 2
    _graphs._free(a)
    _call(half, "c")
    assert [k[0] for k in _graphs._entries] == [("b",), ("c",)]


def test_a_failed_capture_forgets_its_entry(monkeypatch):
    monkeypatch.setenv(_graphs.ENV, "1")
    entry = _call(10)
    _graphs._drop(entry)
    assert not _graphs._entries
