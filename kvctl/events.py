"""The canonical event model shared by every format, transport and command.

An *event* is a plain ``dict`` keyed by vLLM's field names (``type``, ``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``, ``lora_name``, ...).
Plain dicts because msgpack already hands map-form events over as dicts: keeping them avoids
per-event object churn on the hot path, and any field a producer adds survives untouched.
Decoders of other shapes (positional arrays, Dynamo RouterEvents) build the same dicts.

A *batch* is what one transport message carried: metadata plus a list of events.
Hash values are kept exactly as the producer sent them (signed int, unsigned int or bytes);
presentation (unsigned / signed / hex / decimal string) is the formatter's job, see
:func:`present_hash`; an encoder that must write integers converts them by one rule, see
:func:`unsigned_hash` and :func:`signed_hash`.
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
_I63 = 1 << 63
_U64_LIMIT = 1 << 64
DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block where a stream does not say (vLLM's default)."""

MAX_DEPTH = 64
"""How deep containers may nest in one batch, counted from the batch ``[ts, events, dp_rank]``
(level 1) through its events array (2) and an event (3): a field's value may nest
``MAX_DEPTH - 3`` levels itself. Real KV events nest 3 levels at most. The decoders turn a
message beyond the bound into a malformed one (raw frames kept) and the recording layer refuses
to store deeper values, with this one bound, so that live and recorded counts agree and no
encoder or reader of a batch comes near Python's recursion limit."""

TS_RANGE = (-62135510400.0, 253402214399.0)
"""Batch timestamps (s since the epoch) a clock can show: years 1-9999 with a day to spare for
any time zone. A producer's ts outside it (NaN, inf, a ms value sent as s: year 55,000) makes
the message malformed, as a wrong type would: no command can show it as a time."""

HASH_STYLES = ("unsigned", "signed", "hex", "string")
"""How 64-bit hashes are shown: ``string`` is the unsigned value as decimal text, for readers
that parse JSON numbers as IEEE doubles (jq, JavaScript) and round integers above 2^53."""


@dataclass(slots=True)
class Batch:
    """One transport message, decoded (or not: ``error`` is set and ``events`` is empty)."""

    source: str
    events: list[Event]
    """Event dicts; for consumers that asked for them (a live source's ``typed``: tap's JSON
    lines, the recorder), a plain vLLM batch's events may instead all be
    :class:`kvctl.formats.engine_zmq.TypedEvent` (``event["type"]`` and ``event.get`` read
    them alike; ``type(events[0]) is dict`` tells them apart)."""
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
    """Key that a sequence number counts within (one ZMQ socket, one Dynamo publisher_id).
    Always hashable: the decoders refuse a publisher_id that is not an int."""

    @property
    def malformed(self) -> bool:
        return self.error is not None


def present_hash(value: Any, style: str = "unsigned") -> Any:
    """Render one block hash for people and JSON: 64-bit ints as unsigned (Dynamo's view),
    signed, hex, or the unsigned value as a decimal string; byte-string hashes always as
    hex."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not -(1 << 63) <= value < (1 << 64):
            # does not fit 64 bits: shown as sent (`check` flags it), as text where asked
            return str(value) if style == "string" else value
        if style == "unsigned":
            return value + (1 << 64) if value < 0 else value
        if style == "signed":
            return value - (1 << 64) if value >= 1 << 63 else value
        if style == "string":
            return str(value + (1 << 64) if value < 0 else value)
        return f"{value & U64_MASK:016x}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    return value


# --- hash values ------------------------------------------------------------------------------
# Producers send a block hash as a signed i64 (SGLang, seed), an unsigned u64 (vLLM, Dynamo) or
# raw bytes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the 32-byte SHA-256). An encoder
# whose format carries integers turns every one of them into the same 64 bits, so that one
# block keeps one id whichever format it is replayed in.


def bytes_hash_to_int(value: bytes | bytearray) -> int:
    """The unsigned 64-bit integer of a bytes hash: its last 8 bytes, big-endian.

    vLLM's own rule for its int hashes (vllm-project/vllm, ``maybe_convert_block_hash`` in
    ``vllm/v1/core/kv_cache_utils.py``, applied when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is
    on, its default in ``vllm/envs.py``):
    ``int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)``,
    i.e. the low 64 bits of the big-endian value, which are the last 8 bytes. So a vLLM
    recording with bytes hashes replays to the ids vLLM itself would have sent."""
    return int.from_bytes(value[-8:], "big")


def unsigned_hash(value: Any) -> Any:
    """A hash as an unsigned 64-bit integer (vLLM's and Dynamo's view): bytes by
    :func:`bytes_hash_to_int`, a negative i64 by two's complement. Anything else (an int outside
    64 bits, a value that is no hash) is returned as it is, for ``check`` to flag."""
    if type(value) is int:
        return value + _U64_LIMIT if -_I63 <= value < 0 else value
    if isinstance(value, (bytes, bytearray)):
        return bytes_hash_to_int(value)
    return value


def signed_hash(value: Any) -> Any:
    """A hash as a signed 64-bit integer (SGLang's i64 view): the two's complement of
    :func:`unsigned_hash`, so both views are the same 64 bits. Anything that is no 64-bit hash
    is returned as :func:`unsigned_hash` gives it."""
    value = unsigned_hash(value)
    if type(value) is int and _I63 <= value < _U64_LIMIT:
        return value - _U64_LIMIT
    return value


# --- field types ------------------------------------------------------------------------------
# What real producers put in the known fields (wire-formats reference): hashes are ints (signed
# or unsigned 64-bit, Dynamo u64) or bytes (vLLM's raw 32-byte SHA-256); token ids are ints,
# SGLang EAGLE [a, b] pairs, strings, or TensorRT-LLM's serialized UniqueToken maps; null
# means "not set" everywhere. Any other type is a producer bug, and the decoders turn the
# whole message into a malformed one that names the field, so that no command prints, records
# or models an event whose meaning is unknown. Fields kvctl does not know are never checked.
TYPED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "lora_name",
    "medium",
    "tokens_hashes",
)
"""The fields :func:`field_type_error` checks; every other field may hold any value."""
_HASH_TYPES = frozenset({int, bytes})
_TOKEN_TYPES = frozenset({int, str, dict})
_INT_OR_NIL = frozenset({int, type(None)})
_STR_OR_NIL = frozenset({str, type(None)})
_CONTAINERS = frozenset({list, dict, tuple})
_CHECKED_KEYS = frozenset(("type", *TYPED_FIELDS))
"""Fields whose shape is known flat once typed (``type``: the decoders require a string)."""
_VALUE_LEVELS = MAX_DEPTH - 3  # the batch, its events array and the event sit above a value
_NESTING = f"nests deeper than {MAX_DEPTH} levels"
_KINDS = {
    str: "a str",
    dict: "a map",
    list: "an array",
    float: "a float",
    bool: "a bool",
    bytes: "bytes",
    int: "an int",
}


def kind_of(value: Any) -> str:
    """A value's type as error messages name it: ``a str``, ``a map``, ``an array``, ``bytes``."""
    return _KINDS.get(type(value)) or f"a {type(value).__name__}"


def field_type_error(event: Event) -> str | None:
    """The first known field of ``event`` whose type no producer sends, or the first field
    whose value nests containers beyond :data:`MAX_DEPTH`, described (``None`` when every
    known field has a type some producer uses and nothing nests too deep).

    On the hot path of every command, so the common case costs a few C-level calls. Token
    ids (the long list) are summed in C first, which raises on str, list, map and nil and
    turns float on a float; only then are the elements looked at one by one. (A bool among
    token ids passes: msgpack's true sums as 1. Hashes are checked exactly.) Once the known
    fields have their flat shapes, only the containers in other fields (and token maps) can
    nest: those alone are walked for depth."""
    get = event.get
    hashes = get("block_hashes")
    if hashes is not None:
        if type(hashes) is not list:
            return f"block_hashes is {kind_of(hashes)}, expected an array of int or bytes"
        if not _HASH_TYPES.issuperset(map(type, hashes)):
            bad = next(h for h in hashes if type(h) not in _HASH_TYPES)
            return f"block_hashes holds {kind_of(bad)}, expected int or bytes"
    parent = get("parent_block_hash")
    if parent is not None and type(parent) is not int and type(parent) is not bytes:
        return f"parent_block_hash is {kind_of(parent)}, expected int, bytes or nil"
    tokens = get("token_ids")
    if tokens is not None:
        if type(tokens) is not list:
            return f"token_ids is {kind_of(tokens)}, expected an array"
        try:
            plain = type(sum(tokens)) is int
        except TypeError:
            plain = False
        if not plain:
            problem = _token_error(tokens)
            if problem is not None:
                return problem
    value = get("block_size")
    if type(value) not in _INT_OR_NIL:
        return f"block_size is {kind_of(value)}, expected int or nil"
    value = get("lora_id")
    if type(value) not in _INT_OR_NIL:
        return f"lora_id is {kind_of(value)}, expected int or nil"
    value = get("lora_name")
    if type(value) not in _STR_OR_NIL:
        return f"lora_name is {kind_of(value)}, expected a string or nil"
    value = get("medium")
    if type(value) not in _STR_OR_NIL:
        return f"medium is {kind_of(value)}, expected a string or nil"
    value = get("tokens_hashes")  # Dynamo: one u64 per block (null: that block sent none)
    if value is not None:
        if type(value) is not list:
            return f"tokens_hashes is {kind_of(value)}, expected an array of int"
        for h in value:
            if h is not None and type(h) is not int:
                return f"tokens_hashes holds {kind_of(h)}, expected int"
    if _CHECKED_KEYS.issuperset(event):  # vLLM/SGLang events: one C-level pass, done
        return None
    for key in event.keys() - _CHECKED_KEYS:  # Dynamo's extra fields: scalars, as a rule
        if type(key) is tuple or type(event[key]) in _CONTAINERS:
            break
    else:
        return None
    for key, value in event.items():  # in field order, so that the message is always the same
        if key in _CHECKED_KEYS:
            continue
        if type(key) is tuple:
            return _ARRAY_KEY
        t = type(value)
        if t is list or t is dict or t is tuple:
            problem = container_problem(value, _VALUE_LEVELS)
            if problem is not None:
                return f"field {_name(key)} {problem}"
    return None


_ARRAY_KEY = "has an array as a map key"
"""msgpack allows any key; an array key (a tuple in Python) cannot be printed as JSON."""


def container_problem(value: Any, levels: int) -> str | None:
    """Why the containers in ``value`` cannot be shown or recorded: nesting more than
    ``levels`` deep (``value`` itself is level 1), or an array as a map key; ``None`` when
    they can. Iterative, so any depth is safe to look at."""
    stack = [(value, 1)]
    while stack:
        container, level = stack.pop()
        if level > levels:
            return _NESTING
        if type(container) is dict:
            if tuple in set(map(type, container)):
                return _ARRAY_KEY
            container = container.values()
        for child in container:
            t = type(child)
            if t is list or t is dict or t is tuple:
                stack.append((child, level + 1))
    return None


def _name(key: Any) -> str:
    """A field name as it arrived (str, int, bytes, ...), bounded in length."""
    return repr(key[:40] if type(key) in (str, bytes) else key)[:60]


def _token_error(tokens: list[Any]) -> str | None:
    for token in tokens:
        if type(token) in _TOKEN_TYPES:
            if type(token) is dict:
                problem = container_problem(token, _VALUE_LEVELS - 1)
                if problem is not None:
                    return f"token_ids holds a token map that {problem}"
            continue
        if type(token) is list and token and all(type(t) is int for t in token):
            continue  # an EAGLE [a, b] pair
        return (
            f"token_ids holds {kind_of(token)}, expected int, an [int, int] pair, "
            "a string or a token map"
        )
    return None
