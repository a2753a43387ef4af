"""The simulated stream is pinned: the same seed gives the same events, byte for byte.

Each case hashes every ``(time, worker, events)`` batch the fleet yields and its final stats.
A digest that changes means the simulation changed (a different stream for the same seed):
speed work on the engine must leave these untouched; a deliberate model change updates them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from inprocess import run_main

from kvctl.engine import ChatParams, Fleet, FleetConfig
from kvctl.recording.reader import open_recording

SMALL = ChatParams(
    prefix_len=(20, 60),
    first_user_median=24,
    followup_median=12,
    output_median=12,
    mean_turns=3.0,
    max_context=400,
)

CASES: dict[str, dict[str, Any]] = {
    # the benchmark's shape, scaled down: default chat workload, evicting
    "kv-default": dict(workers=4, num_blocks=1024, requests=150, rate=40.0, seed=3),
    "prefix-default": dict(workers=3, num_blocks=1024, requests=100, rate=40.0, router="prefix"),
    # tight pools: preemptions, dedup of blocks filled while cached, chunked prefill
    "random-tight": dict(
        workers=2,
        num_blocks=48,
        block_size=4,
        requests=120,
        rate=60.0,
        router="random",
        chat=SMALL,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        seed=7,
    ),
    "round-robin-tight": dict(
        workers=3,
        num_blocks=40,
        block_size=2,
        requests=120,
        rate=80.0,
        router="round-robin",
        chat=SMALL,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        seed=11,
    ),
    "kv-small": dict(
        workers=3, num_blocks=128, block_size=8, requests=200, rate=25.0, chat=SMALL, seed=1
    ),
    "duration": dict(workers=2, num_blocks=256, rate=30.0, duration=4.0, chat=SMALL, seed=2),
}

DIGESTS = {
    "kv-default": "e137af094ec8bf408ea1e8ceeafb5ba9d9861fc30f334b67fdb962b44f9d0f3c",
    "prefix-default": "3e74079058d1e088415fdee5411f57d6c981596665e89ade0483495706c8af1b",
    "random-tight": "be0adaa7e13f08e848c45b28dcaf6ee888ebf2e546845cef8bfe9595be5bc4e8",
    "round-robin-tight": "4c8b06b00ac912e91e28e62f54fa84b5d819010fe4ce233bd37c58cd676cdfa8",
    "kv-small": "537201298fcafbcdaa038cb6ff9169a07574965f641b9095938656ead5e0227d",
    "duration": "58b8954337f128b8a0c90e2cdc138a66eaf45c44a758b974fd8c927642632d80",
}

RECORDING_DIGEST = "fada6fd7c33b9d28ce5174ec94ad56bb015b5daa75c43e47873bc1e335388b1c"


def stream_digest(**config: Any) -> str:
    fleet = Fleet(FleetConfig(**config))
    digest = hashlib.sha256()
    for t, worker, events in fleet.run():
        digest.update(json.dumps([repr(t), worker, events]).encode())
    digest.update(json.dumps(fleet.stats(), sort_keys=True).encode())
    return digest.hexdigest()


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_seed_same_stream(case: str) -> None:
    assert stream_digest(**CASES[case]) == DIGESTS[case]


def test_queued_tokens_follow_every_step() -> None:
    """The KV router's per-worker queued-token count is kept incrementally: it equals the sum
    over running and waiting requests after every step, preemptions included."""
    fleet = Fleet(FleetConfig(**CASES["random-tight"]))
    for _ in fleet.run():
        for worker in fleet.workers:
            queue = [*worker.running, *worker.waiting]
            assert worker.queued_tokens() == sum(r.known - r.computed for r in queue)
    assert fleet.stats()["total"]["preemptions"] > 0


def test_recording_of_a_seed_is_pinned(tmp_path: Path) -> None:
    """``simulate -o`` with a seed and an epoch writes the same frames, byte for byte (the
    payload shortcut of the recording target included)."""
    path = tmp_path / "sim.parquet"
    args = ("--workers", "3", "--requests", "60", "--num-blocks", "300", "--seed", "5")
    result = run_main("simulate", "-o", str(path), *args, "--epoch", "1e9", "-q")
    assert result.code == 0, result.err
    digest = hashlib.sha256()
    batches = 0
    for batch in open_recording(path):
        batches += 1
        for frame in batch.frames:
            digest.update(len(frame).to_bytes(8, "big"))
            digest.update(frame)
    assert batches == 1502
    assert digest.hexdigest() == RECORDING_DIGEST
