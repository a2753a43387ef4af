"""kvctl stats: summarise KV-event streams per worker and overall (tables, JSON, PNG charts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..events import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED
from ..help import KvctlCommand
from ..options import (
    Sources,
    filter_options,
    limit_options,
    reporting,
    source_arguments,
    stream_options,
)
from ..redact import shown_sources
from ..selection import Filters, Limits
from ..text import plural

if TYPE_CHECKING:
    from ..output import Output
    from ..pipeline import Summary


def _num(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.1f} ms"
    if value < 120:
        return f"{value:.2f} s"
    return f"{value / 60:.1f} min"


def span_s(result: dict[str, Any]) -> float:
    """Seconds covered by the rate buckets (rates are per this span)."""
    rates = result["rates"]
    return len(rates["buckets"]) * rates["bucket_s"]


def print_stats(result: dict[str, Any], summary: Summary, console: Any) -> None:
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    o = result["overall"]
    span = span_s(result)
    by_type = o["events_by_type"]
    blocks = o["blocks_by_type"]
    lt = result["lifetime_s"]
    reuse = result["reuse"]
    pubs = result["gaps"]["publishers"].values()
    gaps = sum(p["gaps"] for p in pubs)
    missing = sum(p["missing"] for p in pubs)

    overall = Table(title="kvctl stats: overall", title_justify="left", show_header=False)
    overall.add_column(style="bold")
    overall.add_column()
    rows = [
        (
            "span",
            f"{_secs(span)} ({plural(len(result['rates']['buckets']), 'bucket')} of "
            f"{result['rates']['bucket_s']:g} s)",
        ),
        ("batches / events", f"{o['batches']:,} / {o['events']:,} (malformed {o['malformed']})"),
        ("events by type", ", ".join(f"{k} {v:,}" for k, v in by_type.items()) or "none"),
        ("blocks stored / removed", f"{blocks[BLOCK_STORED]:,} / {blocks[BLOCK_REMOVED]:,}"),
        ("workers / blocks cached now", f"{o['workers']} / {o['blocks_cached']:,}"),
        (
            "events/s mean / peak",
            f"{_num(o['events'] / span if span else None)} / "
            f"{_num(result['rates']['peak_events_per_s'])}",
        ),
        (
            "block lifetime p50 / p90 / p99",
            " / ".join(_secs(lt.get(q)) for q in ("p50", "p90", "p99"))
            + f" ({plural(lt['count'], 'removal', thousands=True)})",
        ),
        (
            "reuse across workers",
            f"{plural(reuse['hashes_on_multiple_workers'], 'hash', thousands=True)} on several "
            f"workers, {plural(reuse['extra_stores'], 'store', thousands=True)} of a block "
            "another worker held",
        ),
        (
            "gaps",
            f"{gaps} ({plural(missing, 'batch')} missing), ts backwards "
            f"{result['gaps']['ts_backwards']}",
        ),
        ("stopped by", summary.stopped_by),
    ]
    for k, v in rows:
        overall.add_row(k, escape(v))
    console.print(overall)

    # Labels (endpoints) fold, numbers never wrap: the table stays readable in 80 columns.
    per = Table(title="per worker (blocks)", title_justify="left", box=box.SIMPLE_HEAD)
    per.add_column("worker", overflow="fold", min_width=14)
    for name in ("events", "stored", "removed", "cleared", "cached", "peak", "events/s"):
        per.add_column(name, justify="right", no_wrap=True)
    life = Table(
        title="block lifetime per worker (store to removal, engine clock)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    life.add_column("worker", overflow="fold", min_width=14)
    for name in ("removals", "min", "p50", "p90", "p99", "max"):
        life.add_column(name, justify="right", no_wrap=True)
    for label, w in result["workers"].items():
        et, bt, wl = w["events_by_type"], w["blocks_by_type"], w["lifetime_s"]
        per.add_row(
            escape(label),
            f"{w['events']:,}",
            f"{bt[BLOCK_STORED]:,}",
            f"{bt[BLOCK_REMOVED]:,}",
            f"{et.get(ALL_BLOCKS_CLEARED, 0):,}",
            f"{w['blocks_cached']:,}",
            f"{w['max_blocks_cached']:,}",
            _num(w["events"] / span if span else None),
        )
        life.add_row(
            escape(label),
            f"{wl['count']:,}",
            *(_secs(wl.get(q)) for q in ("min", "p50", "p90", "p99", "max")),
        )
    console.print(per)
    console.print(life)

    mix = Table(title="blocks by LoRA adapter and medium", title_justify="left")
    mix.add_column("kind")
    mix.add_column("value")
    mix.add_column("stored", justify="right")
    mix.add_column("removed", justify="right")
    for name, n in result["lora"].items():
        mix.add_row("lora", escape(name), f"{n:,}", "")
    medium = result["medium"]
    for name in sorted(set(medium["stored"]) | set(medium["removed"])):
        mix.add_row(
            "medium",
            escape(name),
            f"{medium['stored'].get(name, 0):,}",
            f"{medium['removed'].get(name, 0):,}",
        )
    console.print(mix)

    seq = Table(title="sequence per publisher", title_justify="left", box=box.SIMPLE_HEAD)
    seq.add_column("publisher", overflow="fold", min_width=14)
    for name in (
        "batches",
        "last seq",
        "gaps",
        "missing",
        "dups",
        "reorders",
        "resets",
        "recovered",
    ):
        seq.add_column(name, justify="right", no_wrap=True)
    for pub, p in result["gaps"]["publishers"].items():
        seq.add_row(
            escape(pub),
            *(
                f"{p[k]:,}"
                for k in (
                    "batches",
                    "last_seq",
                    "gaps",
                    "missing",
                    "duplicates",
                    "reorders",
                    "resets",
                    "recovered",
                )
            ),
        )
    console.print(seq)


@click.command("stats", cls=KvctlCommand)
@source_arguments
@stream_options
@filter_options
@limit_options
@click.option(
    "--interval",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Resolution of rates and occupancy over time (doubles on long streams).",
)
@click.option(
    "--plot",
    "plot_dir",
    metavar="DIR",
    type=click.Path(file_okay=False),
    help="Also write occupancy.png, rates.png and lifetimes.png into DIR "
    "(needs matplotlib: pip install 'matplotlib>=3.7').",
)
@click.option(
    "--num-blocks",
    type=click.IntRange(min=1),
    metavar="N",
    help="KV-cache capacity per worker in blocks, if known: drawn as the capacity "
    "line of occupancy.png.",
)
@reporting("No progress or summary on stderr.")
def command(
    sources: Sources, selection: Filters, limits: Limits, out: Output, **params: Any
) -> None:
    """Summarise KV-event streams: per worker and overall.

    Reads SOURCEs like tap (ZMQ endpoints, NATS servers, or a recording) until a stop
    condition, then prints events and blocks by type, rates, cache occupancy (now and peak),
    block lifetime percentiles (store to removal, engine clock), reuse across workers (the same
    block stored on several workers: a router that could have reused it), LoRA and medium
    breakdown, and sequence gaps per publisher. Ctrl-C ends a live read: the statistics are
    printed and the exit status is 130.

    --plot DIR writes PNG charts on the wall clock: occupancy per worker (with the capacity
    line given --num-blocks), blocks stored and removed per second and events per second,
    and the block lifetime histogram. Without matplotlib installed it fails at once with
    exit status 1.

    \b
    Example:
      kvctl stats tcp://127.0.0.1:5557 --duration 60
      kvctl stats 0=tcp://10.0.0.1:5557 1=tcp://10.0.0.2:5557 --duration 300 --plot charts/
      kvctl stats run.parquet --num-blocks 4096 --plot charts/
      kvctl stats nats://127.0.0.1:4222 -c 100000 --json | jq .reuse
    """
    from ..pipeline import Summary
    from ..session import on_interrupt, read
    from ..stats import StatsCollector

    if params["plot_dir"]:
        from ..plots import require_matplotlib

        require_matplotlib()  # before a capture that may take minutes
    quiet = out.quiet
    collector = StatsCollector(bucket_s=params["interval"])
    selection.needs_frames = False  # a dataset's raw frames stay unread: only events count

    def on_open(source: Any) -> None:
        out.say(f"kvctl: reading {shown_sources(sources.addresses)}", "dim")

    summary = Summary()

    def report() -> None:
        on_interrupt(None)
        result = collector.result()
        if out.as_json:
            out.json({**result, "stream": summary.to_json()})
        else:
            print_stats(result, summary, out.wide_stdout())
        if params["plot_dir"]:
            from ..plots import write_plots

            written = write_plots(result, params["plot_dir"], capacity=params["num_blocks"])
            out.say(f"kvctl: wrote {', '.join(str(p) for p in written)}", "dim")

    def interrupted() -> str:  # what was read so far is reported, then exit 130
        summary.stopped_by = "interrupt"
        report()
        return summary.line()

    on_interrupt(interrupted, quiet)
    read(sources, selection, limits, out, summary, collector.feed, on_open=on_open)
    report()
    out.say(f"kvctl: {summary.line()}", "dim")
