"""Batches -> rows of the recording schema (:mod:`kvctl.recording.schema`).

Faithfulness is the contract: ``record_batch_to_batches(batches_to_record_batch(b)) == b``
for every batch the decoders produce (same events key for key, in order, with the same
value types; same raw frames). Values that do not fit their typed column (a signed and an
unsigned 64-bit hash in one event, EAGLE token pairs, ints beyond 64 bits, unknown fields)
go to the ``extra`` column as tagged JSON (:mod:`kvctl.recording.tagged_json`), and the
``fields`` column records which keys each event had, in which order, so ``None`` values and
absent keys stay distinct. Pure conversion only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from itertools import chain
from typing import Any

import pyarrow as pa

from ..events import MAX_DEPTH, Batch, Event
from ..formats import frames_recipe
from .schema import (
    BATCH_COLUMNS,
    COLUMN_NAMES,
    COLUMNS,
    GAP,
    I31,
    I63,
    MALFORMED,
    MASK,
    SCHEMA,
    U64,
    Gap,
)
from .tagged_json import NestingTooDeep, dumps, to_json_value

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
    if lo < -I63 or hi >= U64:
        return None
    if lo < 0:
        v = [h & MASK if h is not None else None for h in v]
    return v, lo < 0, hi >= I63


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
        if isinstance(batch, Gap):
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
    recv = fit("recv_ns", recv_ns, type(recv_ns) is int and -I63 <= recv_ns < I63)
    source = fit("source", batch.source, type(batch.source) is str, _display(batch.source))
    publisher = batch.publisher
    pub = fit(
        "publisher", publisher, publisher is None or type(publisher) is str, _display(publisher)
    )
    if isinstance(batch, Gap):
        return [recv, None, source, None, pub, None, None, None, None], bx
    ts, seq, worker, dp = batch.ts, batch.seq, batch.worker_id, batch.dp_rank
    return [
        recv,
        fit("ts", ts, ts is None or type(ts) is float),
        source,
        fit("topic", batch.topic, type(batch.topic) is str, _display(batch.topic)),
        pub,
        fit("seq", seq, seq is None or (type(seq) is int and 0 <= seq < U64)),
        fit("worker_id", worker, worker is None or type(worker) is str, _display(worker)),
        fit("dp_rank", dp, dp is None or (type(dp) is int and -I63 <= dp < I63)),
        fit("format", batch.format, type(batch.format) is str, _display(batch.format)),
    ], bx


def _add_gap(cols: _Columns, gap: Gap) -> None:
    d = cols.data
    values, bx = _batch_values(gap)
    for name, v in zip(BATCH_COLUMNS, values, strict=True):
        d[name].append(v)
    from_seq = gap.from_seq
    d["seq"][-1] = from_seq if type(from_seq) is int and 0 <= from_seq < U64 else None
    extra = {"from_seq": gap.from_seq, "to_seq": gap.to_seq, "missing": gap.missing}
    row = {
        "batch_index": None,
        "event_index": None,
        "recovered": None,
        "type": GAP,
        "extra": dumps(to_json_value(extra)),
        "batch_extra": dumps(bx) if bx else None,
    }
    for name in COLUMN_NAMES[len(BATCH_COLUMNS) :]:
        d[name].append(row.get(name))


def _add_batch(cols: _Columns, batch: Batch, index: int, raw_frames: str) -> None:
    d = cols.data
    values, bx = _batch_values(batch)
    if type(batch.error) is not str and batch.error is not None:
        bx["error"] = to_json_value(batch.error)
    if type(batch.recovered) is not bool:
        bx["recovered"] = to_json_value(batch.recovered)
    frames = [bytes(f) for f in batch.frames]
    codec = frames_recipe(batch) if raw_frames == "auto" else None
    events = batch.events
    n = max(1, len(events))
    for name, v in zip(BATCH_COLUMNS, values, strict=True):
        d[name].extend([v] * n)
    d["batch_index"].extend([index] * n)
    d["recovered"].extend([batch.recovered is True] * n)
    d["error"].append(batch.error if type(batch.error) is str else None)
    d["raw_size"].append(sum(map(len, frames)))
    d["frames"].append(None if codec else frames)
    d["frames_codec"].append(codec)
    d["batch_extra"].append(dumps(bx) if bx else None)
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
            layout = plans[keys] = layouts.setdefault(keys, dumps(list(keys)))
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
    block_size = check("block_size", {int, none}, ints(-I31, I31))
    lora_id = check("lora_id", {int, none}, ints(-I63, I63))
    event_id = check("event_id", {int, none}, ints(0, U64))
    strs = {n: check(n, {str, none}, anything) for n in ("lora_name", "medium", "storage_tier")}
    th = check("tokens_hashes", {lst, none}, int_lists(0, U64))
    hashes = check("block_hashes", {lst, none}, int_lists(-I63, U64))
    parents = check("parent_block_hash", {int, none}, ints(-I63, U64))
    # Signedness is per event: a negative hash means a signed producer; one that also has a
    # hash >= 2**63 (both conventions at once) cannot be flagged, so it goes the slow way.
    signed = [False] * len(evs)
    for i, (h, p) in enumerate(zip(hashes, parents, strict=True)):
        if i in bad:
            continue
        neg = (p is not None and p < 0) or (bool(h) and min(h) < 0)
        if neg:
            if (p is not None and p >= I63) or (h and max(h) >= I63):
                bad.add(i)
                continue
            signed[i] = True
            if h:
                hashes[i] = [x & MASK for x in h]
            if p is not None:
                parents[i] = p & MASK
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
    d["extra"].append(dumps(to_json_value(ev)))
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
    if type(parent) is int and -I63 <= parent < U64:
        parent_u = parent & MASK
        pneg, pbig = parent < 0, parent >= I63
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

    d["block_size"].append(_int_or_extra(extra, "block_size", get("block_size"), -I31, I31))
    d["lora_id"].append(_int_or_extra(extra, "lora_id", get("lora_id"), -I63, I63))
    d["event_id"].append(_int_or_extra(extra, "event_id", get("event_id"), 0, U64))
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
        layout = layouts[tkey] = dumps([[k[0]] if type(k) is tuple else k for k in key])
    d["fields"].append(layout)
    d["extra"].append(dumps({k: to_json_value(v) for k, v in extra.items()}) if extra else None)


def _int_or_extra(extra: dict[str, Any], name: str, v: Any, lo: int, hi: int) -> int | None:
    if v is None:
        return None
    if type(v) is int and lo <= v < hi:
        return v
    extra[name] = v
    return None
