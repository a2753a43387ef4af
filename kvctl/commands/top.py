"""kvctl top: a live per-worker dashboard of KV-event streams."""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from ..events import BLOCK_REMOVED, BLOCK_STORED, Batch
from ..help import KvctlCommand
from ..options import (
    Sources,
    filter_options,
    json_snapshots_option,
    limit_options,
    reporting,
    source_arguments,
    stream_options,
)
from ..redact import shown_sources
from ..selection import Filters, Limits
from ..sequence import GAP, SequenceTracker
from ..state import StreamState, WorkerKey, recv_time, worker_label
from ..text import plural

# Sort keys -> row field; every numeric column sorts largest first (what `top` users expect).
SORT_KEYS = {
    "worker": "worker",
    "cached": "blocks_cached",
    "stores": "stored_blocks_per_s",
    "removes": "removed_blocks_per_s",
    "batches": "batches_per_s",
    "seq": "last_seq",
    "gaps": "gaps",
    "malformed": "malformed",
    "seen": "last_seen_s",
}
# Short headers: the whole table fits 80 columns with 12-character worker labels.
COLUMNS = (
    ("worker", "worker"),
    ("blocks_cached", "cached"),
    ("stored_blocks_per_s", "store/s"),
    ("removed_blocks_per_s", "remove/s"),
    ("batches_per_s", "batch/s"),
    ("last_seq", "seq"),
    ("gaps", "gaps"),
    ("malformed", "malformed"),
    ("last_seen_s", "seen"),
)

if TYPE_CHECKING:
    from ..output import Output


class _Row:
    __slots__ = (
        "batches",
        "stored",
        "removed",
        "events",
        "last_seq",
        "gaps",
        "missing",
        "malformed",
        "last_seen",
        "prev",
        "rates",
    )

    def __init__(self) -> None:
        self.batches = self.stored = self.removed = self.events = 0
        self.gaps = self.missing = self.malformed = 0
        self.last_seq: int | None = None
        self.last_seen: float | None = None  # receive time, seconds since the epoch
        self.prev = (0, 0, 0)  # (batches, stored, removed) at the previous refresh
        self.rates = (0.0, 0.0, 0.0)


class TopModel:
    """Per-worker counters for the dashboard, fed batch by batch (pure: no clock of its own).

    Rates are per refresh window: ``tick(now)`` turns counter deltas since the previous tick
    into per-second rates, so a row shows what happened in the last ~second, not an average
    since start. Batch-level figures (batches, seq, gaps, malformed) go to the worker that
    published the batch; block figures to the worker each event names (Dynamo events do).
    """

    def __init__(self, started: float) -> None:
        self.state = StreamState()
        self.seq = SequenceTracker()
        self.rows: dict[WorkerKey, _Row] = {}
        self.last_tick = started
        self.batches = 0
        self.events = 0

    def _row(self, key: WorkerKey) -> _Row:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = _Row()
        return row

    def feed(self, batch: Batch) -> None:
        state = self.state
        bkey = state.batch_key(batch)
        first = batch.events[0] if batch.events else None
        if type(first) is dict:
            bkey = state.event_key(first, bkey)
        row = self._row(bkey)
        self.batches += 1
        row.batches += 1
        row.last_seen = recv_time(batch)
        if batch.error is not None:
            row.malformed += 1
            self.seq.observe(batch)  # its seq arrived: not a gap (see kvctl.sequence)
            return
        if batch.seq is not None:
            row.last_seq = batch.seq
            irregularity = self.seq.observe(batch)
            if irregularity is not None and irregularity.kind == GAP:
                row.gaps += 1
                row.missing += irregularity.missing
        t = batch.ts
        for ev in batch.events:
            if type(ev) is not dict:
                continue
            key = state.event_key(ev, bkey)
            erow = row if key == bkey else self._row(key)
            erow.events += 1
            self.events += 1
            hashes = ev.get("block_hashes")
            etype = ev.get("type")
            if etype == BLOCK_STORED and type(hashes) is list:
                erow.stored += len(hashes)
            elif etype == BLOCK_REMOVED and type(hashes) is list:
                erow.removed += len(hashes)
            state.apply_event(ev, key, t)

    def tick(self, now: float) -> None:
        dt = now - self.last_tick
        if dt <= 0:
            return
        self.last_tick = now
        for row in self.rows.values():
            cur = (row.batches, row.stored, row.removed)
            batches, stored, removed = ((c - p) / dt for c, p in zip(cur, row.prev, strict=True))
            row.rates = (batches, stored, removed)
            row.prev = cur

    def snapshot(
        self, now_epoch: float, sort: str = "worker", reverse: bool = False
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for key, row in self.rows.items():
            cache = self.state.workers.get(key)
            seen = None if row.last_seen is None else max(0.0, now_epoch - row.last_seen)
            out.append(
                {
                    "worker": worker_label(key),
                    "blocks_cached": len(cache.blocks) if cache else 0,
                    "stored_blocks_per_s": round(row.rates[1], 2),
                    "removed_blocks_per_s": round(row.rates[2], 2),
                    "batches_per_s": round(row.rates[0], 2),
                    "last_seq": row.last_seq,
                    "gaps": row.gaps,
                    "missing_batches": row.missing,
                    "malformed": row.malformed,
                    "last_seen_s": None if seen is None else round(seen, 3),
                    "batches": row.batches,
                    "events": row.events,
                    "stored_blocks": row.stored,
                    "removed_blocks": row.removed,
                }
            )
        field = SORT_KEYS[sort]
        if field == "worker":
            out.sort(key=lambda r: r["worker"], reverse=reverse)
        else:
            # Largest first; rows without a value (no seq, never seen) last either way.
            def key_fn(r: dict[str, Any]) -> tuple[bool, Any, str]:
                v = r[field]
                return (v is None, -(v or 0) if not reverse else (v or 0), r["worker"])

            out.sort(key=key_fn)
        return out


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.0f}m" if seconds < 3600 else f"{seconds / 3600:.0f}h"


def render(
    model: TopModel,
    rows: list[dict[str, Any]],
    sort: str,
    reverse: bool,
    summary_line: str,
    keys_hint: bool,
) -> Any:
    from rich import box
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    arrow = "↑" if (sort == "worker") != reverse else "↓"
    hint = " · keys: q quit, s sort, r reverse" if keys_hint else ""
    title = (
        f"kvctl top · {time.strftime('%H:%M:%S')} · {plural(len(rows), 'worker')} · "
        f"{plural(model.state.total_blocks, 'block', thousands=True)} cached · "
        f"{plural(model.events, 'event', thousands=True)} · "
        f"sort: {sort} {arrow}{hint}"
    )
    # Title and footer sit outside the table: a table title wraps at the table's width.
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    # A narrow terminal folds worker labels but never drops them (rich would shrink an
    # unconstrained column to nothing before it truncates numbers).
    label_width = min(max((len(r["worker"]) for r in rows), default=6), 12)
    for field, header in COLUMNS:
        marked = f"{header} {arrow}" if SORT_KEYS[sort] == field else header
        if field == "worker":
            table.add_column(marked, overflow="fold", min_width=label_width)
        else:
            table.add_column(marked, justify="right", no_wrap=True)
    for r in rows:
        gaps = str(r["gaps"]) if not r["gaps"] else f"[yellow]{r['gaps']}[/]"
        bad = str(r["malformed"]) if not r["malformed"] else f"[red]{r['malformed']}[/]"
        table.add_row(
            escape(r["worker"]),
            f"{r['blocks_cached']:,}",
            f"{r['stored_blocks_per_s']:,.1f}",
            f"{r['removed_blocks_per_s']:,.1f}",
            f"{r['batches_per_s']:,.1f}",
            "-" if r["last_seq"] is None else str(r["last_seq"]),
            gaps,
            bad,
            _ago(r["last_seen_s"]),
        )
    if not rows:
        table.add_row("[dim]waiting for events…[/]", *[""] * (len(COLUMNS) - 1))
    return Group(Text(title, style="bold"), table, Text(summary_line, style="dim"))


class Keys:
    """Single keypresses from a terminal stdin (cbreak mode: no Enter needed, Ctrl-C still
    raises KeyboardInterrupt); inert when stdin is not a terminal."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.saved: Any = None

    def __enter__(self) -> Keys:
        try:
            import termios
            import tty

            if sys.stdin.isatty():
                self.fd = sys.stdin.fileno()
                self.saved = termios.tcgetattr(self.fd)
                tty.setcbreak(self.fd)
        except (ImportError, OSError):  # no termios (Windows) or no usable terminal
            self.fd = None
        return self

    def read(self) -> str:
        if self.fd is None:
            return ""
        import select

        if not select.select([self.fd], [], [], 0)[0]:
            return ""
        try:
            return os.read(self.fd, 32).decode(errors="ignore")
        except OSError:
            return ""

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)


@click.command("top", cls=KvctlCommand)
@source_arguments
@stream_options
@filter_options
@limit_options
@click.option(
    "--sort",
    type=click.Choice(list(SORT_KEYS)),
    default="worker",
    show_default=True,
    help="Column to sort rows by (numbers largest first, workers A-Z).",
)
@click.option("--reverse", is_flag=True, help="Reverse the sort order.")
@click.option(
    "--refresh",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds between screen updates (and rate windows).",
)
@reporting("No messages or summary on stderr.", json_snapshots_option)
def command(
    sources: Sources, selection: Filters, limits: Limits, out: Output, **params: Any
) -> None:
    """Watch KV-event streams live: one row per worker, refreshed every second.

    Columns: blocks cached, blocks stored and removed per second, batches per second, last
    seq, sequence gaps, malformed messages, and seconds since the worker was last heard from. On a
    terminal the screen updates in place; keys: q quits (exit 0), s cycles the sort column, r
    reverses it; Ctrl-C quits with exit status 130. When stdout is not a terminal a plain table
    is printed at every refresh (and once at the end), or with --json one JSON object per
    refresh. Stop conditions (-c, --duration, --idle-timeout) end it with exit status 0.

    \b
    Example:
      kvctl top tcp://127.0.0.1:5557
      kvctl top 0=tcp://10.0.0.1:5557 1=tcp://10.0.0.2:5557 --sort stores
      kvctl top nats://127.0.0.1:4222 --json --duration 10 | jq '.workers[].blocks_cached'
    """

    from ..pipeline import Summary
    from ..session import on_interrupt, read

    quiet = out.quiet
    as_json = out.as_json
    refresh = params["refresh"]
    sort_names = list(SORT_KEYS)
    view = {"sort": params["sort"], "reverse": params["reverse"], "quit": False}
    started = time.monotonic()
    model = TopModel(started)
    summary = Summary()
    screen = out.screen()
    interactive = screen.is_terminal and not as_json

    def frame() -> Any:
        model.tick(time.monotonic())
        rows = model.snapshot(time.time(), view["sort"], view["reverse"])
        if as_json:
            from ..output import dumps

            return dumps(
                {
                    "time": round(time.time(), 3),
                    "sort": view["sort"],
                    "workers": rows,
                    "blocks_cached": model.state.total_blocks,
                    "batches": model.batches,
                    "events": model.events,
                }
            )
        line = (
            f"{plural(model.batches, 'batch', thousands=True)}, {time.monotonic() - started:.0f} s"
        )
        return render(model, rows, view["sort"], view["reverse"], line, interactive)

    def show(live: Any) -> None:
        if live is not None:
            live.update(frame(), refresh=True)
        elif as_json:
            click.echo(frame())
        else:
            screen.print(frame())
            screen.print()
            sys.stdout.flush()  # a pipe reader sees each snapshot when it is made

    next_refresh = started + refresh

    def make_tick(live: Any, keys: Keys) -> Any:
        def tick() -> bool:
            nonlocal next_refresh
            pressed = keys.read()
            redraw = False
            for ch in pressed:
                if ch in "qQ":
                    view["quit"] = True
                    return False  # ends the input: the pipeline returns normally
                if ch == "s":
                    i = sort_names.index(view["sort"])
                    view["sort"] = sort_names[(i + 1) % len(sort_names)]
                    redraw = True
                elif ch == "r":
                    view["reverse"] = not view["reverse"]
                    redraw = True
            now = time.monotonic()
            if now >= next_refresh:
                next_refresh = now + refresh
                show(live)
            elif redraw and live is not None:
                # re-sort now, without moving the rate window
                rows = model.snapshot(time.time(), view["sort"], view["reverse"])
                live.update(
                    render(
                        model,
                        rows,
                        view["sort"],
                        view["reverse"],
                        plural(model.batches, "batch", thousands=True),
                        True,
                    ),
                    refresh=True,
                )
            return True

        return tick

    def on_open(source: Any) -> None:
        if not interactive:
            out.say(f"kvctl: reading {shown_sources(sources.addresses)}", "dim")

    live: Any = None

    def interrupted() -> str:
        summary.stopped_by = "interrupt"
        if live is None:
            show(None)  # the last snapshot printed (a screen keeps its final frame)
        return summary.line()

    on_interrupt(interrupted, quiet)
    try:
        with Keys() as keys:
            if interactive:
                from rich.live import Live

                live = Live(
                    frame(),
                    console=screen,
                    auto_refresh=False,
                    transient=False,
                    redirect_stderr=False,
                )
                live.start()
            tick = make_tick(live, keys)
            read(sources, selection, limits, out, summary, model.feed, tick, on_open)
            on_interrupt(None)
            show(live)  # the final state stays on screen (or is the last snapshot printed)
            if live is not None:
                live.stop()
    finally:
        if live is not None and live.is_started:  # Ctrl-C: the final state stays on screen
            live.update(frame(), refresh=True)
            live.stop()
    if view["quit"]:
        summary.stopped_by = "q"
    out.say(f"kvctl: {summary.line()}", "dim")
