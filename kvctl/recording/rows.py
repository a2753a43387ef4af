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
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from functools import partial
from itertools import accumulate, chain, compress, repeat
from operator import attrgetter
from typing import Any

import msgspec
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

    __slots__ = ("data", "layouts", "plans", "pending", "batch_extras")

    def __init__(self) -> None:
        self.data: dict[str, list[Any]] = {n: [] for n in COLUMN_NAMES}
        self.layouts: dict[tuple[Any, ...], str] = {}
        self.plans: dict[tuple[Any, ...] | None, str] = {}
        self.pending: list[tuple[int, Event, Batch]] = []
        self.batch_extras: dict[tuple[Any, ...], str] = {}


class UntypedEvent(Exception):
    """Raised with ``typed_only``: an event does not fit the typed columns as it is."""


def batches_to_record_batch(
    batches: Iterable[Batch | Gap],
    first_batch_index: int = 0,
    raw_frames: str = "auto",
    *,
    typed_only: bool = False,
    recipes: Sequence[str | None] | None = None,
) -> pa.RecordBatch:
    """Convert batches (and :class:`Gap` markers) to one Arrow record batch of :data:`SCHEMA`.

    ``batch_index`` counts from ``first_batch_index`` (gaps take no index).
    ``raw_frames="auto"`` leaves ``frames`` null when the columns rebuild them byte for byte
    (engine batches encoded canonically: the common case, and half the bytes on disk);
    ``"always"`` stores them regardless.
    ``typed_only``, for events straight from the msgpack decoder (plain ints, never an int
    subclass): raise :class:`UntypedEvent` rather than convert an event that is not a map of
    typed fields whose values all fit their columns (the converter's fast decoder skips the
    decoders' per-event checks, which such events pass by construction, and decodes any
    other batch again the tolerant way).
    ``recipes``: with ``raw_frames="auto"``, what :func:`~kvctl.formats.frames_recipe` says of
    each batch, when the caller knows it already (the converter checks a slice of engine
    payloads in one msgpack call).
    """
    batches = list(batches)
    try:
        return _to_record_batch(batches, first_batch_index, raw_frames, typed_only, recipes)
    except (NestingTooDeep, RecursionError):
        return _deep_ones_malformed(batches, first_batch_index, raw_frames, typed_only, recipes)


def _to_record_batch(
    batches: list[Batch | Gap],
    first_batch_index: int,
    raw_frames: str,
    typed_only: bool,
    recipes: Sequence[str | None] | None = None,
) -> pa.RecordBatch:
    cols = _Columns()
    index = first_batch_index
    run: list[Batch] = []
    for pos, batch in enumerate(batches):
        if isinstance(batch, Gap):
            if run:
                known = recipes[pos - len(run) : pos] if recipes is not None else None
                _add_batches(cols, run, index, raw_frames, known)
                index += len(run)
                run = []
            _add_gap(cols, batch)
        else:
            run.append(batch)
    if run:
        known = recipes[len(batches) - len(run) :] if recipes is not None else None
        _add_batches(cols, run, index, raw_frames, known)
    _fill_events(cols, typed_only)
    arrays = [_array(n, cols.data[n], t) for n, t, _ in COLUMNS]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def _deep_ones_malformed(
    batches: list[Batch | Gap],
    first_batch_index: int,
    raw_frames: str,
    typed_only: bool,
    recipes: Sequence[str | None] | None,
) -> pa.RecordBatch:
    """The rare slow path: batch by batch, a batch holding a value nested too deep becomes a
    Malformed row that keeps its raw frames (the bytes are the record of what arrived)."""
    parts = []
    index = first_batch_index
    for pos, batch in enumerate(batches):
        known = recipes[pos : pos + 1] if recipes is not None else None
        try:
            parts.append(_to_record_batch([batch], index, raw_frames, typed_only, known))
        except (NestingTooDeep, RecursionError):
            assert type(batch) is Batch
            bad = dataclasses.replace(
                batch,
                events=[],
                error=f"not recorded as events: a value "
                f"nests deeper than {MAX_DEPTH} levels (raw frames kept)",
            )
            parts.append(_to_record_batch([bad], index, raw_frames, typed_only))
        if type(batch) is not Gap:
            index += 1
    return pa.Table.from_batches(parts, SCHEMA).combine_chunks().to_batches()[0]


# The repeated batch columns, in schema order: the types a value must have to go in its column
# as is, its integer bounds, and whether a misfit is shown as text (else null). A misfit's exact
# value goes to batch_extra, under its name, in this order (then error, recovered).
_BATCH_FITS: tuple[tuple[str, frozenset[type], tuple[int, int] | None, bool], ...] = (
    ("recv_ns", frozenset({int}), (-I63, I63), False),
    ("ts", frozenset({float, type(None)}), None, False),
    ("source", frozenset({str}), None, True),
    ("topic", frozenset({str}), None, True),
    ("publisher", frozenset({str, type(None)}), None, True),
    ("seq", frozenset({int, type(None)}), (0, U64), False),
    ("worker_id", frozenset({str, type(None)}), None, True),
    ("dp_rank", frozenset({int, type(None)}), (-I63, I63), False),
    ("format", frozenset({str}), None, True),
    ("error", frozenset({str, type(None)}), None, False),
    ("recovered", frozenset({bool}), None, False),
)
_BATCH_FIELDS = attrgetter(*(name for name, _, _, _ in _BATCH_FITS), "frames", "events")
# batch_extra values whose JSON equality implies (type included in the key): cached per stream.
_CACHEABLE = frozenset({int, str, bool, type(None)})
_NO_EVENT = object()  # the row of a batch without events


def _misfits(
    values: list[Any], ok: frozenset[type], bounds: tuple[int, int] | None
) -> Iterable[int]:
    """Positions of the values that do not go in their column as they are (one C-level pass
    over the types, and one over the numbers, when all fit: the common case)."""
    types = set(map(type, values))
    if types <= ok:
        if bounds is None:
            return ()
        nums = [v for v in values if v is not None] if type(None) in types else values
        if not nums or (bounds[0] <= min(nums) and max(nums) < bounds[1]):
            return ()
    lo, hi = bounds or (0, 0)
    return [
        i
        for i, v in enumerate(values)
        if type(v) not in ok or (bounds is not None and v is not None and not lo <= v < hi)
    ]


def _add_gap(cols: _Columns, gap: Gap) -> None:
    d = cols.data
    bx: dict[str, Any] = {}
    recv_ns: Any = gap.recv_ns
    source: Any = gap.source
    publisher: Any = gap.publisher
    if type(recv_ns) is not int or not -I63 <= recv_ns < I63:
        bx["recv_ns"], recv_ns = to_json_value(recv_ns), None
    if type(source) is not str:
        bx["source"], source = to_json_value(source), _display(source)
    if publisher is not None and type(publisher) is not str:
        bx["publisher"], publisher = to_json_value(publisher), _display(publisher)
    from_seq = gap.from_seq
    seq = from_seq if type(from_seq) is int and 0 <= from_seq < U64 else None
    values = [recv_ns, None, source, None, publisher, seq, None, None, None]
    for name, v in zip(BATCH_COLUMNS, values, strict=True):
        d[name].append(v)
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


def _add_batches(
    cols: _Columns,
    batches: list[Batch],
    index: int,
    raw_frames: str,
    recipes: Sequence[str | None] | None,
    queue_events: bool = True,
) -> None:
    """Rows of consecutive batches, column by column: one row per event (one for a batch
    without events), batch values repeated on each; the event columns are left null, their
    events queued for :func:`_fill_events` (unless the caller fills them: ``queue_events``
    false)."""
    d = cols.data
    row0 = len(d["type"])
    *values, frames, events = map(list, zip(*map(_BATCH_FIELDS, batches), strict=True))
    extras: dict[int, list[tuple[str, type, Any]]] = {}
    cacheable = True  # every misfit is an int, str, bool or None: equal keys, equal JSON
    for (name, ok, bounds, shown), col in zip(_BATCH_FITS, values, strict=True):
        misfits = _misfits(col, ok, bounds)
        if not misfits:
            continue
        cacheable = cacheable and {type(col[i]) for i in misfits} <= _CACHEABLE
        for i in misfits:
            v = col[i]
            extras.setdefault(i, []).append((name, type(v), v))
            if name not in ("error", "recovered"):
                col[i] = _display(v) if shown else None
    *batch_values, raw_error, recovered = values
    error = [e if type(e) is str else None for e in raw_error] if extras else raw_error
    batch_extra: list[str | None] = [None] * len(batches)
    cache = cols.batch_extras
    for i, entries in extras.items():
        key = tuple(entries) if cacheable else None
        text = cache.get(key) if key is not None else None
        if text is None:
            text = dumps({name: to_json_value(v) for name, _, v in entries})
            if key is not None:
                cache[key] = text
        batch_extra[i] = text

    if set(map(type, chain.from_iterable(frames))) <= {bytes}:
        raw_size = [sum(map(len, f)) for f in frames]
    else:  # a library caller's bytearray/memoryview frames
        frames = [[bytes(f) for f in fs] for fs in frames]
        raw_size = [sum(map(len, f)) for f in frames]
    if raw_frames == "auto":
        codecs = list(recipes) if recipes is not None else list(map(frames_recipe, batches))
        frames = [None if c else f for f, c in zip(frames, codecs, strict=True)]
    else:
        codecs = [None] * len(batches)

    counts = [len(e) or 1 for e in events]
    total = sum(counts)
    one_row_each = total == len(batches)
    # the batch of each row: per-batch lists become per-row ones by one C-level map each
    owner = (
        [] if one_row_each else list(chain.from_iterable(map(repeat, range(len(counts)), counts)))
    )

    def per_row(col: list[Any]) -> list[Any]:
        return col if one_row_each else list(map(col.__getitem__, owner))

    for name, col in zip(BATCH_COLUMNS, batch_values, strict=True):
        d[name].extend(per_row(col))
    d["batch_index"].extend(per_row(list(range(index, index + len(counts)))))
    d["recovered"].extend(per_row([r is True for r in recovered]))
    # the first row of each batch, within the run
    starts = range(total) if one_row_each else list(accumulate(counts, initial=0))[:-1]
    if one_row_each:
        d["event_index"].extend([0 if e else None for e in events])
        firsts = [error, raw_size, frames, codecs, batch_extra]
    else:
        d["event_index"].extend(
            chain.from_iterable(range(len(e)) if e else (None,) for e in events)
        )
        firsts = []
        for col in (error, raw_size, frames, codecs, batch_extra):
            rows: list[Any] = [None] * total
            deque(map(rows.__setitem__, starts, col), maxlen=0)
            firsts.append(rows)
    for name, col in zip(_FIRST_ROW_COLS, firsts, strict=True):
        d[name].extend(col)
    for name in _ROW_EVENT_COLS:
        d[name].extend([None] * total)  # event rows are filled by _fill_events
    empty = [i for i, e in enumerate(events) if not e]
    if empty:
        types = d["type"]
        for i in empty:
            if raw_error[i] is not None:
                types[row0 + starts[i]] = MALFORMED
    if not queue_events:
        return
    if empty:
        row_events = chain.from_iterable(e or (_NO_EVENT,) for e in events)
        cols.pending.extend(
            item
            for item in zip(range(row0, row0 + total), row_events, per_row(batches), strict=True)
            if item[1] is not _NO_EVENT
        )
    else:
        cols.pending.extend(
            zip(
                range(row0, row0 + total),
                chain.from_iterable(events),
                per_row(batches),
                strict=True,
            )
        )


_FIRST_ROW_COLS = ("error", "raw_size", "frames", "frames_codec", "batch_extra")


def typed_record_batch(
    batches: list[Batch],
    first_batch_index: int,
    raw_frames: str,
    recipes: Sequence[str | None] | None,
    event_columns: dict[str, list[Any]],
) -> pa.RecordBatch:
    """:func:`batches_to_record_batch` for batches whose events a typed decoder has turned into
    columns already (the converter's, :class:`kvctl.recording.convert.Decoder`): no per-event
    work here. ``event_columns``: event column name -> one value per event, the events of all
    ``batches`` in order, every value checked to fit its column as it is; the event columns
    not given are null on event rows. ``batch.events`` is only counted."""
    cols = _Columns()
    _add_batches(cols, batches, first_batch_index, raw_frames, recipes, queue_events=False)
    d = cols.data
    counts = [len(b.events) for b in batches]
    if all(counts):  # every row is an event row: the columns are the event columns
        d.update(event_columns)
    else:
        is_event = chain.from_iterable(repeat(True, n) if n else (False,) for n in counts)
        rows = list(compress(range(len(d["type"])), is_event))
        for name, vals in event_columns.items():
            deque(map(d[name].__setitem__, rows, vals), maxlen=0)
    arrays = [_array(n, d[n], t) for n, t, _ in COLUMNS]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


_ints = partial(msgspec.convert, type=list[int])
"""Checks a list holds ints only (bools refused; int subclasses taken: see ``plain_ints``)."""
# ``array`` type codes whose range is exactly that of a column's unsigned elements.
_U32 = next((c for c in "IL" if array(c).itemsize == 4), None)
_U64 = next((c for c in "LQ" if array(c).itemsize == 8), None)
_INT_LISTS = {"token_ids": _U32, "block_hashes": _U64, "tokens_hashes": _U64}


_DSTR = pa.dictionary(pa.int32(), pa.string())


def _array(name: str, values: list[Any], t: pa.DataType) -> pa.Array:
    """One column of the record batch. Lists of unsigned ints (token ids: most of the values)
    go through an ``array`` buffer, 3x faster than Arrow's conversion of Python lists."""
    n = len(values)
    if values.count(None) == n:  # a column the stream never uses (most of them)
        return pa.nulls(n, t)
    if t == _DSTR and type(values[0]) is str and values.count(values[0]) == n:
        # one string all along (a source, a topic, a medium): no hashing row by row
        return pa.DictionaryArray.from_arrays(
            pa.repeat(pa.scalar(0, pa.int32()), n), pa.array(values[:1], pa.string())
        )
    typecode = _INT_LISTS.get(name)
    if typecode is not None:
        try:
            return _int_list_array(values, t, typecode)
        except (TypeError, OverflowError):  # a null element (tokens_hashes may hold one)
            pass
    return pa.array(values, type=t)


def _int_list_array(values: list[Any], t: pa.DataType, typecode: str) -> pa.Array:
    flat = array(typecode)
    extend = flat.fromlist  # list by list: 2x faster than one list chained from them all
    for v in values:
        if v:
            extend(v)
    offsets = array("i", accumulate((0 if v is None else len(v) for v in values), initial=0))
    return pa.ListArray.from_arrays(
        pa.Array.from_buffers(pa.int32(), len(offsets), [None, pa.py_buffer(offsets)]),
        pa.Array.from_buffers(t.value_type, len(flat), [None, pa.py_buffer(flat)]),
        type=t,
        mask=pa.array([v is None for v in values]) if None in values else None,
    )


def _fill_events(cols: _Columns, typed_only: bool) -> None:
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
    if typed_only and slow:
        raise UntypedEvent
    if fast:
        slow.extend(_fill_fast(d, fast, pending, typed_only))
    if slow:
        if typed_only:
            raise UntypedEvent
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
    plain_ints: bool,
) -> list[tuple[int, Event, Batch]]:
    """Fill typed columns for ``fast`` events; return the ones that must take the slow path.
    ``plain_ints``: the values come from the msgpack decoder (no int subclass to refuse), so
    msgspec checks the types and an ``array`` of the column's width the range, in C."""
    evs = [ev for _, ev, _ in fast]
    bad: set[int] = set()

    def check(name: str, ok_types: set[type], per_event: Any) -> list[Any]:
        vals = [ev.get(name) for ev in evs]
        if not set(map(type, vals)) <= ok_types or not per_event(vals):
            for i, v in enumerate(vals):
                if type(v) not in ok_types or not per_event([v]):
                    bad.add(i)
        return vals

    def ints(lo: int, hi: int) -> Any:
        def ok(vals: list[Any]) -> bool:
            nums = [v for v in vals if v is not None]
            return not nums or (lo <= min(nums) and max(nums) < hi)

        return ok

    def int_lists(lo: int, hi: int, typecode: str | None = None) -> Any:
        def ok(vals: list[Any]) -> bool:
            flat = list(chain.from_iterable(v for v in vals if v))
            if not flat:
                return True
            if plain_ints:
                try:
                    _ints(flat)  # refuses bools, which the range checks below would take
                    if typecode is not None:
                        array(typecode, flat)  # OverflowError outside [lo, hi)
                        return True
                except (msgspec.ValidationError, OverflowError):
                    return False
            elif not set(map(type, flat)) <= {int}:
                return False
            return lo <= min(flat) and max(flat) < hi

        return ok

    def anything(vals: list[Any]) -> bool:
        return True

    none, lst = type(None), list
    types = check("type", {str}, anything)
    tokens = check("token_ids", {lst, none}, int_lists(0, 1 << 32, _U32))
    block_size = check("block_size", {int, none}, ints(-I31, I31))
    lora_id = check("lora_id", {int, none}, ints(-I63, I63))
    event_id = check("event_id", {int, none}, ints(0, U64))
    strs = {n: check(n, {str, none}, anything) for n in ("lora_name", "medium", "storage_tier")}
    th = check("tokens_hashes", {lst, none}, int_lists(0, U64, _U64))
    hashes = check("block_hashes", {lst, none}, int_lists(-I63, U64))
    parents = check("parent_block_hash", {int, none}, ints(-I63, U64))
    # Signedness is per event: a negative hash means a signed producer; one that also has a
    # hash >= 2**63 (both conventions at once) cannot be flagged, so it goes the slow way.
    signed = [False] * len(evs)
    try:
        parent_values = [p for p in parents if p is not None]
        any_negative = (bool(parent_values) and min(parent_values) < 0) or min(
            chain.from_iterable(h for h in hashes if h), default=0
        ) < 0
    except TypeError:  # bytes hashes of an event already refused: look event by event
        any_negative = True
    for i, (h, p) in enumerate(zip(hashes, parents, strict=True)):
        if not any_negative:  # vLLM, Dynamo: unsigned hashes, nothing to flag
            break
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
    out = []
    if bad:
        by_row = {r: b for r, _, b in pending}
        out = [(fast[i][0], fast[i][1], by_row[fast[i][0]]) for i in sorted(bad)]
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
    if bad:
        good = [i for i in range(len(rows)) if i not in bad]
        rows = [rows[i] for i in good]
        columns = {name: [vals[i] for i in good] for name, vals in columns.items()}
    contiguous = bool(rows) and rows[-1] - rows[0] + 1 == len(rows)  # rows only increase
    for name, vals in columns.items():
        if contiguous:
            d[name][rows[0] : rows[-1] + 1] = vals
        else:
            deque(map(d[name].__setitem__, rows, vals), maxlen=0)
    return out


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
