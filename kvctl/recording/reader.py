"""Reading recordings back: a file, a segment directory or a journal (decoded on the fly), in
recorded order, as batches (:func:`open_recording`) or as rows of the schema
(:func:`record_batches`). Anything kvctl did not write is refused with :class:`NotARecording`
(one clear line rather than a traceback or "0 events")."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any, Literal, overload

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..events import Batch
from .convert import event_batches
from .dataset import Segment, check_bucket, is_remote, list_segments, open_root, s3_error
from .journal import NotAJournal, journal_header
from .layout import JOURNAL_SUFFIX, MANIFEST_NAME, SEGMENT_JOURNAL_RE, SEGMENT_RE, NotARecording
from .rebuild import columns_to_pylists, rows_to_batches
from .schema import METADATA_KEY, SCHEMA, SCHEMA_VERSION, Gap


def recording_sources(path: Path) -> list[tuple[str, Path]]:
    """(kind, path) of everything that holds rows, in recorded order (a local dataset: its
    segments in storage order); each one checked to be a kvctl recording or journal whose
    columns have the schema's types (else :class:`NotARecording`: one clear line rather than
    a traceback or "0 events")."""
    if is_dataset(path):
        plan = plan_dataset(path)
        return [("parquet", Path(f.path)) for f in plan.files]
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
    _check_schema(pq.ParquetFile(p), label)


def _check_schema(pf: pq.ParquetFile, label: str) -> None:
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
            if m := SEGMENT_RE.match(e.name):
                items.append((int(m.group(1)), "parquet", e))
            elif (m := SEGMENT_JOURNAL_RE.match(e.name)) and not (
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


def record_batches(
    path: Path, columns: list[str] | None = None, batch_size: int = 16 * 1024
) -> Iterator[pa.RecordBatch]:
    """Rows of the schema (only ``columns`` if given), source after source, in recorded order
    (a dataset: in storage order, see :func:`dataset_record_batches`)."""
    if is_dataset(path):
        yield from dataset_record_batches(plan_dataset(path), columns)
        return
    for kind, p in recording_sources(path):
        if kind == "parquet":
            yield from pq.ParquetFile(p).iter_batches(batch_size=batch_size, columns=columns)
        else:
            for rb in event_batches(p):
                yield rb.select(columns) if columns else rb


@overload
def open_recording(
    path: str | os.PathLike[str],
    include_gaps: Literal[False] = False,
    batch_size: int = 16 * 1024,
    selection: Any = None,
) -> Iterator[Batch]: ...


@overload
def open_recording(
    path: str | os.PathLike[str],
    include_gaps: bool,
    batch_size: int = 16 * 1024,
    selection: Any = None,
) -> Iterator[Batch | Gap]: ...


def open_recording(
    path: str | os.PathLike[str],
    include_gaps: bool = False,
    batch_size: int = 16 * 1024,
    selection: Any = None,
) -> Iterator[Batch | Gap]:
    """Iterate the batches of a recording (file, segment directory or journal), in recorded
    order, or of a dataset (a directory of partitioned segments, or ``s3://bucket/prefix``),
    in receive-time order, with their events and raw frames. ``include_gaps`` also yields
    :class:`Gap`.

    ``selection`` (a :class:`~kvctl.selection.Filters`-like object) is pushed down into a
    dataset: files, row groups and rows of other workers, partitions or times are not read
    (see :func:`plan_dataset`); a single recording is read whole (the pipeline filters).

    A batch's rows may straddle many chunks (a million-event batch spans dozens): its pieces
    are held and joined once, when the batch is complete, so reading stays linear. Rows no
    kvctl writer produces (a damaged or doctored file) raise :class:`NotARecording`."""
    try:
        if is_dataset(path):
            plan = plan_dataset(path, selection)
            yield from _dataset_batches(plan, include_gaps, batch_size, selection)
        else:
            yield from _read_batches(Path(path), include_gaps, batch_size)
    except DAMAGE as exc:
        raise NotARecording(f"damaged recording ({type(exc).__name__}: {exc})") from None


# What rows that passed the schema check can still raise when a file was damaged or doctored.
DAMAGE = (RecursionError, KeyError, TypeError, IndexError, AttributeError, OverflowError)


def _read_batches(path: Path, include_gaps: bool, batch_size: int) -> Iterator[Batch | Gap]:
    return _assemble(record_batches(path, batch_size=batch_size), include_gaps)


def _assemble(chunks: Iterator[pa.RecordBatch], include_gaps: bool) -> Iterator[Batch | Gap]:
    """The batches (and gaps) of consecutive chunks of rows, a batch's rows being contiguous."""
    held: list[dict[str, list[Any]]] = []  # pieces of the batch that straddles chunks
    held_index: Any = None
    for rb in chunks:
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


def file_metadata(path: Path) -> dict[str, Any]:
    """The kvctl metadata in a Parquet file's footer ({} if none)."""
    kv = pq.ParquetFile(path).metadata.metadata or {}
    raw = kv.get(METADATA_KEY.encode())
    return json.loads(raw) if raw else {}


# --- datasets: the segments of partitioned recorders (see kvctl.recording.dataset) --------------
#
# A dataset's files are each sorted by (worker_id, dp_rank, seq), not by receive time, and
# several partitions hold disjoint sets of workers. Two ways to read one:
#
# - in storage order (:func:`dataset_record_batches`): partition after partition, segment after
#   segment, one row group at a time. Each worker's messages come in stream order; memory is
#   one row group. For order-free aggregates (``kvctl inspect``).
# - in receive-time order (:func:`open_recording`, hence every pipeline command): a lazy heap
#   merge over the files. A file is opened only once the merge reaches the smallest receive
#   time its Parquet statistics give, and is then read whole (its selected row groups) and
#   sorted by receive time: a row group of a file sorted by worker is no time range, so
#   nothing smaller is a sorted run. Segments of one partition follow each other in time, so
#   the files open at once are about one per partition: memory is bounded by the segment size
#   (in memory, of the columns read: a selection with ``needs_frames`` False leaves the raw
#   frames unread) times the number of partitions (times the overlap of consecutive
#   segments' time ranges, which is small), never by the dataset's row count. Recorders that
#   cut segments by size keep it bounded; a reader needing less would merge per-worker runs
#   (a cursor per worker and file), which costs a reader per worker.


@dataclass(frozen=True)
class DatasetFile:
    """One segment of a dataset selected for reading: where it is, what its name says, and
    the row groups (by index) that may hold selected rows."""

    path: str
    segment: Segment
    row_groups: tuple[int, ...]
    rows: int
    """Rows in the selected row groups."""
    min_recv_ns: int | None
    max_recv_ns: int | None
    metadata: dict[str, Any]
    bytes: int


@dataclass
class DatasetPlan:
    """What a read of a dataset touches: the files to read, in (stream, partition, first seq)
    order, and what the selection let it skip."""

    location: str
    fs: Any
    root: str
    files: list[DatasetFile]
    segments: int
    """Segments in the dataset."""
    skipped_files: int = 0
    skipped_row_groups: int = 0


def is_dataset(location: str | os.PathLike[str]) -> bool:
    """``s3://...``, or a local directory holding segments named as
    :mod:`kvctl.recording.dataset` says (at any depth: flat or hive)."""
    text = str(location)
    if is_remote(text):
        return True
    path = Path(text)
    if not path.is_dir():
        return False
    if any(SEGMENT_RE.match(e.name) for e in path.iterdir()):
        return False  # a segment directory of `kvctl record --rotate-*`
    fs, root = open_root(text)
    return bool(list_segments(fs, root))


def _hive_hour(relative: str) -> int | None:
    """The UTC hour since the epoch of a hive path's ``dt=``/``hour=`` directories."""
    import datetime as dt

    match = _HIVE_HOUR.search(relative)
    if match is None:
        return None
    day = dt.datetime.strptime(match["dt"], "%Y-%m-%d").replace(tzinfo=dt.timezone.utc)
    return int(day.timestamp()) // 3600 + int(match["hour"])


_HIVE_HOUR = re.compile(r"(?:^|/)dt=(?P<dt>\d{4}-\d{2}-\d{2})/hour=(?P<hour>\d{2})/")
_HOUR_NS = 3_600_000_000_000


def _stat_range(rg: Any, column: int) -> tuple[Any, Any] | None:
    """(min, max) of a row group's column from its statistics, None when it has none."""
    stats = rg.column(column).statistics
    if stats is None or not stats.has_min_max:
        return None
    return stats.min, stats.max


def _worker_text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def plan_dataset(location: str | os.PathLike[str], selection: Any = None) -> DatasetPlan:
    """The files (and their row groups) of a dataset a read needs under ``selection`` (a
    :class:`~kvctl.selection.Filters`-like object: ``workers``, ``partition``, and optional
    ``since_ns``/``until_ns``). Pruned without reading rows: by partition (the ``pPP`` of the
    name, which the ``part=`` directory repeats), by worker (the partition a worker's
    messages land in, when the footers say how many partitions the stream has; the
    ``worker_id`` statistics of each row group, files being sorted by worker), and by time
    (the ``dt``/``hour`` directories, then the ``recv_ns`` statistics). Every file read is
    checked to be a kvctl recording (:class:`NotARecording` otherwise)."""
    text = str(location)
    try:
        fs, root = open_root(text)
        segments = list_segments(fs, root)
        if not segments:
            check_bucket(fs, root)  # a listing takes a missing bucket for an empty prefix
    except OSError as exc:
        if not is_remote(text):
            raise
        raise OSError(s3_error(exc, text)) from None
    if not segments:
        raise FileNotFoundError(f"no dataset at {text} (no segments)")
    workers = frozenset(getattr(selection, "workers", None) or ())
    partition = getattr(selection, "partition", None)
    since = getattr(selection, "since_ns", None)
    until = getattr(selection, "until_ns", None)
    plan = DatasetPlan(text, fs, root, [], len(segments))
    stream_partitions: int | None = None
    for path, segment in segments:
        if partition is not None and segment.partition != partition[0]:
            plan.skipped_files += 1
            continue
        if workers and stream_partitions:
            from ..partitions import partition_of

            if segment.partition not in {partition_of(w, stream_partitions) for w in workers}:
                plan.skipped_files += 1
                continue
        hour = _hive_hour(path[len(root) :].lstrip("/"))
        if hour is not None and (
            (since is not None and (hour + 1) * _HOUR_NS <= since)
            or (until is not None and hour * _HOUR_NS > until)
        ):
            plan.skipped_files += 1
            continue
        pf = _parquet(fs, path)
        label = f"{path[len(root) :].lstrip('/')}: "
        _check_schema(pf, label)
        meta = _kvctl_metadata(pf)
        if stream_partitions is None:
            stream_partitions = _stream_partitions(meta)
            if workers and stream_partitions:  # this file too may be of another partition
                from ..partitions import partition_of

                if segment.partition not in {partition_of(w, stream_partitions) for w in workers}:
                    plan.skipped_files += 1
                    continue
        chosen = _row_groups(pf, workers, since, until)
        plan.skipped_row_groups += pf.metadata.num_row_groups - len(chosen)
        if not chosen:
            plan.skipped_files += 1
            continue
        recv = pf.schema_arrow.get_field_index("recv_ns")
        ranges = [_stat_range(pf.metadata.row_group(i), recv) for i in chosen]
        known = [r for r in ranges if r is not None]
        complete = len(known) == len(ranges)
        plan.files.append(
            DatasetFile(
                path=path,
                segment=segment,
                row_groups=tuple(chosen),
                rows=sum(pf.metadata.row_group(i).num_rows for i in chosen),
                # without statistics a file is opened at once (its time is unknown)
                min_recv_ns=min(r[0] for r in known) if complete and known else None,
                max_recv_ns=max(r[1] for r in known) if complete and known else None,
                metadata=meta,
                bytes=fs.get_file_info(path).size or 0,
            )
        )
    return plan


def _parquet(fs: Any, path: str) -> pq.ParquetFile:
    return pq.ParquetFile(fs.open_input_file(path))


def _kvctl_metadata(pf: pq.ParquetFile) -> dict[str, Any]:
    raw = (pf.metadata.metadata or {}).get(METADATA_KEY.encode())
    try:
        meta = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def _stream_partitions(meta: dict[str, Any]) -> int | None:
    """How many partitions the stream has, if the footer says (``partitions``, at the top of
    kvctl's metadata or in its ``metadata``)."""
    for where in (meta, meta.get("metadata") or {}):
        value = where.get("partitions") if isinstance(where, dict) else None
        if type(value) is int and value >= 1:
            return value
    return None


def _row_groups(
    pf: pq.ParquetFile, workers: frozenset[str], since: int | None, until: int | None
) -> list[int]:
    """The row groups whose statistics do not rule out every selected row."""
    schema = pf.schema_arrow
    recv = schema.get_field_index("recv_ns")
    worker = schema.get_field_index("worker_id")
    chosen = []
    for i in range(pf.metadata.num_row_groups):
        rg = pf.metadata.row_group(i)
        times = _stat_range(rg, recv)
        if times is not None and (
            (since is not None and times[1] < since) or (until is not None and times[0] > until)
        ):
            continue
        if workers:
            names = _stat_range(rg, worker)
            # a row group with null workers has them outside the statistics: kept
            if (
                names is not None
                and not rg.column(worker).statistics.null_count
                and not any(_worker_text(names[0]) <= w <= _worker_text(names[1]) for w in workers)
            ):
                continue
        chosen.append(i)
    return chosen


def _row_mask(table: pa.Table, selection: Any) -> pa.Array | None:
    """Rows of the selection (by worker or partition, and time); None: every row."""
    masks = []
    workers = frozenset(getattr(selection, "workers", None) or ())
    partition = getattr(selection, "partition", None)
    if workers or partition is not None:
        keys = _partition_keys(table)
        if workers:
            masks.append(pa.array([k in workers for k in keys], pa.bool_()))
        if partition is not None:
            from ..partitions import partition_of

            index, count = partition
            memo: dict[str, bool] = {}
            flags = []
            for k in keys:
                keep = memo.get(k)
                if keep is None:
                    keep = memo[k] = partition_of(k, count) == index
                flags.append(keep)
            masks.append(pa.array(flags, pa.bool_()))
    since = getattr(selection, "since_ns", None)
    until = getattr(selection, "until_ns", None)
    if since is not None:
        masks.append(pc.greater_equal(table.column("recv_ns"), since))
    if until is not None:
        masks.append(pc.less_equal(table.column("recv_ns"), until))
    if not masks:
        return None
    mask = masks[0]
    for m in masks[1:]:
        mask = pc.and_(mask, m)
    return mask


def _partition_keys(table: pa.Table) -> list[str]:
    """Each row's partition key: its ``worker_id`` text, else its source (as
    :func:`kvctl.partitions.partition_key`)."""
    workers = table.column("worker_id").cast(pa.string()).to_pylist()
    if None not in workers:
        return workers
    sources = table.column("source").cast(pa.string()).to_pylist()
    return [w if w is not None else str(s) for w, s in zip(workers, sources, strict=True)]


def dataset_record_batches(
    plan: DatasetPlan, columns: list[str] | None = None, selection: Any = None
) -> Iterator[pa.RecordBatch]:
    """Rows of the plan's files in storage order (partition, segment, row group): each
    worker's messages in stream order, one row group in memory at a time."""
    extra = [c for c in ("worker_id", "source", "recv_ns") if columns and c not in columns]
    read_columns = None if columns is None else [*columns, *extra]
    for f in plan.files:
        pf = _parquet(plan.fs, f.path)
        for i in f.row_groups:
            table = pf.read_row_group(i, columns=read_columns)
            mask = _row_mask(table, selection)
            if mask is not None:
                table = table.filter(mask)
            if columns is not None:
                table = table.select(columns)
            yield from table.to_batches()


def _time_sorted(
    plan: DatasetPlan, f: DatasetFile, selection: Any, batch_size: int
) -> Iterator[pa.RecordBatch]:
    """A file's selected rows in receive-time order (ties: file order, which keeps a batch's
    rows together and each worker's messages in stream order), ``batch_size`` rows at a time:
    the file's rows are held once, each chunk is taken from them as it is needed."""
    pf = _parquet(plan.fs, f.path)
    columns = None
    if not getattr(selection, "needs_frames", True):  # the largest columns, often
        columns = [n for n in pf.schema_arrow.names if n not in ("frames", "frames_codec")]
    table = pf.read_row_groups(list(f.row_groups), columns=columns)
    mask = _row_mask(table, selection)
    if mask is not None:
        table = table.filter(mask)
    order = pa.table(
        {"recv_ns": table.column("recv_ns"), "pos": pa.array(range(table.num_rows), pa.int64())}
    )
    indices = pc.sort_indices(order, [("recv_ns", "ascending"), ("pos", "ascending")])
    del order
    for start in range(0, len(indices), batch_size):
        yield from table.take(indices.slice(start, batch_size)).to_batches()


def _dataset_batches(
    plan: DatasetPlan, include_gaps: bool, batch_size: int, selection: Any
) -> Iterator[Batch | Gap]:
    """Every batch (and gap) of the plan's files, merged by receive time; see the notes at
    the top of this section for what it holds in memory."""
    import heapq

    def items(f: DatasetFile) -> Iterator[Batch | Gap]:
        yield from _assemble(_time_sorted(plan, f, selection, batch_size), include_gaps)

    rank = {f.path: n for n, f in enumerate(plan.files)}  # ties between files: stream order
    pending = sorted(
        plan.files,
        key=lambda f: (f.min_recv_ns if f.min_recv_ns is not None else -(1 << 63), rank[f.path]),
    )
    heap: list[tuple[int, int, int, Batch | Gap, Iterator[Batch | Gap]]] = []
    counter = 0

    def push(it: Iterator[Batch | Gap], file_rank: int) -> None:
        nonlocal counter
        item = next(it, None)
        if item is not None:
            counter += 1
            heapq.heappush(heap, (item.recv_ns or 0, file_rank, counter, item, it))

    nxt = 0
    while True:
        while nxt < len(pending) and (
            not heap or pending[nxt].min_recv_ns is None or pending[nxt].min_recv_ns <= heap[0][0]  # type: ignore[operator]
        ):
            f = pending[nxt]
            nxt += 1
            push(items(f), rank[f.path])
        if not heap:
            return
        _, file_rank, _, item, it = heapq.heappop(heap)
        yield item
        push(it, file_rank)
