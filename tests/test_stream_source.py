"""A fleet stream as a live source: ``kvctl tap|check ... nats://... --stream NAME
[--partition I/N] [--from-start]`` read what the bridges published as the engines' own
messages (ephemeral ordered consumers: nothing is left on the server)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from typing import Any

import nats
import pytest
from conftest import Engine, NatsServer, finish, free_port, removed, start_kvctl, stored
from inprocess import Live, run_main

from kvctl.partitions import MSG_ID, FleetMessage, StreamLayout, message_id, partition_of

_names = (f"live{n}-{os.getpid()}" for n in itertools.count())
PARTITIONS = 4


def init_stream(url: str, partitions: int = PARTITIONS) -> StreamLayout:
    name = next(_names)
    result = run_main("stream", "init", url, "--name", name, "--partitions", str(partitions))
    assert result.code == 0, result.err
    return StreamLayout(name, partitions)


def publish(url: str, layout: StreamLayout, items: list[tuple[str, Any]]) -> None:
    """Publish (worker, FleetMessage or (headers, body)) into the stream, as a bridge does."""

    async def main() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            for n, (worker, msg) in enumerate(items):
                if isinstance(msg, FleetMessage):
                    headers, body = msg.headers(), msg.body()
                else:
                    headers, body = msg
                headers[MSG_ID] = message_id(worker, None, n, body)
                await js.publish(layout.publish_subject(worker), body, headers=headers)
        finally:
            await nc.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def consumers_left(url: str, name: str) -> int:
    async def main() -> int:
        nc = await nats.connect(url)
        try:
            return (await nc.jetstream().stream_info(name)).state.consumer_count
        finally:
            await nc.close()

    return asyncio.run(asyncio.wait_for(main(), 30))


def event_lines(out: str) -> list[dict[str, Any]]:
    """tap --json lines, receive time aside (two processes, two clocks)."""
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    for line in lines:
        for key in [k for k in line if k.startswith("recv")]:
            del line[key]
    return lines


def by_worker(lines: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    """Each engine's lines in its own order (two engines interleave as they arrive)."""
    out: dict[Any, list[dict[str, Any]]] = {}
    for line in lines:
        out.setdefault(line.get("worker_id"), []).append(line)
    return out


@pytest.fixture(scope="module")
def bridged(nats_server: NatsServer) -> dict[str, Any]:
    """Two engines (one drops a batch: a gap; one sends a malformed message), read at once by
    tap, by check and by a bridge into a 4-partition fleet stream."""
    layout = init_stream(nats_server.url)
    engines = {w: Engine(f"tcp://127.0.0.1:{free_port()}") for w in ("w0", "w1")}
    sources = [f"{w}={e.endpoint}" for w, e in engines.items()]
    direct_tap = start_kvctl("tap", *sources, "--json", "--idle-timeout", "3", drain=True)
    direct_check = start_kvctl("check", *sources, "--json", "--idle-timeout", "3", "-q", drain=True)

    def send(_: Live) -> None:
        for engine in engines.values():
            engine.wait_for(3)  # tap, check and the bridge
        for n in range(20):
            for w, engine in engines.items():
                frames = engine.batch([stored([n, n + 1]), removed([n])] if n % 3 else [])
                if w == "w0" and n == 7:
                    continue  # dropped: a gap of w0
                if w == "w1" and n == 9:
                    engine.send_raw([b"", frames[1], b"\xc1"])  # malformed
                    continue
                engine.send_raw(frames)
        engines["w1"].send_raw(engines["w1"].batch([removed([12345])]))  # KV101

    try:
        run = run_main(
            "bridge",
            *sources,
            "--to",
            nats_server.url,
            "--stream",
            layout.name,
            "--idle-timeout",
            "2",
            alongside=send,
            timeout=40,
        )
        tap_rc, tap_out, tap_err = finish(direct_tap, timeout=30)
        check_rc, check_out, check_err = finish(direct_check, timeout=30)
    finally:
        for engine in engines.values():
            engine.close()
    assert run.code == 0, run.err
    assert tap_rc == 0, tap_err
    assert check_rc == 3, check_err  # KV101
    return {
        "layout": layout,
        "tap": event_lines(tap_out),
        "tap_err": tap_err,
        "check": json.loads(check_out),
    }


def test_tap_of_the_stream_shows_what_tap_of_the_engines_showed(
    nats_server: NatsServer, bridged: dict[str, Any]
) -> None:
    name = bridged["layout"].name
    result = run_main(
        "tap", nats_server.url, "--stream", name, "--from-start", "--json", "--idle-timeout", "2"
    )
    assert result.code == 0, result.err
    ours = event_lines(result.out)
    assert len(ours) == len(bridged["tap"]) > 40
    assert by_worker(ours) == by_worker(bridged["tap"])
    # the summary: the gap of w0 (seq 7 missing) and the malformed message of w1, as tap said
    summary = result.err.strip().splitlines()[-1]
    assert "gaps 1 (1 batch missing" in summary and "malformed 1" in summary, summary
    assert "gaps 1 (1 batch missing" in bridged["tap_err"]
    assert consumers_left(nats_server.url, name) == 0  # ordered consumers are ephemeral


@pytest.mark.parametrize("command", ["stats", "index"])
def test_stats_and_index_read_the_stream(
    nats_server: NatsServer, bridged: dict[str, Any], tmp_path, command: str
) -> None:
    """The other reading commands take the same source: stats counts the engines' events,
    index builds their blocks (what a recording of the stream would give)."""
    name = bridged["layout"].name
    events = len(bridged["tap"])
    if command == "stats":
        result = run_main(
            "stats", nats_server.url, "--stream", name, "--from-start", "--json",
            "--idle-timeout", "2", "-q",
        )  # fmt: skip
        assert result.code == 0, result.err
        report = json.loads(result.out)
        assert report["overall"]["events"] == events, report["overall"]
    else:
        snapshot = tmp_path / "index.json"
        result = run_main(
            "index", nats_server.url, "--stream", name, "--from-start", "--idle-timeout", "2",
            "-o", str(snapshot), "-q",
        )  # fmt: skip
        assert result.code == 0, result.err
        assert snapshot.stat().st_size > 0
    assert consumers_left(nats_server.url, name) == 0


def _comparable(report: dict[str, Any], examples: bool = True) -> dict[str, Any]:
    rules = {
        r["id"]: (
            r["count"],
            sorted(json.dumps(e, sort_keys=True) for e in r["examples"]) if examples else None,
        )
        for r in report["rules"]
    }
    return {
        "rules": rules,
        "batches": report["batches"],
        "events": report["events"],
        "workers": sorted(report["workers"]),
        "failed": report["failed"],
    }


def test_check_of_each_partition_merged_equals_one_check_of_the_stream_and_the_engines(
    nats_server: NatsServer, bridged: dict[str, Any], tmp_path
) -> None:
    name = bridged["layout"].name
    common = ("--stream", name, "--from-start", "--idle-timeout", "2", "--json", "-q")
    whole = run_main("check", nats_server.url, *common)
    assert whole.code == 3, whole.err
    reports = []
    for i in range(PARTITIONS):
        shard = run_main("check", nats_server.url, *common, "--partition", f"{i}/{PARTITIONS}")
        assert shard.code in (0, 3), shard.err
        path = tmp_path / f"r{i}.json"
        path.write_text(shard.out)
        reports.append(str(path))
        assert json.loads(shard.out)["partition"] == {"index": i, "count": PARTITIONS}
    merged = run_main("check", "--merge", *reports, "--json")
    assert merged.code == 3, merged.err
    direct = bridged["check"]
    assert _comparable(json.loads(merged.out)) == _comparable(json.loads(whole.out))
    # the engines' own check: the same findings of each rule (the examples kept are the
    # first ones as the two engines' batches interleaved, which differs between readers),
    # batches, events and workers
    assert _comparable(json.loads(whole.out), examples=False) == _comparable(direct, False)
    assert json.loads(whole.out)["stream"]["malformed"] == direct["stream"]["malformed"] == 1


def test_only_new_messages_without_from_start_and_only_the_partition_s(
    nats_server: NatsServer,
) -> None:
    layout = init_stream(nats_server.url)
    workers = [f"w{n}" for n in range(8)]
    mine = [w for w in workers if partition_of(w, PARTITIONS) == 1]
    assert mine and len(mine) < len(workers)

    def batch(worker: str, seq: int) -> FleetMessage:
        frames = Engine.batch(Engine.__new__(Engine), [stored([seq])], seq=seq)
        return FleetMessage(
            1_700_000_000_000_000_000 + seq, f"tcp://{worker}:5557", "", frames, json.dumps(worker)
        )

    # as Engine.batch needs an encoding and a seq: a bare instance with them
    Engine.encoding = "vllm"
    publish(nats_server.url, layout, [(w, batch(w, 0)) for w in workers])  # before: not read

    def later(live: Live) -> None:
        live.wait_for_stderr("kvctl: reading")
        publish(nats_server.url, layout, [(w, batch(w, 1)) for w in workers])

    result = run_main(
        "tap",
        nats_server.url,
        "--stream",
        layout.name,
        "--partition",
        f"1/{PARTITIONS}",
        "--json",
        "--idle-timeout",
        "2",
        alongside=later,
    )
    assert result.code == 0, result.err
    lines = [json.loads(line) for line in result.out.splitlines()]
    assert sorted((line["worker_id"], line["seq"]) for line in lines) == [(w, 1) for w in mine]


def test_a_malformed_envelope_is_counted_and_a_gap_marker_said(nats_server: NatsServer) -> None:
    layout = init_stream(nats_server.url, partitions=1)
    marker = FleetMessage(
        1, "tcp://w0:5557", "", [], gap={"publisher": "tcp://w0:5557", "from_seq": 3, "to_seq": 4}
    )
    publish(
        nats_server.url,
        layout,
        [("w0", ({"Kvctl-Source": "x"}, b"junk")), ("w0", marker), ("w0", ({}, b"\x00"))],
    )
    result = run_main(
        "check", nats_server.url, "--stream", layout.name, "--from-start", "--idle-timeout", "1.5"
    )
    assert "malformed 2" in result.err, result.err
    assert "marked seqs 3..4 of tcp://w0:5557 missing" in result.err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("tcp://127.0.0.1:5557", "--stream", "s"), "--stream reads one JetStream server"),
        (
            ("nats://127.0.0.1:4222", "nats://127.0.0.1:4223", "--stream", "s"),
            "--stream reads one JetStream server",
        ),
        (("nats://127.0.0.1:4222", "--partition", "0/2"), "give --stream NAME"),
        (("nats://127.0.0.1:4222", "--stream", "a.b"), "stream name"),
    ],
)
def test_stream_usage_errors_are_one_line(args: tuple[str, ...], said: str) -> None:
    result = run_main("tap", *args)
    assert result.code == 2 and said in result.err and "Traceback" not in result.err


@pytest.mark.parametrize(
    ("partition", "said"),
    [("5/4", "partition 5 is not in 0..3"), ("0/3", "has 4 partitions, not 3")],
)
def test_a_partition_not_of_the_stream_is_refused(
    nats_server: NatsServer, partition: str, said: str
) -> None:
    layout = init_stream(nats_server.url)
    result = run_main("tap", nats_server.url, "--stream", layout.name, "--partition", partition)
    assert result.code == 2 and said in result.err, result.err
    check = run_main("check", nats_server.url, "--stream", layout.name, "--partition", "0,1/4")
    assert check.code == 2 and "I/N" in check.err, check.err


def test_a_missing_stream_is_one_line(nats_server: NatsServer) -> None:
    result = run_main("tap", nats_server.url, "--stream", "nosuch", "-c", "1")
    assert result.code == 1 and "no fleet stream nosuch" in result.err, result.err


def test_a_server_restart_is_read_through_without_loss_or_repeat(tmp_path) -> None:
    """The ordered consumers (in memory on the server) are gone after a restart: the reader
    goes on from the message after the last one it read."""
    from conftest import read_until

    server = NatsServer(tmp_path / "store")
    try:
        layout = init_stream(server.url, partitions=2)
        workers = ["w0", "w1", "w2"]

        def batches(seq: int) -> list[tuple[str, FleetMessage]]:
            out = []
            for w in workers:
                frames = Engine.batch(Engine.__new__(Engine), [stored([seq])], seq=seq)
                message = FleetMessage(seq, f"tcp://{w}:5557", "", frames, json.dumps(w))
                out.append((w, message))
            return out

        Engine.encoding = "vllm"
        publish(server.url, layout, [m for s in range(3) for m in batches(s)])
        tap = start_kvctl(
            "tap", server.url, "--stream", layout.name, "--from-start", "--json",
            "--idle-timeout", "20", "--connect-timeout", "20",
        )  # fmt: skip
        lines = read_until(tap.stdout, '"seq":2', timeout=15)
        port = server.port
        server.stop()
        server = NatsServer(tmp_path / "store", port=port)
        read_until(tap.stderr, "reconnected", timeout=20)
        publish(server.url, layout, [m for s in range(3, 6) for m in batches(s)])
        t0 = time.monotonic()
        lines += read_until(tap.stdout, '"seq":5', timeout=20)
        resumed_s = time.monotonic() - t0
        tap.send_signal(2)
        rc, out, err = finish(tap, timeout=20)
    finally:
        server.stop()
    assert rc == 130, err
    assert resumed_s < 5  # made again at the reconnect, not after nats-py's heartbeats (~20 s)
    seen = sorted(
        (line["worker_id"], line["seq"]) for line in map(json.loads, lines + out.splitlines())
    )
    assert seen == sorted((w, s) for w in workers for s in range(6))
