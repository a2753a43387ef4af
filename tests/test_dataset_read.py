"""Every reading command reads a dataset (the segments of partitioned recorders, flat or
hive): the same output as on the one recording the dataset was split from (tests/
dataset_builder.py splits it as the recorders would), receive-time order where a command
needs it, and selections that leave the files of other workers and times unread."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import free_port
from dataset_builder import build_dataset
from inprocess import run_main
from test_cmd_replay import subscriber

from kvctl.recording.reader import open_recording, plan_dataset
from kvctl.selection import Filters

PARTITIONS = 4


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    """A simulated fleet of 6 workers: 5 000 events, a few hundred KiB."""
    path = tmp_path_factory.mktemp("rec") / "run.parquet"
    result = run_main(
        "simulate", "-o", str(path), "--workers", "6", "--requests", "120", "--topspeed", "-q"
    )
    assert result.code == 0, result.err
    return path


@pytest.fixture(scope="module", params=["hive", "flat"])
def dataset(request, recording, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    # small row groups: a file has several, so row-group pruning has something to skip
    build_dataset(recording, root, request.param, PARTITIONS, 3, row_group_size=150)
    return root


def run_ok(*args: str) -> str:
    result = run_main(*args, "-q") if args[0] not in ("inspect", "index") else run_main(*args)
    assert result.code == 0, result.err
    return result.out


def without_timing(report: dict) -> dict:
    report.get("stream", {}).pop("elapsed_s", None)
    return report


def test_cat_prints_the_dataset_in_receive_time_order(recording, dataset):
    # byte for byte what the recording prints: every event, in the order it was received
    assert run_ok("cat", str(dataset), "--json") == run_ok("cat", str(recording), "--json")
    times = [b.recv_ns for b in open_recording(dataset)]
    assert times == sorted(times) and len(times) == len(list(open_recording(recording)))


@pytest.mark.parametrize("command", ["check", "stats"])
def test_check_and_stats_report_as_on_the_recording(recording, dataset, command):
    whole = without_timing(json.loads(run_ok(command, str(recording), "--json")))
    assert without_timing(json.loads(run_ok(command, str(dataset), "--json"))) == whole


def test_inspect_says_it_is_a_dataset(recording, dataset):
    single = json.loads(run_ok("inspect", str(recording), "--json"))
    info = json.loads(run_ok("inspect", str(dataset), "--json"))
    for key in ("rows", "batches", "events", "gaps", "by_type", "by_worker", "raw_bytes"):
        assert info[key] == single[key], key
    for key in ("first_recv_ns", "last_recv_ns", "first_ts", "last_ts"):
        assert info[key] == single[key], key
    assert {p: (v["min_seq"], v["max_seq"]) for p, v in info["publishers"].items()} == {
        p: (v["min_seq"], v["max_seq"]) for p, v in single["publishers"].items()
    }
    ds = info["dataset"]
    assert ds["layout"] == dataset.name.rstrip("0123456789") and ds["segments"] == 12
    parts = ds["streams"]["FLEET"]["partitions"]
    assert sorted(parts) == ["0", "1", "2", "3"]
    assert sum(p["rows"] for p in parts.values()) == single["rows"]
    assert all(p["segments"] == 3 and p["holes"] == [] for p in parts.values())
    text = run_ok("inspect", str(dataset))
    assert "stream FLEET, 4 partitions" in text


def test_inspect_shows_a_hole_where_a_segment_is_missing(recording, tmp_path):
    built = build_dataset(recording, tmp_path, "flat", PARTITIONS, 3)
    lost = next(b for b in built if b.segment.partition == 2 and b.segment.first > 1)
    lost.path.unlink()  # a recorder killed, its stream data expired
    if lost.segment.last == max(b.segment.last for b in built if b.segment.partition == 2):
        pytest.skip("the lost segment was the partition's last: no hole between segments")
    info = json.loads(run_ok("inspect", str(tmp_path), "--json"))
    part = info["dataset"]["streams"]["FLEET"]["partitions"]["2"]
    assert part["holes"] == [[lost.segment.first, lost.segment.last]]
    assert str(lost.segment.first) in run_ok("inspect", str(tmp_path))


def snapshot_of(source: Path, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{source.name}.json"
    run_ok("index", str(source), "-o", str(out), "--overwrite", *args)
    return json.loads(out.read_text())


def test_index_until_a_time_leaves_later_segments_unread(recording, tmp_path):
    build_dataset(recording, tmp_path / "ds", "flat", PARTITIONS, 3)
    times = sorted(b.recv_ns for b in open_recording(recording))
    until = times[len(times) // 4]
    # the footers' recv_ns statistics put the later segments past the moment: unread
    assert plan_dataset(tmp_path / "ds", Filters(until_ns=until)).skipped_files >= PARTITIONS
    moment = f"{until / 1e9:.9f}"
    assert snapshot_of(tmp_path / "ds", tmp_path, "--until", moment) == snapshot_of(
        recording, tmp_path, "--until", moment
    )


def test_index_builds_the_same_snapshot(recording, dataset, tmp_path):
    assert snapshot_of(dataset, tmp_path) == snapshot_of(recording, tmp_path)
    times = sorted(b.recv_ns for b in open_recording(recording))
    middle = f"{times[len(times) // 2] / 1e9:.9f}"
    assert snapshot_of(dataset, tmp_path, "--until", middle) == snapshot_of(
        recording, tmp_path, "--until", middle
    )


def test_top_ends_with_the_same_table(recording, dataset):
    keep = ("worker", "blocks_cached", "last_seq", "gaps", "batches", "events", "stored_blocks")

    def last_table(source: Path) -> list[dict]:
        last = json.loads(run_ok("top", str(source), "--json").splitlines()[-1])
        return [{k: w[k] for k in keep} for w in last["workers"]]

    assert last_table(dataset) == last_table(recording)


def test_replay_sends_the_recorded_frames_in_receive_order(recording, dataset):
    def sent(source: Path) -> list[list[bytes]]:
        to = f"tcp://127.0.0.1:{free_port()}"
        expected = sum(1 for _ in open_recording(recording))
        received, receive = subscriber(to, expected)
        result = run_main(
            "replay",
            str(source),
            "--to",
            to,
            "--wait-subscribers",
            "1",
            "--topspeed",
            "--no-cache",
            "--json",
            alongside=receive,
        )
        assert result.code == 0, result.err
        assert len(received) == expected
        return [frames[1:] for frames in received]  # topic aside: the bytes sent

    assert sent(dataset) == sent(recording)


def corrupt(path: Path) -> None:
    path.write_bytes(b"not parquet at all" * 10)


def test_a_worker_selection_leaves_other_partitions_unread(recording, tmp_path):
    built = build_dataset(recording, tmp_path, "hive", PARTITIONS, 3)
    worker = sorted(built[0].workers)[0]
    for b in built:
        if worker not in b.workers:
            corrupt(b.path)  # read, it would fail the command
    expected = run_ok("cat", str(recording), "--json", "--worker", worker)
    assert run_ok("cat", str(tmp_path), "--json", "--worker", worker) == expected
    # without the selection the damage shows: one line, exit 1
    result = run_main("cat", str(tmp_path), "-q")
    assert result.code == 1 and len(result.err.strip().splitlines()) == 1, result.err


def test_a_worker_selection_skips_row_groups_by_their_statistics(recording, tmp_path):
    # footers that do not say how many partitions: only the worker_id statistics prune
    build_dataset(recording, tmp_path, "flat", 1, 2, row_group_size=100, say_partitions=False)
    whole = plan_dataset(tmp_path)
    plan = plan_dataset(tmp_path, Filters(workers=frozenset({"3"})))
    assert plan.skipped_row_groups > 0
    assert sum(f.rows for f in plan.files) < sum(f.rows for f in whole.files)
    mine = [b for b in open_recording(tmp_path, selection=Filters(workers=frozenset({"3"})))]
    assert mine and {str(b.worker_id) for b in mine} == {"3"}
    assert [b.seq for b in mine] == [
        b.seq for b in open_recording(recording) if str(b.worker_id) == "3"
    ]


def Window(since_ns: int | None, until_ns: int | None) -> Filters:  # noqa: N802
    return Filters(since_ns=since_ns, until_ns=until_ns)


def test_a_time_window_skips_files_and_keeps_the_rows_in_it(recording, tmp_path):
    build_dataset(recording, tmp_path, "hive", PARTITIONS, 3)
    times = sorted(b.recv_ns for b in open_recording(recording))
    since, until = times[0], times[len(times) // 5]
    plan = plan_dataset(tmp_path, Window(since, until))
    assert plan.skipped_files > 0  # later segments' recv_ns statistics are past the window
    got = [
        (b.recv_ns, b.source, b.seq)
        for b in open_recording(tmp_path, selection=Window(since, until))
    ]
    want = [
        (b.recv_ns, b.source, b.seq)
        for b in open_recording(recording)
        if since <= b.recv_ns <= until
    ]
    assert got == want


def test_a_segment_that_is_no_recording_is_one_line(recording, tmp_path):
    build_dataset(recording, tmp_path, "flat", PARTITIONS, 2)
    pq.write_table(
        pq.read_table(recording).select(["recv_ns"]),
        tmp_path / "FLEET.p09.000000000001-000000000002.parquet",
    )
    result = run_main("check", str(tmp_path), "-q")
    assert result.code == 1
    assert result.err.strip().splitlines() == [result.err.strip()]
    assert "FLEET.p09" in result.err and "not a kvctl recording" in result.err


def test_duckdb_reads_the_same_rows(recording, dataset):
    duckdb = pytest.importorskip("duckdb")
    pattern = str(dataset / "**" / "*.parquet")
    query = (
        "select count(*), sum(seq), count(distinct worker_id), min(recv_ns), max(recv_ns) "
        "from read_parquet('{}')"
    )
    assert (
        duckdb.sql(query.format(pattern)).fetchall()
        == duckdb.sql(query.format(recording)).fetchall()
    )
