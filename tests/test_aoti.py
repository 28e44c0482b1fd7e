"""AOTInductor without Python: a package of a model built from fastlayers layers (torch.export with
dynamic batch and time, then torch._inductor.aoti_compile_and_package) runs in a fresh process that
loads only fastlayers' operator library (no ``import fastlayers``), equal to eager at several shapes
and lengths. The C++ example in examples/aoti_cpp (cmake against the LibTorch inside the torch
wheel) is built and run by tests/test_install.py, against a fresh venv holding the wheel."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.export import Dim

import fastlayers

pytestmark = pytest.mark.subprocess  # (see pyproject's markers)

SHAPES = [(3, 9), (6, 2), (1, 12)]  # (batch, time); the export's is (4, 7)


class Model(nn.Module):
    """Every C++ operator: LSTM with options (2 layers, both directions), GRU with zoneout, a ReLU RNN
    and a locally connected layer over each step's features."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = fastlayers.LSTM(5, 6, num_layers=2, bidirectional=True, layer_norm=True, peephole=True)
        self.gru = fastlayers.GRU(12, 4, zoneout=0.1)
        self.rnn = fastlayers.RNN(4, 3, nonlinearity="relu")
        self.local = fastlayers.LocallyConnected1d(1, 2, 3, kernel_size=2)

    def forward(self, x, lengths):
        y, _ = self.lstm(x, lengths=lengths)
        y, h = self.gru(y, lengths=lengths)
        y, _ = self.rnn(y, lengths=lengths)
        return y, h, self.local(y.reshape(-1, 1, 3))


def _case(batch: int, steps: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, steps + 1, (batch,), generator=g)
    lengths[-1] = steps
    return {"x": torch.randn(steps, batch, 5, generator=g), "lengths": lengths}


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    torch.manual_seed(0)
    model = Model().eval()
    example = _case(4, 7, 0)
    ep = torch.export.export(model, (example["x"], example["lengths"]),
                             dynamic_shapes=({0: Dim("T"), 1: Dim("B")}, {0: Dim("B")}))
    folder = tmp_path_factory.mktemp("aoti")
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(folder / "model.pt2"))
    cases = []
    with torch.no_grad():
        for i, (batch, steps) in enumerate(SHAPES):
            case = _case(batch, steps, i + 1)
            case["expected"] = list(model(case["x"], case["lengths"]))
            cases.append(case)
    torch.save(cases, folder / "cases.pt")
    return folder, path, cases


_RUN = """
import json, sys, torch
torch.ops.load_library(sys.argv[1])
runner = torch._inductor.aoti_load_package(sys.argv[2])
errors = []
for case in torch.load(sys.argv[3]):
    outputs = runner(case["x"], case["lengths"])
    errors.append([float((a - b).abs().max()) if a.shape == b.shape else float("inf")
                   for a, b in zip(outputs, case["expected"])])
print(json.dumps({"errors": errors, "fastlayers_imported": "fastlayers" in sys.modules}))
"""


def test_package_runs_in_a_process_without_fastlayers(package):
    folder, path, _ = package
    proc = subprocess.run([sys.executable, "-c", _RUN, fastlayers.ops_library(), path, str(folder / "cases.pt")],
                          capture_output=True, text=True, cwd=folder, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fastlayers_imported"] is False
    assert len(result["errors"]) == len(SHAPES)
    for errors in result["errors"]:
        assert len(errors) == 3 and max(errors) <= 1e-6, result
