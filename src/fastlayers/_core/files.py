"""Files written whole or not at all: a crash or an error mid-write never leaves a partial file
where the user's file was (checkpoints, metrics, reports, plots)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable


def write_atomic(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Create or replace ``path`` with what ``write`` writes to a binary file: into a temporary file
    in the same directory, flushed and fsync'ed, renamed over ``path``, then the directory fsync'ed;
    on any error the temporary file is removed and ``path`` is left as it was."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would hide a shared run folder's files
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _umask() -> int:
    """The process's umask: from /proc/self/status on Linux (read-only), else read back by setting
    it (the os module offers no getter; setting it races with files other threads create meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
