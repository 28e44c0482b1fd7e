"""Running the documentation's python blocks, each as a reader runs it: its text alone as the main
script of a fresh process, in an empty working directory (tests/test_docs.py).

A fresh ``python block.py`` pays torch's import (about 3 s here) before the block's first line;
the pages hold about twenty blocks. So the processes are forked from one server process that has
imported torch and fastlayers and done nothing else (``multiprocessing``'s forkserver with those
modules preloaded, started with the reader's environment): every block still gets a new process
with a new ``__main__``, none sees another's state, and each skips the import.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import traceback
from pathlib import Path

_CONTEXT = None


def _run(script: str, out: str) -> None:
    """In the forked process: stdout and stderr into ``out``, the block as ``__main__``."""
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(Path(script).parent)
    sys.argv = [script]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_block(script: Path, timeout: float) -> tuple[int | None, str]:
    """Run ``script`` (in its own folder) in a process forked from the preloaded server: (exit code,
    None after ``timeout`` seconds; its output)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "fastlayers", "docs_blocks"])
        # the reader's environment: not the interpreter setting tests/conftest.py adds for the test process
        saved = os.environ.pop("TRITON_INTERPRET", None)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            if saved is not None:
                os.environ["TRITON_INTERPRET"] = saved
    out = script.with_suffix(".out")
    proc = _CONTEXT.Process(target=_run, args=(str(script), str(out)))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return None, out.read_text(errors="replace")
    return proc.exitcode, out.read_text(errors="replace")
