"""One place chooses the backend per call; the user can force one; an unusable forced backend is a
clear error."""

from __future__ import annotations

import threading

import pytest
import torch

import fastlayers
from fastlayers._core import backend as _backend
from fastlayers._core.backend import select

X32 = torch.zeros(2, 3)


def test_automatic_choice_on_cpu():
    assert select("lstm", X32) == "cpu"
    assert select("gru", X32.double()) == "cpu"
    assert select("local2d", X32) == "cpu"
    assert select("attention", X32) == "cpu"  # torch's products with a backward of its own, no C library
    assert select("lstm", X32.half()) == "cpu"  # computed in float32 by the C kernels
    assert select("lstm", X32.long()) == "reference"


def test_context_manager_nests_and_restores(monkeypatch):
    monkeypatch.delenv(_backend.ENV, raising=False)
    with fastlayers.backend("reference") as name:
        assert name == "reference" and select("lstm", X32) == "reference"
        with fastlayers.backend("cpu"):
            assert select("lstm", X32) == "cpu"
        assert select("local2d", X32) == "reference"
    assert select("lstm", X32) == "cpu"


def test_context_is_per_thread():
    seen = []
    with fastlayers.backend("reference"):
        worker = threading.Thread(target=lambda: seen.append(select("lstm", X32)))
        worker.start()
        worker.join()
    assert seen == ["cpu"]


def test_environment_variable(monkeypatch):
    monkeypatch.setenv(_backend.ENV, "reference")
    assert select("local2d", X32) == "reference"
    with fastlayers.backend("cpu"):  # the context manager wins
        assert select("local2d", X32) == "cpu"
    monkeypatch.setenv(_backend.ENV, "auto")
    assert select("local2d", X32) == "cpu"
    monkeypatch.setenv(_backend.ENV, "gpu")
    with pytest.raises(ValueError, match=r"FASTLAYERS_BACKEND: expected one of \('cpu', 'triton', 'reference'\), got 'gpu'"):
        select("lstm", X32)


@pytest.mark.parametrize("env", [None, "auto", "cpu", "reference"])
@pytest.mark.parametrize("context", [None, "cpu", "reference"])
def test_cpu_kernels_shortcut_agrees_with_select(monkeypatch, env, context):
    """The no-autograd paths of the cells and the local layers ask cpu_kernels (a few lookups)
    where select() was asked: the same answer for every way of forcing, read at every call."""
    if env is None:
        monkeypatch.delenv(_backend.ENV, raising=False)
    else:
        monkeypatch.setenv(_backend.ENV, env)
    with fastlayers.backend(context) if context else torch.no_grad():
        for op in ("lstm", "gru", "local2d"):
            for x in (X32, X32.double()):
                assert _backend.cpu_kernels(op, x) == (select(op, x) == "cpu"), (op, x.dtype)
    monkeypatch.delenv(_backend.ENV, raising=False)
    assert _backend.cpu_kernels("lstm", X32)


def test_triton_kernels_shortcut_is_false_off_cuda():
    """The CUDA shortcut of the local layers never claims a CPU tensor, whatever is forced (Triton's
    interpreter on CPU tensors is chosen by select(); tests/test_cuda.py checks CUDA tensors)."""
    for context in (None, "triton", "reference", "cpu"):
        with fastlayers.backend(context) if context else torch.no_grad():
            assert not _backend.triton_kernels("local2d", X32)


def test_unknown_name():
    with pytest.raises(ValueError, match=r"backend: expected one of .*got 'cuda'"):
        with fastlayers.backend("cuda"):
            pass


def test_unusable_forced_backend_is_a_clear_error(monkeypatch):
    with fastlayers.backend("cpu"):
        with pytest.raises(RuntimeError, match=r"backend 'cpu' \(forced by fastlayers.backend\(...\)\) cannot run lstm: "
                                               r"the C kernels take float32/float64 .*, got torch.int64"):
            select("lstm", X32.long())
        with pytest.raises(RuntimeError, match="cannot run local2d: the C kernels run on CPU tensors, got a tensor on meta"):
            fastlayers.LocallyConnected2d(1, 1, 3, device="meta")(torch.zeros(1, 1, 3, 3, device="meta"))
    monkeypatch.setenv("FASTLAYERS_NO_NATIVE", "1")
    monkeypatch.setattr("fastlayers._native._STATE", {})
    with fastlayers.backend("cpu"), pytest.raises(RuntimeError, match="C library 'local' is unavailable: FASTLAYERS_NO_NATIVE"):
        fastlayers.LocallyConnected2d(1, 1, 3)(torch.zeros(1, 1, 3, 3))


def test_triton_unusable_here_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(_backend, "_triton_importable", lambda: True)
    with fastlayers.backend("triton"), pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        select("lstm", X32)
    for value in ("true", "ON", "yes"):  # (Triton's own reading of it: it interprets, so the backend runs)
        monkeypatch.setenv("TRITON_INTERPRET", value)
        with fastlayers.backend("triton"):
            assert select("lstm", X32) == "triton", value
    monkeypatch.setenv("TRITON_INTERPRET", "2")  # (not Triton's: it compiles for a GPU)
    with fastlayers.backend("triton"), pytest.raises(RuntimeError, match="set TRITON_INTERPRET=1"):
        select("lstm", X32)
    monkeypatch.setattr(_backend, "_triton_importable", lambda: False)
    with fastlayers.backend("triton"), pytest.raises(RuntimeError, match="triton package is not installed"):
        select("lstm", X32)


@pytest.mark.subprocess
def test_a_triton_that_does_not_import_is_not_chosen(tmp_path):
    """A broken triton install (it raises at import: a driver or CUDA mismatch) warns once and is
    never chosen: CUDA tensors take the reference (find_spec alone said it was there, and the
    layers' first CUDA call failed importing the kernels)."""
    import subprocess
    import sys

    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text('raise RuntimeError("libcuda.so: version mismatch")\n')
    code = ("import warnings; warnings.simplefilter('always'); import torch, fastlayers\n"
            "from fastlayers._core import backend\n"
            "print(backend._triton_importable(), backend._triton_importable())\n"
            "print(backend.unavailable('triton', 'lstm', torch.zeros(1, device='meta')))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["False False", "the triton package is not installed, or does not import"]
    assert proc.stderr.count("the triton package is installed but does not import (RuntimeError: libcuda.so: "
                             "version mismatch)") == 1


def test_forced_reference_runs_the_twins_with_the_same_results():
    torch.manual_seed(0)
    lstm = fastlayers.LSTM(4, 5, bidirectional=True, layer_norm=True, peephole=True).eval()
    local = fastlayers.LocallyConnected2d(2, 3, (5, 6), 3, padding=1)
    x, img = torch.randn(6, 3, 4), torch.randn(2, 2, 5, 6)
    fast = lstm(x, lengths=[6, 2, 4])[0], local(img)
    with fastlayers.backend("reference"):
        slow = lstm(x, lengths=[6, 2, 4])[0], local(img)
        assert "locally_connected2d" not in type(local(img.requires_grad_()).grad_fn).__name__
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
