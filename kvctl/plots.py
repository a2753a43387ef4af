"""PNG charts for ``kvctl stats --plot DIR``, drawn from :meth:`StatsCollector.result`.

matplotlib is an optional extra (``pip install 'kvctl[plot]'``) and is imported only here, only
when plotting: it costs ~0.5 s to import and most users never plot. Figures are built with the
object API on the Agg canvas (no pyplot, no global figure state, no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import KvctlError

MISSING = "--plot needs matplotlib, which is not installed: pip install 'kvctl[plot]'"
MAX_LEGEND = 12  # beyond this a legend hides the chart; lines stay, labels go


def require_matplotlib() -> None:
    """Fail before reading a stream (exit 1) rather than after a long capture. Imports it for
    real: a present but broken matplotlib must fail here too, not after the capture."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KvctlError(MISSING) from None


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise KvctlError(MISSING) from None
    fig = Figure(figsize=(9, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_occupancy(result: dict[str, Any], path: Path) -> Path:
    occ = result["occupancy"]
    bucket = occ["bucket_s"]
    samples = occ["samples"]
    fig, ax = _figure("Cache occupancy per worker", "time (s)", "blocks cached")
    workers = sorted({w for s in samples for w in s})
    # Sample i is the occupancy at the end of bucket i.
    xs = [(i + 1) * bucket for i in range(len(samples))]
    for w in workers:
        ax.step(xs, [s.get(w, 0) for s in samples], where="post", label=w)
    if not workers:
        _empty(ax, "no events with a usable time")
    elif len(workers) <= MAX_LEGEND:
        ax.legend(loc="best", fontsize="small")
    ax.set_ylim(bottom=0)
    fig.savefig(path)
    return path


def plot_rates(result: dict[str, Any], path: Path) -> Path:
    rates = result["rates"]
    bucket = rates["bucket_s"]
    rows = rates["buckets"]
    fig, ax = _figure(f"Event rates ({bucket:g} s buckets)", "time (s)", "per second")
    xs = [i * bucket for i in range(len(rows))]
    for col, label in ((1, "events/s"), (2, "blocks stored/s"), (3, "blocks removed/s")):
        ax.step(xs, [r[col] / bucket for r in rows], where="post", label=label)
    if rows:
        ax.legend(loc="best", fontsize="small")
    else:
        _empty(ax, "no events with a usable time")
    ax.set_ylim(bottom=0)
    fig.savefig(path)
    return path


def plot_lifetimes(result: dict[str, Any], path: Path) -> Path:
    lt = result["lifetime_s"]
    fig, ax = _figure("Block lifetime (store to removal)", "lifetime (s)", "blocks")
    hist = lt.get("histogram")
    if hist and lt.get("count"):
        from matplotlib.ticker import MaxNLocator

        edges, counts = hist["edges_s"], hist["counts"]
        # Leading empty buckets (the histogram starts at 1 ms) would squeeze the data.
        first = next(i for i, c in enumerate(counts) if c)
        edges, counts = edges[first:], counts[first:]
        # Power-of-two buckets: equal-width bars on a log axis; a bucket starting at 0, which
        # a log axis cannot show, is drawn from half its upper edge.
        lefts = [edges[0] if edges[0] > 0 else edges[1] / 2, *edges[1:-1]]
        widths = [r - left for left, r in zip(lefts, edges[1:], strict=True)]
        ax.bar(lefts, counts, width=widths, align="edge", edgecolor="black", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
            if lt.get(q) and lt[q] > 0:
                ax.axvline(lt[q], linestyle=style, linewidth=1.2, color="black",
                           label=f"{q} {lt[q]:.3g} s")
        ax.legend(loc="best", fontsize="small")
    else:
        _empty(ax, "no block was removed: no lifetimes")
    fig.savefig(path)
    return path


def write_plots(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write occupancy.png, rates.png and lifetimes.png into ``directory`` (created)."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvctlError(f"--plot {directory}: {exc.strerror or exc}") from None
    return [plot_occupancy(result, out / "occupancy.png"),
            plot_rates(result, out / "rates.png"),
            plot_lifetimes(result, out / "lifetimes.png")]
