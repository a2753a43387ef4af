"""Recordings on disk: a crash-safe writer, ``recover``, and readers for cat/tap/replay/inspect.

Write path. ``RecordingWriter.write`` only appends batches to an in-memory buffer; at least
every ``flush_interval`` seconds (a background thread sees to it even when the stream goes
quiet) or every ``flush_rows`` rows the buffer becomes one Arrow record batch appended to an
Arrow IPC *stream* journal beside the output. A stream journal is append-only and readable up
to its last complete message, so ``kill -9`` loses at most the last second; a Parquet file
without its footer, by contrast, is unreadable. On ``close`` (or rotation) the journal is
rewritten as Parquet (zstd) into a temp file that is atomically renamed into place, then the
journal is removed. :func:`recover` does the same for a journal a crash left behind.

Layouts::

    run.parquet                       one file (run.parquet.journal while recording)
    run/part-00000.parquet ...        with --rotate-size / --rotate-every: segments,
    run/_manifest.json                a manifest, and .part-NNNNN.parquet.journal while open

Segment journals and temp files are dot-files and the manifest starts with ``_`` so that
``pyarrow.dataset.dataset("run")`` and DuckDB's ``'run/*.parquet'`` read the directory as one
dataset without options (the same convention as Hive/Spark's ``_SUCCESS``).

pyarrow is imported here at module level: import this module lazily (inside commands).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import __version__
from ..events import Batch
from ..formats.parquet import (
    SCHEMA,
    SCHEMA_VERSION,
    Gap,
    batches_to_record_batch,
    columns_to_pylists,
    from_json_value,
    rows_to_batches,
)

__all__ = ["RecordingWriter", "recover", "open_recording", "recording_info", "Gap",
           "MANIFEST_NAME", "JOURNAL_SUFFIX"]

JOURNAL_SUFFIX = ".journal"
MANIFEST_NAME = "_manifest.json"
METADATA_KEY = "kvctl"
_SEGMENT_RE = re.compile(r"^part-(\d{5,})\.parquet$")
_SEGMENT_JOURNAL_RE = re.compile(r"^\.part-(\d{5,})\.parquet\.journal$")

# Parquet tuning (bench/record_disk.py): random 64-bit hashes gain nothing from a dictionary,
# so they go PLAIN (+zstd); monotonic ints delta-encode; token ids (a Zipf-like vocabulary) and
# all strings use dictionaries. Nested columns are named by their leaf path.
_DICT = ("source", "topic", "publisher", "worker_id", "dp_rank", "format", "event_index",
         "recovered", "type", "hash_signed", "token_ids.list.element", "block_size", "lora_id",
         "lora_name", "medium", "storage_tier", "fields", "error", "frames_codec")
_DELTA = ("recv_ns", "seq", "batch_index", "event_id")
DEFAULT_ZSTD_LEVEL = 6
ROW_GROUP_ROWS = 64 * 1024


def _parquet_options(compression_level: int) -> dict[str, Any]:
    return {
        "compression": "zstd",
        "compression_level": compression_level,
        "use_dictionary": list(_DICT),
        "column_encoding": dict.fromkeys(_DELTA, "DELTA_BINARY_PACKED"),
    }


# --- journals -----------------------------------------------------------------------------------


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


def _journal_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with pa.memory_map(str(path), "r") as source:
            meta = pa.ipc.open_stream(source).schema.metadata or {}
    except (OSError, pa.ArrowException):
        return {}
    raw = meta.get(METADATA_KEY.encode())
    return json.loads(raw) if raw else {}


class _Counts:
    """Running counts over written rows (kept by the writer, recomputed by recover/inspect)."""

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

    def merge(self, other: _Counts) -> None:
        for f in self.FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for name in ("recv_ns", "batch_index"):
            first = getattr(other, f"first_{name}")
            if first is not None:
                self._span(name, {"min": first, "max": getattr(other, f"last_{name}")})

    def as_dict(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in self.FIELDS}
        out.update(first_recv_ns=self.first_recv_ns, last_recv_ns=self.last_recv_ns,
                   first_batch_index=self.first_batch_index,
                   last_batch_index=self.last_batch_index)
        return out


def _fsync_dir(directory: Path) -> None:
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


def _journal_to_parquet(journal: Path, target: Path, info: dict[str, Any],
                        compression_level: int = DEFAULT_ZSTD_LEVEL) -> dict[str, Any]:
    """Rewrite a (possibly torn) journal as Parquet: temp file, fsync, atomic rename, then
    remove the journal. Returns the file's kvctl metadata (with counts)."""
    tmp = target.with_name(f".{target.name}.tmp")
    counts = _Counts()
    writer = pq.ParquetWriter(tmp, SCHEMA, **_parquet_options(compression_level))
    try:
        pending: list[pa.RecordBatch] = []
        pending_rows = 0
        for rb in read_journal(journal):
            counts.add_record_batch(rb)
            pending.append(rb)
            pending_rows += rb.num_rows
            if pending_rows >= ROW_GROUP_ROWS:
                # Row groups of ~64k rows: big enough for zstd, small enough for flat RSS.
                writer.write_table(pa.Table.from_batches(pending, SCHEMA))
                pending, pending_rows = [], 0
        if pending:
            writer.write_table(pa.Table.from_batches(pending, SCHEMA))
        meta = dict(info)
        meta.update(kvctl_version=__version__, schema_version=SCHEMA_VERSION,
                    counts=counts.as_dict())
        writer.add_key_value_metadata({METADATA_KEY: json.dumps(meta)})
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    writer.close()
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    journal.unlink(missing_ok=True)
    meta["bytes"] = target.stat().st_size
    return meta


# --- the writer ---------------------------------------------------------------------------------

_ROTATE = object()  # marker in the write buffer: a time boundary passed here


class _Journal:
    def __init__(self, path: Path, info: dict[str, Any]) -> None:
        self.path = path
        self.info = info
        self.sink = pa.OSFile(str(path), "wb")
        schema = SCHEMA.with_metadata({**SCHEMA.metadata,
                                       METADATA_KEY.encode(): json.dumps(info).encode()})
        self.writer = pa.ipc.new_stream(self.sink, schema)
        self.rows = 0
        self.bytes = self.sink.tell()

    def write(self, rb: pa.RecordBatch, fsync: bool) -> None:
        self.writer.write_batch(rb)
        self.rows += rb.num_rows
        self.bytes = self.sink.tell()
        self.sink.flush()  # OSFile writes straight to the fd: the data is in the page cache
        if fsync:
            os.fsync(self.sink.fileno())

    def close(self) -> None:
        self.writer.close()
        self.bytes = self.sink.tell()
        self.sink.close()


class RecordingWriter:
    """Record batches (and gaps) to ``path``: one Parquet file, or with ``rotate_size`` /
    ``rotate_every`` a directory of segments plus ``_manifest.json``.

    Thread-safe: ``write`` may be called from a receive loop while a background thread
    flushes the journal and another converts finished segments to Parquet.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rotate_size: int | None = None,
        rotate_every: float | None = None,
        metadata: dict[str, Any] | None = None,
        flush_interval: float = 1.0,
        flush_rows: int = 16 * 1024,
        fsync: bool = False,
        compression_level: int = DEFAULT_ZSTD_LEVEL,
        raw_frames: str = "auto",
        background: bool = True,
    ) -> None:
        """``metadata`` (JSON-able: sources, command line, ...) lands in every file's footer,
        the journal header and the manifest. ``rotate_size`` is in bytes of Parquet
        (estimated from the journal size and the previous segment's compression ratio);
        ``rotate_every`` in seconds, segments starting on multiples of it (60 -> at :00).
        ``raw_frames``: see :func:`~kvctl.formats.parquet.batches_to_record_batch`."""
        if rotate_size is not None and rotate_size <= 0:
            raise ValueError("rotate_size must be positive")
        if rotate_every is not None and rotate_every <= 0:
            raise ValueError("rotate_every must be positive")
        self.path = Path(path)
        self.rotate_size = rotate_size
        self.rotate_every = rotate_every
        self.segmented = rotate_size is not None or rotate_every is not None
        self.metadata = dict(metadata or {})
        self.flush_interval = flush_interval
        self.flush_rows = flush_rows
        self.fsync = fsync
        self.compression_level = compression_level
        self.raw_frames = raw_frames
        self.start_ns = time.time_ns()

        self._buf_lock = threading.Lock()  # guards the buffer and counters (held briefly)
        self._io_lock = threading.RLock()  # serialises journal writes and rotation
        self._meta_lock = threading.Lock()  # segment list + manifest (converter thread)
        self._buffer: list[Any] = []
        self._buffer_rows = 0
        self._last_flush = time.monotonic()
        self._next_index = 0
        self._journal: _Journal | None = None
        self._segment = 0
        self._segments: list[dict[str, Any]] = []
        self._pending: list[Future[dict[str, Any]]] = []
        self._ratio = 1.0  # parquet bytes / journal bytes of the last segment
        self._closed = False
        self._summary: dict[str, Any] | None = None
        self._error: Exception | None = None
        self.counts = {"batches": 0, "events": 0, "malformed": 0, "gaps": 0, "missing": 0,
                       "raw_bytes": 0, "parquet_bytes": 0}

        if self.segmented:
            self.path.mkdir(parents=True, exist_ok=True)
            self._converter: ThreadPoolExecutor | None = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvctl-record-convert")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._converter = None
        self._boundary = self._next_boundary(time.time()) if rotate_every else None

        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="kvctl-record-flush",
                                            daemon=True)
            self._thread.start()

    # -- public API ------------------------------------------------------------------------------

    def write(self, batches: Batch | Iterable[Batch]) -> None:
        """Queue batches for the journal (no I/O here unless the flusher falls far behind)."""
        if self._error is not None:
            raise self._error
        if isinstance(batches, Batch):
            batches = (batches,)
        c = self.counts
        with self._buf_lock:
            if self._closed:
                raise ValueError("write to a closed RecordingWriter")
            self._mark_boundary()
            for b in batches:
                self._buffer.append(b)
                n = len(b.events)
                self._buffer_rows += n or 1
                c["batches"] += 1
                c["events"] += n
                if b.error is not None:
                    c["malformed"] += 1
                c["raw_bytes"] += sum(map(len, b.frames))
            rows = self._buffer_rows
        if self._thread is None:
            if rows >= self.flush_rows or self._due():
                self.flush()
        elif rows >= self.flush_rows:
            self._wake.set()
            if rows >= 4 * self.flush_rows:
                self.flush()  # backpressure: never buffer without bound

    def write_gap(self, publisher: Any, from_seq: int, to_seq: int,
                  recv_ns: int | None = None, source: str = "") -> None:
        """Record that sequence numbers ``from_seq..to_seq`` (inclusive) of ``publisher``
        never arrived: a row of type ``Gap`` (``extra`` = from_seq, to_seq, missing)."""
        gap = Gap(publisher=publisher, from_seq=from_seq, to_seq=to_seq,
                  recv_ns=time.time_ns() if recv_ns is None else recv_ns, source=source)
        with self._buf_lock:
            if self._closed:
                raise ValueError("write to a closed RecordingWriter")
            self._mark_boundary()
            self._buffer.append(gap)
            self._buffer_rows += 1
            self.counts["gaps"] += 1
            self.counts["missing"] += gap.missing

    def flush(self) -> None:
        """Append everything buffered to the journal (and fsync if asked)."""
        with self._io_lock:
            with self._buf_lock:
                items, self._buffer, self._buffer_rows = self._buffer, [], 0
                self._last_flush = time.monotonic()
            start = 0
            for i, item in enumerate(items):
                if item is _ROTATE:
                    self._write_items(items[start:i])
                    self._rotate()
                    start = i + 1
            self._write_items(items[start:])

    def stats(self) -> dict[str, Any]:
        """Counters for a progress line: batches, events, malformed, gaps, missing,
        raw_bytes, bytes (journal + finished Parquet), file (being written), segments."""
        out: dict[str, Any] = dict(self.counts)
        journal = self._journal
        journal_bytes = journal.bytes if journal is not None else 0
        out["bytes"] = out.pop("parquet_bytes") + journal_bytes
        out["file"] = str(journal.path) if journal is not None else str(self.path)
        out["segments"] = len(self._segments)
        return out

    def close(self) -> dict[str, Any]:
        """Flush, convert the last journal to Parquet, write the manifest; returns a summary
        (metadata with counts, paths, bytes on disk). Idempotent."""
        if self._summary is not None:
            return self._summary
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        self.flush()
        with self._buf_lock:
            self._closed = True
        with self._io_lock:
            end_ns = time.time_ns()
            if self.segmented:
                self._finish_segment(end_ns)
                assert self._converter is not None
                self._converter.shutdown(wait=True)
                for fut in self._pending:
                    fut.result()  # surface conversion errors
                with self._meta_lock:
                    self._write_manifest(complete=True, end_ns=end_ns)
                files = [str(self.path / s["file"]) for s in self._segments]
            else:
                journal = self._journal
                if journal is None:  # nothing written: still leave a valid, empty file
                    journal = self._open_journal()
                journal.close()
                meta = _journal_to_parquet(journal.path, self.path,
                                           {**journal.info, "end_ns": end_ns},
                                           self.compression_level)
                self._segments.append(meta)
                self.counts["parquet_bytes"] = meta["bytes"]
                files = [str(self.path)]
            self._journal = None
        summary = {"kvctl_version": __version__, "schema_version": SCHEMA_VERSION,
                   "path": str(self.path), "files": files, "metadata": self.metadata,
                   "start_ns": self.start_ns, "end_ns": end_ns, **self.counts}
        summary["bytes"] = summary.pop("parquet_bytes")
        summary["ratio"] = (summary["bytes"] / summary["raw_bytes"]
                            if summary["raw_bytes"] else None)
        self._summary = summary
        return summary

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------

    def _next_boundary(self, now: float) -> float:
        every = self.rotate_every
        assert every is not None
        return (now // every + 1) * every

    def _mark_boundary(self) -> None:
        # Called with _buf_lock held: rows queued after a clock boundary go to a new segment.
        if self._boundary is not None:
            now = time.time()
            if now >= self._boundary:
                self._buffer.append(_ROTATE)
                self._boundary = self._next_boundary(now)

    def _due(self) -> bool:
        return bool(self._buffer) and time.monotonic() - self._last_flush >= self.flush_interval

    def _run(self) -> None:
        tick = min(0.1, self.flush_interval / 4)
        while not self._stop.is_set():
            self._wake.wait(tick)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._buf_lock:
                self._mark_boundary()
                due = self._buffer_rows >= self.flush_rows or self._due()
                rotate = _ROTATE in self._buffer if self._boundary is not None else False
            if due or rotate:
                try:
                    self.flush()
                except Exception as exc:  # disk full, ...: the next write/close raises it
                    self._error = exc
                    return

    def _open_journal(self) -> _Journal:
        info = {"kvctl_version": __version__, "schema_version": SCHEMA_VERSION,
                "metadata": self.metadata, "start_ns": self.start_ns,
                "opened_ns": time.time_ns()}
        if self.segmented:
            name = f"part-{self._segment:05d}.parquet"
            info["segment"] = self._segment
            info["file"] = name
            if self.rotate_every:
                # The clock window this segment covers (it starts on a boundary).
                end = self._boundary or self._next_boundary(time.time())
                info["window_start_ns"] = int((end - self.rotate_every) * 1e9)
                info["window_end_ns"] = int(end * 1e9)
            path = self.path / f".{name}{JOURNAL_SUFFIX}"
        else:
            path = self.path.with_name(self.path.name + JOURNAL_SUFFIX)
        self._journal = _Journal(path, info)
        return self._journal

    def _write_items(self, items: list[Any]) -> None:
        if not items:
            return
        rb = batches_to_record_batch(items, self._next_index, self.raw_frames)
        self._next_index += sum(1 for b in items if type(b) is not Gap)
        journal = self._journal or self._open_journal()
        journal.write(rb, self.fsync)
        if self.rotate_size is not None and journal.bytes * self._ratio >= self.rotate_size:
            self._rotate()

    def _rotate(self) -> None:
        if self.segmented and self._journal is not None and self._journal.rows:
            self._finish_segment(time.time_ns())

    def _finish_segment(self, end_ns: int) -> None:
        journal = self._journal
        if journal is None:
            return
        journal.close()
        self._journal = None
        self._segment += 1
        info = {**journal.info, "closed_ns": end_ns}
        assert self._converter is not None
        fut = self._converter.submit(self._convert_segment, journal, info)
        self._pending.append(fut)

    def _convert_segment(self, journal: _Journal, info: dict[str, Any]) -> dict[str, Any]:
        target = self.path / info["file"]
        meta = _journal_to_parquet(journal.path, target, info, self.compression_level)
        if journal.bytes:
            self._ratio = max(meta["bytes"] / journal.bytes, 0.01)
        with self._meta_lock:
            self._segments.append(meta)
            self._segments.sort(key=lambda s: s["segment"])
            self.counts["parquet_bytes"] += meta["bytes"]
            self._write_manifest(complete=False)
        return meta

    def _write_manifest(self, complete: bool, end_ns: int | None = None) -> None:
        _write_manifest(self.path, self._segments, self.metadata, complete,
                        {"start_ns": self.start_ns, "end_ns": end_ns,
                         "rotate_size": self.rotate_size, "rotate_every": self.rotate_every})


def _segment_entry(meta: dict[str, Any]) -> dict[str, Any]:
    entry = {k: meta.get(k) for k in ("file", "segment", "bytes", "opened_ns", "closed_ns",
                                      "window_start_ns", "window_end_ns", "recovered")
             if meta.get(k) is not None}
    entry.update(meta.get("counts", {}))
    return entry


def _write_manifest(directory: Path, segments: list[dict[str, Any]], metadata: dict[str, Any],
                    complete: bool, extra: dict[str, Any]) -> None:
    totals = _Counts()
    for seg in segments:
        c = _Counts()
        for k, v in seg.get("counts", {}).items():
            setattr(c, k, v)
        totals.merge(c)
    manifest = {"format": "kvctl-recording", "kvctl_version": __version__,
                "schema_version": SCHEMA_VERSION, "complete": complete, "metadata": metadata,
                **extra, "counts": totals.as_dict(),
                "bytes": sum(s.get("bytes", 0) for s in segments),
                "segments": [_segment_entry(s) for s in segments]}
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, directory / MANIFEST_NAME)


# --- recover ------------------------------------------------------------------------------------


def recover(journal_path: str | os.PathLike[str]) -> Path:
    """Turn what a crashed recorder left into Parquet; returns the recording's path.

    Accepts a journal (``run.parquet.journal``), the recording path whose journal exists
    (``run.parquet``), or a segment directory (every leftover segment journal is converted
    and the manifest rebuilt). Every complete record batch in the journal is kept.
    """
    path = Path(journal_path)
    if path.is_dir():
        return _recover_directory(path)
    if not path.name.endswith(JOURNAL_SUFFIX):
        candidate = path.with_name(path.name + JOURNAL_SUFFIX)
        if not candidate.exists():
            raise FileNotFoundError(f"no journal to recover at {candidate}")
        path = candidate
    if _SEGMENT_JOURNAL_RE.match(path.name):
        return _recover_directory(path.parent)
    target = path.with_name(path.name[: -len(JOURNAL_SUFFIX)])
    _recover_one(path, target)
    return target


def _recover_one(journal: Path, target: Path) -> dict[str, Any]:
    info = _journal_metadata(journal)
    if target.exists():
        # A crash between the rename and the unlink: the Parquet file is already complete.
        journal.unlink()
        return _file_metadata(target)
    info.update(recovered=True, recovered_ns=time.time_ns())
    return _journal_to_parquet(journal, target, info)


def _recover_directory(directory: Path) -> Path:
    for entry in sorted(directory.iterdir()):
        m = _SEGMENT_JOURNAL_RE.match(entry.name)
        if m:
            _recover_one(entry, directory / entry.name[1: -len(JOURNAL_SUFFIX)])
    segments = []
    metadata: dict[str, Any] = {}
    for entry in _segment_files(directory):
        meta = _file_metadata(entry)
        meta["file"] = entry.name
        meta["bytes"] = entry.stat().st_size
        meta.setdefault("segment", int(_SEGMENT_RE.match(entry.name).group(1)))
        metadata = meta.get("metadata", metadata)
        segments.append(meta)
    old: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        old = json.loads((directory / MANIFEST_NAME).read_text())
    extra = {k: old.get(k) for k in ("start_ns", "rotate_size", "rotate_every")}
    extra.update(end_ns=None, recovered=True)
    _write_manifest(directory, segments, old.get("metadata", metadata), True, extra)
    return directory


# --- reading ------------------------------------------------------------------------------------


def _segment_files(directory: Path) -> list[Path]:
    found = [(int(m.group(1)), e) for e in directory.iterdir()
             if (m := _SEGMENT_RE.match(e.name))]
    return [e for _, e in sorted(found)]


def _sources(path: Path) -> list[tuple[str, Path]]:
    """(kind, path) of everything that holds rows, in recorded order."""
    if path.is_dir():
        items: list[tuple[int, str, Path]] = []
        for e in path.iterdir():
            if m := _SEGMENT_RE.match(e.name):
                items.append((int(m.group(1)), "parquet", e))
            elif (m := _SEGMENT_JOURNAL_RE.match(e.name)) and not (
                    path / e.name[1: -len(JOURNAL_SUFFIX)]).exists():
                items.append((int(m.group(1)), "journal", e))
        return [(kind, p) for _, kind, p in sorted(items)]
    if path.name.endswith(JOURNAL_SUFFIX):
        return [("journal", path)]
    if path.exists():
        return [("parquet", path)]
    journal = path.with_name(path.name + JOURNAL_SUFFIX)
    if journal.exists():
        return [("journal", journal)]
    raise FileNotFoundError(f"no recording at {path}")


def _record_batches(path: Path, columns: list[str] | None = None,
                    batch_size: int = 16 * 1024) -> Iterator[pa.RecordBatch]:
    for kind, p in _sources(path):
        if kind == "parquet":
            yield from pq.ParquetFile(p).iter_batches(batch_size=batch_size, columns=columns)
        else:
            for rb in read_journal(p):
                yield rb.select(columns) if columns else rb


def open_recording(path: str | os.PathLike[str], include_gaps: bool = False,
                   batch_size: int = 16 * 1024) -> Iterator[Batch | Gap]:
    """Iterate the batches of a recording (file, segment directory or journal), in recorded
    order, with their events and raw frames. ``include_gaps`` also yields :class:`Gap`."""
    pending: dict[str, list[Any]] | None = None
    for rb in _record_batches(Path(path), batch_size=batch_size):
        cols = columns_to_pylists(rb)
        if pending is not None:
            cols = {k: pending[k] + v for k, v in cols.items()}
        bi = cols["batch_index"]
        n = len(bi)
        # A batch's rows may straddle two chunks: hold the last group back until the next.
        cut = n
        if n and bi[-1] is not None:
            cut = n - 1
            while cut > 0 and bi[cut - 1] == bi[-1]:
                cut -= 1
        yield from rows_to_batches(cols, 0, cut, include_gaps)
        pending = {k: v[cut:] for k, v in cols.items()} if cut < n else None
    if pending is not None:
        yield from rows_to_batches(pending, 0, len(pending["batch_index"]), include_gaps)


def _file_metadata(path: Path) -> dict[str, Any]:
    kv = pq.ParquetFile(path).metadata.metadata or {}
    raw = kv.get(METADATA_KEY.encode())
    return json.loads(raw) if raw else {}


_INFO_COLUMNS = ["recv_ns", "ts", "publisher", "seq", "worker_id", "type", "batch_index",
                 "event_index", "error", "raw_size", "extra"]


def recording_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything ``kvctl inspect`` shows, computed by scanning the recording column-wise:
    schema version, metadata, files and sizes, time range, seq range per publisher, counts by
    type and worker, gaps, malformed count, and size on disk / raw frame bytes."""
    root = Path(path)
    sources = _sources(root)
    files = []
    metadata: dict[str, Any] = {}
    schema_version = None
    size = 0
    for kind, p in sources:
        st = p.stat().st_size
        size += st
        meta = _file_metadata(p) if kind == "parquet" else _journal_metadata(p)
        if not metadata:
            metadata = meta.get("metadata", {})
            schema_version = meta.get("schema_version")
        files.append({"path": str(p), "kind": kind, "bytes": st})
    counts = _Counts()
    by_type: dict[str, int] = {}
    by_worker: dict[str, int] = {}
    publishers: dict[str, dict[str, Any]] = {}
    gaps: list[dict[str, Any]] = []
    ts_lo = ts_hi = None
    for rb in _record_batches(root, columns=_INFO_COLUMNS, batch_size=64 * 1024):
        counts.add_record_batch(rb)
        for key, col in (("type", rb.column("type")), ("worker_id", None)):
            if key == "worker_id":
                events = pc.is_valid(rb.column("event_index"))
                col = rb.column("worker_id").filter(events)
            vc = pc.value_counts(col.cast(pa.string()))
            target = by_type if key == "type" else by_worker
            for item in vc.to_pylist():
                name = item["values"]
                name = "null" if name is None else name
                target[name] = target.get(name, 0) + item["counts"]
        mm = pc.min_max(rb.column("ts")).as_py()
        if mm["min"] is not None:
            ts_lo = mm["min"] if ts_lo is None else min(ts_lo, mm["min"])
            ts_hi = mm["max"] if ts_hi is None else max(ts_hi, mm["max"])
        firsts = rb.filter(pc.is_valid(rb.column("raw_size")))
        if firsts.num_rows:
            table = pa.Table.from_batches([firsts.select(["publisher", "seq"])])
            table = table.set_column(0, "publisher", table.column(0).cast(pa.string()))
            agg = table.group_by("publisher").aggregate(
                [("seq", "min"), ("seq", "max"), ("seq", "count"), ("seq", "count_distinct")])
            for row in agg.to_pylist():
                key = row["publisher"] if row["publisher"] is not None else "null"
                p = publishers.setdefault(key, {"batches": 0, "min_seq": None,
                                                "max_seq": None, "distinct_seqs": 0})
                p["batches"] += row["seq_count"]
                p["distinct_seqs"] += row["seq_count_distinct"]  # per chunk: an upper bound
                if row["seq_min"] is not None:
                    p["min_seq"] = row["seq_min"] if p["min_seq"] is None else min(
                        p["min_seq"], row["seq_min"])
                    p["max_seq"] = row["seq_max"] if p["max_seq"] is None else max(
                        p["max_seq"], row["seq_max"])
        bi = rb.column("batch_index")
        if bi.null_count:
            gap_rows = rb.filter(pc.is_null(bi))
            for pub, extra in zip(gap_rows.column("publisher").to_pylist(),
                                  gap_rows.column("extra").to_pylist(), strict=True):
                g = from_json_value(json.loads(extra)) if extra else {}
                gaps.append({"publisher": pub, **g})
    raw = counts.raw_bytes
    return {
        "path": str(root),
        "schema_version": schema_version,
        "kvctl_version": _first_version(sources),
        "metadata": metadata,
        "files": files,
        "bytes": size,
        "raw_bytes": raw,
        "ratio": size / raw if raw else None,
        "rows": counts.rows,
        "batches": counts.batches,
        "events": counts.events,
        "malformed": counts.malformed,
        "gaps": counts.gaps,
        "missing": counts.missing,
        "gap_list": gaps,
        "first_recv_ns": counts.first_recv_ns,
        "last_recv_ns": counts.last_recv_ns,
        "first_ts": ts_lo,
        "last_ts": ts_hi,
        "by_type": dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
        "by_worker": dict(sorted(by_worker.items(), key=lambda kv: -kv[1])),
        "publishers": publishers,
        "journals": sum(k == "journal" for k, _ in sources),  # read from unconverted journals
    }


def _first_version(sources: list[tuple[str, Path]]) -> str | None:
    for kind, p in sources:
        meta = _file_metadata(p) if kind == "parquet" else _journal_metadata(p)
        if meta.get("kvctl_version"):
            return meta["kvctl_version"]
    return None
