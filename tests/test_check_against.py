"""kvctl check --against: a router's index (a real `kvctl index` over HTTP, a /dump file, and
Dynamo's own indexer where it is installed) compared with the engines' truth from the stream.
Drift is injected (the index fed a truncated recording, a snapshot edited) and exactly the
injected blocks must be reported, per worker; a clean comparison reports nothing."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error

import pytest
from conftest import (
    Engine,
    finish,
    free_port,
    free_port_range,
    interrupt,
    read_until,
    removed,
    run_kvctl,
    start_dynamo_indexer,
    start_kvctl,
    stored,
)

from kvctl.checks import Checker, dump_prefixes
from kvctl.events import Batch
from kvctl.recording.source import RecordingSource
from kvctl.state import RouterIndex, worker_label

WORKERS, CUT = 4, 30


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> str:
    """A simulated fleet whose caches evict: stores and removals on every worker."""
    path = str(tmp_path_factory.mktemp("fleet") / "fleet.parquet")
    proc = run_kvctl(
        *("simulate", "--workers", str(WORKERS), "--requests", "80", "--seed", "3"),
        *("--num-blocks", "120", "--epoch", "1700000000", "--topspeed", "-q", "-o", path),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return path


def held(recording: str, until_seq: int | None = None) -> dict[str, set[int]]:
    """What each engine holds after its batches numbered up to ``until_seq``: plain sets (the
    simulated caches evict tails first, so every held block is reachable)."""
    out: dict[str, set[int]] = {}
    for batch in RecordingSource([recording]).batches():
        if until_seq is not None and batch.seq > until_seq:
            continue
        blocks = out.setdefault(worker_label((batch.worker_id, batch.dp_rank or 0)), set())
        for ev in batch.events:
            if ev["type"] == "BlockStored":
                blocks.update(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                blocks.difference_update(ev["block_hashes"])
            else:
                blocks.clear()
    return out


def check(*args: str) -> tuple[int, dict, str]:
    proc = run_kvctl("check", *args, "--json", "--max-examples", "100000", timeout=60)
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == 1, (proc.stdout, proc.stderr)
    return proc.returncode, json.loads(lines[0]), proc.stderr.decode()


def drift(report: dict, rule: str) -> dict[str, set[int]]:
    """The blocks a rule reported, per worker; its per-worker counts agree."""
    out: dict[str, set[int]] = {}
    for res in report["rules"]:
        if res["id"] == rule:
            for f in res["examples"]:
                out.setdefault(f["worker"], set()).add(f["hash"])
            assert res["details"]["workers"] == {w: len(h) for w, h in out.items()}
            assert res["count"] == sum(len(h) for h in out.values())
    return out


def serve(*args: str) -> tuple[subprocess.Popen, str]:
    proc = start_kvctl("index", *args, "--port", "0", "--json", "-q")
    return proc, json.loads(read_until(proc.stdout, '"serving"')[-1])["serving"]


def test_index_fed_a_truncated_recording_drifts_by_exactly_the_later_events(fleet):
    """`kvctl index --until seq:N` misses every later store and removal: each later removal of a
    block it holds is stale there, each block stored later and still held is missing."""
    then, now = held(fleet, CUT), held(fleet)
    stale = {w: then[w] - now[w] for w in now if then[w] - now[w]}
    missing = {w: now[w] - then[w] for w in now if now[w] - then[w]}
    assert len(stale) == len(missing) == WORKERS  # drift on every worker, both ways
    index, url = serve(fleet, "--until", f"seq:{CUT}")
    try:
        rc, report, err = check(fleet, "--against", url)
    finally:
        interrupt(index)
        finish(index)
    assert rc == 3, err  # stale blocks are errors
    assert drift(report, "KV501") == stale
    assert drift(report, "KV502") == missing
    assert report["against"] == {
        "index": url,
        "workers": WORKERS,
        "router_blocks": sum(map(len, then.values())),
        "engine_blocks": sum(map(len, now.values())),
    }
    assert report["rules"][0]["examples"][0]["source"] == url


def test_same_index_reports_no_drift_and_pretty_report_says_so(fleet, tmp_path):
    snapshot = tmp_path / "now.json"
    proc = run_kvctl("index", fleet, "-o", str(snapshot), "-q")
    assert proc.returncode == 0, proc.stderr
    index, url = serve(str(snapshot))
    try:
        rc, report, err = check(fleet, "--against", url + "/dump")
        pretty = run_kvctl("check", fleet, "--against", url, timeout=60)
    finally:
        interrupt(index)
        finish(index)
    assert rc == 0 and report["ok"], err
    assert not {r["id"] for r in report["rules"]} & {"KV501", "KV502"}
    total = sum(map(len, held(fleet).values()))
    assert report["against"]["router_blocks"] == report["against"]["engine_blocks"] == total
    text = pretty.stdout.decode()
    assert pretty.returncode == 0 and f"{total} blocks it holds" in text and "no drift" in text


def test_edited_snapshot_drifts_by_exactly_the_edit(fleet, tmp_path):
    """One worker's leaf edge deleted from the /dump (its blocks: missing), a block the engine
    never stored added under another worker's chain (stale)."""
    snapshot = tmp_path / "now.json"
    assert run_kvctl("index", fleet, "-o", str(snapshot), "-q").returncode == 0
    dump = json.loads(snapshot.read_text())
    (model,) = dump.values()
    events = model["events"]

    def stored(ev: dict) -> dict:
        return ev["event"]["data"]["stored"]

    parents = {(e["worker_id"], stored(e)["parent_hash"]) for e in events}
    leaf = next(  # an edge no other edge of its worker hangs under
        e
        for e in events
        if (e["worker_id"], stored(e)["blocks"][-1]["block_hash"]) not in parents
        and e["worker_id"] == 1
    )
    events.remove(leaf)
    other = next(e for e in events if e["worker_id"] == 2)
    phantom = {"block_hash": 4242, "tokens_hash": 4343, "mm_extra_info": None}
    events.append(
        {
            **other,
            "event": {
                **other["event"],
                "data": {
                    "stored": {
                        "parent_hash": stored(other)["blocks"][-1]["block_hash"],
                        "start_position": None,
                        "blocks": [phantom],
                    }
                },
            },
        }
    )
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(dump))
    rc, report, err = check(fleet, "--against", str(edited))
    assert rc == 3, err
    assert drift(report, "KV501") == {"2[dp0]": {4242}}
    assert drift(report, "KV502") == {"1[dp0]": {b["block_hash"] for b in stored(leaf)["blocks"]}}


def test_same_tokens_under_another_workers_hashes_are_not_drift():
    """Dynamo keeps the first storer's engine hash for a block both workers stored: compared by
    tokens_hash chains, the second worker is in step; by engine hash it would not be."""

    def store(hashes: list[int], parent: int | None, tokens: list[int]) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": 4,
        }

    batches = [
        Batch(
            source="a",
            format="engine-map",
            events=[store([11, 12], None, list(range(8)))],
            worker_id=1,
        ),
        Batch(
            source="b",
            format="engine-map",
            events=[store([21, 22], None, list(range(8)))],
            worker_id=2,
        ),
        Batch(source="b", format="engine-map", events=[store([23], 22, [7] * 4)], worker_id=2),
        Batch(
            source="b", format="engine-map", events=[store([24], 999, [8] * 4)], worker_id=2
        ),  # unknown parent
    ]
    index, checker = RouterIndex(4), Checker(router_view=True)
    for batch in batches:
        index.apply(batch)
        checker.feed(batch)
    dump = index.dump()
    held_by_2 = {
        b["block_hash"]
        for e in dump["default:default"]["events"]
        if e["worker_id"] == 2
        for b in e["event"]["data"]["stored"]["blocks"]
    }
    assert held_by_2 == {11, 12}  # the caveat: worker 2's own 21, 22 are held as 11, 12
    # Dynamo then rejects worker 2's store under 22 (not the hash its tree keeps): the one
    # block the router never learned. By engine hash, 11, 12 would be stale, 21, 22 missing.
    (finding,) = checker.compare_router(dump_prefixes(dump), "index")
    assert (finding.rule, finding.worker, finding.hash) == ("KV502", "2[dp0]", 23)
    # the block under an unknown parent is out of reach on both sides: not compared
    assert checker.against == {
        "index": "index",
        "workers": 2,
        "router_blocks": 4,
        "engine_blocks": 5,
    }
    # without token ids a router cannot index a block: missing, and said why
    batch = Batch(
        source="a",
        format="engine-map",
        events=[{**store([13], 12, []), "token_ids": None}],
        worker_id=1,
    )
    checker.feed(batch)
    found = {f.hash: f for f in checker.compare_router(dump_prefixes(dump), "index")}
    assert sorted(found) == [13, 23] and "no token ids" in found[13].message


def test_unreachable_index_or_bad_dump_is_one_line_and_exit_1(fleet, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc = run_kvctl("check", fleet, "--against", url)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and proc.stdout == b""
    assert err == f"kvctl: {url}/health: connection refused: is the index running there?\n"
    for body, says in [("[1, 2]", "not a /dump"), ("{", "not a /dump snapshot")]:
        bad = tmp_path / "bad.json"
        bad.write_text(body)
        proc = run_kvctl("check", fleet, "--against", str(bad))
        err = proc.stderr.decode()
        assert proc.returncode == 1 and err.count("\n") == 1 and says in err, err
    proc = run_kvctl("check", fleet, "--against", "ftp://somewhere")
    assert proc.returncode == 2 and "expected http://HOST:PORT" in proc.stderr.decode()


def test_dynamos_indexer_fed_the_same_stream_is_in_step(fleet):
    """Dynamo's standalone indexer, fed the recording by `kvctl replay` (one socket per
    worker), holds what the engines hold: no drift."""
    pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installable here")
    base = free_port_range(WORKERS)
    labels = [f"{i}=tcp://127.0.0.1:{base + i}" for i in range(WORKERS)]
    dynamo, url = start_dynamo_indexer(labels, 16, log="warn")
    total = sum(map(len, held(fleet).values()))
    try:
        args = ["replay", fleet, "--to", f"tcp://127.0.0.1:{base}", "--port-per-worker"]
        rc, _, err = finish(start_kvctl(*args, "--wait-subscribers", "1", "--topspeed", "-q"), 120)
        assert rc == 0, err
        deadline = time.monotonic() + 60
        while True:  # Dynamo applies events asynchronously: until it holds them all, bounded
            try:
                rc, report, err = check(fleet, "--against", url)
            except (OSError, urllib.error.URLError, AssertionError):
                rc, report = -1, {}
            if report.get("against", {}).get("router_blocks") == total:
                break
            assert time.monotonic() < deadline, (rc, report.get("against"))
            time.sleep(0.5)
    finally:
        dynamo.terminate()
        dynamo.wait(10)
    assert rc == 0 and not {r["id"] for r in report["rules"]} & {"KV501", "KV502"}, report


def test_live_check_against_a_live_index_that_hears_one_engine_of_two():
    """Live: `kvctl index` listens to engine 1 only, `kvctl check` to both; when the stream has
    been quiet for --idle-timeout, the index's /dump is fetched: engine 2's blocks are missing
    from it, engine 1 is in step (its removal included)."""
    one = Engine(f"tcp://127.0.0.1:{free_port()}")
    two = Engine(f"tcp://127.0.0.1:{free_port()}")
    index, url = serve(f"1={one.endpoint}", "--block-size", "4")
    checker = start_kvctl(
        *("check", f"1={one.endpoint}", f"2={two.endpoint}", "--idle-timeout", "2"),
        *("--against", url, "--json", "--max-examples", "100"),
    )
    try:
        one.wait_for(2)
        two.wait_for(1)
        one.send([stored([1, 2]), stored([3], parent=2)])
        one.send([removed([3])])
        two.send([stored([7, 8])])
        rc, out, err = finish(checker, timeout=30)
    finally:
        interrupt(index)
        finish(index)
        one.close()
        two.close()
    assert rc == 0, err  # missing blocks are warnings
    report = json.loads(out)
    assert drift(report, "KV502") == {"2[dp0]": {7, 8}}
    assert drift(report, "KV501") == {}
    assert report["against"]["router_blocks"] == 2 and report["against"]["engine_blocks"] == 4
