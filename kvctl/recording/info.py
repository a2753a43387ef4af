"""What ``kvctl inspect`` shows about a recording, computed by scanning it column-wise."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from ..redact import redact_metadata
from .counts import Counts
from .journal import journal_metadata
from .layout import NotARecording
from .reader import (
    DAMAGE,
    DatasetPlan,
    dataset_record_batches,
    file_metadata,
    is_dataset,
    plan_dataset,
    record_batches,
    recording_sources,
)
from .tagged_json import from_json_value

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
        if is_dataset(path):
            return _dataset_info(str(path))
        return _recording_info(Path(path))
    except DAMAGE as exc:
        raise NotARecording(f"damaged recording ({type(exc).__name__}: {exc})") from None


def _recording_info(root: Path) -> dict[str, Any]:
    sources = recording_sources(root)
    files = []
    metadata: dict[str, Any] = {}
    schema_version = None
    size = 0
    for kind, p in sources:
        st = p.stat().st_size
        size += st
        meta = file_metadata(p) if kind == "parquet" else journal_metadata(p)
        if not metadata:
            metadata = meta.get("metadata", {})
            schema_version = meta.get("schema_version")
        files.append({"path": str(p), "kind": kind, "bytes": st})
    info = _scan(record_batches(root, columns=_INFO_COLUMNS, batch_size=64 * 1024))
    raw = info["raw_bytes"]
    return {
        "path": str(root),
        "schema_version": schema_version,
        "kvctl_version": _first_version(sources),
        "metadata": redact_metadata(metadata),  # recordings of older versions held secrets
        "files": files,
        "bytes": size,
        "ratio": size / raw if raw else None,
        **info,
        "journals": sum(k == "journal" for k, _ in sources),  # read from unconverted journals
    }


def _dataset_info(location: str) -> dict[str, Any]:
    """A dataset's info: what a recording's says (its rows scanned in storage order, an
    aggregate being order-free), and ``dataset``: its streams, partitions, segments, and each
    partition's seq coverage with its holes (see :func:`partition_coverage`)."""
    plan = plan_dataset(location)
    first = plan.files[0].metadata if plan.files else {}
    size = sum(f.bytes for f in plan.files)
    info = _scan(dataset_record_batches(plan, _INFO_COLUMNS))
    raw = info["raw_bytes"]
    return {
        "path": location,
        "schema_version": first.get("schema_version"),
        "kvctl_version": next(
            (f.metadata["kvctl_version"] for f in plan.files if f.metadata.get("kvctl_version")),
            None,
        ),
        "metadata": redact_metadata(first.get("metadata", {})),
        "files": [{"path": f.path, "kind": "parquet", "bytes": f.bytes} for f in plan.files],
        "bytes": size,
        "ratio": size / raw if raw else None,
        **info,
        "journals": 0,
        "dataset": dataset_layout(plan),
    }


def dataset_layout(plan: DatasetPlan) -> dict[str, Any]:
    """Streams, partitions and segments of a dataset, from the segments' names and footers."""
    streams: dict[str, dict[str, Any]] = {}
    layouts = set()
    for f in plan.files:
        relative = f.path[len(plan.root) :].lstrip("/")
        layouts.add("hive" if "/" in relative else "flat")
        stream = streams.setdefault(f.segment.stream, {"partitions": {}})
        part = stream["partitions"].setdefault(
            str(f.segment.partition), {"segments": 0, "rows": 0, "bytes": 0, "ranges": []}
        )
        part["segments"] += 1
        part["rows"] += f.rows
        part["bytes"] += f.bytes
        part["ranges"].append((f.segment.first, f.segment.last))
    for stream in streams.values():
        for part in stream["partitions"].values():
            part.update(partition_coverage(part.pop("ranges")))
    return {
        "layout": "/".join(sorted(layouts)),
        "segments": plan.segments,
        "streams": streams,
    }


def partition_coverage(ranges: list[tuple[int, int]]) -> dict[str, Any]:
    """The stream seqs a partition's segments cover, and the holes between them. A recorder
    names each segment after the last (FIRST = the previous LAST + 1: the seqs between that
    it did not receive are other partitions'), so a seq range no segment covers was never
    written: a recorder lost it (killed, and the stream's copy expired). Overlaps (a
    segment written twice) are counted too."""
    holes: list[list[int]] = []
    overlaps = 0
    ordered = sorted(ranges)
    covered_to = None
    for first, last in ordered:
        if covered_to is not None:
            if first > covered_to + 1:
                holes.append([covered_to + 1, first - 1])
            elif first <= covered_to:
                overlaps += 1
        covered_to = last if covered_to is None else max(covered_to, last)
    return {
        "first_seq": ordered[0][0] if ordered else None,
        "last_seq": covered_to,
        "holes": holes,
        "missing_seqs": sum(b - a + 1 for a, b in holes),
        "overlaps": overlaps,
    }


def _scan(batches: Any) -> dict[str, Any]:
    """Counts, types, workers, seq ranges and gaps over rows of ``_INFO_COLUMNS``."""
    counts = Counts()
    by_type: dict[str, int] = {}
    by_worker: dict[str, int] = {}
    publishers: dict[str, dict[str, Any]] = {}
    gaps: list[dict[str, Any]] = []
    ts_lo = ts_hi = None
    for rb in batches:
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
        _add_seq_ranges(publishers, rb)
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
    return {
        "raw_bytes": counts.raw_bytes,
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
    }


def _add_seq_ranges(publishers: dict[str, dict[str, Any]], rb: pa.RecordBatch) -> None:
    """Batches and seq range per publisher, from the first row of each batch in ``rb``."""
    firsts = rb.filter(pc.is_valid(rb.column("raw_size")))
    if firsts.num_rows:
        table = pa.Table.from_batches([firsts.select(["publisher", "seq"])])
        table = table.set_column(0, "publisher", table.column(0).cast(pa.string()))
        agg = table.group_by("publisher").aggregate(
            [("seq", "min"), ("seq", "max"), ("seq", "count"), ("seq", "count_distinct")]
        )
        for row in agg.to_pylist():
            key = row["publisher"] if row["publisher"] is not None else "null"
            seen = publishers.setdefault(
                key, {"batches": 0, "min_seq": None, "max_seq": None, "distinct_seqs": 0}
            )
            seen["batches"] += row["seq_count"]
            seen["distinct_seqs"] += row["seq_count_distinct"]  # per chunk: an upper bound
            if row["seq_min"] is not None:
                seen["min_seq"] = (
                    row["seq_min"]
                    if seen["min_seq"] is None
                    else min(seen["min_seq"], row["seq_min"])
                )
                seen["max_seq"] = (
                    row["seq_max"]
                    if seen["max_seq"] is None
                    else max(seen["max_seq"], row["seq_max"])
                )


def _first_version(sources: list[tuple[str, Path]]) -> str | None:
    for kind, p in sources:
        meta = file_metadata(p) if kind == "parquet" else journal_metadata(p)
        if meta.get("kvctl_version"):
            return meta["kvctl_version"]
    return None
