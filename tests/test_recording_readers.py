"""A recording is plain Parquet: pyarrow, DuckDB and polars read what ``kvctl simulate -o``
wrote with the same rows, the same counts by type as kvctl's footer, and the hashes exactly as
unsigned 64-bit (values >= 2**63 included: a signed reading would turn them negative). The
token ids go through the encodings chosen in kvctl.recording.convert (BYTE_STREAM_SPLIT),
which every reader has to decode to the same values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import run_kvctl

COLUMNS = ["type", "block_hashes", "parent_block_hash", "token_ids"]


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A small simulated recording (a tiny cache, so that it has evictions too) and what
    ``kvctl inspect --json`` says about it."""
    path = tmp_path_factory.mktemp("readers") / "sim.parquet"
    sim = run_kvctl(
        "simulate", "-o", str(path), "--workers", "2", "--requests", "20", "--num-blocks", "64",
        "-q", timeout=90,
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr.decode()
    inspect = run_kvctl("inspect", str(path), "--json")
    assert inspect.returncode == 0, inspect.stderr.decode()
    info = json.loads(inspect.stdout)
    assert set(info["by_type"]) == {"BlockStored", "BlockRemoved"}, info["by_type"]
    return path, info


@pytest.fixture(scope="module")
def reference(recording: tuple[Path, dict[str, Any]]) -> dict[str, list[Any]]:
    """The columns as pyarrow reads them, in file order."""
    table = pq.read_table(recording[0], columns=COLUMNS)
    return {name: table[name].to_pylist() for name in COLUMNS}


def test_pyarrow_reads_the_rows_counts_and_unsigned_hashes(recording, reference):
    path, info = recording
    table = pq.read_table(path)
    assert table.num_rows == info["rows"]
    counts = pc.value_counts(table["type"].cast(pa.string())).to_pylist()
    assert {c["values"]: c["counts"] for c in counts} == info["by_type"]
    assert table.schema.field("block_hashes").type == pa.list_(pa.uint64())
    assert table.schema.field("parent_block_hash").type == pa.uint64()
    hashes = [h for hs in reference["block_hashes"] if hs for h in hs]
    assert max(hashes) >= 1 << 63  # the unsigned reading below is tested on such values


def test_duckdb_reads_the_same_recording(recording, reference):
    duckdb = pytest.importorskip("duckdb", reason="duckdb is not installed (the test extra)")
    path, info = recording
    con = duckdb.connect()
    source = "read_parquet(?)"
    assert con.execute(f"SELECT count(*) FROM {source}", [str(path)]).fetchone()[0] == info["rows"]
    by_type = con.execute(f"SELECT type, count(*) FROM {source} GROUP BY type", [str(path)])
    assert dict(by_type.fetchall()) == info["by_type"]
    types = con.execute(
        f"SELECT typeof(block_hashes), typeof(parent_block_hash) FROM {source} LIMIT 1",
        [str(path)],
    ).fetchone()
    assert types == ("UBIGINT[]", "UBIGINT")
    rows = con.execute(f"SELECT {', '.join(COLUMNS)} FROM {source}", [str(path)]).fetchall()
    for i, name in enumerate(COLUMNS):  # DuckDB keeps the file's row order
        assert [row[i] for row in rows] == reference[name], name


def test_polars_reads_the_same_recording(recording, reference):
    pl = pytest.importorskip("polars", reason="polars is not installed (the test extra)")
    path, info = recording
    frame = pl.read_parquet(path)
    assert frame.height == info["rows"]
    by_type = frame.group_by(pl.col("type").cast(pl.String)).len().rows()
    assert dict(by_type) == info["by_type"]
    assert frame.schema["block_hashes"] == pl.List(pl.UInt64)
    assert frame.schema["parent_block_hash"] == pl.UInt64
    for name in COLUMNS:
        column = frame[name]
        values = column.cast(pl.String).to_list() if name == "type" else column.to_list()
        assert values == reference[name], name
