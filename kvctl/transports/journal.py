"""Raw journals and the converter subprocess behind ``kvctl record``.

A *raw journal* is an Arrow IPC stream with one row per transport message: batch-level columns
only (receive time, source, topic, worker/dp labels, the recovered flag, the raw frames, the
decoder's error, how many events were recorded) — cheap enough to build on the recorder's hot
path (about a microsecond per message, no per-event work). The per-event Parquet rows of
:mod:`kvctl.formats.parquet` are produced later, by re-decoding the frames with
:func:`kvctl.formats.decode_zmq` / :func:`kvctl.formats.decode_nats` (deterministic: the same
events ``tap`` showed), then applying the recorder's filters (journal header) and the ``kept``
cut (``-c`` on the last batch). Batches that did not come straight from a decoder (a recording
re-recorded, a library caller) and gap markers are journalled *exactly* instead: their fields
as tagged JSON in the ``exact`` column.

The conversion runs in a separate process (:func:`main`, driven by :class:`Converter`), so it
never competes with the receive loop for the GIL. It follows the journal while recording: the
recorder sends the byte offset up to which the journal holds complete record batches after
each flush; the converter reads up to there (one record batch at a time: disk is the buffer),
appends Parquet row groups to a temp file, and when the recorder seals the journal (rotation or
close) finishes the file (metadata, fsync, atomic rename, journal removed). Its stdin is its
lifeline: end of input without an ``exit`` command means the recorder died, and the converter
removes its temp file and leaves the journal for ``kvctl recover``.

Protocol (JSON lines): recorder -> converter ``config`` (first line), ``open``, ``commit``,
``seal``, ``exit``; converter -> recorder ``ready``, ``progress``, ``done``, ``bye``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from array import array
from collections.abc import Iterator
from itertools import accumulate, chain
from operator import attrgetter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import __version__
from ..events import Batch
from ..formats import decode_nats, decode_zmq
from ..formats.parquet import (
    SCHEMA,
    SCHEMA_VERSION,
    Gap,
    NestingTooDeep,
    batches_to_record_batch,
    from_json_value,
    to_json_value,
)
from ..redact import redact_url

JOURNAL_FORMAT = 2
METADATA_KEY = "kvctl"
DEFAULT_ZSTD_LEVEL = 6
ROW_GROUP_ROWS = 64 * 1024

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
_NCOLS = len(JOURNAL_SCHEMA)

# Parquet tuning (bench/record_disk.py): random 64-bit hashes gain nothing from a dictionary,
# so they go PLAIN (+zstd); monotonic ints delta-encode; token ids (a Zipf-like vocabulary) and
# all strings use dictionaries. Nested columns are named by their leaf path.
_DICT = (
    "source",
    "topic",
    "publisher",
    "worker_id",
    "dp_rank",
    "format",
    "event_index",
    "recovered",
    "type",
    "hash_signed",
    "token_ids.list.element",
    "block_size",
    "lora_id",
    "lora_name",
    "medium",
    "storage_tier",
    "fields",
    "error",
    "frames_codec",
)
_DELTA = ("recv_ns", "seq", "batch_index", "event_id")


def parquet_options(compression_level: int) -> dict[str, Any]:
    return {
        "compression": "zstd",
        "compression_level": compression_level,
        "use_dictionary": list(_DICT),
        "column_encoding": dict.fromkeys(_DELTA, "DELTA_BINARY_PACKED"),
    }


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


# --- building journal rows (recorder side) ------------------------------------------------------


_I63 = 1 << 63


def _fit_int(v: Any) -> int | None:
    return v if type(v) is int and -_I63 <= v < _I63 else None


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
        exact = _dumps(to_json_value(fields))
    except NestingTooDeep as exc:  # recorded as what it is: a message kvctl cannot hold
        fields.update(events=[], error=f"not recorded as events: {exc} (raw frames kept)")
        exact = _dumps(to_json_value(fields))
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
        _dumps(to_json_value(fields)),
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
            table = {v: _dumps(to_json_value(v)) for v in set(values)}
            return list(map(table.__getitem__, values))
        except TypeError:  # an unhashable label (a Dynamo worker id that is a list, ...)
            pass
    return [_dumps(to_json_value(v)) for v in values]


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
    try:
        with pa.memory_map(str(path), "r") as source:
            return pa.ipc.open_stream(source).schema
    except (OSError, pa.ArrowException):
        return None


def journal_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
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


class Decoder:
    """Journal record batches -> record batches of the Parquet schema, in order.

    Raw rows are re-decoded, filtered and cut exactly as the recorder's pipeline did; exact
    rows are rebuilt from their JSON. Journals of the first format (already one row per event)
    pass through unchanged."""

    SLICE = 256  # messages decoded at once

    def __init__(self, info: dict[str, Any], raw_frames: str | None = None) -> None:
        self.next_index = int(info.get("first_batch_index") or 0)
        self.raw_frames = raw_frames or info.get("raw_frames") or "auto"
        spec = info.get("filters") or {}
        self.filters = None
        if spec.get("types") or spec.get("workers"):
            from ..pipeline import Filters

            self.filters = Filters(
                types=frozenset(spec.get("types") or ()),
                workers=frozenset(spec.get("workers") or ()),
            )
        self.labels = {k: from_json_value(v) for k, v in (info.get("labels") or {}).items()}
        self.mismatches = 0

    def convert(self, rb: pa.RecordBatch) -> pa.RecordBatch:
        if "event_index" in rb.schema.names:  # a format-1 journal: event rows already
            return rb
        if rb.num_rows > self.SLICE:  # decoded events are big Python objects: a few at once
            parts = [
                self.convert(rb.slice(i, self.SLICE)) for i in range(0, rb.num_rows, self.SLICE)
            ]
            return pa.Table.from_batches(parts, SCHEMA).combine_chunks().to_batches()[0]
        items = self.items(rb)
        out = batches_to_record_batch(items, self.next_index, self.raw_frames)
        self.next_index += sum(1 for b in items if type(b) is not Gap)
        return out

    def items(self, rb: pa.RecordBatch) -> list[Batch | Gap]:
        d = {
            name: rb.column(name).to_pylist()
            for name in (
                "recv_ns",
                "source",
                "topic",
                "worker_id",
                "dp_rank",
                "recovered",
                "frames",
                "events",
                "exact",
            )
        }
        out: list[Batch | Gap] = []
        labels: dict[str | None, Any] = {}
        filters = self.filters
        for i, exact in enumerate(d["exact"]):
            if exact is not None:
                out.append(_from_exact(exact, d["frames"][i]))
                continue
            source, frames, recv_ns = d["source"][i], d["frames"][i] or [], d["recv_ns"][i]
            if source.startswith(("nats://", "tls://")) and len(frames) == 1:
                batch = decode_nats(d["topic"][i], frames[0], source, recv_ns)
            else:
                w, dp = d["worker_id"][i], d["dp_rank"][i]
                if w is None and dp is None:
                    w_label, dp_label = self.labels.get(source) or (None, None)
                else:
                    if w not in labels:
                        labels[w] = from_json_value(json.loads(w)) if w is not None else None
                    if dp not in labels:
                        labels[dp] = from_json_value(json.loads(dp)) if dp is not None else None
                    w_label, dp_label = labels[w], labels[dp]
                batch = decode_zmq(frames, source, recv_ns, w_label, dp_label)
            if d["recovered"][i]:
                batch.recovered = True
            # What the pipeline kept: the filters' events, cut by -c on the last batch.
            events = filters.apply(batch) if filters is not None else batch.events
            n = d["events"][i]
            if len(events) != n:
                events = events[:n]
                if len(events) != n:
                    self.mismatches += 1  # cannot happen with kvctl's decoders: flagged
            batch.events = events
            out.append(batch)
        return out


def _from_exact(text: str, frames: list[bytes] | None) -> Batch | Gap:
    fields = from_json_value(json.loads(text))
    kind = fields.pop("kind")
    if kind == "gap":
        return Gap(**fields)
    return Batch(**fields, frames=list(frames or []))


def event_batches(path: str | os.PathLike[str]) -> Iterator[pa.RecordBatch]:
    """The Parquet-schema record batches of a journal (decoded on the fly; torn tail ok)."""
    decoder = Decoder(journal_metadata(path))
    for rb in read_journal(path):
        yield decoder.convert(rb)


# --- Parquet output -----------------------------------------------------------------------------


class Counts:
    """Running counts over Parquet-schema rows (kept by writers, recomputed by readers)."""

    FIELDS = ("rows", "batches", "events", "malformed", "gaps", "missing", "raw_bytes")

    def __init__(self) -> None:
        self.rows = self.batches = self.events = self.malformed = 0
        self.gaps = self.missing = self.raw_bytes = 0
        self.first_recv_ns: int | None = None
        self.last_recv_ns: int | None = None
        self.first_batch_index: int | None = None
        self.last_batch_index: int | None = None

    def add_record_batch(self, rb: pa.RecordBatch) -> None:
        n = rb.num_rows
        if not n:
            return
        self.rows += n
        self.events += n - rb.column("event_index").null_count
        raw_size = rb.column("raw_size")
        self.batches += n - raw_size.null_count
        self.malformed += n - rb.column("error").null_count
        self.raw_bytes += pc.sum(raw_size).as_py() or 0
        bi = rb.column("batch_index")
        if bi.null_count:
            for extra in rb.column("extra").filter(pc.is_null(bi)).to_pylist():
                self.gaps += 1
                self.missing += json.loads(extra).get("missing", 0) if extra else 0
        self._span("recv_ns", pc.min_max(rb.column("recv_ns")).as_py())
        self._span("batch_index", pc.min_max(bi).as_py())

    def _span(self, name: str, mm: dict[str, Any]) -> None:
        lo, hi = mm["min"], mm["max"]
        if lo is None:
            return
        first, last = f"first_{name}", f"last_{name}"
        if getattr(self, first) is None or lo < getattr(self, first):
            setattr(self, first, lo)
        if getattr(self, last) is None or hi > getattr(self, last):
            setattr(self, last, hi)

    def merge(self, other: Counts) -> None:
        for f in self.FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for name in ("recv_ns", "batch_index"):
            first = getattr(other, f"first_{name}")
            if first is not None:
                self._span(name, {"min": first, "max": getattr(other, f"last_{name}")})

    def as_dict(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in self.FIELDS}
        out.update(
            first_recv_ns=self.first_recv_ns,
            last_recv_ns=self.last_recv_ns,
            first_batch_index=self.first_batch_index,
            last_batch_index=self.last_batch_index,
        )
        return out


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_path(target: Path) -> Path:
    """A temp name unique to this process (a dying converter never unlinks another's file)."""
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def remove_stale_temps(target: Path) -> None:
    """Remove temp files of ``target`` left by processes that no longer run."""
    with contextlib.suppress(OSError):
        for entry in target.parent.glob(f".{target.name}.*.tmp"):
            pid = entry.name[len(target.name) + 2 : -4]
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue
            entry.unlink(missing_ok=True)


def writer_running(info: dict[str, Any]) -> int | None:
    """The pid of the kvctl process still writing the journal with header ``info``, if any
    (a pid reused by another program does not count)."""
    pid = info.get("writer_pid")
    if type(pid) is not int or pid == os.getpid() or not _alive(pid):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return pid if b"kvctl" in f.read() else None
    except OSError:
        return pid  # no /proc: trust the pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class OutputExists(FileExistsError):
    """The output path holds a file this run did not write."""


def publish(tmp: Path, target: Path, overwrite: bool) -> None:
    """Move a complete ``tmp`` to ``target`` atomically. Without ``overwrite`` an existing
    target is never replaced: a hard link fails if the name is taken (no check-then-rename
    race); file systems without hard links fall back to a checked rename."""
    if overwrite:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise OutputExists(f"{target} exists (written by someone else); not replaced") from None
    except OSError:
        if target.exists():
            raise OutputExists(f"{target} exists (written by someone else); not replaced") from None
        os.rename(tmp, target)
        return
    tmp.unlink()


_JOURNAL_ONLY = ("journal_format", "first_batch_index", "raw_frames", "writer_pid")


class ParquetOutput:
    """One Parquet file being written from a journal: temp file, row groups of ~64k rows,
    then metadata + fsync + atomic rename + journal removal in :meth:`finish`."""

    def __init__(self, target: Path, compression_level: int = DEFAULT_ZSTD_LEVEL) -> None:
        self.target = target
        self.tmp = temp_path(target)
        self.counts = Counts()
        try:
            self.writer = pq.ParquetWriter(self.tmp, SCHEMA, **parquet_options(compression_level))
        except BaseException:  # a full disk fails on the header: leave no empty temp file
            self.tmp.unlink(missing_ok=True)
            raise
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0

    def add(self, rb: pa.RecordBatch) -> None:
        if not rb.num_rows:
            return
        self.counts.add_record_batch(rb)
        self.pending.append(rb)
        self.pending_rows += rb.num_rows
        if self.pending_rows >= ROW_GROUP_ROWS:
            self._write()

    def _write(self) -> None:
        if self.pending:
            self.writer.write_table(pa.Table.from_batches(self.pending, SCHEMA))
            self.pending, self.pending_rows = [], 0

    def finish(
        self, info: dict[str, Any], journal: Path | None, overwrite: bool = False
    ) -> dict[str, Any]:
        """Complete the file and move it into place; only then remove ``journal``. An
        existing target is replaced only with ``overwrite`` (else :class:`OutputExists`,
        and the journal stays)."""
        try:
            self._write()
            meta = {k: v for k, v in info.items() if k not in _JOURNAL_ONLY}
            meta.update(
                kvctl_version=__version__,
                schema_version=SCHEMA_VERSION,
                counts=self.counts.as_dict(),
            )
            self.writer.add_key_value_metadata({METADATA_KEY: json.dumps(meta)})
            self.writer.close()
            with open(self.tmp, "rb") as f:
                os.fsync(f.fileno())
        except BaseException:
            self.abort()
            raise
        try:
            publish(self.tmp, self.target, overwrite)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.target.parent)
        if journal is not None:
            journal.unlink(missing_ok=True)
        meta["bytes"] = self.target.stat().st_size
        return meta

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
        self.tmp.unlink(missing_ok=True)


def journal_to_parquet(
    journal: Path,
    target: Path,
    info: dict[str, Any],
    compression_level: int = DEFAULT_ZSTD_LEVEL,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Convert a whole (possibly torn) journal in this process; returns the file's metadata
    (with counts, and ``mismatches`` if a re-decoded message disagreed with the journal)."""
    decoder = Decoder(journal_metadata(journal) or info)
    out = ParquetOutput(target, compression_level)
    try:
        for rb in read_journal(journal):
            out.add(decoder.convert(rb))
    except BaseException:
        out.abort()
        raise
    if decoder.mismatches:
        info = {**info, "mismatches": decoder.mismatches}
    return out.finish(info, journal, overwrite)


# --- the converter process ----------------------------------------------------------------------


class _Task:
    def __init__(self, msg: dict[str, Any], level: int) -> None:
        self.journal = Path(msg["journal"])
        self.target = Path(msg["target"])
        self.committed = int(msg.get("offset", 0))
        self.overwrite = bool(msg.get("overwrite", False))
        self.sealed: dict[str, Any] | None = None
        self.level = level
        self.file: Any = None
        self.schema: pa.Schema | None = None
        self.pos = 0
        self.decoder: Decoder | None = None
        self.out: ParquetOutput | None = None

    def step(self) -> bool:
        """Convert the next committed record batch; False when there is none yet."""
        if self.pos >= self.committed:
            return False
        if self.file is None:
            self.file = pa.OSFile(str(self.journal), "rb")
            message = pa.ipc.read_message(self.file)
            self.schema = pa.ipc.read_schema(message)
            info = json.loads((self.schema.metadata or {}).get(METADATA_KEY.encode(), b"{}"))
            self.decoder = Decoder(info)
            self.out = ParquetOutput(self.target, self.level)
            self.pos = self.file.tell()
            if self.pos >= self.committed:
                return True
        self.file.seek(self.pos)
        message = pa.ipc.read_message(self.file)
        rb = pa.ipc.read_record_batch(message, self.schema)
        self.pos = self.file.tell()
        assert self.decoder is not None and self.out is not None
        self.out.add(self.decoder.convert(rb))
        return True

    def finish(self) -> dict[str, Any]:
        assert self.sealed is not None
        if self.file is None:  # nothing was committed: an empty, valid file
            self.decoder = Decoder(self.sealed)
            self.out = ParquetOutput(self.target, self.level)
        else:
            self.file.close()
        assert self.out is not None and self.decoder is not None
        info = dict(self.sealed)
        if self.decoder.mismatches:
            info["mismatches"] = self.decoder.mismatches
        return self.out.finish(info, self.journal, self.overwrite)

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.out is not None:
            self.out.abort()


def _emit(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def main() -> int:
    """The converter process: ``python -m kvctl.transports.journal`` (driven by the recorder
    through stdin/stdout; see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the recorder decides when we stop
    fd = sys.stdin.fileno()
    buf = b""
    config: dict[str, Any] | None = None
    tasks: list[_Task] = []
    exiting = False
    ready = False
    while True:
        busy = bool(tasks) and (tasks[0].pos < tasks[0].committed or tasks[0].sealed is not None)
        r, _, _ = select.select([fd], [], [], 0 if busy else 0.05)
        if r:
            chunk = os.read(fd, 65536)
            if not chunk:  # the recorder died: leave its journals for `kvctl recover`
                for t in tasks:
                    t.abort()
                return 1
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                op = msg["op"]
                if op == "config":
                    config = msg
                    with contextlib.suppress(OSError):
                        os.nice(int(msg.get("nice", 0)))
                elif op == "open":
                    assert config is not None
                    tasks.append(
                        _Task(msg, int(config.get("compression_level", DEFAULT_ZSTD_LEVEL)))
                    )
                elif op == "commit":
                    for t in tasks:
                        if str(t.journal) == msg["journal"]:
                            t.committed = max(t.committed, int(msg["offset"]))
                elif op == "seal":
                    for t in tasks:
                        if str(t.journal) == msg["journal"]:
                            t.committed = max(t.committed, int(msg["offset"]))
                            t.sealed = msg["info"]
                elif op == "exit":
                    exiting = True
        if config is not None and not ready:
            ready = True
            _emit({"op": "ready", "pid": os.getpid()})
        if tasks:
            task = tasks[0]
            try:
                stepped = task.step()
            except Exception as exc:  # never a traceback, never a stray temp file: the
                tasks.pop(0)  # journal stays, and the recorder converts it or says why
                task.abort()
                _emit({"op": "failed", "journal": str(task.journal), "error": str(exc)})
                continue
            if stepped:
                _emit({"op": "progress", "journal": str(task.journal), "pos": task.pos})
            elif task.sealed is not None:
                tasks.pop(0)
                try:
                    meta = task.finish()
                except Exception as exc:  # e.g. the target appeared: the journal stays
                    task.abort()
                    _emit({"op": "failed", "journal": str(task.journal), "error": str(exc)})
                    continue
                _emit(
                    {
                        "op": "done",
                        "journal": str(task.journal),
                        "meta": meta,
                        "journal_bytes": task.committed,
                    }
                )
        elif exiting:
            import resource

            _emit({"op": "bye", "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
            return 0


class Converter:
    """The recorder's handle on a converter process: non-blocking both ways, so a stalled or
    dead converter never holds up the recorder (commits are coalesced, never queued without
    bound; essential commands wait in a small buffer)."""

    def __init__(self, config: dict[str, Any]) -> None:
        pkg_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = pkg_root + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        # The system allocator hands freed row-group buffers back to the OS: flat RSS.
        env.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl.transports.journal"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.out_fd = self.proc.stdin.fileno()
        self.in_fd = self.proc.stdout.fileno()
        os.set_blocking(self.out_fd, False)
        os.set_blocking(self.in_fd, False)
        self.outbox = bytearray()
        self.inbox = b""
        self.last_heard = time.monotonic()
        self.ready = False
        self.finished = False  # "bye" received
        self.peak_rss_kb: int | None = None
        self.send({"op": "config", **config})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, msg: dict[str, Any]) -> None:
        self.outbox += (json.dumps(msg) + "\n").encode()
        self.pump()

    def commit(self, journal: Path, offset: int) -> None:
        """Coalesced: when earlier commands are still waiting, the next seal/commit tells."""
        if not self.outbox:
            self.send({"op": "commit", "journal": str(journal), "offset": offset})

    def pump(self) -> list[dict[str, Any]]:
        """Write what we can, read what there is; returns the converter's messages."""
        if self.outbox:
            try:
                n = os.write(self.out_fd, self.outbox)
                del self.outbox[:n]
            except BlockingIOError:
                pass
            except OSError:  # broken pipe: the converter died
                self.outbox.clear()
        msgs = []
        while True:
            try:
                chunk = os.read(self.in_fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                break
            if not chunk:
                break
            self.inbox += chunk
        if b"\n" in self.inbox:
            *lines, self.inbox = self.inbox.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    msg = json.loads(line)
                    msgs.append(msg)
                    if msg.get("op") == "ready":
                        self.ready = True
                    elif msg.get("op") == "bye":
                        self.finished = True
                        self.peak_rss_kb = msg.get("peak_rss_kb")
            self.last_heard = time.monotonic()
        return msgs

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        self.close_pipes()

    def close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the recorder is gone; its journal stays for `kvctl recover`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
