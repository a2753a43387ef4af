"""The recording schema: one Parquet row per event, its columns (:data:`COLUMNS`, the single
source of truth: the README's table is :func:`schema_table`, checked by tests/test_contract.py),
the Arrow schema and gap markers. The recipes that rebuild raw frames from the columns belong
to the codecs (:func:`kvctl.formats.frames_recipe`).

One row per event, so that SQL users query without unnesting; batch columns are repeated on
every row of the batch (Parquet's dictionary/RLE encodings make that nearly free). A batch
with no events (malformed or empty) still gets one row, and a transport gap is a row of type
``Gap``. Rows are built in :mod:`kvctl.recording.rows` and read back in
:mod:`kvctl.recording.rebuild`; pure (no file I/O).

pyarrow is imported at module level: import this package only from code paths that record or
read recordings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1
"""Bump on any incompatible change of column meaning; readers check it."""

GAP = "Gap"
MALFORMED = "Malformed"

METADATA_KEY = "kvctl"
"""The key of kvctl's JSON metadata in a Parquet footer and a journal header."""

# Integer bounds of the typed columns.
U64 = 1 << 64
I63 = 1 << 63
I31 = 1 << 31
MASK = U64 - 1

_DSTR = pa.dictionary(pa.int32(), pa.string())

# (name, type, meaning) -- the README table is generated from this list, keep it in step.
COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("recv_ns", pa.int64(), "receive time, ns since the epoch (batch)"),
    ("ts", pa.float64(), "engine/publisher timestamp, s (batch)"),
    ("source", _DSTR, "source URL the batch came from (batch)"),
    ("topic", _DSTR, "ZMQ topic or NATS subject (batch)"),
    ("publisher", _DSTR, "key sequence numbers count within (batch)"),
    ("seq", pa.uint64(), "transport sequence number (batch); a Gap row: first missing seq"),
    ("worker_id", _DSTR, "worker label or Dynamo worker id, as text (batch)"),
    ("dp_rank", pa.int64(), "data-parallel rank (batch)"),
    ("format", _DSTR, "decoded shape: engine-map, engine-array, dynamo-json, ... (batch)"),
    ("batch_index", pa.int64(), "message number in the recording; null on Gap rows"),
    ("event_index", pa.int32(), "event number within the batch; null: batch without events"),
    ("recovered", pa.bool_(), "batch fetched from the replay socket to fill a gap (batch)"),
    ("type", _DSTR, "event type as sent; on kvctl's own rows (event_index null): Malformed, Gap"),
    ("block_hashes", pa.list_(pa.uint64()), "block hashes as unsigned 64-bit"),
    ("block_hashes_bytes", pa.list_(pa.binary()), "block hashes a producer sent as bytes"),
    ("hash_signed", pa.bool_(), "the producer sent signed 64-bit hashes (re-encode as i64)"),
    ("parent_block_hash", pa.uint64(), "parent block hash, unsigned 64-bit"),
    ("parent_block_hash_bytes", pa.binary(), "parent block hash sent as bytes"),
    ("token_ids", pa.list_(pa.uint32()), "token ids of the stored blocks"),
    ("block_size", pa.int32(), "tokens per block"),
    ("lora_id", pa.int64(), "LoRA adapter id"),
    ("lora_name", _DSTR, "LoRA adapter name"),
    ("medium", _DSTR, "GPU, CPU_TIER1, ..."),
    ("tokens_hashes", pa.list_(pa.uint64()), "Dynamo tokens_hash of each block"),
    ("event_id", pa.uint64(), "Dynamo event id"),
    ("storage_tier", _DSTR, "Dynamo storage tier"),
    ("extra", pa.string(), "JSON object: every other field, and values no column fits"),
    ("fields", _DSTR, "JSON array: the event's keys in order ([name] = copied from batch)"),
    ("error", pa.string(), "why the message could not be decoded (Malformed rows)"),
    ("raw_size", pa.int64(), "bytes of all raw frames (first row of a batch)"),
    ("frames", pa.list_(pa.binary()), "raw transport frames (first row of a batch)"),
    ("frames_codec", _DSTR, "set when frames is null: frames are rebuilt from the columns"),
    ("batch_extra", pa.string(), "JSON: batch values no column fits exactly (first row)"),
]

SCHEMA = pa.schema(
    [pa.field(n, t) for n, t, _ in COLUMNS],
    metadata={b"kvctl.schema_version": str(SCHEMA_VERSION).encode()},
)
COLUMN_NAMES = [n for n, _, _ in COLUMNS]

# The batch columns, repeated on every row of a batch (and set on a Gap row).
BATCH_COLUMNS = (
    "recv_ns",
    "ts",
    "source",
    "topic",
    "publisher",
    "seq",
    "worker_id",
    "dp_rank",
    "format",
)


@dataclass(slots=True)
class Gap:
    """A transport gap: sequence numbers ``from_seq..to_seq`` (inclusive) never arrived."""

    publisher: Any
    from_seq: int
    to_seq: int
    recv_ns: int = 0
    source: str = ""

    @property
    def missing(self) -> int:
        return self.to_seq - self.from_seq + 1


def schema_table() -> str:
    """The schema as a Markdown table: the README's, kept equal by tests/test_contract.py."""
    lines = ["| column | type | meaning |", "|---|---|---|"]
    for name, t, meaning in COLUMNS:
        shown = "dictionary<string>" if t == _DSTR else str(t).replace("<item: ", "<")
        lines.append(f"| `{name}` | `{shown}` | {meaning} |")
    return "\n".join(lines)
