"""kvctl inspect: what a recording holds, without printing its events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from ..help import KvctlCommand
from ..options import json_report_option

if TYPE_CHECKING:
    from rich.console import Console


@click.command("inspect", cls=KvctlCommand)
@click.argument("path", metavar="PATH")
@json_report_option
def command(path: str, as_json: bool) -> None:
    """Show a recording's schema version, time range, seq range per publisher, counts by type
    and worker, gaps, malformed messages, size and compression ratio.

    PATH may be a dataset (the segments of partitioned recorders, flat or hive, in a
    directory or s3://bucket/prefix): then also its streams, partitions, segments, rows, the
    stream seqs each partition covers and the holes between its segments (seqs no segment
    holds: data a recorder lost).

    \b
    Example:
      kvctl inspect run.parquet
      kvctl inspect segments/ --json | jq .by_type
      kvctl inspect data/ --json | jq .dataset
    """
    from pathlib import Path

    from ..errors import TransportError, UsageError
    from ..output import Output
    from ..recording.info import recording_info

    if not path.startswith("s3://") and not Path(path).exists():
        raise UsageError(f"{path}: no such recording or dataset")
    try:
        info = recording_info(path)
    except (OSError, ValueError) as exc:
        raise TransportError(f"{path}: cannot read recording: {exc}") from None
    out = Output(as_json=as_json)
    if out.as_json:
        out.json(info)
    else:
        _print(info, out.stdout)


def _when(ns: Any) -> str:
    from datetime import datetime, timezone

    if ns is None:
        return "-"
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _print(info: dict[str, Any], console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..text import plural

    meta = info.get("metadata") or {}
    ts = [info.get("first_ts"), info.get("last_ts")]
    lines = [
        f"[bold]{escape(str(info.get('path', '')))}[/] schema v{info.get('schema_version')}, "
        f"written by kvctl {info.get('kvctl_version') or '?'}, "
        f"{plural(len(info.get('files', [])), 'file')}",
        f"received {_when(info.get('first_recv_ns'))} .. {_when(info.get('last_recv_ns'))} UTC;"
        f" engine time {_when(ts[0] and ts[0] * 1e9)} .. {_when(ts[1] and ts[1] * 1e9)} UTC",
        f"{plural(info.get('batches', 0), 'batch')}, {plural(info.get('events', 0), 'event')}, "
        f"{info.get('malformed', 0)} malformed, {plural(info.get('gaps', 0), 'gap')} "
        f"({plural(info.get('missing', 0), 'batch')} missing)",
        f"{plural(info.get('bytes', 0), 'byte', thousands=True)} on disk for "
        f"{plural(info.get('raw_bytes', 0), 'raw byte', thousands=True)} "
        f"(ratio {info.get('ratio') or 0:.3f})",
    ]
    if meta.get("sources"):
        lines.append("sources: " + escape(", ".join(map(str, meta["sources"]))))
    # Not soft-wrapped, unlike other reports: long lines wrap between words on a terminal and
    # the table titles are padded to the table's width.
    console.print("\n".join(lines), soft_wrap=False)
    for title, key in (("events by type", "by_type"), ("events by worker", "by_worker")):
        counts = info.get(key) or {}
        if counts:
            table = Table(title=title, title_justify="left")
            table.add_column(key.removeprefix("by_"))
            table.add_column("events", justify="right")
            for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
                table.add_row(escape(str(name)), str(n))
            console.print(table, soft_wrap=False)
    if info.get("dataset"):
        _print_dataset(info["dataset"], console)
    publishers = info.get("publishers") or {}
    if publishers:
        table = Table(title="sequence per publisher", title_justify="left")
        for col in ("publisher", "first seq", "last seq", "batches"):
            table.add_column(col, justify="left" if col == "publisher" else "right")
        for name, p in publishers.items():
            table.add_row(
                escape(str(name)),
                str(p.get("min_seq")),
                str(p.get("max_seq")),
                str(p.get("batches")),
            )
        console.print(table, soft_wrap=False)


def _print_dataset(dataset: dict[str, Any], console: Console) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..text import plural

    for name, stream in dataset.get("streams", {}).items():
        parts = stream.get("partitions", {})
        table = Table(
            title=f"dataset ({dataset.get('layout')}): stream {escape(name)}, "
            f"{plural(len(parts), 'partition')}",
            title_justify="left",
        )
        for col in ("partition", "segments", "rows", "first seq", "last seq", "holes"):
            table.add_column(col, justify="left" if col == "holes" else "right")
        for index, p in sorted(parts.items(), key=lambda kv: int(kv[0])):
            holes = ", ".join(f"{a}-{b}" for a, b in p.get("holes", [])) or "none"
            table.add_row(
                index,
                str(p.get("segments")),
                f"{p.get('rows', 0):,}",
                str(p.get("first_seq")),
                str(p.get("last_seq")),
                holes if not p.get("holes") else f"[red]{holes}[/]",
            )
        console.print(table, soft_wrap=False)
