"""What every reading command shares: opening sources, filters and stop conditions, and two
ways to run the pipeline: :func:`stream` into a printing sink (tap, cat) and :func:`read` into a
pure consumer batch by batch (check, stats, top)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import click

from .errors import UsageError
from .events import Batch
from .options import Sources
from .output import Output
from .pipeline import (
    Emptied,
    Item,
    LiveSource,
    Malformed,
    Narrowed,
    SourceSpec,
    StreamRead,
    Summary,
    run,
)
from .recording.source import RecordingSource
from .redact import shown_sources
from .selection import Filters, Limits
from .text import CLOSING_WORDS


def on_interrupt(finish: Callable[[], str] | None, quiet: bool = False) -> None:
    """What Ctrl-C (or SIGTERM) does from now on: ``cli.py``, the one place that handles it,
    calls ``finish`` (the command's closing work: its report, the recording's last flush) and
    exits 130 with the line ``finish`` returns on stderr (nothing with ``quiet``). ``None``:
    nothing more is said (the command is closing already: its words are on their way)."""
    meta = click.get_current_context().meta
    if finish is None:
        meta.pop(CLOSING_WORDS, None)
    else:
        meta[CLOSING_WORDS] = (finish, quiet)


def interrupted(summary: Summary) -> str:
    """The summary line of input that Ctrl-C stopped."""
    summary.stopped_by = "interrupt"
    return summary.line()


def open_source(
    sources: Sources, out: Output, typed: bool = False, selection: Filters | None = None
) -> Any:
    """Recordings, or live sources (returned at once: a missing engine or NATS server is
    waited for while the pipeline runs, with notices on stderr unless quiet). ``typed``: the
    consumers read typed events too (see :class:`~kvctl.pipeline.LiveSource`); ``selection``:
    what a dataset need not read (its files of other workers)."""
    specs = [SourceSpec.parse(s) for s in sources.addresses]
    partition_alone = selection is None or selection.partition is None
    if sources.partition is not None and sources.stream is None and partition_alone:
        raise UsageError("--partition applies to a fleet stream: give --stream NAME")
    stream = None if sources.stream is None else _stream_read(sources, specs)
    files = [s for s in specs if s.kind == "file"]
    if files and len(files) != len(specs):
        raise UsageError("recordings and live sources cannot be mixed in one command")
    if files:
        return RecordingSource([s.address for s in files], selection=selection)
    notify = None if out.quiet else out.say
    c = sources.connection
    if c is None:  # a command without source options: the defaults
        return LiveSource(specs, notify=notify, typed=typed)
    return LiveSource(
        specs,
        nats_options=c.nats,
        subjects=list(c.subjects),
        from_start=c.from_start,
        replay_endpoints=list(c.replay_endpoints),
        connect_timeout=c.connect_timeout,
        topic=c.topic,
        notify=notify,
        max_queue=c.max_queue,
        typed=typed,
        stream=stream,
    )


def _stream_read(sources: Sources, specs: list[SourceSpec]) -> StreamRead:
    """``--stream NAME [--partition I[,J...]/N]``: the partitions to read, checked against the
    stream on its server (a short conversation before reading: the server must be there)."""
    from .errors import TransportError
    from .partitions import check_name, parse_partitions
    from .redact import redact_url
    from .transports.jetstream import stream_partitions
    from .transports.nats import NatsOptions

    name = sources.stream
    assert name is not None
    bad_name = check_name(name)
    if bad_name is not None:
        raise UsageError(bad_name)
    if len(specs) != 1 or specs[0].kind != "nats" or specs[0].subjects:
        raise UsageError(
            "--stream reads one JetStream server (or one comma list of a cluster's servers): "
            "give one nats://HOST:PORT[,nats://HOST:PORT...]"
        )
    c = sources.connection
    if c is not None and c.subjects:
        raise UsageError("--subject does not apply to --stream (its partitions name the subjects)")
    wanted = None
    if sources.partition is not None:
        try:
            wanted = parse_partitions(sources.partition)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    url = specs[0].address
    total = stream_partitions(url, c.nats if c is not None else NatsOptions(), name)
    if total is None:
        raise TransportError(
            f"{redact_url(url)}: no fleet stream {name} there (`kvctl stream init` makes one)"
        )
    if wanted is not None and wanted[1] != total:
        raise UsageError(
            f"--partition {sources.partition}: stream {name} has {total} partitions, "
            f"not {wanted[1]}"
        )
    chosen = wanted[0] if wanted is not None else list(range(total))
    return StreamRead(name, tuple(chosen), total)


def stream(
    sources: Sources,
    selection: Filters,
    limits: Limits,
    out: Output,
    strict: bool = False,
) -> Summary:
    """tap/cat: print events from SOURCEs until a stop condition, then the summary."""
    sink = out.events_sink()
    # JSON lines (and the diagnostics) read typed events; the readable view reads dicts
    source = open_source(sources, out, typed=out.as_json, selection=selection)
    summary = Summary()
    # a signal right after the "reading" line still gets the summary
    on_interrupt(lambda: interrupted(summary), out.quiet)
    try:
        out.say(f"kvctl: reading {shown_sources(sources.addresses)}", "dim")
        run(source, [sink, out], limits, selection, strict=strict, summary=summary)
    finally:
        try:
            sink.close()  # writes what it held back: a closed pipe raises here
        finally:
            source.close()
    on_interrupt(None)
    out.say("kvctl: " + summary.line(), "dim")
    return summary


class EveryBatch:
    """Hands a pure model (checker, statistics, top's table) every batch exactly once,
    carrying exactly the events tap would print: a batch the filters emptied comes without
    events (its seq still counts), a malformed one as received. Only the selected events, or
    ``--type`` filters would turn into false "removal of an unknown block" findings."""

    def __init__(self, consume: Callable[[Batch], Any]) -> None:
        self.consume = consume

    def handle(self, item: Item) -> None:
        if type(item) is Batch:
            self.consume(item)
        elif isinstance(item, Narrowed):
            self.consume(dataclasses.replace(item.batch, events=item.events))
        elif isinstance(item, Emptied):
            self.consume(dataclasses.replace(item.batch, events=[]))
        elif isinstance(item, Malformed):
            self.consume(item.batch)


class Ticking:
    """A source wrapper that calls ``tick()`` at every batch and every idle poll (~10 Hz when
    quiet), so commands can refresh screens and check timers; ``tick`` returning False ends
    the input cleanly."""

    def __init__(self, source: Any, tick: Callable[[], bool]) -> None:
        self.source = source
        self.tick = tick
        # gap recovery from the replay socket, and the counts of what the queues dropped or
        # still held, keep working through the wrapper
        for name in ("recover", "dropped", "unprocessed"):
            if hasattr(source, name):
                setattr(self, name, getattr(source, name))

    def batches(self) -> Iterator[Batch | None]:
        for item in self.source.batches():
            if not self.tick():
                return
            yield item

    def close(self) -> None:
        self.source.close()


def read(
    sources: Sources,
    selection: Filters,
    limits: Limits,
    out: Output,
    summary: Summary,
    consume: Callable[[Batch], Any],
    tick: Callable[[], bool] | None = None,
    on_open: Callable[[Any], None] | None = None,
) -> None:
    """Open SOURCEs, run them through the tap pipeline into ``consume`` until a stop condition,
    counting in ``summary``.

    ``tick`` runs between batches and at idle polls (return False to stop); ``on_open`` gets
    the opened source. Ctrl-C propagates (see :func:`on_interrupt`: the command has said what
    it then prints, from ``summary``)."""
    source = open_source(sources, out, selection=selection)
    try:
        if on_open is not None:
            on_open(source)
        run(
            source if tick is None else Ticking(source, tick),
            [EveryBatch(consume)],
            limits,
            selection,
            summary=summary,
        )
    finally:
        source.close()


def live_addresses(source: Any, sources: Sources) -> list[str]:
    """The ``batch.source`` each live SOURCE argument produces (labels stripped); none for
    recordings, whose batches name the sources they were recorded from, nor a fleet stream,
    whose batches name the engines its bridges read."""
    if not isinstance(source, LiveSource) or sources.stream is not None:
        return []
    return [SourceSpec.parse(s).address for s in sources.addresses]
