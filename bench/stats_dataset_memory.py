"""Peak memory of ``kvctl stats`` over datasets of growing row counts: it should stay flat.

Usage: python bench/stats_dataset_memory.py [--rows 1000000 5000000] [--partitions 4]

A simulated recording (8 workers, a small KV cache so that blocks are evicted) is repeated,
each copy with its seqs, batch numbers and times shifted past the previous one (same workers,
same block hashes: the cache model stays the size of the workers' caches), and written as a
flat dataset of N partitions, segments of about 100 000 rows sorted by (worker, dp rank, seq)
in row groups of 50 000. Each size is measured in a fresh process (``python -m kvctl stats
DIR --json``): peak resident memory (the child's ru_maxrss) and wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from kvctl.partitions import partition_of  # noqa: E402
from kvctl.recording.dataset import Segment, segment_path  # noqa: E402
from kvctl.recording.schema import METADATA_KEY  # noqa: E402

SEGMENT_ROWS = 100_000
ROW_GROUP = 50_000


def base_recording(where: Path, requests: int) -> Path:
    path = where / "base.parquet"
    subprocess.run(
        [sys.executable, "-m", "kvctl", "simulate", "-o", str(path), "--workers", "8"]
        + ["--requests", str(requests), "--num-blocks", "512", "--topspeed", "-q"],
        cwd=REPO,
        check=True,
    )
    return path


def write_dataset(base: Path, root: Path, rows: int, partitions: int) -> int:
    """``rows`` (about) rows of shifted copies of ``base``; the rows written."""
    table = pq.read_table(base)
    footer = json.loads(pq.ParquetFile(base).metadata.metadata[METADATA_KEY.encode()])
    footer["partitions"] = partitions
    meta = {METADATA_KEY.encode(): json.dumps(footer).encode()}
    recv = table.column("recv_ns")
    span = pc.max(recv).as_py() - pc.min(recv).as_py() + 1_000_000
    seq_step = (pc.max(table.column("seq")).as_py() or 0) + 1
    index_step = (pc.max(table.column("batch_index")).as_py() or 0) + 1
    keys = table.column("worker_id").cast(pa.string()).to_pylist()
    parts = pa.array([partition_of(k, partitions) for k in keys], pa.int32())
    copies = max(1, rows // table.num_rows)
    written = 0
    for p in range(partitions):
        mine = table.filter(pc.equal(parts, p))
        if not mine.num_rows:
            continue
        per_segment = max(1, SEGMENT_ROWS // mine.num_rows)
        seq_first = 1
        for start in range(0, copies, per_segment):
            pieces = []
            for c in range(start, min(copies, start + per_segment)):
                shifted = mine
                for name, step in (
                    ("recv_ns", span),
                    ("seq", seq_step),
                    ("batch_index", index_step),
                ):
                    column = shifted.column(name)
                    moved = pc.add(column, pa.scalar(step * c, column.type))
                    shifted = shifted.set_column(shifted.schema.get_field_index(name), name, moved)
                shifted = shifted.set_column(
                    shifted.schema.get_field_index("ts"),
                    "ts",
                    pc.add(shifted.column("ts"), span * c / 1e9),
                )
                pieces.append(shifted)
            segment_rows = pa.concat_tables(pieces)
            order = pa.table(
                {
                    "w": segment_rows.column("worker_id").cast(pa.string()),
                    "d": segment_rows.column("dp_rank"),
                    "s": segment_rows.column("seq"),
                    "i": pa.array(range(segment_rows.num_rows), pa.int64()),
                }
            )
            segment_rows = segment_rows.take(
                pc.sort_indices(order, [(c, "ascending") for c in ("w", "d", "s", "i")])
            )
            segment = Segment("BENCH", p, seq_first, seq_first + segment_rows.num_rows)
            seq_first = segment.last + 1
            path = root / segment_path("flat", segment, 0)
            pq.write_table(
                segment_rows.replace_schema_metadata(meta), path, row_group_size=ROW_GROUP
            )
            written += segment_rows.num_rows
    return written


MEASURE = """
import resource, subprocess, sys, time
started = time.monotonic()
done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
elapsed = time.monotonic() - started
if done.returncode:
    sys.exit(done.stderr)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, elapsed)
"""


def measure(root: Path) -> tuple[int, float]:
    """Peak RSS (KiB) and wall seconds of one ``kvctl stats`` over ``root``."""
    command = [sys.executable, "-m", "kvctl", "stats", str(root), "--json", "-q"]
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *command],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return int(out[0]), float(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 5_000_000])
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--requests", type=int, default=2000, help="of the base recording")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = base_recording(Path(tmp), args.requests)
        print(f"base recording: {pq.ParquetFile(base).metadata.num_rows:,} rows")
        for rows in args.rows:
            root = Path(tmp) / f"ds{rows}"
            root.mkdir()
            written = write_dataset(base, root, rows, args.partitions)
            files = len(list(root.iterdir()))
            peak, elapsed = measure(root)
            print(
                f"kvctl stats: {written:>11,} rows in {files:>3} segments of "
                f"{args.partitions} partitions: peak RSS {peak / 1024:7.1f} MiB, "
                f"{elapsed:6.1f} s ({written / elapsed:,.0f} rows/s)"
            )
            for f in root.iterdir():
                f.unlink()


if __name__ == "__main__":
    main()
