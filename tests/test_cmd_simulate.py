"""kvctl simulate publishing on real sockets (in-process), consumed by a real kvctl tap (a
process)."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from conftest import finish, free_port_range, start_draining, start_kvctl
from inprocess import run_main
from test_tap_nats import wait_ready

SIM_ARGS = [
    "simulate",
    "--requests",
    "40",
    "--topspeed",
    "--num-blocks",
    "400",
    "--epoch",
    "1e9",
    "-q",
    "--json",
]
SIM = [*SIM_ARGS, "--wait-subscribers", "1"]


def tap_simulation(workers: int, *extra: str) -> tuple[list[dict], dict]:
    base = free_port_range(workers)
    endpoints = [f"tcp://127.0.0.1:{base + i}" for i in range(workers)]
    tap = start_kvctl(
        "tap", *endpoints, "--json", "--idle-timeout", "4", "--connect-timeout", "10", drain=True
    )
    sim = run_main(*SIM, "--workers", str(workers), "--base-port", str(base), *extra, timeout=60)
    rc_tap, out, err = finish(tap, timeout=60)
    assert sim.code == 0 and rc_tap == 0, (sim.err, err)
    return [json.loads(line) for line in out.splitlines()], json.loads(sim.out)


def test_tap_consumes_all_eight_workers_and_sees_every_event():
    rows, summary = tap_simulation(8)
    sources = Counter(r["source"] for r in rows)
    assert len(sources) == 8
    published = summary["total"]["store_events"] + summary["total"]["remove_events"]
    assert len(rows) == published == summary["events"]
    stored_blocks = sum(len(r["block_hashes"]) for r in rows if r["type"] == "BlockStored")
    assert stored_blocks == summary["total"]["stored_blocks"]
    assert {r["worker_id"] for r in rows} == {None}  # unlabelled sources: worker is the source
    assert all(r["format"] == "engine-map" and r["block_size"] in (16, None) for r in rows)


def test_stream_is_self_consistent_per_worker():
    rows, _ = tap_simulation(2)
    for source in {r["source"] for r in rows}:
        cached: set[int] = set()
        for r in (r for r in rows if r["source"] == source):
            if r["type"] == "BlockStored":
                assert r["parent_block_hash"] is None or r["parent_block_hash"] in cached
                assert len(r["token_ids"]) == r["block_size"] * len(r["block_hashes"])
                cached.update(r["block_hashes"])
            elif r["type"] == "BlockRemoved":
                assert set(r["block_hashes"]) <= cached
                cached.difference_update(r["block_hashes"])
            assert len(cached) <= 400


def test_same_seed_gives_identical_streams(tmp_path):
    """The seed decides every event: two runs with one seed write the same stream, another
    seed a different one. Compared on recordings (`simulate -o`), so that nothing but the
    seed is under test (live delivery is the other tests' subject)."""

    def events(seed: str, name: str) -> list[tuple]:
        path = str(tmp_path / name)
        sim = run_main(*SIM_ARGS, "--workers", "2", "--seed", seed, "-o", path)
        assert sim.code == 0, sim.err
        cat = run_main("cat", path, "--json", "-q")
        assert cat.code == 0, cat.err
        rows = [json.loads(line) for line in cat.out.splitlines()]
        assert rows
        return [
            (r["worker_id"], r["seq"], r["ts"], r["type"], r["block_hashes"], r["token_ids"])
            for r in rows
        ]

    first = events("7", "a.parquet")
    assert events("7", "b.parquet") == first
    assert events("8", "c.parquet") != first


@pytest.mark.parametrize(
    "encoding,shape",
    [("vllm-array", "engine-array"), ("sglang", "engine-map"), ("seed", "engine-map")],
)
def test_engine_formats(encoding, shape):
    rows, summary = tap_simulation(1, "--format", encoding)
    assert rows and {r["format"] for r in rows} == {shape}
    stored_blocks = sum(len(r["block_hashes"]) for r in rows if r["type"] == "BlockStored")
    assert stored_blocks == summary["total"]["stored_blocks"]


def test_nats_output_decodes_as_dynamo(nats_server):
    tap = start_kvctl("tap", nats_server.url, "--json", "--idle-timeout", "2")
    wait_ready(tap)
    start_draining(tap)  # while kvctl runs in-process
    result = run_main(
        "simulate",
        "--to",
        nats_server.url,
        "--workers",
        "2",
        "--requests",
        "10",
        "--topspeed",
        "-q",
        "--json",
        "--namespace",
        "sim",
        timeout=60,
    )
    assert result.code == 0, result.err
    summary = json.loads(result.out)
    rc, out, err = finish(tap, timeout=30)
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["format"] for r in rows} == {"dynamo-msgpack"}
    assert {r["worker_id"] for r in rows} == {0, 1}
    assert {r["topic"] for r in rows} == {
        "namespace.sim.component.backend.endpoint.generate.kv-events"
    }
    assert len(rows) == summary["events"]
    assert all(
        len(r["tokens_hashes"]) == len(r["block_hashes"])
        for r in rows
        if r["type"] == "BlockStored"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--to", "http://x"],
        ["--workers", "0"],
        ["--format", "dynamo", "--requests", "1"],
        ["-o", "x.parquet", "--to", "nats://127.0.0.1:1"],
        ["-o", "x.parquet", "--format", "dynamo"],
    ],
)
def test_simulate_usage_errors(args):
    result = run_main("simulate", "--base-port", str(free_port_range(8)), *args)
    assert result.code == 2, result.err
    assert "Traceback" not in result.err


def test_output_recording_is_deterministic_and_passes_check(tmp_path):
    from kvctl.recording.reader import open_recording

    paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    for path in paths:
        result = run_main(
            "simulate",
            "-o",
            str(path),
            "--workers",
            "3",
            "--requests",
            "60",
            "--num-blocks",
            "300",
            "--seed",
            "5",
            "--epoch",
            "1e9",
            "--json",
            "-q",
            timeout=60,
        )
        assert result.code == 0, result.err
    summary = json.loads(result.out)
    first, second = ([b.frames for b in open_recording(p)] for p in paths)
    assert first == second and len(first) == summary["batches"]  # byte-identical streams
    check = run_main(
        "check",
        str(paths[0]),
        "--block-size",
        "16",
        "--num-blocks",
        "300",
        "--expect-workers",
        "3",
        "--json",
    )
    report = json.loads(check.out)
    assert check.code == 0, report
    assert summary["total"]["removed_blocks"] > 0  # the pool filled and evicted


def test_trace_driven_run(tmp_path):
    trace = tmp_path / "trace.jsonl"
    # Mooncake layout: 512 tokens per hash id; the second and third requests share a prefix
    trace.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]},
                {"timestamp": 50, "input_length": 1500, "output_length": 10, "hash_ids": [1, 2, 3]},
                {"timestamp": 90, "input_length": 600, "output_length": 10, "hash_ids": [1, 4]},
            ]
        )
        + "\n"
    )
    result = run_main(
        "simulate",
        "--trace",
        str(trace),
        "--workers",
        "1",
        "-o",
        str(tmp_path / "t.parquet"),
        "--json",
        "-q",
        timeout=60,
    )
    assert result.code == 0, result.err
    total = json.loads(result.out)["total"]
    assert total["prompt_tokens"] == 1000 + 1500 + 600
    # request 2 reuses request 1's first 992 tokens (62 full blocks of 16), request 3 the
    # 512 tokens of hash id 1 (32 blocks)
    assert total["hit_tokens"] == 992 + 512


def test_replay_router_per_worker():
    from kvctl.transports.zmq import fetch_replay

    base, replay_base = free_port_range(2), free_port_range(2)
    sim = start_kvctl(
        "simulate",
        "--workers",
        "2",
        "--base-port",
        str(base),
        "--replay-base-port",
        str(replay_base),
        "--duration",
        "30",
        "-q",
    )
    try:
        replies: list = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(replies) < 3:
            replies, complete = fetch_replay(f"tcp://127.0.0.1:{replay_base + 1}", 0, 1.0)
        assert complete and len(replies) >= 3
        assert [int.from_bytes(seq, "big") for _, seq, _ in replies[:3]] == [0, 1, 2]
    finally:
        sim.terminate()
        finish(sim)


def test_wait_for_two_subscribers():
    base = free_port_range(1)
    endpoint = f"tcp://127.0.0.1:{base}"
    taps = [
        start_kvctl(
            "tap", endpoint, "--json", "--idle-timeout", "2", "--connect-timeout", "10", drain=True
        )
        for _ in range(2)
    ]
    sim = run_main(
        "simulate",
        "--workers",
        "1",
        "--base-port",
        str(base),
        "--requests",
        "5",
        "--topspeed",
        "--wait-subscribers",
        "2",
        "-q",
        "--json",
        timeout=60,
    )
    assert sim.code == 0, sim.err
    events = json.loads(sim.out)["events"]
    for tap in taps:
        rc, tapped, err = finish(tap, timeout=60)
        assert rc == 0, err
        assert len(tapped.splitlines()) == events > 0  # both were there from the first batch


GOOD_LINE = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'


@pytest.mark.parametrize(
    "bad,problem",
    [
        ("{not json", "not JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        ('{"input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "missing timestamp"),
        (
            '{"timestamp": "soon", "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
            "timestamp must be a number",
        ),
        (
            '{"timestamp": 10, "input_length": "600", "output_length": 5, "hash_ids": [1, 2]}',
            "input_length must be an integer",
        ),
        (
            '{"timestamp": 10, "input_length": 600, "output_length": null, "hash_ids": [1, 2]}',
            "output_length must be an integer",
        ),
        ('{"timestamp": 10, "input_length": 600, "output_length": 5}', "missing hash_ids"),
        (
            '{"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": "1,2"}',
            "hash_ids must be a list of integers",
        ),
        (
            '{"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1]}',
            "cannot cover input_length 600",
        ),
    ],
)
def test_bad_trace_line_is_named_and_leaves_no_recording(tmp_path, bad, problem):
    """A bad line anywhere in the trace: `FILE:LINE: problem`, exit 2, and nothing written (the
    trace is checked before the recording is opened; line 3 after a blank line 2)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(f"{GOOD_LINE}\n\n{bad}\n{GOOD_LINE.replace(': 0,', ': 20,')}\n")
    output = tmp_path / "out.parquet"
    result = run_main("simulate", "--trace", str(trace), "-o", str(output), "--workers", "1")
    lines = result.err.splitlines()
    assert result.code == 2 and len(lines) == 1, result.err
    assert lines[0].startswith(f"kvctl: {trace}:3: ") and problem in lines[0], lines[0]
    assert "Traceback" not in result.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]  # no file, journal, temp


def test_trace_out_of_time_order_is_refused(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(f"{GOOD_LINE.replace(': 0,', ': 50,')}\n{GOOD_LINE}\n")
    result = run_main(
        "simulate", "--trace", str(trace), "--workers", "1", "--base-port", str(free_port_range(1))
    )
    assert result.code == 2 and f"{trace}:2: timestamp 0 is earlier" in result.err


def test_output_never_replaces_a_file_unasked(tmp_path):
    output = tmp_path / "data.parquet"
    output.write_bytes(b"the user's own file")
    result = run_main("simulate", "-o", str(output), "--requests", "5", "-q")
    assert result.code == 2 and "--overwrite" in result.err and "Traceback" not in result.err
    assert output.read_bytes() == b"the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.parquet"]  # no journal, temp
    replaced = run_main("simulate", "-o", str(output), "--requests", "5", "-q", "--overwrite")
    assert replaced.code == 0, replaced.err
    assert output.read_bytes()[:4] == b"PAR1"
