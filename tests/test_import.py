"""``import fastlayers`` stays light: it imports neither torch._dynamo (torch.compile's tracer, about
1 s; fastlayers._core.compiling is imported when tracing starts) nor Triton, nor the CLI's libraries. The
time it adds is measured by benchmarks/bench_import.py (BENCHMARKS.md), not asserted here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.subprocess


def test_import_pulls_in_no_heavy_module():
    probe = ("import sys, torch; before = set(sys.modules); import fastlayers; "
             "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'triton', 'matplotlib', 'rich', 'tqdm') "
             "if m in sys.modules and m not in before))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_public_submodules_are_attributes_after_import_fastlayers():
    """``import fastlayers`` then ``fastlayers.functional.locally_connected2d`` (README's spelling), as
    ``torch.nn.functional`` after ``import torch``: an AttributeError unless the submodule was
    imported by name. Each one on first use (import fastlayers stays light: the test above)."""
    probe = ("import sys, fastlayers; subs = ('functional', 'onnx', 'bench', 'data', 'train'); "
             "print([s for s in subs if f'fastlayers.{s}' in sys.modules]); "
             "print([getattr(fastlayers, s).__name__ for s in subs]); "
             "print(fastlayers.functional.locally_connected2d.__module__)")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1] == str([f"fastlayers.{s}" for s in ("functional", "onnx", "bench", "data", "train")])
    assert out[2].startswith("fastlayers.")


def test_compile_markers_are_dynamos():
    """fastlayers._core.compiling's functions carry exactly the marks torch's own decorators put there."""
    from fastlayers._core import compiling

    assert getattr(compiling.constant, "_dynamo_marked_constant", False) is True
    assert getattr(compiling.eagerly, "_torchdynamo_disable", False) is True
    assert torch.compiler.is_compiling() is False
