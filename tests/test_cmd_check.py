"""kvctl check wired to real ZMQ publishers (in-process, the publisher in a thread; Ctrl-C in
a subprocess): live findings, the report, exit codes. Per-rule logic is covered by
test_checks.py; this is about the command."""

from __future__ import annotations

import json
import time

import pytest
from conftest import (
    Engine,
    finish,
    free_port,
    interrupt,
    read_line,
    removed,
    start_kvctl,
    stored,
)
from inprocess import Live, run_main

from kvctl.events import Batch
from kvctl.pipeline import run
from kvctl.selection import Filters, Limits
from kvctl.session import EveryBatch


def report(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out  # --json: exactly one object on stdout
    return json.loads(lines[0])


def publish_broken(engine: Engine) -> int:
    """One batch per mistake; returns the number of events sent (for -c)."""
    engine.send([stored([1, 2]), stored([3], parent=2)])  # clean start
    engine.send([removed([99])])  # KV101
    engine.send([stored([5], parent=77)])  # KV102
    engine.send([{**stored([6], parent=3), "token_ids": [1, 2, 3]}])  # KV201
    engine.send([stored([7], parent=6, block_size=8)])  # KV202 (--block-size 4), KV203
    engine.send_raw([b"", (engine.seq).to_bytes(8, "big"), b"\xc1garbage"])  # KV001
    engine.seq += 1
    engine.send([removed([1])], seq=9)  # KV301: 6..8 missing (5 arrived, if malformed)
    return 7


def publishing_broken(engine: Engine) -> None:
    engine.wait_for()
    publish_broken(engine)


EXPECTED_ERRORS = {"KV001", "KV101", "KV102", "KV201", "KV202", "KV301"}


def test_broken_stream_findings_print_live_and_exit_3(engine):
    result = run_main(
        "check",
        engine.endpoint,
        "--block-size",
        "4",
        "-c",
        "7",
        alongside=lambda _: publishing_broken(engine),
    )
    rc, out, err = result.code, result.out, result.err
    assert rc == 3, err
    finding_lines = [line for line in err.splitlines() if line.startswith("kvctl: KV")]
    ids = {line.split()[1] for line in finding_lines}
    assert ids == EXPECTED_ERRORS | {"KV203"}, err
    line = next(x for x in finding_lines if "KV101" in x)
    assert "error remove-unknown-block" in line and "seq 1" in line and "hash 99" in line
    assert "seq 9, expected 6" in next(x for x in finding_lines if "KV301" in x)
    # the report on stdout: grouped by rule with its name, severity and count, then a verdict
    for rule in EXPECTED_ERRORS:
        assert rule in out
    assert "remove-unknown-block" in out and "FAIL" in out and "6 errors" in out
    # and the same stream accounting as tap
    assert "7 events" in err and "gaps 1 (3 batches missing" in err and "malformed 1" in err


def test_json_report_is_one_object(engine):
    result = run_main(
        "check",
        engine.endpoint,
        "--block-size",
        "4",
        "-c",
        "7",
        "--json",
        alongside=lambda _: publishing_broken(engine),
    )
    rc, out, err = result.code, result.out, result.err
    assert rc == 3, err
    rep = report(out)
    assert rep["ok"] is False and rep["failed"] is True and rep["exit_code"] == 3
    rules = {r["id"]: r for r in rep["rules"]}
    assert set(rules) >= EXPECTED_ERRORS
    assert rules["KV101"]["count"] == 1 and rules["KV101"]["severity"] == "error"
    ex = rules["KV101"]["examples"][0]
    assert (ex["seq"], ex["hash"], ex["source"]) == (1, 99, engine.endpoint)
    assert ex["worker"] == f"{engine.endpoint}[dp0]" and ex["ts"] == 1_700_000_000.5
    assert rules["KV301"]["details"]["missing_batches"] == 3 == rep["stream"]["missing_batches"]
    assert (rep["errors"], rep["warnings"], rep["infos"]) == (6, 1, 0)
    assert rep["batches"] == 7 and rep["events"] == 7
    assert rep["stream"]["gaps"] == 1 and rep["stream"]["malformed"] == 1
    assert rep["sources"] == [engine.endpoint]


def test_clean_stream_exits_0(engine):
    def publish(_: Live) -> None:
        engine.wait_for()
        engine.send([stored([1, 2])])
        engine.send([stored([3], parent=2), removed([1])])
        engine.send([stored([4], parent=3), {"type": "AllBlocksCleared"}])
        engine.send([stored([10])])

    result = run_main(
        "check",
        engine.endpoint,
        "--block-size",
        "4",
        "--num-blocks",
        "4",
        "--expect-workers",
        "1",
        "-c",
        "6",
        alongside=publish,
    )
    rc, out, err = result.code, result.out, result.err
    assert rc == 0, err
    assert "KV" not in err and "OK: 0 errors, 0 warnings, 0 infos" in out


@pytest.mark.parametrize("fail_on,code", [("error", 0), ("warning", 3)])
def test_warnings_exit_0_unless_fail_on_warning(engine, fail_on, code):
    def publish(_: Live) -> None:
        engine.wait_for()
        engine.send([stored([1])])
        engine.send([stored([1])])  # KV103 duplicate store: a warning

    result = run_main(
        "check", engine.endpoint, "-c", "2", "--json", "--fail-on", fail_on, alongside=publish
    )
    rc, out, err = result.code, result.out, result.err
    rep = report(out)
    assert rc == code, err
    assert [r["id"] for r in rep["rules"]] == ["KV103"] and rep["warnings"] == 1
    assert rep["ok"] is True  # no errors; failing is the --fail-on policy's call


def test_gap_from_a_real_socket(engine):
    def publish(_: Live) -> None:
        engine.wait_for()
        engine.send([stored([1])])
        engine.send([stored([2], parent=1)], seq=5)  # seqs 1..4 never sent
        engine.send([stored([3], parent=2)])

    result = run_main("check", engine.endpoint, "-c", "3", "--json", "-q", alongside=publish)
    rc, out, err = result.code, result.out, result.err
    assert rc == 3 and err == ""  # -q: nothing on stderr
    rep = report(out)
    assert [r["id"] for r in rep["rules"]] == ["KV301"]
    gap = rep["rules"][0]
    assert gap["count"] == 1 and gap["details"] == {"missing_batches": 4}
    assert gap["examples"][0]["message"] == "seq 5, expected 1: 4 batch(es) missing"
    assert (rep["stream"]["gaps"], rep["stream"]["missing_batches"]) == (1, 4)


def test_expected_worker_silent_is_reported_within_idle_timeout(endpoint):
    talker, silent = Engine(endpoint), Engine(f"tcp://127.0.0.1:{free_port()}")
    seen_at: dict[str, float] = {}  # each KV306 line -> when it first appeared on stderr

    def talk(live: Live) -> None:
        talker.wait_for()
        silent.wait_for()
        h = 1
        while not live.ended.is_set() and h < 400:  # the talker never goes quiet: no idle stop
            talker.send([stored([h])] if h == 1 else [stored([h], parent=h - 1)])
            h += 1
            for line in live.stderr().splitlines():
                if "KV306" in line:
                    seen_at.setdefault(line, time.monotonic())
            time.sleep(0.05)  # the talker's pace, not a wait for anything

    try:
        result = run_main(
            "check",
            f"0={talker.endpoint}",
            f"1={silent.endpoint}",
            "--expect-workers",
            "2",
            "--idle-timeout",
            "1",
            "--duration",
            "3.5",
            alongside=talk,
        )
        ended = time.monotonic()
    finally:
        talker.close()
        silent.close()
    assert result.code == 3, result.err
    kv306 = [x for x in result.err.splitlines() if "KV306" in x]
    assert any(f"source {silent.endpoint} published nothing" in x for x in kv306)
    assert any("1 of 2 expected workers published events" in x for x in kv306)
    # printed live, ~1 s in, well before the 3.5 s run ended
    assert all(ended - seen_at.get(line, ended) > 1.2 for line in kv306), (seen_at, ended)
    out = result.out
    assert "KV306" in out and "worker-silent" in out and "stopped by --duration" in out


def test_worker_filter_checks_only_that_worker(endpoint):
    good, bad = Engine(endpoint), Engine(f"tcp://127.0.0.1:{free_port()}")

    def publish(_: Live) -> None:
        good.wait_for()
        bad.wait_for()
        bad.send([removed([42])], dp_rank=None)  # KV101, but filtered out
        good.send([stored([1])], dp_rank=None)
        good.send([removed([1])], dp_rank=None)

    try:
        result = run_main(
            "check",
            f"0={good.endpoint}",
            f"1={bad.endpoint}",
            "--worker",
            "0",
            "--json",
            "--idle-timeout",
            "1",
            alongside=publish,
        )
    finally:
        good.close()
        bad.close()
    rep = report(result.out)
    assert result.code == 0, result.err
    assert rep["rules"] == [] and rep["workers"] == ["0[dp0]"] and rep["events"] == 2
    assert rep["batches"] == 3  # the filtered-out batch still counted for sequence tracking


def test_unreachable_source_is_a_runtime_error():
    result = run_main("check", f"tcp://127.0.0.1:{free_port()}", "--connect-timeout", "0.3")
    assert result.code == 1 and "connection refused" in result.err


def test_every_batch_once_with_selected_events():
    # the contract the three commands rely on, through the real pipeline
    batches = [
        Batch("s", [stored([1]), removed([1])], "x", seq=0, publisher="s"),
        Batch("s", [removed([2])], "x", seq=1, publisher="s"),
        Batch("s", [], "x", seq=2, publisher="s", error="bad"),
        Batch("s", [stored([3]), stored([4])], "x", seq=3, publisher="s"),
    ]
    seen: list[Batch] = []
    run(
        type("Src", (), {"batches": lambda self: iter(batches)})(),
        [EveryBatch(seen.append)],
        Limits(count=2),
        Filters(types=frozenset({"BlockStored"})),
    )
    assert [(b.seq, [e["type"] for e in b.events], b.error) for b in seen] == [
        (0, ["BlockStored"], None),
        (1, [], None),
        (2, [], "bad"),
        (3, ["BlockStored"], None),
    ]


def test_help_lists_rules_and_example():
    text = run_main("check", "--help").out
    assert "Example:" in text and "KV306" in text and "worker-silent" in text


def test_ctrl_c_still_prints_the_report_then_exits_130(engine):
    proc = start_kvctl("check", engine.endpoint, "--json")
    engine.wait_for()
    engine.send([removed([5])])
    while "KV101" not in read_line(proc.stderr):  # the live finding: check has seen it
        pass
    interrupt(proc)
    rc, out, err = finish(proc)
    assert rc == 130, err
    rep = report(out)
    assert [r["id"] for r in rep["rules"]] == ["KV101"] and rep["exit_code"] == 130
    assert "stopped by interrupt" in err


@pytest.fixture(scope="module")
def wrong_block_size_recording(tmp_path_factory) -> str:
    """A simulated recording with 16-token blocks: `--block-size 8` makes every store KV202."""
    path = str(tmp_path_factory.mktemp("check") / "sim.parquet")
    result = run_main("simulate", "-o", path, "--workers", "2", "--requests", "20", "-q")
    assert result.code == 0, result.err
    return path


@pytest.mark.parametrize("max_examples", [1, 7])
def test_text_report_prints_max_examples_per_rule(wrong_block_size_recording, max_examples):
    result = run_main(
        "check",
        wrong_block_size_recording,
        "--block-size",
        "8",
        "-q",
        "--max-examples",
        str(max_examples),
    )
    assert result.code == 3, result.err
    examples = [line for line in result.out.splitlines() if line.startswith("  KV202 error")]
    assert len(examples) == max_examples, result.out
    total = json.loads(
        run_main("check", wrong_block_size_recording, "--block-size", "8", "-q", "--json").out
    )["rules"][0]["count"]
    assert f"KV202: … {total - max_examples} more" in result.out
