"""Checkpoints that survive interruption: written atomically, validated on load, the last few kept.

A checkpoint is one ``torch.save`` file ``checkpoints/step-{global_step:08d}.pt`` holding the
model, optimizer and LR-scheduler states, every RNG state (torch, CUDA, numpy, python), the
position in the data (epoch, step in epoch; the sample order is a function of the seed and the
epoch) and the metrics so far. Only tensors, numbers, strings, lists and dicts: it loads with
``torch.load(weights_only=True)``.

Writing: to a temporary file in the same directory, flushed and fsync'ed, given the permissions
of any file the user creates (0666 less the umask), then renamed over the final name (atomic on
POSIX) and the directory fsync'ed; older checkpoints are deleted only after that, so a crash at
any moment leaves every checkpoint file either complete or absent. Pruning removes only the
checkpoints the run itself wrote (their names travel in the checkpoints, so a resumed run prunes
its own earlier ones and never another run's).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._core.files import write_atomic

FORMAT = "fastlayers-train-checkpoint/1"


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used (truncated, corrupt, or from a different run), or
    cannot be written."""


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(map(listify, random.getstate())),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def listify(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step-{step:08d}.pt"


def save_checkpoint(directory: Path, step: int, payload: dict[str, Any], keep: int, ours: list[str]) -> Path:
    """Add the file name of ``step``'s checkpoint to ``ours`` (the names this run wrote, oldest
    first: the list the payload carries, so the checkpoint itself lists it), write ``payload``
    atomically as that checkpoint, then delete all but the newest ``keep`` of ``ours``: never a
    file the run did not write.

    Raises:
        CheckpointError: the file could not be written (a full disk, an I/O error); nothing is
            deleted then, and ``ours`` is as it was.
    """
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, step)
    before = list(ours)
    if final.name in ours:
        ours.remove(final.name)
    ours.append(final.name)
    try:
        write_atomic(final, lambda f: torch.save({"format": FORMAT, **payload}, f))
    except (OSError, RuntimeError) as e:  # a full disk: torch's writer raises RuntimeError ("unexpected pos")
        ours[:] = before
        kept = ", ".join(n for n in ours if (directory / n).is_file()) or "none"
        raise CheckpointError(f"{final}: could not be written ({type(e).__name__}: {str(e).splitlines()[0][:200]}; "
                              f"a full disk?); the earlier checkpoints are kept ({kept}): free space, then "
                              f"--resume") from e
    for name in ours[:-keep]:
        (directory / name).unlink(missing_ok=True)
    del ours[:-keep]
    return final


def list_checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (temporary files of an interrupted write excluded)."""
    return sorted(directory.glob("step-*.pt")) if directory.is_dir() else []


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load and check one checkpoint file.

    Raises:
        CheckpointError: the file is missing, truncated, not a checkpoint of ``fastlayers train``,
            or lacks a part; the message names the file.
    """
    path = Path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file") from None
    except MemoryError:  # (not the file's fault: resuming from an older one would later overwrite it)
        raise
    except Exception as e:  # truncated zip, bad pickle, ...
        raise CheckpointError(f"{path}: not a loadable checkpoint, truncated or corrupt ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]})") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a fastlayers train checkpoint (expected format {FORMAT!r}, got "
                              f"{payload.get('format') if isinstance(payload, dict) else type(payload).__name__!r})")
    missing = [k for k in ("config", "model", "optimizer", "scheduler", "rng", "progress") if k not in payload]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {missing}")
    return payload


def load_latest(directory: Path, warn=print) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` that loads; a newer one that does not is reported
    through ``warn`` (naming the file and why) and skipped. None when there is none at all.

    Raises:
        CheckpointError: checkpoint files exist but none of them loads.
    """
    errors = []
    for path in reversed(list_checkpoints(directory)):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as e:
            errors.append(str(e))
            warn(f"warning: {e}; trying the previous checkpoint")
    if errors:
        raise CheckpointError("no checkpoint in " + str(directory) + " loads: " + "; ".join(errors))
    return None
