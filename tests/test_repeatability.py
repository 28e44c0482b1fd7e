"""Repeatability on CPU: the same module and inputs give bitwise-equal outputs, final states and
every gradient, across repeated calls and across processes (the C kernels' parallel loops split
work by rows or columns, never by timing, and every sum runs in a fixed order)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from module_cases import CASE_IDS, CASES, digest, run


@pytest.fixture(autouse=True)
def _two_threads():
    """Two threads whatever the test runner chose (make test's workers each get one, and the
    kernels' parallel loops, whose split this file checks, then never ran split)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_repeated_calls_are_bitwise_equal(case):
    torch.manual_seed(0)
    module = case.build().train()
    results = []
    for _ in range(3):
        torch.manual_seed(1)  # the same dropout / zoneout masks in every call
        results.append(run(module, case))
    (outs, grads), *others = results
    assert all(g is not None for g in grads.values())
    for outs2, grads2 in others:
        assert all(torch.equal(a, b) for a, b in zip(outs, outs2, strict=True))
        assert grads.keys() == grads2.keys()
        for name in grads:
            assert torch.equal(grads[name], grads2[name]), name


@pytest.mark.subprocess
def test_results_are_bitwise_equal_across_processes():
    here = Path(__file__).parent
    threads = torch.get_num_threads()
    proc = subprocess.run([sys.executable, str(here / "module_cases.py"), str(threads)], capture_output=True,
                          text=True, check=True, cwd=here)
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = {c.id: digest(c) for c in CASES}
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if ours[k] != theirs[k]] == []
