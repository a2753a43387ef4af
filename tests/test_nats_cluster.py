"""The 3-node cluster test bed, proven with nats-py alone: an R3 stream survives ``kill -9`` of
its leader mid-publish with every message stored exactly once."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import nats
import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig
from nats_cluster import (
    NatsCluster,
    nats_cluster_fixture,  # noqa: F401 (pytest finds it by name)
    wait_stream_current,
)

STREAM = "FLEET"
MESSAGES = 1_000
KILL_AT = 300  # acknowledged messages before the stream leader is killed
RESTART_AT = 600  # ... and before it is started again, while publishing goes on

# what a publish meets while the stream has no leader or the client reconnects: each is
# retried with the same Nats-Msg-Id, so one that was stored after all is dropped as a duplicate
RETRYABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)


@dataclass
class Publishing:
    """What the publisher saw: acknowledged messages, and when publishes were refused."""

    acked: int = 0
    duplicates: int = 0
    first_ack_after_refusal: float | None = None
    refusals: dict[str, int] = field(default_factory=dict)


async def publish_all(js, publishing: Publishing, per_message_deadline: float = 30) -> None:
    """Publish MESSAGES messages with Nats-Msg-Id headers, retrying each with bounded backoff."""
    for i in range(MESSAGES):
        deadline = time.monotonic() + per_message_deadline
        backoff = 0.05
        while True:
            try:
                ack = await js.publish(
                    f"fleet.w{i % 8}",
                    f"event {i}".encode(),
                    timeout=1.0,
                    headers={"Nats-Msg-Id": f"m-{i}"},
                )
            except RETRYABLE as error:
                name = type(error).__name__
                publishing.refusals[name] = publishing.refusals.get(name, 0) + 1
                refused = f"message {i} refused for {per_message_deadline} s: {error!r}"
                assert time.monotonic() < deadline, refused
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
                continue
            if publishing.refusals and publishing.first_ack_after_refusal is None:
                publishing.first_ack_after_refusal = time.monotonic()
            publishing.duplicates += bool(ack.duplicate)
            publishing.acked += 1
            break


async def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        await asyncio.sleep(0.01)


async def survive_leader_kill(cluster: NatsCluster) -> None:
    nc = await nats.connect(
        servers=cluster.urls, connect_timeout=2, reconnect_time_wait=0.1, max_reconnect_attempts=50
    )
    try:
        js = nc.jetstream()
        await js.add_stream(
            name=STREAM, subjects=["fleet.>"], num_replicas=3, duplicate_window=120.0
        )
        publishing = Publishing()
        publisher = asyncio.create_task(publish_all(js, publishing))
        await wait_for(lambda: publishing.acked >= KILL_AT or publisher.done(), "publishes")

        leader = (await js.stream_info(STREAM)).cluster.leader
        killed = cluster.index_of(leader)
        killed_at = time.monotonic()
        cluster.kill(killed)
        try:
            await wait_for(
                lambda: publishing.acked >= RESTART_AT or publisher.done(),
                "publishes after the leader was killed",
            )
        finally:  # the node comes back even when the test fails: the cluster is the module's
            await asyncio.to_thread(cluster.restart, killed)
        await asyncio.wait_for(publisher, 60)

        refused_for = (publishing.first_ack_after_refusal or killed_at) - killed_at
        print(
            f"\nstream leader {leader} killed: publishes resumed after {refused_for:.2f} s "
            f"(refusals {publishing.refusals}, {publishing.duplicates} duplicates dropped)"
        )
        assert publishing.acked == MESSAGES
        assert publishing.refusals, "killing the stream leader refused no publish"

        info = await wait_stream_current(js, STREAM)
        assert info.state.messages == MESSAGES

        # the new leader drops what the old one stored: message ids survive the fail-over
        for i in range(0, MESSAGES, 10):
            ack = await js.publish(
                f"fleet.w{i % 8}", f"event {i}".encode(), headers={"Nats-Msg-Id": f"m-{i}"}
            )
            assert ack.duplicate, f"m-{i} stored twice"
        assert (await js.stream_info(STREAM)).state.messages == MESSAGES

        ids = await read_all(js)
        assert sorted(ids) == sorted(f"m-{i}" for i in range(MESSAGES))
    finally:
        await nc.close()


async def read_all(js, timeout: float = 20) -> list[str]:
    """Every message of the stream through a durable pull consumer, acknowledged."""
    consumer = await js.pull_subscribe(
        "fleet.>", durable="reader", stream=STREAM, config=ConsumerConfig(ack_wait=30)
    )
    ids: list[str] = []
    deadline = time.monotonic() + timeout
    while len(ids) < MESSAGES:
        assert time.monotonic() < deadline, f"read {len(ids)} of {MESSAGES} in {timeout} s"
        try:
            batch = await consumer.fetch(250, timeout=2)
        except nats.errors.TimeoutError:
            continue
        for message in batch:
            ids.append(message.headers["Nats-Msg-Id"])
            await message.ack()
    # acks are fire-and-forget: the consumer's leader takes them in shortly after
    acked_by = time.monotonic() + 10
    while (info := await consumer.consumer_info()).num_ack_pending or info.num_pending:
        assert time.monotonic() < acked_by, f"acks not taken in within 10 s: {info}"
        await asyncio.sleep(0.05)
    return ids


def test_r3_stream_keeps_every_message_once_across_leader_kill(nats_cluster: NatsCluster) -> None:
    asyncio.run(asyncio.wait_for(survive_leader_kill(nats_cluster), 90))
    nats_cluster.wait_healthy()
