"""A new user's install: a fresh venv, torch, then a plain ``pip install`` of this checkout (no
Makefile): the layers work without the command line's extra, the command line names the extra it
needs, and after ``pip install '.[cli]'`` ``fastlayers train`` fetches its dataset on first use
into the user cache (or fails in one line, no traceback, saying how to provide it offline)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)


def test_plain_pip_install_then_the_cli_fetches_its_data(tmp_path):
    source = tmp_path / "src-copy"  # the files a source distribution holds (no build output in the checkout)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py, cli = str(venv / "bin" / "python"), str(venv / "bin" / "fastlayers")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FASTLAYERS_DATA", "FASTLAYERS_OFFLINE",
                                                            "VIRTUAL_ENV")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), FASTLAYERS_CACHE=str(tmp_path / "kernels"), OMP_NUM_THREADS="1")
    pip = [py, "-m", "pip", "install", "--quiet"]
    # torch pinned (the CPU build on disk), without compiling its thousands of modules ahead (25 of
    # its 35 s of install here; the imports below compile the few they read); this checkout as a user would
    for cmd in ([*pip, "--no-compile", "torch==2.13.0"], [*pip, str(source)]):
        proc = _run(cmd, env, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]

    # the layers alone: torch is all they need
    listed = _run([py, "-m", "pip", "list", "--format=freeze"], env, tmp_path).stdout.lower()
    assert not any(f"{name}==" in listed for name in ("tqdm", "rich", "matplotlib")), listed
    layer = _run([py, "-c", "import torch, fastlayers; y, _ = fastlayers.LSTM(3, 4, layer_norm=True)"
                            "(torch.randn(5, 2, 3), lengths=torch.tensor([5, 2])); print(tuple(y.shape))"], env, tmp_path)
    assert layer.returncode == 0 and layer.stdout.strip() == "(5, 2, 4)", layer.stderr[-3000:]
    version = _run([cli, "--version"], env, tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("fastlayers 0."), version.stderr
    no_extra = _run([cli, "train", "--dataset", "vowels"], env, tmp_path)
    assert no_extra.returncode == 1 and "Traceback" not in no_extra.stderr, no_extra.stderr[-3000:]
    assert no_extra.stderr.strip().endswith("pip install 'fastlayers[cli]'"), no_extra.stderr

    proc = _run([*pip, f"{source}[cli]"], env, tmp_path)
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
    doctor = _run([cli, "doctor"], env, tmp_path)
    assert doctor.returncode == 0 and "torch" in doctor.stdout, doctor.stderr[-3000:]
