"""kvctl check in shards: ``--partition I/N`` checks one partition's workers (of a dataset, only
that partition's segments are read), and ``--merge`` turns the shards' JSON reports into the
report one check of the whole gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Engine, free_port, removed, stored
from dataset_builder import build_dataset
from inprocess import Live, run_main

from kvctl.partitions import partition_of

N = 4
EXAMPLES = "100000"  # every finding kept: the merged examples are the whole's, order aside
CHECK = ("--block-size", "8", "--max-examples", EXAMPLES)  # 16-token blocks: KV202 galore


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rec") / "run.parquet"
    result = run_main(
        "simulate", "-o", str(path), "--workers", "5", "--requests", "60", "--topspeed", "-q"
    )
    assert result.code == 0, result.err
    return path


@pytest.fixture(scope="module")
def dataset(recording, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hive")
    build_dataset(recording, root, "hive", N, 2)
    return root


def canonical(report: dict) -> dict:
    """What one check of the whole and the merge of its shards must agree on: everything but
    the run's own bookkeeping (elapsed time, shard labels) and the order of examples."""
    report = dict(report)
    for key in ("partition", "merged"):
        report.pop(key, None)
    report["stream"] = {k: v for k, v in report["stream"].items() if k != "elapsed_s"}
    report["rules"] = [
        {**r, "examples": sorted(r["examples"], key=lambda e: json.dumps(e, sort_keys=True))}
        for r in report["rules"]
    ]
    return json.loads(json.dumps(report, sort_keys=True))


def check(*args: str) -> tuple[int, dict]:
    result = run_main("check", *args, "--json", "-q")
    assert result.code in (0, 3), result.err
    return result.code, json.loads(result.out)


@pytest.mark.parametrize("source", ["dataset", "recording"])
def test_the_merged_shards_are_the_whole(request, tmp_path, source):
    path = str(request.getfixturevalue(source))
    code, whole = check(path, *CHECK)
    assert code == 3 and whole["rules"] and whole["workers"]
    shards = []
    for i in range(N):
        code_i, report = check(path, "--partition", f"{i}/{N}", *CHECK)
        assert report["partition"] == {"index": i, "count": N}
        shard = tmp_path / f"r{i}.json"
        shard.write_text(json.dumps(report))
        shards.append(str(shard))
    # each shard holds only its own workers, and together they are all of them
    seen = [w for s in shards for w in json.loads(Path(s).read_text())["workers"]]
    assert sorted(seen) == sorted(whole["workers"])
    result = run_main("check", "--merge", *reversed(shards), *CHECK, "--json")
    assert result.code == code
    assert canonical(json.loads(result.out)) == canonical(whole)
    # the readable report of the merge says what the whole's says
    text = run_main("check", "--merge", *shards, *CHECK)
    assert text.code == 3 and "FAIL" in text.out and "KV202" in text.out


def test_a_partition_of_a_dataset_reads_only_its_segments(recording, tmp_path):
    built = build_dataset(recording, tmp_path, "hive", N, 2)
    for b in built:
        if b.segment.partition != 1:
            b.path.write_bytes(b"not parquet")  # read, it would fail the check
    code, report = check(str(tmp_path), "--partition", f"1/{N}", *CHECK)
    mine: set[str] = set().union(*(b.workers for b in built if b.segment.partition == 1))
    assert mine and report["workers"] == sorted(f"{w}[dp0]" for w in mine)


def test_merge_without_findings_exits_0(recording, tmp_path):
    shards = []
    for i in range(2):
        code, report = check(str(recording), "--partition", f"{i}/2")
        assert code == 0
        (tmp_path / f"r{i}.json").write_text(json.dumps(report))
        shards.append(str(tmp_path / f"r{i}.json"))
    result = run_main("check", "--merge", *shards, "--json")
    assert result.code == 0 and json.loads(result.out)["ok"] is True


@pytest.mark.parametrize(
    "content",
    ["not json at all", json.dumps({"overall": {}, "workers": {}}), json.dumps([1, 2])],
    ids=["text", "stats-report", "array"],
)
def test_merge_refuses_what_is_not_a_check_report(tmp_path, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    result = run_main("check", "--merge", str(bad))
    assert result.code == 2
    assert (
        len(result.err.strip().splitlines()) == 1
        and "not a kvctl check --json report" in result.err
    )


def test_merge_refuses_a_partition_given_twice(recording, tmp_path):
    _, report = check(str(recording), "--partition", "0/2")
    shard = tmp_path / "r0.json"
    shard.write_text(json.dumps(report))
    result = run_main("check", "--merge", str(shard), str(shard))
    assert result.code == 2 and "given twice" in result.err


@pytest.mark.parametrize("value", ["4/4", "1", "a/b", "-1/2", "0/0"])
def test_partition_must_be_i_of_n(recording, value):
    result = run_main("check", str(recording), "--partition", value)
    assert result.code == 2 and f"--partition {value!r}" in result.err, result.err
    assert len(result.err.strip().splitlines()) == 1


def test_a_live_source_keeps_only_the_partitions_workers(endpoint):
    label = {partition_of(str(w), 2): str(w) for w in range(8)}  # a worker in each partition
    mine, other = Engine(endpoint), Engine(f"tcp://127.0.0.1:{free_port()}")

    def talk(_: Live) -> None:
        mine.wait_for()
        other.wait_for()
        mine.send([stored([1])])
        mine.send([stored([2], parent=1)])
        other.send([removed([99])])  # KV101 on partition 1's worker: not partition 0's

    try:
        result = run_main(
            "check",
            f"{label[0]}={mine.endpoint}",
            f"{label[1]}={other.endpoint}",
            "--partition",
            "0/2",
            "--idle-timeout",
            "1.5",
            "--json",
            "-q",
            alongside=talk,
        )
    finally:
        mine.close()
        other.close()
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["workers"] == [f"{label[0]}[dp0]"] and report["batches"] == 2
    assert report["rules"] == []  # neither the other worker's KV101 nor a KV306 for its source
