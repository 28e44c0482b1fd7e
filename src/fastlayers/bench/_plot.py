"""PNG bar chart of a Report: forward and forward+backward median time per candidate."""

from __future__ import annotations

from pathlib import Path

from .._core.files import write_atomic
from ._harness import Report


def plot_report(report: Report, path: str) -> None:
    """Write a horizontal bar chart (log time axis, ms) of fwd and fwd+bwd medians to ``path``, in
    the format its suffix names (PNG without one), whole or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in report.results]
    fwd = [r.forward_median * 1e3 for r in report.results]
    both = [r.forward_backward_median * 1e3 for r in report.results]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.6))
    ys = range(len(names))
    ax.barh([y + 0.2 for y in ys], fwd, height=0.4, label="forward")
    ax.barh([y - 0.2 for y in ys], both, height=0.4, label="forward + backward")
    for y, r in zip(ys, report.results):
        if r.flags:
            ax.text(max(fwd[y], both[y]) * 1.05, y, "flagged", va="center", fontsize=8, color="crimson")
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("median time per call (ms, log scale)")
    ax.set_title(f"{report.workload}\n{report.dtype} on {report.device}, {report.threads} threads, torch {report.torch_version}",
                 fontsize=9)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fmt = Path(path).suffix[1:].lower() or "png"
    try:
        write_atomic(Path(path), lambda f: fig.savefig(f, format=fmt, dpi=110))
    finally:
        plt.close(fig)
