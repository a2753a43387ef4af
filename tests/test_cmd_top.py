"""kvctl top driven by a live ZMQ publisher for a few seconds: plain snapshots when stdout is
not a terminal, JSON snapshots (in-process, the publisher in a thread), and a real terminal
(tmux) where q quits and s re-sorts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from conftest import (
    REPO,
    finish,
    interrupt,
    read_line,
    removed,
    start_kvctl,
    stored,
)
from inprocess import Live, run_main, run_while

from kvctl.formats.engine_zmq import encode_frames, encode_payload


class Workload:
    """Two workers on one socket (llm-d topics): a stores 2 blocks and b 1 block per step;
    from step 5 on, a removes 1 block per step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.step = 0
        self.seq = 0

    def _send(self, topic: bytes, events: list) -> None:
        payload = encode_payload(events, 1_700_000_000.0 + self.step)
        self.engine.send_raw(encode_frames(topic, self.seq, payload))
        self.seq += 1

    def run_step(self) -> None:
        h = 3 * self.step + 1
        self._send(b"kv@a@m", [stored([h, h + 1])])
        self._send(b"kv@b@m", [stored([h + 2])])
        if self.step >= 5:
            self._send(b"kv@a@m", [removed([3 * (self.step - 5) + 1])])
        self.step += 1

    def expected(self) -> dict[str, int]:
        return {"a[dp0]": 2 * self.step - max(0, self.step - 5), "b[dp0]": self.step}

    def drive(self, seconds: float, until: Live | None = None) -> None:
        """Steps 40 ms apart (the workload's pace) for ``seconds`` or until top has ended."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and (until is None or not until.ended.is_set()):
            self.run_step()
            time.sleep(0.04)


def snapshots(out: str) -> list[str]:
    return [s for s in out.split("\n\n") if "kvctl top" in s]


def row(snapshot: str, worker: str) -> list[str]:
    line = next(x for x in snapshot.splitlines() if x.strip().startswith(worker))
    return line.split()


def test_plain_snapshots_when_not_a_tty(engine):
    work = Workload(engine)

    def drive() -> None:
        engine.wait_for()
        work.drive(2.0)

    rc, out, err = run_while(
        drive, "top", engine.endpoint, "--refresh", "0.5", "--idle-timeout", "0.8"
    )
    assert rc == 0, err
    snaps = snapshots(out)
    assert len(snaps) >= 3, out  # every refresh, plus the final one
    last = snaps[-1]
    assert "2 workers" in last and "sort: worker" in last
    for header in (
        "worker",
        "cached",
        "store/s",
        "remove/s",
        "batch/s",
        "seq",
        "gaps",
        "malformed",
        "seen",
    ):
        assert header in last
    expected = work.expected()
    a, b = row(last, "a[dp0]"), row(last, "b[dp0]")
    assert int(a[1].replace(",", "")) == expected["a[dp0]"]
    assert int(b[1].replace(",", "")) == expected["b[dp0]"]
    assert a[-3:-1] == ["0", "0"]  # no gaps, nothing malformed
    # mid-run snapshots show the workers working: non-zero store rates
    assert float(row(snaps[1], "a[dp0]")[2]) > 0
    assert "stopped by --idle-timeout" in err


def test_json_snapshots_sorted(engine):
    work = Workload(engine)

    def drive(live: Live) -> None:
        engine.wait_for()
        work.drive(1.2, until=live)

    result = run_main(
        "top",
        engine.endpoint,
        "--json",
        "--refresh",
        "0.5",
        "--sort",
        "cached",
        "--duration",
        "1.8",
        alongside=drive,
    )
    rc, out, err = result.code, result.out, result.err
    assert rc == 0, err
    snaps = [json.loads(line) for line in out.splitlines()]
    assert len(snaps) >= 3 and all(s["sort"] == "cached" for s in snaps)
    last = snaps[-1]
    assert {w["worker"]: w["blocks_cached"] for w in last["workers"]} == work.expected()
    cached = [w["blocks_cached"] for w in last["workers"]]
    assert cached == sorted(cached, reverse=True)
    assert last["blocks_cached"] == sum(work.expected().values())
    busy = next(s for s in snaps if s["workers"])
    assert busy["workers"][0]["stored_blocks_per_s"] > 0
    assert all(w["gaps"] == 0 and w["last_seen_s"] is not None for w in last["workers"])


def test_gap_and_malformed_show_on_the_worker_row(engine):
    def send() -> None:
        engine.wait_for()
        engine.send([stored([1])], topic=b"kv@a@m")
        engine.send_raw([b"kv@a@m", (1).to_bytes(8, "big"), b"\xc1"])  # malformed
        engine.send([stored([2], parent=1)], topic=b"kv@a@m", seq=7)  # gap: 1 (bad) .. 6

    rc, out, err = run_while(send, "top", engine.endpoint, "--json", "-c", "2", "--refresh", "5")
    assert rc == 0, err
    rows = {w["worker"]: w for w in json.loads(out.splitlines()[-1])["workers"]}
    assert rows["a[dp0]"]["gaps"] == 1 and rows["a[dp0]"]["last_seq"] == 7
    assert rows["a[dp0]"]["blocks_cached"] == 2
    # the malformed batch has no decodable worker: it is counted on its socket's row
    assert sum(w["malformed"] for w in rows.values()) == 1


def test_ctrl_c_exits_130_after_a_final_snapshot(engine):
    proc = start_kvctl("top", engine.endpoint, "--refresh", "0.2")
    engine.wait_for()
    Workload(engine).drive(0.3)
    seen = ""
    while "a[dp0]" not in seen:  # a snapshot that shows the worker: top has its events
        seen = read_line(proc.stdout)
    interrupt(proc)
    rc, out, err = finish(proc)
    assert rc == 130, err
    assert "a[dp0]" in snapshots(out)[-1] and "stopped by interrupt" in err


def test_help_has_example():
    assert "Example:" in run_main("top", "--help").out


@pytest.mark.skipif(
    shutil.which("tmux") is None,
    reason="tmux not installed (apt-get install tmux): no real terminal to test",
)
def test_real_terminal_q_quits_and_s_sorts(engine, tmp_path):
    sock = f"kvctl-test-{uuid.uuid4().hex[:8]}"  # a private tmux server, killed at the end
    rc_file = tmp_path / "rc"
    # COLUMNS/LINES from the test runner's environment would pin the width (rich honours them)
    cmd = (
        f"env -u COLUMNS -u LINES {sys.executable} -m kvctl top {engine.endpoint} "
        f"--refresh 0.3; "
        f"echo $? > {rc_file}; sleep 30"
    )

    def tmux(*args: str) -> str:
        return subprocess.run(
            ["tmux", "-L", sock, *args], capture_output=True, text=True, timeout=10, cwd=REPO
        ).stdout

    def screen_with(text: str, timeout: float = 8.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            work.run_step()
            screen = tmux("capture-pane", "-p", "-t", "top")
            if text in screen or time.monotonic() > deadline:
                return screen
            time.sleep(0.1)

    tmux("new-session", "-d", "-s", "top", "-x", "140", "-y", "20", "-c", str(REPO), cmd)
    try:
        engine.wait_for()
        work = Workload(engine)
        screen = screen_with("b[dp0]")
        assert "kvctl top" in screen and "2 workers" in screen, screen
        assert "q quit" in screen and "worker ↑" in screen, screen
        assert "a[dp0]" in screen and "store/s" in screen, screen
        tmux("send-keys", "-t", "top", "s")  # next sort column: cached, largest first
        screen = screen_with("cached ↓")
        assert "sort: cached ↓" in screen and "cached ↓" in screen, screen
        lines = screen.splitlines()
        a_line = next(i for i, x in enumerate(lines) if "a[dp0]" in x)
        b_line = next(i for i, x in enumerate(lines) if "b[dp0]" in x)
        assert a_line < b_line  # a caches more than b
        tmux("send-keys", "-t", "top", "q")
        deadline = time.monotonic() + 8
        while not rc_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rc_file.read_text().strip() == "0"
        screen = tmux("capture-pane", "-p", "-t", "top")
        assert "stopped by q" in screen and "a[dp0]" in screen, screen
    finally:
        tmux("kill-server")
