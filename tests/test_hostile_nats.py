"""Hostile NATS messages: whatever arrives on a Dynamo subject, every consumer goes on.

Fuzzed like the ZMQ path (tests/test_formats_engine.py): ``decode_nats`` on every subject
family never raises, returns either a valid batch or an error batch with its raw bytes, and its
publisher key is hashable; sequence tracking, cache state and stats take every such batch.
Then the command line against a real nats-server: hostile messages interleaved with valid ones,
through ``tap``, ``record`` (then ``cat`` and ``check`` of the recording) and live ``check``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgpack
import pytest
from conftest import publish
from hypothesis import given, settings
from hypothesis import strategies as st
from inprocess import Live, run_main
from test_formats_engine import assert_printable_and_recordable

from kvctl.events import MAX_DEPTH
from kvctl.formats import decode_nats, decode_zmq
from kvctl.formats.dynamo import encode_envelope, encode_event_plane, encode_json, router_event
from kvctl.recording.rebuild import record_batch_to_batches
from kvctl.recording.rows import batches_to_record_batch
from kvctl.sequence import SequenceTracker
from kvctl.stats import StatsCollector

SUBJECTS = [
    "namespace.dyn.component.backend.kv_events",  # <= 0.5
    "namespace.dyn.component.backend.kv-events",  # 0.7-0.9 local indexer, 1.0-1.1
    "namespace.dyn.component.backend.endpoint.generate.kv-events",  # 1.2-1.6
    "namespace-dyn-component-backend-kv-events.kv-events",  # 0.7-0.9 JetStream
    "namespace-dyn-component-backend-kv-events.queue",  # 0.6 JetStream
]
ENVELOPE_SUBJECT = SUBJECTS[2]

STORED = {
    "type": "BlockStored",
    "block_hashes": [2**64 - 2, 5],
    "parent_block_hash": None,
    "token_ids": list(range(8)),
    "block_size": 4,
}


def nested(levels: int) -> list:
    """``levels`` arrays, one inside the other."""
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def envelope_with(**header) -> bytes:
    env = {
        "publisher_id": 99,
        "sequence": 0,
        "published_at": 1_700_000_000_000,
        "payload": msgpack.packb([router_event(STORED, 3, 0)]),
    }
    env.update(header)
    return msgpack.packb(env)


# --- every batch decode_nats gives, whatever came in, is usable by every consumer ------------


def assert_consumable(batch, data: bytes) -> None:
    assert batch.frames == [data]
    assert (batch.error is None) != (batch.error is not None and batch.events == [])
    hash(batch.publisher)  # sequence tracking keys on it
    Counter(ev["type"] for ev in batch.events)  # the summary counts events by type
    assert all(type(ev["type"]) is str for ev in batch.events)
    tracker = SequenceTracker()
    tracker.observe(batch)
    tracker.observe(batch)  # a second time: the duplicate path
    stats = StatsCollector()
    stats.feed(batch)
    stats.result()
    assert_printable_and_recordable(batch)
    back = record_batch_to_batches(batches_to_record_batch([batch]))
    assert repr(back) == repr([batch])  # read back as it came (repr: NaN != NaN)


deep_values = st.integers(MAX_DEPTH - 6, 300).map(nested)
"""Values around the depth bound and far beyond it."""

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | deep_values,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "worker_id",
                    "event",
                    "data",
                    "stored",
                    "removed",
                    "blocks",
                    "block_hash",
                    "tokens_hash",
                    "block_hashes",
                    "event_id",
                    "dp_rank",
                    "parent_hash",
                    "cleared",
                    "x",
                ]
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6))
    | deep_values,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "worker_id",
                    "event",
                    "data",
                    "stored",
                    "removed",
                    "blocks",
                    "block_hash",
                    "block_hashes",
                    "event_id",
                    "dp_rank",
                    "x",
                ]
            )
            | st.binary(max_size=3),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)


ROUTER_EVENTS = [
    router_event(STORED, 3, 0),
    router_event({"type": "BlockRemoved", "block_hashes": [5]}, 3, 1),
    router_event({"type": "AllBlocksCleared"}, 3, 2),
]


@st.composite
def doctored_router_events(draw, values) -> list:
    """Real RouterEvents with one part replaced by or added as any value: on the RouterEvent,
    its ``event``, the stored/removed body or a stored block."""
    chosen = draw(st.lists(st.sampled_from(range(len(ROUTER_EVENTS))), min_size=1, max_size=3))
    events = [json.loads(json.dumps(ROUTER_EVENTS[i])) for i in chosen]
    target = events[draw(st.integers(0, len(events) - 1))]
    places = [target, target["event"]]
    data = target["event"]["data"]
    if isinstance(data, dict):
        body = next(iter(data.values()))
        places.append(body)
        places += body.get("blocks", [])
    place = draw(st.sampled_from(places))
    # its own keys, a new one, or a name kvctl derives (which must not replace the derived one)
    key = draw(
        st.sampled_from([*place.keys(), "x", "type", "block_hashes", "worker_id", "block_x"])
    )
    place[key] = draw(values)
    return events


@st.composite
def hostile_envelopes(draw) -> bytes:
    """Dynamo envelopes with any header value and any payload: bytes, msgpack of anything, or
    RouterEvents real or doctored."""
    header = {"publisher_id": 7, "sequence": 1, "published_at": 1_700_000_000_000}
    for key in draw(st.lists(st.sampled_from([*header, "topic"]), unique=True)):
        header[key] = draw(msgpack_values)
    payload = draw(
        st.binary(max_size=16)
        | st.builds(msgpack.packb, msgpack_values)
        | st.just(msgpack.packb(ROUTER_EVENTS))
        | st.builds(msgpack.packb, doctored_router_events(msgpack_values))
    )
    return msgpack.packb({**header, "payload": payload})


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SUBJECTS), st.binary(max_size=64))
def test_any_bytes_on_any_subject(subject, data):
    assert_consumable(decode_nats(subject, data, "nats://x"), data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SUBJECTS), json_values)
def test_any_json_on_any_subject(subject, value):
    data = json.dumps(value).encode()
    assert_consumable(decode_nats(subject, data, "nats://x"), data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SUBJECTS), doctored_router_events(json_values))
def test_any_doctored_json_router_event_on_any_subject(subject, events):
    data = json.dumps(events if len(events) > 1 else events[0]).encode()
    assert_consumable(decode_nats(subject, data, "nats://x"), data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SUBJECTS), msgpack_values)
def test_any_msgpack_on_any_subject(subject, value):
    data = msgpack.packb(value)
    assert_consumable(decode_nats(subject, data, "nats://x"), data)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SUBJECTS), hostile_envelopes())
def test_any_envelope_on_any_subject(subject, data):
    assert_consumable(decode_nats(subject, data, "nats://x"), data)


@settings(max_examples=200, deadline=None)
@given(hostile_envelopes(), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_any_envelope_on_the_zmq_event_plane(envelope, publisher_id, sequence):
    # Dynamo >= 1.0 without NATS: the same envelopes in 4 ZMQ frames
    frames = encode_event_plane(envelope, publisher_id, sequence)
    batch = decode_zmq(frames, "tcp://x")
    assert batch.frames == frames
    assert (batch.error is None) != (batch.error is not None and batch.events == [])
    hash(batch.publisher)
    SequenceTracker().observe(batch)
    assert_printable_and_recordable(batch)


@pytest.mark.parametrize(
    "data, why",
    [
        (b"[" * 5000, f"JSON nests deeper than {MAX_DEPTH} levels"),
        (b"\x91" * 5000 + b"\xc0", f"msgpack nests deeper than {MAX_DEPTH} levels"),
        (
            b"\x81\xa1x" + b"\x91" * 5000 + b"\xc0",
            f"envelope: msgpack nests deeper than {MAX_DEPTH} levels",
        ),
        (envelope_with(publisher_id=[1]), "envelope publisher_id is an array, expected int"),
        (envelope_with(publisher_id={"a": 1}), "envelope publisher_id is a map, expected int"),
        (envelope_with(sequence="7"), "envelope sequence is a str, expected int"),
        (envelope_with(publisher_id=b"\x01"), "envelope publisher_id is bytes, expected int"),
        (envelope_with(published_at=[1]), "envelope published_at is an array, expected number"),
        (envelope_with(published_at=1e22), "envelope published_at 1e+22 is not a time"),
        (envelope_with(published_at=float("nan")), "envelope published_at nan is not a time"),
        (
            encode_json({**router_event(STORED, 1, 0), "x": nested(500)}),
            f"field 'x' nests deeper than {MAX_DEPTH} levels",
        ),
        (encode_json(router_event(STORED, [1], 0)), "worker_id is an array, expected int or nil"),
        (
            encode_json({"worker_id": 1, "event": {"event_id": {}, "data": "cleared"}}),
            "event_id is a map, expected int or nil",
        ),
        (
            envelope_with(
                payload=msgpack.packb(
                    [
                        {
                            "worker_id": 1,
                            "event": {"data": {"stored": {"blocks": [{"block_hash": 1, b"k": 2}]}}},
                        }
                    ]
                )
            ),
            "stored block has a bytes key",
        ),
    ],
)
def test_hostile_messages_are_malformed_and_named(data, why):
    batch = decode_nats(ENVELOPE_SUBJECT, data, "nats://x")
    assert batch.error is not None and why in batch.error, batch.error
    assert len(batch.error) < 200
    assert_consumable(batch, data)


# --- the command line against a real nats-server ----------------------------------------------


HOSTILE = [
    b"[" * 5000,
    envelope_with(publisher_id=[1, 2]),
    envelope_with(publisher_id={"a": 1}),
    encode_json({**router_event(STORED, 1, 0), "x": nested(500)}),  # ~1 KB, 500 levels
    encode_envelope([{**router_event(STORED, 3, 1), "x": nested(MAX_DEPTH)}], 8, 0, 0),
    b"\x91" * 5000 + b"\xc0",
]


def valid_messages() -> list[bytes]:
    """Six valid messages of seven events, in order (publisher 7: seq 0, 1, 2)."""
    edge = nested(MAX_DEPTH - 3)  # the deepest value a field may hold: valid everywhere
    return [
        encode_envelope([router_event(STORED, 3, 0)], 7, 0, 1_700_000_000_000),
        encode_json(router_event({"type": "BlockRemoved", "block_hashes": [5]}, 1, 1)),
        encode_envelope(
            [
                router_event(STORED, 3, 2),
                router_event({"type": "BlockRemoved", "block_hashes": [5]}, 3, 3),
            ],
            7,
            1,
            1_700_000_000_001,
        ),
        encode_json({**router_event(STORED, 1, 2), "edge": edge}),
        encode_envelope(
            [router_event({"type": "AllBlocksCleared"}, 3, 4)], 7, 2, 1_700_000_000_002
        ),
        encode_json(router_event(STORED, 1, 3)),
    ]


VALID_EVENTS = 7


def interleaved() -> list[tuple[str, bytes]]:
    valid = valid_messages()
    out = []
    for good, bad in zip(valid, HOSTILE, strict=True):
        out += [(ENVELOPE_SUBJECT, bad), (ENVELOPE_SUBJECT, good)]
    return out


def run_live(*args: str, url: str, ready: str) -> tuple[int, str, str]:
    def publish_when_subscribed(live: Live) -> None:
        line = live.wait_for_stderr("\n").partition("\n")[0]
        assert line.startswith(ready), line
        publish(url, interleaved())

    result = run_main(*args, alongside=publish_when_subscribed)
    return result.code, result.out, result.err


def test_tap_counts_every_hostile_message_and_keeps_every_valid_event(nats_server):
    rc, out, err = run_live(
        "tap",
        nats_server.url,
        "--json",
        "-c",
        str(VALID_EVENTS),
        url=nats_server.url,
        ready="kvctl: reading",
    )
    assert rc == 0, err
    assert "Traceback" not in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == VALID_EVENTS
    assert [r["type"] for r in rows] == [
        "BlockStored",
        "BlockRemoved",
        "BlockStored",
        "BlockRemoved",
        "BlockStored",
        "AllBlocksCleared",
        "BlockStored",
    ]
    assert f"malformed {len(HOSTILE)}" in err
    assert err.count("kvctl: malformed message") == len(HOSTILE)
    assert f"nests deeper than {MAX_DEPTH} levels" in err
    assert "publisher_id is an array" in err and "publisher_id is a map" in err


def test_live_check_reports_each_hostile_message_and_goes_on(nats_server):
    rc, out, err = run_live(
        "check",
        nats_server.url,
        "--json",
        "-c",
        str(VALID_EVENTS),
        url=nats_server.url,
        ready="kvctl: checking",
    )
    assert rc == 3, err  # KV001 findings, nothing else
    assert "Traceback" not in err
    assert f"malformed {len(HOSTILE)}" in err
    assert err.count("KV001") == len(HOSTILE)
    assert f"{VALID_EVENTS} events" in err


def test_record_then_cat_and_check_agree_with_what_arrived(nats_server, tmp_path: Path):
    out_file = tmp_path / "hostile.parquet"
    rc, _, err = run_live(
        "record",
        nats_server.url,
        "-c",
        str(VALID_EVENTS),
        "-o",
        str(out_file),
        url=nats_server.url,
        ready="kvctl: recording",
    )
    assert rc == 0, err
    assert "Traceback" not in err
    assert f"malformed {len(HOSTILE)}" in err and f"{VALID_EVENTS} events" in err

    cat = run_main("cat", str(out_file), "--json")
    assert cat.code == 0, cat.err
    rows = [json.loads(line) for line in cat.out.splitlines()]
    assert len(rows) == VALID_EVENTS
    assert rows[4]["edge"] == nested(MAX_DEPTH - 3)  # the deepest valid value, kept whole
    assert f"malformed {len(HOSTILE)}" in cat.err

    check = run_main("check", str(out_file))
    assert check.code == 3, check.err
    assert f"malformed {len(HOSTILE)}" in check.err
    assert (check.out + check.err).count("KV001") >= 1
    assert "KV301" not in check.out + check.err  # nothing was lost on the way

    stats = run_main("stats", str(out_file), "--json")
    assert stats.code == 0, stats.err
    overall = json.loads(stats.out)["overall"]
    assert overall["malformed"] == len(HOSTILE) and overall["events"] == VALID_EVENTS
