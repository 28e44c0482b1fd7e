"""Without the C kernels (no native library, or another device) the pure-PyTorch twins give the same results."""

import torch

import fastlayers
from fastlayers import _native
from fastlayers.functional import locally_connected2d


def _without_native(monkeypatch):
    monkeypatch.setitem(_native._STATE, "lib", None)  # as if the native library were missing


def test_locally_connected_falls_back(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    w = torch.randn(2, 3, 3, 3, 6, 5, dtype=torch.float64, requires_grad=True)
    y_native = locally_connected2d(x, w, None, 1, 1)
    g_native, = torch.autograd.grad(y_native.sum(), w)
    _without_native(monkeypatch)
    y_eager = locally_connected2d(x, w, None, 1, 1)
    assert type(y_native.grad_fn).__name__ == "LocallyConnected2dNativeBackward"
    assert "Native" not in type(y_eager.grad_fn).__name__  # the twin's torch ops, not the C kernel
    g_eager, = torch.autograd.grad(y_eager.sum(), w)
    torch.testing.assert_close(y_eager, y_native)
    torch.testing.assert_close(g_eager, g_native)


def test_lstm_options_fall_back(monkeypatch):
    torch.manual_seed(0)
    m = fastlayers.LSTM(3, 4, bidirectional=True, layer_norm=True, peephole=True, dtype=torch.float64).eval()
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    out_native, _ = m(x, lengths=[5, 3])
    g_native, = torch.autograd.grad(out_native.sum(), x)
    _without_native(monkeypatch)
    out_eager, _ = m(x, lengths=[5, 3])
    from fastlayers._core.backend import select

    assert select("lstm", x) == "reference"  # so the module ran the per-step reference
    g_eager, = torch.autograd.grad(out_eager.sum(), x)
    torch.testing.assert_close(out_eager, out_native)
    torch.testing.assert_close(g_eager, g_native)


def test_gru_options_fall_back(monkeypatch):
    torch.manual_seed(0)
    m = fastlayers.GRU(3, 4, num_layers=2, bidirectional=True, layer_norm=True, zoneout=0.2,
                       dtype=torch.float64).eval()
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)
    out_native, _ = m(x, lengths=[5, 3])
    g_native, = torch.autograd.grad(out_native.sum(), x)
    _without_native(monkeypatch)
    out_eager, _ = m(x, lengths=[5, 3])
    from fastlayers._core.backend import select

    assert select("gru", x) == "reference"  # so the module ran the per-step reference
    g_eager, = torch.autograd.grad(out_eager.sum(), x)
    torch.testing.assert_close(out_eager, out_native)
    torch.testing.assert_close(g_eager, g_native)


def test_plain_lengths_dispatch_engine_or_segments(monkeypatch):
    """LSTM/GRU with lengths and no options: the engine on CPU, torch's segment path without it."""
    from fastlayers.rnn import _modules, _routing

    calls = []

    def spy(real, name):
        return lambda *a, **k: calls.append(name) or real(*a, **k)

    for cell, name in (("LSTM", "lstm_engine"), ("GRU", "gru_engine")):  # the routing table's CPU engines
        monkeypatch.setitem(_routing.ENGINES, (cell, "cpu"), spy(_routing.ENGINES[cell, "cpu"], name))
    monkeypatch.setattr(_modules, "varlen_rnn", spy(_modules.varlen_rnn, "varlen_rnn"))
    torch.manual_seed(0)
    for cls, engine in ((fastlayers.LSTM, "lstm_engine"), (fastlayers.GRU, "gru_engine")):
        m = cls(3, 4, bidirectional=True, dtype=torch.float64)
        x = torch.randn(6, 3, 3, dtype=torch.float64, requires_grad=True)
        calls.clear()
        out_engine, _ = m(x, lengths=[6, 2, 4])
        assert calls == [engine]
        g_engine, = torch.autograd.grad(out_engine.sum(), x)
        with monkeypatch.context() as mp:
            _without_native(mp)
            calls.clear()
            out_segments, _ = m(x, lengths=[6, 2, 4])
            assert calls == ["varlen_rnn"]
            g_segments, = torch.autograd.grad(out_segments.sum(), x)
        torch.testing.assert_close(out_segments, out_engine)
        torch.testing.assert_close(g_segments, g_engine)
        calls.clear()
        m(x, lengths=[6, 6, 6])  # no padding: torch's padded kernel
        assert calls == []


def test_a_forced_cpu_backend_without_the_library_refuses_the_cells_too(monkeypatch):
    """Without the native library a forced "cpu" backend refuses a cell with options as it refuses
    the layers (the cells ran their equations silently); unforced, the cell runs its equations."""
    import pytest

    from fastlayers._core.backend import BackendUnavailable

    torch.manual_seed(0)
    cell, layer = fastlayers.LSTMCell(4, 3, layer_norm=True), fastlayers.LSTM(4, 3, layer_norm=True)
    x = torch.randn(2, 4)
    want = cell(x)
    _without_native(monkeypatch)
    for call in (lambda: cell(x), lambda: layer(x.unsqueeze(0))):
        with fastlayers.backend("cpu"), pytest.raises(BackendUnavailable, match=r"backend 'cpu' .* cannot run lstm"):
            call()
    for a, b in zip(cell(x), want):
        torch.testing.assert_close(a, b)
