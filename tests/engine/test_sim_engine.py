"""Tests of the pure synthetic engine: pool, scheduler, workloads, fleet stream invariants."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.engine import (
    BlockPool,
    ChatParams,
    Fleet,
    FleetConfig,
    Request,
    Worker,
    block_hash,
    chain_hashes,
    expand_trace_tokens,
    trace_block_tokens,
)
from kvctl.engine.workload import TraceWorkload
from kvctl.events import BLOCK_REMOVED, BLOCK_STORED

SMALL = ChatParams(
    prefix_len=(20, 60),
    first_user_median=24,
    followup_median=12,
    output_median=12,
    mean_turns=3.0,
    max_context=400,
)


def check_stream(batches, workers: int, num_blocks: int, block_size: int):
    """Assert the per-worker stream invariants; return each worker's cached {hash: parent}."""
    cached: list[dict] = [{} for _ in range(workers)]
    kids: list[defaultdict] = [defaultdict(int) for _ in range(workers)]
    last_t = float("-inf")
    for t, i, events in batches:
        assert t >= last_t, "time goes backwards"
        last_t = t
        assert events, "a step without events must yield nothing"
        c, k = cached[i], kids[i]
        for e in events:
            hashes = e["block_hashes"]
            assert hashes
            if e["type"] == BLOCK_STORED:
                assert e["block_size"] == block_size
                assert len(e["token_ids"]) == block_size * len(hashes)
                assert e["medium"] == "GPU" and e["lora_id"] is None and e["lora_name"] is None
                parent = e["parent_block_hash"]
                assert parent is None or parent in c, "parent not cached at store time"
                for j, h in enumerate(hashes):
                    toks = e["token_ids"][j * block_size : (j + 1) * block_size]
                    assert h == block_hash(parent, toks), "hash is not content-addressed"
                    assert h not in c, "stored twice while cached"
                    assert 0 <= h < 1 << 64
                    c[h] = parent
                    if parent is not None:
                        k[parent] += 1
                    parent = h
                assert len(c) <= num_blocks, "occupancy exceeds num_blocks"
            else:
                assert e["type"] == BLOCK_REMOVED
                for h in hashes:
                    assert h in c, "removal of a block not stored (or already removed)"
                    assert k.get(h, 0) == 0, "parent evicted while a descendant is cached"
                    parent = c.pop(h)
                    if parent is not None:
                        k[parent] -= 1
    return cached


def run(**kw):
    fleet = Fleet(FleetConfig(**kw))
    return fleet, list(fleet.run())


# -- pool -----------------------------------------------------------------------------------


def test_hash_is_chained_u64_and_prefix_stable():
    toks = list(range(64))
    hs = chain_hashes(toks, 16)
    assert len(hs) == 4 and all(0 <= h < 1 << 64 for h in hs)
    assert chain_hashes(toks[:40], 16) == hs[:2]  # partial block gets no hash
    assert hs[1] == block_hash(hs[0], toks[16:32])
    assert block_hash(None, toks[16:32]) != hs[1]  # the parent matters
    assert chain_hashes([9] + toks[1:], 16)[3] != hs[3]  # a change propagates down the chain


def test_pool_lru_evicts_tail_first_and_dedups():
    pool = BlockPool(4, block_size=2)
    removed: list[int] = []
    assert pool.allocate(3, removed) and pool.empty == 1
    for h in (1, 2, 3):
        assert pool.commit(h)
    pool.release([1, 2, 3])  # chain 1 <- 2 <- 3: free list must be 3, 2, 1
    assert list(pool.free) == [3, 2, 1] and pool.used == 0 and pool.cached == 3
    assert not pool.allocate(5, removed) and removed == []  # all or nothing
    assert pool.allocate(2, removed) and removed == [3]  # empty block first, then LRU tail
    assert pool.match([1, 2, 3]) == 2 == pool.match_sorted([1, 2, 3])
    pool.touch([1])  # a hit pins the root
    assert pool.allocate(1, removed) and removed == [3, 2]
    assert pool.available == 0 and not pool.allocate(1, removed)
    # a block filled with an already-cached hash is shared; its copy goes back to empty
    assert not pool.commit(1) and pool.refs[1] == 2 and pool.empty == 1


def test_worker_prefix_hit_and_events():
    w = Worker(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks + 2
    r1 = Request(0, prompt + [1, 2, 3], len(prompt))
    assert w.add(r1)
    stored = []
    while w.has_work:
        events, dt, _ = w.step()
        assert dt > 0
        stored += [e for e in events if e["type"] == BLOCK_STORED]
    # chunks of 8 tokens: blocks 0-1, then 2-3 (parent = block 1), then block 4 at decode
    assert [len(e["block_hashes"]) for e in stored] == [2, 2, 1]
    assert stored[0]["parent_block_hash"] is None
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]
    assert w.hit_tokens == 0 and w.prompt_tokens == 18
    # the same prompt again: 4 full blocks hit, nothing re-published for them
    r2 = Request(1, prompt + [7, 7, 7], len(prompt))
    w.add(r2)
    events, _, _ = w.step()
    assert w.hit_tokens == 16 and r2.hit_tokens == 16
    assert not any(e["type"] == BLOCK_STORED for e in events)
    # an exactly block-aligned repeat still computes its last token (hit = all but one block)
    w2 = Worker(num_blocks=64, block_size=4)
    for rid in range(2):
        w2.add(Request(rid, list(range(16)) + [5], 16))
        while w2.has_work:
            w2.step()
    assert w2.hit_tokens == 12


def test_preemption_under_pressure_keeps_stream_consistent():
    # 12 blocks of 4 tokens, requests of up to 11 blocks: steady preemption
    fleet, batches = run(
        workers=1,
        num_blocks=12,
        block_size=4,
        rate=50.0,
        requests=60,
        seed=3,
        max_num_batched_tokens=16,
        chat=ChatParams(
            prefix_len=(8, 16),
            first_user_median=16,
            followup_median=8,
            output_median=16,
            max_context=44,
        ),
    )
    cached = check_stream(batches, 1, 12, 4)
    w = fleet.workers[0]
    assert w.preemptions > 0 and w.removed_blocks > 0
    assert w.finished + w.rejected == 60 and not w.has_work
    assert set(cached[0]) == set(w.pool.refs)
    assert w.pool.used == 0 and w.pool.empty + len(w.pool.free) == 12


# -- fleet ----------------------------------------------------------------------------------


@pytest.mark.parametrize("router", ["random", "round-robin", "kv", "prefix"])
def test_fleet_stream_invariants(router):
    fleet, batches = run(
        workers=3,
        num_blocks=96,
        block_size=4,
        rate=30.0,
        requests=250,
        seed=7,
        router=router,
        chat=SMALL,
        max_num_batched_tokens=64,
    )
    cached = check_stream(batches, 3, 96, 4)
    assert sum(w.removed_blocks for w in fleet.workers) > 0  # eviction really happened
    for w, c in zip(fleet.workers, cached, strict=True):
        assert set(c) == set(w.pool.refs)  # the stream mirrors the pool
        assert not w.has_work
    total = fleet.stats()["total"]
    assert total["finished"] + total["rejected"] == 250
    assert total["stored_blocks"] == sum(
        len(e["block_hashes"]) for _, _, ev in batches for e in ev if e["type"] == BLOCK_STORED
    )


def test_equal_prompts_hash_equally_across_workers():
    fleet, batches = run(
        workers=4, router="round-robin", requests=40, rate=20.0, prefixes=1, seed=5
    )
    expected = chain_hashes(fleet.workload.system_prompts[0], 16)
    seen: list[dict] = [{} for _ in range(4)]
    for _, i, events in batches:
        for e in events:
            if e["type"] == BLOCK_STORED:
                for j, h in enumerate(e["block_hashes"]):
                    seen[i][h] = e["token_ids"][j * 16 : (j + 1) * 16]
    for s in seen:  # every worker computed the shared system prompt: same hashes everywhere
        assert all(h in s for h in expected)
    common = set(seen[0]).intersection(*seen[1:])
    assert set(expected) <= common
    for h in common:
        assert all(s[h] == seen[0][h] for s in seen)


def test_kv_router_beats_random_on_shared_prefixes():
    cfg = dict(workers=4, num_blocks=2048, rate=12.0, requests=500, prefixes=8, seed=11)
    rates, routed = {}, {}
    for router in ("random", "kv", "prefix"):
        fleet, _ = run(router=router, **cfg)
        rates[router] = fleet.stats()["total"]["hit_rate"]
        routed[router] = fleet.routed
    assert rates["kv"] > rates["random"] + 0.1, rates
    assert rates["prefix"] > rates["random"] + 0.1, rates
    assert min(routed["kv"]) > 500 / 4 / 2, routed  # kv also balances load


def test_kv_router_spreads_a_prefix_every_request_shares(tmp_path):
    # every request starts with hash id 0 (like the conversation trace): `prefix` sends all of
    # them to the first worker that cached it, `kv` weighs the hit against the load
    path = tmp_path / "t.jsonl"
    lines = [
        {
            "timestamp": 50 * i,
            "input_length": 1500,
            "output_length": 20,
            "hash_ids": [0, 3 * i + 1, 3 * i + 2, 3 * i + 3],
        }
        for i in range(120)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    prefix, _ = run(workers=4, trace=str(path), router="prefix")
    kv, _ = run(workers=4, trace=str(path), router="kv")
    assert prefix.routed[0] == 120
    assert min(kv.routed) >= 15, kv.routed


def test_determinism_by_seed():
    cfg = dict(
        workers=3, num_blocks=128, block_size=8, rate=25.0, requests=120, chat=SMALL, router="kv"
    )
    a = run(seed=1, **cfg)[1]
    b = run(seed=1, **cfg)[1]
    c = run(seed=2, **cfg)[1]
    assert json.dumps(a) == json.dumps(b)
    assert json.dumps(a) != json.dumps(c)
    d = run(seed=1, router="random", **{k: v for k, v in cfg.items() if k != "router"})[1]
    e = run(seed=1, router="random", **{k: v for k, v in cfg.items() if k != "router"})[1]
    assert d == e


def test_duration_stops_the_clock():
    fleet, batches = run(workers=2, rate=50.0, duration=2.0, seed=0)
    assert batches and all(t <= 2.0 for t, _, _ in batches)
    assert fleet.now <= 2.0


# -- trace mode -----------------------------------------------------------------------------


def test_trace_expansion_rules():
    a = expand_trace_tokens([0, 1, 2], 1100)
    assert len(a) == 1100
    assert a[:512] == list(trace_block_tokens(0)) and a[512:1024] == list(trace_block_tokens(1))
    assert a[1024:] == list(trace_block_tokens(2))[:76]  # the last block is partial
    b = expand_trace_tokens([0, 1, 5], 1536)
    assert b[:1024] == a[:1024] and b[1024:] != a[1024:]  # equal ids, equal tokens
    assert trace_block_tokens(3) == trace_block_tokens(3) != trace_block_tokens(4)
    with pytest.raises(ValueError):
        expand_trace_tokens([0], 600)


def test_trace_fleet(tmp_path):
    recs = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1300, "output_length": 3, "hash_ids": [0, 1, 3]},
        {"timestamp": 2000, "input_length": 700, "output_length": 2, "hash_ids": [4, 5]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 0, "hash_ids": [0, 1, 2]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    wl = TraceWorkload(path, speedup=2.0)
    assert wl.peek() == 0.0
    r0 = wl.take()
    assert r0.prompt_len == 1100 and r0.output_len == 5 and wl.peek() == 0.25

    fleet, batches = run(workers=1, trace=str(path), speedup=1.0)
    check_stream(batches, 1, 4096, 16)
    w = fleet.workers[0]
    assert w.finished == 4
    # request 2 reuses ids 0,1 (1024 tokens = 64 blocks); request 4 repeats request 1 whose
    # 1100-token prompt has 68 full 16-token blocks (the last, partial block never is cached)
    assert w.prompt_tokens == 1100 + 1300 + 700 + 1100
    assert w.hit_tokens == 1024 + 68 * 16
    # the last request computes 12 tokens of a partial block: a step without events
    assert batches[0][0] > 0.0 and 2.0 < batches[-1][0] < 3.0


# -- property: random small workloads keep every invariant ------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workers=st.integers(1, 3),
    num_blocks=st.integers(8, 80),
    block_size=st.sampled_from([1, 2, 4, 16]),
    budget=st.sampled_from([4, 16, 64, 2048]),
    router=st.sampled_from(["random", "round-robin", "kv", "prefix"]),
    prefixes=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_random_small_workloads_keep_invariants(
    workers, num_blocks, block_size, budget, router, prefixes, seed
):
    fleet, batches = run(
        workers=workers,
        num_blocks=num_blocks,
        block_size=block_size,
        router=router,
        prefixes=prefixes,
        seed=seed,
        rate=40.0,
        requests=40,
        chat=SMALL,
        max_num_batched_tokens=budget,
        max_num_seqs=8,
    )
    cached = check_stream(batches, workers, num_blocks, block_size)
    for w, c in zip(fleet.workers, cached, strict=True):
        assert set(c) == set(w.pool.refs)
        assert w.pool.used == 0 and not w.has_work
        assert w.pool.empty + len(w.pool.free) == num_blocks
        assert 0.0 <= w.hit_rate <= 1.0
    total = fleet.stats()["total"]
    assert total["finished"] + total["rejected"] == 40
