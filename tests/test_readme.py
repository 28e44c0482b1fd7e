"""Every ```python block of README.md runs as written.

The blocks are extracted from README.md when the tests are collected (not copied here), and each
runs as a reader would run it: its text alone, as a script in a fresh Python process whose working
directory is an empty temporary folder. A block therefore defines everything it uses; a block that
cannot run that way belongs in a ```sh (or other non-python) block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
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
    assert fence is None, f"README.md: the block opened at line {start} is never closed"
    return found


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


ALL = blocks(README.read_text(encoding="utf-8"))
PYTHON = [(heading, line, code) for info, heading, line, code in ALL if info == "python"]


def test_python_blocks_found():
    assert len(PYTHON) >= 3, "README.md: expected the Quickstart, Cells and Deploy python blocks"
    # a block marked ```py or ```Python would silently not be run
    odd = [(info, line) for info, _, line, _ in ALL if info.lower().startswith("py") and info != "python"]
    assert not odd, f"README.md: mark python blocks ```python (found {odd})"


@pytest.mark.subprocess
@pytest.mark.parametrize("heading, line, code",
                         PYTHON, ids=[f"{i}-{_slug(h)}" for i, (h, _, _) in enumerate(PYTHON)])
def test_python_block_runs(heading, line, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    # the reader's environment: not the interpreter setting tests/conftest.py adds for the test process
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"README.md line {line} (under '{heading}') failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}",
                    pytrace=False)
