"""The stream state model: hash normalisation, parent links, Dynamo-like removal and clearing."""

from __future__ import annotations

import msgpack

from kvctl.events import Batch
from kvctl.formats import decode_nats, decode_zmq, dynamo, engine_zmq
from kvctl.state import (
    DUPLICATE_STORE,
    INVALID_EVENT,
    PARENT_UNKNOWN,
    REMOVE_UNKNOWN,
    UNKNOWN_TYPE,
    StreamState,
    norm_hash,
    worker_label,
)

SRC = "tcp://engine:5557"
KEY = (SRC, 0)


def stored(hashes, parent=None, size=4, **extra):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(size * len(hashes))),
        "block_size": size,
        "lora_id": None,
        **extra,
    }


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes}


def batch(events, seq=None, ts=None, source=SRC, **kw) -> Batch:
    return Batch(
        source=source, events=events, format="engine-map", seq=seq, ts=ts, publisher=source, **kw
    )


def kinds(anomalies):
    return [a.kind for a in anomalies]


def test_norm_hash_64_bits():
    assert norm_hash(-1) == norm_hash((1 << 64) - 1) == (1 << 64) - 1
    assert norm_hash(5) == 5
    assert norm_hash(b"\x01" * 32) == b"\x01" * 32
    assert norm_hash(bytearray(b"ab")) == b"ab"
    assert norm_hash(1 << 70) == 1 << 70  # kept as sent, never aliased to a 64-bit value
    assert norm_hash([1, 2]) == ("invalid", "[1, 2]")  # unhashable input never raises


def test_chain_lookups_and_occupancy():
    st = StreamState()
    assert st.apply(batch([stored([1, 2]), stored([3], parent=2)], ts=10.0)) == []
    assert st.is_cached(KEY, 3) and not st.is_cached(KEY, 4)
    assert st.parent(KEY, 1) is None
    assert st.parent(KEY, 2) == 1
    assert st.parent(KEY, 3) == 2
    blk = st.block(KEY, 3)
    assert blk is not None and blk.block_size == 4 and blk.stored_at == 10.0
    assert st.occupancy() == {KEY: 3}
    assert st.total_blocks == 3
    cache = st.workers[KEY]
    assert (cache.stored_events, cache.stored_blocks, cache.max_blocks) == (2, 3, 3)
    assert worker_label(KEY) == f"{SRC}[dp0]"


def test_signed_and_unsigned_are_the_same_block():
    st = StreamState()
    st.apply(batch([stored([-2])]))
    assert st.is_cached(KEY, (1 << 64) - 2)
    assert st.apply(batch([stored([7], parent=(1 << 64) - 2), removed([(1 << 64) - 2])])) == []
    assert st.occupancy() == {KEY: 1}


def test_bytes_hashes_are_their_own_keys():
    h = bytes(range(32))
    st = StreamState()
    assert st.apply(batch([stored([h]), stored([b"x" * 32], parent=bytearray(h))])) == []
    assert not st.is_cached(KEY, int.from_bytes(h[-8:], "big"))
    assert st.parent(KEY, b"x" * 32) == h


def test_removal_keeps_descendants_like_dynamo():
    st = StreamState()
    st.apply(batch([stored([1, 2, 3])]))
    assert st.apply(batch([removed([2])])) == []
    assert st.is_cached(KEY, 3) and not st.is_cached(KEY, 2)
    assert st.parent(KEY, 3) == 2  # dangling link: descendants are not dropped
    # a child of the surviving descendant is still accepted
    assert st.apply(batch([stored([4], parent=3)])) == []


def test_anomalies():
    st = StreamState()
    found = st.apply(
        batch(
            [
                removed([9]),  # never stored
                stored([1]),
                stored([1]),  # duplicate
                stored([2], parent=42),  # parent unknown (kept: engine view)
                {"type": "BlockStored", "block_hashes": "nope"},
                {"type": "Frobbed"},
                "not a map",
            ]
        )
    )
    assert kinds(found) == [
        REMOVE_UNKNOWN,
        DUPLICATE_STORE,
        PARENT_UNKNOWN,
        INVALID_EVENT,
        UNKNOWN_TYPE,
        INVALID_EVENT,
    ]
    assert found[0].hash == 9 and found[2].hash == 42
    assert st.is_cached(KEY, 2)


def test_removal_continues_after_unknown_hash():
    st = StreamState()
    st.apply(batch([stored([1, 2])]))
    assert kinds(st.apply(batch([removed([1, 99, 2])]))) == [REMOVE_UNKNOWN]
    assert st.occupancy() == {KEY: 0}


def test_strict_parents_rejects_the_store():
    st = StreamState(strict_parents=True)
    assert kinds(st.apply(batch([stored([5, 6], parent=4)]))) == [PARENT_UNKNOWN]
    assert st.occupancy() == {KEY: 0}


def test_cleared_empties_every_rank_of_the_worker_only():
    st = StreamState()
    st.apply(batch([stored([1])], worker_id="w1", dp_rank=0))
    st.apply(batch([stored([2])], worker_id="w1", dp_rank=1))
    st.apply(batch([stored([3])], worker_id="w2", dp_rank=0))
    st.apply(batch([{"type": "AllBlocksCleared"}], worker_id="w1", dp_rank=1))
    assert st.occupancy() == {("w1", 0): 0, ("w1", 1): 0, ("w2", 0): 1}
    assert st.workers[("w1", 0)].cleared == 1


def test_sources_without_worker_ids_do_not_share_a_cache():
    st = StreamState()
    st.apply(batch([stored([1])], source="a"))
    assert kinds(st.apply(batch([removed([1])], source="b"))) == [REMOVE_UNKNOWN]


def test_per_event_worker_ids_from_dynamo_override_the_batch():
    evs = [
        dynamo.router_event(stored([1, 2]), worker_id=7, event_id=0, dp_rank=0),
        dynamo.router_event(stored([1]), worker_id=8, event_id=0, dp_rank=2),
        dynamo.router_event(removed([2]), worker_id=7, event_id=1, dp_rank=0),
    ]
    data = dynamo.encode_envelope(evs, publisher_id=1, sequence=0, published_at_ms=5000)
    b = decode_nats("namespace.x.component.y.kv-events", data, "nats://x")
    assert b.error is None
    st = StreamState()
    assert st.apply(b) == []
    assert st.occupancy() == {(7, 0): 1, (8, 2): 1}


def test_engine_batches_decoded_from_the_wire():
    ev = [stored([(1 << 63) + 5, 3]), removed([3])]
    for enc in engine_zmq.ENGINE_ENCODINGS:
        payload = engine_zmq.encode_payload(ev, ts=1.5, dp_rank=1, encoding=enc)
        b = decode_zmq(engine_zmq.encode_frames(b"", 0, payload), SRC)
        st = StreamState()
        assert st.apply(b) == [], enc
        assert st.occupancy() == {(SRC, 1): 1}, enc
        assert st.is_cached((SRC, 1), (1 << 63) + 5), enc


def test_lifetimes_and_sharing():
    st = StreamState(track_lifetimes=True, track_sharing=True)
    st.apply(batch([stored([1, 2])], ts=10.0, source="a"))
    st.apply(batch([stored([2, 3])], ts=11.0, source="b"))
    st.apply(batch([stored([2])], ts=11.5, source="c"))
    assert (st.cross_worker_stores, st.shared_hashes) == (2, 1)
    st.apply(batch([removed([1, 2])], ts=12.5, source="a"))
    assert list(st.workers[("a", 0)].lifetimes) == [2.5, 2.5]
    assert st.holders == {2: 2, 3: 1}
    st.apply(batch([{"type": "AllBlocksCleared"}], ts=13.0, source="b"))
    assert st.holders == {2: 1}
    assert sorted(st.workers_holding(2)) == [("c", 0)]


def test_raw_array_events_survive():
    # An array-form event with extra trailing fields decodes with field_N keys; state accepts it.
    payload = msgpack.packb(
        [
            1.0,
            [
                [
                    "BlockStored",
                    [1],
                    None,
                    [0, 1],
                    2,
                    None,
                    "GPU",
                    None,
                    None,
                    None,
                    None,
                    None,
                    "extra",
                ]
            ],
            0,
        ]
    )
    b = decode_zmq(engine_zmq.encode_frames(b"", 0, payload), SRC)
    st = StreamState()
    assert st.apply(b) == []
    assert st.is_cached(KEY, 1)
