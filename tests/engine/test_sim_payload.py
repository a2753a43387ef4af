"""`simulate -o` packs the simulator's events as vLLM sends them, skipping the encoder's
per-event rebuild: the bytes must be the encoder's, for the simulator's events and for any
event the shortcut must not take."""

from __future__ import annotations

from typing import Any

import pytest

from kvctl import targets
from kvctl.engine import Fleet, FleetConfig
from kvctl.formats import encoding_named, format_names
from kvctl.formats.codec import ZMQ, ZmqEncoding
from kvctl.formats.engine_zmq import DEFAULT_ARRAY_LAYOUT
from kvctl.targets import engine_payload

STORED: dict[str, Any] = {
    "type": "BlockStored",
    "block_hashes": [1, 2],
    "parent_block_hash": 7,
    "token_ids": [1, 2, 3, 4],
    "block_size": 2,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}
REMOVED: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}


def encoder_payload(encoding: str, events: list[dict[str, Any]]) -> bytes:
    found = encoding_named(encoding)
    assert isinstance(found, ZmqEncoding)
    return found.payload(events, 1.5, 0, DEFAULT_ARRAY_LAYOUT)


def simulated_batches() -> list[list[dict[str, Any]]]:
    fleet = Fleet(FleetConfig(workers=2, num_blocks=256, requests=40, rate=40.0, seed=4))
    batches = [events for _t, _worker, events in fleet.run()]
    assert any(e["type"] == "BlockRemoved" for events in batches for e in events)
    return batches


def test_simulated_batches_skip_the_vllm_encoder(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = simulated_batches()
    expected = [encoder_payload("vllm", events) for events in batches]

    def no_encoder(name: str) -> None:
        raise AssertionError(f"the {name} encoder was used")

    monkeypatch.setattr(targets, "zmq_encoding", no_encoder)
    got = [engine_payload("vllm", events, 1.5, 0, DEFAULT_ARRAY_LAYOUT) for events in batches]
    assert got == expected


def test_simulated_batches_match_every_encoder() -> None:
    batches = simulated_batches()
    for encoding in format_names(ZMQ):
        for events in batches:
            assert engine_payload(
                encoding, events, 1.5, 0, DEFAULT_ARRAY_LAYOUT
            ) == encoder_payload(encoding, events)


@pytest.mark.parametrize(
    "event",
    [
        STORED,
        REMOVED,
        {**STORED, "parent_block_hash": None},
        {**STORED, "block_hashes": []},
        {**STORED, "block_hashes": [-5, 2]},  # a signed i64: sent unsigned
        {**STORED, "block_hashes": [b"\x01" * 32]},  # bytes hashes
        {**STORED, "block_hashes": [1, b"\x01" * 32]},
        {**STORED, "parent_block_hash": -1},
        {**STORED, "parent_block_hash": b"\x02" * 32},
        {**STORED, "medium": None},  # vLLM sends GPU
        {**REMOVED, "medium": None},
        {**REMOVED, "medium": ""},
        {**STORED, "session_id": "s"},  # an optional field
        {**STORED, "type": "BlockRemoved"},
        {k: STORED[k] for k in reversed(STORED)},  # another key order
        {"type": "AllBlocksCleared"},
        {**REMOVED, "block_hashes": None},
    ],
)
def test_any_event_packs_as_the_encoder_does(event: dict[str, Any]) -> None:
    events = [STORED, event]
    assert engine_payload("vllm", events, 1.5, 0, DEFAULT_ARRAY_LAYOUT) == encoder_payload(
        "vllm", events
    )
