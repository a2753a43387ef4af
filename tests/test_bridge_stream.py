"""kvctl bridge --stream: engine messages published into a kvctl fleet stream on a real
nats-server (the session's, and the 3-node cluster for a leader killed mid-stream), read back
with nats-py and checked against what the engine sent."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import nats
import pytest
from conftest import Engine, NatsServer, free_port, publish, removed, serve_replays_until, stored
from inprocess import Live, Run, run_main
from nats_cluster import NatsCluster, nats_cluster_fixture  # noqa: F401 (pytest finds it)

from kvctl.formats.dynamo import encode_json, router_event
from kvctl.partitions import HEADER_BRIDGE, MSG_ID, FleetMessage, StreamLayout, partition_of
from kvctl.transports.zmq import ReplayServer

_names = (f"b{n}" for n in itertools.count())


def stream_name() -> str:
    """A stream of its own per test: the server is the session's, shared."""
    return f"kvctl-bridge-{next(_names)}"


def init_stream(url: str, name: str, partitions: int = 4, replicas: int = 1) -> StreamLayout:
    result = run_main(
        "stream",
        "init",
        url,
        "--name",
        name,
        "--partitions",
        str(partitions),
        "--replicas",
        str(replicas),
    )
    assert result.code == 0, result.err
    return StreamLayout(name, partitions)


def stored_messages(url: str, name: str) -> list[Any]:
    """Every message of the stream, in stream order (nats-py's RawStreamMsg: subject, headers,
    data), read by sequence number (bounded)."""

    async def main() -> list[Any]:
        nc = await nats.connect(servers=url.split(","))
        try:
            js = nc.jetstream()
            info = await js.stream_info(name)
            first, last = info.state.first_seq, info.state.last_seq
            if info.state.messages == 0:
                return []
            return [await js.get_msg(name, seq) for seq in range(first, last + 1)]
        finally:
            await nc.close()

    return asyncio.run(asyncio.wait_for(main(), 30))


def bridge(*args: str, alongside: Any = None, timeout: float = 40) -> Run:
    return run_main("bridge", *args, alongside=alongside, timeout=timeout)


def report_of(run: Run) -> dict[str, Any]:
    return json.loads(run.out)


def test_every_message_lands_in_its_partition_with_its_bytes(nats_server: NatsServer) -> None:
    """Three labelled engines and an unlabelled one, a malformed message, gaps the replay
    socket fills and one it cannot: every message is one stream message in the partition
    partition_of(worker) says, with the engine's frames byte for byte and the labels of the
    journal row kvctl record writes; the unfilled gap is a gap marker."""
    name = stream_name()
    layout = init_stream(nats_server.url, name)
    engines = [Engine(f"tcp://127.0.0.1:{free_port()}") for _ in range(4)]
    replay = ReplayServer(f"tcp://127.0.0.1:{free_port()}")
    labels = ["w0", "w1", "7", None]
    sent: dict[int, list[list[bytes]]] = {i: [] for i in range(4)}

    def engines_publish(live: Live) -> None:
        for engine in engines:
            engine.wait_for()
        for step in range(40):
            for i, engine in enumerate(engines):
                frames = engine.batch([stored([step * 10 + i, step * 10 + i + 1])])
                seq = int.from_bytes(frames[1], "big")
                sent[i].append(frames)
                if i == 0:
                    if seq != 20:  # seq 20 is dropped live and never kept: a gap marker
                        replay.remember(seq, frames[0], frames[2])
                    if seq in (10, 11, 20):  # 10, 11: dropped live, filled by the replay
                        continue
                engine.send_raw(frames)
        bad = [b"", (40).to_bytes(8, "big"), b"\xc1 not msgpack"]
        engines[3].send_raw(bad)
        sent[3].append(bad)
        serve_replays_until(replay, live.ended.is_set, timeout=30)

    try:
        sources = [
            e.endpoint if label is None else f"{label}={e.endpoint}"
            for e, label in zip(engines, labels, strict=True)
        ]
        run = bridge(
            *sources,
            "--replay-endpoint",
            replay.endpoint,
            "--to",
            nats_server.url,
            "--stream",
            name,
            "--idle-timeout",
            "1.5",
            "--json",
            alongside=engines_publish,
        )
    finally:
        replay.close()
        for engine in engines:
            engine.close()
    assert run.code == 0, run.err
    # the unlabelled engine is keyed by its address, which every node's bridge would share
    unlabelled = engines[labels.index(None)].endpoint
    warnings = [line for line in run.err.splitlines() if "has no worker label" in line]
    assert len(warnings) == 1 and unlabelled in warnings[0], run.err
    report = report_of(run)
    # engine 0: 40 - 3 dropped live + 2 recovered; the others 40 each, engine 3 one malformed
    assert report["messages"] == 39 + 40 + 40 + 41
    assert report["gap_markers"] == 1 and report["malformed"] == 1
    assert report["delivery"]["acked"] == report["messages"] + 1
    assert report["delivery"]["failed"] == 0 and report["delivery"]["duplicates"] == 0

    messages = stored_messages(nats_server.url, name)
    assert len(messages) == report["messages"] + 1
    by_key: dict[str, list[FleetMessage]] = {}
    for raw in messages:
        partition, token_worker = layout.parse_stored(raw.subject) or (None, None)
        fleet = FleetMessage.parse(raw.headers, raw.data)
        key = token_worker
        assert partition == partition_of(key, 4), raw.subject
        assert raw.headers[MSG_ID] and raw.headers[HEADER_BRIDGE]
        by_key.setdefault(key, []).append(fleet)
    for i, engine in enumerate(engines):
        key = labels[i] or engine.endpoint
        data = [m for m in by_key[key] if m.gap is None]
        # the engine's frames byte for byte, in its order (the recovered ones in their place)
        expected = [f for f in sent[i] if i or int.from_bytes(f[1], "big") != 20]
        assert [m.frames for m in data] == expected
        worker = None if labels[i] is None else json.dumps(int(key) if key.isdigit() else key)
        assert {m.worker for m in data} == {worker}
        assert {m.source for m in data} == {engine.endpoint}
        assert {m.dp_rank for m in data if m.events} == {"0"}  # the payload's dp rank
    recovered = [m for m in by_key["w0"] if m.recovered]
    assert [int.from_bytes(m.frames[1], "big") for m in recovered] == [10, 11]
    gaps = [m for m in by_key["w0"] if m.gap is not None]
    assert [(g.gap["from_seq"], g.gap["to_seq"]) for g in gaps] == [(20, 20)]
    assert gaps[0].gap["publisher"] == engines[0].endpoint and gaps[0].frames == []
    malformed = by_key[engines[3].endpoint][-1]
    assert malformed.frames == sent[3][-1] and malformed.events == 0
    assert {m.events for m in by_key["w1"]} == {1}


def test_the_same_messages_bridged_twice_are_stored_once(nats_server: NatsServer) -> None:
    """A bridge restarted over input it already published (an engine's replay socket sends it
    again, here a second engine the same bytes): the server drops every repeat by its
    Nats-Msg-Id."""
    name = stream_name()
    init_stream(nats_server.url, name)
    runs = []
    frames: list[list[bytes]] = []
    for _ in range(2):
        engine = Engine(f"tcp://127.0.0.1:{free_port()}")
        frames = [engine.batch([stored([n, n + 1]), removed([n])]) for n in range(60)]

        def send(live: Live, engine: Engine = engine, frames: list = frames) -> None:
            engine.wait_for()
            for message in frames:
                engine.send_raw(message)

        try:
            runs.append(
                bridge(
                    f"w={engine.endpoint}",
                    "--to",
                    nats_server.url,
                    "--stream",
                    name,
                    "--idle-timeout",
                    "1",
                    "--json",
                    alongside=send,
                )
            )
        finally:
            engine.close()
    assert all(r.code == 0 for r in runs), [r.err for r in runs]
    first, second = (report_of(r)["delivery"] for r in runs)
    assert (first["acked"], first["duplicates"]) == (60, 0)
    assert (second["acked"], second["duplicates"]) == (0, 60)
    messages = stored_messages(nats_server.url, name)
    assert [FleetMessage.parse(m.headers, m.data).frames for m in messages] == frames


def test_a_missing_stream_is_one_line_naming_stream_init(nats_server: NatsServer) -> None:
    run = bridge(
        "tcp://127.0.0.1:1", "--to", nats_server.url, "--stream", "nosuch", "--idle-timeout", "1"
    )
    assert run.code == 1
    assert run.err.count("\n") == 1 and "no stream nosuch" in run.err
    assert "kvctl stream init" in run.err and "Traceback" not in run.err


def test_a_plain_stream_is_not_taken_for_a_fleet_stream(nats_server: NatsServer) -> None:
    publish(nats_server.url, [("plain.subject", b"x")], stream="kvctl-bridge-plain")
    run = bridge(
        "tcp://127.0.0.1:1",
        "--to",
        nats_server.url,
        "--stream",
        "kvctl-bridge-plain",
        "--idle-timeout",
        "1",
    )
    assert run.code == 1 and "is not a kvctl fleet stream" in run.err


@pytest.mark.parametrize(
    "extra",
    [["--format", "vllm"], ["--type", "BlockStored"], ["--worker", "w0"], ["--keep-seq"]],
)
def test_options_that_change_messages_are_refused_with_stream(extra: list[str]) -> None:
    run = bridge("tcp://127.0.0.1:1", "--to", "nats://127.0.0.1:1", "--stream", "fleet", *extra)
    assert run.code == 2 and extra[0] in run.err and run.err.count("\n") == 1


def test_a_server_that_never_comes_back_is_bounded_counted_and_fails(tmp_path) -> None:
    """The stream's only server dies mid-stream and stays away: the bridge retries for
    --publish-timeout, then counts what was not stored, says so in one line, exits 1."""
    server = NatsServer(tmp_path / "store")
    name = stream_name()
    init_stream(server.url, name, partitions=2)
    engine = Engine(f"tcp://127.0.0.1:{free_port()}")

    def send(live: Live) -> None:
        engine.wait_for()
        for n in range(30):
            engine.send([stored([n])])
        deadline = time.monotonic() + 10
        while stored_count() < 30:  # the first 30 are in the stream before it dies
            assert time.monotonic() < deadline, "the first 30 messages were not stored"
            time.sleep(0.05)
        server.stop()
        for n in range(30, 50):
            engine.send([stored([n])])

    def stored_count() -> int:
        async def count() -> int:
            nc = await nats.connect(server.url)
            try:
                return (await nc.jetstream().stream_info(name)).state.messages
            finally:
                await nc.close()

        return asyncio.run(asyncio.wait_for(count(), 5))

    started = time.monotonic()
    try:
        run = bridge(
            f"w={engine.endpoint}",
            "--to",
            server.url,
            "--stream",
            name,
            "--publish-timeout",
            "2",
            "--idle-timeout",
            "1",
            "--json",
            alongside=send,
        )
    finally:
        engine.close()
        server.stop()
    took = time.monotonic() - started
    assert run.code == 1, run.err
    delivery = report_of(run)["delivery"]
    assert delivery["acked"] == 30 and delivery["failed"] == 20
    errors = [line for line in run.err.splitlines() if "not published" in line]
    assert len(errors) == 1 and "20 messages not published" in errors[0]
    assert "--publish-timeout" in errors[0] and "Traceback" not in run.err
    assert took < 20


def test_multi_server_urls_fail_over_for_source_and_target(nats_server: NatsServer) -> None:
    """nats://DOWN,nats://UP everywhere a NATS URL is taken: tap reading a subject, bridge
    reading NATS and publishing into a stream."""
    down = f"nats://127.0.0.1:{free_port()}"
    both = f"{down},{nats_server.url}"
    name = stream_name()
    init_stream(both, name, partitions=2)
    subject = f"kvctl.bridge.test.{name}"
    payload = encode_json(router_event({"type": "BlockRemoved", "block_hashes": [5]}, 3, 0))

    def send(live: Live) -> None:
        # with a server up, the source has subscribed before the bridge says what it bridges
        live.wait_for_stderr("kvctl: bridging", 15)
        publish(nats_server.url, [(subject, payload)] * 5)

    run = bridge(
        f"{both}/{subject}",
        "--to",
        both,
        "--stream",
        name,
        "--idle-timeout",
        "2",
        "--json",
        alongside=send,
    )
    assert run.code == 0, run.err
    report = report_of(run)
    assert report["messages"] == 5 and report["delivery"]["acked"] >= 1
    stored_back = stored_messages(nats_server.url, name)
    assert {FleetMessage.parse(m.headers, m.data).frames[0] for m in stored_back} == {payload}

    tap = run_main(
        "tap",
        f"{both}/{subject}",
        "--json",
        "-c",
        "1",
        alongside=lambda live: (
            live.wait_for_stderr("kvctl: reading", 15),
            publish(nats_server.url, [(subject, payload)]),
        ),
        timeout=30,
    )
    assert tap.code == 0, tap.err
    assert json.loads(tap.out.splitlines()[0])["block_hashes"] == [5]


def test_passwords_in_multi_server_urls_are_never_shown() -> None:
    from kvctl.redact import redact_url

    shown = redact_url("nats://u:secret@a:4222,nats://v:other@b:4222/subject")
    assert shown == "nats://u:***@a:4222,nats://v:***@b:4222/subject"


def test_a_leader_killed_mid_stream_is_retried_through(nats_cluster: NatsCluster) -> None:
    """An R3 stream, its leader's node killed with -9 while the bridge publishes: the bridge
    retries through the election, and afterwards every message is in the stream exactly once,
    in each worker's order; the report counts the retries and no failure."""
    name = stream_name()
    init_stream(nats_cluster.url, name, partitions=4, replicas=3)
    engine = Engine(f"tcp://127.0.0.1:{free_port()}")
    total = 2400
    killed: list[int] = []

    def leader_index() -> int:
        async def ask() -> str:
            nc = await nats.connect(servers=nats_cluster.urls)
            try:
                return (await nc.jetstream().stream_info(name)).cluster.leader
            finally:
                await nc.close()

        return nats_cluster.index_of(asyncio.run(asyncio.wait_for(ask(), 10)))

    def send(live: Live) -> None:
        engine.wait_for()
        started = time.monotonic()
        for n in range(total):
            engine.send([stored([n])], topic=b"", dp_rank=n % 2)
            if n == 400:
                index = leader_index()
                nats_cluster.kill(index)
                killed.append(index)
            # about 200 messages/s: the election happens while messages keep coming
            pause = started + (n + 1) / 200 - time.monotonic()
            if pause > 0:
                time.sleep(pause)

    try:
        run = bridge(
            f"w={engine.endpoint}",
            "--to",
            nats_cluster.url,
            "--stream",
            name,
            "--idle-timeout",
            "3",
            "--json",
            alongside=send,
            timeout=80,
        )
    finally:
        engine.close()
        for index in killed:  # the cluster is the module's: the node comes back
            nats_cluster.restart(index)
    assert killed, "the leader was not killed"
    assert run.code == 0, run.err
    report = report_of(run)
    delivery = report["delivery"]
    print(
        f"\nleader killed: {delivery['retried']} publishes retried, outages "
        f"{delivery['outages']} ({delivery['outage_s']} s, longest "
        f"{delivery['longest_outage_s']} s), duplicates {delivery['duplicates']}, "
        f"reordered {delivery['reordered']}"
    )
    assert delivery["failed"] == 0 and delivery["retried"] > 0
    # a publish unanswered in the election may have been stored after all: its retry is
    # acked as a duplicate, dropped by the server
    assert delivery["acked"] + delivery["duplicates"] == total
    messages = stored_messages(nats_cluster.url, name)
    assert len(messages) == delivery["acked"]
    seqs = [
        int.from_bytes(FleetMessage.parse(m.headers, m.data).frames[1], "big") for m in messages
    ]
    assert sorted(seqs) == list(range(total))  # every message exactly once
    if delivery["reordered"] == 0:
        assert seqs == list(range(total))  # in the worker's order


class _Kept:
    """A stand-in publisher that keeps what it is given (no server: the envelope alone)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, str]]] = []

    def publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> None:
        self.sent.append((subject, payload, headers))


def test_the_hot_path_headers_are_the_fleet_message_s_own() -> None:
    """StreamSending computes the per-source headers once: they must equal FleetMessage's for
    every message (labels, a password in the source, recovered, malformed)."""
    from kvctl.formats import decode_zmq
    from kvctl.formats.engine_zmq import encode_frames, encode_payload
    from kvctl.publishing import StreamSending, fleet_message

    kept = _Kept()
    sending = StreamSending(kept, StreamLayout("fleet", 4), "host:1")
    payload = encode_payload([stored([1, 2])], 1.5, 3, "vllm")
    batches = [
        decode_zmq(encode_frames(b"kv@pod-a@m", 0, payload), "tcp://h:1", 10, None, None),
        decode_zmq(encode_frames(b"", 1, payload), "nats://u:pw@h:4222", 11, "w 1", 2),
        decode_zmq([b"x", b"y"], "ipc:///tmp/e", 12, 5, None),
    ]
    batches[1].recovered = True
    for batch in batches:
        sending.send(batch)
    for batch, (subject, body, headers) in zip(batches, kept.sent, strict=True):
        expected = fleet_message(batch)
        assert {k: v for k, v in headers.items() if k not in (MSG_ID, HEADER_BRIDGE)} == (
            expected.headers()
        )
        assert body == expected.body() and FleetMessage.parse(headers, body) == expected
        assert "pw" not in subject + json.dumps(headers)
    assert FleetMessage.parse(kept.sent[0][2], kept.sent[0][1]).worker == '"pod-a"'
    assert kept.sent[1][0] == "kvctl.fleet.events.w%201"


def test_gap_markers_are_the_rows_kvctl_record_writes() -> None:
    """A Gap item: one marker per run of seqs neither recovered nor arrived malformed, in the
    partition of the publisher's messages, its publisher as tagged JSON."""
    from kvctl.formats import decode_zmq
    from kvctl.formats.engine_zmq import encode_frames, encode_payload
    from kvctl.pipeline import Gap
    from kvctl.publishing import StreamSending

    kept = _Kept()
    sending = StreamSending(kept, StreamLayout("fleet", 4), "host:1")
    payload = encode_payload([stored([1])], 1.5, 0, "vllm")
    source = "tcp://h:1"
    sending.send(decode_zmq(encode_frames(b"", 0, payload), source, 1, "w", None))
    sending.send(decode_zmq([b"", (3).to_bytes(8, "big"), b"\xc1"], source, 2, "w", None))
    sending.handle(Gap(source, 1, 7, [5]))
    markers = [FleetMessage.parse(h, b) for _, b, h in kept.sent[2:]]
    assert [(m.gap["from_seq"], m.gap["to_seq"]) for m in markers] == [(1, 2), (4, 4), (6, 6)]
    assert {m.gap["publisher"] for m in markers} == {source} and {m.source for m in markers} == {
        source
    }
    assert {s for s, _, _ in kept.sent} == {"kvctl.fleet.events.w"}
    ids = {h[MSG_ID] for _, _, h in kept.sent}
    assert len(ids) == 5  # a marker's id is its own, never a message's


@pytest.mark.parametrize(
    ("argument", "address", "subjects"),
    [
        ("nats://a:4222", "nats://a:4222", []),
        ("nats://a:4222/x.y", "nats://a:4222", ["x.y"]),
        ("nats://a:4222,nats://b:4222", "nats://a:4222,nats://b:4222", []),
        ("nats://u:p@a:1,tls://b:2/s.*", "nats://u:p@a:1,tls://b:2", ["s.*"]),
    ],
)
def test_a_nats_source_takes_several_servers(
    argument: str, address: str, subjects: list[str]
) -> None:
    from kvctl.pipeline import SourceSpec

    spec = SourceSpec.parse(argument)
    assert (spec.kind, spec.address, spec.subjects) == ("nats", address, subjects)


def test_a_server_list_with_a_foreign_url_is_a_usage_error() -> None:
    from kvctl.errors import UsageError
    from kvctl.pipeline import SourceSpec

    with pytest.raises(UsageError, match="not a NATS URL"):
        SourceSpec.parse("nats://u:secret@a:4222,tcp://b:5557")
    try:
        SourceSpec.parse("nats://u:secret@a:4222,http://u:secret@b")
    except UsageError as exc:
        assert "secret" not in str(exc)


@pytest.mark.parametrize("with_gap", [False, True])
def test_a_recording_through_the_stream_equals_kvctl_record(
    nats_server: NatsServer, tmp_path, with_gap: bool
) -> None:
    """kvctl record and bridge --stream on the same engine: the stream's messages, written by
    RecordingWriter as a recorder of the stream would (decoded again from the frames, labels
    and flags the headers carry; gap markers as Gap rows), make a recording equal row for row
    to kvctl record's, receive times aside (two processes, two clocks)."""
    import pyarrow.parquet as pq
    from conftest import finish, start_kvctl

    from kvctl.formats import decode_zmq
    from kvctl.recording.tagged_json import from_json_value
    from kvctl.recording.writer import RecordingWriter

    name = stream_name()
    init_stream(nats_server.url, name, partitions=2)
    engine = Engine(f"tcp://127.0.0.1:{free_port()}")
    recorded = tmp_path / "record.parquet"
    record = start_kvctl(
        "record", f"w0={engine.endpoint}", "-o", str(recorded), "--idle-timeout", "2"
    )

    def send(live: Live) -> None:
        engine.wait_for(2)  # kvctl record and the bridge
        for n in range(30):
            frames = engine.batch([stored([n, n + 1]), removed([n])] if n % 3 else [])
            if n != 12 or not with_gap:  # dropped: a gap
                engine.send_raw(frames)
        engine.send_raw([b"", (30).to_bytes(8, "big"), b"\xc1"])  # malformed

    try:
        run = bridge(
            f"w0={engine.endpoint}",
            "--to",
            nats_server.url,
            "--stream",
            name,
            "--idle-timeout",
            "2",
            alongside=send,
        )
        rc, _, err = finish(record, timeout=30)
    finally:
        engine.close()
    assert run.code == 0, run.err
    assert rc == 0, err

    through = tmp_path / "through-stream.parquet"
    writer = RecordingWriter(str(through))
    for raw in stored_messages(nats_server.url, name):
        message = FleetMessage.parse(raw.headers, raw.data)
        if message.gap is not None:
            gap = message.gap
            writer.write_gap(
                from_json_value(gap["publisher"]),
                gap["from_seq"],
                gap["to_seq"],
                recv_ns=message.recv_ns,
                source=message.source,
            )
            continue
        label = None if message.worker is None else from_json_value(json.loads(message.worker))
        dp = None if message.dp_rank is None else from_json_value(json.loads(message.dp_rank))
        batch = decode_zmq(message.frames, message.source, message.recv_ns, label, dp)
        batch.recovered = message.recovered
        assert len(batch.events) == message.events
        writer.write_message(batch)
    writer.close()
    ours, theirs = pq.read_table(through), pq.read_table(recorded)
    assert ours.num_rows == theirs.num_rows > 30
    columns = [c for c in theirs.column_names if c != "recv_ns"]
    diffs = [
        (i, {k: (a[k], b[k]) for k in a if a[k] != b[k]})
        for i, (a, b) in enumerate(
            zip(ours.select(columns).to_pylist(), theirs.select(columns).to_pylist(), strict=True)
        )
        if a != b
    ]
    assert not diffs, diffs
