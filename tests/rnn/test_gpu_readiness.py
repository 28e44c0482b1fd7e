"""When a plain LSTM / GRU call may replay the GPU engine's captured loops (rnn/_gpu.replays), on
CPU tensors under Triton's interpreter with emulated graphs: the first call of a configuration
prepares its loops by a capture-only run and is cuDNN's, the next replays. That preparation runs
the engine on aliases of the parameters (the user's hooks on them never fire), never inside
saved-tensor hooks (a non-reentrant torch.utils.checkpoint counted its tensors and failed at
backward), and the TF32 flag is part of the readiness key (as of the loops' own keys)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fastlayers
from fastlayers.rnn import _gpu, _gpu_graphs


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    _gpu_graphs.clear()
    _gpu._READY.clear()
    _gpu._UNREADY.clear()
    monkeypatch.setattr(_gpu_graphs, "EAGER_STEPS", 0)
    before = dict(_gpu_graphs.stats)
    with _gpu_graphs.emulated(), fastlayers.backend("triton"), warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed preparation warns: none may
        yield
    _gpu_graphs.stats.update(before)
    _gpu_graphs.clear()
    _gpu._READY.clear()
    _gpu._UNREADY.clear()


def _layer(mode: str):
    torch.manual_seed(0)
    return getattr(fastlayers, mode)(3, 4, bidirectional=True)


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_first_call_prepares_and_the_next_replays(mode):
    m, x = _layer(mode), torch.randn(6, 2, 3, requires_grad=True)
    assert not _gpu.replays(m, x)
    assert _gpu.replays(m, x) and _gpu_graphs.stats["failed"] == 0


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_preparation_fires_no_hook_on_the_parameters(mode):
    m, x = _layer(mode), torch.randn(6, 2, 3, requires_grad=True)
    fired = []
    for name, p in m.named_parameters():
        p.register_hook(lambda g, name=name: fired.append(name))
    assert not _gpu.replays(m, x) and _gpu.replays(m, x)  # prepared
    assert fired == [] and all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("hooks", ["checkpoint", "save_on_cpu"])
def test_no_preparation_inside_saved_tensor_hooks(hooks):
    """The call is cuDNN's there (torch's kernels), and a non-reentrant checkpoint's backward runs."""
    m, x = _layer("LSTM"), torch.randn(6, 2, 3, requires_grad=True)
    seen, captures = [], _gpu_graphs.stats["captures"]

    def forward(x):
        seen.append(_gpu.replays(m, x))
        return m(x)[0].sum()

    for _ in range(2):
        if hooks == "checkpoint":
            out = checkpoint(forward, x, use_reentrant=False)
        else:
            with torch.autograd.graph.save_on_cpu():
                out = forward(x)
        out.backward()
    assert seen and not any(seen) and not _gpu._READY and _gpu_graphs.stats["captures"] == captures
    assert not _gpu.replays(m, x) and _gpu.replays(m, x)  # outside: prepared as usual


def test_the_tf32_flag_is_part_of_the_readiness_key():
    m, x = _layer("LSTM"), torch.randn(6, 2, 3)
    assert not _gpu.replays(m, x) and _gpu.replays(m, x)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not before
    try:
        assert not _gpu.replays(m, x)  # the loops' keys change with it: prepared again
        assert _gpu.replays(m, x)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
