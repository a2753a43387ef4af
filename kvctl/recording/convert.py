"""Journal -> Parquet: the conversion ``kvctl record`` runs in its converter process
(:mod:`kvctl.recording.converter`), at close, and ``kvctl recover`` runs on what a crash left.

Raw journal rows are re-decoded with :func:`kvctl.formats.decode_zmq` /
:func:`kvctl.formats.decode_nats` (deterministic: the same events ``tap`` showed), then the
recorder's filters (journal header) and the ``kept`` cut (``-c`` on the last batch) are applied
again; exact rows are rebuilt from their JSON. The rows go to a temp file, moved into place
atomically once complete (:mod:`kvctl.recording.disk`).

The converter has to keep up with the stream (100k events/s), so a slice of vLLM's map-form
batches takes a typed decoder (:meth:`Decoder.typed_items`): msgspec decodes each payload
straight into Structs of vLLM's event shapes, checking every type and range in C, and the
event columns are read off the Structs (no per-event dict, no per-event Python code). Other
common engine batches (SGLang, the seed publisher, older vLLM) take a fast decoder
(:meth:`Decoder.plain_items`): payloads decoded without the codecs' per-event checks, rows
built column-wise with ``typed_only`` (which refuses any event those checks could reject),
frames recipes checked in one msgpack call. Anything else in a slice, and the whole slice is
decoded again the tolerant way: all three write the same rows.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain, repeat
from pathlib import Path
from types import NoneType
from typing import Annotated, Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from .. import __version__
from ..errors import DecodeError
from ..events import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED, TS_RANGE, Batch
from ..formats import decode_nats, decode_zmq
from ..formats.engine_zmq import (
    MAP_FORM,
    RECIPES,
    map_form_zmq_recipes,
    unpack,
    worker_from_topic,
)
from ..selection import Filters
from .counts import Counts
from .disk import fsync_dir, publish, temp_path
from .journal import journal_metadata, read_journal
from .rows import UntypedEvent, batches_to_record_batch, typed_record_batch
from .schema import I31, I63, METADATA_KEY, SCHEMA, SCHEMA_VERSION, Gap
from .tagged_json import dumps, from_json_value

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


# --- the typed decoder: vLLM's map-form payloads straight into Structs --------------------------
# Each Struct takes exactly one of vLLM's event shapes (its keys, in its order, nothing else),
# and each field exactly what its column holds as it is: msgspec refuses anything else (a bool
# for an int, a negative or 2**64 hash, a token id beyond 32 bits, an unknown key), and the
# slice goes the other ways. What msgspec takes but the Structs cannot say (a key missing or
# repeated, keys in another order, an int ts, a float32, a non-canonical int) is caught by
# encoding the Structs again: the bytes must be the payloads received.
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop below 2**64
_U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
_I32 = Annotated[int, msgspec.Meta(ge=-I31, lt=I31)]
_I64 = Annotated[int, msgspec.Meta(le=I63 - 1)]  # msgpack ints start at -2**63
_TS = Annotated[float, msgspec.Meta(ge=TS_RANGE[0], le=TS_RANGE[1])]  # NaN refused too


class _Event(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, gc=False):
    """An event map whose "type" names its Struct; no key the Struct has not."""


class _Stored(_Event, tag=BLOCK_STORED):
    block_hashes: list[_U64]
    parent_block_hash: _U64 | None
    token_ids: list[_U32]
    block_size: _I32
    lora_id: _I64 | None
    medium: str | None
    lora_name: str | None


class _Removed(_Event, tag=BLOCK_REMOVED):
    block_hashes: list[_U64]
    medium: str | None


class _Cleared(_Event, tag=ALL_BLOCKS_CLEARED):
    pass


_TypedEvent = _Stored | _Removed | _Cleared


class _Payload2(msgspec.Struct, array_like=True, gc=False):  # vLLM 0.9: no dp_rank
    ts: _TS
    events: list[_TypedEvent]


class _Payload3(_Payload2, array_like=True):
    dp_rank: int | None


_DECODERS: dict[int, Callable[[bytes], _Payload2]] = {
    0x93: msgspec.msgpack.Decoder(_Payload3).decode,
    0x92: msgspec.msgpack.Decoder(_Payload2).decode,
}
_ENCODE = msgspec.msgpack.Encoder().encode
# What each shape puts in the type and fields columns (as the row builder writes them).
_SHAPES = (_Stored, _Removed, _Cleared)
_EVENT_TYPE: dict[type, str] = {cls: str(cls.__struct_config__.tag) for cls in _SHAPES}
_FIELDS: dict[type, str] = {cls: dumps(["type", *cls.__struct_fields__]) for cls in _SHAPES}
_TYPED_COLUMNS = tuple(_Stored.__struct_fields__)
_ZMQ3, _ZMQ2 = RECIPES[0], RECIPES[1]  # frames rebuilt from a 3- or 2-element payload


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
        parts = self.convert_parts(rb)
        if len(parts) == 1:
            return parts[0]
        return pa.Table.from_batches(parts, SCHEMA).combine_chunks().to_batches()[0]

    def convert_parts(self, rb: pa.RecordBatch) -> list[pa.RecordBatch]:
        """:meth:`convert`'s rows in a few record batches (one per slice, not copied into one:
        the Parquet writer takes them as they are)."""
        if "event_index" in rb.schema.names:  # a format-1 journal: event rows already
            return [rb]
        # A slice decodes to ~100k Python objects (token ids), freed by refcounting when it is
        # done and in no reference cycle: the cyclic GC, which would scan them again and again
        # while they live (10 % of the time), waits until the record batch is converted.
        paused = gc.isenabled()
        gc.disable()
        try:
            if rb.num_rows <= self.SLICE:
                return [self._convert_slice(rb)]
            # decoded events are big Python objects: a few at once
            return [
                self._convert_slice(rb.slice(i, self.SLICE))
                for i in range(0, rb.num_rows, self.SLICE)
            ]
        finally:
            if paused:
                gc.enable()

    def _convert_slice(self, rb: pa.RecordBatch) -> pa.RecordBatch:
        rows = {name: rb.column(name).to_pylist() for name in _JOURNAL_COLUMNS}
        self.label_values.clear()  # bounded by a slice: labels may come from the wire
        typed = self.typed_items(rows)
        if typed is not None:
            batches, recipes, columns = typed
            first = self.next_index
            self.next_index += len(batches)
            return typed_record_batch(batches, first, self.raw_frames, recipes, columns)
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

    def typed_items(
        self, rows: dict[str, list[Any]]
    ) -> tuple[list[Batch], list[str | None] | None, dict[str, list[Any]]] | None:
        """The typed decoder: when every row is a vLLM map-form batch the Structs above take
        (and :meth:`plain_items`' conditions hold), its batches (events as Structs, only
        counted by the row builder), their frames recipes (``raw_frames="auto"``) and their
        event columns; else ``None``."""
        frames = rows["frames"]
        if not self._plain_rows(rows):
            return None
        payloads = [f[2] for f in frames]
        try:
            objs = [_DECODERS[p[0]](p) for p in payloads]
        except (KeyError, IndexError, msgspec.MsgspecError):
            return None
        # Equal streams, equal payloads (msgpack is self-delimiting): one encode for the slice.
        n = len(objs)
        header = _ENCODE([None] * n)[: 1 if n < 16 else 3 if n < 1 << 16 else 5]
        if _ENCODE(objs) != header + b"".join(payloads):
            return None
        try:
            topics = [f[0].decode() for f in frames]
        except UnicodeDecodeError:  # a topic no recipe rebuilds: the other ways decide
            return None
        events = [o.events for o in objs]
        if list(map(len, events)) != rows["events"]:  # a cut hides events to check
            return None
        payload_dps = [o.dp_rank if isinstance(o, _Payload3) else None for o in objs]
        batches = self._batches(rows, topics, [o.ts for o in objs], events, payload_dps)
        evs = list(chain.from_iterable(events))
        kinds = list(map(type, evs))
        columns = {
            name: list(map(getattr, evs, repeat(name), repeat(None))) for name in _TYPED_COLUMNS
        }
        columns["type"] = list(map(_EVENT_TYPE.__getitem__, kinds))
        columns["fields"] = list(map(_FIELDS.__getitem__, kinds))
        columns["hash_signed"] = [False] * len(evs)
        recipes = None
        if self.raw_frames == "auto":  # a label standing in for a null dp_rank is no payload's
            recipes = [
                (_ZMQ3 if b.dp_rank == o.dp_rank else None) if isinstance(o, _Payload3) else _ZMQ2
                for o, b in zip(objs, batches, strict=True)
            ]
        return batches, recipes, columns

    def _plain_rows(self, rows: dict[str, list[Any]]) -> bool:
        """Every row a 3-frame ZMQ message with an 8-byte seq, decoded as it arrived: no
        filters, no exact row, a plain source string."""
        frames = rows["frames"]
        return (
            self.filters is None
            and set(map(len, frames)) == {3}
            and rows["exact"].count(None) == len(frames)
            and set(map(type, rows["source"])) <= {str}
            and set(map(len, (f[1] for f in frames))) == {8}
        )

    def plain_items(self, rows: dict[str, list[Any]]) -> list[Batch] | None:
        """The fast decoder: when every row is an engine batch of the common shape (3 frames,
        ``[ts, events, dp_rank]``, every event recorded: no filters, no ``-c`` cut, nothing
        malformed), the batches :func:`~kvctl.formats.decode_zmq` would return, decoded
        column by column without its per-event checks (the rows are built with
        ``typed_only``, which refuses any event those checks could reject); else ``None``."""
        if not self._plain_rows(rows):
            return None
        try:
            objs = [unpack(f[2]) for f in rows["frames"]]
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
        topics = [f[0].decode("utf-8", "replace") for f in rows["frames"]]
        return self._batches(rows, topics, list(map(float, stamps)), events, payload_dps)

    def _batches(
        self,
        rows: dict[str, list[Any]],
        topics: list[str],
        stamps: list[float],
        events: list[Any],
        payload_dps: list[Any],
    ) -> list[Batch]:
        """The map-form batches of 3-frame journal rows, from their decoded payloads."""
        out = []
        for source, f, topic, ts, evs, payload_dp, recv_ns, w, dp, recovered in zip(
            rows["source"],
            rows["frames"],
            topics,
            stamps,
            events,
            payload_dps,
            rows["recv_ns"],
            rows["worker_id"],
            rows["dp_rank"],
            rows["recovered"],
            strict=True,
        ):
            worker, dp_label = self.label(source, w, dp)
            if worker is None and topic:
                worker = worker_from_topic(topic)
            out.append(
                Batch(
                    source,
                    evs,
                    MAP_FORM,
                    topic,
                    int.from_bytes(f[1], "big"),
                    ts,
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
        # Row groups are compressed and written on a thread (Arrow lets go of the GIL), while
        # the next one is decoded: at most one in flight, so two row groups in memory at most.
        self.background = ThreadPoolExecutor(1, thread_name_prefix="kvctl-parquet")
        self.in_flight: Future[None] | None = None

    def add(self, rb: pa.RecordBatch) -> None:
        if not rb.num_rows:
            return
        self.counts.add_record_batch(rb)
        self.pending.append(rb)
        self.pending_rows += rb.num_rows
        if self.pending_rows >= ROW_GROUP_ROWS:
            self._write()

    def _write(self) -> None:
        self._wait()
        if self.pending:
            table = pa.Table.from_batches(self.pending, SCHEMA)
            self.in_flight = self.background.submit(self.writer.write_table, table)
            self.pending, self.pending_rows = [], 0

    def _wait(self) -> None:
        """Until the row group in flight is written (its error raised here)."""
        if self.in_flight is not None:
            done, self.in_flight = self.in_flight, None
            done.result()

    def finish(
        self, info: dict[str, Any], journal: Path | None, overwrite: bool = False
    ) -> dict[str, Any]:
        """Complete the file and move it into place; only then remove ``journal``. An
        existing target is replaced only with ``overwrite`` (else :class:`OutputExists`,
        and the journal stays)."""
        try:
            self._write()
            self._wait()
            self.background.shutdown()
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
            self._wait()
        self.background.shutdown()
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
            for part in decoder.convert_parts(rb):
                out.add(part)
    except BaseException:
        out.abort()
        raise
    if decoder.mismatches:
        info = {**info, "mismatches": decoder.mismatches}
    return out.finish(info, journal, overwrite)
