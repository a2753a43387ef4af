"""Engine-side ZMQ batches: golden vectors from the wire-format reference, round trips, and
hostile input."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.events import MAX_DEPTH, STORED_ARRAY_FIELDS, TYPED_FIELDS
from kvctl.formats import decode_nats, decode_zmq
from kvctl.formats.engine_zmq import (
    ARRAY_LAYOUTS,
    encode_frames,
    encode_payload,
    worker_from_topic,
)

TOKENS = list(range(32))


def frames_of(batch_obj, seq=7, topic=b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(batch_obj)]


def test_vllm_map_form_batch_is_decoded_as_sent():
    ev = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": TOKENS,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 1,
        "kv_cache_spec_kind": "full_attention",
    }
    batch = decode_zmq(frames_of([1.5, [ev, {"type": "AllBlocksCleared"}], 2]), "src", 1)
    assert batch.error is None
    assert (batch.seq, batch.ts, batch.dp_rank, batch.format) == (7, 1.5, 2, "engine-map")
    assert batch.events == [ev, {"type": "AllBlocksCleared"}]


def test_map16_header_for_small_map_decodes():
    # vLLM 0.33 (msgspec) writes map16 even for 8 entries: de 00 08
    body = b"".join(
        msgpack.packb(x)
        for x in (
            "type",
            "BlockRemoved",
            "block_hashes",
            [1],
            "medium",
            "GPU",
            "group_idx",
            0,
            "locality",
            None,
            "ownership",
            None,
            "a",
            1,
            "b",
            2,
        )
    )
    payload = b"\x93" + msgpack.packb(1.0) + b"\x91" + b"\xde\x00\x08" + body + b"\x00"
    batch = decode_zmq([b"", (0).to_bytes(8, "big"), payload], "src")
    assert batch.error is None
    assert batch.events[0]["type"] == "BlockRemoved" and batch.events[0]["b"] == 2


@pytest.mark.parametrize("version,stored_len", [(v, s) for v, (s, _) in ARRAY_LAYOUTS.items()])
def test_every_historical_array_length(version, stored_len):
    full = [
        "BlockStored",
        [1, 2],
        None,
        TOKENS,
        16,
        None,
        "GPU",
        "lora-a",
        [["x"]],
        0,
        "sliding_window",
        128,
    ]
    batch = decode_zmq(frames_of([2.0, [full[:stored_len]], 0]), "src")
    assert batch.error is None and batch.format == "engine-array"
    ev = batch.events[0]
    assert ev["type"] == "BlockStored" and ev["block_hashes"] == [1, 2]
    assert ev["token_ids"] == TOKENS and ev["block_size"] == 16
    assert len(ev) == stored_len  # every element named, none invented
    if stored_len >= 7:
        assert ev["medium"] == "GPU"
    if stored_len == 12:
        assert ev["kv_cache_spec_sliding_window"] == 128


def test_vllm_0_9_two_element_batch_and_removed_arrays():
    events = [
        ["BlockRemoved", [5]],
        ["BlockRemoved", [6], "CPU"],
        ["BlockRemoved", [7], "GPU", 1],
        ["AllBlocksCleared"],
    ]
    batch = decode_zmq(frames_of([3.0, events]), "src")
    assert batch.error is None and batch.dp_rank is None
    assert batch.events == [
        {"type": "BlockRemoved", "block_hashes": [5]},
        {"type": "BlockRemoved", "block_hashes": [6], "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 1},
        {"type": "AllBlocksCleared"},
    ]


def test_longer_array_than_known_keeps_extra_fields():
    ev = ["BlockStored", [1], None, TOKENS[:16], 16, None, "GPU", None, None, 0, None, None, "new"]
    batch = decode_zmq(frames_of([1.0, [ev], 0]), "src")
    assert batch.events[0]["field_12"] == "new"


def test_mixed_shapes_bytes_hashes_and_eagle_pairs():
    h = bytes(range(32))
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": None,
            "token_ids": [[1, 2], [3, 4]],
            "block_size": 2,
            "lora_id": None,
        },
        ["BlockRemoved", [h], "GPU"],
    ]
    batch = decode_zmq(frames_of([1.0, events, None]), "src")
    assert batch.format == "engine-mixed"
    assert batch.events[0]["block_hashes"] == [h] and batch.events[0]["token_ids"] == [
        [1, 2],
        [3, 4],
    ]
    assert batch.events[1]["block_hashes"] == [h]


def test_signed_hashes_kept_as_sent():
    ev = {
        "type": "BlockStored",
        "block_hashes": [-1, 2**64 - 1],
        "parent_block_hash": -2,
        "token_ids": TOKENS,
        "block_size": 16,
        "lora_id": None,
    }
    batch = decode_zmq(frames_of([1.0, [ev], 0]), "src")
    assert batch.events[0]["block_hashes"] == [-1, 2**64 - 1]


def test_llm_d_topic_names_the_worker_and_labels_win():
    batch = decode_zmq(frames_of([1.0, [], 0], topic=b"kv@pod-7@llama"), "src")
    assert batch.worker_id == "pod-7" and batch.topic == "kv@pod-7@llama"
    labelled = decode_zmq(
        frames_of([1.0, [], None], topic=b"kv@pod-7@llama"), "src", worker_id=3, dp_rank=1
    )
    assert (labelled.worker_id, labelled.dp_rank) == (3, 1)
    assert worker_from_topic("kv@@m") is None and worker_from_topic("other") is None


@pytest.mark.parametrize(
    "frames,why",
    [
        ([b"", (0).to_bytes(8, "big")], "2 frames"),
        ([b"", b"\x00" * 4, msgpack.packb([1.0, [], 0])], "seq frame is 4 bytes"),
        ([b"", b"\x00" * 8, b"\xc1"], "not msgpack"),
        ([b"", b"\x00" * 8, msgpack.packb([1.0, [], 0])[:-1]], "not msgpack"),
        ([b"", b"\x00" * 8, msgpack.packb({"a": 1})], "expected [ts, events, dp_rank]"),
        ([b"", b"\x00" * 8, msgpack.packb(["x", [], 0])], "ts"),
        ([b"", b"\x00" * 8, msgpack.packb([1.0, {}, 0])], "events"),
        ([b"", b"\x00" * 8, msgpack.packb([1.0, [5], 0])], "event 0"),
        ([b"", b"\x00" * 8, msgpack.packb([1.0, [{"no": "type"}], 0])], "without a string 'type'"),
        ([b"", b"\x00" * 8, b"\xdd\xff\xff\xff\xff"], "not msgpack"),  # array header of 4G items
    ],
)
def test_bad_input_becomes_an_error_batch(frames, why):
    batch = decode_zmq(frames, "src")
    assert batch.error is not None and why in batch.error
    assert batch.events == [] and batch.frames == frames


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames_never_raise(frames):
    batch = decode_zmq(frames, "src")
    assert (batch.error is None) != (batch.error is not None and batch.events == [])
    assert_printable_and_recordable(batch)


def assert_printable_and_recordable(batch) -> None:
    """Whatever a decoder accepted, tap can print and record can store."""
    import io

    from kvctl.output import JsonLinesSink, PrettySink
    from kvctl.recording.rows import batches_to_record_batch

    out = io.BytesIO()
    JsonLinesSink(out).handle(batch)
    assert out.getvalue().count(b"\n") == len(batch.events)
    PrettySink(console=_quiet_console()).write(batch, batch.events)
    assert batches_to_record_batch([batch]).num_rows >= 1


def _quiet_console():
    import io

    from rich.console import Console

    return Console(file=io.StringIO())


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**32), st.integers(0, 999_999_999)),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=8).filter(lambda k: k not in ("type", *TYPED_FIELDS)),
        msgpack_values,
        max_size=4,
    )
)
def test_any_msgpack_value_in_an_event_can_be_printed_and_recorded(fields):
    # any value in a field whose type kvctl does not check (typed fields: tests below)
    payload = msgpack.packb([1.0, [{"type": "BlockStored", **fields}], 0], datetime=False)
    batch = decode_zmq([b"", b"\x00" * 8, payload], "src")
    assert batch.error is None
    assert_printable_and_recordable(batch)


hashes = st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=4)


@st.composite
def stored_events(draw):
    hs = draw(hashes)
    size = draw(st.sampled_from([1, 2, 16]))
    return {
        "type": "BlockStored",
        "block_hashes": hs,
        "parent_block_hash": draw(st.none() | st.integers(0, 2**64 - 1)),
        "token_ids": draw(
            st.lists(st.integers(0, 2**32 - 1), min_size=size * len(hs), max_size=size * len(hs))
        ),
        "block_size": size,
        "lora_id": draw(st.none() | st.integers(1, 100)),
        "medium": draw(st.sampled_from(["GPU", "CPU"])),
        "lora_name": None,
    }


events_strategy = st.lists(
    stored_events()
    | st.builds(lambda h: {"type": "BlockRemoved", "block_hashes": h, "medium": "GPU"}, hashes)
    | st.just({"type": "AllBlocksCleared"}),
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(events_strategy, st.sampled_from(list(ARRAY_LAYOUTS)))
def test_vllm_map_and_array_round_trip(events, layout):
    for encoding in ("vllm", "vllm-array"):
        payload = encode_payload(events, 1.25, 0, encoding, layout)
        batch = decode_zmq(encode_frames(b"t", 3, payload), "src")
        assert batch.error is None and batch.seq == 3 and batch.ts == 1.25
        if encoding == "vllm":
            assert batch.events == events
        else:  # an array carries the layout's fields: those we had, exact; newer ones null
            for got, want in zip(batch.events, events, strict=True):
                assert {k: want.get(k) for k in got} == got
                assert set(want) - set(got) <= {"medium", "lora_name"}


def _signed(h):
    return h - 2**64 if h >= 2**63 else h


@settings(max_examples=100, deadline=None)
@given(events_strategy)
def test_sglang_and_seed_round_trip(events):
    sglang = decode_zmq(encode_frames(b"", 0, encode_payload(events, 1.0, 0, "sglang")), "s")
    seed = decode_zmq(encode_frames(b"", 0, encode_payload(events, 1.0, 0, "seed")), "s")
    assert sglang.error is None and seed.error is None
    # SGLang: one store per page, chained; signed hashes
    expected_pages = [
        (ev["block_hashes"][i], ev["token_ids"][i * ev["block_size"] : (i + 1) * ev["block_size"]])
        for ev in events
        if ev["type"] == "BlockStored"
        for i in range(len(ev["block_hashes"]))
    ]
    pages = [
        (e["block_hashes"][0], e["token_ids"]) for e in sglang.events if e["type"] == "BlockStored"
    ]
    assert pages == [(_signed(h), t) for h, t in expected_pages]
    stored = [e for e in seed.events if e["type"] == "BlockStored"]
    assert [e["block_hashes"] for e in stored] == [
        [_signed(h) for h in ev["block_hashes"]] for ev in events if ev["type"] == "BlockStored"
    ]
    assert all(
        set(e) == {"type", "block_hashes"} for e in seed.events if e["type"] == "BlockRemoved"
    )


# --- known fields of types no producer sends ---------------------------------------------------


def _stored(**fields):
    return {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        **fields,
    }


@pytest.mark.parametrize(
    "event,why",
    [
        (
            _stored(block_hashes="d0326374"),
            "event 0 (BlockStored): block_hashes is a str, expected an array of int or bytes",
        ),
        (_stored(block_hashes={"a": 1}), "block_hashes is a map"),
        (_stored(block_hashes=[1, 2.5]), "block_hashes holds a float, expected int or bytes"),
        (_stored(block_hashes=[None]), "block_hashes holds a NoneType"),
        (_stored(block_hashes=[True]), "block_hashes holds a bool"),
        (
            _stored(parent_block_hash=1.0),
            "parent_block_hash is a float, expected int, bytes or nil",
        ),
        (_stored(parent_block_hash="1"), "parent_block_hash is a str"),
        (_stored(token_ids={"0": 1}), "token_ids is a map, expected an array"),
        (_stored(token_ids="12"), "token_ids is a str"),
        (_stored(token_ids=[1, 2.0]), "token_ids holds a float"),
        (_stored(token_ids=[1, None]), "token_ids holds a NoneType"),
        (_stored(token_ids=[[1, "x"]]), "token_ids holds an array"),
        (_stored(block_size=16.0), "block_size is a float, expected int or nil"),
        (_stored(block_size="16"), "block_size is a str"),
        (_stored(lora_id="a"), "lora_id is a str, expected int or nil"),
        (_stored(lora_name=3), "lora_name is an int, expected a string or nil"),
        (_stored(medium=["GPU"]), "medium is an array, expected a string or nil"),
        ({"type": "BlockRemoved", "block_hashes": 5}, "event 0 (BlockRemoved): block_hashes is an"),
        (["BlockStored", "d0326374", None, [1, 2], 2, None], "event 0 (BlockStored): block_hashes"),
        (["BlockStored", [1], None, [1, 2], 2.5, None], "block_size is a float"),
        (["BlockRemoved", [1], 7], "medium is an int"),
    ],
)
def test_known_fields_of_types_no_producer_sends_make_the_batch_malformed(event, why):
    frames = frames_of([1.0, [{"type": "AllBlocksCleared"}, event], 0])
    batch = decode_zmq(frames, "src")
    assert batch.error is not None and why.replace("event 0", "event 1") in batch.error, batch.error
    assert batch.events == [] and batch.frames == frames
    relayed = decode_nats("s", frames[2], "nats://x")  # an engine payload relayed on NATS
    assert relayed.error == batch.error


@pytest.mark.parametrize(
    "event",
    [
        _stored(token_ids=[[1, 2], [3, 4]], block_size=2),  # SGLang EAGLE bigram pairs
        _stored(token_ids=["a", "b"]),  # string tokens
        _stored(
            token_ids=[{"type": "unique_token", "token_id": 1, "token_extra_id": 0}]
        ),  # TRT-LLM
        _stored(block_hashes=[bytes(range(32))], parent_block_hash=bytes(32)),  # vLLM sha256 bytes
        _stored(block_hashes=[-1, 2**64 - 1, 0], parent_block_hash=-(2**63)),  # i64 and u64
        _stored(parent_block_hash=None, lora_id=None, lora_name=None, medium=None),
        _stored(
            lora_id=3,
            lora_name="adapter",
            medium="CPU_PINNED",
            brand_new={"x": [1.5]},
            extra_keys=[["img", 0.5]],
            group_idx="g",
        ),  # unknown/unchecked fields: anything
        {"type": "AllBlocksCleared"},
        {"type": "Unknown", "whatever": 1.5},
        ["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, [["x"]], 0, "full", None, 9.5],
    ],
)
def test_values_real_producers_send_stay_valid(event):
    batch = decode_zmq(frames_of([1.0, [event], 0]), "src")
    assert batch.error is None, batch.error
    assert_printable_and_recordable(batch)


wrong_types = st.one_of(
    st.floats(),
    st.text(max_size=4),
    st.booleans(),
    st.dictionaries(st.text(max_size=2), st.integers(0, 9), max_size=2),
)
WRONG_FOR = {  # field -> a strategy of values no producer sends in it
    "block_hashes": wrong_types.filter(lambda v: v is not None)
    | st.lists(st.floats() | st.text(max_size=2) | st.none(), min_size=1, max_size=3).map(
        lambda v: [1, *v]
    ),
    "parent_block_hash": st.floats()
    | st.text(max_size=4)
    | st.booleans()
    | st.lists(st.integers(0, 9), max_size=2),
    "token_ids": st.floats()
    | st.text(max_size=4)
    | st.dictionaries(st.text(max_size=2), st.integers(0, 9))
    | st.lists(st.floats() | st.none() | st.binary(max_size=2), min_size=1, max_size=3).map(
        lambda v: [1, *v]
    ),
    "block_size": st.floats() | st.text(max_size=4) | st.booleans() | st.binary(max_size=2),
    "lora_id": st.floats() | st.text(max_size=4) | st.lists(st.integers(0, 9), max_size=2),
    "lora_name": st.floats() | st.integers(0, 9) | st.binary(max_size=2),
    "medium": st.floats() | st.integers(0, 9) | st.lists(st.text(max_size=2), max_size=2),
}


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(sorted(WRONG_FOR)),
    data=st.data(),
    as_array=st.booleans(),
    etype=st.sampled_from(["BlockStored", "BlockRemoved", "Custom"]),
)
def test_wrong_typed_known_fields_are_always_malformed_never_a_crash(field, data, as_array, etype):
    value = data.draw(WRONG_FOR[field])
    event = {**_stored(), "type": etype, field: value}
    if as_array and etype == "BlockStored":
        event = ["BlockStored", *(event.get(k) for k in STORED_ARRAY_FIELDS[:7])]
    batch = decode_zmq(frames_of([1.0, [event], 0]), "src")
    assert batch.error is not None and field in batch.error, batch.error
    assert batch.events == []
    assert_printable_and_recordable(batch)


# --- the depth bound: the same in every decoder as in the recording --------------------------


def _nested(levels: int, leaf=None) -> list:
    value: list = [] if leaf is None else [leaf]
    for _ in range(levels - 1):
        value = [value]
    return value


VALUE_LEVELS = MAX_DEPTH - 3  # the batch, its events array and the event sit above a value


@pytest.mark.parametrize("place", ["map", "array", "token map", "map in a map"])
def test_a_value_nested_to_the_bound_is_valid_and_one_level_more_is_malformed(place):
    def event_with(levels: int):
        deep = _nested(levels, 1)
        if place == "array":  # vLLM's positional form: extra_keys is the 8th element
            return ["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, deep]
        if place == "token map":  # a TensorRT-LLM UniqueToken map whose value nests
            return {**_stored(), "token_ids": [{"token_id": 1, "x": _nested(levels - 2, 1)}]}
        if place == "map in a map":
            return {**_stored(), "x": {"k": _nested(levels - 1, 1)}}
        return {**_stored(), "extra_keys": deep}

    ok = decode_zmq(frames_of([1.0, [event_with(VALUE_LEVELS)], 0]), "src")
    assert ok.error is None, ok.error
    assert_printable_and_recordable(ok)
    from kvctl.recording.rows import batches_to_record_batch
    from kvctl.recording.schema import MALFORMED

    recorded = batches_to_record_batch([ok]).to_pydict()
    assert MALFORMED not in recorded["type"]  # the recording takes what the decoder took

    frames = frames_of([1.0, [event_with(VALUE_LEVELS + 1)], 0])
    bad = decode_zmq(frames, "src")
    assert bad.error is not None and f"nests deeper than {MAX_DEPTH} levels" in bad.error
    assert bad.events == [] and bad.frames == frames
    assert_printable_and_recordable(bad)


@pytest.mark.parametrize(
    "event",
    [
        {**_stored(), (1, 2): 1},
        {**_stored(), "x": [{(1,): 1}]},
        {**_stored(), "token_ids": [{(1,): 1}]},
    ],
)
def test_an_array_as_map_key_is_malformed(event):
    # msgpack allows it (msgspec gives a tuple); no JSON line or recording can hold it
    batch = decode_zmq(frames_of([1.0, [event], 0]), "src")
    assert batch.error is not None and "has an array as a map key" in batch.error
    assert_printable_and_recordable(batch)


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), -1e300, 1.7e12])
def test_a_ts_no_clock_can_show_is_malformed(ts):
    # tap's pretty view shows the batch time: NaN, inf or a ms value sent as s would end it
    batch = decode_zmq(frames_of([ts, [_stored()], 0]), "src")
    assert batch.error is not None and "is not a time" in batch.error
    assert_printable_and_recordable(batch)
    for fine in (0, 1_700_000_000.25, 253402214399):
        assert decode_zmq(frames_of([fine, [_stored()], 0]), "src").error is None


def test_nesting_beyond_what_python_can_parse_is_malformed():
    frames = [b"", b"\x00" * 8, b"\x93\xcb" + b"\x00" * 8 + b"\x91" * 5000 + b"\xc0\x00"]
    batch = decode_zmq(frames, "src")
    assert batch.error == f"msgpack nests deeper than {MAX_DEPTH} levels"
    assert batch.frames == frames


def test_absurd_array_and_map_headers_are_malformed_without_allocating():
    for header in (b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"):
        payload = b"\x93\xcb" + b"\x00" * 8 + header
        batch = decode_zmq([b"", b"\x00" * 8, payload], "src")
        assert batch.error is not None and "truncated" in batch.error
        nats = decode_nats("x.kv-events", b"\x81\xa7payload" + header, "src")
        assert nats.error is not None


def test_live_tap_and_record_agree_on_a_deep_event(engine, tmp_path):
    """A 1 KB event nesting 500 levels is one malformed batch for tap and in the recording."""
    from conftest import finish, start_kvctl
    from inprocess import run_main

    deep = {**_stored(), "x": _nested(500)}
    out_file = tmp_path / "deep.parquet"
    tap = start_kvctl("tap", engine.endpoint, "--json", "-c", "1")
    record = start_kvctl("record", engine.endpoint, "-c", "1", "-o", str(out_file))
    engine.wait_for(2)
    engine.send_raw(frames_of([1.0, [deep], 0], seq=0))  # as sent: the encoder drops "x"
    engine.send_raw(frames_of([1.0, [_stored()], 0], seq=1))
    for proc in (tap, record):
        rc, out, err = finish(proc)
        assert rc == 0, err
        assert "malformed 1" in err and "1 event " in err, err
        assert f"nests deeper than {MAX_DEPTH} levels" in err or proc is record
    cat = run_main("cat", str(out_file), "--json")
    assert cat.code == 0 and "malformed 1" in cat.err
    assert len(cat.out.splitlines()) == 1
