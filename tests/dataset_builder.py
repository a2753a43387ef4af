"""Build a dataset (the segments of partitioned recorders, see kvctl/recording/dataset.py) from
one recording, as the recorders of a fleet stream would have written it: each message gets a
stream seq in arrival order, goes to the partition of its worker
(``partitions.partition_of(partition_key(worker, source), N)``), and each partition's messages
are cut into consecutive segments, each sorted by (worker_id, dp_rank, seq) and written under
the names and directories dataset.py gives. For tests (and benches) until the partitioned
recorders write real ones."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kvctl.partitions import partition_of
from kvctl.recording.dataset import Segment, segment_path
from kvctl.recording.schema import METADATA_KEY


@dataclass
class BuiltSegment:
    path: Path
    segment: Segment
    rows: int
    workers: frozenset[str]


def partition_keys(table: pa.Table) -> list[str]:
    """Each row's partition key: its worker_id text, else its source."""
    workers = table.column("worker_id").cast(pa.string()).to_pylist()
    sources = table.column("source").cast(pa.string()).to_pylist()
    return [w if w is not None else s for w, s in zip(workers, sources, strict=True)]


def message_numbers(table: pa.Table) -> list[int]:
    """The stream seq (1, 2, ...) of each row's message in arrival order: a batch's rows share
    one (same batch_index, contiguous); a gap row is a message of its own."""
    numbers = []
    previous = object()
    n = 0
    for index in table.column("batch_index").to_pylist():
        if index is None or index != previous:
            n += 1
        previous = index
        numbers.append(n)
    return numbers


def build_dataset(
    recording: str | Path,
    root: str | Path,
    layout: str = "hive",
    partitions: int = 4,
    segments_per_partition: int = 3,
    stream: str = "FLEET",
    row_group_size: int | None = None,
    say_partitions: bool = True,
) -> list[BuiltSegment]:
    """Split ``recording`` (one Parquet file) into a dataset under ``root``. ``say_partitions``:
    the footers say how many partitions the stream has (``partitions`` in kvctl's metadata)."""
    table = pq.read_table(recording)
    footer = pq.ParquetFile(recording).metadata.metadata or {}
    meta = json.loads(footer[METADATA_KEY.encode()])
    if say_partitions:
        meta["partitions"] = partitions
    keys = partition_keys(table)
    seqs = message_numbers(table)
    memo: dict[str, int] = {}
    part_of = [memo.setdefault(k, partition_of(k, partitions)) for k in keys]
    table = table.append_column("_stream_seq", pa.array(seqs, pa.int64()))
    table = table.append_column("_part", pa.array(part_of, pa.int32()))
    table = table.append_column("_pos", pa.array(range(table.num_rows), pa.int64()))
    table = table.append_column("_worker", table.column("worker_id").cast(pa.string()))
    built = []
    for p in range(partitions):
        rows = table.filter(pc.equal(table.column("_part"), p))
        if not rows.num_rows:
            continue
        messages = sorted(set(rows.column("_stream_seq").to_pylist()))
        per = -(-len(messages) // segments_per_partition)
        covered = 0  # a recorder names a segment after the last: they tile the seq line
        for start in range(0, len(messages), per):
            chunk = messages[start : start + per]
            first, last = covered + 1, chunk[-1]
            covered = last
            seg_rows = rows.filter(
                pc.and_(
                    pc.greater_equal(rows.column("_stream_seq"), chunk[0]),
                    pc.less_equal(rows.column("_stream_seq"), last),
                )
            )
            seg_rows = seg_rows.sort_by(
                [
                    ("_worker", "ascending"),
                    ("dp_rank", "ascending"),
                    ("seq", "ascending"),
                    ("_pos", "ascending"),
                ]
            )
            segment = Segment(stream, p, first, last)
            recv0 = seg_rows.column("recv_ns")[0].as_py()
            path = Path(root) / segment_path(layout, segment, recv0)
            path.parent.mkdir(parents=True, exist_ok=True)
            out = seg_rows.drop_columns(["_stream_seq", "_part", "_pos", "_worker"])
            out = out.replace_schema_metadata(
                {**(out.schema.metadata or {}), METADATA_KEY.encode(): json.dumps(meta).encode()}
            )
            pq.write_table(out, path, row_group_size=row_group_size)
            workers = frozenset(k for k in set(partition_keys(out)))
            built.append(BuiltSegment(path, segment, out.num_rows, workers))
    return built
