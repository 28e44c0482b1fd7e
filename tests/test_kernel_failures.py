"""Kernels never crash a forward (issue 43, 2; issue 64): without the native library (a source
checkout that was not built), with one that does not load (built for another torch), with a forced
CPU variant that is unknown, and with each variant this CPU runs, each in a fresh process: the
layers give the reference's values and gradients (within float32 rounding: the variants differ in
FMA contraction and vector width), with at most one warning naming the reason; and
``fastlayers doctor``'s report completes."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastlayers
from fastlayers import _native

pytestmark = pytest.mark.subprocess  # other processes: the poisoned pass's settings do not reach them

HERE = Path(__file__).resolve()
UNSET = ("FASTLAYERS_BACKEND", "FASTLAYERS_NO_NATIVE", _native.ENV)  # (the children set what they test)
# the child: this file's _child() in a new process (the per-process load state starts empty there)
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


def _child(out: str, library_dir: str, preload: str = "", cdll_fails: str = "") -> None:
    import warnings

    if preload:  # a file loaded by hand before fastlayers loads its own (docs/deploy.md's serving recipe)
        torch.ops.load_library(preload)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from fastlayers import _native

        if cdll_fails:  # the operators register (torch.ops.load_library), the loader's own dlopen then fails
            import ctypes
            import types

            def refuse(path, *args, **kwargs):
                raise OSError(f"{path}: cannot open (as the test makes it)")

            _native.ctypes = types.SimpleNamespace(**{**vars(ctypes), "CDLL": refuse})
        from fastlayers._core.backend import select
        from fastlayers._native import ops_lib

        if library_dir:  # where this process looks for the library (a folder without it, or a broken one)
            _native._HERE = Path(library_dir)
        results = _forwards(no_grad=True)
        x = torch.zeros(1)
        backends = {op: select(op, x) for op in ("lstm", "gru", "local2d")}
    torch.save(results, out)
    variant = _native.built_as()
    print(json.dumps({"warnings": [str(w.message) for w in caught if "fastlayers" in str(w.message)],
                      "backends": backends, "operators": ops_lib.load(), "variant": variant}))


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    with fastlayers.backend("reference"):
        return _forwards(no_grad=True)


def _run(tmp_path: Path, library_dir: Path | None = None, preload: Path | None = None, cdll_fails: bool = False,
         **env: str) -> dict:
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}.pt"
    environ = {k: v for k, v in os.environ.items() if k not in UNSET}
    environ.update(OMP_NUM_THREADS=str(torch.get_num_threads()), **env)
    args = [str(out), str(library_dir or ""), str(preload or ""), "1" if cdll_fails else ""]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(HERE), *args],
                          capture_output=True, text=True, env=environ, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["results"] = torch.load(out, weights_only=True)
    return report


def _same(results: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    for name, value in results.items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_missing_library_warns_once_and_runs_the_reference(tmp_path, reference):
    run = _run(tmp_path, library_dir=tmp_path / "empty")
    assert run["backends"] == {"lstm": "reference", "gru": "reference", "local2d": "reference"}
    assert len(run["warnings"]) == 1 and "no native library" in run["warnings"][0], run["warnings"]
    assert "pip install -e . --no-build-isolation" in run["warnings"][0]
    assert run["operators"] is False and run["variant"] is None
    _same(run["results"], reference)


def test_library_that_does_not_load_warns_once(tmp_path, reference):
    """A file of the library's name that dlopen refuses (as one built for another torch, whose
    symbols are missing): one warning naming the file and the reason, the pure-PyTorch path."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for variant in _native.VARIANTS:
        shutil.copy(shutil.which("true"), broken / f"_C_{variant}.so")
    run = _run(tmp_path, library_dir=broken)
    assert len(run["warnings"]) == 1, run["warnings"]
    assert "does not load" in run["warnings"][0] and str(broken) in run["warnings"][0], run["warnings"]
    assert run["backends"] == {"lstm": "reference", "gru": "reference", "local2d": "reference"}
    assert run["operators"] is False
    _same(run["results"], reference)


@pytest.mark.parametrize("damage", ["not a library", "a dangling link"])
def test_a_variant_that_does_not_load_falls_to_the_next_one_down(tmp_path, reference, damage):
    """The best variant's file damaged (another file in its place, or a dangling link, whose torch
    record's read raised FileNotFoundError from every layer call), the others as built: one warning
    naming the file, the next variant down loaded (its C kernels and operators on), the reference's
    results."""
    runnable = _runnable()
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs one variant only ({runnable})")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for variant, path in _native.built().items():
        shutil.copy(path, mixed / path.name)
    best = mixed / _native.built()[runnable[-1]].name
    best.unlink()
    if damage == "not a library":
        shutil.copy(shutil.which("true"), best)
    else:
        best.symlink_to(tmp_path / "nowhere.so")
    run = _run(tmp_path, library_dir=mixed)
    assert len(run["warnings"]) == 1, run["warnings"]
    assert "does not load" in run["warnings"][0] and f"loaded the {runnable[-2]} variant" in run["warnings"][0]
    assert run["variant"] == runnable[-2] and run["operators"] is True
    assert run["backends"] == {"lstm": "cpu", "gru": "cpu", "local2d": "cpu"}
    _same(run["results"], reference)


@pytest.mark.subprocess
def test_operators_whose_python_half_fails_to_register_are_reported_as_unavailable():
    """A family's registration (fake function, autograd) failing: load() warned that torch.export
    uses the plain-PyTorch path, while unavailable_reason() said '' and export then failed inside
    torch on an operator without a fake. Now the reason reaches the export's error."""
    script = """
import warnings, torch
from fastlayers._native import ops_lib
import fastlayers

def broken():
    raise RuntimeError("simulated: register_fake failed")

ops_lib._REGISTER.insert(0, broken)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert ops_lib.load() is False
assert any("torch.export of a recurrent layer" in str(w.message) for w in caught), [str(w.message) for w in caught]
assert "simulated: register_fake failed" in ops_lib.unavailable_reason()
try:
    torch.export.export(fastlayers.LSTM(3, 4, layer_norm=True).eval(), (torch.randn(5, 2, 3),))
except RuntimeError as e:
    assert "simulated: register_fake failed" in str(e), e
else:
    raise AssertionError("exported")
print("ok")
"""
    environ = {k: v for k, v in os.environ.items() if k not in UNSET}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**environ, "PYTHONPATH": str(Path(fastlayers.__file__).parents[1])})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_library_built_against_another_torch_is_not_loaded(tmp_path, reference):
    """The libraries as built, their record of the torch they were built against changed to another
    release (2.99): not loaded (loading would register the operators with this torch, whose C++ ABI
    differs; dlopen alone may well succeed), one warning naming both versions, the pure-PyTorch path."""
    other = tmp_path / "other"
    other.mkdir()
    marker = b"fastlayers-torch-version:"
    built = torch.__version__.split("+")[0].encode()
    for variant, path in _native.built().items():
        data = path.read_bytes()
        assert data.count(marker + built + b"\0") == 1, variant
        fake = b"2.99." + b"9" * (len(built) - len(b"2.99."))
        (other / path.name).write_bytes(data.replace(marker + built + b"\0", marker + fake + b"\0"))
        assert _native.built_against(other / path.name) == fake.decode()
    run = _run(tmp_path, library_dir=other)
    assert len(run["warnings"]) == 1, run["warnings"]
    assert f"was built against torch {fake.decode()}, and this is torch {built.decode()}" in run["warnings"][0]
    assert run["backends"] == {"lstm": "reference", "gru": "reference", "local2d": "reference"}
    assert run["operators"] is False
    _same(run["results"], reference)


def test_a_variant_loaded_by_hand_first_is_used_not_aborted(tmp_path, reference):
    """A process that loaded a variant's file itself (torch.ops.load_library, as docs/deploy.md's
    serving process does) before fastlayers loads: fastlayers loaded its own choice beside it, a
    second registration of the operators, and the process aborted (SIGABRT: "Only a single
    TORCH_LIBRARY can be used to register the namespace fastlayers"). Now the file loaded (or a copy
    of it elsewhere) is used, with one warning where it is not the variant fastlayers would load."""
    runnable = _runnable()
    lower = runnable[-2] if len(runnable) > 1 else runnable[-1]
    run = _run(tmp_path, preload=_native.built()[lower])
    assert run["variant"] == lower and run["operators"] is True, run
    assert run["backends"] == {"lstm": "cpu", "gru": "cpu", "local2d": "cpu"}
    assert len(run["warnings"]) == (lower != runnable[-1]), run["warnings"]
    assert all(f"loaded the {lower} variant of the native library before fastlayers did" in w for w in run["warnings"])
    _same(run["results"], reference)
    copy = tmp_path / "served" / _native.built()[runnable[-1]].name
    copy.parent.mkdir()
    shutil.copy(_native.built()[runnable[-1]], copy)
    run = _run(tmp_path, preload=copy)
    assert run["warnings"] == [] and run["variant"] == runnable[-1] and run["operators"] is True, run
    _same(run["results"], reference)


def test_another_library_holding_the_operators_is_not_loaded_beside(tmp_path, reference):
    """A file that registered torch.ops.fastlayers and is none of this build's (another build's
    library): nothing of ours loads beside it (that aborted the process), one warning naming it, the
    pure-PyTorch path."""
    best = _native.built()[_runnable()[-1]]
    other = tmp_path / "other" / best.name
    other.parent.mkdir()
    other.write_bytes(best.read_bytes() + b"another build")  # (still a library that loads: other bytes)
    run = _run(tmp_path, preload=other)
    assert len(run["warnings"]) == 1 and "already registered in this process by" in run["warnings"][0], run
    assert str(other) in run["warnings"][0] and "not a file of this fastlayers build" in run["warnings"][0]
    assert run["backends"] == {"lstm": "reference", "gru": "reference", "local2d": "reference"}
    assert run["operators"] is False and run["variant"] is None
    _same(run["results"], reference)


def test_a_registered_variant_that_fails_its_dlopen_stops_there(tmp_path, reference):
    """The operators of the chosen variant registered, then the loader's own dlopen of the file
    failed: it went on to the next variant down, whose registration aborted the process. Now one
    warning, the pure-PyTorch path for the C kernels."""
    run = _run(tmp_path, cdll_fails=True)
    assert len(run["warnings"]) == 1 and "cannot open (as the test makes it)" in run["warnings"][0], run
    assert "loaded the" not in run["warnings"][0]
    assert run["backends"] == {"lstm": "reference", "gru": "reference", "local2d": "reference"}
    _same(run["results"], reference)


@pytest.mark.parametrize("value, on", [("0", True), ("false", True), ("", True), ("1", False), ("yes", False)])
def test_the_switch_reads_its_value(tmp_path, reference, value, on):
    """FASTLAYERS_NO_NATIVE=0 (or false, or empty) leaves the library on (any value switched it off)."""
    run = _run(tmp_path, FASTLAYERS_NO_NATIVE=value)
    assert run["warnings"] == []
    assert run["backends"] == ({"lstm": "cpu", "gru": "cpu", "local2d": "cpu"} if on else
                               {"lstm": "reference", "gru": "reference", "local2d": "reference"})
    _same(run["results"], reference)


def test_unknown_forced_variant_warns_and_loads_the_best(tmp_path, reference):
    best = _native.choose()[0]
    run = _run(tmp_path, **{_native.ENV: "avx9000"})
    assert len(run["warnings"]) == 1 and "avx9000" in run["warnings"][0], run["warnings"]
    assert run["variant"] == best and run["backends"] == {"lstm": "cpu", "gru": "cpu", "local2d": "cpu"}
    _same(run["results"], reference)


def _runnable() -> list[str]:
    best = _native.cpu_capability()
    return [v for v in _native.VARIANTS[:_native.VARIANTS.index(best) + 1] if v in _native.built()]


def test_every_variant_this_cpu_runs_gives_the_same_results(tmp_path, reference):
    """Each variant forced in turn (FASTLAYERS_CPU_CAPABILITY): no warning, that variant's file
    loaded (it says so itself), the C kernels and the C++ operators on, values and gradients equal
    to the reference and to each other within float32 rounding."""
    variants = _runnable()
    assert variants[0] == "default" and len(variants) >= 2, variants  # (x86-64 CPUs all run avx2 here)
    runs = {}
    for variant in variants:
        run = _run(tmp_path, **{_native.ENV: variant})
        assert run["warnings"] == [] and run["variant"] == variant, run
        assert run["operators"] is True and run["backends"] == {"lstm": "cpu", "gru": "cpu", "local2d": "cpu"}
        _same(run["results"], reference)
        runs[variant] = run["results"]
    for variant in variants[1:]:
        for name, value in runs[variant].items():
            torch.testing.assert_close(value, runs["default"][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{variant} vs default, {name}: {m}")  # noqa: B023


SECTIONS = ("fastlayers:", "Python:", "torch:", "numpy:", "Triton:", "OS:", "CPU:", "CPU features:",
            "Native library:", "C++ operators:", "CUDA:", "Backends:")


def test_doctor_report_completes_without_the_library(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    code = ("from pathlib import Path; from fastlayers import _native, _doctor; "
            f"_native._HERE = Path({str(tmp_path)!r}); print(_doctor.report())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for section in SECTIONS:
        assert any(line.startswith(section) for line in lines), (section, proc.stdout)
    assert "fastlayers:" not in proc.stderr  # the probes' warnings are in the report, not printed
    text = proc.stdout
    assert "Native library: unavailable: no native library" in text
    assert "LSTM, LSTMCell (lstm): CPU float32: reference" in text


def test_doctor_version_and_report_here():
    from fastlayers import _doctor

    assert _doctor.version() == importlib.metadata.version("fastlayers")
    text = _doctor.report(load=False)
    for section in SECTIONS:
        assert f"\n{section}" in f"\n{text}", section
    assert f"fastlayers: {_doctor.version()}" in text
    variant = _native.choose()[0]
    assert f"Native library: would load {variant}" in text


def test_python_dash_m_fastlayers_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "fastlayers", "--version"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(fastlayers.__file__).parents[1])})
    assert proc.returncode == 0 and proc.stdout.strip().endswith(importlib.metadata.version("fastlayers")), proc


@pytest.mark.subprocess
def test_doctor_reports_the_loaders_warnings():
    """The library's and operators' probes recorded their warnings and dropped them: the report
    said nothing of a bad setting, and warn_once then kept every later call silent too."""
    environ = {k: v for k, v in os.environ.items() if k not in UNSET}
    proc = subprocess.run([sys.executable, "-m", "fastlayers", "doctor"], capture_output=True, text=True, timeout=300,
                          env={**environ, "FASTLAYERS_LARGE_PRODUCTS": "bogus",
                               "PYTHONPATH": str(Path(fastlayers.__file__).parents[1])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings_section = proc.stdout.split("\nWarnings:\n", 1)
    assert len(warnings_section) == 2 and "FASTLAYERS_LARGE_PRODUCTS='bogus'" in warnings_section[1], proc.stdout
