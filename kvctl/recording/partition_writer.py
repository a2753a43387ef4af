"""Segments of a partitioned recorder (``kvctl record nats://... --stream NAME``): the fleet
messages of one stream partition, buffered as journal rows, cut into segments and written as
Parquet into a dataset (:mod:`kvctl.recording.dataset`). Knows no sockets: the command feeds
it what the JetStream transport delivered and acks what it says is committed.

"The stream is the journal": nothing is journalled locally. A partition's messages are kept
in memory as journal rows (:class:`~kvctl.recording.journal.RowBuffer`: per message a fields
tuple and its raw frames, no per-event decoding) until the segment is cut: on size, on a clock
boundary of the rotation interval, when the UTC hour of the receive time changes (a hive file
lies in one ``dt=/hour=`` directory) and at exit. A cut segment is decoded by the recording
converter (:class:`~kvctl.recording.convert.Decoder`, as a journal's rows are), sorted by
(worker_id, dp_rank, seq) (stable: equal keys keep stream order), written to a hidden temp
name, fsynced, renamed into place, its directory fsynced; only then does the command ack its
messages. A recorder killed between the rename and the ack resumes after the last segment on
disk and skips what the stream delivers again (counted).

pyarrow is imported at module level: import this module only from code that records.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from .. import __version__
from ..events import Batch
from ..partitions import FleetMessage
from .convert import DEFAULT_ZSTD_LEVEL, Decoder, parquet_options
from .counts import Counts
from .dataset import (
    Segment,
    check_bucket,
    display_location,
    hour_of,
    is_remote,
    leftover_temps,
    list_segments,
    open_root,
    s3_error,
    segment_path,
    temp_path,
)
from .disk import fsync_dir, publish
from .journal import RowBuffer, exact_row, gap_row
from .schema import METADATA_KEY, SCHEMA, SCHEMA_VERSION, Gap
from .tagged_json import from_json_value

SEGMENT_ROW_GROUP_ROWS = 256 * 1024
"""Rows per Parquet row group of a segment (DuckDB and Spark parallelise per row group)."""
FLEET_FORMAT = "kvctl-fleet"
"""The ``format`` of a Malformed row whose fleet envelope could not be read."""


def count_events(frames: list[bytes]) -> int:
    """How many events an engine batch holds, read off its msgpack headers (no decoding):
    ``[ts, [event, ...], dp_rank?]`` in the third frame. -1 when the message has another
    shape (the caller decodes it)."""
    if len(frames) != 3:
        return -1
    p = frames[2]
    if len(p) < 3 or p[0] not in (0x92, 0x93):
        return -1
    tag = p[1]
    if tag == 0xCB:
        i = 10
    elif tag == 0xCA:
        i = 6
    elif tag < 0x80 or tag >= 0xE0:
        i = 2
    elif 0xCC <= tag <= 0xD3:
        i = 2 + (1, 2, 4, 8)[(tag - 0xCC) % 4]
    else:
        return -1
    if i >= len(p):
        return -1
    head = p[i]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and i + 3 <= len(p):
        return int.from_bytes(p[i + 1 : i + 3], "big")
    if head == 0xDD and i + 5 <= len(p):
        return int.from_bytes(p[i + 1 : i + 5], "big")
    return -1


def decoded_events(frames: list[bytes], source: str, topic: str) -> int:
    """The event count of a message of another shape, decoded as the recorder would (0 for a
    malformed one: its row is Malformed)."""
    from ..formats import decode_nats, decode_zmq

    if source.startswith(("nats://", "tls://")) and len(frames) == 1:
        batch = decode_nats(topic, frames[0], source)
    else:
        batch = decode_zmq(frames, source)
    return len(batch.events)


@dataclass
class PartitionBuffer:
    """The open segment of one partition."""

    partition: int
    rows: RowBuffer = field(default_factory=lambda: RowBuffer(labelled=True))
    first_seq: int = 0
    last_seq: int = 0
    first_recv_ns: int = 0
    hour: int = -1
    raw_bytes: int = 0
    events: int = 0
    cut_at: float = 0.0
    """Wall-clock time of the next rotation boundary (0: no time limit)."""
    last_handle: Any = None
    sources: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class Committed:
    """A segment written and in place: what the command acks and reports."""

    partition: int
    path: str
    segment: Segment
    messages: int
    rows: int
    bytes: int
    handle: Any


@dataclass
class Tally:
    """What a recorder saw, for its progress line and summary."""

    messages: int = 0
    events: int = 0
    gaps: int = 0
    malformed_envelopes: int = 0
    skipped: int = 0
    """Messages delivered again with a stream seq a segment already holds (acked, skipped)."""
    segments: int = 0
    bytes: int = 0
    rows: int = 0


class DatasetWriter:
    """Segments of some partitions of one stream, written into one dataset location."""

    def __init__(
        self,
        location: str,
        stream: str,
        partitions: list[int],
        partition_count: int,
        layout: str = "flat",
        rotate_bytes: int = 32_000_000,
        rotate_every: float | None = 60.0,
        compression_level: int = DEFAULT_ZSTD_LEVEL,
        row_group_rows: int = SEGMENT_ROW_GROUP_ROWS,
        command: list[str] | None = None,
    ) -> None:
        self.location = display_location(location)
        """Where the dataset is, as shown (keys in an ``s3://KEY:SECRET@`` URL masked)."""
        self._location = location
        self._open_error: OSError | None = None
        try:
            self.fs, self.root = open_root(location)
        except OSError as exc:  # S3's region lookup: said by the first listing (remove_leftovers)
            self.fs, self.root, self._open_error = pafs.S3FileSystem(anonymous=True), "", exc
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self._bucket_checked = False
        self.stream = stream
        self.partition_count = partition_count
        """N of the stream's partitions (in each segment's footer: readers skip whole
        partitions for a worker selection)."""
        self.layout = layout
        self.rotate_bytes = rotate_bytes
        self.rotate_every = rotate_every
        self.compression_level = compression_level
        self.row_group_rows = row_group_rows
        self.recorder = f"{socket.gethostname()}:{os.getpid()}"
        self.command = command or []
        self.buffers = {p: PartitionBuffer(p) for p in partitions}
        self.committed: dict[int, int] = {}
        """Per partition, the last stream seq a segment in place holds."""
        self.handed: dict[int, int] = {}
        """Per partition, the last stream seq handed to the segment writer."""
        self.pool: Any = None
        self.skipped_acks: dict[int, tuple[int, Any]] = {}
        self.in_flight: list[tuple[Any, Segment, int, Any]] = []
        self.tally = Tally()
        self.malformed_kinds: dict[str, int] = {}
        self._labels: dict[str, Any] = {}
        self._texts: dict[str, str] = {}

    # --- start -------------------------------------------------------------------------------

    def resume_points(self) -> dict[int, int]:
        """Per partition, the last stream seq a segment in the dataset holds (0: none)."""
        from .dataset import committed_through

        segments = self._listed(list_segments)
        self.committed = {
            p: committed_through(segments, self.stream, p) for p in sorted(self.buffers)
        }
        self.handed = dict(self.committed)
        return dict(self.committed)

    def stream_starts_at(self, first_seq: int) -> None:
        """The stream holds messages from ``first_seq`` on: the ones before it that no
        segment holds are gone (expired, purged), and the next segments do not claim them
        (inspect shows them as a hole)."""
        for p in self.handed:
            self.handed[p] = max(self.handed[p], first_seq - 1)

    def remove_leftovers(self) -> list[str]:
        """Remove the temp segments a killed recorder of these partitions left (incomplete
        copies of messages the stream still holds: they were never acked)."""
        if not self.local:  # S3: no temp objects (an upload is invisible until complete)
            self._listed(lambda fs, root: None)
            return []
        found = self._listed(
            lambda fs, root: leftover_temps(fs, root, self.stream, set(self.buffers))
        )
        for path in found:
            self.fs.delete_file(path)
        return found

    def _listed(self, listing: Any) -> Any:
        """``listing(fs, root)``; on S3 the bucket is checked first (a listing takes a
        missing bucket for an empty dataset) and a failure says what to check."""
        try:
            if self._open_error is not None:
                raise self._open_error
            if not self.local and not self._bucket_checked:
                check_bucket(self.fs, self.root)
                self._bucket_checked = True
            return listing(self.fs, self.root)
        except OSError as exc:
            if self.local:
                raise
            raise OSError(s3_error(exc, self.location)) from None

    # --- receiving ---------------------------------------------------------------------------

    def add(
        self,
        partition: int,
        stream_seq: int,
        subject: str,
        headers: dict[str, str] | None,
        body: bytes,
        handle: Any,
    ) -> str | None:
        """Buffer one delivered message (the open segment is cut first when the message
        is of another UTC hour). For a message that is no fleet envelope: why (it is kept as
        a Malformed row)."""
        buf = self.buffers[partition]
        if stream_seq <= max(self.handed.get(partition, 0), buf.last_seq):
            # a segment holds it already (delivered again after lost acks): skipped, and acked
            # by the next segment's ack, or alone once the segment holding it is in place
            # (AckPolicy all: acking it acks everything before it, so never earlier)
            self.tally.skipped += 1
            if not len(buf):
                held = self.skipped_acks.get(partition)
                if held is None or held[0] < stream_seq:
                    self.skipped_acks[partition] = (stream_seq, handle)
            return None
        why = None
        try:
            fm = FleetMessage.parse(headers, body)
        except ValueError as exc:
            why = str(exc)
            row, frames, events, recv_ns, source = self._malformed(
                partition, stream_seq, subject, headers, body, why
            )
        else:
            # one string per distinct source and topic, not one per message held
            recv_ns, source = fm.recv_ns, self._text(fm.source)
            if fm.gap is not None:
                gap = Gap(
                    fm.gap.get("publisher"),
                    int(fm.gap["from_seq"]),
                    int(fm.gap["to_seq"]),
                    recv_ns,
                    source,
                )
                row, frames = gap_row(gap)
                events = 0
                self.tally.gaps += 1
            else:
                frames = fm.frames
                events = count_events(frames)
                if events < 0:
                    events = decoded_events(frames, source, fm.topic)
                row = (
                    recv_ns,
                    source,
                    self._text(fm.topic),
                    self._label(fm.worker),
                    self._label(fm.dp_rank),
                    fm.recovered,
                    None,
                )
        if len(buf) and hour_of(recv_ns) != buf.hour:
            self.cut(partition)
            buf = self.buffers[partition]
        if not len(buf):
            buf.first_seq = stream_seq
            buf.first_recv_ns = recv_ns
            buf.hour = hour_of(recv_ns)
            if self.rotate_every:
                now = time.time()
                buf.cut_at = (now // self.rotate_every + 1) * self.rotate_every
        if len(row) == 8:
            buf.rows.add_special(row, frames, events)
        else:
            buf.rows.rows.append(row)
            buf.rows.events.append(events)
            buf.rows.frames.append(frames)
        buf.sources.add(source)
        buf.last_seq = stream_seq
        buf.last_handle = handle
        buf.raw_bytes += len(body)
        buf.events += events
        self.tally.messages += 1
        self.tally.events += events
        return why

    def _text(self, text: str) -> str:
        if len(self._texts) > 65536:  # bounded: sources and topics come from the wire
            self._texts.clear()
        return self._texts.setdefault(text, text)

    def _label(self, tagged: str | None) -> Any:
        """A label value from its tagged JSON (the row buffer encodes it again)."""
        if tagged is None:
            return None
        try:
            return self._labels[tagged]
        except KeyError:
            value = from_json_value(json.loads(tagged))
            if len(self._labels) < 65536:
                self._labels[tagged] = value
            return value

    def _malformed(
        self,
        partition: int,
        stream_seq: int,
        subject: str,
        headers: dict[str, str] | None,
        body: bytes,
        why: str,
    ) -> tuple[tuple, list[bytes], int, int, str]:
        """A message that is no fleet envelope, as a Malformed row: its body kept as the one
        frame, the headers it had in the error."""
        from ..partitions import HEADER_RECV_NS, HEADER_SOURCE, header_value

        headers = headers or {}
        try:
            recv_ns = int(headers[HEADER_RECV_NS])
        except (KeyError, ValueError):
            recv_ns = time.time_ns()
        source = header_value(headers[HEADER_SOURCE]) if HEADER_SOURCE in headers else subject
        kind = why.split(" (")[0]
        self.malformed_kinds[kind] = self.malformed_kinds.get(kind, 0) + 1
        self.tally.malformed_envelopes += 1
        error = f"{why}: stream {self.stream} seq {stream_seq}, subject {subject}"
        batch = Batch(
            source, [], FLEET_FORMAT, subject, None, None, recv_ns, None, None, [body], error
        )
        row, frames = exact_row(batch)
        return row, frames, 0, recv_ns, source

    def due(self, now: float) -> list[int]:
        """Partitions whose open segment is to be cut now (size or clock boundary)."""
        return [
            p
            for p, buf in self.buffers.items()
            if len(buf)
            and (buf.raw_bytes >= self.rotate_bytes or (buf.cut_at and now >= buf.cut_at))
        ]

    def full(self, partition: int) -> bool:
        """The open segment of ``partition`` reached the rotation size."""
        return self.buffers[partition].raw_bytes >= self.rotate_bytes

    def pending_acks(self) -> dict[int, Any]:
        """Skipped messages to ack on their own (nothing open after them, the segment that
        holds them in place): per partition, the handle of the last."""
        out = {}
        for p, (seq, handle) in list(self.skipped_acks.items()):
            if len(self.buffers[p]):  # the open segment's ack will cover it
                del self.skipped_acks[p]
            elif seq <= self.committed.get(p, 0):
                out[p] = handle
                del self.skipped_acks[p]
        return out

    # --- writing -----------------------------------------------------------------------------

    def cut(self, partition: int) -> None:
        """Hand the open segment of ``partition`` to the segment writer process (nothing
        open: nothing to do). :meth:`completed` tells when it is in place."""
        buf = self.buffers[partition]
        if not len(buf):
            return
        # a segment's range starts right after the previous one of its partition: the seqs
        # between that it did not receive are other partitions' (the consumer's filter), so
        # consecutive segments tile the seq line and a range no segment covers was lost
        first = min(self.handed.get(partition, buf.first_seq - 1) + 1, buf.first_seq)
        segment = Segment(self.stream, partition, first, buf.last_seq)
        job = {
            "location": self._location,
            "relative": segment_path(self.layout, segment, buf.first_recv_ns),
            "rb": buf.rows.build().rb,
            "compression_level": self.compression_level,
            "row_group_rows": self.row_group_rows,
            "meta": {
                "kvctl_version": __version__,
                "schema_version": SCHEMA_VERSION,
                "sources": sorted(buf.sources),
                "stream": self.stream,
                "partition": partition,
                "partitions": self.partition_count,
                "first_stream_seq": first,
                "last_stream_seq": buf.last_seq,
                "messages": len(buf),
                "recorder": self.recorder,
                "command": self.command,
            },
        }
        self.buffers[partition] = PartitionBuffer(partition)
        self.handed[partition] = buf.last_seq
        if self.pool is None:
            self.pool = _segment_pool()
        future = self.pool.submit(write_segment, job)
        self.in_flight.append((future, segment, len(buf), buf.last_handle))

    def cut_all(self) -> None:
        for p in sorted(self.buffers):
            self.cut(p)

    def completed(self, wait: bool = False) -> list[Committed]:
        """Segments now in place, in the order they were cut (one writer process: they
        complete in that order, so a partition's acks never pass a segment not yet in
        place). ``wait``: all of them. A failed write raises its OSError."""
        from concurrent.futures.process import BrokenProcessPool

        done = []
        while self.in_flight and (wait or self.in_flight[0][0].done()):
            future, segment, messages, handle = self.in_flight[0]
            try:
                result = future.result()
            except BrokenProcessPool:
                raise OSError("the segment writer process died") from None
            except OSError:
                raise
            except Exception as exc:  # never a traceback: the command reports it, unacked
                raise OSError(f"segment writer: {exc}") from None
            self.in_flight.pop(0)
            self.committed[segment.partition] = segment.last
            self.tally.segments += 1
            self.tally.bytes += result["bytes"]
            self.tally.rows += result["rows"]
            done.append(
                Committed(
                    segment.partition,
                    result["relative"],
                    segment,
                    messages,
                    result["rows"],
                    result["bytes"],
                    handle,
                )
            )
        return done

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _segment_pool() -> Any:
    """One process that writes segments: decoding and compressing a segment takes seconds of
    CPU, which the receive loop (and its NATS client thread) must not wait for."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn: the recorder runs threads (the NATS client), which fork does not mix with
    return ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_interrupts
    )


def _ignore_interrupts() -> None:
    """Ctrl-C reaches the whole process group: the recorder decides when the writer stops
    (it commits the open segments first)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


_failed: str | None = None
"""In the segment writer process: why a segment failed to be written, once one did (no
segment is written after it)."""


def write_segment(job: dict[str, Any]) -> dict[str, Any]:
    """In the segment writer process: decode a segment's journal rows as the converter does,
    sort them by (worker_id, dp_rank, seq) (stable), write the Parquet file where no reader
    sees it until complete; its relative path, rows and bytes."""
    global _failed
    if _failed is not None:
        # a later segment in place would move its partition's resume point past the one
        # that failed: the failed one's messages (never acked) would be skipped as recorded
        raise OSError(f"not written after an earlier segment failed ({_failed})")
    fs, root = open_root(job["location"])
    table, counts = segment_table(job["rb"])
    meta = {**job["meta"], "counts": counts.as_dict()}
    try:
        size = _write(fs, root, job["relative"], table, meta, job)
    except OSError as exc:
        if is_remote(job["location"]):  # pyarrow's words, led by what to check
            exc = OSError(s3_error(exc, job["location"]))
        _failed = str(exc)
        raise exc from None
    except BaseException as exc:
        _failed = f"{type(exc).__name__}: {exc}"
        raise
    return {"relative": job["relative"], "rows": table.num_rows, "bytes": size}


def segment_table(rb: pa.RecordBatch) -> tuple[pa.Table, Counts]:
    """A segment's rows, decoded as a journal's are, sorted by worker, dp rank, seq."""
    decoder = Decoder({"labels": {}, "filters": {}, "first_batch_index": 0})
    parts = decoder.convert_parts(rb)
    table = pa.Table.from_batches(parts, SCHEMA)
    keys = pa.table(
        {
            "w": table.column("worker_id").cast(pa.string()),
            "d": table.column("dp_rank"),
            "s": table.column("seq"),
        }
    )
    order = pc.sort_indices(
        keys, sort_keys=[("w", "ascending"), ("d", "ascending"), ("s", "ascending")]
    )
    counts = Counts()
    for part in parts:
        counts.add_record_batch(part)
    return table.take(order), counts


def _write(
    fs: pafs.FileSystem,
    root: str,
    relative: str,
    table: pa.Table,
    meta: dict[str, Any],
    job: dict[str, Any],
) -> int:
    """Write a segment where no reader sees it until it is complete; its size."""
    final = f"{root}/{relative}"
    options = parquet_options(job["compression_level"])
    metadata = {METADATA_KEY: json.dumps(meta)}
    rows = job["row_group_rows"]
    if not isinstance(fs, pafs.LocalFileSystem):
        return _upload(fs, final, table, options, metadata, rows)
    from pathlib import Path

    directory = os.path.dirname(final)
    os.makedirs(directory, exist_ok=True)
    tmp = temp_path(final)
    try:
        _parquet(tmp, table, options, metadata, rows)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        publish(Path(tmp), Path(final), overwrite=False)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(Path(directory))
    return os.path.getsize(final)


def _upload(
    fs: pafs.FileSystem, final: str, table: pa.Table, options: dict, metadata: dict, rows: int
) -> int:
    """S3 has no rename: the whole file is made in memory first, then sent to its final key.
    An object appears only when its upload completes: a file smaller than a part goes in one
    request at close (``allow_delayed_open``, see :func:`~kvctl.recording.dataset.open_root`);
    a larger one as a multipart upload, which S3 makes an object of only when it is
    completed, with every part uploaded (an upload left by a killed writer stays invisible
    until the bucket's lifecycle rule aborts it). The object's size is checked against the
    file's before the segment counts as in place."""
    sink = pa.BufferOutputStream()
    _parquet(sink, table, options, metadata, rows)
    data = sink.getvalue()
    stream = fs.open_output_stream(final)
    stream.write(data)
    stream.close()
    size = fs.get_file_info(final).size
    if size != data.size:
        raise OSError(f"{final}: the object holds {size} bytes, not the {data.size} sent")
    return int(size)


def _parquet(where: Any, table: pa.Table, options: dict, metadata: dict, rows: int) -> None:
    writer = pq.ParquetWriter(where, SCHEMA, **options)
    try:
        writer.write_table(table, row_group_size=rows)
        writer.add_key_value_metadata(metadata)
    finally:
        writer.close()
