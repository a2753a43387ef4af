"""PNG charts for ``kvctl stats --plot DIR``, drawn from :meth:`StatsCollector.result`.

matplotlib is optional (the ``plot`` extra) and is imported only here, only when plotting: it
costs ~0.5 s to import and most users never plot. Figures are built with the object API on the
Agg canvas (no pyplot, no global figure state, no display needed).

Readability rules: one unit per y axis (blocks/s and events/s get separate panels); stored and
removed differ in colour, line style and fill, so they stay apart where they overlap (in a full
cache they do: every store evicts); time runs on the wall clock, in the local time zone named
on the axis; lifetimes are seconds on a log axis ticked 0.001 … 0.1, 1, 10 ….
"""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

from .errors import KvctlError

MATPLOTLIB_REQUIREMENT = "matplotlib>=3.7"
"""The ``plot`` extra of pyproject.toml (a test keeps the two equal)."""
# Named as a plain requirement, not ``kvctl[plot]``: that form needs kvctl on an index and fails
# in a checkout; this one works for both.
MISSING = f"--plot needs matplotlib, which is not installed: pip install '{MATPLOTLIB_REQUIREMENT}'"
MAX_LEGEND = 12  # beyond this a legend hides the chart; lines stay, labels go
WALL_CLOCK_FROM = 946_684_800.0
"""2000-01-01 UTC. Earlier times are a clock that is not the wall clock (engine clocks that start
at 0, hand-made streams): those charts show seconds since the first event instead."""
STORED_STYLE = {"color": "tab:blue", "linestyle": "-", "linewidth": 1.6}
REMOVED_STYLE = {"color": "tab:red", "linestyle": "--", "linewidth": 1.6}


def require_matplotlib() -> None:
    """Fail before reading a stream (exit 1) rather than after a long capture. Imports it for
    real: a present but broken matplotlib must fail here too, not after the capture."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KvctlError(MISSING) from None


def _figure(
    title: str, rows: int = 1, height_ratios: list[int] | None = None
) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise KvctlError(MISSING) from None
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(9, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False, height_ratios=height_ratios)[
        :, 0
    ].tolist()
    fig.suptitle(title)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.yaxis.set_major_formatter(FuncFormatter(_count))
    return fig, axes


def _count(value: float, _pos: Any = None) -> str:
    """36,000 rather than 36000; fractions only where a tick has one."""
    return f"{value:,.0f}" if value == round(value) else f"{value:,.2f}"


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")


class _TimeAxis:
    """x values for offsets (s) from ``t0``: local wall-clock datetimes when ``t0`` is a wall-clock
    time, else the offsets themselves."""

    def __init__(self, t0: float | None) -> None:
        self.t0 = t0
        self.wall = t0 is not None and t0 >= WALL_CLOCK_FROM
        # the local zone's offset at the first event (not now: the stream may predate a DST
        # change)
        local = datetime.datetime.fromtimestamp(
            t0 if self.wall else 0,  # type: ignore[arg-type]
            datetime.timezone.utc,
        ).astimezone()
        self.tz = local.tzinfo
        self.tz_name = local.tzname() or "local time"

    def xs(self, offsets: list[float]) -> list[Any]:
        if not self.wall:
            return offsets
        assert self.t0 is not None
        return [datetime.datetime.fromtimestamp(self.t0 + o, self.tz) for o in offsets]

    def label(self, ax: Any) -> None:
        if not self.wall:
            ax.set_xlabel("time since the first event (s)")
            return
        from matplotlib.dates import AutoDateLocator, ConciseDateFormatter

        locator = AutoDateLocator(tz=self.tz)
        # Seconds-level ticks read as clock times (the default shows bare seconds); the date
        # goes once into the offset text at the axis end.
        formats = ["%Y", "%b", "%d", "%H:%M", "%H:%M", "%H:%M:%S"]
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(ConciseDateFormatter(locator, tz=self.tz, formats=formats))
        ax.set_xlabel(f"time ({self.tz_name})")


def _steps(
    offsets: list[float], values: list[float], width: float
) -> tuple[list[float], list[float]]:
    """Step-plot points that also draw the last bucket (``where="post"`` alone stops at its
    start)."""
    if not offsets:
        return [], []
    return [*offsets, offsets[-1] + width], [*values, values[-1]]


def occupancy_figure(result: dict[str, Any], capacity: int | None = None) -> Any:
    """Blocks cached per worker over wall-clock time, with the per-worker capacity line when
    it is known (``--num-blocks``)."""
    occ = result["occupancy"]
    bucket = occ["bucket_s"]
    samples = occ["samples"]
    fig, (ax,) = _figure("Cache occupancy per worker")
    ax.set_ylabel("blocks cached")
    time = _TimeAxis(occ["t0"])
    workers = sorted({w for s in samples for w in s})
    # Sample i is the occupancy at the end of bucket i.
    offsets = [(i + 1) * bucket for i in range(len(samples))]
    for w in workers:
        xs, ys = _steps(offsets, [s.get(w, 0) for s in samples], bucket)
        ax.step(time.xs(xs), ys, where="post", label=w)
    handles = ax.get_lines() if len(workers) <= MAX_LEGEND else []
    top = max((max(s.values(), default=0) for s in samples), default=0)
    if capacity:
        cap = ax.axhline(
            capacity,
            color="black",
            linestyle=":",
            linewidth=1.4,
            label=f"capacity ({capacity:,} blocks per worker)",
        )
        handles = [*handles, cap]
        top = max(top, capacity)
    if not workers:
        _empty(ax, "no events with a usable time")
    if handles:
        ax.legend(handles=handles, loc="lower right", fontsize="small")
    ax.set_ylim(0, top * 1.08 or 1)
    time.label(ax)
    return fig


def rates_figure(result: dict[str, Any]) -> Any:
    """Blocks stored and removed per second (one panel, one unit), events per second below."""
    rates = result["rates"]
    bucket = rates["bucket_s"]
    rows = rates["buckets"]
    fig, (blocks_ax, events_ax) = _figure(
        f"Rates ({bucket:g} s buckets)", rows=2, height_ratios=[2, 1]
    )
    blocks_ax.set_ylabel("blocks/s")
    events_ax.set_ylabel("events/s")
    time = _TimeAxis(rates["t0"])
    offsets = [i * bucket for i in range(len(rows))]

    def per_s(col: int) -> tuple[list[Any], list[float]]:
        xs, ys = _steps(offsets, [r[col] / bucket for r in rows], bucket)
        return time.xs(xs), ys

    if rows:
        xs, stored = per_s(2)
        blocks_ax.fill_between(
            xs, stored, step="post", color=STORED_STYLE["color"], alpha=0.15, linewidth=0
        )
        blocks_ax.step(xs, stored, where="post", label="stored", **STORED_STYLE)
        blocks_ax.step(*per_s(3), where="post", label="removed", **REMOVED_STYLE)
        blocks_ax.legend(loc="upper right", fontsize="small")
        events_ax.step(*per_s(1), where="post", color="tab:gray", linewidth=1.2)
    else:
        _empty(blocks_ax, "no events with a usable time")
    for ax in (blocks_ax, events_ax):
        ax.set_ylim(bottom=0)
    time.label(events_ax)
    return fig


def _seconds(value: float, _pos: Any = None) -> str:
    return f"{value:g}" if value < 1 else f"{value:,.0f}"


def lifetimes_figure(result: dict[str, Any]) -> Any:
    """Histogram of block lifetimes (store to removal) in seconds on a log axis."""
    lt = result["lifetime_s"]
    fig, (ax,) = _figure("Block lifetime (store to removal)")
    ax.set_xlabel("lifetime (s)")
    ax.set_ylabel("blocks")
    hist = lt.get("histogram")
    if hist and lt.get("count"):
        from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

        edges, counts = hist["edges_s"], hist["counts"]
        # Leading empty buckets (the histogram starts at 1 ms) would squeeze the data.
        first = next(i for i, c in enumerate(counts) if c)
        edges, counts = edges[first:], counts[first:]
        # Power-of-two buckets: equal-width bars on a log axis; a bucket starting at 0, which
        # a log axis cannot show, is drawn from half its upper edge.
        lefts = [edges[0] if edges[0] > 0 else edges[1] / 2, *edges[1:-1]]
        widths = [r - left for left, r in zip(lefts, edges[1:], strict=True)]
        ax.bar(
            lefts,
            counts,
            width=widths,
            align="edge",
            color="tab:blue",
            edgecolor="black",
            linewidth=0.5,
        )
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10))
        ax.xaxis.set_major_formatter(FuncFormatter(_seconds))
        ax.xaxis.set_minor_formatter(NullFormatter())
        # whole decades, so the axis starts and ends on a labelled 0.1 / 1 / 10-style tick
        ax.set_xlim(10 ** math.floor(math.log10(lefts[0])), 10 ** math.ceil(math.log10(edges[-1])))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
            if lt.get(q) and lt[q] > 0:
                ax.axvline(
                    lt[q], linestyle=style, linewidth=1.2, color="black", label=f"{q} {lt[q]:.3g} s"
                )
        ax.legend(loc="upper right", fontsize="small")
    else:
        _empty(ax, "no block was removed: no lifetimes")
    return fig


def write_plots(
    result: dict[str, Any], directory: str | Path, capacity: int | None = None
) -> list[Path]:
    """Write occupancy.png, rates.png and lifetimes.png into ``directory`` (created)."""
    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvctlError(f"--plot {directory}: {exc.strerror or exc}") from None
    written = []
    for name, fig in (
        ("occupancy.png", occupancy_figure(result, capacity)),
        ("rates.png", rates_figure(result)),
        ("lifetimes.png", lifetimes_figure(result)),
    ):
        fig.savefig(out / name)
        written.append(out / name)
    return written
