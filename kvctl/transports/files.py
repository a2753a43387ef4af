"""Recordings on disk: a crash-safe writer, ``recover``, and readers for cat/tap/replay/inspect.

Write path. The receive loop only appends a tuple of batch fields per transport message to a
queue (:meth:`RecordingWriter.write_message`; no per-event work, no I/O). A background thread
turns the queue into one record batch of a *raw journal* (one row per message, raw frames;
see :mod:`kvctl.transports.journal`) appended to an Arrow IPC stream ``PATH.journal`` at least
every ``flush_interval`` seconds, so ``kill -9`` loses at most the last second. A converter
*subprocess* follows the journal, re-decodes the frames and writes the per-event Parquet file
(zstd) into a temp file, atomically renamed into place when the journal is sealed (close or
rotation); then the journal is removed. If the converter dies, recording goes on (the journal is
the truth) and a new converter, or ``close`` itself, converts from the journal;
:func:`recover` does the same for a journal a crash left behind.

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
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import chain
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
    columns_to_pylists,
    from_json_value,
    rows_to_batches,
    to_json_value,
)
from ..redact import redact_metadata, redact_url
from .journal import (
    DEFAULT_ZSTD_LEVEL,
    JOURNAL_FORMAT,
    METADATA_KEY,
    ROW_GROUP_ROWS,
    Chunk,
    Converter,
    JournalWriter,
    NotAJournal,
    OutputExists,
    RowBuffer,
    event_batches,
    exact_row,
    gap_row,
    journal_header,
    journal_metadata,
    journal_to_parquet,
    message_fields,
    message_fields_unlabelled,
    read_journal,
    remove_stale_temps,
    writer_running,
)
from .journal import Counts as _Counts

__all__ = [
    "RecordingWriter",
    "recover",
    "open_recording",
    "recording_info",
    "Gap",
    "MANIFEST_NAME",
    "JOURNAL_SUFFIX",
    "read_journal",
    "DEFAULT_ZSTD_LEVEL",
    "ROW_GROUP_ROWS",
    "NotAJournal",
    "OutputExists",
    "NotARecording",
    "output_conflict",
    "leftover_journals",
    "RecorderRunning",
]

JOURNAL_SUFFIX = ".journal"
MANIFEST_NAME = "_manifest.json"
_SEGMENT_RE = re.compile(r"^part-(\d{5,})\.parquet$")
_SEGMENT_JOURNAL_RE = re.compile(r"^\.part-(\d{5,})\.parquet\.journal$")

CONVERTER_RESTARTS = 3  # a converter that keeps dying: the rest is converted at close
CONVERTER_NICE = 19  # the receive loop comes first; conversion uses idle CPU (disk buffers)
CONVERTER_STALL_S = 60.0  # at close: a converter silent this long is replaced by inline work
MAX_READY_CHUNKS = 16  # built chunks waiting for the I/O thread before the caller writes them
FLUSH_BYTES = 4_000_000  # raw frames buffered before a chunk is cut: large batches stay bounded


def _journal_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    return journal_metadata(path)


class RecorderRunning(ValueError):
    """The journal belongs to a recorder that is still running: not ours to convert."""


class NotARecording(ValueError):
    """A file or directory that kvctl did not write (or not in a shape it can read)."""


def _journal_of(path: Path) -> Path:
    return path.with_name(path.name + JOURNAL_SUFFIX)


def leftover_journals(path: str | os.PathLike[str]) -> list[Path]:
    """Journals a killed recorder left at ``path`` (a recording file or segment directory)."""
    path = Path(path)
    if path.is_dir():
        return sorted(e for e in path.iterdir() if _SEGMENT_JOURNAL_RE.match(e.name))
    journal = _journal_of(path)
    return [journal] if journal.exists() else []


def _is_kvctl_entry(name: str) -> bool:
    return bool(
        _SEGMENT_RE.match(name)
        or _SEGMENT_JOURNAL_RE.match(name)
        or name == MANIFEST_NAME
        or name.startswith((".part-", f".{MANIFEST_NAME}"))
    )


def output_conflict(
    path: str | os.PathLike[str],
    segmented: bool,
    overwrite: bool = False,
    append: bool = False,
    options: bool = True,
) -> str | None:
    """Why recording to ``path`` would destroy or mix in data this run did not write, with
    the remedy; None when it is safe. A recording file is replaced only with ``overwrite``;
    a segment directory must be new or empty, or, with ``append``, hold a kvctl recording
    (new segments are numbered after its last). An unconverted journal is never touched.
    ``options``: name record's ``--overwrite``/``--append`` in the remedy."""
    path = Path(path)
    journals = leftover_journals(path) if path.exists() or _journal_of(path).exists() else []
    if journals:
        return (
            f"{journals[0]} is the journal of a recording that was never converted; run "
            f"`kvctl recover {path}` first (or move it away)"
        )
    if not segmented:
        if path.is_dir():
            return (
                f"{path} is a directory; give a file path (run.parquet), or write "
                "segments into a directory with --rotate-size/--rotate-every"
            )
        if path.exists() and not overwrite:
            how = ", or --overwrite to replace it" if options else " (or remove it first)"
            return f"{path} exists; give a new path{how}"
        return None
    if not path.exists():
        return None
    if not path.is_dir():
        return f"{path} is a file; rotation writes a directory of segments"
    names = [e.name for e in path.iterdir()]
    if not names:
        return None
    if not append:
        how = ", or --append to add segments to the recording in it" if options else ""
        return f"{path} is not empty; give a new or empty directory{how}"
    if not any(_is_kvctl_entry(n) for n in names):
        return f"{path} holds no kvctl recording; --append adds segments to one"
    return None


# --- the writer ---------------------------------------------------------------------------------

_ROTATE = object()  # marker in the write queue: a time boundary passed here


class _Segment:
    """A journal not yet converted: being written, or sealed and waiting for the converter."""

    def __init__(self, journal: JournalWriter, target: Path) -> None:
        self.journal = journal
        self.target = target
        self.sealed_info: dict[str, Any] | None = None


class RecordingWriter:
    """Record batches (and gaps) to ``path``: one Parquet file, or with ``rotate_size`` /
    ``rotate_every`` a directory of segments plus ``_manifest.json``.

    ``write_message``/``write``/``write_gap`` are called from one thread (the receive loop)
    while a background thread writes the journal and talks to the converter process.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        rotate_size: int | None = None,
        rotate_every: float | None = None,
        metadata: dict[str, Any] | None = None,
        flush_interval: float = 1.0,
        flush_rows: int = 2048,
        fsync: bool = False,
        compression_level: int = DEFAULT_ZSTD_LEVEL,
        raw_frames: str = "auto",
        background: bool = True,
        filters: Any = None,
        labels: dict[str, tuple[Any, Any]] | None = None,
        converter: bool = True,
        overwrite: bool = False,
        append: bool = False,
    ) -> None:
        """``metadata`` (JSON-able: sources, command line, ...) lands in every file's footer,
        the journal header and the manifest. ``rotate_size`` is in bytes of Parquet
        (estimated from the journal size and the previous segment's compression ratio);
        ``rotate_every`` in seconds, segments starting on multiples of it (60 -> at :00).
        ``flush_rows``: messages queued before a flush is due regardless of time.
        ``raw_frames``: see :func:`~kvctl.formats.parquet.batches_to_record_batch`.
        ``filters`` (a :class:`~kvctl.pipeline.Filters`): what the pipeline applied to the
        batches given to :meth:`write_message`; the conversion applies it again.
        ``labels``: source address -> (worker label, dp rank label) as the decoder got them
        (``SourceSpec``); then :meth:`write_message` journals no per-message labels.
        ``converter=False``: no converter process; journals are converted at close.
        ``overwrite``: replace an existing recording file (at the end, atomically);
        ``append``: add segments to the recording in an existing segment directory. Without
        them, an output holding data raises :class:`OutputExists` (see
        :func:`output_conflict`)."""
        if rotate_size is not None and rotate_size <= 0:
            raise ValueError("rotate_size must be positive")
        if rotate_every is not None and rotate_every <= 0:
            raise ValueError("rotate_every must be positive")
        self.path = Path(path)
        self.rotate_size = rotate_size
        self.rotate_every = rotate_every
        self.segmented = rotate_size is not None or rotate_every is not None
        conflict = output_conflict(self.path, self.segmented, overwrite, append, options=False)
        if conflict is not None:
            raise OutputExists(conflict)
        self.overwrite = overwrite and not self.segmented
        self.metadata = redact_metadata(metadata or {})  # footer, journal, manifest: no secrets
        self.flush_interval = flush_interval
        self.flush_rows = flush_rows
        self.fsync = fsync
        self.compression_level = compression_level
        self.raw_frames = raw_frames
        self.filters = (
            {"types": sorted(filters.types), "workers": sorted(filters.workers)}
            if filters is not None
            else None
        )
        self.start_ns = time.time_ns()

        # keyed as the journal's (redacted) source column is
        self.labels = (
            {redact_url(k): to_json_value(list(v)) for k, v in labels.items()}
            if labels is not None
            else None
        )
        self._fields = message_fields if labels is None else message_fields_unlabelled
        self._buf = RowBuffer(labelled=labels is None)  # what the receive loop appends to
        self._buffered_bytes = 0  # raw frames in self._buf (approximately: see _cut)
        self._busy = False  # the writing thread is appending to a buffer (see _cut)
        self._ready: deque[Any] = deque()  # built chunks (and rotation marks) to write
        self._cut_lock = threading.Lock()  # one builder at a time keeps the order
        self._io_lock = threading.RLock()  # serialises journal writes, rotation, converter
        self._last_flush = time.monotonic()
        self._next_index = 0
        self._journal: JournalWriter | None = None
        self._open: list[_Segment] = []  # journals not converted yet, in order
        self._segment = 0
        self._segments: list[dict[str, Any]] = []
        self._ratio = 1.0  # parquet bytes / journal bytes of the last converted segment
        self._refusal: Exception | None = None  # set on close or a flush error
        self._closed = False
        self._summary: dict[str, Any] | None = None
        self.counts = {
            "batches": 0,
            "events": 0,
            "malformed": 0,
            "gaps": 0,
            "missing": 0,
            "raw_bytes": 0,
            "parquet_bytes": 0,
        }
        self.converter_info: dict[str, Any] = {
            "restarts": 0,
            "inline_conversions": 0,
            "peak_rss_kb": None,
        }

        if self.segmented:
            self.path.mkdir(parents=True, exist_ok=True)
            if append:
                self._continue_segments()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._boundary = self._next_boundary(time.time()) if rotate_every else None
        self._converter: Converter | None = None
        if converter:
            self._converter = self._start_converter()

        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._inline = not background
        if background:
            self._thread = threading.Thread(
                target=self._run, name="kvctl-record-flush", daemon=True
            )
            self._thread.start()

    # -- public API ------------------------------------------------------------------------------

    def write_message(self, batch: Batch, events: list | None = None) -> None:
        """Queue a batch exactly as :func:`~kvctl.formats.decode_zmq`/``decode_nats`` returned
        it (``recovered`` may be set), ``events`` being what the filters and limits kept of
        it (the first n of what the writer's ``filters`` keep; ``None``: all). Only its
        frames and labels are journalled: the conversion decodes them again.

        The receive loop's hot path: a few appends; every ``flush_rows`` messages, one record
        batch built column-wise here (no GIL hand-off to another thread), written by the
        background thread."""
        if self._refusal is not None:
            raise self._refusal
        if self._boundary is not None:
            self._mark_boundary()
        fields = self._fields(batch)
        n = len(batch.events if events is None else events)
        self._busy = True  # before reading self._buf: see _cut
        buf = self._buf
        buf.rows.append(fields)
        buf.events.append(n)
        buf.frames.append(batch.frames)
        self._busy = False
        self._buffered_bytes += sum(map(len, batch.frames))
        if len(buf.rows) >= self.flush_rows or self._buffered_bytes >= FLUSH_BYTES:
            self._cut()

    def write(self, batches: Batch | Iterable[Batch]) -> None:
        """Queue batches to be recorded exactly as given (events included, whatever made
        them): slower than :meth:`write_message`, for batches that are not a decoder's."""
        if isinstance(batches, Batch):
            batches = (batches,)
        for b in batches:
            self._put(*exact_row(b), len(b.events))

    def write_gap(
        self,
        publisher: Any,
        from_seq: int,
        to_seq: int,
        recv_ns: int | None = None,
        source: str = "",
    ) -> None:
        """Record that sequence numbers ``from_seq..to_seq`` (inclusive) of ``publisher``
        never arrived: a row of type ``Gap`` (``extra`` = from_seq, to_seq, missing)."""
        gap = Gap(
            publisher=publisher,
            from_seq=from_seq,
            to_seq=to_seq,
            recv_ns=time.time_ns() if recv_ns is None else recv_ns,
            source=source,
        )
        self._put(*gap_row(gap), 0)

    def _put(self, row: tuple, frames: list[bytes], events: int) -> None:
        if self._refusal is not None:
            raise self._refusal
        if self._boundary is not None:
            self._mark_boundary()
        self._busy = True
        buf = self._buf
        buf.add_special(row, frames, events)
        self._busy = False
        full = len(buf) >= self.flush_rows
        if full or (self._inline and self._due()):
            self._cut()

    def flush(self) -> None:
        """Append everything queued to the journal (and fsync if asked)."""
        self._cut(write=False)
        self._write_ready()

    def _cut(self, write: bool | None = None, rotate: bool = False) -> None:
        """Turn what is buffered into a journal chunk ready to write (and, with ``rotate``,
        mark a segment boundary after it)."""
        with self._cut_lock:
            buf = self._buf
            self._buf = RowBuffer(buf.labelled)
            self._buffered_bytes = 0
            self._last_flush = time.monotonic()
            # Lock-free hand-over (writes come from one thread, the receive loop): a write
            # sets _busy before it reads self._buf, so once _busy is seen clear after the
            # swap no write to the old buffer is in flight. Only the flush thread ever waits.
            while self._busy and threading.current_thread() is self._thread:
                time.sleep(0.0002)
            if len(buf):
                self._ready.append(buf.build())
            if rotate:
                self._ready.append(_ROTATE)
        if write is None:
            write = self._inline or len(self._ready) > MAX_READY_CHUNKS
        if write:
            self._write_ready()  # no thread, or it fell behind: never buffer without bound
        elif self._ready:
            self._wake.set()

    def _write_ready(self) -> None:
        with self._io_lock:
            ready = self._ready
            while ready:
                chunk = ready.popleft()
                if chunk is _ROTATE:
                    self._rotate()
                else:
                    self._write_chunk(chunk)
            self._service()

    def stats(self) -> dict[str, Any]:
        """Counters for a progress line: batches, events, malformed, gaps, missing,
        raw_bytes, bytes (journals + finished Parquet), file (being written), segments."""
        out: dict[str, Any] = dict(self.counts)
        journal = self._journal
        out["bytes"] = out.pop("parquet_bytes") + sum(s.journal.bytes for s in self._open)
        out["file"] = str(journal.path) if journal is not None else str(self.path)
        out["segments"] = len(self._segments)
        return out

    def converter_ready(self, timeout: float = 10.0) -> bool:
        """Wait until the converter process runs (benchmarks start timing after this)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._io_lock:
                conv = self._converter
                if conv is None:
                    return False
                self._handle(conv.pump())
                if conv.ready:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> dict[str, Any]:
        """Flush, seal the last journal, let the converter finish (or convert here if it is
        gone), write the manifest; returns a summary (metadata with counts, paths, bytes on
        disk). Idempotent."""
        if self._summary is not None:
            return self._summary
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        error = self._refusal
        if error is not None:
            raise error
        self.flush()
        self._refusal = ValueError("write to a closed RecordingWriter")
        with self._io_lock:
            end_ns = time.time_ns()
            if (
                self._journal is None
                and not self.segmented
                and not self._segments
                and not self._open
            ):
                self._open_journal()  # nothing written: still leave a valid, empty file
            if self._journal is not None:
                self._seal(end_ns)
            self._drain_converter()
            for seg in list(self._open):  # what the converter did not do (it died, ...)
                self._convert_inline(seg)
            if self.segmented:
                self._write_manifest(complete=True, end_ns=end_ns)
                files = [str(self.path / s["file"]) for s in self._segments]
            else:
                files = [str(self.path)]
        summary = {
            "kvctl_version": __version__,
            "schema_version": SCHEMA_VERSION,
            "path": str(self.path),
            "files": files,
            "metadata": self.metadata,
            "start_ns": self.start_ns,
            "end_ns": end_ns,
            **self.counts,
            "converter": dict(self.converter_info),
        }
        summary["bytes"] = summary.pop("parquet_bytes")
        summary["ratio"] = summary["bytes"] / summary["raw_bytes"] if summary["raw_bytes"] else None
        self._summary = summary
        return summary

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------

    def _continue_segments(self) -> None:
        """--append: keep the directory's segments in the manifest; number new segments and
        batches after them (readers take the directory in segment order)."""
        for entry in _segment_files(self.path):
            meta = _file_metadata(entry)
            meta["file"] = entry.name
            meta["bytes"] = entry.stat().st_size
            meta["segment"] = int(_SEGMENT_RE.match(entry.name).group(1))
            self._segments.append(meta)
            self._segment = meta["segment"] + 1
            last = (meta.get("counts") or {}).get("last_batch_index")
            if isinstance(last, int):
                self._next_index = max(self._next_index, last + 1)

    def _next_boundary(self, now: float) -> float:
        every = self.rotate_every
        assert every is not None
        return (now // every + 1) * every

    def _mark_boundary(self) -> None:
        # Rows buffered after a clock boundary go to a new segment.
        now = time.time()
        boundary = self._boundary
        if boundary is not None and now >= boundary:
            self._boundary = self._next_boundary(now)
            self._cut(rotate=True)

    def _due(self) -> bool:
        return bool(len(self._buf)) and time.monotonic() - self._last_flush >= self.flush_interval

    def _run(self) -> None:
        tick = min(0.05, self.flush_interval / 4)
        while not self._stop.is_set():
            self._wake.wait(tick)
            self._wake.clear()
            try:
                if self._boundary is not None and time.time() >= self._boundary:
                    self._mark_boundary()
                if self._due():
                    self._cut(write=False)
                self._write_ready()
            except Exception as exc:  # disk full, ...: the next write/close raises it
                self._refusal = exc
                return

    def _write_chunk(self, chunk: Chunk) -> None:
        journal = self._journal or self._open_journal()
        self._next_index += chunk.batches
        journal.write(chunk.rb, self.fsync)
        # counted once in the journal: after a failed write (disk full) the counts say what
        # `kvctl recover` gets back
        c = self.counts
        c["batches"] += chunk.batches
        c["events"] += chunk.events
        c["malformed"] += chunk.malformed
        c["gaps"] += chunk.gaps
        c["missing"] += chunk.missing
        c["raw_bytes"] += chunk.raw_bytes
        if self._converter is not None:
            self._converter.commit(journal.path, journal.offset)
        if self.rotate_size is not None and journal.bytes * self._ratio >= self.rotate_size:
            self._rotate()

    def _rotate(self) -> None:
        if self.segmented and self._journal is not None and self._journal.rows:
            self._seal(time.time_ns())

    def _open_journal(self) -> JournalWriter:
        info: dict[str, Any] = {
            "kvctl_version": __version__,
            "schema_version": SCHEMA_VERSION,
            "journal_format": JOURNAL_FORMAT,
            "metadata": self.metadata,
            "start_ns": self.start_ns,
            "opened_ns": time.time_ns(),
            "writer_pid": os.getpid(),
            "first_batch_index": self._next_index,
            "raw_frames": self.raw_frames,
        }
        if self.filters is not None:
            info["filters"] = self.filters
        if self.labels is not None:
            info["labels"] = self.labels
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
            target = self.path / name
        else:
            path = self.path.with_name(self.path.name + JOURNAL_SUFFIX)
            target = self.path
        self._journal = JournalWriter(path, info)
        self._open.append(_Segment(self._journal, target))
        if self._converter is not None:
            self._converter.send(
                {
                    "op": "open",
                    "journal": str(path),
                    "target": str(target),
                    "offset": self._journal.offset,
                    "overwrite": self.overwrite,
                }
            )
        return self._journal

    def _seal(self, end_ns: int) -> None:
        journal = self._journal
        assert journal is not None
        offset = journal.offset
        journal.close()
        self._journal = None
        seg = self._open[-1]
        key = "closed_ns" if self.segmented else "end_ns"
        seg.sealed_info = {**journal.info, key: end_ns}
        if self.segmented:
            self._segment += 1
        if self._converter is not None:
            self._converter.send(
                {
                    "op": "seal",
                    "journal": str(journal.path),
                    "offset": offset,
                    "info": seg.sealed_info,
                }
            )

    # -- the converter process -------------------------------------------------------------------

    def _start_converter(self) -> Converter | None:
        try:
            return Converter({"compression_level": self.compression_level, "nice": CONVERTER_NICE})
        except OSError:
            return None

    def _service(self) -> None:
        """Exchange messages with the converter; replace it if it died (io lock held)."""
        conv = self._converter
        if conv is None:
            return
        self._handle(conv.pump())
        if conv.alive() or conv.finished:
            return
        self._handle(conv.pump())  # its last words
        conv.kill()
        self._converter = None
        for seg in self._open:
            remove_stale_temps(seg.target)
        if self.converter_info["restarts"] >= CONVERTER_RESTARTS or self._closed:
            return
        self.converter_info["restarts"] += 1
        new = self._start_converter()
        self._converter = new
        if new is None:
            return
        for seg in self._open:  # start over from the journals: they are the truth
            j = seg.journal
            new.send(
                {
                    "op": "open",
                    "journal": str(j.path),
                    "target": str(seg.target),
                    "offset": j.offset,
                    "overwrite": self.overwrite,
                }
            )
            if seg.sealed_info is not None:
                new.send(
                    {
                        "op": "seal",
                        "journal": str(j.path),
                        "offset": j.offset,
                        "info": seg.sealed_info,
                    }
                )

    def _handle(self, msgs: list[dict[str, Any]]) -> None:
        for msg in msgs:
            if msg.get("op") == "done":
                self._done(msg["journal"], msg["meta"], msg.get("journal_bytes", 0))
            elif msg.get("op") == "bye":
                self.converter_info["peak_rss_kb"] = msg.get("peak_rss_kb")
            elif msg.get("op") == "failed":  # its journal is converted here at close
                self.converter_info.setdefault("failures", []).append(msg.get("error"))

    def _done(self, journal: str, meta: dict[str, Any], journal_bytes: int) -> None:
        seg = next((s for s in self._open if str(s.journal.path) == journal), None)
        if seg is None:
            return
        self._open.remove(seg)
        if journal_bytes:
            # Capped at 1: a small segment's Parquet is mostly fixed overhead (footer, ...).
            self._ratio = min(max(meta["bytes"] / journal_bytes, 0.01), 1.0)
        self.counts["parquet_bytes"] += meta["bytes"]
        self._segments.append(meta)
        if self.segmented:
            self._segments.sort(key=lambda s: s["segment"])
            self._write_manifest(complete=False)

    def _drain_converter(self) -> None:
        """At close: let the converter finish every sealed journal, then exit."""
        self._closed = True
        conv = self._converter
        if conv is None:
            return
        conv.send({"op": "exit"})
        while True:
            self._handle(conv.pump())
            if conv.finished or not conv.alive():
                break
            if time.monotonic() - conv.last_heard > CONVERTER_STALL_S:
                break  # stuck (stopped?): do the rest here
            time.sleep(0.01)
        self._handle(conv.pump())
        if conv.finished:
            with contextlib.suppress(Exception):
                conv.proc.wait(5)
            conv.close_pipes()
        else:
            conv.kill()
        self._converter = None
        for seg in self._open:
            remove_stale_temps(seg.target)

    def _convert_inline(self, seg: _Segment) -> None:
        info = seg.sealed_info or {**seg.journal.info, "closed_ns": time.time_ns()}
        path = seg.journal.path
        if seg.target.exists() and not path.exists():
            meta = _file_metadata(seg.target)  # converted; the converter died before telling
            meta["bytes"] = seg.target.stat().st_size
        else:
            meta = journal_to_parquet(
                path, seg.target, info, self.compression_level, self.overwrite
            )
            self.converter_info["inline_conversions"] += 1
        self._done(str(path), meta, seg.journal.bytes)

    def _write_manifest(self, complete: bool, end_ns: int | None = None) -> None:
        _write_manifest(
            self.path,
            self._segments,
            self.metadata,
            complete,
            {
                "start_ns": self.start_ns,
                "end_ns": end_ns,
                "rotate_size": self.rotate_size,
                "rotate_every": self.rotate_every,
            },
        )


def _segment_entry(meta: dict[str, Any]) -> dict[str, Any]:
    entry = {
        k: meta.get(k)
        for k in (
            "file",
            "segment",
            "bytes",
            "opened_ns",
            "closed_ns",
            "window_start_ns",
            "window_end_ns",
            "recovered",
        )
        if meta.get(k) is not None
    }
    entry.update(meta.get("counts", {}))
    return entry


def _write_manifest(
    directory: Path,
    segments: list[dict[str, Any]],
    metadata: dict[str, Any],
    complete: bool,
    extra: dict[str, Any],
) -> None:
    totals = _Counts()
    for seg in segments:
        c = _Counts()
        for k, v in seg.get("counts", {}).items():
            setattr(c, k, v)
        totals.merge(c)
    manifest = {
        "format": "kvctl-recording",
        "kvctl_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "complete": complete,
        "metadata": metadata,
        **extra,
        "counts": totals.as_dict(),
        "bytes": sum(s.get("bytes", 0) for s in segments),
        "segments": [_segment_entry(s) for s in segments],
    }
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, directory / MANIFEST_NAME)


# --- recover ------------------------------------------------------------------------------------


def recover(
    journal_path: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> Path:
    """Turn what a crashed recorder left into Parquet; returns the recording's path.

    Accepts a journal (``run.parquet.journal``), the recording path whose journal exists
    (``run.parquet``), or a segment directory (every leftover segment journal is converted
    and the manifest rebuilt). Every complete record batch in the journal is kept.

    Nothing that this call did not write is replaced or removed: a file that is not a kvctl
    journal raises :class:`NotAJournal`; an existing output that is not this journal's
    conversion raises :class:`OutputExists` (recover to ``output`` instead); the journal is
    removed only once a complete output holding all of it is in place.
    """
    path = Path(journal_path)
    if path.is_dir():
        if output is not None:
            raise NotARecording(f"{path}: a segment directory is recovered in place (no -o)")
        return _recover_directory(path)
    if not path.name.endswith(JOURNAL_SUFFIX):
        candidate = _journal_of(path)
        if not candidate.exists():
            raise FileNotFoundError(f"no journal to recover at {candidate}")
        path = candidate
    if _SEGMENT_JOURNAL_RE.match(path.name) and output is None:
        return _recover_directory(path.parent)
    target = (
        Path(output) if output is not None else path.with_name(path.name[: -len(JOURNAL_SUFFIX)])
    )
    _recover_one(path, target, explicit=output is not None)
    return target


def _recover_one(journal: Path, target: Path, explicit: bool = False) -> dict[str, Any]:
    info = journal_header(journal)
    pid = writer_running(info)
    if pid is not None:
        raise RecorderRunning(
            f"{journal} is being written by a running recorder (pid {pid}); "
            "stop it instead (Ctrl-C or SIGTERM converts it)"
        )
    remove_stale_temps(target)
    if target.exists():
        if not explicit and _converted_from(target, journal, info):
            # A crash between the rename and the unlink: the Parquet file is already complete.
            journal.unlink()
            return _file_metadata(target)
        hint = "" if explicit else " with -o NEW.parquet"
        raise OutputExists(
            f"{target} exists and is not this journal's recording; recover "
            f"to a new path{hint} ({journal} is kept)"
        )
    info.update(recovered=True, recovered_ns=time.time_ns())
    return journal_to_parquet(journal, target, info, overwrite=False)


def _converted_from(target: Path, journal: Path, info: dict[str, Any]) -> bool:
    """``target`` is the complete conversion of ``journal``: the same recorder segment (start
    and open times) and at least as many batches and gaps as the journal holds."""
    try:
        meta = _file_metadata(target)
    except (OSError, ValueError):
        return False
    if not meta or (meta.get("start_ns"), meta.get("opened_ns")) != (
        info.get("start_ns"),
        info.get("opened_ns"),
    ):
        return False
    counts = meta.get("counts") or {}
    journalled = sum(rb.num_rows for rb in read_journal(journal))
    return int(counts.get("batches", 0)) + int(counts.get("gaps", 0)) >= journalled


def _recover_directory(directory: Path) -> Path:
    names = [e.name for e in directory.iterdir()]
    if not any(_is_kvctl_entry(n) for n in names):
        raise NotARecording(
            f"{directory}: no kvctl recording here (no segments, journals or "
            "manifest); nothing changed"
        )
    old_manifest: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        old_manifest = json.loads((directory / MANIFEST_NAME).read_text())
    if not leftover_journals(directory) and old_manifest.get("complete"):
        raise FileNotFoundError(
            f"no journal to recover in {directory} (its recording is complete); nothing changed"
        )
    for entry in sorted(directory.iterdir()):  # a live recorder's directory is its own
        if _SEGMENT_JOURNAL_RE.match(entry.name):
            with contextlib.suppress(NotAJournal):
                pid = writer_running(journal_header(entry))
                if pid is not None:
                    raise RecorderRunning(
                        f"{directory} is being written by a running recorder (pid {pid}); "
                        "stop it instead (Ctrl-C or SIGTERM converts it); nothing changed"
                    )
    refused: list[str] = []
    for entry in sorted(directory.iterdir()):
        m = _SEGMENT_JOURNAL_RE.match(entry.name)
        if m:
            try:
                _recover_one(entry, directory / entry.name[1 : -len(JOURNAL_SUFFIX)])
            except (NotAJournal, OutputExists, RecorderRunning) as exc:
                refused.append(str(exc))
    for entry in list(directory.glob(".part-*.tmp")):
        remove_stale_temps(directory / (entry.name[1:].split(".parquet.")[0] + ".parquet"))
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
    _write_manifest(directory, segments, old.get("metadata", metadata), not refused, extra)
    if refused:
        raise OutputExists(
            refused[0] + (f" (and {len(refused) - 1} more)" if len(refused) > 1 else "")
        )
    return directory


# --- reading ------------------------------------------------------------------------------------


def _segment_files(directory: Path) -> list[Path]:
    found = [(int(m.group(1)), e) for e in directory.iterdir() if (m := _SEGMENT_RE.match(e.name))]
    return [e for _, e in sorted(found)]


def _sources(path: Path) -> list[tuple[str, Path]]:
    """(kind, path) of everything that holds rows, in recorded order; each one checked to be
    a kvctl recording or journal whose columns have the schema's types (else
    :class:`NotARecording`: one clear line rather than a traceback or "0 events")."""
    found = _find_sources(path)
    for kind, p in found:
        label = "" if p == path else f"{p.name}: "
        if kind == "parquet":
            _check_parquet(p, label)
        else:
            try:
                journal_header(p)
            except NotAJournal:
                raise NotARecording(f"{label}not a kvctl recording (not a kvctl journal)") from None
    return found


def _type_fits(actual: pa.DataType, expected: pa.DataType) -> bool:
    """``actual`` reads back as ``expected`` (dictionary or plain strings, list field names
    and 32/64-bit offsets aside)."""
    if actual.equals(expected):
        return True
    if pa.types.is_dictionary(expected):
        value = actual.value_type if pa.types.is_dictionary(actual) else actual
        return pa.types.is_string(value) or pa.types.is_large_string(value)
    if pa.types.is_list(expected) or pa.types.is_large_list(expected):
        return (pa.types.is_list(actual) or pa.types.is_large_list(actual)) and _type_fits(
            actual.value_type, expected.value_type
        )
    if pa.types.is_binary(expected):
        return pa.types.is_large_binary(actual)
    if pa.types.is_string(expected):
        return pa.types.is_large_string(actual)
    return False


def _check_parquet(p: Path, label: str) -> None:
    pf = pq.ParquetFile(p)
    raw = (pf.metadata.metadata or {}).get(METADATA_KEY.encode())
    if raw is None:
        raise NotARecording(f"{label}not a kvctl recording (no kvctl metadata)")
    try:
        version = json.loads(raw).get("schema_version")
    except (ValueError, AttributeError):
        raise NotARecording(f"{label}damaged kvctl metadata (not a JSON object)") from None
    if type(version) is not int or version > SCHEMA_VERSION:
        raise NotARecording(
            f"{label}recording schema version {version!r}; this kvctl reads "
            f"version {SCHEMA_VERSION} (upgrade kvctl)"
        )
    schema = pf.schema_arrow
    for name, expected in zip(SCHEMA.names, SCHEMA.types, strict=True):
        index = schema.get_field_index(name)
        if index < 0:
            raise NotARecording(
                f"{label}column {name} is missing (a kvctl recording of "
                f"schema {SCHEMA_VERSION} has it)"
            )
        actual = schema.field(index).type
        if not _type_fits(actual, expected):
            raise NotARecording(f"{label}column {name} has type {actual}, expected {expected}")


def _find_sources(path: Path) -> list[tuple[str, Path]]:
    if path.is_dir():
        items: list[tuple[int, str, Path]] = []
        for e in path.iterdir():
            if m := _SEGMENT_RE.match(e.name):
                items.append((int(m.group(1)), "parquet", e))
            elif (m := _SEGMENT_JOURNAL_RE.match(e.name)) and not (
                path / e.name[1 : -len(JOURNAL_SUFFIX)]
            ).exists():
                items.append((int(m.group(1)), "journal", e))
        if not items and not (path / MANIFEST_NAME).exists():
            raise FileNotFoundError(f"no recording in {path} (no segments, no manifest)")
        return [(kind, p) for _, kind, p in sorted(items)]
    if path.name.endswith(JOURNAL_SUFFIX):
        return [("journal", path)]
    if path.exists():
        return [("parquet", path)]
    journal = path.with_name(path.name + JOURNAL_SUFFIX)
    if journal.exists():
        return [("journal", journal)]
    raise FileNotFoundError(f"no recording at {path}")


def _record_batches(
    path: Path, columns: list[str] | None = None, batch_size: int = 16 * 1024
) -> Iterator[pa.RecordBatch]:
    for kind, p in _sources(path):
        if kind == "parquet":
            yield from pq.ParquetFile(p).iter_batches(batch_size=batch_size, columns=columns)
        else:
            for rb in event_batches(p):
                yield rb.select(columns) if columns else rb


def open_recording(
    path: str | os.PathLike[str], include_gaps: bool = False, batch_size: int = 16 * 1024
) -> Iterator[Batch | Gap]:
    """Iterate the batches of a recording (file, segment directory or journal), in recorded
    order, with their events and raw frames. ``include_gaps`` also yields :class:`Gap`.

    A batch's rows may straddle many chunks (a million-event batch spans dozens): its pieces
    are held and joined once, when the batch is complete, so reading stays linear. Rows no
    kvctl writer produces (a damaged or doctored file) raise :class:`NotARecording`."""
    try:
        yield from _read_batches(Path(path), include_gaps, batch_size)
    except _DAMAGE as exc:
        raise NotARecording(f"damaged recording ({type(exc).__name__}: {exc})") from None


# What rows that passed the schema check can still raise when a file was damaged or doctored.
_DAMAGE = (RecursionError, KeyError, TypeError, IndexError, AttributeError, OverflowError)


def _read_batches(path: Path, include_gaps: bool, batch_size: int) -> Iterator[Batch | Gap]:
    held: list[dict[str, list[Any]]] = []  # pieces of the batch that straddles chunks
    held_index: Any = None
    for rb in _record_batches(path, batch_size=batch_size):
        cols = columns_to_pylists(rb)
        bi = cols["batch_index"]
        n = len(bi)
        start = 0
        if held:
            while start < n and bi[start] == held_index:
                start += 1
            if start:
                held.append({k: v[:start] for k, v in cols.items()})
            if start == n:
                continue
            yield from _joined_batches(held, include_gaps)
            held = []
        # Hold the last group back: its rows may go on in the next chunk.
        cut = n
        if n > start and bi[-1] is not None:
            cut = n - 1
            while cut > start and bi[cut - 1] == bi[-1]:
                cut -= 1
        yield from rows_to_batches(cols, start, cut, include_gaps)
        if cut < n:
            held = [{k: v[cut:] for k, v in cols.items()}]
            held_index = bi[-1]
    if held:
        yield from _joined_batches(held, include_gaps)


def _joined_batches(pieces: list[dict[str, list[Any]]], include_gaps: bool) -> list[Batch | Gap]:
    if len(pieces) == 1:
        cols = pieces[0]
    else:
        cols = {k: list(chain.from_iterable(p[k] for p in pieces)) for k in pieces[0]}
    return rows_to_batches(cols, 0, len(cols["batch_index"]), include_gaps)


def _file_metadata(path: Path) -> dict[str, Any]:
    kv = pq.ParquetFile(path).metadata.metadata or {}
    raw = kv.get(METADATA_KEY.encode())
    return json.loads(raw) if raw else {}


_INFO_COLUMNS = [
    "recv_ns",
    "ts",
    "publisher",
    "seq",
    "worker_id",
    "type",
    "batch_index",
    "event_index",
    "error",
    "raw_size",
    "extra",
]


def recording_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Everything ``kvctl inspect`` shows, computed by scanning the recording column-wise:
    schema version, metadata, files and sizes, time range, seq range per publisher, counts by
    type and worker, gaps, malformed count, and size on disk / raw frame bytes."""
    try:
        return _recording_info(Path(path))
    except _DAMAGE as exc:
        raise NotARecording(f"damaged recording ({type(exc).__name__}: {exc})") from None


def _recording_info(root: Path) -> dict[str, Any]:
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
        # Counts by type and worker are of events (event_index set): kvctl's own rows (Gap,
        # Malformed, a batch without events) have none, so a producer's event named "Gap"
        # is counted as an event and never as a gap (gaps and malformed come from the
        # batch_index and error columns).
        events = pc.is_valid(rb.column("event_index"))
        for key in ("type", "worker_id"):
            col = rb.column(key).filter(events)
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
                [("seq", "min"), ("seq", "max"), ("seq", "count"), ("seq", "count_distinct")]
            )
            for row in agg.to_pylist():
                key = row["publisher"] if row["publisher"] is not None else "null"
                p = publishers.setdefault(
                    key, {"batches": 0, "min_seq": None, "max_seq": None, "distinct_seqs": 0}
                )
                p["batches"] += row["seq_count"]
                p["distinct_seqs"] += row["seq_count_distinct"]  # per chunk: an upper bound
                if row["seq_min"] is not None:
                    p["min_seq"] = (
                        row["seq_min"]
                        if p["min_seq"] is None
                        else min(p["min_seq"], row["seq_min"])
                    )
                    p["max_seq"] = (
                        row["seq_max"]
                        if p["max_seq"] is None
                        else max(p["max_seq"], row["seq_max"])
                    )
        bi = rb.column("batch_index")
        if bi.null_count:
            gap_rows = rb.filter(pc.is_null(bi))
            for pub, extra in zip(
                gap_rows.column("publisher").to_pylist(),
                gap_rows.column("extra").to_pylist(),
                strict=True,
            ):
                g = from_json_value(json.loads(extra)) if extra else {}
                gaps.append({"publisher": pub, **g})
    raw = counts.raw_bytes
    return {
        "path": str(root),
        "schema_version": schema_version,
        "kvctl_version": _first_version(sources),
        "metadata": redact_metadata(metadata),  # recordings of older versions held secrets
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
