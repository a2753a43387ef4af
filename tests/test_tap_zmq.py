"""kvctl tap against real ZMQ publishers on 127.0.0.1, run as the console script runs it
(in-process, the publisher in a thread; Ctrl-C and a closed pipe in a subprocess)."""

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
    serve_replays_until,
    start_kvctl,
    stored,
)
from inprocess import Live, run_main, run_while

from kvctl.transports.zmq import ReplayServer


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_json_lines_carry_every_documented_field(engine):
    def send() -> None:
        engine.wait_for()
        engine.send([stored([1, 2**63 + 5], extra_keys=[["img", 0]]), removed([-1])])
        engine.send([{"type": "AllBlocksCleared"}])

    rc, out, err = run_while(send, "tap", engine.endpoint, "--json", "-c", "3")
    assert rc == 0, err
    rows = json_lines(out)
    assert [r["type"] for r in rows] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    first = rows[0]
    for key in (
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "lora_name",
        "medium",
        "ts",
        "seq",
        "source",
        "worker_id",
        "dp_rank",
        "format",
    ):
        assert key in first
    assert first["block_hashes"] == [1, 2**63 + 5]
    assert first["extra_keys"] == [["img", 0]]  # unknown-to-us fields pass through by name
    assert rows[1]["block_hashes"] == [2**64 - 1]  # signed -1 shown as unsigned 64-bit
    assert (rows[2]["seq"], rows[2]["source"], rows[2]["format"]) == (
        1,
        engine.endpoint,
        "engine-map",
    )
    assert "3 events" in err and "stopped by --count" in err


@pytest.mark.parametrize("style,expected", [("signed", -1), ("hex", "ffffffffffffffff")])
def test_hash_format_option(engine, style, expected):
    def send() -> None:
        engine.wait_for()
        engine.send([removed([2**64 - 1])])

    rc, out, _ = run_while(
        send, "tap", engine.endpoint, "--json", "-c", "1", "--hash-format", style
    )
    assert json_lines(out)[0]["block_hashes"] == [expected]


def test_pretty_output_is_readable(engine):
    def send() -> None:
        engine.wait_for()
        engine.send([stored([10, 11, 12, 13, 14], parent=9), removed([10])])

    rc, out, err = run_while(send, "tap", engine.endpoint, "-c", "2")
    assert rc == 0, err
    lines = out.splitlines()
    assert engine.endpoint in lines[0] and "seq=0" in lines[0] and "2 events" in lines[0]
    assert "BlockStored" in lines[1] and "5 blocks" in lines[1] and "+2" in lines[1]
    assert "tokens=20 (4/block)" in lines[1] and "parent=9" in lines[1]
    assert "BlockRemoved" in lines[2] and "1 block " in lines[2]
    assert not out.lstrip().startswith("{")


def test_several_labelled_sources_each_tracked(endpoint):
    a, b = Engine(endpoint), Engine(f"tcp://127.0.0.1:{free_port()}")

    def send() -> None:
        a.wait_for()
        b.wait_for()
        a.send([removed([1])], dp_rank=None)
        b.send([removed([2])], dp_rank=None)
        a.send([removed([3])], dp_rank=None)
        b.send([removed([4])], seq=5, dp_rank=None)  # a gap on b only

    try:
        rc, out, err = run_while(
            send, "tap", f"0={a.endpoint}", f"w1:3={b.endpoint}", "--json", "-c", "4"
        )
    finally:
        a.close()
        b.close()
    rows = json_lines(out)
    by_hash = {r["block_hashes"][0]: (r["worker_id"], r["dp_rank"]) for r in rows}
    assert by_hash == {1: (0, None), 2: ("w1", 3), 3: (0, None), 4: ("w1", 3)}
    assert "gaps 1 (4 batches missing" in err and b.endpoint in err


def test_filters_by_type_and_worker(endpoint):
    a, b = Engine(endpoint), Engine(f"tcp://127.0.0.1:{free_port()}")

    def send() -> None:
        a.wait_for()
        b.wait_for()
        for i in range(3):
            a.send([stored([i]), removed([i])])
            b.send([stored([100 + i]), removed([100 + i])])

    try:
        rc, out, err = run_while(
            send,
            "tap",
            f"0={a.endpoint}",
            f"1={b.endpoint}",
            "--json",
            "--type",
            "BlockRemoved",
            "--worker",
            "1",
            "-c",
            "2",
        )
    finally:
        a.close()
        b.close()
    rows = json_lines(out)
    assert [(r["type"], r["worker_id"], r["block_hashes"]) for r in rows] == [
        ("BlockRemoved", 1, [100]),
        ("BlockRemoved", 1, [101]),
    ]


@pytest.mark.parametrize("mode", [[], ["--json"]])
def test_count_cuts_inside_a_batch(engine, mode):
    def send() -> None:
        engine.wait_for()
        engine.send([removed([1]), removed([2]), removed([3])])

    rc, out, err = run_while(send, "tap", engine.endpoint, "-c", "2", *mode)
    assert rc == 0 and "2 events" in err
    if mode:
        assert len(json_lines(out)) == 2


@pytest.mark.parametrize("mode", [[], ["--json"]])
def test_duration_stops_even_while_events_flow(engine, mode):
    def flow(live: Live) -> None:
        engine.wait_for()
        while not live.ended.is_set() and time.monotonic() - started < 15:
            engine.send([removed([1])])
            time.sleep(0.01)  # the stream's pace, not a wait for anything

    started = time.monotonic()
    result = run_main("tap", engine.endpoint, "--duration", "1.5", *mode, alongside=flow)
    rc, err = result.code, result.err
    assert rc == 0 and "stopped by --duration" in err
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("mode", [[], ["--json"]])
def test_idle_timeout_stops_a_silent_stream(engine, mode):
    def send() -> None:
        engine.wait_for()
        engine.send([removed([1])])

    rc, out, err = run_while(send, "tap", engine.endpoint, "--idle-timeout", "0.5", *mode)
    assert rc == 0 and "stopped by --idle-timeout" in err and "1 event (" in err


def test_sequence_anomalies_are_counted_and_shown(engine):
    def send() -> None:
        engine.wait_for()
        for seq in (0, 1, 4, 4, 2, 0, 0):
            engine.send([removed([seq])], seq=seq)

    rc, out, err = run_while(send, "tap", engine.endpoint, "--json", "--idle-timeout", "1")
    assert rc == 0
    assert "gap from" in err and "seq 2..3 missing (2 batches, not recovered)" in err
    assert "duplicate from" in err and "late arrival from" in err and "restart from" in err
    # seq 2 arrived late: only seq 3 is still missing; the second 0 repeats the restart's 0
    assert "gaps 1 (1 batch missing, 0 recovered), duplicates 2, reorders 1" in err
    assert len(json_lines(out)) == 7  # anomalies are shown, not dropped


@pytest.mark.parametrize("with_topic", [True, False])
def test_gap_recovered_from_replay_socket(engine, with_topic):
    replay = ReplayServer(f"tcp://127.0.0.1:{free_port()}", with_topic=with_topic)

    def publish(live: Live) -> None:
        engine.wait_for()
        for seq in range(5):
            frames = engine.batch([removed([seq])], seq=seq)
            replay.remember(seq, frames[0], frames[2])
            if seq not in (2, 3):  # the engine "drops" 2 and 3 on the live socket
                engine.send_raw(frames)
        serve_replays_until(replay, live.ended.is_set)

    try:
        result = run_main(
            "tap",
            engine.endpoint,
            "--replay-endpoint",
            replay.endpoint,
            "--json",
            "-c",
            "5",
            alongside=publish,
        )
        rc, out, err = result.code, result.out, result.err
    finally:
        replay.close()
    assert rc == 0, err
    rows = json_lines(out)
    assert [r["block_hashes"][0] for r in rows] == [0, 1, 2, 3, 4]  # in order
    assert [r.get("recovered", False) for r in rows] == [False, False, True, True, False]
    assert "2 recovered" in err


def test_bad_input_is_counted_shown_and_never_fatal(engine):
    def send() -> None:
        engine.wait_for()
        engine.send_raw([b"", (0).to_bytes(8, "big"), b"\xde\xad\xbe\xef"])
        engine.send_raw([b"only-one-frame"])
        engine.send_raw([b"", b"", b"", b"", b""])
        engine.send_raw([b"", (1).to_bytes(8, "big"), b"\xdd\xff\xff\xff\xff"])  # huge array
        engine.send([removed([7])], seq=2)

    rc, out, err = run_while(send, "tap", engine.endpoint, "--json", "--idle-timeout", "1")
    assert rc == 0
    assert err.count("malformed message from") == 4
    assert "de ad be ef" in err  # hex preview
    assert "malformed 4" in err
    assert [r["block_hashes"] for r in json_lines(out)] == [[7]]


def test_strict_exits_1_on_malformed(engine):
    def send() -> None:
        engine.wait_for()
        engine.send_raw([b"", (0).to_bytes(8, "big"), b"\xc1"])

    rc, out, err = run_while(send, "tap", engine.endpoint, "--strict", "--idle-timeout", "5")
    assert rc == 1 and "malformed" in err and "Traceback" not in err


def test_interrupt_prints_summary_and_exits_130(engine):
    proc = start_kvctl("tap", engine.endpoint, "--json")
    engine.wait_for()
    engine.send([removed([1])])
    assert read_line(proc.stdout)  # the event reached tap: it is running its loop
    interrupt(proc)
    rc, out, err = finish(proc)
    assert rc == 130 and "1 event (" in err and "Traceback" not in err


def test_dead_endpoint_is_a_clear_error():
    port = free_port()
    result = run_main("tap", f"tcp://127.0.0.1:{port}", "--connect-timeout", "0.5")
    err = result.err
    assert result.code == 1
    last = err.splitlines()[-1]
    assert last.startswith(f"kvctl: tcp://127.0.0.1:{port}: connection refused after 0.5 s")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "args",
    [
        ["tap"],
        ["tap", "foo://bar"],
        ["tap", "tcp://127.0.0.1:1", "-c", "0"],
        ["tap", "tcp://127.0.0.1:1", "--type", "Nope"],
        ["tap", "tcp://nohost"],
        ["tap", "=tcp://127.0.0.1:1"],
        ["tap", "0:x=tcp://127.0.0.1:1"],
        *(
            ["tap", "tcp://127.0.0.1:1", "--max-queue", size]
            for size in ("abc", "10k", "inf", "-1G")
        ),
    ],
)
def test_usage_errors_exit_2(args):
    result = run_main(*args)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err


def test_max_queue_from_environment():
    result = run_main("tap", "tcp://127.0.0.1:1", env={"KVCTL_TAP_MAX_QUEUE": "10k"})
    assert result.code == 2 and "KVCTL_TAP_MAX_QUEUE" in result.err, result.err


def test_options_from_environment(engine):
    def send() -> None:
        engine.wait_for()
        engine.send([removed([1]), removed([2])])

    rc, out, err = run_while(send, "tap", engine.endpoint, "--json", env={"KVCTL_TAP_COUNT": "1"})
    assert rc == 0 and len(json_lines(out)) == 1


def test_ipc_endpoint(tmp_path):
    engine = Engine(f"ipc://{tmp_path}/engine.sock")

    def send() -> None:
        engine.wait_for()
        engine.send([removed([5])])

    try:
        rc, out, err = run_while(send, "tap", engine.endpoint, "--json", "-c", "1")
    finally:
        engine.close()
    assert rc == 0, err
    assert json_lines(out)[0]["source"] == engine.endpoint


@pytest.mark.parametrize("connect_timeout", [5.0, None])
def test_connection_monitor_is_off_once_connected(engine, connect_timeout):
    """An unread monitor fills up with reconnect events while a publisher is gone and then
    blocks libzmq's I/O thread: tap froze minutes after its engine exited."""
    from kvctl.pipeline import LiveSource, SourceSpec

    source = LiveSource([SourceSpec.parse(engine.endpoint)], connect_timeout=connect_timeout)
    try:
        batches = source.batches()
        deadline = time.monotonic() + 10
        while source.waiting and time.monotonic() < deadline:
            next(batches)  # idle polls: the monitor is read while connecting
        assert not source.waiting
        assert all(sub.monitor.closed for sub in source.subscribers)
    finally:
        source.close()


@pytest.mark.parametrize("mode", [[], ["--json"]])
def test_a_closed_pipe_ends_quietly_with_exit_0(tmp_path, mode):
    """`kvctl cat run.parquet | head -1`: the reader leaves early; like other Unix tools, kvctl
    stops without a traceback and succeeds (scripts with `set -o pipefail` rely on it)."""
    import subprocess
    import sys

    path = tmp_path / "r.parquet"
    sim = run_main("simulate", "-o", str(path), "--workers", "1", "--requests", "200", "-q")
    assert sim.code == 0, sim.err
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvctl", "cat", str(path), *mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    rc = proc.wait(30)
    err = proc.stderr.read()
    assert rc == 0 and b"Traceback" not in err, err


def test_a_malformed_message_is_not_also_a_gap(engine, tmp_path):
    """[seq 0 ok, seq 1 malformed, seq 2 ok]: 0 gaps and 1 malformed, live and read back."""
    recording = tmp_path / "run.parquet"
    record = start_kvctl(
        "record", engine.endpoint, "-o", str(recording), "--idle-timeout", "1", drain=True
    )

    def send() -> None:
        engine.wait_for(subscribers=2)  # record (a process) and tap (here)
        engine.send([removed([0])], seq=0)
        engine.send_raw([b"", (1).to_bytes(8, "big"), b"\xc1"])
        engine.send([removed([2])], seq=2)

    tapped = run_while(send, "tap", engine.endpoint, "--json", "--idle-timeout", "1")
    for rc, _, err in (tapped, finish(record)):
        assert rc == 0, err
        assert "gaps 0 (0 batches missing" in err and "malformed 1" in err, err
    cat = run_main("cat", str(recording), "--json")
    summary = cat.err
    assert cat.code == 0, summary
    assert "gaps 0 (0 batches missing" in summary and "malformed 1" in summary, summary
    check = run_main("check", str(recording), "--json")
    report = json.loads(check.out)
    counts = {rule["id"]: rule["count"] for rule in report["rules"]}
    assert counts.get("KV001") == 1 and "KV301" not in counts, report
    assert report["stream"]["gaps"] == 0 and report["stream"]["malformed"] == 1


def test_a_silent_replay_endpoint_is_warned_about_once_and_never_stalls_the_loop(engine):
    """A replay socket that takes the request and never answers, and a stream with a gap
    after every batch: every batch is processed, one warning, in bounded time."""
    silent = ReplayServer(f"tcp://127.0.0.1:{free_port()}")  # never serves: never answers
    times: list[float] = []

    def send() -> None:
        engine.wait_for()
        times.append(time.monotonic())
        for i in range(300):
            engine.send([removed([i])], seq=2 * i)  # every odd seq is missing

    try:
        rc, out, err = run_while(
            send,
            "tap",
            engine.endpoint,
            "--replay-endpoint",
            silent.endpoint,
            "--json",
            "--idle-timeout",
            "1",
            timeout=30,
        )
        elapsed = time.monotonic() - times[0]
    finally:
        silent.close()
    assert rc == 0, err
    assert len(json_lines(out)) == 300
    assert "in 300 batches" in err and "gaps 299 (299 batches missing, 0 recovered)" in err
    assert err.count("does not answer") == 1, err
    assert elapsed < 10, f"{elapsed:.1f} s"
