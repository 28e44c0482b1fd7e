"""Kernels never crash a forward (issue 43, 2): a missing or failing compiler, a compiler command
with arguments, an unwritable cache and damaged cached libraries, each in a fresh process with a
fresh cache: the layers give the reference's values and gradients, with at most one warning per
library naming the reason; and ``fastlayers doctor``'s report completes."""

import importlib.metadata
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastlayers

pytestmark = pytest.mark.subprocess  # other processes: the poisoned pass's settings do not reach them

HERE = Path(__file__).resolve()
UNSET = ("FASTLAYERS_BACKEND", "FASTLAYERS_NO_NATIVE", "CC", "CXX")  # (the children set what they test)
# the child: this file's _child() in a new process (the per-process load caches start empty there)
CHILD = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('kf', sys.argv[1]); "
         "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m._child(*sys.argv[2:])")


def _forwards(no_grad: bool) -> dict[str, torch.Tensor]:
    """The calls under test (the same in the child and in the parent's reference run): LayerNorm-LSTM,
    plain LSTM with lengths, LayerNorm-GRU, LocallyConnected2d; values and input gradients, and
    optionally the same calls without autograd (the C++ operators' path where they load)."""
    torch.manual_seed(0)
    ln = fastlayers.LSTM(4, 5, layer_norm=True)
    plain = fastlayers.LSTM(4, 5, bidirectional=True)
    gru = fastlayers.GRU(4, 5, layer_norm=True)
    local = fastlayers.LocallyConnected2d(2, 3, (6, 6), 3, padding=1)
    x = torch.randn(6, 3, 4)
    lengths = torch.tensor([6, 2, 4])
    image = torch.randn(2, 2, 6, 6)
    calls = {"lstm_ln": lambda x, _: ln(x)[0], "lstm_lengths": lambda x, _: plain(x, lengths=lengths)[0],
             "gru_ln": lambda x, _: gru(x)[0], "local": lambda _, image: local(image)}
    out = {}
    for name, call in calls.items():
        xi, im = x.clone().requires_grad_(), image.clone().requires_grad_()
        y = call(xi, im)
        out[name] = y.detach()
        out[name + "_grad"] = torch.autograd.grad(y.square().sum(), im if name == "local" else xi)[0]
        if no_grad:
            with torch.no_grad():
                out[name + "_no_grad"] = call(x, image)
    return out


def _child(out: str, no_grad: str, corrupt_operators: str) -> None:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from fastlayers import _native
        from fastlayers._native import ops_lib
        from fastlayers._core.backend import select

        if corrupt_operators:  # the C++ library's cached file: an ELF file that dlopen refuses
            filename, _ = ops_lib._spec()
            _native.cache_dir().mkdir(parents=True, exist_ok=True)
            shutil.copy(shutil.which("true"), _native.cache_dir() / filename)
        results = _forwards(no_grad == "1")
        x = torch.zeros(1)
        backends = {op: select(op, x) for op in ("lstm", "gru", "local2d")}
    torch.save(results, out)
    private = _native.private_cache_dir()
    print(json.dumps({"warnings": [str(w.message) for w in caught if "fastlayers" in str(w.message)],
                      "backends": backends, "private": str(private) if private else None,
                      "operators": ops_lib._STATE.get("loaded")}))


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    with fastlayers.backend("reference"):
        return _forwards(no_grad=True)


def _run(tmp_path: Path, *, cache: Path | None = None, no_grad: bool = False, corrupt_operators: bool = False,
         **env: str) -> dict:
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.pt"
    environ = {k: v for k, v in os.environ.items() if k not in UNSET}
    environ.update(FASTLAYERS_CACHE=str(cache or tmp_path / "cache"), OMP_NUM_THREADS=str(torch.get_num_threads()),
                   **env)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(HERE), str(out), "1" if no_grad else "",
                           "1" if corrupt_operators else ""], capture_output=True, text=True, env=environ, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["results"] = torch.load(out, weights_only=True)
    return report


def _same(results: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    for name, value in results.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_missing_compiler_warns_once_and_runs_the_reference(tmp_path, reference):
    run = _run(tmp_path, no_grad=True, CC="/nonexistent")
    assert run["backends"] == {"lstm": "reference", "gru": "reference", "local2d": "reference"}
    assert len(run["warnings"]) == 1 and "/nonexistent" in run["warnings"][0], run["warnings"]
    _same(run["results"], reference)


def test_compiler_command_with_arguments(tmp_path, reference):
    """CC holds a launcher with arguments (as "ccache gcc"), here a quoted path with a space."""
    log = tmp_path / "calls.log"
    wrapper = _script(tmp_path / "my tools" / "cc-wrapper",
                      f'[ "$1" = "--some-arg" ] || exit 3\nshift\necho "$@" >> "{log}"\nexec gcc "$@"\n')
    run = _run(tmp_path, CC=f"'{wrapper}' --some-arg")
    assert run["warnings"] == []
    assert run["backends"] == {"lstm": "cpu", "gru": "cpu", "local2d": "cpu"}  # the C kernels, built by the wrapper
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and all("-march=native" in c for c in calls), calls
    _same(run["results"], reference)


def test_failing_compiler_warns_once_per_library(tmp_path, reference):
    failing = _script(tmp_path / "bin" / "cc", 'echo "simulated compiler failure" >&2\nexit 1\n')
    run = _run(tmp_path, no_grad=True, CC=str(failing))
    assert run["backends"] == {"lstm": "reference", "gru": "reference", "local2d": "reference"}
    assert len(run["warnings"]) == 3, run["warnings"]  # one for each C library (lstm, gru, local)
    for library, message in zip(("lstm", "gru", "local"), run["warnings"]):
        assert f"C kernels {library!r} failed" in message and "simulated compiler failure" in message, message
    _same(run["results"], reference)


def test_unwritable_cache_builds_into_a_private_cache(tmp_path, reference):
    """A cache folder that cannot be created (it lies under a regular file: as root, a read-only
    mode would not stop the writes): one warning, the kernels and the C++ operator library built
    into a private temporary cache, removed at exit."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    run = _run(tmp_path, cache=blocker / "cache", no_grad=True)
    assert len(run["warnings"]) == 1, run["warnings"]
    assert str(blocker / "cache") in run["warnings"][0] and "private temporary cache" in run["warnings"][0]
    assert run["backends"] == {"lstm": "cpu", "gru": "cpu", "local2d": "cpu"}
    assert run["operators"] is True  # the calls without autograd ran on the C++ operators
    assert run["private"] is not None and not Path(run["private"]).exists()
    _same(run["results"], reference)


def test_damaged_cached_libraries_are_rebuilt(tmp_path, reference):
    from fastlayers import _native

    cache = tmp_path / "cache"
    first = _run(tmp_path)
    assert first["warnings"] == [] and first["backends"]["lstm"] == "cpu"
    files = {p.name.split("-")[0]: p for p in cache.glob("*.so")}
    assert sorted(files) == ["gru", "local", "lstm"]
    files["lstm"].write_bytes(os.urandom(3000))  # garbage
    data = files["local"].read_bytes()
    files["local"].write_bytes(data[: len(data) // 2])  # truncated: dlopen would map it and die of SIGBUS
    shutil.copyfile(shutil.which("true"), files["gru"])  # an ELF file that dlopen refuses (OSError)
    inodes = {name: path.stat().st_ino for name, path in files.items()}
    run = _run(tmp_path)
    assert len(run["warnings"]) == 3, run["warnings"]
    reasons = {"lstm": "not an ELF file", "gru": "does not load", "local": "truncated"}
    for library, message in zip(("lstm", "gru", "local"), run["warnings"]):
        assert f"C library {library!r}" in message and reasons[library] in message and "rebuilt" in message, message
    assert run["backends"] == {"lstm": "cpu", "gru": "cpu", "local2d": "cpu"}
    for name, path in files.items():  # a new file moved onto the name, not the old one rewritten
        assert path.stat().st_ino != inodes[name] and _native.damaged(path) is None
    _same(run["results"], reference)
    assert _run(tmp_path)["warnings"] == []  # the next process loads the rebuilt files


def test_damaged_operator_library_that_cannot_be_rebuilt(tmp_path, reference):
    """The C++ library's cached file does not load and the C++ compiler fails: one warning; the
    calls without autograd keep the C kernels through their autograd path."""
    failing = _script(tmp_path / "bin" / "c++", 'echo "simulated C++ failure" >&2\nexit 1\n')
    run = _run(tmp_path, no_grad=True, corrupt_operators=True, CXX=str(failing))
    assert len(run["warnings"]) == 1, run["warnings"]
    message = run["warnings"][0]
    assert "C++ operator library" in message and "does not load" in message and "simulated C++ failure" in message
    assert run["operators"] is False and run["backends"] == {"lstm": "cpu", "gru": "cpu", "local2d": "cpu"}
    _same(run["results"], reference)


SECTIONS = ("fastlayers:", "Python:", "torch:", "numpy:", "Triton:", "OS:", "CPU:", "CPU features:", "C compiler:",
            "C++ compiler:", "Cache:", "C kernels:", "C++ operator library:", "CUDA:", "Backends:")


def test_doctor_report_completes_without_a_compiler(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(CC="/nonexistent", FASTLAYERS_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", "from fastlayers import _doctor; print(_doctor.report())"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for section in SECTIONS:
        assert any(line.startswith(section) for line in lines), (section, proc.stdout)
    assert "fastlayers:" not in proc.stderr  # the probes' warnings are in the report, not printed
    text = proc.stdout
    assert "$CC='/nonexistent': not usable" in text and "lstm: NOT available: no working C compiler" in text
    assert "LSTM, LSTMCell (lstm): CPU float32: reference" in text


def test_doctor_version_and_report_here():
    from fastlayers import _doctor

    assert _doctor.version() == importlib.metadata.version("fastlayers")
    text = _doctor.report(build=False)
    for section in SECTIONS:
        assert f"\n{section}" in f"\n{text}", section
    assert f"fastlayers: {_doctor.version()}" in text
