"""The recording schema: :class:`~kvctl.events.Batch` lists <-> Arrow record batches.

One row per event, so that SQL users query without unnesting; batch columns are repeated on
every row of the batch (Parquet's dictionary/RLE encodings make that nearly free). A batch
with no events (malformed or empty) still gets one row, and a transport gap is a row of type
``Gap``. Pure conversion only: no file I/O here (see :mod:`kvctl.transports.files`).

Faithfulness is the contract: ``record_batch_to_batches(batches_to_record_batch(b)) == b``
for every batch the decoders produce (same events key for key, in order, with the same
value types; same raw frames). Values that do not fit their typed column (a signed and an
unsigned 64-bit hash in one event, EAGLE token pairs, ints beyond 64 bits, unknown fields)
go to the ``extra`` JSON column with a few tags for what JSON cannot say (bytes, tuples,
maps with non-string keys), and the ``fields`` column records which keys each event had,
in which order, so ``None`` values and absent keys stay distinct.

pyarrow is imported lazily (``kvctl --help`` must stay instant): import this module only
from code paths that record or read recordings.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import msgpack
import pyarrow as pa
import pyarrow.compute as pc

from ..events import MAX_DEPTH, Batch, Event
from . import engine_zmq

SCHEMA_VERSION = 1
"""Bump on any incompatible change of column meaning; readers check it."""

GAP = "Gap"
MALFORMED = "Malformed"

_U64 = 1 << 64
_I63 = 1 << 63
_I31 = 1 << 31
_MASK = _U64 - 1

_DSTR = pa.dictionary(pa.int32(), pa.string())

# (name, type, meaning) -- the README table is generated from this list, keep it in step.
COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("recv_ns", pa.int64(), "receive time, ns since the epoch (batch)"),
    ("ts", pa.float64(), "engine/publisher timestamp, s (batch)"),
    ("source", _DSTR, "source URL the batch came from (batch)"),
    ("topic", _DSTR, "ZMQ topic or NATS subject (batch)"),
    ("publisher", _DSTR, "key sequence numbers count within (batch)"),
    ("seq", pa.uint64(), "transport sequence number (batch); a Gap row: first missing seq"),
    ("worker_id", _DSTR, "worker label or Dynamo worker id, as text (batch)"),
    ("dp_rank", pa.int64(), "data-parallel rank (batch)"),
    ("format", _DSTR, "decoded shape: engine-map, engine-array, dynamo-json, ... (batch)"),
    ("batch_index", pa.int64(), "message number in the recording; null on Gap rows"),
    ("event_index", pa.int32(), "event number within the batch; null: batch without events"),
    ("recovered", pa.bool_(), "batch fetched from the replay socket to fill a gap (batch)"),
    ("type", _DSTR, "event type as sent; on kvctl's own rows (event_index null): Malformed, Gap"),
    ("block_hashes", pa.list_(pa.uint64()), "block hashes as unsigned 64-bit"),
    ("block_hashes_bytes", pa.list_(pa.binary()), "block hashes a producer sent as bytes"),
    ("hash_signed", pa.bool_(), "the producer sent signed 64-bit hashes (re-encode as i64)"),
    ("parent_block_hash", pa.uint64(), "parent block hash, unsigned 64-bit"),
    ("parent_block_hash_bytes", pa.binary(), "parent block hash sent as bytes"),
    ("token_ids", pa.list_(pa.uint32()), "token ids of the stored blocks"),
    ("block_size", pa.int32(), "tokens per block"),
    ("lora_id", pa.int64(), "LoRA adapter id"),
    ("lora_name", _DSTR, "LoRA adapter name"),
    ("medium", _DSTR, "GPU, CPU_TIER1, ..."),
    ("tokens_hashes", pa.list_(pa.uint64()), "Dynamo tokens_hash of each block"),
    ("event_id", pa.uint64(), "Dynamo event id"),
    ("storage_tier", _DSTR, "Dynamo storage tier"),
    ("extra", pa.string(), "JSON object: every other field, and values no column fits"),
    ("fields", _DSTR, "JSON array: the event's keys in order ([name] = copied from batch)"),
    ("error", pa.string(), "why the message could not be decoded (Malformed rows)"),
    ("raw_size", pa.int64(), "bytes of all raw frames (first row of a batch)"),
    ("frames", pa.list_(pa.binary()), "raw transport frames (first row of a batch)"),
    ("frames_codec", _DSTR, "set when frames is null: frames are rebuilt from the columns"),
    ("batch_extra", pa.string(), "JSON: batch values no column fits exactly (first row)"),
]

SCHEMA = pa.schema(
    [pa.field(n, t) for n, t, _ in COLUMNS],
    metadata={b"kvctl.schema_version": str(SCHEMA_VERSION).encode()},
)
COLUMN_NAMES = [n for n, _, _ in COLUMNS]

# frames_codec values: frames are exactly ``engine_zmq.encode_frames``/the bare payload of
# the decoded batch (checked byte for byte when written). "zmq3" = [topic, seq, payload] with
# a 3-element payload, "zmq2" = vLLM 0.9's 2-element payload; "nats3"/"nats2": payload only.
_CODECS = ("zmq3", "zmq2", "nats3", "nats2")

# Event fields that have a typed column; the rest live in ``extra``.
_TYPED = frozenset(
    {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "lora_name",
        "medium",
        "tokens_hashes",
        "event_id",
        "storage_tier",
    }
)
# Event fields that usually repeat the batch's value (Dynamo puts them on every event).
_FROM_BATCH = ("worker_id", "dp_rank")


@dataclass(slots=True)
class Gap:
    """A transport gap: sequence numbers ``from_seq..to_seq`` (inclusive) never arrived."""

    publisher: Any
    from_seq: int
    to_seq: int
    recv_ns: int = 0
    source: str = ""

    @property
    def missing(self) -> int:
        return self.to_seq - self.from_seq + 1


# --- tagged JSON for the extra columns ----------------------------------------------------------


# MAX_DEPTH (kvctl.events, shared with the decoders): containers nested deeper inside one value
# are not recorded as values: the message is recorded as Malformed with its raw frames.


class NestingTooDeep(ValueError):
    """A value nests containers deeper than :data:`MAX_DEPTH`."""


def to_json_value(v: Any, _depth: int = 0) -> Any:
    """Make ``v`` JSON-safe, losslessly: bytes, tuples, odd maps, non-finite floats and
    timestamps get a one-key ``{"$b"|"$t"|"$m"|"$f"|"$d": ...}`` wrapper, everything else stays
    readable JSON (anything else becomes its ``repr`` under ``"$r"``). Containers nested
    deeper than :data:`MAX_DEPTH` raise :class:`NestingTooDeep` (never a RecursionError)."""
    t = type(v)
    if v is None or t is str or t is bool or t is int:
        return v
    if t is float:
        return v if math.isfinite(v) else {"$f": repr(v)}
    if t is list or t is dict or t is tuple:
        if _depth >= MAX_DEPTH:
            raise NestingTooDeep(f"a value nests deeper than {MAX_DEPTH} levels")
        d = _depth + 1
        if t is list:
            return [to_json_value(x, d) for x in v]
        if t is tuple:
            return {"$t": [to_json_value(x, d) for x in v]}
        if all(type(k) is str and not k.startswith("$") for k in v):
            return {k: to_json_value(x, d) for k, x in v.items()}
        return {"$m": [[to_json_value(k, d), to_json_value(x, d)] for k, x in v.items()]}
    if t is bytes or t is bytearray or t is memoryview:
        return {"$b": base64.b64encode(bytes(v)).decode()}
    if t is datetime.datetime:  # a msgpack timestamp
        return {"$d": v.isoformat()}
    return {"$r": repr(v)}  # not from any decoder; kept as text rather than refused


def from_json_value(v: Any) -> Any:
    t = type(v)
    if t is list:
        return [from_json_value(x) for x in v]
    if t is dict:
        if len(v) == 1:
            ((key, x),) = v.items()
            if key == "$b":
                return base64.b64decode(x)
            if key == "$t":
                return tuple(from_json_value(y) for y in x)
            if key == "$m":
                return {from_json_value(k): from_json_value(y) for k, y in x}
            if key == "$f":
                return float(x)
            if key == "$d":
                return datetime.datetime.fromisoformat(x)
            if key == "$r":
                return x
        return {k: from_json_value(x) for k, x in v.items()}
    return v


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


# --- Batch list -> RecordBatch ------------------------------------------------------------------


def _display(v: Any) -> str | None:
    """Readable text for a publisher/worker key (the exact value goes to batch_extra)."""
    if v is None or type(v) is str:
        return v
    if type(v) is tuple:
        return "#".join("" if x is None else str(x) for x in v)
    return str(v)


def _hash_ints(v: list[Any]) -> tuple[list[Any], bool, bool] | None:
    """``(unsigned values, has negatives, has >= 2**63)`` if ``v`` fits list<uint64>."""
    kinds = set(map(type, v))
    if kinds <= {int}:
        if not v:
            return v, False, False
        lo, hi = min(v), max(v)
    elif kinds <= {int, type(None)}:
        ints = [h for h in v if h is not None]
        lo, hi = min(ints), max(ints)
    else:
        return None
    if lo < -_I63 or hi >= _U64:
        return None
    if lo < 0:
        v = [h & _MASK if h is not None else None for h in v]
    return v, lo < 0, hi >= _I63


def _payload_codec(batch: Batch) -> str | None:
    """Name the recipe that rebuilds ``batch.frames`` from its columns, if one does exactly."""
    fmt = batch.format
    if batch.error is not None or fmt not in (engine_zmq.MAP_FORM, engine_zmq.ARRAY_FORM):
        return None
    frames = batch.frames
    if len(frames) == 3:
        kind = "zmq"
        if batch.seq is None or frames[1] != batch.seq.to_bytes(8, "big"):
            return None
        if frames[0] != batch.topic.encode("utf-8", "surrogatepass"):
            return None
        payload = frames[2]
    elif len(frames) == 1:
        kind, payload = "nats", frames[0]
    else:
        return None
    for n in (3, 2):
        try:
            rebuilt = _build_payload(batch.ts, batch.events, batch.dp_rank, fmt, n)
        except Exception:  # an odd value msgpack refuses: keep the raw bytes
            return None
        if rebuilt == payload:
            return f"{kind}{n}"
    return None


def _build_payload(ts: Any, events: list[Event], dp_rank: Any, fmt: str, n: int) -> bytes:
    # Array-form events were decoded into dicts in positional order: values() is the array.
    wire = events if fmt == engine_zmq.MAP_FORM else [list(e.values()) for e in events]
    return msgpack.packb([ts, wire, dp_rank] if n == 3 else [ts, wire])


def _rebuild_frames(codec: str, batch: Batch) -> list[bytes]:
    payload = _build_payload(batch.ts, batch.events, batch.dp_rank, batch.format, int(codec[-1]))
    if codec.startswith("zmq"):
        return [batch.topic.encode("utf-8", "surrogatepass"), batch.seq.to_bytes(8, "big"), payload]
    return [payload]


class _Columns:
    """Column lists being filled row by row (one append per column per row)."""

    __slots__ = ("data", "layouts", "plans", "pending")

    def __init__(self) -> None:
        self.data: dict[str, list[Any]] = {n: [] for n in COLUMN_NAMES}
        self.layouts: dict[tuple[Any, ...], str] = {}
        self.plans: dict[tuple[Any, ...] | None, str] = {}
        self.pending: list[tuple[int, Event, Batch]] = []


def batches_to_record_batch(
    batches: Iterable[Batch | Gap],
    first_batch_index: int = 0,
    raw_frames: str = "auto",
) -> pa.RecordBatch:
    """Convert batches (and :class:`Gap` markers) to one Arrow record batch of :data:`SCHEMA`.

    ``batch_index`` counts from ``first_batch_index`` (gaps take no index).
    ``raw_frames="auto"`` leaves ``frames`` null when the columns rebuild them byte for byte
    (engine batches encoded canonically: the common case, and half the bytes on disk);
    ``"always"`` stores them regardless.
    """
    batches = list(batches)
    try:
        return _to_record_batch(batches, first_batch_index, raw_frames)
    except (NestingTooDeep, RecursionError):
        return _deep_ones_malformed(batches, first_batch_index, raw_frames)


def _to_record_batch(
    batches: list[Batch | Gap], first_batch_index: int, raw_frames: str
) -> pa.RecordBatch:
    cols = _Columns()
    index = first_batch_index
    for batch in batches:
        if type(batch) is Gap:
            _add_gap(cols, batch)
        else:
            _add_batch(cols, batch, index, raw_frames)
            index += 1
    _fill_events(cols)
    arrays = [pa.array(cols.data[n], type=t) for n, t, _ in COLUMNS]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def _deep_ones_malformed(
    batches: list[Batch | Gap], first_batch_index: int, raw_frames: str
) -> pa.RecordBatch:
    """The rare slow path: batch by batch, a batch holding a value nested too deep becomes a
    Malformed row that keeps its raw frames (the bytes are the record of what arrived)."""
    parts = []
    index = first_batch_index
    for batch in batches:
        try:
            parts.append(_to_record_batch([batch], index, raw_frames))
        except (NestingTooDeep, RecursionError):
            assert type(batch) is Batch
            bad = dataclasses.replace(
                batch,
                events=[],
                error=f"not recorded as events: a value "
                f"nests deeper than {MAX_DEPTH} levels (raw frames kept)",
            )
            parts.append(_to_record_batch([bad], index, raw_frames))
        if type(batch) is not Gap:
            index += 1
    return pa.Table.from_batches(parts, SCHEMA).combine_chunks().to_batches()[0]


def _batch_values(batch: Batch | Gap) -> tuple[list[Any], dict[str, Any]]:
    """The repeated batch columns (recv_ns .. worker_id/dp_rank) and batch_extra entries."""
    bx: dict[str, Any] = {}

    def fit(name: str, value: Any, ok: bool, shown: Any = None) -> Any:
        if ok:
            return value
        bx[name] = to_json_value(value)
        return shown

    recv_ns = batch.recv_ns
    recv = fit("recv_ns", recv_ns, type(recv_ns) is int and -_I63 <= recv_ns < _I63)
    source = fit("source", batch.source, type(batch.source) is str, _display(batch.source))
    publisher = batch.publisher
    pub = fit(
        "publisher", publisher, publisher is None or type(publisher) is str, _display(publisher)
    )
    if type(batch) is Gap:
        return [recv, None, source, None, pub, None, None, None, None], bx
    ts, seq, worker, dp = batch.ts, batch.seq, batch.worker_id, batch.dp_rank
    return [
        recv,
        fit("ts", ts, ts is None or type(ts) is float),
        source,
        fit("topic", batch.topic, type(batch.topic) is str, _display(batch.topic)),
        pub,
        fit("seq", seq, seq is None or (type(seq) is int and 0 <= seq < _U64)),
        fit("worker_id", worker, worker is None or type(worker) is str, _display(worker)),
        fit("dp_rank", dp, dp is None or (type(dp) is int and -_I63 <= dp < _I63)),
        fit("format", batch.format, type(batch.format) is str, _display(batch.format)),
    ], bx


_BATCH_COLS = (
    "recv_ns",
    "ts",
    "source",
    "topic",
    "publisher",
    "seq",
    "worker_id",
    "dp_rank",
    "format",
)


def _add_gap(cols: _Columns, gap: Gap) -> None:
    d = cols.data
    values, bx = _batch_values(gap)
    for name, v in zip(_BATCH_COLS, values, strict=True):
        d[name].append(v)
    from_seq = gap.from_seq
    d["seq"][-1] = from_seq if type(from_seq) is int and 0 <= from_seq < _U64 else None
    extra = {"from_seq": gap.from_seq, "to_seq": gap.to_seq, "missing": gap.missing}
    row = {
        "batch_index": None,
        "event_index": None,
        "recovered": None,
        "type": GAP,
        "extra": _dumps(to_json_value(extra)),
        "batch_extra": _dumps(bx) if bx else None,
    }
    for name in COLUMN_NAMES[len(_BATCH_COLS) :]:
        d[name].append(row.get(name))


def _add_batch(cols: _Columns, batch: Batch, index: int, raw_frames: str) -> None:
    d = cols.data
    values, bx = _batch_values(batch)
    if type(batch.error) is not str and batch.error is not None:
        bx["error"] = to_json_value(batch.error)
    if type(batch.recovered) is not bool:
        bx["recovered"] = to_json_value(batch.recovered)
    frames = [bytes(f) for f in batch.frames]
    codec = _payload_codec(batch) if raw_frames == "auto" else None
    events = batch.events
    n = max(1, len(events))
    for name, v in zip(_BATCH_COLS, values, strict=True):
        d[name].extend([v] * n)
    d["batch_index"].extend([index] * n)
    d["recovered"].extend([batch.recovered is True] * n)
    d["error"].append(batch.error if type(batch.error) is str else None)
    d["raw_size"].append(sum(map(len, frames)))
    d["frames"].append(None if codec else frames)
    d["frames_codec"].append(codec)
    d["batch_extra"].append(_dumps(bx) if bx else None)
    if n > 1:
        rest = [None] * (n - 1)
        for name in ("error", "raw_size", "frames", "frames_codec", "batch_extra"):
            d[name].extend(rest)
    if not events:
        d["event_index"].append(None)
        d["type"].append(MALFORMED if batch.error is not None else None)
        for name in _EVENT_COLS:
            d[name].append(None)
        d["hash_signed"].append(None)
        d["extra"].append(None)
        d["fields"].append(None)
        return
    d["event_index"].extend(range(len(events)))
    row = len(d["type"])
    for name in _ROW_EVENT_COLS:
        d[name].extend([None] * n)  # filled by _fill_events, column by column
    cols.pending.extend(zip(range(row, row + n), events, [batch] * n, strict=True))


def _fill_events(cols: _Columns) -> None:
    """Event columns for every pending event. Events whose keys all have typed columns (vLLM,
    SGLang, seed) are converted column-wise, their values checked in bulk (one pass over all
    token ids instead of one per event: 3x faster); anything a bulk check rejects, and every
    other event, takes the exact per-event path."""
    d, pending = cols.data, cols.pending
    fast: list[tuple[int, Event, str]] = []
    slow: list[tuple[int, Event, Batch]] = []
    layouts, plans = cols.layouts, cols.plans
    for item in pending:
        ev = item[1]
        keys = tuple(ev) if type(ev) is dict else None
        layout = plans.get(keys)
        if layout is None and keys is not None and "type" in keys and _TYPED.issuperset(keys):
            layout = plans[keys] = layouts.setdefault(keys, _dumps(list(keys)))
        if layout is None:
            slow.append(item)
        else:
            fast.append((item[0], ev, layout))
    if fast:
        slow.extend(_fill_fast(d, fast, pending))
    if slow:
        tmp: dict[str, list[Any]] = {name: [] for name in _ROW_EVENT_COLS}
        for _, ev, batch in slow:
            n0 = len(tmp["type"])
            try:
                _add_event(tmp, layouts, ev, batch)
            except Exception:
                # Whatever this event holds that the typed path trips over: keep it whole.
                _truncate(tmp, n0)
                _add_raw_event(tmp, ev)
        rows = [r for r, _, _ in slow]
        for name in _ROW_EVENT_COLS:
            col = d[name]
            for r, v in zip(rows, tmp[name], strict=True):
                col[r] = v
    pending.clear()


def _fill_fast(
    d: dict[str, list[Any]],
    fast: list[tuple[int, Event, str]],
    pending: list[tuple[int, Event, Batch]],
) -> list[tuple[int, Event, Batch]]:
    """Fill typed columns for ``fast`` events; return the ones that must take the slow path."""
    evs = [ev for _, ev, _ in fast]
    bad: set[int] = set()

    def check(name: str, ok_types: set[type], per_event: Any) -> list[Any]:
        vals = [ev.get(name) for ev in evs]
        if not set(map(type, vals)) <= ok_types or not per_event(vals, bulk=True):
            for i, v in enumerate(vals):
                if type(v) not in ok_types or not per_event([v], bulk=False):
                    bad.add(i)
        return vals

    def ints(lo: int, hi: int) -> Any:
        def ok(vals: list[Any], bulk: bool) -> bool:
            nums = [v for v in vals if v is not None]
            return not nums or (lo <= min(nums) and max(nums) < hi)

        return ok

    def int_lists(lo: int, hi: int) -> Any:
        def ok(vals: list[Any], bulk: bool) -> bool:
            flat = list(chain.from_iterable(v for v in vals if v))
            if not set(map(type, flat)) <= {int}:
                return False
            return not flat or (lo <= min(flat) and max(flat) < hi)

        return ok

    def anything(vals: list[Any], bulk: bool) -> bool:
        return True

    none, lst = type(None), list
    types = check("type", {str}, anything)
    tokens = check("token_ids", {lst, none}, int_lists(0, 1 << 32))
    block_size = check("block_size", {int, none}, ints(-_I31, _I31))
    lora_id = check("lora_id", {int, none}, ints(-_I63, _I63))
    event_id = check("event_id", {int, none}, ints(0, _U64))
    strs = {n: check(n, {str, none}, anything) for n in ("lora_name", "medium", "storage_tier")}
    th = check("tokens_hashes", {lst, none}, int_lists(0, _U64))
    hashes = check("block_hashes", {lst, none}, int_lists(-_I63, _U64))
    parents = check("parent_block_hash", {int, none}, ints(-_I63, _U64))
    # Signedness is per event: a negative hash means a signed producer; one that also has a
    # hash >= 2**63 (both conventions at once) cannot be flagged, so it goes the slow way.
    signed = [False] * len(evs)
    for i, (h, p) in enumerate(zip(hashes, parents, strict=True)):
        if i in bad:
            continue
        neg = (p is not None and p < 0) or (bool(h) and min(h) < 0)
        if neg:
            if (p is not None and p >= _I63) or (h and max(h) >= _I63):
                bad.add(i)
                continue
            signed[i] = True
            if h:
                hashes[i] = [x & _MASK for x in h]
            if p is not None:
                parents[i] = p & _MASK
    out = [
        (r, ev, pending_batch)
        for i, ((r, ev, _), pending_batch) in enumerate(
            zip(fast, _batches_of(fast, pending), strict=True)
        )
        if i in bad
    ]
    columns = {
        "type": types,
        "block_hashes": hashes,
        "parent_block_hash": parents,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": lora_id,
        "event_id": event_id,
        "tokens_hashes": th,
        "hash_signed": signed,
        "fields": [layout for _, _, layout in fast],
        **strs,
    }
    rows = [r for r, _, _ in fast]
    for name, vals in columns.items():
        col = d[name]
        if bad:
            for i, (r, v) in enumerate(zip(rows, vals, strict=True)):
                if i not in bad:
                    col[r] = v
        else:
            for r, v in zip(rows, vals, strict=True):
                col[r] = v
    return out


def _batches_of(
    fast: list[tuple[int, Event, str]], pending: list[tuple[int, Event, Batch]]
) -> list[Batch]:
    by_row = {r: b for r, _, b in pending}
    return [by_row[r] for r, _, _ in fast]


_EVENT_COLS = (
    "block_hashes",
    "block_hashes_bytes",
    "parent_block_hash",
    "parent_block_hash_bytes",
    "token_ids",
    "block_size",
    "lora_id",
    "lora_name",
    "medium",
    "tokens_hashes",
    "event_id",
    "storage_tier",
)
_ROW_EVENT_COLS = ("type", *_EVENT_COLS, "hash_signed", "extra", "fields")


def _truncate(d: dict[str, list[Any]], n: int) -> None:
    for name in _ROW_EVENT_COLS:
        del d[name][n:]


def _add_raw_event(d: dict[str, list[Any]], ev: Any) -> None:
    etype = ev.get("type") if type(ev) is dict else None
    d["type"].append(etype if type(etype) is str else None)
    for name in _EVENT_COLS:
        d[name].append(None)
    d["hash_signed"].append(None)
    d["extra"].append(_dumps(to_json_value(ev)))
    d["fields"].append(None)  # null layout: extra is the whole event


def _add_event(
    d: dict[str, list[Any]], layouts: dict[tuple[Any, ...], str], ev: Event, batch: Batch
) -> None:
    if type(ev) is not dict:
        raise TypeError("event is not a dict")
    extra: dict[str, Any] = {}
    get = ev.get
    # Typed columns, each checked for an exact fit; a misfit goes to extra.
    etype = get("type")
    d["type"].append(etype if type(etype) is str else None)
    if etype is not None and type(etype) is not str:
        extra["type"] = etype

    signed = False
    hashes = get("block_hashes")
    hashes_u = hashes_b = None
    neg = big = False
    if type(hashes) is list:
        fitted = _hash_ints(hashes)
        if fitted is not None:
            hashes_u, neg, big = fitted
        elif set(map(type, hashes)) <= {bytes, type(None)}:
            hashes_b = hashes
        else:
            extra["block_hashes"] = hashes
    elif hashes is not None:
        extra["block_hashes"] = hashes
    parent = get("parent_block_hash")
    parent_u = parent_b = None
    if type(parent) is int and -_I63 <= parent < _U64:
        parent_u = parent & _MASK
        pneg, pbig = parent < 0, parent >= _I63
        if (neg or pneg) and (big or pbig):
            # signed and unsigned mixed in one event: one flag cannot say both; keep exact.
            extra["parent_block_hash"] = parent
            parent_u = None
        else:
            neg = neg or pneg
    elif type(parent) is bytes:
        parent_b = parent
    elif parent is not None:
        extra["parent_block_hash"] = parent
    if neg and big:
        extra["block_hashes"] = hashes
        hashes_u = None
    signed = neg
    d["block_hashes"].append(hashes_u)
    d["block_hashes_bytes"].append(hashes_b)
    d["parent_block_hash"].append(parent_u)
    d["parent_block_hash_bytes"].append(parent_b)
    d["hash_signed"].append(signed)

    tokens = get("token_ids")
    if type(tokens) is list and set(map(type, tokens)) <= {int}:
        if tokens and (min(tokens) < 0 or max(tokens) >= 1 << 32):
            extra["token_ids"] = tokens
            tokens = None
    elif tokens is not None:
        extra["token_ids"] = tokens  # EAGLE pairs and other shapes
        tokens = None
    d["token_ids"].append(tokens)

    d["block_size"].append(_int_or_extra(extra, "block_size", get("block_size"), -_I31, _I31))
    d["lora_id"].append(_int_or_extra(extra, "lora_id", get("lora_id"), -_I63, _I63))
    d["event_id"].append(_int_or_extra(extra, "event_id", get("event_id"), 0, _U64))
    for name in ("lora_name", "medium", "storage_tier"):
        v = get(name)
        if v is None or type(v) is str:
            d[name].append(v)
        else:
            d[name].append(None)
            extra[name] = v
    th = get("tokens_hashes")
    th_u = None
    if type(th) is list:
        fitted = _hash_ints(th)
        if fitted is not None and not fitted[1]:
            th_u = th
        else:
            extra["tokens_hashes"] = th
    elif th is not None:
        extra["tokens_hashes"] = th
    d["tokens_hashes"].append(th_u)

    # Key layout (order, presence, copies of batch values); few distinct ones per stream.
    key: list[Any] = []
    for k in ev:
        if type(k) is not str:
            raise TypeError("non-string event key")
        if k in _TYPED:
            key.append(k)
        elif k in _FROM_BATCH:
            v, bv = ev[k], getattr(batch, k)
            if type(v) is type(bv) and v == bv:
                key.append((k,))
            else:
                key.append(k)
                extra[k] = v
        else:
            key.append(k)
            extra[k] = ev[k]
    tkey = tuple(key)
    layout = layouts.get(tkey)
    if layout is None:
        layout = layouts[tkey] = _dumps([[k[0]] if type(k) is tuple else k for k in key])
    d["fields"].append(layout)
    d["extra"].append(_dumps({k: to_json_value(v) for k, v in extra.items()}) if extra else None)


def _int_or_extra(extra: dict[str, Any], name: str, v: Any, lo: int, hi: int) -> int | None:
    if v is None:
        return None
    if type(v) is int and lo <= v < hi:
        return v
    extra[name] = v
    return None


# --- RecordBatch -> Batch list ------------------------------------------------------------------


def record_batch_to_batches(
    rb: pa.RecordBatch | pa.Table, include_gaps: bool = False
) -> list[Batch | Gap]:
    """Inverse of :func:`batches_to_record_batch`: rebuild the batches (events and frames).

    Rows of one batch must be contiguous and complete in ``rb`` (the readers in
    :mod:`kvctl.transports.files` carry a batch that straddles two chunks over).
    Gap rows become :class:`Gap` objects when ``include_gaps``, else are skipped.
    """
    cols = columns_to_pylists(rb)
    return rows_to_batches(cols, 0, rb.num_rows, include_gaps)


def columns_to_pylists(rb: pa.RecordBatch | pa.Table) -> dict[str, list[Any]]:
    """Python lists per column (only the columns the reader needs, missing ones as nulls)."""
    n = rb.num_rows
    names = set(rb.schema.names)
    return {
        name: (_to_pylist(rb.column(name)) if name in names else [None] * n)
        for name in COLUMN_NAMES
    }


def _to_pylist(column: pa.Array | pa.ChunkedArray) -> list[Any]:
    """``to_pylist``, about 30 times faster for dictionary columns."""
    if isinstance(column, pa.ChunkedArray):  # chunks may carry different dictionaries
        return [value for chunk in column.chunks for value in _to_pylist(chunk)]
    if pa.types.is_dictionary(column.type):
        # decode the (small) dictionary once, then index: pyarrow's to_pylist costs ~1 µs/row
        values = [*column.dictionary.to_pylist(), None]
        indices = _int_list(pc.fill_null(column.indices, -1))
        return [values[i] for i in indices]
    return column.to_pylist()


def _int_list(ints: pa.Array) -> list[int]:
    """A null-free signed integer array as Python ints, read straight from its data buffer:
    faster than ``to_pylist`` and, unlike ``to_numpy``, without numpy (not a dependency)."""
    if len(ints) == 0:
        return []
    width = ints.type.bit_width // 8
    data = ints.buffers()[1].slice(ints.offset * width, len(ints) * width)
    return memoryview(data).cast({1: "b", 2: "h", 4: "i", 8: "q"}[width]).tolist()


def rows_to_batches(
    cols: dict[str, list[Any]], start: int, stop: int, include_gaps: bool = False
) -> list[Batch | Gap]:
    out: list[Batch | Gap] = []
    bi = cols["batch_index"]
    layouts: dict[str, list[Any]] = {}
    i = start
    while i < stop:
        index = bi[i]
        if index is None:
            if include_gaps and cols["type"][i] == GAP:
                out.append(_gap_from_row(cols, i))
            i += 1
            continue
        j = i + 1
        while j < stop and bi[j] == index:
            j += 1
        out.append(_batch_from_rows(cols, i, j, layouts))
        i = j
    return out


def _batch_from_row(cols: dict[str, list[Any]], i: int) -> tuple[dict[str, Any], dict]:
    raw = cols["batch_extra"][i]
    bx = {k: from_json_value(v) for k, v in json.loads(raw).items()} if raw else {}
    values = {name: bx[name] if name in bx else cols[name][i] for name in _BATCH_COLS}
    return values, bx


def _gap_from_row(cols: dict[str, list[Any]], i: int) -> Gap:
    values, _ = _batch_from_row(cols, i)
    extra = from_json_value(json.loads(cols["extra"][i]))
    return Gap(
        publisher=values["publisher"],
        from_seq=extra["from_seq"],
        to_seq=extra["to_seq"],
        recv_ns=values["recv_ns"],
        source=values["source"],
    )


def _batch_from_rows(
    cols: dict[str, list[Any]], i: int, j: int, layouts: dict[str, list[Any]]
) -> Batch:
    values, bx = _batch_from_row(cols, i)
    batch = Batch(
        source=values["source"],
        events=[],
        format=values["format"],
        topic=values["topic"],
        seq=values["seq"],
        ts=values["ts"],
        recv_ns=values["recv_ns"],
        worker_id=values["worker_id"],
        dp_rank=values["dp_rank"],
        error=bx["error"] if "error" in bx else cols["error"][i],
        recovered=bx["recovered"] if "recovered" in bx else bool(cols["recovered"][i]),
        publisher=values["publisher"],
    )
    if cols["event_index"][i] is not None:
        batch.events = [_event_from_row(cols, k, batch, layouts) for k in range(i, j)]
    codec = cols["frames_codec"][i]
    if codec is not None:
        batch.frames = _rebuild_frames(codec, batch)
    else:
        batch.frames = cols["frames"][i] or []
    return batch


def _event_from_row(
    cols: dict[str, list[Any]], k: int, batch: Batch, layouts: dict[str, list[Any]]
) -> Event:
    raw_extra = cols["extra"][k]
    extra = json.loads(raw_extra) if raw_extra is not None else None
    layout_s = cols["fields"][k]
    if layout_s is None:
        return from_json_value(extra)
    layout = layouts.get(layout_s)
    if layout is None:
        layout = layouts[layout_s] = json.loads(layout_s)
    signed = cols["hash_signed"][k]
    ev: Event = {}
    for name in layout:
        if type(name) is list:
            ev[name[0]] = getattr(batch, name[0])
        elif extra is not None and name in extra:
            ev[name] = from_json_value(extra[name])
        elif name == "block_hashes":
            b = cols["block_hashes_bytes"][k]
            if b is not None:
                ev[name] = b
            else:
                v = cols["block_hashes"][k]
                if signed and v:
                    v = [h - _U64 if h is not None and h >= _I63 else h for h in v]
                ev[name] = v
        elif name == "parent_block_hash":
            b = cols["parent_block_hash_bytes"][k]
            if b is not None:
                ev[name] = b
            else:
                v = cols["parent_block_hash"][k]
                if signed and v is not None and v >= _I63:
                    v -= _U64
                ev[name] = v
        else:
            ev[name] = cols[name][k]
    return ev


def schema_table() -> str:
    """The schema as a Markdown table (for the README and ``kvctl inspect --schema``)."""
    lines = ["| column | type | meaning |", "|---|---|---|"]
    for name, t, meaning in COLUMNS:
        shown = "dictionary<string>" if t == _DSTR else str(t).replace("<item: ", "<")
        lines.append(f"| `{name}` | `{shown}` | {meaning} |")
    return "\n".join(lines)
