"""kvctl record at a sustained rate: does the converter keep up? Backlog over time and at close,
and the memory of the recorder and of its converter.

A publisher process sends realistic vLLM batches (bench/_stream.py) at ``--rate`` events/s for
``--seconds``; ``kvctl record`` (the command users run, in its own process, stopping
``--idle-timeout`` after the stream ends) records them. Watched from outside every 0.1 s:
how far the journal has grown, how far the converter process has read it (its file offset,
from /proc), and the resident memory of both processes. The converter's backlog is shown as
the stream time it is behind (how long ago the journal reached the converter's position) and
in journal MB; at the end: the backlog when the stream stopped, the conversion left at close
(from the journal's last write, at close, to the recorder's exit: the Parquet file complete),
peak memory (VmHWM), and the events in the file against the events sent. On a busy machine
the recorder itself may fall behind the stream (its queue fills; the journal keeps growing
after the stream has stopped): that shows as the time its journal grew after the stream.
The CPU time each process used (/proc, all threads) says how much of a core each needs at
this rate, whatever else the machine runs: the converter keeps up where it gets that share.

The target (issue 12): after 60 s at 100k events/s the backlog stays under 1 s, memory flat
and under 200 MB per process.

    python bench/record_sustained.py [--rate 100000] [--seconds 60] [--every 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import zmq
from _stream import free_port, realistic_payloads

REPO = Path(__file__).resolve().parent.parent
SAMPLE_S = 0.1


def publish(endpoint: str, rate: float, seconds: float, ready, done) -> None:
    """Send realistic batches at ``rate`` events/s for ``seconds`` once a subscriber is
    there (a pool of payloads reused with increasing seq numbers); ``done`` gets the events
    sent and the time the last one went."""
    pool = realistic_payloads(20_000, seed=1)
    sizes = [len(msgpack.unpackb(p)[1]) for p in pool]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    ready.set()
    sock.recv()  # the recorder's subscription
    total = int(rate * seconds)
    sent, seq = 0, 0
    start = time.perf_counter()
    while sent < total:
        i = seq % len(pool)
        sock.send_multipart([b"kv@bench@model", seq.to_bytes(8, "big"), pool[i]])
        sent += sizes[i]
        seq += 1
        if seq % 100 == 0:  # pace against the absolute schedule
            delay = start + sent / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
    done.put((sent, seq, time.perf_counter() - start, time.time()))
    time.sleep(0.5)
    sock.close(linger=-1)
    ctx.term()


def _status_kb(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _cpu_s(pid: int) -> float | None:
    """CPU time (user + system, all threads) of ``pid`` so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return found


def _read_offset(pid: int, path: Path) -> int | None:
    """The file offset of ``pid``'s open descriptor of ``path`` (the converter reads the
    journal in order: its offset is how far it has converted)."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") != str(path):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    for line in f:
                        if line.startswith("pos:"):
                            return int(line.split()[1])
            except OSError:
                continue
    except OSError:
        pass
    return None


class Watch:
    """The journal's growth and the converter's position over time, and both RSS."""

    def __init__(self, recorder: int, journal: Path) -> None:
        self.recorder = recorder
        self.journal = journal
        self.converter: int | None = None
        self.history: list[tuple[float, int]] = []  # (time, journal bytes)
        self.rss_max = {"recorder": 0, "converter": 0}
        self.hwm = {"recorder": 0, "converter": 0}
        self.cpu = {"recorder": 0.0, "converter": 0.0}
        self.cpu_start: dict[str, float] = {}  # at the first journal write: start-up excluded
        self.last: dict[str, float] = {}

    def sample(self) -> dict[str, float] | None:
        now = time.perf_counter()
        if self.converter is None:
            kids = _children(self.recorder)
            self.converter = kids[0] if kids else None
        try:
            size = self.journal.stat().st_size
        except OSError:
            return None
        self.history.append((now, size))
        pos = _read_offset(self.converter, self.journal) if self.converter else None
        if pos is None:
            return None
        behind = max(size - pos, 0)
        reached = next((t for t, s in self.history if s >= pos), now)
        rss = {}
        for name, pid in (("recorder", self.recorder), ("converter", self.converter)):
            kb = _status_kb(pid, "VmRSS") or 0
            rss[name] = kb
            self.rss_max[name] = max(self.rss_max[name], kb)
            self.hwm[name] = max(self.hwm[name], _status_kb(pid, "VmHWM") or 0)
            used = _cpu_s(pid) or 0.0
            self.cpu_start.setdefault(name, used)
            self.cpu[name] = max(self.cpu[name], used - self.cpu_start[name])
        self.last = {
            "lag_s": now - reached if behind else 0.0,
            "behind_mb": behind / 1e6,
            "journal_mb": size / 1e6,
            "recorder_mb": rss["recorder"] / 1024,
            "converter_mb": rss["converter"] / 1024,
        }
        return self.last


def _events_in(path: Path) -> int | None:
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path).metadata or {}
        return json.loads(meta[b"kvctl"])["counts"]["events"]
    except (OSError, KeyError, ValueError):
        return None


def run(rate: float, seconds: float, every: float, idle: float) -> None:
    spawn = mp.get_context("spawn")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    tmp = Path(tempfile.mkdtemp(prefix="kvctl-bench-sustained-"))
    out = tmp / "run.parquet"
    journal = out.with_name(out.name + ".journal")
    ready, done = spawn.Event(), spawn.Queue()
    pub = spawn.Process(target=publish, args=(endpoint, rate, seconds, ready, done))
    pub.start()
    rec = None
    log = (tmp / "record.log").open("w+")  # kvctl's stderr: a file never blocks it
    try:
        ready.wait(30)
        rec = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "record", endpoint, "-o", str(out)]
            + ["--idle-timeout", str(idle)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        watch = Watch(rec.pid, journal)
        print(
            f"{rate:,.0f} events/s for {seconds:g} s into kvctl record; "
            "converter backlog = stream time behind (journal MB behind)"
        )
        print(f"{'t (s)':>6} {'journal MB':>10} {'backlog':>16} {'recorder':>9} {'converter':>9}")
        start = time.perf_counter()
        next_print = start + every
        finished = None
        lag_at_end = None
        while rec.poll() is None and time.perf_counter() - start < seconds + 600:
            time.sleep(SAMPLE_S)
            s = watch.sample()
            if finished is None and not done.empty():
                finished = done.get()
                lag_at_end = dict(watch.last)
            if s is not None and time.perf_counter() >= next_print:
                next_print += every
                print(
                    f"{time.perf_counter() - start:6.0f} {s['journal_mb']:10.1f} "
                    f"{s['lag_s']:6.2f} s ({s['behind_mb']:5.1f} MB) "
                    f"{s['recorder_mb']:6.0f} MB {s['converter_mb']:6.0f} MB"
                )
        exit_at = time.perf_counter()
        if rec.poll() is None:
            rec.send_signal(signal.SIGINT)
            rec.wait(120)
        log.seek(0)
        err = log.read()
        if finished is None:
            assert not done.empty() or pub.is_alive(), err[-2000:]
            finished = done.get(timeout=seconds + 60)
        sent, batches, pub_s, end_at = finished
        end_at -= time.time() - time.perf_counter()  # the publisher's clock: wall -> perf
        final = watch.history[-1][1] if watch.history else 0
        journalled = next((t for t, size in watch.history if size >= final), exit_at)
        pub.join(10)
        assert rec.returncode == 0, err[-2000:]
        events = _events_in(out)
        if events != sent:  # say why: kvctl's own summary
            print(err.strip()[-2000:], file=sys.stderr)
        lag = lag_at_end or {}
        print(
            f"sent {sent:,} events in {batches:,} batches at {sent / pub_s:,.0f} events/s; "
            f"recorded {events if events is None else f'{events:,}'} events"
        )
        print(
            f"backlog when the stream stopped: {lag.get('lag_s', 0.0):.2f} s "
            f"({lag.get('behind_mb', 0.0):.1f} MB of journal); the recorder journalled the "
            f"last batch {journalled - end_at:.2f} s after the stream stopped ({idle:g} s idle "
            f"timeout included); conversion left at close: {exit_at - journalled:.2f} s"
        )
        cpu = watch.cpu
        print(
            "CPU time (all threads, from the first journal write): recorder "
            f"{cpu['recorder']:.1f} s, converter {cpu['converter']:.1f} s for {sent:,} events: "
            "the converter needs "
            f"{cpu['converter'] / max(sent, 1) * rate:.0%} of a core at {rate:,.0f} events/s "
            f"(the recorder {cpu['recorder'] / max(sent, 1) * rate:.0%}): it keeps up where it "
            "gets that much CPU (on a busy machine, it is niced below everything else)"
        )
        print(
            f"RSS max: recorder {watch.rss_max['recorder'] / 1024:.0f} MB, converter "
            f"{watch.rss_max['converter'] / 1024:.0f} MB; peak (VmHWM): recorder "
            f"{watch.hwm['recorder'] / 1024:.0f} MB, converter "
            f"{watch.hwm['converter'] / 1024:.0f} MB"
        )
    finally:
        log.close()
        if rec is not None and rec.poll() is None:
            rec.kill()
            rec.wait()
        if pub.is_alive():
            pub.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100_000, help="events/s")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--every", type=float, default=5, help="print every N seconds")
    parser.add_argument("--idle-timeout", type=float, default=3.0, dest="idle")
    args = parser.parse_args()
    run(args.rate, args.seconds, args.every, args.idle)


if __name__ == "__main__":
    main()
