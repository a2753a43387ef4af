"""Overload: receive queues are bounded in bytes, and what they cannot hold is counted as lost,
never silently. Real parts: a full-speed engine in its own process, kvctl as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    NatsServer,
    finish,
    free_port,
    interrupt,
    kvctl_cmd,
    read_line,
    removed,
    start_kvctl,
)

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="peak memory is read from /proc (Linux)"
)

RSS_LIMIT_KB = 300_000
FLOOD_S = 3.0


def peak_rss_kb(pid: int) -> int:
    """VmHWM: the process's peak resident set so far (0 once it has exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) if match else 0


def count(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, text
    return int(match.group(1).replace(",", ""))


def flood(*kvctl_args: str, timeout: float = 90) -> tuple[int, int, str]:
    """64 KB batches at full speed into ``kvctl ARGS ENDPOINT --idle-timeout 2`` (stdout
    discarded); returns (peak RSS in kB, batches sent, kvctl's stderr)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    engine = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "flood_publisher.py"), endpoint, str(FLOOD_S), "64"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert read_line(engine.stdout).strip() == "ready"
        proc = subprocess.Popen(
            kvctl_cmd(*kvctl_args, endpoint, "--idle-timeout", "2"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=REPO,
        )
        peak = 0
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            peak = max(peak, peak_rss_kb(proc.pid))
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
        sent_line = read_line(engine.stdout)
    finally:
        engine.stdin.close()  # the engine exits
        engine.wait(10)
    assert proc.returncode == 0, err.decode()
    return peak, count(r"sent (\d+)", sent_line), err.decode()


@pytest.mark.parametrize("command", [["tap", "--json"], ["record", "-o", "{tmp}/run.parquet"]])
def test_a_flood_of_64kb_batches_stays_bounded_and_accounted(tmp_path, command):
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    peak_kb, sent, err = flood(*args)
    summary = err.strip().splitlines()[-1]
    received = count(r" in ([\d,]+) batch", summary)
    missing = count(r"\(([\d,]+) batch(?:es)? missing", summary)
    assert received + missing == sent, summary  # every batch is received or counted lost
    assert peak_kb < RSS_LIMIT_KB, f"peak RSS {peak_kb / 1000:.0f} MB; {summary}"
    if command[0] == "record":  # the recording says the same: every batch, every gap
        back = subprocess.run(
            kvctl_cmd("cat", args[-1], "--json"), capture_output=True, cwd=REPO, timeout=60
        )
        read_back = back.stderr.decode().strip().splitlines()[-1]
        assert count(r" in ([\d,]+) batch", read_back) == received, read_back
        assert count(r"\(([\d,]+) batch(?:es)? missing", read_back) == missing, read_back


def wait_until_quiet(port: int, timeout: float = 20) -> None:
    """Until the connections on ``port`` carry nothing (the client has read everything)."""
    from flood_publisher import tcp_queued

    quiet = 0
    deadline = time.monotonic() + timeout
    while quiet < 5:
        assert time.monotonic() < deadline, "the connection never emptied"
        quiet = quiet + 1 if tcp_queued(port) == 0 else 0
        time.sleep(0.05)  # the kernel's queues have no push signal


def test_a_stalled_nats_tap_stays_bounded_and_says_what_it_dropped(tmp_path):
    """tap's stdout is a pipe nobody reads: the hand-off from the NATS thread fills up to
    --max-queue, the rest is dropped and counted; Ctrl-C says what was still queued."""
    from flood_publisher import events_of_about
    from test_tap_nats import delivered, publish, wait_ready

    from kvctl.formats.engine_zmq import encode_payload

    sent = 1500
    payload = encode_payload(events_of_about(64), 1_700_000_000.0, 0, "vllm")
    monitor = free_port()
    server = NatsServer(tmp_path / "store", "-m", str(monitor))
    try:
        proc = start_kvctl("tap", server.url, "--json", "--max-queue", "16M")
        wait_ready(proc)
        publish(server.url, [("namespace.ns.component.c.kv-events", payload)] * sent)
        delivered(monitor, sent)
        wait_until_quiet(server.port)
        peak_kb = peak_rss_kb(proc.pid)
        interrupt(proc)
        rc, _, err = finish(proc)
    finally:
        server.stop()
    summary = err.strip().splitlines()[-1]
    assert rc == 130, err
    received = count(r" in ([\d,]+) batch", summary)
    dropped = count(r"dropped ([\d,]+) \(receive queue full", summary)
    queued = count(r"([\d,]+) received batch(?:es)? not processed \(queued at exit\)", summary)
    assert received + dropped + queued == sent, summary
    assert queued * len(payload) <= 16_000_000, summary  # the bound held
    assert err.count("receive queue full (--max-queue") <= 1, err  # a warning, not a flood
    assert peak_kb < RSS_LIMIT_KB, f"peak RSS {peak_kb / 1000:.0f} MB; {summary}"


def test_interrupt_says_how_many_received_zmq_batches_were_not_processed(engine):
    """tap stalls on a stdout nobody reads while batches keep arriving; Ctrl-C: the summary
    accounts for each of them, processed or still queued."""
    sent = 500  # fewer than the socket takes before it has measured a message
    proc = start_kvctl("tap", engine.endpoint, "--json")
    engine.wait_for()
    for i in range(sent):
        engine.send([removed(list(range(i, i + 32)))])
    wait_until_quiet(int(engine.endpoint.rsplit(":", 1)[1]))  # all of it reached kvctl
    interrupt(proc)
    rc, _, err = finish(proc)
    summary = err.strip().splitlines()[-1]
    assert rc == 130, err
    received = count(r" in ([\d,]+) batch", summary)
    queued = count(r"([\d,]+) received batch(?:es)? not processed \(queued at exit\)", summary)
    assert received + queued == sent and queued > 0, summary
    assert "gaps 0" in summary, summary
