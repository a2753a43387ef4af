"""kvctl index: the router's view (``state.RouterIndex``), Dynamo's query hashing, and the
HTTP server with every endpoint, fed by real recordings. The decisions asserted here are the
ones Dynamo 1.6's standalone indexer was seen to make (tests/test_index_dynamo.py compares the
two on one stream)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from conftest import finish, interrupt, read_until, run_kvctl, start_kvctl
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.events import Batch
from kvctl.formats.dynamo import tokens_hash
from kvctl.recording.source import RecordingSource
from kvctl.state import RouterIndex, dynamo_block_hashes

T = lambda a, b: list(range(a, b))  # noqa: E731


def store(hashes, parent, tokens, medium=None, lora_name=None, block_size=4) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": 1 if lora_name else None,
        "medium": medium,
        "lora_name": lora_name,
    }


def remove(hashes, medium=None) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


CLEARED = {"type": "AllBlocksCleared"}


def feed(index: RouterIndex, worker, events, dp=None) -> None:
    index.apply(
        Batch(
            source=f"src{worker}", events=events, format="engine-map", worker_id=worker, dp_rank=dp
        )
    )


def chains(dump: dict) -> set[tuple]:
    """Every block of a /dump with its parent link: equal however the stores are split."""
    out = set()
    for key, model in dump.items():
        for ev in model["events"]:
            stored = ev["event"]["data"]["stored"]
            parent = stored["parent_hash"]
            for block in stored["blocks"]:
                out.add(
                    (key, ev["worker_id"], ev["event"]["dp_rank"], ev["storage_tier"], parent)
                    + (block["block_hash"], block["tokens_hash"])
                )
                parent = block["block_hash"]
    return out


def ask(index: RouterIndex, tokens, lora=None) -> dict:
    return index.response(index.query(tokens, lora))


# --- hashing ----------------------------------------------------------------------------------


def test_query_hashing_is_dynamos():
    # the value Dynamo's indexer showed in /dump for the block of tokens 0..3
    assert dynamo_block_hashes(T(0, 6), 4) == [9143094415614847814]  # the partial block: none
    assert dynamo_block_hashes(T(0, 8), 4)[1] == 12124091508212882195
    assert dynamo_block_hashes(T(0, 4), 4, "myl") == [tokens_hash(T(0, 4), "myl")]
    assert dynamo_block_hashes(T(0, 4), 4, "myl") != dynamo_block_hashes(T(0, 4), 4)
    assert dynamo_block_hashes([], 4) == []


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=40),
    st.integers(1, 9),
    st.none() | st.text(max_size=8),
)
def test_query_hashing_is_per_full_block(tokens, size, lora):
    hashes = dynamo_block_hashes(tokens, size, lora)
    assert len(hashes) == len(tokens) // size
    expected = [tokens_hash(tokens[i * size : (i + 1) * size], lora) for i in range(len(hashes))]
    assert hashes == expected


@given(st.lists(st.integers(), min_size=4, max_size=8))
def test_token_ids_no_u32_holds_are_refused(tokens):
    """From a query: ValueError (the server answers 422 before); from an event: not indexed."""
    hashed = tokens[: len(tokens) - len(tokens) % 4]  # a partial last block is not hashed
    if all(0 <= t < 2**32 for t in hashed):
        return
    with pytest.raises(ValueError):
        dynamo_block_hashes(tokens, 4)
    ix = RouterIndex(4)
    feed(ix, 1, [store([1], None, tokens[:4])])
    if not all(0 <= t < 2**32 for t in tokens[:4]):
        assert ix.decisions == {("stored", "device", "invalid_block"): 1}


# --- the decisions ----------------------------------------------------------------------------


def test_query_shape_per_worker_dp_rank_and_tier():
    """Exactly the JSON Dynamo's indexer answered for this stream."""
    ix = RouterIndex(4)
    feed(ix, 1, [store([101, 102, 103], None, T(0, 12))])
    feed(ix, 1, [store([201, 202], None, T(0, 8))], dp=1)
    feed(ix, 2, [store([301], None, T(0, 4), medium="CPU")])
    assert ask(ix, T(0, 14)) == {
        "scores": {"1": {"1": 8, "0": 12}},
        "frequencies": [],
        "instances": {
            "2": {"longest_matched": 4, "gpu": 0, "dp": {"0": 0}, "cpu": 4, "disk": 4},
            "1": {"longest_matched": 12, "gpu": 12, "dp": {"0": 12, "1": 8}, "cpu": 12, "disk": 12},
        },
    }
    assert ask(ix, T(0, 14), lora="x") == {"scores": {}, "frequencies": [], "instances": {}}
    assert ask(ix, []) == {"scores": {}, "frequencies": [], "instances": {}}


def test_removal_ends_the_edge_and_unknown_removal_changes_nothing():
    ix = RouterIndex(4)
    feed(ix, 1, [store([10, 11, 12], None, T(0, 12))])
    feed(ix, 1, [remove([11])])
    assert ix.query(T(0, 12)).device == {(1, 0): 1}
    feed(ix, 1, [store([13], 12, T(12, 16))])  # under a descendant of the removed block
    assert ix.query(T(0, 16)).device == {(1, 0): 1}
    assert ix.decisions[("stored", "device", "parent_block_not_found")] == 1
    before = ix.dump()
    feed(ix, 1, [remove([777])])
    assert ix.dump() == before
    feed(ix, 1, [store([20, 21], None, T(200, 208))])
    feed(ix, 1, [remove([778, 20])])  # the unknown hash does not stop the known one
    assert ix.query(T(200, 208)).device == {}
    assert ix.decisions[("removed", "device", "block_not_found")] == 2


def test_store_with_unknown_parent_is_rejected_on_the_device_tier_only():
    ix = RouterIndex(4)
    feed(ix, 2, [store([1, 2], None, T(0, 8)), store([9], 5555, T(8, 12))])
    assert ix.query(T(0, 12)).device == {(2, 0): 2}
    # lower tiers take any parent; the host walk continues the device match
    feed(ix, 2, [store([3], 2, T(8, 12), "CPU"), store([4], 3, T(12, 16), "CPU")])
    feed(ix, 2, [store([5], 999, T(16, 20), "CPU"), store([6], 4, T(16, 20), "DISK")])
    assert ask(ix, T(0, 20))["instances"]["2"] == {
        "longest_matched": 20,
        "gpu": 8,
        "dp": {"0": 8},
        "cpu": 16,
        "disk": 20,
    }
    feed(ix, 2, [remove([3], "CPU")])
    assert ask(ix, T(0, 20))["instances"]["2"]["cpu"] == 8


def test_cleared_is_one_worker_and_dp_rank_every_tier():
    ix = RouterIndex(4)
    feed(ix, 1, [store([1, 2, 3], None, T(0, 12))])
    feed(ix, 1, [store([1], None, T(0, 4)), store([7], None, T(50, 54), "CPU")], dp=1)
    feed(ix, 1, [CLEARED], dp=1)
    assert ix.query(T(0, 12)).device == {(1, 0): 3}
    assert not any(ix.query(T(50, 54)).lower.values())
    feed(ix, 1, [CLEARED])
    assert ix.query(T(0, 12)).device == {} and ix.dump()["default:default"]["events"] == []


def test_media_tiers_block_size_and_short_tokens():
    ix = RouterIndex(4)
    tiers = {"CPU_PINNED": "cpu", "CPU_TIER1": "cpu", "DISK": "disk", "STORAGE": "disk"}
    for i, (medium, seen) in enumerate({**tiers, "EXTERNAL": "disk", "GPU": "gpu"}.items()):
        feed(ix, 2, [store([1000 + i], None, T(100 * i, 100 * i + 4), medium)])
        got = ask(ix, T(100 * i, 100 * i + 4))["instances"]["2"]
        assert got[seen] == 4 and (seen == "gpu" or got["gpu"] == 0), medium
    for i, medium in enumerate(["cpu", "weird"]):  # not indexed, as Dynamo drops them
        feed(ix, 2, [store([2000 + i], None, T(5000 + 4 * i, 5004 + 4 * i), medium)])
        assert ask(ix, T(5000 + 4 * i, 5004 + 4 * i))["instances"] == {}
    feed(ix, 2, [store([4000, 4001], None, T(4000, 4008), block_size=8)])
    assert ix.query(T(4000, 4008)).device == {}
    feed(ix, 2, [store([6000, 6001], None, T(6000, 6006))])  # tokens for 1.5 blocks
    assert ix.query(T(6000, 6008)).device == {(2, 0): 1}
    feed(ix, 2, [store([3000], None, T(3000, 3004), lora_name="myl")])
    assert ix.query(T(3000, 3004)).device == {}
    assert ix.query(T(3000, 3004), "myl").device == {(2, 0): 1}


def test_dump_matches_dynamos_and_rebuilds_the_index(tmp_path):
    ix = RouterIndex(4)
    feed(ix, 1, [store([101, 102, 103], None, T(0, 12))])
    feed(ix, 1, [store([201, 202], None, T(0, 8))], dp=1)
    events = ix.dump()["default:default"]["events"]
    # Dynamo dumped this stream as these stores (dp 1 shows the first worker's hashes)
    assert [
        (
            e["worker_id"],
            e["event"]["dp_rank"],
            e["event"]["data"]["stored"]["parent_hash"],
            [b["block_hash"] for b in e["event"]["data"]["stored"]["blocks"]],
        )
        for e in events
    ] == [(1, 0, None, [101, 102, 103]), (1, 1, None, [101, 102])]
    snapshot = tmp_path / "snap.json"
    snapshot.write_text(json.dumps(ix.dump()))
    from kvctl.indexing import load_snapshot

    again = load_snapshot(snapshot)
    assert again.dump() == ix.dump()
    assert ask(again, T(0, 12)) == ask(ix, T(0, 12))


# --- against a naive model --------------------------------------------------------------------

CHAINS = [T(0, 16), T(0, 8) + T(100, 108), T(200, 212), T(0, 4) + T(300, 304)]


def path_of(chain: int, n: int) -> tuple:
    """Content-derived engine hashes, as vLLM's: a block's hash names its whole prefix."""
    return tuple(CHAINS[chain][: 4 * n])


op = st.tuples(
    st.sampled_from(["store", "remove", "clear"]),
    st.integers(0, 2),  # worker
    st.integers(0, len(CHAINS) - 1),
    st.integers(1, 4),  # block count / position
)


def tail_removal(held: set[tuple], path: tuple) -> bool:
    """Engines evict a chain from its end: no block the worker holds hangs below this one."""
    return path in held and not any(len(p) > len(path) and p[: len(path)] == path for p in held)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=30))
def test_the_index_answers_as_a_naive_model_of_dynamos_rules(ops):
    """A worker holds token prefixes; a store needs its parent prefix held, a removal from a
    chain's end drops that prefix, a clear empties the worker; a query matches the longest run
    of held prefixes from the first block. (Removals inside a chain depend on how Dynamo's
    compressed tree happens to be split: tests/test_index_dynamo.py compares those with
    Dynamo itself.) The /dump rebuilds an index that answers the same."""
    ix = RouterIndex(4)
    held: dict[int, set[tuple]] = {w: set() for w in range(3)}
    for kind, w, chain, n in ops:
        path = path_of(chain, n)
        if len(path) < 4 * n:
            continue
        h = hash(path) & (2**64 - 1)
        if kind == "store":
            parent = path_of(chain, n - 1)
            ph = hash(parent) & (2**64 - 1) if parent else None
            feed(ix, w, [store([h], ph, list(path[-4:]))])
            if not parent or parent in held[w]:
                held[w].add(path)
        elif kind == "remove":
            if tail_removal(held[w], path):
                feed(ix, w, [remove([h])])
                held[w].discard(path)
        else:
            feed(ix, w, [CLEARED])
            held[w] = set()
    rebuilt = RouterIndex.from_dump(json.loads(json.dumps(ix.dump())))
    for chain in CHAINS:
        expected = {}
        for w in range(3):
            n = 0
            while n < len(chain) // 4 and tuple(chain[: 4 * (n + 1)]) in held[w]:
                n += 1
            if n:
                expected[(w, 0)] = n
        assert ix.query(chain).device == expected
        assert rebuilt.query(chain).device == expected
    for node in ix._nodes():  # a worker covers an edge whole or a part of it, never both
        assert not node.full & node.cut.keys()


# --- the command and its server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("index") / "sim.parquet")
    done = run_kvctl(
        "simulate", "--workers", "3", "--requests", "60", "--num-blocks", "150", "--seed", "5",
        "--epoch", "1700000000", "-o", path, "-q",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return path


def http(url: str, body: bytes | None = None, ctype: str = "application/json"):
    request = urllib.request.Request(url, data=body, headers={"content-type": ctype})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers.get("content-type"), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("content-type"), exc.read()


def serve(*args: str):
    proc = start_kvctl("index", *args, "--port", "0", "--json")
    serving = json.loads(read_until(proc.stdout, '"serving"')[-1])
    return proc, serving["serving"]


def index_of(recording: str, keep=lambda b: True) -> RouterIndex:
    ix = RouterIndex(16)
    for batch in RecordingSource([recording]).batches():
        if keep(batch):
            ix.apply(batch)
    return ix


def test_every_endpoint_on_a_recording(recording):
    proc, url = serve(recording)
    try:
        indexed = json.loads(read_until(proc.stdout, '"indexed"')[-1])["indexed"]
        expected = index_of(recording)
        assert indexed["blocks"] == sum(expected.blocks_per_worker().values()) > 0
        assert http(url + "/health")[:2] == (200, None)
        status, ctype, body = http(url + "/dump")
        assert (status, ctype) == (200, "application/json")
        assert json.loads(body) == json.loads(json.dumps(expected.dump()))
        workers = json.loads(http(url + "/workers")[2])
        assert sorted(w["instance_id"] for w in workers) == sorted(
            {w for w, _ in expected.workers}, key=str
        )
        assert {w["model_name"] for w in workers} == {"default"}
        # a prompt the fleet sent: the first stored chain
        first = next(
            e for b in RecordingSource([recording]).batches() for e in b.events
            if e["type"] == "BlockStored" and e["parent_block_hash"] is None
        )  # fmt: skip
        query = {"token_ids": first["token_ids"], "model_name": "default"}
        status, ctype, body = http(url + "/query", json.dumps(query).encode())
        assert (status, ctype) == (200, "application/json")
        assert json.loads(body) == ask(expected, first["token_ids"])
        errors = [
            ({"token_ids": [1], "model_name": "nope"}, 404),
            ({"token_ids": [1]}, 422),
            ({"token_ids": "abc", "model_name": "default"}, 422),
            ({"token_ids": [-1], "model_name": "default"}, 422),
        ]
        for bad, code in errors:
            assert http(url + "/query", json.dumps(bad).encode())[0] == code, bad
        assert json.loads(http(url + "/query", json.dumps(errors[0][0]).encode())[2]) == {
            "error": "no indexer for model=nope routing_group=default"
        }
        assert http(url + "/query", b"{not json")[0] == 400
        assert http(url + "/query", b"{}", "text/plain")[0] == 415
        assert http(url + "/query")[0] == 405 and http(url + "/nope")[0] == 404
        status, ctype, body = http(url + "/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        text = body.decode()
        stored_ok = expected.decisions[("stored", "device", "ok")]
        labels = '{event_type="stored",storage_tier="device",status="ok"}'
        assert f"kvctl_index_events_applied_total{labels} {stored_ok}" in text
        assert 'kvctl_index_blocks{worker_id="0",dp_rank="0",storage_tier="device"}' in text
        labels = '{event_type="stored",status="ok"}'
        assert f"dynamo_kvrouter_kv_cache_events_applied{labels} {stored_ok}" in text
    finally:
        interrupt(proc)
        rc, _, err = finish(proc)
    assert rc == 130 and "Traceback" not in err


@pytest.mark.parametrize("cut", ["seq", "time"])
def test_until_builds_the_index_as_it_stood(recording, tmp_path, cut):
    batches = list(RecordingSource([recording]).batches())
    middle = batches[len(batches) // 2]
    if cut == "seq":
        until = f"seq:{middle.seq}"
        keep = lambda b: b.seq <= middle.seq  # noqa: E731
    else:
        until = str(middle.recv_ns / 1e9)
        keep = lambda b: b.recv_ns <= middle.recv_ns  # noqa: E731
    snapshot = tmp_path / "until.json"
    rc, err = kvctl("index", recording, "--until", until, "-o", str(snapshot))
    assert rc == 0, err
    truncated = index_of(recording, keep)
    assert json.loads(snapshot.read_text()) == json.loads(json.dumps(truncated.dump()))
    assert truncated.dump() != index_of(recording).dump()
    # the snapshot is served as it was written
    proc, url = serve(str(snapshot))
    try:
        assert chains(json.loads(http(url + "/dump")[2])) == chains(
            json.loads(snapshot.read_text())
        )
    finally:
        interrupt(proc)
        finish(proc)


def kvctl(*args: str) -> tuple[int, str]:
    done = run_kvctl(*args)
    return done.returncode, done.stderr.decode()


def test_bad_input_is_one_line(recording, tmp_path):
    rc, err = kvctl("index", recording, "--until", "yesterday", "-o", str(tmp_path / "x.json"))
    assert rc == 2 and "--until" in err and len(err.strip().splitlines()) == 1
    rc, err = kvctl("index", "tcp://127.0.0.1:1", "--until", "seq:3")
    assert rc == 2 and "recordings" in err
    rc, err = kvctl("index", recording, "--until", "nan")
    assert rc == 2 and "not a time" in err
    taken = tmp_path / "taken.json"
    taken.write_text("mine")
    rc, err = kvctl("index", recording, "-o", str(taken))
    assert rc == 2 and "--overwrite" in err and taken.read_text() == "mine"
    assert kvctl("index", recording, "-o", str(taken), "--overwrite")[0] == 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    rc, err = kvctl("index", str(bad))
    assert rc == 1 and "snapshot" in err and "Traceback" not in err


def test_live_from_dynamo_on_nats(recording, nats_server):
    """A live source in Dynamo's own format (RouterEvents in msgpack envelopes on NATS, with
    Dynamo's tokens_hash per block): the index keeps updating while it serves, and ends up
    as the index of the recording the replay sent."""
    proc = start_kvctl("index", nats_server.url, "--port", "0", "--json", "--idle-timeout", "3")
    try:
        url = json.loads(read_until(proc.stdout, '"serving"')[-1])["serving"]
        read_until(proc.stderr, "reading")  # subscribed before it says so
        assert http(url + "/health")[0] == 200  # serving while it reads
        replay = run_kvctl(
            "replay", recording, "--to", nats_server.url, "--format", "dynamo", "--topspeed", "-q"
        )
        assert replay.returncode == 0, replay.stderr
        json.loads(read_until(proc.stdout, '"indexed"', timeout=30)[-1])
        served = json.loads(http(url + "/dump")[2])
    finally:
        interrupt(proc)
        rc, _, err = finish(proc)
    assert rc == 130 and "Traceback" not in err
    assert chains(served) == chains(json.loads(json.dumps(index_of(recording).dump())))
