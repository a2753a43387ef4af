"""Journal -> Parquet: the conversion ``kvctl record`` runs in its converter process
(:mod:`kvctl.recording.converter`), at close, and ``kvctl recover`` runs on what a crash left.

Raw journal rows are re-decoded with :func:`kvctl.formats.decode_zmq` /
:func:`kvctl.formats.decode_nats` (deterministic: the same events ``tap`` showed), then the
recorder's filters (journal header) and the ``kept`` cut (``-c`` on the last batch) are applied
again; exact rows are rebuilt from their JSON. The rows go to a temp file, moved into place
atomically once complete (:mod:`kvctl.recording.disk`).

The converter has to keep up with the stream, so a slice of common engine batches takes a fast
decoder (:meth:`Decoder.plain_items`): payloads decoded without the codecs' per-event checks,
rows built column-wise with ``typed_only`` (which refuses any event those checks could reject),
frames recipes checked in one msgpack call. Anything else in a slice, and the whole slice is
decoded again the tolerant way: both write the same rows.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from types import NoneType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .. import __version__
from ..errors import DecodeError
from ..events import TS_RANGE, Batch
from ..formats import decode_nats, decode_zmq
from ..formats.engine_zmq import MAP_FORM, map_form_zmq_recipes, unpack, worker_from_topic
from ..selection import Filters
from .counts import Counts
from .disk import fsync_dir, publish, temp_path
from .journal import journal_metadata, read_journal
from .rows import UntypedEvent, batches_to_record_batch
from .schema import METADATA_KEY, SCHEMA, SCHEMA_VERSION, Gap
from .tagged_json import from_json_value

DEFAULT_ZSTD_LEVEL = 6
"""Level 9 saves 1 % more and 15 saves 8 % (bench/record_disk.py), for 1.4x and 4x the time
spent writing Parquet: the converter has to keep up with the stream, so 6."""
ROW_GROUP_ROWS = 64 * 1024
"""Rows buffered before a row group is written: DuckDB and Spark parallelise per row group and
want >= 64k rows; the rows and the page buffers below are what the converter holds in memory."""

# Per-column Parquet encodings, measured with bench/record_disk.py (bytes of each column from
# the file's metadata; Zipf tokens / random tokens). Nested columns are named by their leaf.
#
# Token ids (56-75 % of a file): no dictionary, BYTE_STREAM_SPLIT. Dictionary indices are
# bit-packed at the vocabulary's width (17-18 bits), which shifts repeated blocks to a new bit
# alignment each time and hides them from zstd; split into byte planes, a repeated block is a
# repeated run in every plane, and the high planes of ids < 2**24 compress to almost nothing.
# Zipf 10.4 -> 6.6 MB, random 21.4 -> 20.2 MB (plain: 7.8 / 24.1 MB).
_BYTE_STREAM_SPLIT = ("token_ids.list.element",)
# 64-bit hashes (block, parent) are random: PLAIN, zstd finds the repeats (each BlockRemoved
# repeats hashes stored earlier). A dictionary measured 21-28 % larger, BYTE_STREAM_SPLIT 0-2 %.
# Monotonic ints delta-encode.
_DELTA = ("recv_ns", "seq", "batch_index", "event_id")
# Strings and the small ints/bools repeated along a batch: dictionary + RLE.
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
    "block_size",
    "lora_id",
    "lora_name",
    "medium",
    "storage_tier",
    "fields",
    "error",
    "frames_codec",
)
# Pages of up to 4 MB, with no row limit: zstd compresses each page on its own, and Arrow's
# default pages (1 MB, at most 20,000 rows) cut a row group into pieces shorter than the
# distance between a block and its repeat, or between a hash stored and the same hash removed.
# A row group's token ids are ~8 MB (Zipf) to ~18 MB (random) uncompressed. Disk / raw with the
# encodings above, by page size: 1 MB/20k rows 0.374 Zipf / 0.459 random; 2 MB 0.32 / 0.458;
# 4 MB 0.282 / 0.458; 8 MB 0.253 / 0.458. Bigger pages cost memory (a page is buffered
# several times over while it is split and compressed): the peak of a conversion of random
# tokens is ~10 MB below today's dictionary-encoded 1 MB pages with 4 MB, ~30 MB above with 8.
_PAGE_BYTES = 4 << 20
_PAGE_ROWS = 1 << 30


def parquet_options(compression_level: int) -> dict[str, Any]:
    """``pyarrow.parquet.ParquetWriter`` options for a recording file."""
    return {
        "compression": "zstd",
        "compression_level": compression_level,
        "use_dictionary": list(_DICT),
        "column_encoding": {
            **dict.fromkeys(_DELTA, "DELTA_BINARY_PACKED"),
            **dict.fromkeys(_BYTE_STREAM_SPLIT, "BYTE_STREAM_SPLIT"),
        },
        "data_page_size": _PAGE_BYTES,
        "max_rows_per_page": _PAGE_ROWS,
    }


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
        self.filters: Filters | None = None
        if spec.get("types") or spec.get("workers"):
            self.filters = Filters(
                types=frozenset(spec.get("types") or ()),
                workers=frozenset(spec.get("workers") or ()),
            )
        self.labels = {k: from_json_value(v) for k, v in (info.get("labels") or {}).items()}
        self.label_values: dict[str | None, Any] = {}  # tagged JSON -> label, in one slice
        self.mismatches = 0

    def convert(self, rb: pa.RecordBatch) -> pa.RecordBatch:
        if "event_index" in rb.schema.names:  # a format-1 journal: event rows already
            return rb
        if rb.num_rows > self.SLICE:  # decoded events are big Python objects: a few at once
            parts = [
                self.convert(rb.slice(i, self.SLICE)) for i in range(0, rb.num_rows, self.SLICE)
            ]
            return pa.Table.from_batches(parts, SCHEMA).combine_chunks().to_batches()[0]
        rows = {name: rb.column(name).to_pylist() for name in _JOURNAL_COLUMNS}
        self.label_values.clear()  # bounded by a slice: labels may come from the wire
        items = self.plain_items(rows)
        if items is not None:
            try:
                out = batches_to_record_batch(
                    items,
                    self.next_index,
                    self.raw_frames,
                    typed_only=True,
                    recipes=map_form_zmq_recipes(items) if self.raw_frames == "auto" else None,
                )
            except UntypedEvent:
                pass  # an event the typed columns do not hold as it is: the tolerant way
            else:
                self.next_index += len(items)
                return out
        tolerant = self.items(rows)
        out = batches_to_record_batch(tolerant, self.next_index, self.raw_frames)
        self.next_index += sum(1 for b in tolerant if type(b) is not Gap)
        return out

    def plain_items(self, rows: dict[str, list[Any]]) -> list[Batch] | None:
        """The fast decoder: when every row is an engine batch of the common shape (3 frames,
        ``[ts, events, dp_rank]``, every event recorded: no filters, no ``-c`` cut, nothing
        malformed), the batches :func:`~kvctl.formats.decode_zmq` would return, decoded
        column by column without its per-event checks (the rows are built with
        ``typed_only``, which refuses any event those checks could reject); else ``None``."""
        frames = rows["frames"]
        if (
            self.filters is not None
            or set(map(len, frames)) != {3}
            or rows["exact"].count(None) != len(frames)
            or not set(map(type, rows["source"])) <= {str}
        ):
            return None
        try:
            objs = [unpack(f[2]) for f in frames]
        except DecodeError:
            return None
        if set(map(type, objs)) != {list} or not set(map(len, objs)) <= {2, 3}:
            return None
        stamps = [o[0] for o in objs]
        ts_min, ts_max = TS_RANGE
        if not set(map(type, stamps)) <= {float, int} or not all(
            ts_min <= t <= ts_max
            for t in stamps  # false for NaN
        ):
            return None
        events = [o[1] for o in objs]
        payload_dps = [o[2] if len(o) == 3 else None for o in objs]
        if (
            set(map(type, events)) != {list}
            or list(map(len, events)) != rows["events"]  # a cut hides events to check
            or not set(map(type, payload_dps)) <= {int, NoneType}
        ):
            return None
        seq_frames = [f[1] for f in frames]
        if set(map(len, seq_frames)) != {8}:
            return None
        out = []
        for source, f, ts, evs, payload_dp, seq, recv_ns, w, dp, recovered in zip(
            rows["source"],
            frames,
            stamps,
            events,
            payload_dps,
            seq_frames,
            rows["recv_ns"],
            rows["worker_id"],
            rows["dp_rank"],
            rows["recovered"],
            strict=True,
        ):
            topic_frame = f[0]
            topic = topic_frame.decode("utf-8", "replace") if topic_frame else ""
            worker, dp_label = self.label(source, w, dp)
            if worker is None and topic:
                worker = worker_from_topic(topic)
            out.append(
                Batch(
                    source,
                    evs,
                    MAP_FORM,
                    topic,
                    int.from_bytes(seq, "big"),
                    float(ts),
                    recv_ns,
                    worker,
                    dp_label if payload_dp is None else payload_dp,
                    f,
                    None,
                    bool(recovered),
                    source,
                )
            )
        return out

    def label(self, source: str, worker: str | None, dp: str | None) -> tuple[Any, Any]:
        """The worker and dp rank labels of a journal row (tagged JSON, or the header's labels
        of its source when the row has none)."""
        if worker is None and dp is None:
            return self.labels.get(source) or (None, None)
        cache = self.label_values
        if worker not in cache:
            cache[worker] = from_json_value(json.loads(worker)) if worker is not None else None
        if dp not in cache:
            cache[dp] = from_json_value(json.loads(dp)) if dp is not None else None
        return cache[worker], cache[dp]

    def items(self, d: dict[str, list[Any]]) -> list[Batch | Gap]:
        """The tolerant decoder: every row through the codecs, as the recorder decoded it."""
        out: list[Batch | Gap] = []
        filters = self.filters
        for i, exact in enumerate(d["exact"]):
            if exact is not None:
                out.append(_from_exact(exact, d["frames"][i]))
                continue
            source, frames, recv_ns = d["source"][i], d["frames"][i] or [], d["recv_ns"][i]
            if source.startswith(("nats://", "tls://")) and len(frames) == 1:
                batch = decode_nats(d["topic"][i], frames[0], source, recv_ns)
            else:
                w_label, dp_label = self.label(source, d["worker_id"][i], d["dp_rank"][i])
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


_JOURNAL_COLUMNS = (
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
