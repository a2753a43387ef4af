"""kvctl stream init / info against a real nats-server (the session's JetStream server), and
the partition function checked against the server's own subject mapping."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import nats.errors
import pytest
from conftest import NatsServer, free_port, nats_server_binary
from hypothesis import given
from hypothesis import strategies as st
from inprocess import Run, run_main
from nats_cluster import nats_cluster_fixture  # noqa: F401 (pytest finds it by name)

from kvctl.partitions import (
    StreamLayout,
    fnv1a_32,
    parse_age,
    partition_of,
    worker_label,
    worker_token,
)

_names = (f"s{n}" for n in itertools.count())


def stream_name() -> str:
    """A stream of its own per test: the server is the session's, shared."""
    return f"kvctl-test-{next(_names)}"


def kvctl(*args: str) -> Run:
    return run_main("stream", *args)


def on_server(url: str, work: Callable[[Any], Awaitable[Any]]) -> Any:
    """``await work(js)`` with a JetStream context of a plain nats-py client (bounded)."""

    async def main() -> Any:
        nc = await nats.connect(url)
        try:
            return await work(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(asyncio.wait_for(main(), 20))


def publish_workers(url: str, layout: StreamLayout, messages: dict[str, int]) -> None:
    async def send(js: Any) -> None:
        for worker, count in messages.items():
            for n in range(count):
                await js.publish(layout.publish_subject(worker), f"{worker}/{n}".encode())

    on_server(url, send)


# --- the pure function ---


def test_fnv1a_32_known_values():
    assert fnv1a_32(b"") == 0x811C9DC5
    assert fnv1a_32(b"a") == 0xE40C292C
    assert fnv1a_32(b"foobar") == 0xBF9CF968


@given(st.text(min_size=1, max_size=40))
def test_worker_token_is_one_subject_token_and_reversible(label):
    token = worker_token(label)
    assert token and not set(token) & set(".*> \t\r\n")
    assert token.isascii() and token.isprintable()
    assert worker_label(token) == label


@given(st.text(min_size=1, max_size=20), st.integers(min_value=1, max_value=64))
def test_partition_is_in_range_and_of_the_stored_subject(label, partitions):
    layout = StreamLayout("fleet", partitions)
    partition = partition_of(label, partitions)
    assert 0 <= partition < partitions
    assert layout.parse_stored(layout.stored_subject(label)) == (partition, label)


def test_max_age_units():
    assert parse_age("7d") == 7 * 86400 and parse_age("90m") == 5400 and parse_age("0") == 0
    with pytest.raises(ValueError):
        parse_age("soon")


# --- init ---


def test_init_partitions_workers_as_the_server_maps_them(nats_server):
    name = stream_name()
    result = kvctl("init", nats_server.url, "--name", name, "--partitions", "8", "--json")
    assert result.code == 0, result.err
    made = json.loads(result.out)
    assert made["status"] == "created"
    assert made["partition_subjects"] == [f"kvctl.{name}.{p}.*" for p in range(8)]
    assert made["publish_subject"] == f"kvctl.{name}.events.WORKER"
    assert (made["partitions"], made["replicas"], made["max_age"]) == (8, 1, "unlimited")

    layout = StreamLayout(name, 8)
    odd = ["10.0.0.1:5557", "host a", "wörker", "x*y>z", "50%", "dp.3"]
    workers = [str(n) for n in range(300)] + [f"worker-{n}" for n in range(100)] + odd
    publish_workers(nats_server.url, layout, dict.fromkeys(workers, 1))

    async def stored(js: Any) -> dict[str, int]:
        info = await js.stream_info(name, subjects_filter=">")
        return info.state.subjects

    subjects = on_server(nats_server.url, stored)
    assert len(subjects) == len(workers)  # one subject per worker, nothing merged
    landed = {layout.parse_stored(subject) for subject in subjects}
    assert landed == {(partition_of(w, 8), w) for w in workers}
    assert {p for p, _ in landed} == set(range(8))  # every partition holds workers


def test_init_again_is_idempotent_and_other_settings_are_refused(nats_server):
    name = stream_name()
    args = ("init", nats_server.url, "--name", name, "--partitions", "4", "--max-age", "1h")
    assert kvctl(*args).code == 0
    again = kvctl(*args)
    assert again.code == 0, again.err
    assert f"stream {name}: exists, unchanged" in again.out
    assert "4 partitions, 1 replica, max age 1h" in again.out

    other = kvctl("init", nats_server.url, "--name", name, "--partitions", "6", "--max-age", "2h")
    assert other.code == 2 and other.out == ""
    assert other.err.count("\n") == 1 and "Traceback" not in other.err
    assert "partitions 4 (asked 6); max age 1h (asked 2h)" in other.err
    assert "--update" in other.err

    updated = kvctl(
        "init", nats_server.url, "--name", name, "--partitions", "6", "--max-age", "2h",
        "--update", "--json",
    )  # fmt: skip
    assert updated.code == 0, updated.err
    report = json.loads(updated.out)
    assert (report["status"], report["partitions"], report["max_age"]) == ("updated", 6, "2h")
    assert "{{partition(6,1)}}" in report["transform"]["dest"]


def test_a_stream_kvctl_did_not_make_is_left_alone(nats_server):
    name = stream_name()

    async def make(js: Any) -> None:
        await js.add_stream(name=name, subjects=[f"other.{name}.>"])

    on_server(nats_server.url, make)
    result = kvctl("init", nats_server.url, "--name", name, "--partitions", "2", "--update")
    assert result.code == 2
    assert f"stream {name} exists and is not one kvctl stream init made" in result.err


# --- info ---


def test_info_counts_partitions_and_a_consumer_s_lag(nats_server):
    name = stream_name()
    assert kvctl("init", nats_server.url, "--name", name, "--partitions", "3").code == 0
    layout = StreamLayout(name, 3)
    workers = {f"w{n}": n + 1 for n in range(12)}  # w0 sends 1 message, w11 sends 12
    publish_workers(nats_server.url, layout, workers)
    reader = 1
    mine = sum(count for w, count in workers.items() if partition_of(w, 3) == reader)
    assert mine >= 3

    async def read_some(js: Any) -> None:
        sub = await js.pull_subscribe(
            layout.partition_subject(reader), durable="reader-1", stream=name
        )  # a stored subject, not one the stream listens on: the stream is named
        taken = await sub.fetch(3, timeout=5)
        for msg in taken[:2]:
            await msg.ack()  # the third stays delivered, not acknowledged

    on_server(nats_server.url, read_some)
    result = kvctl("info", nats_server.url, "--name", name, "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["messages"] == sum(workers.values())
    expected = [
        sum(count for w, count in workers.items() if partition_of(w, 3) == p) for p in range(3)
    ]
    assert [p["messages"] for p in report["partitions"]] == expected
    assert [p["workers"] for p in report["partitions"]] == [
        sum(1 for w in workers if partition_of(w, 3) == p) for p in range(3)
    ]
    (consumer,) = report["consumers"]
    assert consumer["name"] == "reader-1" and consumer["durable"]
    assert consumer["filter_subjects"] == [f"kvctl.{name}.1.*"]
    assert consumer["num_pending"] == mine - 3
    assert consumer["num_ack_pending"] == 1

    pretty = kvctl("info", nats_server.url, "--name", name)
    assert pretty.code == 0
    assert f"stream {name}: 3 partitions, 1 replica" in pretty.out
    assert "reader-1" in pretty.out and f"kvctl.{name}.1.*" in pretty.out


def test_info_of_a_missing_stream(nats_server):
    result = kvctl("info", nats_server.url, "--name", "kvctl-test-none")
    assert result.code == 1 and "no stream kvctl-test-none" in result.err


def test_several_servers_one_unreachable(nats_server):
    name = stream_name()
    servers = f"nats://127.0.0.1:{free_port()},{nats_server.url}"
    result = kvctl("init", servers, "--name", name, "--partitions", "2")
    assert result.code == 0, result.err
    assert kvctl("info", servers, "--name", name).code == 0


# --- what goes wrong ---


def test_unreachable_server_is_one_line():
    url = f"nats://127.0.0.1:{free_port()}"
    result = kvctl("info", url, "--name", "fleet", "--connect-timeout", "1")
    assert result.code == 1
    assert result.err == f"kvctl: {url}: cannot connect to NATS: connection refused\n"


def test_credentials_as_every_command_and_no_password_shown(tmp_path):
    server = NatsServer(tmp_path / "store", "--user", "kv", "--pass", "s3cret")
    try:
        args = ("--name", "fleet", "--partitions", "2")
        made = kvctl("init", server.url, *args, "--nats-user", "kv", "--nats-password", "s3cret")
        assert made.code == 0, made.err
        refused = kvctl("info", server.url, "--name", "fleet")
        assert refused.code == 1 and refused.err.count("\n") == 1
        assert "authorization violation" in refused.err
        wrong = f"nats://kv:wrong@127.0.0.1:{server.port}"
        refused = kvctl("info", wrong, "--name", "fleet")
        assert refused.code == 1 and "wrong" not in refused.err
    finally:
        server.stop()


def test_jetstream_not_enabled_is_said(tmp_path):
    port = free_port()
    server = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"nats://127.0.0.1:{port}"
        # readiness: a client connects (bounded by the connect timeout and attempts)
        on_server_ready = run_until_connected(url)
        assert on_server_ready
        result = kvctl("init", url, "--name", "fleet", "--partitions", "2")
        assert result.code == 1
        assert result.err.count("\n") == 1
        assert "JetStream is not enabled" in result.err
    finally:
        server.terminate()
        server.wait(10)


def run_until_connected(url: str, attempts: int = 100) -> bool:
    async def connect() -> bool:
        for _ in range(attempts):
            try:
                nc = await nats.connect(url, allow_reconnect=False, connect_timeout=0.5)
            except Exception:
                await asyncio.sleep(0.05)  # the server's port has no readiness signal
                continue
            await nc.close()
            return True
        return False

    return asyncio.run(connect())


@pytest.mark.parametrize(
    "args, message",
    [
        (("--partitions", "0"), "0 is not in the range x>=1"),
        (("--partitions", "2", "--max-age", "soon"), "'soon' is not a duration"),
        ((), "stream init needs --partitions N"),
    ],
)
def test_bad_options(nats_server, args, message):
    result = kvctl("init", nats_server.url, "--name", stream_name(), *args)
    assert result.code == 2 and message in result.err and result.err.count("\n") == 1


def test_bad_name_and_init_options_on_info(nats_server):
    result = kvctl("init", nats_server.url, "--name", "a.b", "--partitions", "2")
    assert result.code == 2 and "stream name 'a.b'" in result.err
    result = kvctl("info", nats_server.url, "--name", "fleet", "--partitions", "2")
    assert result.code == 2 and "--partitions: for `kvctl stream init` only" in result.err
    result = kvctl("info", "tcp://127.0.0.1:5557", "--name", "fleet")
    assert result.code == 2 and "not a NATS URL" in result.err


def test_more_replicas_than_one_server_has_is_the_server_s_refusal(nats_server):
    name = stream_name()
    result = kvctl("init", nats_server.url, "--name", name, "--partitions", "2", "--replicas", "3")
    assert result.code == 2 and result.err.count("\n") == 1
    assert f"stream {name}: replicas > 1 not supported in non-clustered mode" in result.err


async def stream_leader_elected(js: Any, stream: str, lost: str, timeout: float = 20) -> None:
    """Until the stream has a leader other than the lost node (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(nats.errors.Error):
            info = await js.stream_info(stream)
            if info.cluster and info.cluster.leader not in (None, lost):
                return
        assert time.monotonic() < deadline, f"no leader for {stream} within {timeout} s"
        await asyncio.sleep(0.05)


def test_an_r3_stream_on_a_cluster_survives_a_node(nats_cluster):
    """The issue's deployment: a replicated stream on three servers, reached through a server
    list; with the first server of the list killed, once the cluster has elected new leaders
    (several seconds, during which JetStream does not answer), `info` answers through the
    others."""
    name = stream_name()
    made = kvctl("init", nats_cluster.url, "--name", name, "--partitions", "4", "--replicas", "3")
    assert made.code == 0, made.err
    info = kvctl("info", nats_cluster.url, "--name", name, "--json")
    assert info.code == 0, info.err
    first = json.loads(info.out)
    assert first["replicas"] == 3
    nats_cluster.kill(0)  # the first server of the list
    try:
        nats_cluster.wait_healthy()
        on_server(
            nats_cluster.urls[1],
            lambda js: stream_leader_elected(js, name, nats_cluster.nodes[0].name),
        )
        again = kvctl("info", nats_cluster.url, "--name", name, "--json")
        assert again.code == 0, again.err
        assert json.loads(again.out)["replicas"] == 3
    finally:
        nats_cluster.restart(0)
