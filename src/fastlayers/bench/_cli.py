"""``fastlayers bench``: run a seed workload through the verified comparison harness."""

from __future__ import annotations

import argparse

import torch

from ._harness import compare
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


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console() if Console().is_terminal else Console(width=200)  # files and pipes: no truncation
    if args.list or not args.workload:
        for name, make in sorted(WORKLOADS.items()):
            console.print(f"{name:10s} {(make.__doc__ or '').strip().splitlines()[0]}")
        return 0
    if args.repeats < 1:
        raise SystemExit(f"--repeats: expected >= 1, got {args.repeats}")
    if args.size == "seed-large" and args.workload != "local2d":
        raise SystemExit(f"--size seed-large: only the local2d workload has it, got {args.workload}")
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
        with open(args.json, "w") as f:
            f.write(report.to_json())
    if args.plot:
        from ._plot import plot_report

        plot_report(report, args.plot)
    return 0
