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


def test_compile_markers_are_dynamos():
    """fastlayers._core.compiling's functions carry exactly the marks torch's own decorators put there."""
    from fastlayers._core import compiling

    assert getattr(compiling.constant, "_dynamo_marked_constant", False) is True
    assert getattr(compiling.eagerly, "_torchdynamo_disable", False) is True
    assert torch.compiler.is_compiling() is False
