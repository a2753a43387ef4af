"""What every reading command shares: opening sources, filters and stop conditions, and two
ways to run the pipeline: :func:`stream` into a printing sink (tap, cat) and :func:`read` into a
pure consumer batch by batch (check, stats, top)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from .errors import ExitCode, KvctlError, UsageError
from .events import Batch, Event
from .options import connection_kwargs
from .output import JsonLinesSink, PrettySink, StderrDiagnostics
from .pipeline import LiveSource, SourceSpec, Summary, run
from .recording.source import RecordingSource
from .redact import shown_sources
from .selection import Filters, Limits


class Interrupted(KvctlError):
    """Ctrl-C or SIGTERM: exit 130 after the summary (the message; empty with ``-q``)."""

    exit_code = ExitCode.INTERRUPTED

    def __init__(self, summary: str = "", quiet: bool = False) -> None:
        super().__init__("" if quiet else summary)


def open_source(
    sources: tuple[str, ...] | list[str], quiet: bool = False, **connection: Any
) -> Any:
    """Recordings, or live sources (returned at once: a missing engine or NATS server is
    waited for while the pipeline runs, with notices on stderr unless ``quiet``)."""
    specs = [SourceSpec.parse(s) for s in sources]
    files = [s for s in specs if s.kind == "file"]
    if files and len(files) != len(specs):
        raise UsageError("recordings and live sources cannot be mixed in one command")
    if files:
        return RecordingSource([s.address for s in files])
    notify = None if quiet else StderrDiagnostics().say
    return LiveSource(specs, notify=notify, **connection)


def make_filters(params: dict[str, Any]) -> Filters:
    types = frozenset(
        {
            "blockstored": "BlockStored",
            "blockremoved": "BlockRemoved",
            "allblockscleared": "AllBlocksCleared",
        }[t.lower()]
        for t in params.get("types") or ()
    )
    return Filters(types=types, workers=frozenset(params.get("workers") or ()))


def make_limits(params: dict[str, Any]) -> Limits:
    return Limits(
        count=params.get("count"),
        duration=params.get("duration"),
        idle_timeout=params.get("idle_timeout"),
    )


def stream(
    params: dict[str, Any], connection: dict[str, Any] | None = None, on_batch: Any = None
) -> Summary:
    """tap/cat: print events from SOURCEs until a stop condition, then the summary."""
    diagnostics = StderrDiagnostics(quiet=params.get("quiet", False))
    hash_style = params.get("hash_format", "unsigned")
    sink = (
        JsonLinesSink(hash_style=hash_style)
        if params.get("as_json")
        else PrettySink(hash_style=hash_style)
    )
    source = open_source(params["sources"], **(connection or {}))
    summary = Summary()
    try:  # a signal right after the "reading" line still gets the summary
        diagnostics.say(f"kvctl: reading {shown_sources(params['sources'])}", "dim")
        run(
            source,
            sink,
            make_limits(params),
            make_filters(params),
            diagnostics,
            strict=params.get("strict", False),
            summary=summary,
            on_batch=on_batch,
        )
    except KeyboardInterrupt:
        summary.stopped_by = "interrupt"
        raise Interrupted(summary.line(), params.get("quiet", False)) from None
    finally:
        sink.close()
        source.close()
    diagnostics.say("kvctl: " + summary.line(), "dim")
    return summary


class Feed:
    """A pipeline sink (plus ``on_batch`` hook) that hands a consumer every batch exactly once,
    carrying exactly the events tap would print.

    ``on_batch`` sees every batch before filters and ``--count``; ``write`` sees the filtered,
    count-trimmed events of the batches that kept some. A consumer needs both: every batch for
    sequence accounting and malformed input, but only the selected events, or ``--type``
    filters would turn into false "removal of an unknown block" findings.
    """

    def __init__(self, consume: Callable[[Batch], Any]) -> None:
        self.consume = consume
        self.pending: Batch | None = None

    def on_batch(self, batch: Batch) -> None:
        self.flush()
        if batch.error is not None:
            self.consume(batch)  # the pipeline never writes a malformed batch
        else:
            self.pending = batch

    def write(self, batch: Batch, events: list[Event]) -> None:
        self.pending = None
        if events is not batch.events:
            batch = dataclasses.replace(batch, events=events)
        self.consume(batch)

    def flush(self) -> None:
        """Hand over a batch whose events were all filtered out (its seq still counts)."""
        if self.pending is not None:
            batch, self.pending = self.pending, None
            self.consume(dataclasses.replace(batch, events=[]))

    def close(self) -> None:
        self.flush()


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
    params: dict[str, Any],
    consume: Callable[[Batch], Any],
    tick: Callable[[], bool] | None = None,
    on_open: Callable[[Any], None] | None = None,
) -> Summary:
    """Open SOURCEs, run them through the tap pipeline into ``consume`` until a stop condition.

    ``tick`` runs between batches and at idle polls (return False to stop); ``on_open`` gets
    the opened source. KeyboardInterrupt propagates, carrying the summary (``stopped_by ==
    "interrupt"``) as its ``summary`` attribute, so each command decides what Ctrl-C prints.
    """
    source = open_source(params["sources"], **connection_kwargs(params))
    feed = Feed(consume)
    summary = Summary()

    def between_batches() -> bool:
        # The pipeline has finished with the previous batch: one it did not write was
        # filtered out entirely; hand it over now, not when the next batch happens to come.
        feed.flush()
        return tick() if tick is not None else True

    try:
        if on_open is not None:
            on_open(source)
        run(
            Ticking(source, between_batches),
            feed,
            make_limits(params),
            make_filters(params),
            None,
            summary=summary,
            on_batch=feed.on_batch,
        )
    except KeyboardInterrupt as exc:
        summary.stopped_by = "interrupt"
        exc.summary = summary  # type: ignore[attr-defined]
        raise
    finally:
        feed.close()
        source.close()
    return summary


def live_addresses(source: Any, sources: tuple[str, ...]) -> list[str]:
    """The ``batch.source`` each live SOURCE argument produces (labels stripped); none for
    recordings, whose batches name the sources they were recorded from."""
    if not isinstance(source, LiveSource):
        return []
    return [SourceSpec.parse(s).address for s in sources]
