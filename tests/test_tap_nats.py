"""kvctl tap against a real nats-server: every Dynamo era's subject and body."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import msgpack
import nats
import pytest
from conftest import finish, free_port, publish, read_line, read_until, start_kvctl
from inprocess import Live, run_main

from kvctl.formats.dynamo import encode_envelope, encode_json, router_event, tokens_hash


def wait_ready(proc: subprocess.Popen | Live) -> None:
    """tap has subscribed (with the server up, the "reading" line comes after that)."""
    if isinstance(proc, Live):
        line = proc.wait_for_stderr("\n").partition("\n")[0]
    else:
        line = read_line(proc.stderr)
    assert line.startswith("kvctl: reading"), line


def tap_while(publish_when_ready, *args: str, **options) -> tuple[int, str, str]:
    """kvctl tap in-process; once it has subscribed, ``publish_when_ready()`` in a thread."""

    def publish(live: Live) -> None:
        wait_ready(live)
        publish_when_ready()

    result = run_main("tap", *args, alongside=publish, **options)
    return result.code, result.out, result.err


STORED = {
    "type": "BlockStored",
    "block_hashes": [2**64 - 2, 5],
    "parent_block_hash": None,
    "token_ids": list(range(8)),
    "block_size": 4,
}


def test_live_subjects_of_every_era(nats_server):
    envelope = encode_envelope(
        [
            router_event(STORED, 3, 0),
            router_event({"type": "BlockRemoved", "block_hashes": [5]}, 3, 1),
        ],
        99,
        0,
        1_700_000_000_000,
    )
    messages = [
        (
            "namespace.dyn.component.backend.kv_events",  # <= 0.5, JSON
            encode_json(router_event(STORED, 1, 0, era="0.5")),
        ),
        (
            "namespace-dyn-component-backend-kv-events.kv-events",  # 0.7-0.9 JetStream subject
            encode_json(router_event({"type": "AllBlocksCleared"}, 2, 1, era="0.9")),
        ),
        ("unrelated.queue", b"{}"),  # not a KV stream: ignored
        ("namespace.dyn.component.backend.endpoint.generate.kv-events", envelope),  # >= 1.2
    ]
    rc, out, err = tap_while(
        lambda: publish(nats_server.url, messages), nats_server.url, "--json", "-c", "4"
    )
    assert rc == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["type"], r["worker_id"], r["format"]) for r in rows] == [
        ("BlockStored", 1, "dynamo-json"),
        ("AllBlocksCleared", 2, "dynamo-json"),
        ("BlockStored", 3, "dynamo-msgpack"),
        ("BlockRemoved", 3, "dynamo-msgpack"),
    ]
    assert rows[0]["tokens_hashes"] == [tokens_hash(range(4)), tokens_hash(range(4, 8))]
    assert rows[2]["seq"] == 0 and rows[2]["topic"].endswith("endpoint.generate.kv-events")
    assert "malformed 0" in err


def test_subject_in_url_and_pretty_output(nats_server):
    subject = "custom.kv"
    messages = [
        ("namespace.x.component.y.kv_events", b"{}"),
        (subject, encode_json(router_event(STORED, 4, 0))),
    ]
    rc, out, err = tap_while(
        lambda: publish(nats_server.url, messages), f"{nats_server.url}/{subject}", "-c", "1"
    )
    assert rc == 0, err
    assert "BlockStored" in out and "2 blocks" in out and "worker=4" in out


@pytest.mark.parametrize("stop", [["-c", "3"], ["--idle-timeout", "1"]])
def test_from_start_reads_jetstream_history(tmp_path, stop):
    from conftest import NatsServer

    server = NatsServer(tmp_path)  # its own JetStream store: only this stream's history
    stream = "namespace-hist-component-backend-kv-events"
    subject = f"{stream}.kv-events"
    try:
        publish(
            server.url,
            [
                (
                    subject,
                    encode_json(router_event({"type": "BlockRemoved", "block_hashes": [i]}, 9, i)),
                )
                for i in range(3)
            ],
            stream=stream,
        )
        result = run_main("tap", server.url, "--from-start", "--json", *stop)
    finally:
        server.stop()
    assert result.code == 0, result.err
    rows = [json.loads(line) for line in result.out.splitlines()]
    assert [r["block_hashes"] for r in rows] == [[0], [1], [2]]
    assert [r["event_id"] for r in rows] == [0, 1, 2]
    # the JetStream consumers are closed before the client: no asyncio or nats-py noise
    err = result.err
    for noise in (
        "Task was destroyed",
        "Unclosed",
        "Traceback",
        "Exception ignored",
        "never connected",
    ):
        assert noise not in err, err
    assert len(err.strip().splitlines()) == 2  # "reading" and the summary


def test_malformed_nats_message_is_shown(nats_server):
    messages = [
        ("namespace.a.component.b.kv-events", b"\x85garbage"),
        ("namespace.a.component.b.kv-events", msgpack.packb({"payload": b"\xc1"})),
    ]
    rc, out, err = tap_while(
        lambda: publish(nats_server.url, messages), nats_server.url, "--idle-timeout", "1", "--json"
    )
    assert rc == 0 and out == ""
    assert err.count("malformed message from") == 2 and "malformed 2" in err


def test_unreachable_nats_is_a_clear_error():
    result = run_main("tap", f"nats://127.0.0.1:{free_port()}", "--connect-timeout", "1")
    err = result.err
    assert result.code == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("kvctl: reading") and len(lines) == 2  # one error line
    assert "cannot connect to NATS after 1 s (connection refused)" in lines[1]


def test_nats_credentials_from_options_and_environment(tmp_path):
    from conftest import NatsServer

    server = NatsServer(tmp_path, "--user", "kv", "--pass", "s3cret")
    try:
        # waiting does not cure wrong credentials: an error at once, without --connect-timeout
        started = time.monotonic()
        denied = run_main("tap", server.url, "--duration", "10")
        assert denied.code == 1 and "Traceback" not in denied.err
        assert "cannot connect to NATS: authorization violation" in denied.err
        assert time.monotonic() - started < 5
        for args, env in (
            (["--nats-user", "kv", "--nats-password", "s3cret"], None),
            ([], {"KVCTL_NATS_USER": "kv", "KVCTL_NATS_PASSWORD": "s3cret"}),
        ):
            rc, out, err = tap_while(
                lambda: asyncio.run(asyncio.wait_for(_publish_auth(server.url), 10)),
                server.url,
                "--json",
                "-c",
                "1",
                *args,
                env=env,
            )
            assert rc == 0, err
            assert json.loads(out)["type"] == "AllBlocksCleared"
    finally:
        server.stop()


async def _publish_auth(url: str) -> None:
    nc = await nats.connect(url, user="kv", password="s3cret")
    await nc.publish(
        "namespace.a.component.b.kv_events",
        encode_json(router_event({"type": "AllBlocksCleared"}, 1, 0)),
    )
    await nc.flush()
    await nc.close()


def test_connect_timeout_0_still_means_wait(tmp_path):
    """Compatibility: 0 was "wait forever" before waiting became the default."""
    result = run_main(
        "tap",
        f"nats://127.0.0.1:{free_port()}",
        "--connect-timeout",
        "0",
        "--duration",
        "1.5",
        timeout=20,
    )
    assert result.code == 0 and "stopped by --duration" in result.err


def read_lines(stream, count: int, timeout: float = 15) -> str:
    """The first ``count`` lines of a child's pipe, read from the descriptor (a buffered
    readline could take several lines in, and a later select would wait for nothing)."""
    import os
    import select

    data = b""
    deadline = time.monotonic() + timeout
    while data.count(b"\n") < count:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"{count} lines not within {timeout}s: {data!r}"
        chunk = os.read(stream.fileno(), 65536)
        assert chunk, f"pipe closed after {data!r}"
        data += chunk
    return data.decode()


def kill_server(server) -> None:
    """kill -9: the server gets no chance to say goodbye to its clients."""
    server.proc.kill()
    server.proc.wait(10)


@pytest.mark.parametrize("outage_s", [0, 1, 10])
def test_server_outage_mid_run_is_survived_and_reported(tmp_path, outage_s):
    """kill -9 of the server, down for a while, restarted on the same port and store: tap keeps
    its subscriptions, says each state change in one line and counts what it missed."""
    from conftest import NatsServer

    server = NatsServer(tmp_path)
    proc = start_kvctl("tap", server.url, "--json", "-c", "2")
    try:
        wait_ready(proc)
        subject = "namespace.a.component.b.endpoint.c.kv-events"
        event = router_event({"type": "AllBlocksCleared"}, 1, 0)
        publish(server.url, [(subject, encode_envelope([event], 7, 0, 1000))])
        assert read_line(proc.stdout)
        kill_server(server)
        seen = read_until(proc.stderr, "disconnected")
        time.sleep(outage_s)  # the outage itself: nothing to wait for but the clock
        assert proc.poll() is None, "tap gave up during the outage"
        server = NatsServer(tmp_path, port=server.port)  # same port, same store
        seen += read_until(proc.stderr, "reconnected after")
        # seqs 1 and 2 were "published" during the outage: the envelope's seq shows the loss
        publish(server.url, [(subject, encode_envelope([event], 7, 3, 2000))])
        rc, out, rest = finish(proc)
    finally:
        server.stop()
    err = "".join(seen) + rest
    assert rc == 0, err
    assert len(out.splitlines()) == 1  # the second event (the first was read above)
    assert "Traceback" not in err and "Error" not in err and "nats: " not in err
    assert err.count("disconnected") == 1 and err.count("reconnected") == 1
    assert f"kvctl: {server.url}: disconnected (unexpected EOF); reconnecting" in err
    assert "seq 1..2 missing (2 batches, not recovered)" in err
    assert "gaps 1 (2 batches missing" in err


def delivered(monitor_port: int, count: int, timeout: float = 10) -> None:
    """Wait until the server has delivered ``count`` messages to some client (its /connz
    monitoring page): record prints nothing per message to wait on."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz", timeout=2) as r:
            if any(c.get("out_msgs", 0) >= count for c in json.load(r)["connections"]):
                return
        time.sleep(0.05)  # polling the server's own counter: there is no push signal
    raise AssertionError(f"the server did not deliver {count} messages within {timeout}s")


@pytest.mark.parametrize("outage_s", [1, 10])
def test_record_through_an_outage_keeps_the_gap(tmp_path, outage_s):
    from conftest import NatsServer

    path = tmp_path / "outage.parquet"
    monitor = str(free_port())
    server = NatsServer(tmp_path / "store", "-m", monitor)
    proc = start_kvctl("record", server.url, "-o", str(path), "-c", "2")
    try:
        assert read_until(proc.stderr, "kvctl: ")[-1].startswith("kvctl: recording")
        subject = "namespace.a.component.b.endpoint.c.kv-events"
        event = router_event({"type": "AllBlocksCleared"}, 1, 0)
        publish(server.url, [(subject, encode_envelope([event], 7, 0, 1000))])
        delivered(int(monitor), 1)  # record has it before the server dies
        kill_server(server)
        read_until(proc.stderr, "disconnected")
        time.sleep(outage_s)  # the outage itself
        assert proc.poll() is None, "record gave up during the outage"
        server = NatsServer(tmp_path / "store", "-m", monitor, port=server.port)
        read_until(proc.stderr, "reconnected after")
        publish(server.url, [(subject, encode_envelope([event], 7, 3, 2000))])
        rc, _, err = finish(proc, timeout=30)
    finally:
        server.stop()
    assert rc == 0, err
    info = json.loads(run_main("inspect", str(path), "--json").out)
    assert (info["gaps"], info["missing"], info["events"]) == (1, 2, 2), info


def test_from_start_history_resumes_after_a_restart(tmp_path):
    """A restarted server has forgotten the ephemeral JetStream consumers: tap creates them
    again from the message after the last one it got, so nothing repeats and nothing is
    skipped."""
    from conftest import NatsServer

    stream = "namespace-r-component-backend-kv-events"
    subject = f"{stream}.kv-events"

    def history(first: int) -> list:
        return [
            (
                subject,
                encode_json(router_event({"type": "BlockRemoved", "block_hashes": [i]}, 9, i)),
            )
            for i in range(first, first + 3)
        ]

    server = NatsServer(tmp_path)
    publish(server.url, history(0), stream=stream)
    proc = start_kvctl("tap", server.url, "--from-start", "--json", "-c", "6")
    try:
        first = read_lines(proc.stdout, 3)
        kill_server(server)
        read_until(proc.stderr, "disconnected")
        server = NatsServer(tmp_path, port=server.port)
        read_until(proc.stderr, "reconnected after")
        publish(server.url, history(3), stream=stream)
        rc, out, err = finish(proc, timeout=8)  # not nats-py's own 10-20 s heartbeat timeout
    finally:
        server.stop()
    assert rc == 0, err
    rows = [json.loads(line) for line in (first + out).splitlines()]
    assert [r["block_hashes"] for r in rows] == [[0], [1], [2], [3], [4], [5]]
    assert "Traceback" not in err and "not resumed" not in err


def test_connect_timeout_also_bounds_an_outage(tmp_path):
    from conftest import NatsServer

    server = NatsServer(tmp_path)
    proc = start_kvctl("tap", server.url, "--connect-timeout", "1")
    try:
        wait_ready(proc)
        kill_server(server)
        started = time.monotonic()
        rc, _, err = finish(proc, timeout=10)
    finally:
        server.stop()
    assert rc == 1 and time.monotonic() - started < 5, err
    last = err.splitlines()[-1]  # the reason is the latest attempt's: connection refused
    assert last == (
        f"kvctl: {server.url}: disconnected for 1 s (connection refused); giving up "
        "(--connect-timeout)"
    )
    assert "Traceback" not in err
