"""`check` rules: one curated broken stream per rule is flagged with exactly its rule id(s),
clean streams from every producer shape are not flagged, and no input makes the checker raise."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.checks import ERROR, INFO, RULES, WARNING, Checker, idle_workers, rules_markdown
from kvctl.events import Batch
from kvctl.formats import decode_nats, decode_zmq, dynamo, engine_zmq

SRC = "tcp://engine:5557"
BS = 4


def stored(hashes, parent=None, size=BS, tokens=None, **extra):
    if tokens is None:
        tokens = list(range(size * len(hashes)))
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **extra,
    }


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def mk(events, seq=0, ts=None, source=SRC, **kw) -> Batch:
    return Batch(
        source=source,
        events=events,
        format="engine-map",
        seq=seq,
        ts=float(seq) if ts is None else ts,
        recv_ns=(seq + 1) * 10**9,
        publisher=source,
        **kw,
    )


def stream(*event_lists, source=SRC):
    """One batch per event list, seq 0.. and ts rising."""
    return [mk(evs, seq=i, source=source) for i, evs in enumerate(event_lists)]


def run(batches, sources=(), **opts):
    ck = Checker(**opts)
    for b in batches:
        ck.feed(b)
    return ck.finish(sources)


def engine_workload(seed=1, n=60, capacity=40):
    """Canonical events of a small well-behaved engine: prompts stored whole (parent None),
    decode blocks chained, LRU eviction of whole chains, capacity respected."""
    rng = random.Random(seed)
    chains: list[list[int]] = []
    cached = 0
    out = []
    for _ in range(n):
        evs = []
        if chains and rng.random() < 0.5:
            chain = rng.choice(chains)
            h = rng.getrandbits(64)
            evs.append(stored([h], parent=chain[-1]))
            chain.append(h)
            cached += 1
        else:
            hs = [rng.getrandbits(64) for _ in range(rng.randint(2, 4))]
            evs.append(stored(hs))
            chains.append(list(hs))  # the event keeps its own list
            cached += len(hs)
        while cached > capacity:
            old = chains.pop(0)
            evs.append(removed(list(reversed(old))))
            cached -= len(old)
        out.append(evs)
    return out


@pytest.mark.parametrize("encoding", engine_zmq.ENGINE_ENCODINGS)
def test_clean_engine_streams_are_not_flagged(encoding):
    batches = []
    for seq, evs in enumerate(engine_workload()):
        payload = engine_zmq.encode_payload(evs, ts=100.0 + seq, dp_rank=0, encoding=encoding)
        batches.append(
            decode_zmq(engine_zmq.encode_frames(b"", seq, payload), SRC, recv_ns=seq * 10**6)
        )
    report = run(batches, sources=[SRC], block_size=BS, num_blocks=40, expect_workers=1)
    assert report.rule_ids == set(), report.to_json()
    assert not report.has_errors
    assert report.events > 60


def test_clean_dynamo_stream_is_not_flagged():
    batches = []
    for seq, evs in enumerate(engine_workload(seed=2)):
        rev = [
            dynamo.router_event(e, worker_id=7, event_id=i, dp_rank=0) for i, e in enumerate(evs)
        ]
        data = dynamo.encode_envelope(rev, publisher_id=3, sequence=seq, published_at_ms=1000 + seq)
        batches.append(decode_nats("namespace.ns.component.c.kv-events", data, "nats://n"))
    report = run(batches, num_blocks=40, expect_workers=1)
    assert report.rule_ids == set(), report.to_json()
    assert report.workers == ["7[dp0]"]


# --- one broken stream per rule ----------------------------------------------------------------


def _orphans():
    return stream(*[[stored([i + 1])] for i in range(20)])


BROKEN = {
    "KV001": lambda: [decode_zmq([b"garbage"], SRC)],
    "KV002": lambda: stream([{"type": "BlockStored", "block_hashes": 5}]),
    "KV003": lambda: stream([{"type": "BlockFrobbed"}]),
    "KV004": lambda: stream([stored([1], frobnicate=True)]),
    "KV101": lambda: stream([stored([1])], [removed([2])]),
    "KV102": lambda: stream([stored([1])], [stored([3], parent=2)]),
    "KV103": lambda: stream([stored([1, 2])], [stored([2], parent=1)]),
    "KV104": lambda: stream([stored([1, 2])], [stored([3], parent=2)]),
    "KV105": _orphans,
    "KV201": lambda: stream([stored([1, 2], tokens=[0, 1, 2])]),
    "KV202": lambda: stream([stored([1], size=16)]),
    "KV203": lambda: stream([stored([1])], [stored([2], parent=1, size=8)]),
    "KV204": lambda: stream([stored([-5])], [stored([(1 << 63) + 1], parent=-5)]),
    "KV205": lambda: stream([stored([bytes(32)])]),
    "KV206": lambda: stream([stored([1 << 64])], [stored(["abc"])]),
    "KV301": lambda: [mk([], seq=0), mk([], seq=1), mk([], seq=4)],
    "KV302": lambda: [mk([], seq=0), mk([], seq=1), mk([], seq=1)],
    "KV303": lambda: [mk([], seq=0), mk([], seq=2), mk([], seq=1)],
    "KV304": lambda: [mk([], seq=0), mk([], seq=1), mk([], seq=0, ts=5.0)],
    "KV305": lambda: [mk([], seq=0, ts=10.0), mk([], seq=1, ts=9.0)],
}
# Rules that necessarily come with another one.
ALSO = {"KV303": {"KV301"}, "KV202": set(), "KV203": {"KV202"}}


@pytest.mark.parametrize("rule_id", sorted(BROKEN))
def test_each_rule_is_flagged(rule_id):
    opts = {"block_size": BS, "num_blocks": 2 if rule_id == "KV104" else None}
    report = run(BROKEN[rule_id](), **opts)
    assert report.rule_ids == {rule_id} | ALSO.get(rule_id, set()), report.to_json()
    res = report.get(rule_id)
    assert res is not None and res.count >= 1 and res.examples
    assert res.rule.severity == RULES[rule_id].severity
    assert report.has_errors == any(RULES[r].severity == ERROR for r in report.rule_ids)
    json.dumps(report.to_json())


def test_worker_silent_by_count_and_by_source():
    report = run(stream([stored([1])]), sources=[SRC, "tcp://other:5557"], expect_workers=2)
    assert report.rule_ids == {"KV306"}
    res = report.get("KV306")
    assert res.count == 2
    assert res.details["seen_workers"] == [f"{SRC}[dp0]"]
    assert report.has_errors


def test_check_silent_is_reported_once_and_idle_helper():
    ck = Checker(expect_workers=2)
    assert [f.rule for f in ck.check_silent(["a"])] == ["KV306", "KV306"]
    assert ck.check_silent(["a"]) == []
    ck.feed(mk([stored([1])], source="b"))
    assert idle_workers(ck.last_seen_ns, now_ns=5 * 10**9, timeout_s=3) == ["b"]
    assert idle_workers(ck.last_seen_ns, now_ns=2 * 10**9, timeout_s=3) == []


def test_example_details():
    report = run(stream([stored([1])], [removed([(1 << 64) - 1])]))
    f = report.get("KV101").examples[0]
    assert (f.rule, f.name, f.severity, f.source, f.seq, f.ts) == (
        "KV101",
        "remove-unknown-block",
        ERROR,
        SRC,
        1,
        1.0,
    )
    assert f.to_json()["hash"] == (1 << 64) - 1
    assert f.worker == f"{SRC}[dp0]"
    r = report.to_json()
    assert r["ok"] is False and r["errors"] == 1
    assert [x["id"] for x in r["rules"]] == ["KV101"]


def test_unknown_fields_are_named_and_array_extras_count():
    payload = engine_zmq.encode_payload([stored([1])], ts=1.0, encoding="vllm-array")
    import msgpack

    obj = msgpack.unpackb(payload)
    obj[1][0].append("surprise")  # a 13th array element: a future vLLM field
    b = decode_zmq(engine_zmq.encode_frames(b"", 0, msgpack.packb(obj)), SRC)
    report = run([b, mk([stored([2], parent=1, zz=1)], seq=1)])
    res = report.get("KV004")
    assert res.rule.severity == INFO and res.count == 2
    assert res.details["fields"] == {"field_12": 1, "zz": 1}
    assert not report.has_errors


def test_feed_returns_live_findings_capped_per_rule():
    ck = Checker(max_examples=2)
    new = ck.feed(mk([removed([i]) for i in range(5)]))
    assert [f.rule for f in new] == ["KV101", "KV101"]
    assert ck.feed(mk([removed([9])], seq=1)) == []
    assert ck.finish().get("KV101").count == 6
    ck = Checker(max_examples=2, report_all=True)
    assert len(ck.feed(mk([removed([i]) for i in range(5)]))) == 5


def test_recovered_batches_fill_gaps():
    batches = [
        mk([], seq=0),
        mk([], seq=3),
        mk([], seq=1, recovered=True),
        mk([], seq=2, recovered=True),
        mk([], seq=4),
    ]
    report = run(batches)
    assert report.rule_ids == {"KV301"}
    assert report.get("KV301").details == {"missing_batches": 2, "recovered_batches": 2}


def test_missing_parent_heuristic_spares_chained_single_block_stores():
    # SGLang style: one page per event, chained: a parentless first page per sequence only.
    evs = []
    h = 0
    for _ in range(10):
        parent = None
        for _ in range(4):
            h += 1
            evs.append([stored([h], parent=parent)])
            parent = h
    assert run(stream(*evs)).rule_ids == set()


def test_capacity_counts_each_crossing():
    report = run(stream([stored([1, 2, 3])], [removed([3])], [stored([4], parent=2)]), num_blocks=2)
    assert report.get("KV104").count == 2


def test_severities_are_known():
    assert {r.severity for r in RULES.values()} == {ERROR, WARNING, INFO}
    assert all(r.id == k for k, r in RULES.items())
    table = rules_markdown()
    assert all(f"| {k} | {r.name} | {r.severity} |" in table for k, r in RULES.items())


# --- robustness ---------------------------------------------------------------------------------

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 80), max_value=1 << 80),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=33),
)
hashes = st.one_of(st.lists(junk, max_size=4), junk)
events = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X", 3])},
        optional={
            "block_hashes": hashes,
            "parent_block_hash": junk,
            "token_ids": st.one_of(st.lists(st.integers(0, 9), max_size=20), junk),
            "block_size": st.one_of(st.integers(-2, 20), junk),
            "group_idx": st.one_of(junk, st.lists(junk, max_size=2)),
            "worker_id": st.one_of(junk, st.lists(junk, max_size=2)),
            "dp_rank": junk,
            "extra": junk,
        },
    ),
    junk,
)
batches = st.builds(
    Batch,
    source=st.sampled_from(["a", "b"]),
    events=st.lists(events, max_size=6),
    format=st.just("x"),
    seq=st.one_of(st.none(), st.integers(-3, 8)),
    ts=st.one_of(st.none(), st.floats()),
    recv_ns=st.integers(0, 10**10),
    worker_id=junk,
    dp_rank=st.one_of(st.none(), st.integers(0, 3)),
    error=st.one_of(st.none(), st.text(max_size=3)),
    recovered=st.booleans(),
    # what decoders give (Batch.publisher is always hashable): a source, (source, publisher_id)
    publisher=st.one_of(
        st.none(), st.text(max_size=3), st.tuples(st.text(max_size=3), st.integers())
    ),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(batches, max_size=8))
def test_checker_never_raises(bs):
    ck = Checker(block_size=4, num_blocks=3, expect_workers=2)
    for b in bs:
        for f in ck.feed(b):
            json.dumps(f.to_json())
    json.dumps(ck.finish(["a", "c"]).to_json())


def test_dynamo_json_stream_with_unknown_parent():
    ev = dynamo.router_event(stored([2], parent=1), worker_id=1, event_id=0)
    b = decode_nats("s", dynamo.encode_json(ev), "nats://n")
    report = run([b])
    assert report.rule_ids == {"KV102"}
