"""Recordings on disk: the crash-safe :class:`RecordingWriter` behind ``kvctl record``.

The receive loop only appends a tuple of batch fields per transport message to a buffer
(:meth:`RecordingWriter.write_message`; no per-event work, no I/O). A background thread
appends it as one record batch of a *raw journal* (one row per message, raw frames; see
:mod:`kvctl.recording.journal`) to an Arrow IPC stream ``PATH.journal`` at least every
``flush_interval`` seconds, so ``kill -9`` loses at most the last second. A converter
*subprocess* (:mod:`kvctl.recording.converter`) follows the journal, re-decodes the frames and
writes the per-event Parquet file (zstd) into a temp file, atomically renamed into place when
the journal is sealed (close or rotation); then the journal is removed. If the converter dies,
recording goes on (the journal is the truth) and a new converter, or ``close`` itself,
converts from the journal; :func:`kvctl.recording.recover.recover` does the same for a journal
a crash left behind. Rotation, the segment directory and its manifest: see
:mod:`kvctl.recording.layout`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import __version__
from ..events import Batch
from ..redact import redact_metadata, redact_url
from ..selection import Filters
from .convert import DEFAULT_ZSTD_LEVEL, journal_to_parquet
from .converter import Converter
from .disk import OutputExists, remove_stale_temps
from .journal import (
    JOURNAL_FORMAT,
    Chunk,
    JournalWriter,
    RowBuffer,
    exact_row,
    gap_row,
    message_fields,
    message_fields_unlabelled,
)
from .layout import (
    JOURNAL_SUFFIX,
    output_conflict,
    segment_files,
    write_manifest,
)
from .reader import file_metadata
from .schema import SCHEMA_VERSION, Gap
from .tagged_json import to_json_value

CONVERTER_RESTARTS = 3  # a converter that keeps dying: the rest is converted at close
CONVERTER_NICE = 19  # the receive loop comes first; conversion uses idle CPU (disk buffers)
CONVERTER_EXIT_S = 5.0  # after a failure: how long the converter may take to stop
CONVERTER_STALL_S = 60.0  # at close: a converter silent this long is replaced by inline work
MAX_READY_CHUNKS = 16  # built chunks waiting for the I/O thread before the caller writes them
FLUSH_BYTES = 4_000_000  # raw frames buffered before a chunk is cut: large batches stay bounded


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
        filters: Filters | None = None,
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
        ``raw_frames``: see :func:`~kvctl.recording.rows.batches_to_record_batch`.
        ``filters``: what the pipeline applied to the batches given to :meth:`write_message`;
        the conversion applies them again.
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
        try:
            summary = self._finish()
        except BaseException:
            self._release_converter()  # no converter process outlives a failed close
            raise
        self._summary = summary
        return summary

    def _finish(self) -> dict[str, Any]:
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
        summary: dict[str, Any] = {
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
        return summary

    def _release_converter(self) -> None:
        """After a failure: the converter is told what a recorder's death tells it (its pipes
        close), so it stops at once and leaves every unconverted journal to `kvctl recover`;
        it is killed if it has not exited within a few seconds."""
        conv = self._converter
        if conv is None:
            return
        self._converter = None
        conv.close_pipes()
        try:
            conv.proc.wait(CONVERTER_EXIT_S)
        except subprocess.TimeoutExpired:
            conv.kill()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------

    def _continue_segments(self) -> None:
        """--append: keep the directory's segments in the manifest; number new segments and
        batches after them (readers take the directory in segment order)."""
        for number, entry in segment_files(self.path):
            meta = file_metadata(entry)
            meta["file"] = entry.name
            meta["bytes"] = entry.stat().st_size
            meta["segment"] = number
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
            meta = file_metadata(seg.target)  # converted; the converter died before telling
            meta["bytes"] = seg.target.stat().st_size
        else:
            meta = journal_to_parquet(
                path, seg.target, info, self.compression_level, self.overwrite
            )
            self.converter_info["inline_conversions"] += 1
        self._done(str(path), meta, seg.journal.bytes)

    def _write_manifest(self, complete: bool, end_ns: int | None = None) -> None:
        write_manifest(
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
