"""kvctl inspect: what a recording holds, without printing its events."""

from __future__ import annotations

from typing import Any

import click

from ..help import KvctlCommand


@click.command("inspect", cls=KvctlCommand)
@click.argument("path", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout.")
def command(path: str, as_json: bool) -> None:
    """Show a recording's schema version, time range, seq range per publisher, counts by type
    and worker, gaps, malformed messages, size and compression ratio.

    \b
    Example:
      kvctl inspect run.parquet
      kvctl inspect segments/ --json | jq .by_type
    """
    from ..errors import TransportError
    from ..output import dumps
    from ..transports.files import recording_info

    try:
        info = recording_info(path)
    except (OSError, ValueError) as exc:
        raise TransportError(f"{path}: cannot read recording: {exc}") from None
    if as_json:
        click.echo(dumps(info))
    else:
        _print(info)


def _when(ns: Any) -> str:
    from datetime import datetime, timezone

    if ns is None:
        return "-"
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _print(info: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    meta = info.get("metadata") or {}
    ts = [info.get("first_ts"), info.get("last_ts")]
    lines = [
        f"[bold]{info.get('path', '')}[/] schema v{info.get('schema_version')}, written by "
        f"kvctl {info.get('kvctl_version') or '?'}, {len(info.get('files', []))} file(s)",
        f"received {_when(info.get('first_recv_ns'))} .. {_when(info.get('last_recv_ns'))} UTC;"
        f" engine time {_when(ts[0] and ts[0] * 1e9)} .. {_when(ts[1] and ts[1] * 1e9)} UTC",
        f"{info.get('batches', 0)} batches, {info.get('events', 0)} events, "
        f"{info.get('malformed', 0)} malformed, {info.get('gaps', 0)} gaps "
        f"({info.get('missing', 0)} batches missing)",
        f"{info.get('bytes', 0):,} bytes on disk for {info.get('raw_bytes', 0):,} raw bytes "
        f"(ratio {info.get('ratio') or 0:.3f})",
    ]
    if meta.get("sources"):
        lines.append("sources: " + ", ".join(map(str, meta["sources"])))
    console.print("\n".join(lines))
    for title, key in (("events by type", "by_type"), ("events by worker", "by_worker")):
        counts = info.get(key) or {}
        if counts:
            table = Table(title=title, title_justify="left")
            table.add_column(key.removeprefix("by_"))
            table.add_column("events", justify="right")
            for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
                table.add_row(str(name), str(n))
            console.print(table)
    publishers = info.get("publishers") or {}
    if publishers:
        table = Table(title="sequence per publisher", title_justify="left")
        for col in ("publisher", "first seq", "last seq", "batches"):
            table.add_column(col, justify="left" if col == "publisher" else "right")
        for name, p in publishers.items():
            table.add_row(str(name), str(p.get("min_seq")), str(p.get("max_seq")),
                          str(p.get("batches")))
        console.print(table)
