"""Dynamo's own NATS traffic captured the fleet way, without changing Dynamo: a bridge reads
Dynamo's KV-event subjects and publishes every message into a fleet stream partitioned by the
Dynamo worker id; a partitioned recorder writes the dataset. It holds what a direct
``kvctl record`` of the same traffic holds, and each worker sits in the partition the stream's
mapping gives it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from conftest import NatsServer, finish, read_until, run_kvctl, start_kvctl

from kvctl.partitions import partition_of

PARTITIONS = 4


def test_dynamo_nats_traffic_through_a_fleet_stream(nats_server: NatsServer, tmp_path: Path):
    url = nats_server.url
    made = run_kvctl("stream", "init", url, "--name", "dyn", "--partitions", str(PARTITIONS))
    assert made.returncode == 0, made.stderr.decode()
    bridge = start_kvctl(
        "bridge", url, "--to", url, "--stream", "dyn", "--idle-timeout", "3", "--json"
    )
    direct = tmp_path / "direct.parquet"
    recorder = start_kvctl("record", url, "-o", str(direct), "--idle-timeout", "3")
    try:
        # each prints its first line once subscribed to Dynamo's subjects
        assert read_until(bridge.stderr, "kvctl: ")[-1].startswith("kvctl: bridging")
        assert read_until(recorder.stderr, "kvctl: ")[-1].startswith("kvctl: recording")
        simulated = run_kvctl(
            "simulate", "--to", url, "--workers", "6", "--requests", "40", "--rate", "200",
            "--seed", "5", "--json", "-q", timeout=60,
        )  # fmt: skip
        assert simulated.returncode == 0, simulated.stderr.decode()
    finally:
        bridged = finish(bridge, 30)
        recorded = finish(recorder, 30)
    assert bridged[0] == 0, bridged[2]
    assert recorded[0] == 0, recorded[2]
    sent = json.loads(simulated.stdout)["batches"]
    assert json.loads(bridged[1].splitlines()[-1])["messages"] == sent

    dataset = tmp_path / "dataset"
    fleet = run_kvctl(
        "record", url, "--stream", "dyn", "-o", str(dataset), "--layout", "hive",
        "--idle-timeout", "2", "-q", timeout=60,
    )  # fmt: skip
    assert fleet.returncode == 0, fleet.stderr.decode()

    def summary(location: Path) -> dict:
        result = run_kvctl("check", str(location), "--json", "-q", timeout=60)
        assert result.returncode == 0, result.stderr.decode()
        report = json.loads(result.stdout)
        report["stream"].pop("elapsed_s")
        return {k: report[k] for k in ("batches", "events", "workers", "rules", "stream")}

    assert summary(dataset) == summary(direct)
    assert summary(direct)["batches"] == sent
    # every Dynamo worker id in the partition the stream's mapping gives it
    for segment in dataset.glob("dt=*/hour=*/part=*/*.parquet"):
        part = int(segment.parent.name.removeprefix("part="))
        workers = set(pq.read_table(segment, columns=["worker_id"]).column(0).to_pylist())
        assert workers and all(partition_of(str(w), PARTITIONS) == part for w in workers)
