"""Sphinx configuration of fastlayers' documentation: ``make docs`` builds it into build/docs
(strict: ``sphinx-build -W --keep-going``; a warning fails the build)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the checkout's package (an editable install finds the same)

import fastlayers  # noqa: E402

project = "fastlayers"
author = "the fastlayers authors"
copyright = "2026, the fastlayers authors"
release = version = fastlayers.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # [text](page.md#a-heading) links, checked by the build

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "pydata_sphinx_theme"
html_title = f"fastlayers {release}"
html_theme_options = {"navigation_with_keys": False, "show_toc_level": 2}
html_static_path: list[str] = []
