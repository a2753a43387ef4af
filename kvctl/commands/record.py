"""kvctl record: capture KV-event streams to crash-safe Parquet."""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from ..events import Batch, Event
from ..help import KvctlCommand
from ..options import (
    Sources,
    filter_options,
    limit_options,
    reporting,
    source_arguments,
    stream_options,
)
from ..pipeline import Emptied, Gap, Item, Malformed, Narrowed
from ..selection import Filters, Limits
from ..text import parse_duration, plural

LAYOUTS = ("flat", "hive")
"""The dataset layouts of --stream (kvctl.recording.dataset.LAYOUTS: that module needs
pyarrow, which --help does not load)."""

_SIZE_UNITS: dict[str, float] = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}

if TYPE_CHECKING:
    from ..output import Output


def _parse(value: str | None, units: dict[str, float], what: str) -> float | None:
    if value is None:
        return None
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]?)[bB]?\s*", value)
    if not match or match.group(2).lower() not in units or float(match.group(1)) <= 0:
        raise click.BadParameter(f"{value!r} is not a {what}")
    return float(match.group(1)) * units[match.group(2).lower()]


def _interval(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except ValueError:
        seconds = 0
    if seconds <= 0:
        raise click.BadParameter(f"{value!r} is not a time interval (e.g. 5m)")
    return seconds


@click.command("record", cls=KvctlCommand)
@source_arguments
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=True),
    help="Recording to write: a .parquet file, or a directory of segments when rotating.",
)
@click.option(
    "--rotate-size",
    metavar="SIZE",
    help="Start a new segment after about SIZE bytes of Parquet (e.g. 512M, 2G); with "
    "--stream, after SIZE bytes of a partition's raw messages (default 32M).",
)
@click.option(
    "--rotate-every",
    metavar="INTERVAL",
    help="Start a new segment on every clock boundary of INTERVAL (e.g. 60, 5m, 1h); "
    "with --stream the default is 60 s (a segment's messages are acked when it is written).",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace an existing recording file at -o (atomically, when the new one "
    "is complete). Without it an existing file is refused.",
)
@click.option(
    "--append",
    is_flag=True,
    help="With rotation: add segments to the recording already in the -o directory "
    "(numbered after its last). Without it the directory must be new or empty.",
)
@click.option(
    "--fsync",
    is_flag=True,
    help="fsync the journal at every flush (slower; survives "
    "power loss, not only a killed process).",
)
@stream_options
@click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    help="With --stream: flat (DIR/NAME.pPP.FIRST-LAST.parquet) or hive "
    "(DIR/dt=YYYY-MM-DD/hour=HH/part=PP/...). Default: flat.",
)
@filter_options
@limit_options
@reporting("No progress line, diagnostics or summary.")
def command(
    sources: Sources, selection: Filters, limits: Limits, out: Output, **params: Any
) -> None:
    """Record KV-event streams to Parquet, one row per event, raw bytes kept.

    Takes the same SOURCEs and options as tap. Malformed messages and sequence gaps are
    recorded too. The recorder journals to PATH.journal at least every second and turns it into
    Parquet on exit (Ctrl-C included); after a crash run `kvctl recover PATH`. With --stream it
    reads a fleet stream's partitions from JetStream into a dataset of segments instead,
    acking each segment once it is in place (a restart resumes after the last one).

    \b
    Example:
      kvctl record tcp://127.0.0.1:5557 -o run.parquet --duration 600
      kvctl record 0=tcp://10.0.0.1:5557 1=tcp://10.0.0.2:5557 -o run/ --rotate-every 1h
      kvctl record nats://127.0.0.1:4222 --from-start -o dynamo.parquet --idle-timeout 30
      kvctl record nats://10.0.0.5:4222 --stream fleet --partition 0,1/4 -o ds/ --layout hive
      duckdb -c "SELECT type, count(*) FROM 'run.parquet' GROUP BY 1"
    """
    from ..errors import TransportError, UsageError

    if params["stream"] is not None:
        return _record_stream(sources, selection, limits, out, params)
    for name in ("partition_spec", "layout"):
        if params[name] is not None:
            flag = "--partition" if name == "partition_spec" else "--layout"
            raise UsageError(f"{flag} applies to a fleet stream: give --stream NAME")
    from ..pipeline import LiveSource, Summary, run
    from ..recording.disk import OutputExists
    from ..recording.layout import output_conflict
    from ..recording.writer import RecordingWriter
    from ..redact import redact_argv, redact_url, shown_sources
    from ..session import on_interrupt, open_source

    rotate_size = _parse(params["rotate_size"], _SIZE_UNITS, "size (e.g. 512M)")
    rotate_every = _interval(params["rotate_every"])
    segmented = rotate_size is not None or rotate_every is not None
    if params["append"] and not segmented:
        raise UsageError(
            "--append adds segments to a rotation directory: give --rotate-size "
            "or --rotate-every (a Parquet file cannot be appended to)"
        )
    if params["overwrite"] and segmented:
        raise UsageError(
            "--overwrite replaces one recording file; with rotation give a new "
            "directory, or --append"
        )
    conflict = output_conflict(params["output"], segmented, params["overwrite"], params["append"])
    if conflict is not None:  # before any source is opened: nothing of the user's is touched
        raise UsageError(conflict)
    _check_writable(params["output"])
    # the recorder journals live messages raw (it counts their events, the converter decodes
    # them again): typed events will do
    source = open_source(sources, out, typed=True)
    try:
        writer = RecordingWriter(
            params["output"],
            rotate_size=int(rotate_size) if rotate_size else None,
            rotate_every=rotate_every,
            fsync=params["fsync"],
            filters=selection,
            labels=_labels(sources.addresses),
            overwrite=params["overwrite"],
            append=params["append"],
            metadata={
                "sources": [redact_url(s) for s in sources.addresses],
                "command": redact_argv(sys.argv[1:]),
            },
        )
    except OutputExists as exc:  # appeared since the check above
        source.close()
        raise UsageError(str(exc)) from None
    except OSError as exc:
        source.close()
        raise TransportError(f"{params['output']}: cannot write: {exc.strerror or exc}") from None
    summary = Summary()
    progress = None
    write_error: OSError | None = None
    result: dict[str, Any] = {}

    def closing_words(interrupted: bool) -> str:
        """After the writer is closed: a write error, else the report; the summary line."""
        on_interrupt(None)
        if interrupted:
            summary.stopped_by = "interrupt"
        if write_error is not None:  # what was flushed is recoverable; say how much that is
            raise _write_error(write_error, writer, summary, params["output"])
        if out.as_json:
            out.json({"summary": summary.to_json(), "recording": result})
        return (
            f"recorded {summary.line()} -> {params['output']} "
            f"({plural(result.get('bytes', 0), 'byte', thousands=True)})"
        )

    try:  # from here on, whatever happens, the writer is closed and the recording readable
        out.say(f"kvctl: recording {shown_sources(sources.addresses)} -> {params['output']}", "dim")
        # Live batches are journalled raw (frames + labels) and decoded again by the
        # converter; batches read back from recordings are journalled exactly.
        sink = RecordingSink(writer, raw=isinstance(source, LiveSource))
        progress = _progress(writer, summary, out)
        # the diagnostics after the sink: a malformed message is in the journal before its
        # line is shown (a line that is redacted: no password is echoed)
        run(source, [sink, out], limits, selection, summary=summary)
    except OSError as exc:  # disk full, file system gone: reported below, after closing
        summary.stopped_by = "write error"
        write_error = exc
    finally:
        if progress is not None:
            progress.stop()
        source.close()
        try:
            result = writer.close()
        except OSError as exc:
            write_error = exc
        # Ctrl-C stopped the recording (not its closing, which a second one would cut
        # short): the recording is closed, report it
        on_interrupt(lambda: closing_words(interrupted=True), out.quiet)
    out.say("kvctl: " + closing_words(interrupted=False), "dim")


def _write_error(error: OSError, writer: Any, summary: Any, output: str) -> Exception:
    """What a failed write says: why, how much reached the journal, how to recover it."""
    from ..errors import TransportError
    from ..recording.disk import OutputExists
    from ..recording.layout import leftover_journals

    elsewhere = " -o NEW.parquet" if isinstance(error, OutputExists) else ""
    journalled = writer.counts["batches"]
    kept = (
        f"; {journalled:,} of {plural(summary.batches, 'received batch', thousands=True)}"
        f" reached the journal"
        if summary.batches > journalled
        else ""
    )
    hint = (
        f"; `kvctl recover {output}{elsewhere}` restores what was flushed"
        if leftover_journals(output)
        else ""
    )
    why = str(error) if isinstance(error, OutputExists) else error.strerror or error
    return TransportError(f"{output}: cannot write: {why}{kept}{hint}")


def _check_writable(output: str) -> None:
    """Fail before anything is read, not at the first flush a second later."""
    from pathlib import Path

    from ..errors import TransportError

    parent = Path(output).resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise TransportError(f"{output}: cannot write there ({parent} is not a writable directory)")


def _labels(sources: Any) -> dict[str, tuple[Any, Any]] | None:
    """Source address -> the (worker, dp rank) labels LiveSource decodes its messages with,
    so that the journal needs no per-message labels; None if an address repeats."""
    from ..pipeline import SourceSpec

    specs = [SourceSpec.parse(s) for s in sources]
    labels = {s.address: (s.worker_id, s.dp_rank) for s in specs}
    return labels if len(labels) == len(specs) else None


class RecordingSink:
    """Records what passes the filters, and also every batch they emptied (without events,
    so that its seq stays in the recording: readers would otherwise see a gap where there was
    none), every malformed message and every sequence gap.

    ``raw=True`` (batches straight from the decoders, i.e. a live source): the writer
    journals the message (frames, labels, how many events the filters/limits kept) and the
    conversion decodes it again; otherwise batches are journalled exactly."""

    def __init__(self, writer: Any, raw: bool = True) -> None:
        self.writer = writer
        self.raw = raw
        self.malformed_seqs: dict[Any, set[int]] = {}  # since the publisher's last gap
        self._record: Callable[[Batch], None] = writer.write_message if raw else writer.write

    def handle(self, item: Item) -> None:
        if type(item) is Batch:  # the hot path
            self._record(item)
        elif isinstance(item, Narrowed):
            self._record_some(item.batch, item.events)
        elif isinstance(item, Emptied):
            self._record_some(item.batch, [])
        elif isinstance(item, Malformed):
            self.malformed(item.batch)
        elif isinstance(item, Gap):
            self.gap(item)

    def _record_some(self, batch: Batch, events: list[Event]) -> None:
        if self.raw:
            self.writer.write_message(batch, events)
        else:
            self.writer.write(dataclasses.replace(batch, events=events))

    def malformed(self, batch: Batch) -> None:
        if type(batch.seq) is int:
            seqs = self.malformed_seqs.setdefault(batch.publisher, set())
            seqs.add(batch.seq)
            if len(seqs) > 4096:  # a stream of nothing but malformed messages: stay bounded
                keep = sorted(seqs)[-2048:]
                seqs.clear()
                seqs.update(keep)
        self._record(batch)

    def gap(self, gap: Gap) -> None:
        """One Gap row per run of seqs the replay socket could not fill. A batch that arrives
        later still is recorded too (the reader then sees it as a late arrival)."""
        expected, got = gap.first, gap.end
        arrived = {s for s in gap.recovered if expected <= s < got}
        malformed = self.malformed_seqs.pop(gap.publisher, set())
        # A malformed message's seq arrived (its row is Malformed): not also a Gap row.
        arrived.update(s for s in malformed if expected <= s < got)
        start = expected
        for seq in [*sorted(arrived), got]:
            if seq > start:
                self.writer.write_gap(gap.publisher, start, seq - 1, source=str(gap.publisher))
            start = seq + 1


class _Status:
    """The live status line: rendered by rich's refresh thread from the writer's counters."""

    def __init__(self, writer: Any, summary: Any) -> None:
        self.writer, self.summary = writer, summary
        self.started = time.monotonic()

    def __rich__(self) -> str:
        s = self.writer.stats()
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return (
            f"[bold]recording[/] {s['file']} · {plural(s['events'], 'event', thousands=True)}"
            f" ({s['events'] / elapsed:,.0f}/s) · "
            f"{plural(s['batches'], 'batch', thousands=True)} · gaps "
            f"{self.summary.gaps} · malformed {s['malformed']} · {s['bytes'] / 1e6:,.1f} MB"
        )


def _progress(writer: Any, summary: Any, out: Output) -> Any:
    """The status line, started; None without a terminal on stderr or with -q."""
    console = out.live_stderr()
    if console is None:
        return None
    from rich.live import Live

    live = Live(_Status(writer, summary), console=console, refresh_per_second=2, transient=True)
    live.start()
    return live


# --- a fleet stream into a dataset (--stream) ---------------------------------------------------

_STREAM_DEFAULT_SIZE = 32e6
"""Raw bytes of one partition's segment (its rows are decoded and sorted in memory at the cut:
a few times this, at most, per partition cut at once)."""
_STREAM_DEFAULT_EVERY = 60.0
_NOT_WITH_STREAM = (
    ("append", "--append"),
    ("overwrite", "--overwrite"),
)


def _stream_usage(sources: Sources, selection: Filters, params: dict[str, Any]) -> str:
    """The one NATS URL of --stream, or UsageError for what does not apply."""
    from ..errors import UsageError
    from ..transports.nats import servers_of

    for key, flag in _NOT_WITH_STREAM:
        if params[key]:
            raise UsageError(
                f"{flag} does not apply to --stream: a dataset is added to by every run "
                "(it resumes after the segments it holds)"
            )
    if selection.types or selection.workers:
        raise UsageError("--type/--worker do not apply to --stream: a dataset keeps every message")
    c = sources.connection
    if c is not None and (c.subjects or c.from_start or c.replay_endpoints or c.topic):
        raise UsageError(
            "--subject, --from-start, --replay-endpoint and --topic do not apply to --stream "
            "(its consumers know where to read)"
        )
    if len(sources.addresses) != 1:
        raise UsageError(
            "--stream reads one JetStream server (or one comma list of a cluster's servers): "
            "nats://HOST:PORT[,nats://HOST:PORT...]"
        )
    url = sources.addresses[0]
    if not url.startswith(("nats://", "tls://")):
        raise UsageError(
            f"--stream reads a NATS JetStream stream, not {url!r}: "
            "give nats://HOST:PORT[,nats://HOST:PORT...]"
        )
    servers_of(url)  # a bad list is a UsageError
    return url


def _record_stream(
    sources: Sources, selection: Filters, limits: Limits, out: Output, params: dict[str, Any]
) -> None:
    """kvctl record nats://... --stream NAME [--partition I,J/N] -o DIR: one durable pull
    consumer per partition, segments into the dataset, acks after each segment is in place
    (the transport is kvctl.transports.jetstream, the segments kvctl.recording.
    partition_writer)."""
    from ..errors import TransportError, UsageError
    from ..partitions import StreamLayout, check_name, parse_partitions
    from ..redact import redact_argv, redact_url
    from ..session import on_interrupt

    url = _stream_usage(sources, selection, params)
    stream = params["stream"]
    bad_name = check_name(stream)
    if bad_name is not None:
        raise UsageError(bad_name)
    wanted: tuple[list[int], int] | None = None
    if params["partition_spec"] is not None:
        try:
            wanted = parse_partitions(params["partition_spec"])
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    rotate_size = _parse(params["rotate_size"], _SIZE_UNITS, "size (e.g. 512M)")
    rotate_every = _interval(params["rotate_every"]) or _STREAM_DEFAULT_EVERY
    location = params["output"]
    _check_dataset_location(location)

    from ..recording.partition_writer import DatasetWriter
    from ..transports.jetstream import PartitionReader

    c = sources.connection
    assert c is not None
    notify = None if out.quiet else out.say
    layout_probe = PartitionReader(url, c.nats, stream, {}, 0, notify)
    try:
        layout_probe.connect()
        total = layout_probe.stream_partitions()
    finally:
        layout_probe.close()
    if total is None:
        raise TransportError(
            f"{redact_url(url)}: stream {stream} is not one `kvctl stream init` made "
            "(no partitions to read)"
        )
    if wanted is not None and wanted[1] != total:
        raise UsageError(
            f"--partition {params['partition_spec']}: stream {stream} has {total} partitions, "
            f"not {wanted[1]}"
        )
    partitions = wanted[0] if wanted is not None else list(range(total))
    layout = StreamLayout(stream, total)
    ack_wait = max(300.0, 5 * rotate_every)
    writer = DatasetWriter(
        location,
        stream,
        partitions,
        total,
        layout=params["layout"] or "flat",
        rotate_bytes=int(rotate_size or _STREAM_DEFAULT_SIZE),
        rotate_every=rotate_every,
        command=redact_argv(sys.argv[1:]),
    )
    try:
        for path in writer.remove_leftovers():
            out.say(
                f"kvctl: removed {path}: an incomplete segment of a recorder that was stopped "
                "(its messages were never acked: the stream delivers them again)",
                "dim",
            )
        resume = writer.resume_points()
    except OSError as exc:
        raise TransportError(f"{location}: cannot read the dataset: {exc}") from None
    reader = PartitionReader(
        url, c.nats, stream, {p: layout.partition_subject(p) for p in partitions}, ack_wait, notify
    )
    state = _StreamRun(writer, reader, out, limits)
    try:
        reader.connect()
        writer.stream_starts_at(layout_probe.first_seq)
        for p in partitions:
            placed = reader.position(p, resume[p])
            if placed.action == "recreated":
                out.say(
                    f"kvctl: partition {p}: consumer {placed.consumer} made again, delivering "
                    f"from stream seq {resume[p] + 1}: {placed.reason}",
                    "dim",
                )
        shown = ",".join(map(str, partitions))
        out.say(
            f"kvctl: recording stream {stream} partitions {shown}/{total} "
            f"from {redact_url(url)} -> {writer.location}",
            "dim",
        )
        reader.start()
        state.run()
    finally:
        state.close()
        on_interrupt(lambda: state.closing_words(interrupted=True), out.quiet)
    out.say("kvctl: " + state.closing_words(interrupted=False), "dim")


def _check_dataset_location(location: str) -> None:
    """A local dataset directory is made, or must be a writable directory."""
    from ..errors import TransportError

    if location.startswith("s3://"):
        return
    try:
        os.makedirs(location, exist_ok=True)
    except OSError as exc:
        raise TransportError(f"{location}: cannot write there: {exc.strerror or exc}") from None
    if not os.access(location, os.W_OK | os.X_OK):
        raise TransportError(f"{location}: cannot write there (not a writable directory)")


class _StreamRun:
    """The receive loop of --stream and its closing: segments are acked once in place."""

    def __init__(self, writer: Any, reader: Any, out: Output, limits: Limits) -> None:
        self.writer, self.reader, self.out, self.limits = writer, reader, out, limits
        self.started = time.monotonic()
        self.stopped_by = "end of input"
        self.unconfirmed = 0
        self.write_error: OSError | None = None
        self.closed = False
        self.shown_kinds: set[str] = set()
        self.progress: Any = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        """Ctrl-C or SIGTERM: the loop stops between two messages (a KeyboardInterrupt
        raised anywhere could cut a segment's bookkeeping in half)."""
        self.interrupted = True

    def run(self) -> None:
        import signal

        limits, writer = self.limits, self.writer
        deadline = self.started + limits.duration if limits.duration else None
        last_message = time.monotonic()
        self.progress = _stream_progress(self, self.out)
        self.interrupted = False
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not self.interrupted:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self.stopped_by = "duration"
                    return
                # a server restart or a leader election is not idleness: the messages are
                # there, the pulls fail; the idle time counts from the last failure
                last_message = max(last_message, self.reader.failed_at)
                if limits.idle_timeout and now - last_message >= limits.idle_timeout:
                    self.stopped_by = "idle timeout"
                    return
                wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - now))
                if self._take(self.reader.receive(wait)):
                    last_message = time.monotonic()
                for p in writer.due(time.time()):
                    self._cut(p)
                for done in writer.completed():  # in place: only now acked
                    self._ack(done.partition, done.handle)
                for p, handle in writer.pending_acks().items():
                    self._ack(p, handle)
                if limits.count and writer.tally.events >= limits.count:
                    self.stopped_by = "count"
                    return
            self.stopped_by = "interrupt"
            # what was fetched already is recorded too (a stop by -c leaves it to the next run)
            self._take(self.reader.drain())
        except OSError as exc:
            self.stopped_by = "write error"
            self.write_error = exc
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if self.interrupted:
            raise KeyboardInterrupt  # after close, cli.py says the closing words, exit 130

    def _take(self, delivered: list[Any]) -> int:
        """Buffer delivered messages; a segment that reached its size is cut."""
        writer = self.writer
        for d in delivered:
            why = writer.add(d.partition, d.stream_seq, d.subject, d.headers, d.data, d.handle)
            if why is not None:
                self._malformed(why)
            if writer.full(d.partition):
                self._cut(d.partition)
        return len(delivered)

    def _cut(self, partition: int) -> None:
        """Cut a segment; while more than a rotation's worth (one a partition, and one more)
        wait for the segment writer, acking what it completes. The receive loop outruns the
        writer process on a backlog: without this, segments would queue up for it in memory
        (the fetch tasks stop asking for messages once the receive queue is full)."""
        from concurrent.futures import wait

        writer = self.writer
        writer.cut(partition)
        limit = len(writer.buffers) + 1
        while len(writer.in_flight) > limit:
            wait([writer.in_flight[0][0]], timeout=0.5)
            for done in writer.completed():
                self._ack(done.partition, done.handle)

    def _malformed(self, why: str) -> None:
        kind = why.split(" (")[0]
        if kind not in self.shown_kinds:  # once per kind; every one is a row and counted
            self.shown_kinds.add(kind)
            self.out.say(f"kvctl: malformed fleet message (kept as a Malformed row): {why}")

    def _ack(self, partition: int, handle: Any) -> None:
        if handle is not None and not self.reader.ack(handle):
            self.unconfirmed += 1
            self.out.say(
                f"kvctl: partition {partition}: the server did not confirm an ack "
                f"({self.reader.last_error}); the segment is on disk and a restart resumes "
                "after it"
            )

    def close(self) -> None:
        """Stop fetching, commit what is open, ack it, disconnect (Ctrl-C included)."""
        if self.closed:
            return
        self.closed = True
        if self.progress is not None:
            self.progress.stop()
        self.reader.stop.set()
        try:
            self.writer.cut_all()
            for done in self.writer.completed(wait=True):
                self._ack(done.partition, done.handle)
            for p, handle in self.writer.pending_acks().items():
                self._ack(p, handle)
        except OSError as exc:
            self.write_error = exc
        finally:
            self.writer.close()
            self.reader.close()

    def summary(self) -> dict[str, Any]:
        t = self.writer.tally
        return {
            "stream": self.writer.stream,
            "partitions": sorted(self.writer.buffers),
            "messages": t.messages,
            "events": t.events,
            "gaps": t.gaps,
            "malformed_envelopes": t.malformed_envelopes,
            "skipped_already_recorded": t.skipped,
            "segments": t.segments,
            "rows": t.rows,
            "bytes": t.bytes,
            "committed_through": {str(p): s for p, s in sorted(self.writer.committed.items())},
            "unconfirmed_acks": self.unconfirmed,
            "fetch_errors": self.reader.fetch_errors,
            "elapsed_s": round(time.monotonic() - self.started, 3),
            "stopped_by": self.stopped_by,
            # the receive loop's and the segment writer's (children: reaped at close)
            "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "writer_peak_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
        }

    def closing_words(self, interrupted: bool) -> str:
        from ..errors import TransportError
        from ..session import on_interrupt

        on_interrupt(None)
        if interrupted:
            self.stopped_by = "interrupt"
        if self.write_error is not None:
            error = self.write_error
            raise TransportError(
                f"{self.writer.location}: cannot write: {error.strerror or error} "
                "(nothing unwritten was acked: a restart records it)"
            )
        s = self.summary()
        if self.out.as_json:
            self.out.json({"summary": s, "recording": {"location": self.writer.location}})
        skipped = (
            f", {plural(s['skipped_already_recorded'], 'message', thousands=True)} already "
            "recorded skipped"
            if s["skipped_already_recorded"]
            else ""
        )
        return (
            f"recorded {plural(s['messages'], 'message', thousands=True)}, "
            f"{plural(s['events'], 'event', thousands=True)}, gaps {s['gaps']}, "
            f"malformed envelopes {s['malformed_envelopes']}{skipped} in "
            f"{plural(s['segments'], 'segment', thousands=True)} -> {self.writer.location} "
            f"({plural(s['bytes'], 'byte', thousands=True)}); stopped by {s['stopped_by']}"
        )


class _StreamStatus:
    def __init__(self, run: _StreamRun) -> None:
        self.run = run

    def __rich__(self) -> str:
        t = self.run.writer.tally
        elapsed = max(time.monotonic() - self.run.started, 1e-9)
        return (
            f"[bold]recording[/] stream {self.run.writer.stream} · "
            f"{plural(t.messages, 'message', thousands=True)} ({t.messages / elapsed:,.0f}/s) · "
            f"{plural(t.events, 'event', thousands=True)} · "
            f"{plural(t.segments, 'segment', thousands=True)} · "
            f"malformed {t.malformed_envelopes} · {t.bytes / 1e6:,.1f} MB"
        )


def _stream_progress(run: _StreamRun, out: Output) -> Any:
    console = out.live_stderr()
    if console is None:
        return None
    from rich.live import Live

    live = Live(_StreamStatus(run), console=console, refresh_per_second=2, transient=True)
    live.start()
    return live
