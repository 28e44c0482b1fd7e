"""``fastlayers bench``: run a seed workload through the verified comparison harness."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from .._core.files import write_atomic
from ._harness import _summarise_flags, compare
from ._workloads import WORKLOADS

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("workload", nargs="?", choices=sorted(WORKLOADS), help="which seed workload to run")
    parser.add_argument("--list", action="store_true", help="name the workloads and exit")
    parser.add_argument("--size", choices=["small", "seed", "seed-large"], default="seed",
                        help="small: seconds (tests); seed: the shapes of the user reports; seed-large: local2d "
                             "with seed 003's example batch of 1024")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG bar chart (matplotlib)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing --json / --plot files (without "
                                                                  "it an existing file is refused before measuring)")


def run(args: argparse.Namespace) -> int:
    """Measure, print the table and notes, write the files asked for. Exit status 1 when a
    candidate fails its check (a flag of ``_harness.FAILURES`` its workload does not expect), else 0."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console() if Console().is_terminal else Console(width=200)  # files and pipes: no truncation
    if args.list or not args.workload:
        for name, make in sorted(WORKLOADS.items()):
            console.print(f"{name:10s} {(make.__doc__ or '').strip().splitlines()[0]}")
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
            progress=lambda msg: progress.update(task, description=f"{args.workload}: {msg}"),
        )
    report.notes.extend(workload.notes)
    console.print(report.table(workload.anchor))
    for note in report.notes:
        console.print(f"note: {note}")
    console.print(f"reference: {report.reference}; CPU: {report.cpu}")
    if args.json:
        text = report.to_json().encode()
        write_atomic(Path(args.json), lambda f: f.write(text))
    if args.plot:
        from ._plot import plot_report

        plot_report(report, args.plot)
    failed = [f"{r.name}: {_summarise_flags(unexpected)}" for r in report.results
              if (unexpected := [f for f in r.failures() if f.partition(": ")[0] not in workload.expected.get(r.name, ())])]
    if failed:
        console.print(f"fastlayers bench: check failed (values or gradients differ from the reference): "
                      f"{'; '.join(failed)}")
        return 1
    return 0


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
    try:
        torch.empty(0, device=torch.device(args.device))
    except Exception as e:  # a malformed name (RuntimeError), or a device this torch cannot use
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

        formats = Figure().canvas.get_supported_filetypes()
        if Path(args.plot).suffix[1:].lower() not in formats:
            refuse(f"--plot {args.plot}: expected a file name ending in one of matplotlib's formats "
                   f"({', '.join('.' + f for f in sorted(formats))}), got {Path(args.plot).suffix!r}")
