"""End-to-end smoke of every kvctl command after the plain install (no extras).

CI runs this in a fresh venv holding only `pip install .`, before the full suite: the suite
installs every extra (matplotlib pulls numpy in), so it cannot see a command that needs
something outside [project.dependencies]. Standard library only, plus the `kvctl` command;
every subprocess and every wait is bounded. Each step checks exit 0 (or the documented code)
and no traceback on stderr; one line per step, then `smoke: N passed, M failed`; exit 1 on any
failure.

    python .ci/smoke_plain_install.py              # the `kvctl` next to this python, or on PATH
    python .ci/smoke_plain_install.py python -m kvctl   # any command prefix
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

STEP_TIMEOUT = 30.0
"""Seconds any one kvctl process may run before the step fails (and the process is killed)."""


def kvctl_command() -> list[str]:
    if len(sys.argv) > 1:
        return sys.argv[1:]
    beside = Path(sys.executable).parent / "kvctl"
    found = str(beside) if beside.exists() else shutil.which("kvctl")
    if found is None:
        sys.exit("smoke: no kvctl command found (install the package first)")
    return [found]


KVCTL = kvctl_command()


class StepFailed(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def endpoint(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def start(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*KVCTL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(
    proc: subprocess.Popen[bytes], what: str, expect_rc: int = 0, timeout: float = STEP_TIMEOUT
) -> tuple[bytes, bytes]:
    """Wait for a kvctl process; fail on a timeout, another exit code or a traceback."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise StepFailed(
            f"{what}: still running after {timeout:.0f} s; stderr: {tail(err)}"
        ) from None
    if proc.returncode != expect_rc:
        raise StepFailed(
            f"{what}: exit {proc.returncode}, expected {expect_rc}; stderr: {tail(err)}"
        )
    if b"Traceback" in err:
        raise StepFailed(f"{what}: traceback on stderr: {tail(err)}")
    return out, err


def run(*args: str, expect_rc: int = 0) -> tuple[bytes, bytes]:
    return finish(start(*args), "kvctl " + " ".join(args), expect_rc)


def tail(err: bytes, lines: int = 4) -> str:
    return " | ".join(err.decode(errors="replace").strip().splitlines()[-lines:])


def json_lines(out: bytes) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.decode().splitlines() if line.strip()]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Clean up a background process a failed step left behind."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


class Smoke:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.rec = str(workdir / "sim.parquet")
        self.passed = 0
        self.failed = 0

    def step(self, name: str, body: Callable[[], str]) -> None:
        began = time.monotonic()
        try:
            detail = body()
        except (StepFailed, OSError, ValueError, KeyError) as exc:
            self.failed += 1
            print(f"FAIL {name}: {exc}", flush=True)
            return
        self.passed += 1
        print(f"ok   {name} ({time.monotonic() - began:.1f} s): {detail}", flush=True)

    def help_pages(self) -> str:
        commands = (
            "tap",
            "record",
            "cat",
            "inspect",
            "recover",
            "replay",
            "bridge",
            "simulate",
            "check",
            "stats",
            "top",
            "index",
            "query",
            "stream",
        )
        out, _ = run("--help")
        missing = [c for c in commands if c not in out.decode()]
        if missing:
            raise StepFailed(f"kvctl --help does not list {missing}")
        for command in commands:
            run(command, "--help")
        return f"kvctl --help and {len(commands)} command pages"

    # --- a recording, and every command that reads one ---

    def simulate_to_file(self) -> str:
        run(
            "simulate",
            "-o",
            self.rec,
            "--workers",
            "2",
            "--duration",
            "20",
            "--num-blocks",
            "256",
            "--seed",
            "1",
            "-q",
        )
        return f"{os.path.getsize(self.rec)} bytes"

    def tap_file(self) -> str:
        out, _ = run("tap", self.rec, "--json", "-c", "50")
        rows = json_lines(out)
        if len(rows) != 50:
            raise StepFailed(f"{len(rows)} events printed, expected 50")
        return "50 events"

    def cat(self) -> str:
        out, _ = run("cat", self.rec, "--json")
        kinds = {row["type"] for row in json_lines(out)}
        if not {"BlockStored", "BlockRemoved"} <= kinds:
            raise StepFailed(f"event types {sorted(map(str, kinds))}")
        plain, _ = run("cat", self.rec, "-c", "5")
        return f"types {sorted(map(str, kinds))}, pretty output {len(plain)} bytes"

    def inspect(self) -> str:
        out, _ = run("inspect", self.rec, "--json")
        report = json.loads(out)
        if not report["events"]:
            raise StepFailed("inspect counted no events")
        run("inspect", self.rec)
        return f"{report['events']} events"

    def stats(self) -> str:
        out, _ = run("stats", self.rec, "--json")
        report = json.loads(out)
        run("stats", self.rec)
        return f"{report['overall']['events']} events"

    def stats_plot_without_extra(self) -> str:
        """Without matplotlib --plot is exit 1 and one line; with it (a dev venv) it plots."""
        charts = str(self.dir / "charts")
        proc = start("stats", self.rec, "--plot", charts)
        try:
            import importlib.util

            has_plot = importlib.util.find_spec("matplotlib") is not None
        except ValueError:
            has_plot = False
        if has_plot:
            finish(proc, "stats --plot")
            return "matplotlib present: charts written"
        _, err = finish(proc, "stats --plot", expect_rc=1)
        lines = err.decode().strip().splitlines()
        if len(lines) != 1 or "pip install" not in lines[0]:
            raise StepFailed(f"expected a one-line install hint, got {lines}")
        return lines[0]

    def check(self) -> str:
        out, _ = run("check", self.rec, "--json")
        report = json.loads(out)
        if not report["ok"]:
            raise StepFailed(f"findings in a simulated stream: {report['rules']}")
        return f"{report['events']} events, clean"

    def top(self) -> str:
        out, _ = run("top", self.rec, "--json", "--refresh", "0.5")
        snapshots = json_lines(out)
        if not snapshots:
            raise StepFailed("no snapshot printed")
        return f"{len(snapshots)} snapshots"

    def index_and_query(self) -> str:
        """A snapshot of the recording's index, served, asked by `query` over HTTP and
        directly: the same workers hold the prompt both ways."""
        snapshot = str(self.dir / "index.json")
        run("index", self.rec, "-o", snapshot)
        first = json_lines(run("cat", self.rec, "--json", "-c", "1", "--type", "BlockStored")[0])
        prompt = ",".join(map(str, first[0]["token_ids"][:64]))
        direct = json.loads(run("query", self.rec, "--tokens", prompt, "--json")[0])
        server = start("index", snapshot, "--port", "0", "--json")
        try:
            assert server.stdout is not None
            serving = json.loads(server.stdout.readline())["serving"]
            with urllib.request.urlopen(serving + "/health", timeout=STEP_TIMEOUT) as answer:
                if answer.status != 200:
                    raise StepFailed(f"/health answered {answer.status}")
            asked = json.loads(run("query", "--index", serving, "--tokens", prompt, "--json")[0])
            server.send_signal(signal.SIGINT)
            finish(server, "index (serving)", expect_rc=130)
        finally:
            stop(server)

        def holders(answer: dict) -> dict:
            return {
                (w["worker_id"], w["dp_rank"]): w["matched_blocks"]
                for w in answer["workers"]
                if w["matched_blocks"]
            }

        if holders(direct) != holders(asked):
            raise StepFailed(f"direct {holders(direct)} != served {holders(asked)}")
        return f"served {serving}; prompt held by {sorted(map(str, holders(direct)))}"

    # --- live streams on loopback ---

    def record_kill_9_recover(self) -> str:
        port = free_port()
        path = self.dir / "live.parquet"
        journal = Path(str(path) + ".journal")
        engine = start(
            "simulate",
            "--base-port",
            str(port),
            "--workers",
            "1",
            "--duration",
            "600",
            "--wait-subscribers",
            "1",
            "-q",
        )
        recorder = start("record", endpoint(port), "-o", str(path), "--connect-timeout", "20", "-q")
        try:
            # readiness: the journal grows past its header (a flush of received events)
            deadline = time.monotonic() + 20
            first = 0
            while time.monotonic() < deadline:
                size = journal.stat().st_size if journal.exists() else 0
                if first == 0:
                    first = size
                elif size > first:
                    break
                if recorder.poll() is not None:
                    break
                time.sleep(0.1)
            else:
                raise StepFailed("the recorder's journal did not grow within 20 s")
            if recorder.poll() is not None:
                finish(recorder, "record")
                raise StepFailed("the recorder exited early")
            recorder.send_signal(signal.SIGKILL)
            recorder.communicate(timeout=10)
        finally:
            stop(recorder)
            stop(engine)
        if path.exists():
            raise StepFailed("a recording exists although the recorder was killed")
        left = journal.stat().st_size
        run("recover", str(path))
        report = json.loads(run("inspect", str(path), "--json")[0])
        if not report["events"]:
            raise StepFailed("the recovered recording holds no events")
        return f"killed, {left}-byte journal left; recovered {report['events']} events"

    def replay_into_tap(self) -> str:
        port = free_port()
        tap = start("tap", endpoint(port), "--json", "-c", "40", "--connect-timeout", "20")
        replay = start(
            "replay",
            self.rec,
            "--to",
            endpoint(port),
            "--wait-subscribers",
            "1",
            "--topspeed",
            "-q",
        )
        try:
            finish(replay, "replay")  # first: a replay that fails leaves tap waiting
            out, _ = finish(tap, "tap")
        finally:
            stop(tap)
            stop(replay)
        if len(json_lines(out)) != 40:
            raise StepFailed(f"tap printed {len(json_lines(out))} events, expected 40")
        return "40 events received"

    def bridge(self) -> str:
        upstream, downstream = free_port(), free_port()
        engine = start(
            "simulate",
            "--base-port",
            str(upstream),
            "--workers",
            "1",
            "--duration",
            "600",
            "--wait-subscribers",
            "1",
            "-q",
        )
        bridge = start(
            "bridge",
            endpoint(upstream),
            "--to",
            endpoint(downstream),
            "--format",
            "vllm",
            "--wait-subscribers",
            "1",
            "--connect-timeout",
            "20",
            "--idle-timeout",
            "2",
            "-q",
        )
        tap = start("tap", endpoint(downstream), "--json", "-c", "20", "--connect-timeout", "20")
        try:
            out, _ = finish(tap, "tap")
            engine.send_signal(signal.SIGINT)  # the bridge then stops on its idle timeout
            finish(bridge, "bridge")
            finish(engine, "simulate", expect_rc=130)
        finally:
            for proc in (tap, bridge, engine):
                stop(proc)
        rows = json_lines(out)
        if len(rows) != 20 or rows[0]["format"] != "engine-map":
            raise StepFailed(f"{len(rows)} events downstream")
        return "20 events through ZMQ -> ZMQ (vllm)"

    def simulate_into_tap(self) -> str:
        port = free_port()
        engine = start(
            "simulate",
            "--base-port",
            str(port),
            "--workers",
            "1",
            "--requests",
            "3",
            "--speedup",
            "20",
            "--wait-subscribers",
            "1",
            "-q",
        )
        tap = start("tap", endpoint(port), "-c", "10", "--connect-timeout", "20")
        try:
            out, _ = finish(tap, "tap")
            finish(engine, "simulate")
        finally:
            stop(tap)
            stop(engine)
        if b"BlockStored" not in out:
            raise StepFailed("no BlockStored in tap's output")
        return f"{len(out.splitlines())} lines printed"


def main() -> int:
    began = time.monotonic()
    print(f"smoke: {' '.join(KVCTL)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvctl-smoke-") as tmp:
        smoke = Smoke(Path(tmp))
        smoke.step("--help", smoke.help_pages)
        smoke.step("simulate -o", smoke.simulate_to_file)
        smoke.step("tap (recording)", smoke.tap_file)
        smoke.step("cat", smoke.cat)
        smoke.step("inspect", smoke.inspect)
        smoke.step("stats", smoke.stats)
        smoke.step("stats --plot", smoke.stats_plot_without_extra)
        smoke.step("check", smoke.check)
        smoke.step("top --json", smoke.top)
        smoke.step("index -o, index (serving), query", smoke.index_and_query)
        smoke.step("record, kill -9, recover", smoke.record_kill_9_recover)
        smoke.step("replay into tap", smoke.replay_into_tap)
        smoke.step("bridge", smoke.bridge)
        smoke.step("simulate into tap", smoke.simulate_into_tap)
    print(
        f"smoke: {smoke.passed} passed, {smoke.failed} failed ({time.monotonic() - began:.0f} s)",
        flush=True,
    )
    return 1 if smoke.failed else 0


if __name__ == "__main__":
    sys.exit(main())
