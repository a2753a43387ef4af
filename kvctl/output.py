"""The one place that writes: JSON lines on stdout for programs, rich text for people, and
diagnostics on stderr. Every rich console is made here, by the :class:`Output` a command gets."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from datetime import datetime
from typing import IO, TYPE_CHECKING, Any

import click
import msgspec

from .events import CORE_EVENT_FIELDS, Batch, Event, present_hash
from .pipeline import Gap, Idle, Item, Malformed, Narrowed, SequenceIrregularity
from .redact import redact_url
from .sequence import REORDER
from .text import plural

if TYPE_CHECKING:
    from rich.console import Console

_encoder = msgspec.json.Encoder()  # several times faster than json/orjson on these rows
_encode = _encoder.encode
_encode_into = _encoder.encode_into


def _dumps(row: Any) -> bytes:
    try:
        return _encode(row)
    except (TypeError, OverflowError):  # ints beyond 64 bits, exotic types: the slow path
        return json.dumps(row, default=_json_default, separators=(",", ":")).encode()


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return repr(value)


def dumps(obj: Any) -> str:
    """JSON text for one object (summaries, reports), bytes as hex."""
    return _dumps(obj).decode()


_TEXT_STYLES = ("hex", "string")  # styles that turn every int hash into text
_TEMPLATE = dict.fromkeys(("type", *CORE_EVENT_FIELDS))


def present_hashes(values: Any, style: str) -> Any:
    if type(values) is not list:
        return present_hash(values, style) if values is not None else None
    if style == "unsigned":
        try:
            if not values or min(values) >= 0:
                return values  # already what we show: no per-hash work
        except TypeError:
            pass  # bytes hashes (or a mix): convert one by one
    return [present_hash(v, style) for v in values]


def _context(batch: Batch) -> dict[str, Any]:
    """The batch's part of each of its JSON lines."""
    context = {
        "ts": batch.ts,
        "seq": batch.seq,
        "source": batch.source,
        "topic": batch.topic,
        "worker_id": batch.worker_id,
        "dp_rank": batch.dp_rank,
        "format": batch.format,
    }
    if batch.recovered:
        context["recovered"] = True
    return context


def event_rows(batch: Batch, events: list[Event], hash_style: str = "unsigned") -> list[dict]:
    """The JSON-line view of events: core fields first (null when absent), then batch context,
    then every other field the producer sent, under its own name."""
    context = {**_TEMPLATE, **_context(batch)}
    rows = []
    for event in events:
        row = {**context, **event}
        hashes = row["block_hashes"]
        if hashes is not None:
            row["block_hashes"] = present_hashes(hashes, hash_style)
        parent = row["parent_block_hash"]
        if parent is not None and (
            hash_style in _TEXT_STYLES or not (type(parent) is int and 0 <= parent < 1 << 63)
        ):
            row["parent_block_hash"] = present_hash(parent, hash_style)
        tokens_hashes = row.get("tokens_hashes")  # Dynamo's u64 per block: a hash too
        if tokens_hashes is not None:
            row["tokens_hashes"] = present_hashes(tokens_hashes, hash_style)
        rows.append(row)
    return rows


def typed_lines(batch: Batch, events: list[Any], lines: bytearray) -> bool:
    """Append to ``lines`` the JSON lines of :class:`~kvctl.formats.engine_zmq.TypedEvent`
    events with unsigned hashes, as :func:`event_rows` and the encoder write them: each event
    encodes to the core fields of its line, whose closing brace gives way to the batch context,
    encoded once. False (nothing appended) if the context cannot be encoded here (see
    :func:`_dumps`)."""
    try:
        context = _encode(_context(batch))
    except (TypeError, OverflowError):
        return False
    tail = b"," + context[1:] + b"\n"
    for event in events:
        _encode_into(event, lines, -1)  # -1: at the end
        lines[-1:] = tail
    return True


class JsonLinesSink:
    """One JSON object per delivered event per line on stdout.

    ``chunk_bytes``: lines are held back until that many bytes are ready (tap writes
    :attr:`CHUNK_BYTES` at a time while events keep coming: one write system call where a
    buffered stdout makes eight), but never longer than :attr:`HOLD_S`, nor past a pause in
    the input (the pipeline's :class:`~kvctl.pipeline.Idle`) or its end; each such write is
    flushed, so a slow stream's lines show within ~0.1 s (a buffered stdout holds them until
    8 KB are ready). 0: each batch's lines are written at once, unflushed."""

    CHUNK_BYTES = 64 * 1024
    HOLD_S = 0.1

    def __init__(
        self, stream: IO[bytes] | None = None, hash_style: str = "unsigned", chunk_bytes: int = 0
    ) -> None:
        self.stream = stream or sys.stdout.buffer
        self.hash_style = hash_style
        self.chunk_bytes = chunk_bytes
        self.pending = bytearray()
        self.due = 0.0  # when the oldest held-back line must be written (monotonic)

    def _write(self) -> None:
        if self.pending:
            pending, self.pending = self.pending, bytearray()
            self.stream.write(pending)
            if self.chunk_bytes:
                self.stream.flush()

    def handle(self, item: Item) -> None:
        if type(item) is Batch:
            batch, events = item, item.events
        elif type(item) is Narrowed:
            batch, events = item.batch, item.events
        else:
            if type(item) is Idle:
                self._write()
            return
        if not self.pending:
            self.due = time.monotonic() + self.HOLD_S
        self._add(batch, events)
        if len(self.pending) >= self.chunk_bytes or time.monotonic() >= self.due:
            self._write()

    def _add(self, batch: Batch, events: list[Event]) -> None:
        if events and type(events[0]) is not dict:  # TypedEvents: a plain vLLM batch
            typed_events: list[Any] = events
            # unsigned: its hashes are shown as they are
            if self.hash_style == "unsigned" and typed_lines(batch, typed_events, self.pending):
                return
            events = [typed_event.event() for typed_event in typed_events]
        rows = event_rows(batch, events, self.hash_style)
        try:
            self.pending += _encoder.encode_lines(rows)
        except (TypeError, OverflowError):
            self.pending += b"".join(_dumps(row) + b"\n" for row in rows)

    def close(self) -> None:
        self._write()
        self.stream.flush()


def short_hash(value: Any, style: str) -> str:
    shown = present_hash(value, style)
    text = str(shown) if not isinstance(shown, int) or style != "hex" else f"{shown:x}"
    return text if len(text) <= 12 else text[:10] + "…"


def _clock(ts: float | None) -> str:
    if ts is None:
        return "--:--:--.---"
    return datetime.fromtimestamp(ts).strftime("%H:%M:%S.%f")[:-3]


_SHOWN_ELSEWHERE = {
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "lora_name",
    "medium",
    "worker_id",
    "dp_rank",
}
_STYLE = {"BlockStored": "green", "BlockRemoved": "red", "AllBlocksCleared": "magenta"}
_MARK = {"BlockStored": "+", "BlockRemoved": "-", "AllBlocksCleared": "x"}


class PrettySink:
    """Readable batches: a header (time, source, seq, worker, format) and one line per event,
    hashes shortened and token ids elided to a count."""

    def __init__(self, console: Console, hash_style: str = "unsigned", max_hashes: int = 3) -> None:
        self.console = console
        self.hash_style = hash_style
        self.max_hashes = max_hashes

    def handle(self, item: Item) -> None:
        if type(item) is Batch:
            self.write(item, item.events)
        elif isinstance(item, Narrowed):
            self.write(item.batch, item.events)

    def write(self, batch: Batch, events: list[Event]) -> None:
        # Lines are built as rich Text, never as markup: a hex hash list "[d0326374b3…]" or a
        # producer's "[bold]" would otherwise be read as a tag and vanish (and rich's own
        # escape() does not round-trip a backslash before "[").
        from rich.text import Text

        header = Text()
        header.append(_clock(batch.ts), "bold")
        header.append(" ")
        header.append(str(batch.source), "cyan")
        header.append("" if batch.seq is None else f" seq={batch.seq}")
        header.append("" if batch.worker_id is None else f" worker={batch.worker_id}")
        header.append("" if batch.dp_rank is None else f" dp={batch.dp_rank}")
        header.append(f" topic={batch.topic}" if batch.topic else "")
        header.append(" ")
        header.append(f"{batch.format} · {plural(len(events), 'event')}", "dim")
        if batch.recovered:
            header.append(" (recovered)", "yellow")
        lines = [header]
        for event in events:
            line = Text("  ")
            line.append_text(self.event_line(event))
            lines.append(line)
        self.console.print(Text("\n").join(lines))

    def event_line(self, event: Event) -> Any:
        """One event as a rich Text (values shown literally, never parsed as markup)."""
        from rich.text import Text

        etype = str(event.get("type"))
        line = Text()
        line.append(f"{_MARK.get(etype, '?')} {etype:<16}", _STYLE.get(etype, "yellow"))
        parts = []
        hashes = event.get("block_hashes")
        if type(hashes) is not list:  # only recordings of older kvctl versions hold these
            if hashes is not None:
                parts.append(f"blocks={_brief(hashes)}")
            hashes = []
        if hashes or etype != "AllBlocksCleared":
            shown = " ".join(short_hash(h, self.hash_style) for h in hashes[: self.max_hashes])
            more = f" +{len(hashes) - self.max_hashes}" if len(hashes) > self.max_hashes else ""
            noun = "block" if len(hashes) == 1 else "blocks"
            parts.append(f"{len(hashes)} {noun} [{shown}{more}]")
        if "parent_block_hash" in event:
            parent = event["parent_block_hash"]
            parts.append(
                "parent=" + ("-" if parent is None else short_hash(parent, self.hash_style))
            )
        tokens = event.get("token_ids")
        if tokens is not None:
            size = event.get("block_size")
            count = len(tokens) if type(tokens) is list else _brief(tokens)
            parts.append(f"tokens={count}" + (f" ({size}/block)" if size else ""))
        for key in ("lora_name", "lora_id", "medium"):
            if event.get(key) is not None:
                parts.append(f"{key.split('_')[0] if key != 'lora_id' else 'lora_id'}={event[key]}")
        if "worker_id" in event:
            parts.append(f"worker={event['worker_id']}")
        line.append(" " + " ".join(parts) if parts else "")
        extras = [k for k in event if k not in _SHOWN_ELSEWHERE and event[k] is not None]
        if extras:
            line.append(" ")
            line.append(" ".join(f"{k}={_brief(event[k])}" for k in extras), "dim")
        return line

    def close(self) -> None:
        pass


def _brief(value: Any) -> str:
    if isinstance(value, list):
        return f"[{len(value)} items]" if len(value) > 3 else str(value)
    text = value.hex() if isinstance(value, bytes) else str(value)
    return text if len(text) <= 24 else text[:22] + "…"


class Output:
    """Where a command writes, built once from its output options (``--json``, ``-q``,
    ``--hash-format``) and handed to it: on stdout JSON for programs or text for people, on
    stderr the lines for people (nothing with ``quiet``). As a pipeline consumer it shows the
    items a user must see: gaps, sequence irregularities and malformed messages.

    Every rich console a command prints with comes from here, so widths and styles are decided
    in one place: :attr:`console` (diagnostics), :attr:`stdout` (reports), and the special
    cases :meth:`stderr_tables`, :meth:`wide_stdout`, :meth:`screen` and :meth:`live_stderr`."""

    def __init__(
        self, as_json: bool = False, quiet: bool = False, hash_style: str = "unsigned"
    ) -> None:
        self.as_json = as_json
        self.quiet = quiet
        self.hash_style = hash_style

    # Consoles are made when first used: one never written to costs no rich import.
    @functools.cached_property
    def console(self) -> Console:
        """Diagnostics on stderr, shown literally (emoji off: a producer's ":thumbs_up:" stays
        text), each line left whole for the terminal to wrap."""
        from rich.console import Console

        return Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)

    @functools.cached_property
    def stdout(self) -> Console:
        """Tables and reports for people on stdout (check's report, inspect's summary): as
        wide as the terminal, unbounded when piped; long lines left whole."""
        return _unbounded_when_piped(stderr=False, soft_wrap=True)

    def stderr_tables(self) -> Console:
        """Tables for people on stderr, sized like :attr:`stdout` (simulate's final state:
        its stdout is for --json)."""
        return _unbounded_when_piped(stderr=True)

    def wide_stdout(self) -> Console:
        """stats' tables on stdout: 160 columns when piped, a terminal's own width."""
        from rich.console import Console

        return Console(highlight=False, soft_wrap=True, width=_wide_when_piped())

    def screen(self) -> Console:
        """top's screen on stdout: 160 columns when piped, like :meth:`wide_stdout`; rich wraps
        or cuts lines at the width, never the terminal (a screen redrawn in place must know how
        many rows it takes)."""
        from rich.console import Console

        return Console(highlight=False, soft_wrap=False, width=_wide_when_piped())

    def live_stderr(self) -> Console | None:
        """A console for a display redrawn in place on stderr (record's progress line,
        simulate's worker table), or None: with ``quiet``, or when stderr is not a terminal (a
        pipe or log gets no redraws)."""
        if self.quiet:
            return None
        from rich.console import Console

        console = Console(stderr=True)
        return console if console.is_terminal else None

    def events_sink(self) -> JsonLinesSink | PrettySink:
        """Where delivered events go: JSON lines, or readable batches."""
        if self.as_json:
            return JsonLinesSink(hash_style=self.hash_style, chunk_bytes=JsonLinesSink.CHUNK_BYTES)
        return PrettySink(_events_console(), hash_style=self.hash_style)

    def json(self, obj: Any) -> None:
        """One JSON object (a report) on stdout."""
        click.echo(dumps(obj))

    def say(self, text: str, style: str = "") -> None:
        """One line, shown literally (a rich Text, never parsed as markup)."""
        from rich.text import Text

        if not self.quiet:  # sources may be URLs with a password: never shown
            self.console.print(Text(redact_url(text), style=style))

    def handle(self, item: Item) -> None:
        if type(item) is Batch or type(item) is Narrowed:  # the hot path: nothing to say
            return
        if isinstance(item, Malformed):
            self.malformed(item.batch)
        elif isinstance(item, Gap):
            self.gap(item)
        elif isinstance(item, SequenceIrregularity):
            self.sequence(item)

    def malformed(self, batch: Batch) -> None:
        raw = b"|".join(batch.frames)
        preview = raw[:32].hex(" ") + (" …" if len(raw) > 32 else "")
        seq = "" if batch.seq is None else f" seq={batch.seq}"
        self.say(
            f"kvctl: malformed message from {batch.source}{seq}: {batch.error} "
            f"[{len(raw)} bytes: {preview}]",
            "red",
        )

    def gap(self, gap: Gap) -> None:
        recovered = gap.recovered
        how = f"{len(recovered)} recovered from the replay socket" if recovered else "not recovered"
        self.say(
            f"kvctl: gap from {_publisher(gap.publisher)}: seq {gap.first}..{gap.end - 1} "
            f"missing ({plural(gap.end - gap.first, 'batch')}, {how})",
            "yellow",
        )

    def sequence(self, irregularity: SequenceIrregularity) -> None:
        kind = _SEQUENCE_WORDS.get(irregularity.kind, irregularity.kind)
        self.say(
            f"kvctl: {kind} from {_publisher(irregularity.publisher)}: seq "
            f"{irregularity.got} after {irregularity.expected - 1}",
            "yellow",
        )


PIPED_WIDTH = 100_000
"""Console width when not writing to a terminal: wide enough that no table cell is folded or
ellipsised (rich assumes 80 columns otherwise), so piped output keeps every value whole."""


def _unbounded_when_piped(stderr: bool, **settings: Any) -> Console:
    """As wide as the terminal on a terminal, and :data:`PIPED_WIDTH` when piped (unless
    COLUMNS says otherwise), so nothing is cut."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False, **settings)
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console.width = PIPED_WIDTH
    return console


def _wide_when_piped() -> int | None:
    """160 columns when stdout is not a terminal and COLUMNS is not set (no terminal to fit,
    and 80 would fold endpoint labels); else None: rich measures the terminal, or honours
    COLUMNS."""
    return None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160


def _events_console() -> Console:
    """stdout for readable batches: emoji off (a producer's ":thumbs_up:" is shown as sent, not
    as a picture), and a closed pipe ends the command with exit status 0, as for JSON lines
    (rich would exit 1)."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            raise BrokenPipeError  # cli.py exits 0 on it

    return _Console(highlight=False, soft_wrap=True, emoji=False)


_SEQUENCE_WORDS = {REORDER: "late arrival"}
"""How a verdict of :mod:`kvctl.sequence` reads on stderr (others read as their name:
duplicate, restart, recovered)."""


def _publisher(publisher: Any) -> str:
    if isinstance(publisher, tuple):
        return " ".join(str(p) for p in publisher)
    return str(publisher)
