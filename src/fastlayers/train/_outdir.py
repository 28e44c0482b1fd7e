"""The output folder of one run: ``fastlayers train`` never mixes two runs' files in it.

A folder that holds files of a run (config, metrics, curves, summary, model, checkpoints) is
taken only to continue that run (``resume``) or to replace it (``overwrite``: its files are
removed first, and only those); anything else in the folder is left alone.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None  # type: ignore[assignment]

RUN_FILES = ("config.json", "metrics.jsonl", "curves.png", "summary.json", "model.pt")


class OutputInUse(RuntimeError):
    """``out`` holds another run and neither resume nor overwrite was asked for."""


def run_files(out: Path) -> list[Path]:
    """The files of a run in ``out`` (checkpoints included), in a fixed order."""
    files = [out / name for name in RUN_FILES if (out / name).is_file()]
    checkpoints = out / "checkpoints"
    return files + (sorted(checkpoints.glob("step-*.pt")) if checkpoints.is_dir() else [])


def check(out: Path, resume: bool, overwrite: bool, settings: dict[str, Any]) -> list[Path]:
    """The run files that ``overwrite`` will remove (none otherwise). ``settings``: the new run's
    run-defining settings (as its config.json writes them).

    Raises:
        OutputInUse: ``out`` holds a run's files and neither ``resume`` nor ``overwrite`` is set,
            or ``resume`` is set and the run there was started with other settings (or run files
            are there with neither a readable config.json nor a checkpoint to tell); the message
            names the files (or settings) and the flags. Also a folder where a run file goes, or a
            file named ``checkpoints``.
    """
    blocked = [out / name for name in RUN_FILES if (out / name).is_dir()]
    blocked += [out / "checkpoints"] if (out / "checkpoints").exists() and not (out / "checkpoints").is_dir() else []
    if blocked:  # (a run would fail on them when it first writes there, after an epoch)
        raise OutputInUse(f"--out {out}: {', '.join(str(p.relative_to(out)) for p in blocked)}: not what a run writes "
                          f"there (run files are files, checkpoints/ a folder); move it or choose another --out")
    files = run_files(out)
    if not files:
        return []
    if resume:
        try:
            theirs = json.loads((out / "config.json").read_text())
        except (OSError, ValueError):
            theirs = None
        if not isinstance(theirs, dict):
            if any(p.parent.name == "checkpoints" for p in files):
                return []  # no readable config: the checkpoints' own check decides
            raise OutputInUse(f"--resume: {out} holds run files ({_shown(out, files)}) but no readable config.json "
                              f"and no checkpoint, so nothing says which run they belong to; pass --overwrite to "
                              f"replace them, or choose another --out")
        differ = {k: (theirs.get(k), v) for k, v in settings.items() if theirs.get(k) != v}
        if differ:
            raise OutputInUse(f"--resume: the run in {out} has other settings (there vs now: {differ}); resume "
                              f"with its settings, pass --overwrite to replace it, or choose another --out")
        return []
    if not overwrite:
        raise OutputInUse(f"--out {out} holds another run ({_shown(out, files)}): pass --resume to continue it, "
                          f"--overwrite to replace it (its files are removed first), or choose another --out")
    return files


def _shown(out: Path, files: list[Path]) -> str:
    """The first few of ``files`` (in ``out``) for a message."""
    return ", ".join(str(p.relative_to(out)) for p in files[:4]) + (", ..." if len(files) > 4 else "")


def unfinished_writes(out: Path) -> list[Path]:
    """The temporary files of run files that a process killed mid-write left in ``out`` (a write
    goes to ``.NAME.<random>.tmp`` and is renamed to NAME when whole: :func:`fastlayers._core.files.write_atomic`)."""
    found = [p for name in RUN_FILES for p in out.glob(f".{name}.*.tmp")]
    checkpoints = out / "checkpoints"
    return sorted(found) + (sorted(checkpoints.glob(".step-*.pt.*.tmp")) if checkpoints.is_dir() else [])


LOCK = ".fastlayers-train.lock"


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock (an advisory ``flock`` on ``out / LOCK``, released when the process ends,
    however it ends) for a run: a second run on the same ``out`` meanwhile is refused, never mixed
    with this one. Without fcntl (not POSIX) it locks nothing.

    Raises:
        OutputInUse: another process holds the lock.
    """
    if fcntl is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    with open(out / LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputInUse(f"--out {out}: another fastlayers train run is using it (it holds {out / LOCK}); "
                              f"wait for it to end, or choose another --out") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove(files: list[Path]) -> None:
    for path in files:
        path.unlink(missing_ok=True)
