"""Every ```python block of README.md and of the documentation's pages (docs/*.md) runs as
written, and every public name has a docstring and an entry in the API reference (docs/api.rst).

The blocks are extracted from the pages when the tests are collected (not copied here), and each
runs as a reader would run it: its text alone, as the main script of a fresh Python process whose
working directory is an empty temporary folder (forked from a process that has imported torch and
fastlayers and nothing else: tests/docs_blocks.py). A block therefore defines everything it uses;
a block that cannot run that way belongs in a ```sh (or other non-python) block.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from docs_blocks import run_block

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")


def blocks(text: str) -> list[tuple[str, str, int, str]]:
    """(info string, heading, line number, code) of every fenced block, in order."""
    found, heading, fence, start, lines = [], "(top)", None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence, info, start, lines = match.group(1), match.group(2), number, []
            elif re.match(r"#{1,6}\s", line):
                heading = line.lstrip("#").strip()
        elif match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) and not match.group(2):
            found.append((info, heading, start, "\n".join(lines) + "\n"))
            fence = None
        else:
            lines.append(line)
    assert fence is None, f"the block opened at line {start} is never closed"
    return found


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


ALL = [(page.relative_to(ROOT).as_posix(), *block) for page in PAGES for block in blocks(page.read_text(encoding="utf-8"))]
PYTHON = [(page, heading, line, code) for page, info, heading, line, code in ALL if info == "python"]


def test_python_blocks_found():
    pages = {page for page, *_ in PYTHON}
    assert {"README.md", "docs/getting-started.md", "docs/recurrent.md", "docs/deploy.md"} <= pages, pages
    # a block marked ```py or ```Python would silently not be run
    odd = [(page, info, line) for page, info, _, line, _ in ALL if info.lower().startswith("py") and info != "python"]
    assert not odd, f"mark python blocks ```python (found {odd})"


@pytest.mark.subprocess
@pytest.mark.parametrize("page, heading, line, code", PYTHON,
                         ids=[f"{_slug(p.removesuffix('.md'))}-{line}" for p, _, line, _ in PYTHON])
def test_python_block_runs(page, heading, line, code, tmp_path):
    folder = tmp_path / "cwd"  # empty but for the block
    folder.mkdir()
    script = folder / "block.py"
    script.write_text(code, encoding="utf-8")
    status, output = run_block(script, timeout=600)
    if status != 0:
        why = "ran out of time (600 s)" if status is None else f"failed (exit status {status})"
        pytest.fail(f"{page} line {line} (under '{heading}') {why}:\n{output[-6000:]}", pytrace=False)


def _public_names() -> dict[str, object]:
    import fastlayers
    import fastlayers.bench
    import fastlayers.data
    import fastlayers.functional
    import fastlayers.onnx
    import fastlayers.train

    return {f"{module.__name__}.{name}": getattr(module, name)
            for module in (fastlayers, fastlayers.functional, fastlayers.onnx, fastlayers.bench, fastlayers.data,
                           fastlayers.train) for name in module.__all__}


def test_every_public_name_has_a_docstring_and_an_api_entry():
    """A public name (in a module's __all__) without a docstring or an entry in docs/api.rst fails
    here; so does an entry for a name that is not public. Data (``__version__``, ``WORKLOADS``) have
    their entry's text instead of a docstring."""
    api = (ROOT / "docs" / "api.rst").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\.\. (?:auto(?:class|function|exception)|data):: (\S+)", api, re.M))
    names = _public_names()
    aliases = {"fastlayers.functional.attention_pool": "fastlayers.attention_pool"}  # the same function
    wanted = {aliases.get(n, n) for n in names}
    assert wanted - documented == set(), f"public names missing from docs/api.rst: {sorted(wanted - documented)}"
    assert documented - wanted == set(), f"docs/api.rst documents names that are not public: {sorted(documented - wanted)}"
    assert names["fastlayers.functional.attention_pool"] is names["fastlayers.attention_pool"]
    data = {"fastlayers.__version__", "fastlayers.bench.WORKLOADS", "fastlayers.data.SpokenDigits"}
    missing = [n for n, obj in names.items() if n not in data and not (getattr(obj, "__doc__", None) or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"
    # the methods the API page lists (its :members: options) have docstrings too
    listed = re.findall(r"^\.\. autoclass:: (\S+)\n   :members: ([\w, ]+)$", api, re.M)
    assert listed, "docs/api.rst: expected autoclass entries with :members:"
    undocumented = [f"{cls}.{m}" for cls, members in listed for m in members.split(", ")
                    if not (getattr(getattr(names[cls], m, None), "__doc__", None) or "").strip()]
    assert not undocumented, f"methods listed in docs/api.rst without a docstring: {undocumented}"
