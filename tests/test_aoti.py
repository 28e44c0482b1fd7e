"""AOTInductor without Python: a package of a model built from fastlayers layers (torch.export with
dynamic batch and time, then torch._inductor.aoti_compile_and_package) runs in a fresh process that
loads only fastlayers' operator library (no ``import fastlayers``), and from the C++ example in
examples/aoti_cpp (built with cmake against the LibTorch inside the torch wheel), equal to eager at
several shapes and lengths."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

import fastlayers

pytestmark = pytest.mark.subprocess  # (see pyproject's markers)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "aoti_cpp"
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


def test_cpp_example_runs_the_package(package, tmp_path):
    folder, path, cases = package
    cmake = shutil.which("cmake")
    assert cmake is not None, "cmake is part of the set-up (the C++ example is built by this test)"
    build = tmp_path / "build"
    prefix = torch.utils.cmake_prefix_path
    for command in ([cmake, "-S", str(EXAMPLE), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}",
                     "-DCMAKE_BUILD_TYPE=Release"], [cmake, "--build", str(build), "-j", "2"]):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for i, case in enumerate(cases):
        steps, batch, features = case["x"].shape
        case["x"].numpy().tofile(tmp_path / f"x{i}.f32")
        case["lengths"].numpy().tofile(tmp_path / f"l{i}.i64")
        proc = subprocess.run([str(build / "run_package"), fastlayers.ops_library(), path, str(steps), str(batch),
                               str(features), str(tmp_path / f"x{i}.f32"), str(tmp_path / f"l{i}.i64"),
                               str(tmp_path / f"out{i}")], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        for k, want in enumerate(case["expected"]):
            got = torch.from_file(str(tmp_path / f"out{i}.{k}"), size=want.numel(), dtype=torch.float32)
            torch.testing.assert_close(got.view(want.shape), want, rtol=0, atol=1e-6)
