"""Bar chart of a Report: forward and forward+backward median time per candidate."""

from __future__ import annotations

import io
import math
from pathlib import Path

from .._core.files import write_atomic
from ._harness import Report, _summarise_flags

# the formats matplotlib's Agg, pdf and svg backends write without another program (.pgf needs
# LaTeX; .ps / .eps a distiller when one is set): what `fastlayers bench --plot` accepts
FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "tif", "tiff", "webp")


def plot_format(path: str) -> str:
    """The format a chart file's suffix names (``"png"`` without one)."""
    return Path(path).suffix[1:].lower() or "png"


def plot_report(report: Report, path: str) -> None:
    """Write :func:`render_plot`'s chart to ``path``, in the format its suffix names (PNG without
    one), whole or not at all."""
    data = render_plot(report, plot_format(path))
    write_atomic(Path(path), lambda f: f.write(data))


def render_plot(report: Report, fmt: str = "png") -> bytes:
    """:func:`figure`'s chart as ``fmt`` bytes (a format of :data:`FORMATS`)."""
    fig = figure(report)  # (first: it selects the Agg backend)
    import matplotlib.pyplot as plt

    try:
        out = io.BytesIO()
        fig.savefig(out, format=fmt, dpi=110, bbox_inches="tight")  # (tight: the legend and labels outside)
        return out.getvalue()
    finally:
        plt.close(fig)


def figure(report: Report):
    """A horizontal bar chart (log time axis, ms) of the fwd and fwd+bwd medians (a matplotlib
    Figure, on the Agg backend). A candidate's flags its workload does not expect
    (:meth:`Report.unexpected`) are written in red under its name; the legend sits outside the
    axes, where no bar is; the axis spans whole decades, labelled at the decades only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    names = [r.name for r in report.results]
    fwd = [r.forward_median * 1e3 for r in report.results]
    both = [r.forward_backward_median * 1e3 for r in report.results]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.6))
    ys = range(len(names))
    ax.barh([y + 0.2 for y in ys], fwd, height=0.4, label="forward")
    ax.barh([y - 0.2 for y in ys], both, height=0.4, label="forward + backward")
    flagged = [_summarise_flags(unexpected) if (unexpected := report.unexpected(r)) else "" for r in report.results]
    ax.set_yticks(list(ys), [f"{n}\n{f}" if f else n for n, f in zip(names, flagged)])
    for label, f in zip(ax.get_yticklabels(), flagged):
        if f:  # under the candidate's name, not beside its bars (where it could run into the legend)
            label.set_color("crimson")
    ax.invert_yaxis()
    ax.set_xscale("log")
    # whole decades, labelled at the decades only: labelled minor ticks overlapped on a short axis
    times = [t for t in fwd + both if math.isfinite(t) and t > 0]
    if times:
        ax.set_xlim(10 ** math.floor(math.log10(min(times))), 10 ** math.ceil(math.log10(max(times)) + 1e-9))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("median time per call (ms, log scale)")
    ax.set_title(f"{report.workload}\n{report.dtype} on {report.device}, {report.threads} threads, "
                 f"torch {report.torch_version}", fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return fig
