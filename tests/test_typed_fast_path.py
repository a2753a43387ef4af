"""The typed fast path of tap and record (plain vLLM map-form batches decoded into msgspec
Structs) against the tolerant decoder: whatever the fast path takes, the tolerant decoder reads
into the same events and tap prints the same bytes; whatever it leaves, is decoded exactly as
without it (malformed messages included)."""

from __future__ import annotations

import io
import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.events import CORE_EVENT_FIELDS, HASH_STYLES, TS_RANGE
from kvctl.formats import decode_zmq
from kvctl.formats.engine_zmq import TypedEvent, encode_payload
from kvctl.output import JsonLinesSink
from kvctl.pipeline import Narrowed

U64 = 2**64 - 1

# Values for the known fields: the ones vLLM sends, and the ones other producers or broken
# ones send (signed and bytes hashes, bools, floats, strings, token pairs and maps, nesting).
odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.integers(-(2**63), U64),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(-3, 3) | st.booleans() | st.none(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
)


def once_in(draw, n: int) -> bool:
    """True once in ``n`` draws (hypothesis favours small integers: the rare case is the
    largest one)."""
    return draw(st.integers(1, n)) == n


def mostly(usual: st.SearchStrategy, odd: st.SearchStrategy, one_in: int = 10) -> st.SearchStrategy:
    """``odd`` once in ``one_in`` times, else ``usual``."""
    return st.integers(1, one_in).flatmap(lambda i: odd if i == one_in else usual)


hash_lists = mostly(
    st.lists(st.integers(0, U64), max_size=4),
    st.lists(
        st.integers(-(2**63), U64) | st.binary(min_size=1, max_size=8) | st.booleans(), max_size=3
    ),
)
token_lists = mostly(
    st.lists(st.integers(-(2**63), U64), max_size=20),
    st.lists(
        st.integers(0, 9)
        | st.booleans()
        | st.text(max_size=3)
        | st.lists(st.integers(0, 9), min_size=2, max_size=2)
        | st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2),
        max_size=4,
    ),
)
FIELD_VALUES = {
    "block_hashes": mostly(hash_lists, odd_values, 40),
    "parent_block_hash": mostly(st.none() | st.integers(0, U64), odd_values, 40),
    "token_ids": mostly(token_lists, odd_values, 40),
    "block_size": mostly(st.none() | st.sampled_from([1, 16]), odd_values, 40),
    "lora_id": mostly(st.none() | st.integers(0, 9), odd_values, 40),
    "medium": mostly(st.sampled_from(["GPU", "CPU", None]), odd_values, 40),
    "lora_name": mostly(st.none() | st.text(max_size=4), odd_values, 40),
}
VLLM_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")


@st.composite
def events(draw):
    etype = draw(
        mostly(
            st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]),
            st.sampled_from(["Other", "", 1, None]),
        )
    )
    names = draw(
        mostly(
            st.sampled_from(
                [
                    (*VLLM_ORDER, "medium", "lora_name"),  # vLLM's map
                    ("block_hashes", "medium"),  # vLLM's removal
                    (),
                    VLLM_ORDER,  # seed, SGLang
                    CORE_EVENT_FIELDS,
                ]
            ),
            st.lists(st.sampled_from(CORE_EVENT_FIELDS), unique=True, max_size=7),
        )
    )
    event = {} if once_in(draw, 20) else {"type": etype}
    for name in names:
        event[name] = draw(FIELD_VALUES[name])
    if once_in(draw, 10):  # a field kvctl does not know, or the type again
        event[draw(st.sampled_from(["extra_keys", "worker_id", "type", "cache_salt"]))] = draw(
            odd_values
        )
    if once_in(draw, 10):  # another key order
        keys = list(event)
        random.Random(draw(st.integers(0, 99))).shuffle(keys)
        event = {k: event[k] for k in keys}
    return event


@st.composite
def payloads(draw):
    evs = draw(st.lists(events(), max_size=3))
    if once_in(draw, 5):  # an array-form event among them
        evs.append(
            msgpack.unpackb(encode_payload([{"type": "BlockRemoved"}], 1.0, 0, "vllm-array"))[1][0]
        )
    ts = draw(
        mostly(
            st.floats(min_value=TS_RANGE[0], max_value=TS_RANGE[1]),
            st.sampled_from([TS_RANGE[1] * 2, float("nan"), 1700000000]) | odd_values,
        )
    )
    dp_rank = draw(mostly(st.none() | st.integers(0, 7), odd_values))
    batch = [ts, evs, dp_rank, 0][: draw(mostly(st.just(3), st.sampled_from([2, 4])))]
    try:  # floats as float 32 where they fit (a producer's choice: never the fast path's)
        payload = msgpack.packb(batch, use_single_float=draw(st.booleans()))
    except OverflowError:
        payload = msgpack.packb(batch)
    if once_in(draw, 6):  # a byte flipped, or the payload cut short
        data = bytearray(payload)
        at = draw(st.integers(0, len(data) - 1))
        if draw(st.booleans()):
            data[at] = draw(st.integers(0, 255))
        else:
            del data[at:]
        payload = bytes(data)
    return payload


def json_of(batch, events=None, hash_style="unsigned") -> bytes:
    out = io.BytesIO()
    sink = JsonLinesSink(out, hash_style=hash_style)
    sink.handle(batch if events is None else Narrowed(batch, events))
    return out.getvalue()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads(), st.binary(max_size=3), st.sampled_from(["", "kv@pod@model"]))
def test_fast_path_and_tolerant_decoder_agree(payload, seq, topic):
    frames = [topic.encode(), seq.rjust(8, b"\x00") if len(seq) < 3 else seq, payload]
    tolerant = decode_zmq(frames, "src", 5, None, 2)
    fast = decode_zmq(frames, "src", 5, None, 2, typed=True)
    if not (fast.events and isinstance(fast.events[0], TypedEvent)):
        # left to the tolerant decoder: decoded exactly as without (repr: NaN != NaN)
        assert repr(fast) == repr(tolerant)
        return
    assert tolerant.error is None, "the fast path took a batch the tolerant decoder refuses"
    for name in ("ts", "seq", "topic", "worker_id", "dp_rank", "format", "frames", "publisher"):
        assert getattr(fast, name) == getattr(tolerant, name), name
    assert len(fast.events) == len(tolerant.events)
    for typed, event in zip(fast.events, tolerant.events, strict=True):
        assert type(typed) is not dict and typed["type"] == typed.TYPE == event["type"]
        for name in ("type", *CORE_EVENT_FIELDS, "worker_id"):
            assert typed.get(name) == event.get(name), name
        assert typed.get("worker_id", "w") == event.get("worker_id", "w")
    for style in HASH_STYLES:
        assert json_of(fast, hash_style=style) == json_of(tolerant, hash_style=style)
    fast.recovered = tolerant.recovered = True  # the context's optional field
    assert json_of(fast, fast.events[1:]) == json_of(tolerant, tolerant.events[1:])


def test_vllm_batches_take_the_fast_path_and_print_the_same_bytes():
    stored = {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1, 5],
        "parent_block_hash": 2**63 + 1,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": "adapter",
    }
    removed = {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}
    evs = [stored, removed, {"type": "AllBlocksCleared"}]
    frames = [b"kv@pod-1@m", (3).to_bytes(8, "big"), encode_payload(evs, 1.5, 4)]
    fast = decode_zmq(frames, "tcp://h:1", 7, typed=True)
    assert all(isinstance(e, TypedEvent) for e in fast.events)
    tolerant = decode_zmq(frames, "tcp://h:1", 7)
    assert tolerant.events == evs
    assert json_of(fast) == json_of(tolerant)
    assert json_of(fast).count(b"\n") == 3


@pytest.mark.parametrize(
    "event",
    [
        {"type": "BlockStored", "block_hashes": [-1]},  # signed: shown converted
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32]},  # bytes: shown as hex
        {"type": "BlockStored", "token_ids": [1, True]},  # a bool token (msgpack's true)
        {"type": "BlockStored", "token_ids": [[1, 2]]},  # an EAGLE pair
        {"type": "BlockStored", "cache_salt": "s"},  # a field tap prints after the context
        {"type": "BlockStored", "block_size": 1.0},  # malformed
        {"type": "Other"},
    ],
)
def test_what_the_fast_path_leaves_is_decoded_as_before(event):
    frames = [b"", (1).to_bytes(8, "big"), msgpack.packb([1.5, [event], 0])]
    fast = decode_zmq(frames, "src", typed=True)
    assert fast == decode_zmq(frames, "src")
    assert not any(isinstance(e, TypedEvent) for e in fast.events)


def test_the_typed_fields_are_the_core_fields_in_their_order():
    assert TypedEvent.__struct_fields__ == CORE_EVENT_FIELDS


class _Batches:
    """A source of ready batches (the pipeline's view of a live source)."""

    def __init__(self, batches: list) -> None:
        self.items = batches

    def batches(self):
        yield from self.items


@pytest.mark.parametrize(
    ("types", "workers", "count"),
    [
        ((), (), None),
        (("BlockRemoved",), (), None),
        (("BlockStored", "AllBlocksCleared"), (), 7),
        ((), ("pod-1",), 5),
        ((), ("pod-2",), None),
        (("BlockRemoved",), ("pod-1",), 1),
    ],
)
def test_filters_counts_and_limits_read_typed_events_as_dicts(types, workers, count):
    from kvctl.pipeline import run
    from kvctl.selection import Filters, Limits

    rng = random.Random(7)
    frames = []
    for seq in range(40):
        evs = [
            rng.choice(
                [
                    {"type": "BlockStored", "block_hashes": [seq], "token_ids": [1, 2]},
                    {"type": "BlockRemoved", "block_hashes": [seq], "medium": "GPU"},
                    {"type": "AllBlocksCleared"},
                ]
            )
            for _ in range(rng.randint(0, 3))
        ]
        topic = b"kv@pod-1@m" if seq % 3 else b"kv@pod-2@m"
        frames.append([topic, seq.to_bytes(8, "big"), encode_payload(evs, 1.0 + seq, 0)])

    def tapped(typed: bool) -> tuple[bytes, dict]:
        out = io.BytesIO()
        batches = [decode_zmq(f, "src", 1, None, None, typed) for f in frames]
        summary = run(
            _Batches(batches),
            [JsonLinesSink(out)],
            Limits(count=count),
            Filters(frozenset(types), frozenset(workers)),
        )
        return out.getvalue(), summary.to_json() | {"elapsed_s": 0}

    fast, plain = tapped(True), tapped(False)
    assert fast == plain and fast[0]


def test_tap_lines_are_held_back_until_a_chunk_is_full_the_input_pauses_or_time_is_up():
    from kvctl.pipeline import IDLE, run
    from kvctl.selection import Limits

    frames = [
        [b"", seq.to_bytes(8, "big"), encode_payload([{"type": "AllBlocksCleared"}], 1.0, 0)]
        for seq in range(3)
    ]
    batches = [decode_zmq(f, "src", 1, typed=True) for f in frames]
    out = io.BytesIO()
    sink = JsonLinesSink(out, chunk_bytes=JsonLinesSink.CHUNK_BYTES)
    sink.handle(batches[0])
    assert out.getvalue() == b""
    sink.handle(IDLE)  # the input paused: what is ready is written
    assert out.getvalue() == json_of(batches[0])
    sink.handle(batches[1])
    sink.close()
    assert out.getvalue() == json_of(batches[0]) + json_of(batches[1])

    out = io.BytesIO()  # a slow stream that never pauses: held back HOLD_S at most
    sink = JsonLinesSink(out, chunk_bytes=JsonLinesSink.CHUNK_BYTES)
    sink.handle(batches[0])
    sink.due = 0.0  # as when HOLD_S has passed since then
    sink.handle(batches[1])
    assert out.getvalue() == json_of(batches[0]) + json_of(batches[1])

    seen = []

    class Recorder:
        def handle(self, item):
            seen.append(type(item).__name__)

    run(_Batches([batches[0], None, batches[1]]), [Recorder()], Limits())
    assert seen == ["Batch", "Idle", "Batch"]  # the pipeline says when its source idles
