"""A new user's install from a wheel (issue 64): ``pip wheel --no-build-isolation`` of this checkout
builds the native library into the package (one file per CPU variant); the wheel's tags, contents,
pinned torch and the libraries' external dependencies are checked; then in a fresh venv whose PATH
holds no C or C++ compiler, with only torch and the wheel installed: the layers run their kernels
(no warning, the C kernels and the C++ operators on), torch.export runs, an AOTInductor package
compiled elsewhere runs, the C++ example runs against the installed library, ``fastlayers doctor``
says which variant runs, torch.compile runs (the aot_eager backend: Inductor's CPU code needs a
compiler for any model); the command line names the extra it needs, and after installing the
wheel with ``[cli]`` ``fastlayers train`` fetches its dataset on first use into the user cache (or
fails in one line, no traceback, saying how to provide it offline); with ``[onnx]``,
``torch.onnx.export(model, args, dynamo=True)`` as it is, run in ONNX Runtime."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "aoti_cpp"
VARIANTS = ("default", "avx2", "avx512")
# what a variant's library may link against: torch's own libraries (from the torch it requires) and
# the C / C++ runtime (manylinux's allowed system libraries); libgomp is torch's own copy
ALLOWED = {"libc10.so", "libtorch_cpu.so", "libtorch.so", "libgomp.so.1", "libstdc++.so.6", "libm.so.6",
           "libgcc_s.so.1", "libc.so.6", "ld-linux-x86-64.so.2", "libpthread.so.0", "libdl.so.2"}


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this checkout, built once from the files a source distribution holds."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src-copy"
    shutil.copytree(ROOT / "src", source / "src",
                    ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "*.so", ".built"))
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    proc = _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
                 "-w", str(tmp / "dist"), str(source)], cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list((tmp / "dist").glob("fastlayers-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _needed(library: Path) -> set[str]:
    """The shared libraries ``library`` names as NEEDED (its dynamic section, read with pyelftools)."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    with open(library, "rb") as f:
        sections = [s for s in ELFFile(f).iter_sections() if isinstance(s, DynamicSection)]
        return {tag.needed for s in sections for tag in s.iter_tags() if tag.entry.d_tag == "DT_NEEDED"}


def test_wheel_tags_contents_and_dependencies(wheel, tmp_path):
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert re.fullmatch(rf"fastlayers-0\.1\.0-{tag}-{tag}-linux_x86_64\.whl", wheel.name), wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        z.extractall(tmp_path)
    libraries = sorted(n for n in names if n.endswith(".so"))
    assert libraries == [f"fastlayers/_native/_C_{v}.so" for v in sorted(VARIANTS)], libraries
    assert f"Requires-Dist: torch=={torch.__version__.split('+')[0]}" in metadata.splitlines(), metadata
    assert not any(n.startswith(("tests/", "benchmarks/", "build/")) for n in names)
    for name in libraries:
        assert _needed(tmp_path / name) <= ALLOWED, (name, _needed(tmp_path / name) - ALLOWED)


_QUICKSTART = """
import json, shutil, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import torch, fastlayers
    from fastlayers._core.backend import select
    from fastlayers._native import ops_lib
    lstm = fastlayers.LSTM(3, 4, layer_norm=True, bidirectional=True)
    x = torch.randn(5, 2, 3, requires_grad=True)
    y, _ = lstm(x, lengths=torch.tensor([5, 2]))
    y.sum().backward()
    local = fastlayers.LocallyConnected2d(2, 3, (6, 6), 3)
    local(torch.randn(2, 2, 6, 6)).sum().backward()
    program = torch.export.export(lstm.eval(), (x.detach(),), kwargs={"lengths": torch.tensor([5, 2])})
    exported = program.module()(x.detach(), lengths=torch.tensor([5, 2]))[0]
    with torch.no_grad():
        eager = lstm(x, lengths=torch.tensor([5, 2]))[0]
        # torch.compile with a backend that needs no compiler (Inductor's CPU code does, for any model)
        compiled = torch.compile(lstm, backend="aot_eager")(x, lengths=torch.tensor([5, 2]))[0]
print(json.dumps({"shape": list(y.shape), "grad": x.grad is not None, "backends": [select(op, x) for op in
                  ("lstm", "local2d")], "operators": ops_lib.load(), "export_error": float((exported - eager).abs().max()),
                  "compile_error": float((compiled - eager).abs().max()),
                  "compilers": [c for c in ("gcc", "g++", "cc", "c++") if shutil.which(c)],
                  "library": ops_lib.library_path(), "warnings": [str(w.message) for w in caught]}))
"""

_ONNX = """
import json, shutil, numpy as np, onnxruntime as ort, torch, fastlayers
from torch.export import Dim
torch.manual_seed(0)
model = fastlayers.LSTM(3, 4, layer_norm=True, bidirectional=True).eval()
x, lengths = torch.randn(5, 2, 3), torch.tensor([5, 2])
program = torch.onnx.export(model, (x,), kwargs={"lengths": lengths}, dynamo=True, verbose=False,
                            dynamic_shapes={"input": {0: Dim("T"), 1: Dim("B")}, "lengths": {0: Dim("B")}})
session = ort.InferenceSession(program.model_proto.SerializeToString())
x2, lengths2 = torch.randn(7, 3, 3), torch.tensor([7, 1, 4])
got = session.run(None, {"input": x2.numpy(), "lengths": lengths2.numpy()})[0]
with torch.no_grad():
    want = model(x2, lengths=lengths2)[0]
print(json.dumps({"error": float(np.abs(got - want.numpy()).max()),
                  "compilers": [c for c in ("gcc", "g++", "cc", "c++") if shutil.which(c)]}))
"""

_AOTI = """
import json, sys, torch, fastlayers
torch.ops.load_library(fastlayers.ops_library())  # the documented one-liner: the installed library's operators
runner = torch._inductor.aoti_load_package(sys.argv[1])
case = torch.load(sys.argv[2])
out = runner(case["x"], case["lengths"])
print(json.dumps({"error": max(float((a - b).abs().max()) for a, b in zip(out, case["expected"]))}))
"""


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import fastlayers

        self.lstm = fastlayers.LSTM(5, 6, bidirectional=True, layer_norm=True)
        self.local = fastlayers.LocallyConnected1d(1, 2, 12, kernel_size=2)

    def forward(self, x, lengths):
        y, _ = self.lstm(x, lengths=lengths)
        return y, self.local(y.reshape(-1, 1, 12))


def _aoti_package(folder: Path) -> tuple[str, dict]:
    """An AOTInductor package of a model with fastlayers' operators, compiled here (with a compiler)."""
    from torch.export import Dim

    torch.manual_seed(0)
    model = _Model().eval()
    x, lengths = torch.randn(7, 4, 5), torch.tensor([7, 3, 5, 1])
    program = torch.export.export(model, (x, lengths), dynamic_shapes=({0: Dim("T"), 1: Dim("B")}, {0: Dim("B")}))
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / "model.pt2"))
    case = {"x": torch.randn(9, 3, 5), "lengths": torch.tensor([9, 2, 6])}
    with torch.no_grad():
        case["expected"] = list(model(case["x"], case["lengths"]))
    torch.save(case, folder / "case.pt")
    return path, case


def test_fresh_venv_without_a_compiler_runs_the_kernels_export_and_aoti(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py, cli = str(venv / "bin" / "python"), str(venv / "bin" / "fastlayers")
    tools = tmp_path / "tools"  # the PATH's only folder besides the venv: no compiler in it
    tools.mkdir()
    # a user's shell: none of the checkout's or this machine's settings (this machine sets
    # PYTHONDONTWRITEBYTECODE, with which every process below would compile torch's modules anew)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FASTLAYERS_DATA", "FASTLAYERS_OFFLINE",
                                                            "VIRTUAL_ENV", "CC", "CXX", "FASTLAYERS_CPU_CAPABILITY",
                                                            "PYTHONDONTWRITEBYTECODE")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}:{tools}")
    pip = [py, "-m", "pip", "install", "--quiet"]
    # torch pinned (the CPU build on disk), without compiling its thousands of modules ahead (25 of
    # its 35 s of install here; the first import below compiles and caches the few it reads); then
    # the wheel
    for cmd in ([*pip, "--no-compile", "torch==2.13.0"], [*pip, str(wheel)]):
        proc = _run(cmd, env, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]

    # the layers alone: torch is all they need, and nothing compiles
    listed = _run([py, "-m", "pip", "list", "--format=freeze"], env, tmp_path).stdout.lower()
    assert not any(f"{name}==" in listed for name in ("tqdm", "rich", "matplotlib")), listed
    proc = _run([py, "-c", _QUICKSTART], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["compilers"] == [] and result["warnings"] == [], result
    assert result["shape"] == [5, 2, 8] and result["grad"] and result["backends"] == ["cpu", "cpu"], result
    assert result["operators"] is True and result["export_error"] <= 1e-6 and result["compile_error"] <= 1e-6, result
    installed = Path(result["library"])
    assert installed.is_relative_to(venv) and installed.name.startswith("_C_"), installed

    doctor = _run([cli, "doctor"], env, tmp_path)
    assert doctor.returncode == 0 and "Native library: " in doctor.stdout, doctor.stderr[-3000:]
    variant = installed.stem.removeprefix("_C_")
    assert f"Native library: {variant} (the best this CPU runs" in doctor.stdout, doctor.stdout

    # an AOTInductor package (compiled here, where there is a compiler) runs there
    path, case = _aoti_package(tmp_path)
    aoti = _run([py, "-c", _AOTI, path, str(tmp_path / "case.pt")], env, tmp_path)
    assert aoti.returncode == 0, aoti.stderr[-3000:]
    assert json.loads(aoti.stdout.strip().splitlines()[-1])["error"] <= 1e-6

    # the C++ example, built against the fresh venv's LibTorch, runs the package with the installed library
    cmake = shutil.which("cmake", path=str(Path(sys.executable).parent)) or shutil.which("cmake")
    assert cmake is not None, "cmake is part of the set-up (the test extra; the C++ example is built by this test)"
    prefix = _run([py, "-c", "import torch.utils; print(torch.utils.cmake_prefix_path)"], env).stdout.strip()
    build = tmp_path / "build"
    for command in ([cmake, "-S", str(EXAMPLE), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}",
                     "-DCMAKE_BUILD_TYPE=Release"], [cmake, "--build", str(build), "-j", "2"]):
        proc = _run(command)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps, batch, features = case["x"].shape
    case["x"].numpy().tofile(tmp_path / "x.f32")
    case["lengths"].numpy().tofile(tmp_path / "l.i64")
    proc = _run([str(build / "run_package"), str(installed), path, str(steps), str(batch), str(features),
                 str(tmp_path / "x.f32"), str(tmp_path / "l.i64"), str(tmp_path / "out")], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for k, want in enumerate(case["expected"]):
        got = torch.from_file(str(tmp_path / f"out.{k}"), size=want.numel(), dtype=torch.float32)
        torch.testing.assert_close(got.view(want.shape), want, rtol=0, atol=1e-6)

    # the command line: it names its extra; with it, fastlayers train fetches its dataset once
    version = _run([cli, "--version"], env, tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("fastlayers 0."), version.stderr
    no_extra = _run([cli, "train", "--dataset", "vowels"], env, tmp_path)
    assert no_extra.returncode == 1 and "Traceback" not in no_extra.stderr, no_extra.stderr[-3000:]
    assert no_extra.stderr.strip().endswith("pip install 'fastlayers[cli]'"), no_extra.stderr

    proc = _run([*pip, f"{wheel}[cli]"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [cli, "train", "--dataset", "vowels", "--max-samples", "32", "--batch-size", "16", "--hidden-size", "6",
             "--epochs", "1"]
    offline = _run([*train, "--out", "offline"], {**env, "PIP_INDEX_URL": "file:///nonexistent", "PIP_FIND_LINKS": "",
                                                  "PIP_EXTRA_INDEX_URL": "", "PIP_NO_INDEX": "1"}, tmp_path)
    assert offline.returncode == 1 and "Traceback" not in offline.stderr, offline.stderr[-3000:]
    last = offline.stderr.strip().splitlines()[-1]
    assert last.startswith("fastlayers train: aeon==1.6.0: downloading its wheel failed (") and \
        "set FASTLAYERS_DATA=DIR" in last, offline.stderr
    fetched = _run([*train, "--out", "run"], env, tmp_path)
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    assert "fetching the dataset file inside aeon==1.6.0's wheel" in fetched.stderr
    assert [p.name for p in (tmp_path / "cache" / "fastlayers" / "data").iterdir()] == ["aeon-1.6.0-py3-none-any.whl"]
    assert "test: loss" in fetched.stdout and (tmp_path / "run" / "summary.json").is_file()
    again = _run([*train, "--out", "run2"], env, tmp_path)  # the cached wheel: no second download
    assert again.returncode == 0 and "fetching" not in again.stderr, again.stderr[-3000:]

    # ONNX: the wheel's onnx extra, then torch.onnx.export as it is (no table passed), run in ONNX Runtime
    proc = _run([*pip, "--no-compile", f"{wheel}[onnx]"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run([py, "-c", _ONNX], env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    onnx_result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert onnx_result["compilers"] == [] and onnx_result["error"] <= 1e-5, onnx_result
