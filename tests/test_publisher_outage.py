"""Publishers through a NATS outage: kill -9 of the test nats-server mid-run, restarted on the
same port (and store) seconds later. replay and simulate wait, retry and say so; with JetStream
the acks they report are exactly what the stream holds (read back by tap --from-start)."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from conftest import NatsServer, finish, free_port, run_kvctl, start_kvctl
from test_cmd_replay import make_recording, rows_of

OUTAGE_S = 4.0  # longer than nats-py's default reconnect budget (5 tries, 0.5 s apart)


async def _stored(url: str, stream: str) -> int:
    nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False)
    try:
        return (await nc.jetstream().stream_info(stream)).state.messages
    except Exception:  # not created yet
        return 0
    finally:
        await nc.close()


def wait_until_stored(url: str, stream: str, count: int, timeout: float = 20) -> None:
    """The run is under way: the stream holds ``count`` messages (bounded in time)."""
    deadline = time.monotonic() + timeout
    while asyncio.run(_stored(url, stream)) < count:
        assert time.monotonic() < deadline, f"{stream}: fewer than {count} messages"
        time.sleep(0.05)


async def _messages_flowing(url: str, subject: str, count: int, timeout: float) -> None:
    nc = await nats.connect(url, connect_timeout=2)
    seen = asyncio.Event()
    got = 0

    async def count_one(_msg: object) -> None:
        nonlocal got
        got += 1
        if got >= count:
            seen.set()

    try:
        await nc.subscribe(subject, cb=count_one)
        await asyncio.wait_for(seen.wait(), timeout)
    finally:
        await nc.close()


def wait_until_flowing(url: str, subject: str, count: int = 10, timeout: float = 20) -> None:
    """The run is under way: ``count`` messages seen on ``subject`` (NATS core keeps none)."""
    asyncio.run(_messages_flowing(url, subject, count, timeout))


def outage(server: NatsServer, store, seconds: float) -> NatsServer:
    server.proc.kill()
    server.proc.wait()
    time.sleep(seconds)  # the outage itself: its length is the point
    return NatsServer(store, port=server.port)


def history(url: str, namespace: str) -> list[dict]:
    result = run_kvctl(
        "tap",
        url,
        "--from-start",
        "--json",
        "--idle-timeout",
        "2",
        "--subject",
        "nothing.here",
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [
        r
        for r in rows_of(result.stdout.decode())
        if r["topic"].startswith(f"namespace-{namespace}-")
    ]


@pytest.fixture
def store(tmp_path):
    return tmp_path / "store"


@pytest.mark.parametrize("seconds", [1.0, 10.0])
def test_replay_to_jetstream_survives_an_outage_and_its_acks_match_the_stream(
    tmp_path, store, seconds
):
    """10 s: the outage outlasts the sending, so the end waits for the server too."""
    path = tmp_path / "run.parquet"
    events = sum(len(b.events) for b in make_recording(path, batches=400))
    server = NatsServer(store)
    try:
        replay = start_kvctl(
            "replay",
            str(path),
            "--to",
            server.url,
            "--format",
            "dynamo-json",
            "--namespace",
            "out",
            "--rate",
            "50",
            "--json",
        )
        wait_until_stored(server.url, "namespace-out-component-backend-kv-events", 20)
        server = outage(server, store, seconds)
        rc, out, err = finish(replay, timeout=90)
        assert rc == 0, err
        delivery = json.loads(out)["delivery"]
        assert "NATS connection lost" in err and "reconnected to NATS after" in err
        assert delivery["outages"] == 1 and delivery["outage_s"] >= seconds * 0.8
        assert delivery["dropped"] == delivery["failed"] == 0
        assert delivery["acked"] == events == len(history(server.url, "out"))
    finally:
        server.stop()


def test_simulate_to_jetstream_survives_an_outage_and_reports_what_was_stored(store):
    server = NatsServer(store)
    try:
        simulate = start_kvctl(
            "simulate",
            "--to",
            server.url,
            "--format",
            "dynamo-json",
            "--namespace",
            "sim",
            "--workers",
            "2",
            "--rate",
            "20",
            "--duration",
            "8",
            "--json",
        )
        wait_until_stored(server.url, "namespace-sim-component-backend-kv-events", 5)
        server = outage(server, store, OUTAGE_S)
        rc, out, err = finish(simulate, timeout=90)
        assert rc == 0, err
        report = json.loads(out)
        assert report["delivery"]["outages"] == 1
        assert report["delivery"]["acked"] == report["events"] == len(history(server.url, "sim"))
    finally:
        server.stop()


def test_replay_to_nats_core_survives_an_outage_and_counts_what_it_published(tmp_path, store):
    path = tmp_path / "run.parquet"
    sent = len(make_recording(path, batches=300))
    server = NatsServer(store)
    try:
        replay = start_kvctl("replay", str(path), "--to", server.url, "--rate", "50")
        wait_until_flowing(server.url, "namespace.*.component.*.endpoint.*.kv-events")
        server = outage(server, store, OUTAGE_S)
        rc, _, err = finish(replay, timeout=90)
        assert rc == 0, err
        assert f"Published: {sent} messages" in err
        assert "Outages: the server was away 1 time" in err
    finally:
        server.stop()


def test_server_gone_at_the_end_is_counted_as_dropped(tmp_path, store):
    """The server dies and stays away: the run ends, waits a bounded time, and says what was
    never published and why (instead of claiming it was sent)."""
    path = tmp_path / "run.parquet"
    make_recording(path, batches=150)
    server = NatsServer(store)
    replay = start_kvctl(
        "replay",
        str(path),
        "--to",
        server.url,
        "--format",
        "dynamo-json",
        "--namespace",
        "gone",
        "--rate",
        "50",
        "--json",
    )
    wait_until_stored(server.url, "namespace-gone-component-backend-kv-events", 10)
    server.proc.kill()
    server.proc.wait()
    rc, out, err = finish(replay, timeout=60)
    assert rc == 0, err
    delivery = json.loads(out)["delivery"]
    assert delivery["dropped"] > 0 and "unreachable when the run ended" in delivery["drop_reason"]
    report = json.loads(out)
    assert delivery["acked"] + delivery["dropped"] + delivery["failed"] == report["events"]


def test_bridge_into_jetstream_survives_an_outage_and_loses_nothing(tmp_path, store):
    """Engine ZMQ -> bridge -> Dynamo on JetStream, the server killed mid-run for 4 s."""
    path = tmp_path / "run.parquet"
    events = sum(len(b.events) for b in make_recording(path, batches=400))
    engine = f"tcp://127.0.0.1:{free_port()}"
    server = NatsServer(store)
    try:
        bridge = start_kvctl(
            "bridge",
            engine,
            "--to",
            server.url,
            "--format",
            "dynamo-json",
            "--namespace",
            "br",
            "--idle-timeout",
            "3",
            "--json",
        )
        replay = start_kvctl(
            "replay", str(path), "--to", engine, "--rate", "50", "--wait-subscribers", "1", "-q"
        )
        wait_until_stored(server.url, "namespace-br-component-backend-kv-events", 20)
        server = outage(server, store, OUTAGE_S)
        assert finish(replay, timeout=60)[0] == 0
        rc, out, err = finish(bridge, timeout=90)
        assert rc == 0, err
        delivery = json.loads(out)["delivery"]
        assert delivery["outages"] == 1 and delivery["dropped"] == delivery["failed"] == 0
        assert delivery["acked"] == events == len(history(server.url, "br"))
    finally:
        server.stop()
