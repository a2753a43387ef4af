"""Engine-side ZeroMQ batches: vLLM, SGLang, TensorRT-LLM and custom ("seed") publishers.

Live message: 3 frames ``[topic, seq (u64 big-endian), payload]``; payload is msgpack
``[ts, events, dp_rank]`` (vLLM 0.9.0: ``[ts, events]``). Events are tagged maps
(vLLM >= 0.24, SGLang >= 0.5.20, seed publisher) or positional arrays (vLLM 0.9-0.23,
SGLang <= 0.5.15) of any historical length, possibly mixed in one batch.

Pure functions only: bytes in, events out (and back). :data:`CODEC` declares them to the
registry (:mod:`kvctl.formats`): the ``--format`` names ``vllm``, ``vllm-array``, ``sglang`` and
``seed`` write this format, each as its producer shapes it; the decoder reads them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any, ClassVar

import msgpack
import msgspec

from ..errors import DecodeError
from ..events import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    MAX_DEPTH,
    REMOVED_ARRAY_FIELDS,
    STORED_ARRAY_FIELDS,
    TS_RANGE,
    Batch,
    Event,
    field_type_error,
    signed_hash,
    unsigned_hash,
)
from .codec import Codec, NatsForm, ZmqEncoding, ZmqForm

_TS_MIN, _TS_MAX = TS_RANGE
_ARRAY_FIELDS = {BLOCK_STORED: STORED_ARRAY_FIELDS, BLOCK_REMOVED: REMOVED_ARRAY_FIELDS}

# Whole-array lengths (tag included) of each vLLM release that changed them.
ARRAY_LAYOUTS: dict[str, tuple[int, int]] = {
    # version: (BlockStored length, BlockRemoved length)
    "0.9": (6, 2),
    "0.10.2": (7, 3),
    "0.14": (8, 3),
    "0.17": (9, 3),
    "0.20": (10, 4),
    "0.22": (12, 4),
}
DEFAULT_ARRAY_LAYOUT = "0.22"

# Shape names reported in Batch.format for engine batches.
MAP_FORM, ARRAY_FORM, MIXED_FORM = "engine-map", "engine-array", "engine-mixed"


def worker_from_topic(topic: str) -> str | None:
    """llm-d publishes on ``kv@<pod-id>@<model-name>``: the pod is the worker."""
    if topic.startswith("kv@"):
        parts = topic.split("@", 2)
        if len(parts) == 3 and parts[1]:
            return parts[1]
    return None


def parse_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise DecodeError(f"seq frame is {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


# msgspec decodes msgpack faster than msgpack-python (see bench/tap_throughput.py); both give
# the same plain Python objects.
def _ext(code: int, data: memoryview) -> dict[str, Any]:
    """msgpack extension values (no producer sends them, but msgpack allows them) become a
    plain map, so that every decoded value can be printed and recorded."""
    return {"msgpack_ext": code, "data": bytes(data)}


_decode = msgspec.msgpack.Decoder(ext_hook=_ext).decode


def unpack(payload: bytes) -> Any:
    try:
        return _decode(payload)
    except RecursionError:  # msgspec recursed to Python's limit: far beyond MAX_DEPTH
        raise DecodeError(f"msgpack nests deeper than {MAX_DEPTH} levels") from None
    except Exception as exc:
        raise DecodeError(f"not msgpack: {exc}") from None


def decode_payload(payload: bytes) -> tuple[float | None, list[Event], int | None, str]:
    """Decode one batch payload into ``(ts, events, dp_rank, shape)``."""
    return decode_batch_object(unpack(payload))


# --- the typed fast path ------------------------------------------------------------------------
# Most batches are vLLM's map form: events with vLLM's keys only, plain int token ids and hashes
# that need no conversion to be shown. msgspec decodes such a batch straight into the Structs
# below, checking every field's type in C while it decodes, and a Struct encodes to JSON as the
# core of tap's line (the fields in its order, null where the event has none): no event dict, no
# Python pass over the fields. The Structs accept a subset of what the tolerant decoder accepts
# (no unknown key, nothing nested, hashes non-negative ints, token ids ints, ts a float in
# TS_RANGE), so a batch they take is one the tolerant decoder reads into the same events;
# anything else (another producer's shapes, a malformed message) is left to the tolerant
# decoder, which decides as it always has. Only consumers that say they can read them (tap's
# JSON lines, the recorder's raw journal) are handed these events: see ``typed`` in
# :func:`kvctl.formats.decode_zmq`.

_Hash = Annotated[int, msgspec.Meta(ge=0)]
"""A hash shown as sent (an unsigned 64-bit int); signed or bytes hashes take the tolerant
path, where they are converted for display."""


class TypedEvent(
    msgspec.Struct, tag_field="type", forbid_unknown_fields=True, omit_defaults=False, gc=False
):
    """An event of the typed fast path: the fields of :data:`~kvctl.events.CORE_EVENT_FIELDS`
    in their order, ``None`` when the event has no such field (tap shows null either way).
    Reads like an event dict where the pipeline and the filters read one (``event["type"]``,
    ``event.get(...)``); :meth:`event` gives the dict itself."""

    TYPE: ClassVar[str]
    block_hashes: list[_Hash] | None = None
    parent_block_hash: _Hash | None = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None

    def __getitem__(self, key: str) -> Any:
        return self.TYPE if key == "type" else getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self.TYPE if key == "type" else getattr(self, key, default)

    def event(self) -> Event:
        """The event as a dict with every core field (the absent ones null): what tap shows."""
        event: Event = {"type": self.TYPE}
        for name in self.__struct_fields__:
            event[name] = getattr(self, name)
        return event


class _Stored(TypedEvent, tag=BLOCK_STORED):
    TYPE = BLOCK_STORED


class _Removed(TypedEvent, tag=BLOCK_REMOVED):
    TYPE = BLOCK_REMOVED


class _Cleared(TypedEvent, tag=ALL_BLOCKS_CLEARED):
    TYPE = ALL_BLOCKS_CLEARED


class _TypedBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    dp_rank: int | None = None


_decode_typed = msgspec.msgpack.Decoder(_TypedBatch).decode
_MAP_HEADERS = frozenset({*range(0x80, 0x90), 0xDE})


def decode_typed(payload: bytes) -> tuple[float, list[Any], int | None, str] | None:
    """``(ts, events, dp_rank, shape)`` of a map-form batch the typed fast path takes (events
    are :class:`TypedEvent`), or ``None``: decode it with :func:`decode_payload`."""
    # [ts (float 64), [event, ...], dp]: is the first event a map? (else: not worth a try)
    if len(payload) < 14 or payload[0] != 0x93 or payload[1] != 0xCB:
        return None
    header = payload[10]
    first = payload[11] if 0x91 <= header <= 0x9F else payload[13] if header == 0xDC else None
    if first not in _MAP_HEADERS:
        return None
    try:
        batch = _decode_typed(payload)
    except (msgspec.DecodeError, RecursionError):  # ValidationError included
        return None
    ts = batch.ts
    if not _TS_MIN <= ts <= _TS_MAX:  # also false for NaN
        return None
    return ts, batch.events, batch.dp_rank, MAP_FORM


def decode_frames(batch: Batch, frames: list[bytes]) -> None:
    """Fill ``batch`` from a 3-frame ``[topic, seq, payload]`` message. (The registry's fast
    path decodes well-formed messages inline; this one also leaves what it could read on a
    batch that turns out malformed.)"""
    topic = frames[0].decode("utf-8", "replace")
    batch.topic = topic
    batch.seq = parse_seq(frames[1])
    batch.ts, batch.events, payload_dp, batch.format = decode_payload(frames[2])
    if payload_dp is not None:
        batch.dp_rank = payload_dp
    if batch.worker_id is None:
        batch.worker_id = worker_from_topic(topic)


def decode_relayed(batch: Batch, data: bytes) -> None:
    """Fill ``batch`` from an engine payload relayed as is (a NATS message's data)."""
    batch.ts, batch.events, batch.dp_rank, batch.format = decode_payload(data)


def decode_batch_object(obj: Any) -> tuple[float | None, list[Event], int | None, str]:
    if not isinstance(obj, list) or not 2 <= len(obj) <= 3:
        raise DecodeError(f"batch is {_describe(obj)}, expected [ts, events, dp_rank]")
    ts, raw_events = obj[0], obj[1]
    dp_rank = obj[2] if len(obj) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise DecodeError(f"batch ts is {_describe(ts)}, expected a number")
    if not _TS_MIN <= ts <= _TS_MAX:  # also false for NaN
        raise DecodeError(f"batch ts {ts!r} is not a time (seconds since the epoch, years 1-9999)")
    if not isinstance(raw_events, list):
        raise DecodeError(f"batch events is {_describe(raw_events)}, expected an array")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool)):
        raise DecodeError(f"batch dp_rank is {_describe(dp_rank)}, expected int or nil")
    events, shape = decode_events(raw_events)
    return float(ts), events, dp_rank, shape


def decode_events(raw_events: list[Any]) -> tuple[list[Event], str]:
    """Name every event's fields; an event that is not a map or tagged array, or whose known
    fields carry a type no producer sends, or whose values nest beyond
    :data:`~kvctl.events.MAX_DEPTH` (:func:`~kvctl.events.field_type_error`), makes the whole
    batch undecodable."""
    maps = arrays = 0
    events: list[Event] = raw_events  # map-form events are used as they come
    for i, ev in enumerate(raw_events):
        if type(ev) is dict:
            if type(ev.get("type")) is not str:
                raise DecodeError(f"event {i} is a map without a string 'type'")
            maps += 1
        elif type(ev) is list and ev and type(ev[0]) is str:
            if events is raw_events:
                events = list(raw_events)
            ev = events[i] = _array_event(ev)
            arrays += 1
        else:
            raise DecodeError(f"event {i} is {_describe(ev)}, expected a map or a tagged array")
        problem = field_type_error(ev)
        if problem is not None:
            raise DecodeError(f"event {i} ({ev['type'][:40]}): {problem}")
    shape = MIXED_FORM if maps and arrays else ARRAY_FORM if arrays else MAP_FORM
    return events, shape


def _array_event(ev: list[Any]) -> Event:
    tag = ev[0]
    names = _ARRAY_FIELDS.get(tag, ())
    event: Event = {"type": tag}
    for i, value in enumerate(ev[1:]):
        event[names[i] if i < len(names) else f"field_{i + 1}"] = value
    return event


def _describe(obj: Any) -> str:
    if isinstance(obj, list):
        return f"an array of {len(obj)}"
    return f"a {type(obj).__name__}"


# --- encoders ---------------------------------------------------------------------------------

_VLLM_STORED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_VLLM_STORED_OPTIONAL = (
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)

_VLLM_STORED_KEYS = ("type", *_VLLM_STORED)
_VLLM_REMOVED_KEYS = ("type", "block_hashes", "medium")


def sent_as_vllm_sends_it(event: Event) -> bool:
    """True when vLLM's map encoder would send ``event`` unchanged: vLLM's keys in its order
    and nothing else, a medium, and hashes that need no conversion (no bytes, no negative
    ints). The simulator's events all are, so a batch of them is packed without building
    each event again; anything else goes through the encoder."""
    keys = tuple(event)
    if keys == _VLLM_STORED_KEYS:
        parent = event["parent_block_hash"]
        if event["type"] != BLOCK_STORED or not (
            parent is None or (type(parent) is int and parent >= 0)
        ):
            return False
    elif keys != _VLLM_REMOVED_KEYS or event["type"] != BLOCK_REMOVED:
        return False
    hashes = event["block_hashes"]
    if not event["medium"] or type(hashes) is not list:
        return False
    try:  # min raises on bytes (alone or among ints); ints >= 0 are sent as they are
        return not hashes or min(hashes) >= 0
    except TypeError:
        return False


_SGLANG_STORED_OPTIONAL = ("medium", "cache_salt", "session_id", "lora_name")


def _hashes(event: Event, convert: Callable[[Any], Any]) -> list[Any]:
    return [convert(h) for h in event.get("block_hashes") or ()]


def vllm_map_event(event: Event) -> dict[str, Any]:
    etype = event["type"]
    if etype == BLOCK_STORED:
        out = {"type": etype, "block_hashes": _hashes(event, _keep_vllm)}
        parent = event.get("parent_block_hash")
        out["parent_block_hash"] = _keep_vllm(parent) if parent is not None else None
        for key in _VLLM_STORED[2:]:
            out[key] = event.get(key)
        if out["medium"] is None:
            out["medium"] = "GPU"
        for key in _VLLM_STORED_OPTIONAL:
            if event.get(key) is not None:
                out[key] = event[key]
        return out
    if etype == BLOCK_REMOVED:
        out = {
            "type": etype,
            "block_hashes": _hashes(event, _keep_vllm),
            "medium": event.get("medium") or "GPU",
        }
        for key in ("group_idx", "locality", "ownership"):
            if event.get(key) is not None:
                out[key] = event[key]
        return out
    return {"type": etype}


def _keep_vllm(h: Any) -> Any:
    # vLLM sends u64 ints, or the raw 32 bytes when int hashes are disabled: keep bytes.
    return h if isinstance(h, (bytes, bytearray)) else unsigned_hash(h)


def vllm_array_event(event: Event, layout: str = DEFAULT_ARRAY_LAYOUT) -> list[Any]:
    stored_len, removed_len = ARRAY_LAYOUTS[layout]
    etype = event["type"]
    if etype == BLOCK_STORED:
        m = vllm_map_event(event)
        return [etype, *(m.get(k) for k in STORED_ARRAY_FIELDS[: stored_len - 1])]
    if etype == BLOCK_REMOVED:
        m = vllm_map_event(event)
        return [etype, *(m.get(k) for k in REMOVED_ARRAY_FIELDS[: removed_len - 1])]
    return [etype]


def sglang_events(event: Event) -> list[dict[str, Any]]:
    """SGLang publishes one BlockStored per page, chained by parent_block_hash, signed hashes."""
    etype = event["type"]
    if etype == BLOCK_STORED:
        hashes = _hashes(event, signed_hash)
        tokens = event.get("token_ids") or []
        size = event.get("block_size") or (len(tokens) // len(hashes) if hashes else 0)
        parent = signed_hash(event.get("parent_block_hash"))
        out = []
        for i, h in enumerate(hashes):
            ev = {
                "type": etype,
                "block_hashes": [h],
                "parent_block_hash": parent,
                "token_ids": tokens[i * size : (i + 1) * size],
                "block_size": size,
                "lora_id": event.get("lora_id"),
            }
            for key in _SGLANG_STORED_OPTIONAL:
                if event.get(key) is not None:
                    ev[key] = event[key]
            out.append(ev)
            parent = h
        return out
    if etype == BLOCK_REMOVED:
        ev = {"type": etype, "block_hashes": _hashes(event, signed_hash)}
        if event.get("medium") is not None:
            ev["medium"] = event["medium"]
        return [ev]
    return [{"type": etype}]


def seed_event(event: Event) -> dict[str, Any]:
    """The seed document's pure-Python publisher: signed hashes, lora 0 written as nil."""
    etype = event["type"]
    if etype == BLOCK_STORED:
        parent = event.get("parent_block_hash")
        return {
            "type": etype,
            "block_hashes": _hashes(event, signed_hash),
            "parent_block_hash": signed_hash(parent) if parent is not None else None,
            "token_ids": event.get("token_ids"),
            "block_size": event.get("block_size"),
            "lora_id": event.get("lora_id") or None,
        }
    if etype == BLOCK_REMOVED:
        return {"type": etype, "block_hashes": _hashes(event, signed_hash)}
    return {"type": etype}


def _vllm_payload(
    events: Iterable[Event], ts: float | None, dp_rank: int | None, array_layout: str
) -> bytes:
    return msgpack.packb([ts, [vllm_map_event(e) for e in events], dp_rank])


def _vllm_array_payload(
    events: Iterable[Event], ts: float | None, dp_rank: int | None, array_layout: str
) -> bytes:
    wire = [vllm_array_event(e, array_layout) for e in events]
    return msgpack.packb([ts, wire] if array_layout == "0.9" else [ts, wire, dp_rank])


def _sglang_payload(
    events: Iterable[Event], ts: float | None, dp_rank: int | None, array_layout: str
) -> bytes:
    return msgpack.packb([ts, [w for e in events for w in sglang_events(e)], dp_rank])


def _seed_payload(
    events: Iterable[Event], ts: float | None, dp_rank: int | None, array_layout: str
) -> bytes:
    return msgpack.packb([ts, [seed_event(e) for e in events], dp_rank])


ENCODINGS = (
    ZmqEncoding("vllm", _vllm_payload),
    ZmqEncoding("vllm-array", _vllm_array_payload),
    ZmqEncoding("sglang", _sglang_payload),
    ZmqEncoding("seed", _seed_payload),
)
ENGINE_ENCODINGS = tuple(e.name for e in ENCODINGS)
_PAYLOADS = {e.name: e.payload for e in ENCODINGS}


def encode_payload(
    events: Iterable[Event],
    ts: float | None,
    dp_rank: int | None = 0,
    encoding: str = "vllm",
    array_layout: str = DEFAULT_ARRAY_LAYOUT,
) -> bytes:
    """Encode events as one engine batch payload in the chosen producer's shape."""
    payload = _PAYLOADS.get(encoding)
    if payload is None:
        raise ValueError(f"unknown engine encoding {encoding!r}; choose from {ENGINE_ENCODINGS}")
    return payload(events, ts, dp_rank, array_layout)


def encode_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


# --- rebuilding recorded frames -----------------------------------------------------------------
# A recording may leave out the raw frames of a batch its decoded values rebuild byte for byte:
# engine batches in the canonical encoding (msgpack-python's, which every producer uses), the
# common case, and half the bytes on disk. The recipe names are stored in recordings.

RECIPES = ("zmq3", "zmq2", "nats3", "nats2")
"""``zmq3`` = ``[topic, seq, payload]`` with a 3-element payload, ``zmq2`` = vLLM 0.9's
2-element payload; ``nats3``/``nats2``: the payload alone (relayed on NATS)."""


def frames_recipe(batch: Batch) -> str | None:
    """Name the recipe that rebuilds ``batch.frames`` from its decoded values, if one does
    exactly (checked byte for byte)."""
    fmt = batch.format
    if batch.error is not None or fmt not in (MAP_FORM, ARRAY_FORM):
        return None
    frames = batch.frames
    if len(frames) == 3:
        kind = "zmq"
        if batch.seq is None or frames[1] != batch.seq.to_bytes(8, "big"):
            return None
        if frames[0] != batch.topic.encode("utf-8", "surrogatepass"):
            return None
        payload = frames[2]
    elif len(frames) == 1:
        kind, payload = "nats", frames[0]
    else:
        return None
    for n in (3, 2):
        try:
            rebuilt = _rebuilt_payload(batch.ts, batch.events, batch.dp_rank, fmt, n)
        except Exception:  # an odd value msgpack refuses: keep the raw bytes
            return None
        if rebuilt == payload:
            return f"{kind}{n}"
    return None


def rebuild_frames(recipe: str, batch: Batch) -> list[bytes]:
    """The frames :func:`frames_recipe` vouched for, from the batch read back."""
    payload = _rebuilt_payload(batch.ts, batch.events, batch.dp_rank, batch.format, int(recipe[-1]))
    if recipe.startswith("zmq"):
        if batch.seq is None:  # frames_recipe names a zmq recipe only with a seq: a doctored row
            raise TypeError(f"frames recipe {recipe} on a batch without seq")
        return [batch.topic.encode("utf-8", "surrogatepass"), batch.seq.to_bytes(8, "big"), payload]
    return [payload]


def map_form_zmq_recipes(batches: list[Batch]) -> list[str | None] | None:
    """What :func:`frames_recipe` says of each of ``batches`` (3-frame map-form engine batches
    whose events are exactly as decoded, as the recording converter's fast path makes them),
    checked for all at once: when the topics are UTF-8 and the payloads, re-encoded as one
    msgpack array, are byte for byte the payloads received (msgpack is self-delimiting: equal
    streams, equal payloads), each batch is rebuilt by the recipe of its payload's length.
    ``None``: ask :func:`frames_recipe` batch by batch."""
    payloads = [b.frames[2] for b in batches]
    rebuilt = [
        [b.ts, b.events, b.dp_rank] if p[0] == _FIXARRAY3 else [b.ts, b.events]
        for b, p in zip(batches, payloads, strict=True)
    ]
    try:
        packed = msgpack.packb(rebuilt)
    except Exception:  # a value msgpack refuses: the codec decides
        return None
    data = b"".join(payloads)
    header = 1 if len(batches) < 16 else 3 if len(batches) < 1 << 16 else 5
    if len(packed) != header + len(data) or not packed.endswith(data):
        return None
    if [b.topic.encode("utf-8", "surrogatepass") for b in batches] != [
        b.frames[0] for b in batches
    ]:
        return None
    return [_ZMQ3 if p[0] == _FIXARRAY3 else _ZMQ2 for p in payloads]


_FIXARRAY3 = 0x93  # how a 3-element payload [ts, events, dp_rank] starts
_ZMQ3, _ZMQ2 = RECIPES[0], RECIPES[1]


def _rebuilt_payload(ts: Any, events: list[Event], dp_rank: Any, fmt: str, n: int) -> bytes:
    # Array-form events were decoded into dicts in positional order: values() is the array.
    wire = events if fmt == MAP_FORM else [list(e.values()) for e in events]
    return msgpack.packb([ts, wire, dp_rank] if n == 3 else [ts, wire])


# --- the codec --------------------------------------------------------------------------------

KNOWN_FIELDS = frozenset(
    {
        "type",
        *STORED_ARRAY_FIELDS,
        *REMOVED_ARRAY_FIELDS,
        *_VLLM_STORED_OPTIONAL,  # vLLM's map-only fields
        *_SGLANG_STORED_OPTIONAL,  # SGLang: cache_salt
    }
)
"""Every field vLLM, SGLang, TensorRT-LLM and the seed publisher send (wire-formats.md)."""

_MSGPACK_ARRAY = frozenset({*range(0x90, 0xA0), 0xDC, 0xDD})

CODEC = Codec(
    name="engine",
    shapes=(MAP_FORM, ARRAY_FORM, MIXED_FORM),
    known_fields=KNOWN_FIELDS,
    zmq=(ZmqForm(3, "3 [topic, seq, payload]", decode_frames),),
    nats=(NatsForm(_MSGPACK_ARRAY, "an engine batch", decode_relayed),),
    encodings=ENCODINGS,
    frames_recipe=frames_recipe,
    rebuild_frames=rebuild_frames,
    recipes=RECIPES,
)
