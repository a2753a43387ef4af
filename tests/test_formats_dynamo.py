"""Dynamo router-side formats: JSON RouterEvents of every era, the >= 1.0 msgpack envelope and
the ZMQ event plane; tokens_hash."""

from __future__ import annotations

import contextlib
import json

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.events import MAX_DEPTH
from kvctl.formats import decode_nats, decode_zmq
from kvctl.formats.dynamo import (
    encode_envelope,
    encode_event_plane,
    encode_json,
    router_event,
    tokens_hash,
)


def test_tokens_hash_known_vector_and_lora_seed():
    assert tokens_hash([0, 1, 2, 3]) == 9143094415614847814
    seed = (1337 + xxhash.xxh3_64_intdigest(b"my-lora", seed=0)) % 2**64
    expected = xxhash.xxh3_64_intdigest(
        b"".join(t.to_bytes(4, "little") for t in range(4)), seed=seed
    )
    assert tokens_hash([0, 1, 2, 3], "my-lora") == expected != 9143094415614847814


STORED_05 = {
    "worker_id": 7,
    "event": {
        "event_id": 3,
        "data": {
            "stored": {
                "parent_hash": None,
                "blocks": [
                    {"block_hash": 11, "tokens_hash": 21},
                    {"block_hash": 12, "tokens_hash": 22},
                ],
            }
        },
    },
}
REMOVED_06 = {
    "worker_id": 7,
    "event": {"event_id": 4, "data": {"removed": {"block_hashes": [11]}}, "dp_rank": 1},
}
CLEARED_09 = {"worker_id": 8, "event": {"event_id": 5, "data": "cleared", "dp_rank": 0}}


def test_json_router_events_of_each_era():
    stored = decode_nats(
        "namespace.ns.component.c.kv_events", json.dumps(STORED_05).encode(), "nats://x"
    )
    assert stored.error is None and stored.format == "dynamo-json"
    assert stored.worker_id == 7
    ev = stored.events[0]
    assert ev["type"] == "BlockStored" and ev["block_hashes"] == [11, 12]
    assert ev["tokens_hashes"] == [21, 22] and ev["parent_block_hash"] is None
    assert (ev["event_id"], ev["worker_id"], ev["dp_rank"]) == (3, 7, None)
    removed = decode_nats("ns-kv-events.queue", json.dumps(REMOVED_06).encode(), "nats://x")
    assert removed.events[0] | {} == {
        "type": "BlockRemoved",
        "block_hashes": [11],
        "medium": None,
        "event_id": 4,
        "worker_id": 7,
        "dp_rank": 1,
    }
    cleared = decode_nats("s.kv-events", json.dumps(CLEARED_09).encode(), "nats://x")
    assert cleared.events[0]["type"] == "AllBlocksCleared" and cleared.worker_id == 8


def test_envelope_with_newer_fields_keeps_everything():
    rev = {
        "worker_id": 2**64 - 1,
        "storage_tier": "host_pinned",
        "residency_domain": "worker",
        "event": {
            "event_id": 9,
            "dp_rank": 0,
            "data": {
                "stored": {
                    "parent_hash": 5,
                    "start_position": 32,
                    "blocks": [{"block_hash": 2**63, "tokens_hash": 1, "mm_extra_info": {"k": 1}}],
                }
            },
            "future_field": "x",
        },
    }
    env = msgpack.packb(
        {
            "publisher_id": 42,
            "sequence": 17,
            "published_at": 1_700_000_000_123,
            "topic": "kv-events",
            "payload": msgpack.packb([rev, CLEARED_09]),
        }
    )
    batch = decode_nats("namespace.ns.component.c.endpoint.e.kv-events", env, "nats://x")
    assert batch.error is None and batch.format == "dynamo-msgpack"
    assert (batch.seq, batch.ts) == (17, 1_700_000_000.123)
    assert batch.publisher == ("nats://x", 42)
    ev, cleared = batch.events
    assert ev["block_hashes"] == [2**63] and ev["parent_block_hash"] == 5
    assert ev["storage_tier"] == "host_pinned" and ev["residency_domain"] == "worker"
    assert ev["start_position"] == 32 and ev["mm_extra_info"] == [{"k": 1}]
    assert ev["future_field"] == "x" and ev["worker_id"] == 2**64 - 1
    assert cleared["worker_id"] == 8


def test_event_plane_four_frames():
    env = encode_envelope([router_event({"type": "AllBlocksCleared"}, 1, 0)], 42, 5, 1000)
    frames = encode_event_plane(env, 42, 5)
    assert frames[3][:1] == b"\x01" and int.from_bytes(frames[3][1:5], "big") == len(env)
    batch = decode_zmq(frames, "tcp://x")
    assert batch.error is None and batch.format == "dynamo-zmq"
    assert batch.seq == 5 and batch.publisher == ("tcp://x", 42)
    bad = decode_zmq([*frames[:3], b"\x02" + frames[3][1:]], "tcp://x")
    assert "version" in bad.error
    short = decode_zmq([*frames[:3], frames[3][:-1]], "tcp://x")
    assert "says" in short.error


@pytest.mark.parametrize(
    "data",
    [
        b"{",
        b"{}",
        b'{"event": {"data": 5}}',
        b"\x85\xa1a",
        msgpack.packb({"payload": "not bin"}),
        b"\x00\x01",
        b"",
    ],
)
def test_bad_nats_payloads_are_error_batches(data):
    batch = decode_nats("s", data, "nats://x")
    assert batch.error and batch.events == [] and batch.frames == [data]


u64 = st.integers(0, 2**64 - 1)


@st.composite
def canonical(draw):
    kind = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    if kind == "BlockStored":
        n = draw(st.integers(1, 3))
        return {
            "type": kind,
            "block_hashes": draw(st.lists(u64, min_size=n, max_size=n)),
            "parent_block_hash": draw(st.none() | u64),
            "block_size": 4,
            "token_ids": draw(st.lists(st.integers(0, 2**32 - 1), min_size=4 * n, max_size=4 * n)),
        }
    if kind == "BlockRemoved":
        return {"type": kind, "block_hashes": draw(st.lists(u64, min_size=1, max_size=3))}
    return {"type": kind}


def _check(event, decoded, worker):
    assert decoded["type"] == event["type"] and decoded["worker_id"] == worker
    if event["type"] != "AllBlocksCleared":
        assert decoded["block_hashes"] == event["block_hashes"]
    if event["type"] == "BlockStored":
        assert decoded["parent_block_hash"] == event["parent_block_hash"]
        toks = event["token_ids"]
        assert decoded["tokens_hashes"] == [
            tokens_hash(toks[i : i + 4]) for i in range(0, len(toks), 4)
        ]


@settings(max_examples=100, deadline=None)
@given(st.lists(canonical(), min_size=1, max_size=5), u64)
def test_json_and_envelope_round_trip(events, worker):
    rmaps = [router_event(e, worker, i) for i, e in enumerate(events)]
    for i, (event, rmap) in enumerate(zip(events, rmaps, strict=True)):
        batch = decode_nats("s.kv-events", encode_json(rmap), "nats://x")
        assert batch.error is None
        _check(event, batch.events[0], worker)
        assert batch.events[0]["event_id"] == i
    env = decode_nats("s", encode_envelope(rmaps, 1, 2, 3), "nats://x")
    assert env.error is None and len(env.events) == len(events)
    for event, decoded in zip(events, env.events, strict=True):
        _check(event, decoded, worker)


# A real NATS message published by ai-dynamo-runtime 1.6.1's KvEventPublisher
# (publish_removed([333]) from worker 42), captured with a plain nats-py subscriber.
DYNAMO_1_6_REMOVED = bytes.fromhex(
    "85ac7075626c69736865725f6964cf0007ed1ffe670df4a873657175656e636502ac7075626c69736865645f"
    "6174cf000001a22b1db7d0a5746f706963a96b762d6576656e7473a77061796c6f6164c4739184a9776f726b"
    "65725f69642aac73746f726167655f74696572a6646576696365b07265736964656e63795f646f6d61696ea6"
    "776f726b6572a56576656e7483a86576656e745f696403a46461746181a772656d6f76656481ac626c6f636b"
    "5f68617368657391cd014da764705f72616e6b00"
)


def test_real_dynamo_1_6_capture():
    batch = decode_nats(
        "namespace.kvctl.component.worker.endpoint.generate.kv-events",
        DYNAMO_1_6_REMOVED,
        "nats://x",
    )
    assert batch.error is None and batch.format == "dynamo-msgpack"
    assert batch.seq == 2 and batch.publisher == ("nats://x", 0x0007ED1FFE670DF4)
    assert batch.events == [
        {
            "type": "BlockRemoved",
            "block_hashes": [333],
            "medium": None,
            "event_id": 3,
            "worker_id": 42,
            "dp_rank": 0,
            "storage_tier": "device",
            "residency_domain": "worker",
        }
    ]
    # our encoder produces the same RouterEvent structure
    ours = router_event({"type": "BlockRemoved", "block_hashes": [333]}, 42, 3)
    assert msgpack.unpackb(msgpack.unpackb(DYNAMO_1_6_REMOVED)["payload"]) == [ours]


# Dynamo's ZMQ event plane behind the broker (DYN_ZMQ_BROKER_URL): the topic frame is the full
# subject, not "kv-events" (EventPublisher hands ZmqPubTransport::connect the subject). Frames
# written out byte for byte: publisher 42, sequence 5, version 1, length 240, envelope.
BROKER_SUBJECT = b"namespace.dynamo.component.backend.endpoint.generate.kv-events"
ENVELOPE_HEX = (
    "85ac7075626c69736865725f69642aa873657175656e636505ac7075626c69736865645f6174cf0000018bcf"
    "e5687ba5746f706963a96b762d6576656e7473a77061796c6f6164c4a79183a9776f726b65725f696407ac73"
    "746f726167655f74696572a6646576696365a56576656e7483a86576656e745f696403a46461746181a67374"
    "6f72656483ab706172656e745f68617368c0ae73746172745f706f736974696f6ec0a6626c6f636b739183aa"
    "626c6f636b5f68617368cf8000000000000001ab746f6b656e735f68617368cf7ee2cbedc694ab46ad6d6d5f"
    "65787472615f696e666fc0a764705f72616e6b00"
)
BROKER_FRAMES = [
    BROKER_SUBJECT,
    bytes.fromhex("000000000000002a"),
    bytes.fromhex("0000000000000005"),
    bytes.fromhex("01000000f0") + bytes.fromhex(ENVELOPE_HEX),
]


@pytest.mark.parametrize("topic", [BROKER_SUBJECT, b"kv-events", b"", b"anything else"])
def test_event_plane_is_recognised_by_its_frames_whatever_the_topic(topic):
    batch = decode_zmq([topic, *BROKER_FRAMES[1:]], "tcp://broker:5556")
    assert batch.error is None, batch.error
    assert batch.format == "dynamo-zmq" and batch.topic == topic.decode()
    assert (batch.seq, batch.publisher, batch.ts) == (
        5,
        ("tcp://broker:5556", 42),
        1_700_000_000.123,
    )
    (event,) = batch.events
    assert event["block_hashes"] == [2**63 + 1] and event["tokens_hashes"] == [
        tokens_hash([0, 1, 2, 3])
    ]
    assert batch.worker_id == 7 and batch.frames == [topic, *BROKER_FRAMES[1:]]


def test_encoder_writes_the_golden_broker_frames():
    env = bytes.fromhex(ENVELOPE_HEX)
    assert encode_event_plane(env, 42, 5, BROKER_SUBJECT) == BROKER_FRAMES


@pytest.mark.parametrize(
    "frames,why",
    [
        ([BROKER_SUBJECT, b"\x00" * 7, b"\x00" * 8, BROKER_FRAMES[3]], "7 and 8 bytes"),
        ([BROKER_SUBJECT, b"\x00" * 8, b"\x00" * 9, BROKER_FRAMES[3]], "8 and 9 bytes"),
        ([BROKER_SUBJECT, *BROKER_FRAMES[1:3], b"\x02" + BROKER_FRAMES[3][1:]], "version"),
        ([BROKER_SUBJECT, *BROKER_FRAMES[1:3], BROKER_FRAMES[3] + b"\x00"], "says 240 bytes"),
    ],
)
def test_four_frames_that_are_not_the_event_plane_are_malformed(frames, why):
    batch = decode_zmq(frames, "tcp://x")
    assert batch.error is not None and why in batch.error, batch.error
    assert batch.topic == BROKER_SUBJECT.decode() and batch.frames == frames


def _router(block_hash=11, parent=None, tokens_hash=21, **stored_extra):
    return {
        "worker_id": 7,
        "event": {
            "event_id": 1,
            "dp_rank": 0,
            "data": {
                "stored": {
                    "parent_hash": parent,
                    "blocks": [{"block_hash": block_hash, "tokens_hash": tokens_hash}],
                    **stored_extra,
                }
            },
        },
    }


@pytest.mark.parametrize(
    "router,why",
    [
        (_router(block_hash="11"), "block_hashes holds a str, expected int or bytes"),
        (_router(block_hash=1.5), "block_hashes holds a float"),
        (_router(parent=2.0), "parent_block_hash is a float, expected int, bytes or nil"),
        (_router(parent={"h": 1}), "parent_block_hash is a map"),
        (_router(tokens_hash="21"), "tokens_hashes holds a str, expected int"),
        (_router(lora_name=5), "lora_name is an int, expected a string or nil"),
        (
            {
                "worker_id": 7,
                "event": {"event_id": 1, "data": {"removed": {"block_hashes": [1, [2]]}}},
            },
            "(BlockRemoved): block_hashes holds an array",
        ),
    ],
)
def test_router_events_with_types_dynamo_never_sends_are_malformed(router, why):
    env = encode_envelope([CLEARED_09, router], 42, 0, 0)
    for batch in (
        decode_nats("s", env, "nats://x"),
        decode_zmq(encode_event_plane(env, 42, 0), "tcp://x"),
        decode_nats("s", json.dumps(router).encode(), "nats://x"),
    ):
        assert batch.error is not None and why in batch.error, batch.error
        assert batch.events == []
    assert "event 1 (" in decode_nats("s", env, "nats://x").error  # which event, too


wrong_scalars = st.one_of(
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(0, 2**64 - 1), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 9), max_size=2),
)


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(["block_hash", "parent_hash", "tokens_hash"]), value=wrong_scalars)
def test_any_wrong_typed_router_hash_is_malformed_never_a_crash(field, value):
    if isinstance(value, bytes) and field != "tokens_hash":
        value = 1.5  # bytes block hashes are valid (vLLM sends them): not a wrong type
    router = _router(**{field: value})
    batches = [decode_zmq(encode_event_plane(encode_envelope([router], 1, 0, 0), 1, 0), "t")]
    with contextlib.suppress(TypeError):  # bytes have no JSON form
        batches.append(decode_nats("s", json.dumps(router).encode(), "nats://x"))
    for batch in batches:
        assert batch.error is not None and batch.events == [], batch.error


# --- the depth bound: every Dynamo form, the same bound as the recording ----------------------

STORED = {
    "type": "BlockStored",
    "block_hashes": [7, 8],
    "token_ids": list(range(8)),
    "block_size": 4,
}
VALUE_LEVELS = MAX_DEPTH - 3  # the batch, its events array and the event sit above a value


def _nested(levels: int) -> list:
    value: list = [1]
    for _ in range(levels - 1):
        value = [value]
    return value


def _as_each_form(router: dict) -> dict:
    envelope = encode_envelope([router], 42, 0, 1_700_000_000_000)
    return {
        "json": decode_nats("a.kv-events", encode_json(router), "nats://x"),
        "envelope": decode_nats("a.kv-events", envelope, "nats://x"),
        "event plane": decode_zmq(encode_event_plane(envelope, 42, 0), "tcp://x"),
    }


@pytest.mark.parametrize("where", ["RouterEvent", "event", "stored", "block"])
def test_a_value_nested_to_the_bound_is_valid_in_every_form_and_one_more_is_not(where):
    from kvctl.recording.rows import batches_to_record_batch
    from kvctl.recording.schema import MALFORMED

    def router_with(levels: int) -> dict:
        router = router_event(STORED, 3, 0)
        place = {
            "RouterEvent": router,
            "event": router["event"],
            "stored": router["event"]["data"]["stored"],
            "block": router["event"]["data"]["stored"]["blocks"][0],
        }[where]
        # a block's extra field becomes a per-block array on the event: one level more
        place["x"] = _nested(levels - 1 if where == "block" else levels)
        return router

    for form, batch in _as_each_form(router_with(VALUE_LEVELS)).items():
        assert batch.error is None, (form, batch.error)
        assert MALFORMED not in batches_to_record_batch([batch]).to_pydict()["type"]
    for form, batch in _as_each_form(router_with(VALUE_LEVELS + 1)).items():
        field = "'block_x'" if where == "block" else "'x'"
        assert batch.error is not None, form
        assert f"field {field} nests deeper than {MAX_DEPTH} levels" in batch.error, batch.error
        assert batch.events == []


def test_an_envelope_with_an_unhashable_publisher_id_is_malformed_not_a_crash():
    good = msgpack.unpackb(encode_envelope([router_event(STORED, 3, 0)], 42, 5, 0))
    for publisher_id in ([1, 2], {"a": 1}):
        data = msgpack.packb({**good, "publisher_id": publisher_id})
        batch = decode_nats("a.kv-events", data, "nats://x")
        assert batch.error is not None and "publisher_id" in batch.error
        assert batch.frames == [data] and batch.seq is None
        assert hash(batch.publisher)


@pytest.mark.parametrize(
    "where, key",
    [
        ("RouterEvent", "type"),
        ("event", "type"),
        ("stored", "block_hashes"),
        ("event", "worker_id"),
        ("RouterEvent", "dp_rank"),
        ("stored", "block_x"),
    ],
)
def test_a_field_that_would_replace_a_derived_one_is_malformed(where, key):
    # {"type": "Gap"} on a RouterEvent must not turn a stored event into kvctl's own row type,
    # nor a stored "block_x" receive the blocks' "x" values
    router = router_event(STORED, 3, 0)
    router["event"]["data"]["stored"]["blocks"][0]["x"] = 1
    place = {
        "RouterEvent": router,
        "event": router["event"],
        "stored": router["event"]["data"]["stored"],
    }[where]
    place[key] = "Gap"
    for form, batch in _as_each_form(router).items():
        assert batch.error is not None and "collides" in batch.error, (form, batch.error)
        assert batch.events == []


def test_block_fields_keep_the_order_they_were_sent_in():
    router = router_event(STORED, 3, 0)
    for i, block in enumerate(router["event"]["data"]["stored"]["blocks"]):
        block.update({"zeta": i, "alpha": -i})
    event = decode_nats("a.kv-events", encode_json(router), "nats://x").events[0]
    assert event["block_zeta"] == [0, 1] and event["block_alpha"] == [0, -1]
    keys = list(event)
    assert keys.index("block_zeta") < keys.index("block_alpha")
