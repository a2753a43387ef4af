"""The raw journal behind ``kvctl record``: writing it, reading it back, its header.

A *raw journal* is an Arrow IPC stream with one row per transport message: batch-level columns
only (receive time, source, topic, worker/dp labels, the recovered flag, the raw frames, the
decoder's error, how many events were recorded) — cheap enough to build on the recorder's hot
path (about a microsecond per message, no per-event work). The per-event Parquet rows are
produced later, by re-decoding the frames (:mod:`kvctl.recording.convert`). Batches that did
not come straight from a decoder (a recording re-recorded, a library caller) and gap markers
are journalled *exactly* instead: their fields as tagged JSON in the ``exact`` column.

The header (the schema's ``kvctl`` metadata) holds what the conversion needs: the recorder's
filters, the first batch index, the labels of each source, the writer's pid.
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Iterator
from itertools import accumulate, chain
from operator import attrgetter
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..events import Batch
from ..redact import redact_url
from .schema import I63, METADATA_KEY, SCHEMA, Gap
from .tagged_json import NestingTooDeep, dumps, to_json_value

JOURNAL_FORMAT = 2

JOURNAL_SCHEMA = pa.schema(
    [
        ("recv_ns", pa.int64()),
        ("source", pa.string()),
        ("topic", pa.string()),  # the NATS subject decode_nats needs; the ZMQ topic for info
        ("worker_id", pa.string()),  # tagged JSON of the worker label (null: header "labels")
        ("dp_rank", pa.string()),  # tagged JSON of the dp rank label (null: header "labels")
        ("recovered", pa.bool_()),
        ("frames", pa.list_(pa.large_binary())),
        ("events", pa.int32()),  # events recorded: the first n of what the filters keep
        ("exact", pa.string()),  # tagged JSON of a batch/gap recorded as is (not re-decoded)
    ]
)

# --- building journal rows (recorder side) ------------------------------------------------------


def _fit_int(v: Any) -> int | None:
    return v if type(v) is int and -I63 <= v < I63 else None


def _text(v: Any) -> str | None:
    return v if v is None or type(v) is str else str(v)


def exact_row(batch: Batch) -> tuple[tuple, list[bytes]]:
    """A batch recorded as is: (row, frames); every field but the frames as tagged JSON."""
    source = redact_url(batch.source) if type(batch.source) is str else batch.source
    fields = {
        "kind": "batch",
        "source": source,
        "events": batch.events,
        "format": batch.format,
        "topic": batch.topic,
        "seq": batch.seq,
        "ts": batch.ts,
        "recv_ns": batch.recv_ns,
        "worker_id": batch.worker_id,
        "dp_rank": batch.dp_rank,
        "error": batch.error,
        "recovered": batch.recovered,
        "publisher": batch.publisher,
    }
    try:
        exact = dumps(to_json_value(fields))
    except NestingTooDeep as exc:  # recorded as what it is: a message kvctl cannot hold
        fields.update(events=[], error=f"not recorded as events: {exc} (raw frames kept)")
        exact = dumps(to_json_value(fields))
    row = (
        _fit_int(batch.recv_ns),
        _text(source),
        _text(batch.topic),
        None,
        None,
        batch.recovered is True,
        None if fields["error"] is None else "error",
        exact,
    )
    return row, [bytes(f) for f in batch.frames]


_GAP_PREFIX = '{"kind":"gap"'


def gap_row(gap: Gap) -> tuple[tuple, list[bytes]]:
    """A gap marker recorded as is: (row, no frames), its fields as tagged JSON."""
    source = redact_url(gap.source) if type(gap.source) is str else gap.source
    publisher = redact_url(gap.publisher) if type(gap.publisher) is str else gap.publisher
    fields = {
        "kind": "gap",
        "publisher": publisher,
        "from_seq": gap.from_seq,
        "to_seq": gap.to_seq,
        "recv_ns": gap.recv_ns,
        "source": source,
    }
    row = (
        _fit_int(gap.recv_ns),
        _text(source),
        None,
        None,
        None,
        None,
        None,
        dumps(to_json_value(fields)),
    )
    return row, []


message_fields = attrgetter(
    "recv_ns", "source", "topic", "worker_id", "dp_rank", "recovered", "error"
)
"""A raw row's batch fields as a tuple built in C (the frames are copied separately)."""
message_fields_unlabelled = attrgetter("recv_ns", "source", "topic", "recovered", "error")
"""The same without worker/dp (the journal header maps each source to its labels)."""


class Chunk:
    """One journal record batch and what the recorder counts from it."""

    __slots__ = ("rb", "batches", "events", "malformed", "gaps", "missing", "raw_bytes")

    def __init__(self, rb: pa.RecordBatch) -> None:
        self.rb = rb
        self.batches = self.events = self.malformed = self.gaps = self.missing = 0
        self.raw_bytes = 0


class RowBuffer:
    """What the receive loop appends to between flushes: per message a fields tuple (built in
    C), the number of events kept and a reference to its frames list — the batch and its
    decoded events die at once. :meth:`build` turns it into one journal record batch with
    C-level loops only (the frames are joined into one buffer that Arrow wraps as is)."""

    __slots__ = ("rows", "events", "frames", "special", "labelled")

    def __init__(self, labelled: bool) -> None:
        self.rows: list[tuple] = []
        self.events: list[int] = []
        self.frames: list[list[bytes]] = []
        self.special = 0  # rows from exact_row/gap_row in this buffer
        self.labelled = labelled  # rows carry worker/dp (no "labels" map in the header)

    def __len__(self) -> int:
        return len(self.rows)

    def add_special(self, row: tuple, frames: list[bytes], events: int) -> None:
        self.rows.append(row)
        self.events.append(events)
        self.frames.append(frames)
        self.special += 1

    def build(self) -> Chunk:
        """One journal record batch, column-wise (C-level iteration, no per-row Python)."""
        rows = self.rows
        n = len(rows)
        exact: Any = None
        gaps: list[str] = []
        cols: list[Any]
        if self.special:
            full = []
            for r in rows:
                if len(r) == 8:
                    full.append(r)
                    if r[7].startswith(_GAP_PREFIX):
                        gaps.append(r[7])
                elif self.labelled:
                    full.append((*r, None))
                else:
                    full.append((r[0], r[1], r[2], None, None, r[3], r[4], None))
            cols = list(zip(*full, strict=True))
            exact = cols[7]
            if not self.labelled:  # null, not the JSON "null": the header's labels apply
                cols[3] = cols[4] = None
        elif n:
            cols = list(zip(*rows, strict=True))
            if not self.labelled:
                cols = [cols[0], cols[1], cols[2], None, None, cols[3], cols[4]]
        else:
            cols = [()] * 7
        flat = list(chain.from_iterable(self.frames))
        try:
            data = b"".join(flat)
        except TypeError:  # a library caller's odd frame type
            flat = [bytes(f) for f in flat]
            data = b"".join(flat)
        values = pa.Array.from_buffers(
            pa.large_binary(),
            len(flat),
            [
                None,
                pa.py_buffer(array("q", accumulate(map(len, flat), initial=0))),
                pa.py_buffer(data),
            ],
        )
        frames = pa.ListArray.from_arrays(
            pa.array(array("i", accumulate(map(len, self.frames), initial=0)), pa.int32()), values
        )
        arrays = []
        for i, name in enumerate(
            ("recv_ns", "source", "topic", "worker_id", "dp_rank", "recovered")
        ):
            ftype = JOURNAL_SCHEMA.field(name).type
            col = cols[i]
            if col is None:
                arrays.append(pa.nulls(n, ftype))
                continue
            if i in (3, 4):
                col = _labels(col)
            elif i == 1:
                col = _redacted(col)
            try:
                arrays.append(pa.array(col, type=ftype))
            except (TypeError, ValueError, OverflowError, pa.ArrowException):
                arrays.append(pa.array(_sanitize(name, col), type=ftype))
        arrays.append(frames)
        arrays.append(pa.array(self.events, pa.int32()))
        arrays.append(pa.nulls(n, pa.string()) if exact is None else pa.array(exact, pa.string()))
        chunk = Chunk(pa.RecordBatch.from_arrays(arrays, schema=JOURNAL_SCHEMA))
        chunk.batches = n - len(gaps)
        chunk.events = sum(self.events)
        chunk.malformed = n - cols[6].count(None) if n else 0
        chunk.gaps = len(gaps)
        for text in gaps:
            g = json.loads(text)
            chunk.missing += g["to_seq"] - g["from_seq"] + 1
        chunk.raw_bytes = len(data)
        return chunk


def _redacted(sources: Any) -> Any:
    """Source URLs without credentials (nats://u:***@host): computed once per distinct value,
    so the journal, and the Parquet file decoded from it, never hold a password."""
    try:
        table = {v: redact_url(v) if type(v) is str else v for v in set(sources)}
    except TypeError:  # an unhashable source from a library caller
        return [redact_url(v) if type(v) is str else v for v in sources]
    if all(k is v for k, v in table.items()):
        return sources
    return list(map(table.__getitem__, sources))


def _labels(values: tuple) -> list[str]:
    """Tagged JSON per value, computed once per distinct value (a handful per stream)."""
    types = set(map(type, values))
    if len(types & {bool, int, float}) < 2:  # else True == 1 == 1.0 would share a key
        try:
            table = {v: dumps(to_json_value(v)) for v in set(values)}
            return list(map(table.__getitem__, values))
        except TypeError:  # an unhashable label (a Dynamo worker id that is a list, ...)
            pass
    return [dumps(to_json_value(v)) for v in values]


def _sanitize(name: str, values: Any) -> list[Any]:
    """Slow path for values a column refuses (odd types from library callers)."""
    if name in ("source", "topic"):
        return [
            None
            if v is None
            else str(v).encode("utf-8", "surrogatepass").decode("utf-8", "replace")
            for v in values
        ]
    if name == "recv_ns":
        return [_fit_int(v) for v in values]
    if name == "recovered":
        return [v is True for v in values]
    return list(values)


class JournalWriter:
    """An append-only Arrow IPC stream; ``offset`` = bytes of complete record batches."""

    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        self.path = path
        self.info = info
        self.sink = pa.OSFile(str(path), "wb")
        schema = JOURNAL_SCHEMA.with_metadata({METADATA_KEY: json.dumps(info)})
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.rows = 0
        self.sink.flush()
        self.offset = self.bytes = self.sink.tell()

    def write(self, rb: pa.RecordBatch, fsync: bool) -> None:
        self.writer.write_batch(rb)
        self.rows += rb.num_rows
        self.sink.flush()  # OSFile writes straight to the fd: the data is in the page cache
        if fsync:
            os.fsync(self.sink.fileno())
        self.offset = self.bytes = self.sink.tell()

    def close(self) -> None:
        self.writer.close()
        self.bytes = self.sink.tell()
        self.sink.close()


# --- reading journals ---------------------------------------------------------------------------


def read_journal(path: str | os.PathLike[str]) -> Iterator[pa.RecordBatch]:
    """Every complete record batch of an IPC stream journal; a torn tail (the process died
    mid-write, or a writer is still appending) just ends the iteration."""
    try:
        source = pa.memory_map(str(path), "r")
    except (OSError, pa.ArrowException):
        return
    with source:
        try:
            reader = pa.ipc.open_stream(source)
        except (OSError, pa.ArrowException):
            return  # not even a complete schema message: nothing was flushed
        while True:
            try:
                rb = reader.read_next_batch()
            except StopIteration:
                return
            except (OSError, pa.ArrowException):
                return
            yield rb


def journal_schema(path: str | os.PathLike[str]) -> pa.Schema | None:
    """The schema (with the header) of a journal, or None if it is not an Arrow IPC stream."""
    try:
        with pa.memory_map(str(path), "r") as source:
            return pa.ipc.open_stream(source).schema
    except (OSError, pa.ArrowException):
        return None


def journal_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of a journal ({} if none); see :func:`journal_header` for a checked one."""
    schema = journal_schema(path)
    raw = (schema.metadata or {}).get(METADATA_KEY.encode()) if schema is not None else None
    return json.loads(raw) if raw else {}


class NotAJournal(ValueError):
    """A file that is not a kvctl journal: refused, never converted or removed."""


def journal_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of a kvctl journal, or :class:`NotAJournal` (the file is left as it is).

    A kvctl journal is an Arrow IPC stream whose schema carries the ``kvctl`` metadata key
    (kvctl version, journal format) and the journal's columns (format 2) or the recording
    schema's (format 1)."""
    schema = journal_schema(path)
    if schema is None:
        raise NotAJournal(f"{path}: not a kvctl journal (not an Arrow IPC stream); left untouched")
    raw = (schema.metadata or {}).get(METADATA_KEY.encode())
    try:
        info = json.loads(raw) if raw else None
    except ValueError:
        info = None
    if type(info) is not dict or "journal_format" not in info and "kvctl_version" not in info:
        raise NotAJournal(f"{path}: not a kvctl journal (no kvctl header); left untouched")
    if schema.names not in (JOURNAL_SCHEMA.names, SCHEMA.names):
        raise NotAJournal(f"{path}: not a kvctl journal (unexpected columns); left untouched")
    return info
