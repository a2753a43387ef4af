"""A fleet, end to end, on a 3-node NATS cluster: 64 simulated engines, four bridges (one per
"node" of 16 engines) publishing into an R3 stream of 4 partitions, two recorders (two
partitions each) writing one hive dataset. Mid-run, one nats-server node and one recorder are
killed with SIGKILL and restarted. Afterwards every (worker, seq) the engines sent is in the
dataset exactly once, and the sharded checks, merged, equal one check of the whole dataset.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, free_port_range, run_kvctl
from nats_cluster import nats_cluster_fixture  # noqa: F401  (pytest finds it by name)
from test_check_sharded import canonical

WORKERS = 64
BRIDGES = 4
PARTITIONS = 4
SIM_SECONDS = 24
STREAM = "fleet"

pytestmark = pytest.mark.timeout(300)


def _start(*args: str, log: Path) -> subprocess.Popen:
    """kvctl in its own process group (killed as a whole, as an operator's kill -9 of a
    service would), stdout to ``log``, stderr to ``log``.err."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvctl", *args],
        stdout=open(log, "wb"),  # noqa: SIM115 (closed by the process's exit)
        stderr=open(f"{log}.err", "wb"),  # noqa: SIM115
        cwd=REPO,
        start_new_session=True,
    )


def _wait(proc: subprocess.Popen, log: Path, timeout: float) -> dict:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        err = Path(f"{log}.err").read_text()
        raise AssertionError(f"{log.name} overstayed {timeout} s: {err}") from exc
    err = Path(f"{log}.err").read_text()
    assert proc.returncode == 0, f"{log.name} exited {proc.returncode}: {err}"
    text = log.read_text().strip()
    return json.loads(text.splitlines()[-1]) if text else {}


def _recorder(url: str, partitions: str, out: Path, log: Path) -> subprocess.Popen:
    return _start(
        "record",
        url,
        "--stream",
        STREAM,
        "--partition",
        f"{partitions}/{PARTITIONS}",
        "-o",
        str(out),
        "--layout",
        "hive",
        "--rotate-every",
        "2s",
        "--idle-timeout",
        "10",
        "--json",
        log=log,
    )


def _wait_for_segments(
    out: Path, partition_dirs: set[str], logs: Path, timeout: float = 60
) -> None:
    """Until each of ``partition_dirs`` (``part=PP``) has a committed segment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = {p.parent.name for p in out.glob("dt=*/hour=*/part=*/*.parquet")}
        if partition_dirs <= seen:
            return
        time.sleep(0.1)  # polling the file system: a recorder has no readiness signal
    said = "\n".join(f"--- {e.name}\n{e.read_text()[-1500:]}" for e in sorted(logs.glob("*.err")))
    raise AssertionError(f"no segment of {sorted(partition_dirs - seen)} in {timeout} s\n{said}")


def test_fleet_survives_a_node_and_a_recorder_killed(nats_cluster, tmp_path: Path) -> None:
    url = nats_cluster.url
    made = run_kvctl(
        "stream",
        "init",
        url,
        "--name",
        STREAM,
        "--partitions",
        str(PARTITIONS),
        "--replicas",
        "3",
        timeout=60,
    )
    assert made.returncode == 0, made.stderr.decode()
    out = tmp_path / "dataset"
    base, replay_base = free_port_range(WORKERS), free_port_range(WORKERS)
    simulate = _start(
        "simulate",
        "--workers",
        str(WORKERS),
        "--base-port",
        str(base),
        "--replay-base-port",
        str(replay_base),
        "--rate",
        "40",
        "--duration",
        str(SIM_SECONDS),
        "--wait-subscribers",
        "1",
        "--seed",
        "7",
        "--json",
        log=tmp_path / "simulate.json",
    )
    per_bridge = WORKERS // BRIDGES
    bridges = []
    for b in range(BRIDGES):
        workers = range(b * per_bridge, (b + 1) * per_bridge)
        sources = [f"{w}=tcp://127.0.0.1:{base + w}" for w in workers]
        replays = [
            arg
            for w in workers
            for arg in ("--replay-endpoint", f"tcp://127.0.0.1:{replay_base + w}")
        ]
        bridges.append(
            _start(
                "bridge",
                *sources,
                *replays,
                "--to",
                url,
                "--stream",
                STREAM,
                "--idle-timeout",
                "10",
                "--json",
                log=tmp_path / f"bridge{b}.json",
            )
        )
    recorders = [
        _recorder(url, "0,1", out, tmp_path / "recorder-a.json"),
        _recorder(url, "2,3", out, tmp_path / "recorder-b.json"),
    ]
    _wait_for_segments(out, {"part=00", "part=01", "part=02", "part=03"}, tmp_path)
    # mid-run: a node of the cluster and a recorder die without warning
    nats_cluster.kill(1)
    os.killpg(recorders[1].pid, signal.SIGKILL)
    recorders[1].wait()
    time.sleep(2)  # down for a while: the stream elects, the partitions' messages wait
    nats_cluster.restart(1)
    recorders[1] = _recorder(url, "2,3", out, tmp_path / "recorder-b2.json")

    sim_report = _wait(simulate, tmp_path / "simulate.json", SIM_SECONDS + 60)
    bridge_reports = [_wait(p, tmp_path / f"bridge{i}.json", 90) for i, p in enumerate(bridges)]
    for proc, name in zip(recorders, ("recorder-a.json", "recorder-b2.json"), strict=True):
        _wait(proc, tmp_path / name, 90)
    assert not list(out.rglob(".*.tmp-*")), "a temp file was left behind"

    import duckdb

    rows = duckdb.sql(
        f"SELECT worker_id, seq, count(*) AS n, any_value(part) AS part FROM read_parquet("
        f"'{out}/**/*.parquet', hive_partitioning=true) "
        f"WHERE type <> 'Gap' AND coalesce(event_index, 0) = 0 GROUP BY worker_id, seq"
    ).fetchall()
    copies = Counter(n for _, _, n, _ in rows)
    assert set(copies) == {1}, f"batches stored more than once: {copies}"
    per_worker: dict[str, list[int]] = {}
    for worker, seq, _, _ in rows:
        per_worker.setdefault(worker, []).append(seq)
    assert len(per_worker) == WORKERS
    for worker, seqs in per_worker.items():
        assert sorted(seqs) == list(range(len(seqs))), f"worker {worker}: seqs missing"
    assert sum(map(len, per_worker.values())) == sim_report["batches"]
    gaps = duckdb.sql(
        f"SELECT count(*) FROM read_parquet('{out}/**/*.parquet') WHERE type = 'Gap'"
    ).fetchall()
    assert gaps == [(0,)]
    assert all(r.get("failed", 0) == 0 for r in bridge_reports), bridge_reports

    # sharded check == whole check
    whole = run_kvctl("check", str(out), "--max-examples", "100000", "--json", timeout=120)
    shards = []
    for i in range(PARTITIONS):
        shard = run_kvctl(
            "check",
            str(out),
            "--partition",
            f"{i}/{PARTITIONS}",
            "--max-examples",
            "100000",
            "--json",
            timeout=120,
        )
        assert shard.returncode == whole.returncode, shard.stderr.decode()
        path = tmp_path / f"check{i}.json"
        path.write_bytes(shard.stdout)
        shards.append(str(path))
    merged = run_kvctl("check", "--merge", *shards, "--json", timeout=60)
    assert merged.returncode == whole.returncode, merged.stderr.decode()
    assert canonical(json.loads(merged.stdout)) == canonical(json.loads(whole.stdout))
