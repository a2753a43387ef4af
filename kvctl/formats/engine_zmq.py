"""Engine-side ZeroMQ batches: vLLM, SGLang, TensorRT-LLM and custom ("seed") publishers.

Live message: 3 frames ``[topic, seq (u64 big-endian), payload]``; payload is msgpack
``[ts, events, dp_rank]`` (vLLM 0.9.0: ``[ts, events]``). Events are tagged maps
(vLLM >= 0.24, SGLang >= 0.5.20, seed publisher) or positional arrays (vLLM 0.9-0.23,
SGLang <= 0.5.15) of any historical length, possibly mixed in one batch.

Pure functions only: bytes in, events out (and back).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgpack
import msgspec

from ..errors import DecodeError
from ..events import (
    BLOCK_REMOVED,
    BLOCK_STORED,
    MAX_DEPTH,
    REMOVED_ARRAY_FIELDS,
    STORED_ARRAY_FIELDS,
    TS_RANGE,
    Event,
    field_type_error,
)

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
_SGLANG_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
_SGLANG_STORED_OPTIONAL = ("medium", "cache_salt", "session_id", "lora_name")


def to_unsigned(h: Any) -> Any:
    if isinstance(h, int):
        return h + (1 << 64) if h < 0 else h
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h[-8:], "big")
    return h


def to_signed(h: Any) -> Any:
    if isinstance(h, (bytes, bytearray)):
        h = int.from_bytes(h[:8], "big")
    if isinstance(h, int) and h >= 1 << 63:
        return h - (1 << 64)
    return h


def _hashes(event: Event, convert) -> list[Any]:
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
    return h if isinstance(h, (bytes, bytearray)) else to_unsigned(h)


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
        hashes = _hashes(event, to_signed)
        tokens = event.get("token_ids") or []
        size = event.get("block_size") or (len(tokens) // len(hashes) if hashes else 0)
        parent = to_signed(event.get("parent_block_hash"))
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
        ev = {"type": etype, "block_hashes": _hashes(event, to_signed)}
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
            "block_hashes": _hashes(event, to_signed),
            "parent_block_hash": to_signed(parent) if parent is not None else None,
            "token_ids": event.get("token_ids"),
            "block_size": event.get("block_size"),
            "lora_id": event.get("lora_id") or None,
        }
    if etype == BLOCK_REMOVED:
        return {"type": etype, "block_hashes": _hashes(event, to_signed)}
    return {"type": etype}


ENGINE_ENCODINGS = ("vllm", "vllm-array", "sglang", "seed")


def encode_payload(
    events: Iterable[Event],
    ts: float,
    dp_rank: int | None = 0,
    encoding: str = "vllm",
    array_layout: str = DEFAULT_ARRAY_LAYOUT,
) -> bytes:
    """Encode events as one engine batch payload in the chosen producer's shape."""
    if encoding == "vllm":
        wire: list[Any] = [vllm_map_event(e) for e in events]
    elif encoding == "vllm-array":
        wire = [vllm_array_event(e, array_layout) for e in events]
    elif encoding == "sglang":
        wire = [w for e in events for w in sglang_events(e)]
    elif encoding == "seed":
        wire = [seed_event(e) for e in events]
    else:
        raise ValueError(f"unknown engine encoding {encoding!r}; choose from {ENGINE_ENCODINGS}")
    if encoding == "vllm-array" and array_layout == "0.9":
        return msgpack.packb([ts, wire])
    return msgpack.packb([ts, wire, dp_rank])


def encode_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]
