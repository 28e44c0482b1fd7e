"""``fastlayers bench``: run a seed workload through the verified comparison harness."""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from .._core.files import write_atomic
from ._harness import Report, _summarise_flags, compare
from ._plot import FORMATS, plot_format
from ._workloads import WORKLOADS

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``fastlayers bench``, each help saying its default."""
    parser.add_argument("workload", nargs="?", choices=sorted(WORKLOADS), help="which seed workload to run")
    parser.add_argument("--list", action="store_true", help="name the workloads and exit")
    parser.add_argument("--size", choices=["small", "seed", "seed-large"], default="seed",
                        help="small: seconds (tests); seed: the full shapes of the user reports, minutes per "
                             "workload on a CPU; seed-large: local2d with seed 003's example batch of 1024 "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="the inputs' and candidates' precision (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed measurements per candidate (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds first, more until the times settle; 0: none (default: %(default)s)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON (default: none)")
    parser.add_argument("--plot", metavar="FILE",
                        help=f"write a bar chart (matplotlib), in the format its suffix names: "
                             f"{', '.join('.' + f for f in FORMATS)}; PNG without one (default: none)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing --json / --plot files (without "
                                                                  "it an existing file is refused before measuring, "
                                                                  "and one made during the run is not replaced)")


def run(args: argparse.Namespace) -> int:
    """Measure, print the table and notes, write the files asked for. Exit status 1 when a
    candidate fails its check (a flag of ``_harness.FAILURES`` its workload does not expect) or a
    file could not be written (one line each on stderr, after the table), else 0."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console() if Console().is_terminal else Console(width=200)  # files and pipes: no truncation
    if args.list or not args.workload:
        for name, make in sorted(WORKLOADS.items()):
            console.print(f"{name:10s} {_about(make)}", markup=False, highlight=False)
        return 0
    _check(args)
    workload = WORKLOADS[args.workload](args.size, dtype=DTYPES[args.dtype], device=args.device)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task(workload.name, total=None)
        report = compare(
            workload.candidates,
            workload.make_inputs,
            reference=workload.reference,
            repeats=args.repeats,
            warmup=args.warmup,
            memory=not args.no_memory,
            workload=workload.name,
            anchor=workload.anchor,
            expected=workload.expected,
            progress=lambda msg: progress.update(task, description=f"{args.workload}: {msg}"),
        )
    report.notes.extend(workload.notes)
    console.print(report.table())  # first: a file that cannot be written below loses no measurement
    for note in report.notes:
        console.print(f"note: {note}")
    console.print(f"reference: {report.reference}; CPU: {report.cpu}")
    errors = _save(args, report)
    failed = [f"{r.name}: {_summarise_flags(unexpected)}" for r in report.results
              if (unexpected := report.failed(r))]
    if failed:
        errors.insert(0, f"fastlayers bench: check failed (values or gradients differ from the reference): "
                         f"{'; '.join(failed)}")
    for line in errors:
        print(line, file=sys.stderr)
    return 1 if errors else 0


def _about(make: Callable[..., Any]) -> str:
    """A workload's description for ``--list``: the first paragraph of its docstring, whole, on one line."""
    return " ".join((make.__doc__ or "").strip().split("\n\n")[0].replace("``", "").split())


def _save(args: argparse.Namespace, report: Report) -> list[str]:
    """Write the --json and --plot files; return one error line for each that could not be
    written (an OSError: no folder, no space, no permission) or was made by someone else during
    the run (without --overwrite it is not replaced; the file is left beside it)."""
    files: list[tuple[str, str, Callable[[], bytes]]] = []
    if args.json:
        files.append(("--json", args.json, lambda: report.to_json().encode()))
    if args.plot:
        from ._plot import plot_format, render_plot

        files.append(("--plot", args.plot, lambda: render_plot(report, plot_format(args.plot))))
    errors = []
    for option, name, content in files:
        try:
            data = content()
            left = _write_file(Path(name), lambda f: f.write(data), args.overwrite)
        except OSError as e:
            errors.append(f"fastlayers bench: {option} {name}: not written ({type(e).__name__}: {e.strerror or e})")
            continue
        if left is not None:
            errors.append(f"fastlayers bench: {option} {name}: made by someone else during the run, so not replaced "
                          f"(pass --overwrite to replace it); written to {left} instead")
    return errors


def _write_file(path: Path, write: Callable[[BinaryIO], Any], overwrite: bool) -> Path | None:
    """Write ``path`` whole or not at all (:func:`write_atomic`). With ``overwrite`` it replaces a
    file there; without, never: the content goes to a hidden file beside ``path``, then is
    hard-linked to it, which fails if ``path`` exists by then (someone made it during the run).
    Returns None when written, else the hidden file where the content was left."""
    if overwrite:
        write_atomic(path, write)
        return None
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".new", dir=path.parent)
    os.close(fd)
    staged = Path(name)
    try:
        write_atomic(staged, write)
        try:
            os.link(staged, path)
        except FileExistsError:
            return staged
        except OSError:  # a file system without hard links: create it exclusively, then copy
            try:
                _copy_new(staged, path)
            except FileExistsError:  # (made during the run there too: the report stays staged)
                return staged
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    staged.unlink()
    return None


def _copy_new(source: Path, path: Path) -> None:
    """Copy ``source`` to ``path``, which must not exist (FileExistsError), removing a partial copy."""
    with open(path, "xb") as f:
        try:
            f.write(source.read_bytes())
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            path.unlink(missing_ok=True)
            raise


def _check(args: argparse.Namespace) -> None:
    """Refuse, in one line and before minutes of measurement, settings the run would fail on at
    its end or on its first tensor: counts, the device, and the files to write."""
    def refuse(message: str) -> None:
        raise SystemExit(f"fastlayers bench: {message}")

    if args.repeats < 1:
        refuse(f"--repeats: expected >= 1, got {args.repeats}")
    if args.warmup < 0:
        refuse(f"--warmup: expected >= 0, got {args.warmup}")
    if args.size == "seed-large" and args.workload != "local2d":
        refuse(f"--size seed-large: only the local2d workload has it, got {args.workload}")
    # the harness synchronises, times and measures memory on these only (meta, mps, xla...: it failed there)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        refuse(f"--device {args.device}: expected cpu, cuda or cuda:N, got {args.device!r}")
    try:
        torch.empty(0, device=torch.device(args.device))
    except Exception as e:  # a CUDA device this torch or machine cannot use
        refuse(f"--device {args.device}: not usable here with torch {torch.__version__} "
               f"({type(e).__name__}: {str(e).splitlines()[0][:160]})")
    if args.json is not None and args.plot is not None \
            and Path(args.json).resolve() == Path(args.plot).resolve():
        refuse(f"--json {args.json}, --plot {args.plot}: the same file (the plot would replace the report); "
               f"name two files")
    for option, name in (("--json", args.json), ("--plot", args.plot)):
        if name is None:
            continue
        path = Path(name)
        folder = path.parent
        if path.is_dir():
            refuse(f"{option} {name}: is a folder; expected a file name")
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            refuse(f"{option} {name}: cannot write there (no writable folder {str(folder)!r})")
        if path.exists() and not args.overwrite:
            refuse(f"{option} {name}: exists; pass --overwrite to replace it, or name another file")
    if args.plot is not None:
        from matplotlib.figure import Figure  # (the cli extra's; a missing one fails here, before measuring)

        if not Path(args.plot).suffix:
            return
        # only the formats matplotlib writes itself (.pgf needs LaTeX, .ps / .eps a distiller when set)
        formats = [f for f in FORMATS if f in Figure().canvas.get_supported_filetypes()]
        if plot_format(args.plot) not in formats:
            refuse(f"--plot {args.plot}: expected a file name ending in one of the formats matplotlib writes "
                   f"without other programs ({', '.join('.' + f for f in formats)}), got {Path(args.plot).suffix!r}")
