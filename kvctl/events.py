"""The canonical event model shared by every format, transport and command.

An *event* is a plain ``dict`` keyed by vLLM's field names (``type``, ``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``, ...).
Plain dicts because msgpack already hands map-form events over as dicts: keeping them avoids
per-event object churn on the hot path, and any field a producer adds survives untouched.
Decoders of other shapes (positional arrays, Dynamo RouterEvents) build the same dicts.

A *batch* is what one transport message carried: metadata plus a list of events.
Hash values are kept exactly as the producer sent them (signed int, unsigned int or bytes);
presentation (unsigned / signed / hex) is the formatter's job, see :func:`present_hash`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"
EVENT_TYPES = (BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED)

Event = dict[str, Any]

# Field order of vLLM's positional (array) events; a shorter array is an older release.
STORED_ARRAY_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",  # 0.10.2
    "lora_name",  # 0.14
    "extra_keys",  # 0.17
    "group_idx",  # 0.20
    "kv_cache_spec_kind",  # 0.22
    "kv_cache_spec_sliding_window",  # 0.22
)
REMOVED_ARRAY_FIELDS = ("block_hashes", "medium", "group_idx")

# Keys every JSON line carries (null when the event type or producer has no such field).
CORE_EVENT_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "lora_name",
    "medium",
)

U64_MASK = (1 << 64) - 1


@dataclass(slots=True)
class Batch:
    """One transport message, decoded (or not: ``error`` is set and ``events`` is empty)."""

    source: str
    events: list[Event]
    format: str
    topic: str = ""
    seq: int | None = None
    ts: float | None = None
    recv_ns: int = 0
    worker_id: Any = None
    dp_rank: int | None = None
    frames: list[bytes] = field(default_factory=list)
    error: str | None = None
    recovered: bool = False
    """Fetched from the engine's replay socket to fill a sequence gap."""
    publisher: Any = None
    """Key that a sequence number counts within (one ZMQ socket, one Dynamo publisher_id)."""

    @property
    def malformed(self) -> bool:
        return self.error is not None


def present_hash(value: Any, style: str = "unsigned") -> Any:
    """Render one block hash for people and JSON: 64-bit ints as unsigned (Dynamo's view),
    signed, or hex; byte-string hashes always as hex."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not -(1 << 63) <= value < (1 << 64):
            return value  # does not fit 64 bits: show it as sent, `check` flags it
        if style == "unsigned":
            return value + (1 << 64) if value < 0 else value
        if style == "signed":
            return value - (1 << 64) if value >= 1 << 63 else value
        return f"{value & U64_MASK:016x}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return value
