"""record throughput with zero loss vs the bare-Python limit, in the same run; disk ratio; RSS.

The recorder runs record's code path (LiveSource opened typed -> decode -> RecordingSink ->
RecordingWriter raw journal, converter subprocess following it) on a pre-queued stream of
realistic vLLM batches; its rate counts the ingest (every batch taken off the socket and
journalled). Timing starts once the converter process is up (its start-up imports are not
steady-state ingest). The conversion left at close is timed separately, and the file's size is
compared with the raw msgpack payload bytes (random token ids: incompressible, see
bench/record_disk.py for a realistic Zipf workload).

``--long`` records ~1M events (``--events``) through a recorder in its own process from a
publisher paced below the recorder's speed (``--rate`` events/s), and prints the resident
memory of the recorder and of its converter at every quarter of the run and at the end
(VmHWM: the peak) — the issue asks for flat and < 200 MB.

``--convert`` times the converter's work alone: a raw journal of ``--batches`` realistic
batches, written as the recorder writes it, converted to Parquet by ``journal_to_parquet``
(re-decoding, rows, Parquet writing) in this process; events/s per round, CPU time and wall.

    python bench/record_throughput.py [--batches 50000] [--rounds 3]
    python bench/record_throughput.py --long [--events 1000000] [--rate 100000]
    python bench/record_throughput.py --convert [--batches 50000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path

from _stream import PREQUEUED_QUEUE_BYTES, Bare, compare, free_port, realistic_payloads

CLOSE_TIMES: list[float] = []
RATIOS: list[float] = []


class Record:
    name = "kvctl record (ingest)"

    def connect(self, endpoint: str) -> None:
        from kvctl.pipeline import LiveSource, SourceSpec

        self.endpoint = endpoint
        self.source = LiveSource(
            [SourceSpec.parse(endpoint)], max_queue=PREQUEUED_QUEUE_BYTES, typed=True
        )

    def consume(self, batches: int) -> tuple[float, float, int]:
        from kvctl.commands.record import RecordingSink, _labels
        from kvctl.pipeline import run
        from kvctl.recording.writer import RecordingWriter
        from kvctl.selection import Limits

        tmp = Path(tempfile.mkdtemp(prefix="kvctl-bench-"))
        try:
            writer = RecordingWriter(tmp / "run.parquet", labels=_labels([self.endpoint]))
            writer.converter_ready()  # process start-up (imports) is not steady-state ingest
            sink = RecordingSink(writer)
            start, cpu = time.perf_counter(), time.process_time()
            summary = run(self.source, [sink], Limits(idle_timeout=0.5))
            elapsed = time.perf_counter() - start - 0.5
            cpu = time.process_time() - cpu
            closing = time.perf_counter()
            result = writer.close()
            CLOSE_TIMES.append(time.perf_counter() - closing)
            RATIOS.append(result["bytes"] / result["raw_bytes"])
        finally:
            shutil.rmtree(tmp)
        self.source.close()
        assert summary.batches == batches == result["batches"], "the recorder lost batches"
        return elapsed, cpu, summary.total_events


# --- --long: memory over a long run -------------------------------------------------------------


def _rss_kb(pid: int | str = "self", key: str = "VmRSS") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _recorder(endpoint: str, out: str, total_events: int, report) -> None:
    """The recorder process: record's code path until the stream goes idle."""
    import threading

    from kvctl.commands.record import RecordingSink, _labels
    from kvctl.pipeline import LiveSource, SourceSpec, run
    from kvctl.recording.writer import RecordingWriter
    from kvctl.selection import Limits

    source = LiveSource([SourceSpec.parse(endpoint)], max_queue=PREQUEUED_QUEUE_BYTES, typed=True)
    writer = RecordingWriter(out, labels=_labels([endpoint]))
    writer.converter_ready()
    report.put(("ready", None))
    sink = RecordingSink(writer)
    samples: list[tuple[int, int | None, int | None]] = []
    done = threading.Event()

    def sample() -> None:
        marks = [total_events * k // 4 for k in (1, 2, 3)]
        while not done.wait(0.1):
            conv = writer._converter
            if marks and writer.counts["events"] >= marks[0]:
                marks.pop(0)
                samples.append(
                    (
                        writer.counts["events"],
                        _rss_kb(),
                        _rss_kb(conv.pid) if conv is not None else None,
                    )
                )

    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    summary = run(source, [sink], Limits(idle_timeout=2.0))
    elapsed = time.perf_counter() - start - 2.0
    closing = time.perf_counter()
    result = writer.close()
    close_s = time.perf_counter() - closing
    done.set()
    source.close()
    report.put(
        (
            "done",
            {
                "events": summary.total_events,
                "batches": summary.batches,
                "recorded": result["batches"],
                "elapsed": elapsed,
                "close_s": close_s,
                "samples": samples,
                "peak_kb": _rss_kb(key="VmHWM"),
                "end_kb": _rss_kb(),
                "converter_peak_kb": result["converter"]["peak_rss_kb"],
                "bytes": result["bytes"],
                "raw_bytes": result["raw_bytes"],
            },
        )
    )


def _publisher(endpoint: str, events: int, rate: float, go) -> None:
    """Send ~``events`` events of realistic batches at ``rate`` events/s (a pool of payloads
    reused with increasing seq numbers)."""
    import zmq

    pool = realistic_payloads(20_000, seed=1)
    per_batch = 2.8  # events per batch of realistic_payloads, on average
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    sock.recv()  # the subscription
    go.wait()
    n = int(events / per_batch)
    start = time.perf_counter()
    for seq in range(n):
        sock.send_multipart([b"", seq.to_bytes(8, "big"), pool[seq % len(pool)]])
        if seq % 500 == 0:
            due = start + seq * per_batch / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
    time.sleep(1.0)
    sock.close(linger=-1)
    ctx.term()


def long_run(events: int, rate: float) -> None:
    spawn = mp.get_context("spawn")  # a clean recorder process: no bench memory inherited
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    tmp = Path(tempfile.mkdtemp(prefix="kvctl-bench-long-"))
    report = spawn.Queue()
    go = spawn.Event()
    pub = spawn.Process(target=_publisher, args=(endpoint, events, rate, go))
    pub.start()
    rec = spawn.Process(
        target=_recorder, args=(endpoint, str(tmp / "long.parquet"), events, report)
    )
    rec.start()
    try:
        assert report.get(timeout=60)[0] == "ready"
        time.sleep(0.5)
        go.set()
        kind, r = report.get(timeout=max(600, 3 * events / rate))
        rec.join(30)
        pub.join(30)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert r["batches"] == r["recorded"], "the recorder lost batches"
    print(
        f"long run: {r['events']:,} events in {r['batches']:,} batches at "
        f"~{rate:,.0f} events/s offered ({r['events'] / r['elapsed']:,.0f}/s ingested), "
        f"conversion left at close {r['close_s']:.2f} s"
    )
    for ev, rss, conv in r["samples"]:
        print(
            f"  after {ev:>9,} events: recorder RSS {rss / 1024:6.1f} MB, converter "
            f"{(conv or 0) / 1024:6.1f} MB"
        )
    print(
        f"  end: recorder RSS {r['end_kb'] / 1024:.1f} MB; peak (VmHWM) recorder "
        f"{r['peak_kb'] / 1024:.1f} MB, converter {(r['converter_peak_kb'] or 0) / 1024:.1f}"
        f" MB; bytes on disk / raw msgpack bytes: {r['bytes'] / r['raw_bytes']:.3f} "
        "(random tokens)"
    )


# --- --convert: the conversion alone ------------------------------------------------------------


def _write_journal(path: Path, payloads: list[bytes]) -> None:
    """A raw journal of ``payloads`` as the recorder writes it (record batches of 2,048 rows)."""
    from kvctl.formats import decode_zmq
    from kvctl.recording.journal import (
        JOURNAL_FORMAT,
        JournalWriter,
        RowBuffer,
        message_fields,
    )

    info = {"journal_format": JOURNAL_FORMAT, "first_batch_index": 0, "raw_frames": "auto"}
    journal = JournalWriter(path, info)
    buf = RowBuffer(labelled=True)
    for seq, payload in enumerate(payloads):
        frames = [b"kv@pod-1@model", seq.to_bytes(8, "big"), payload]
        batch = decode_zmq(frames, "tcp://127.0.0.1:5557", time.time_ns())
        buf.rows.append(message_fields(batch))
        buf.events.append(len(batch.events))
        buf.frames.append(batch.frames)
        if len(buf) == 2048:
            journal.write(buf.build().rb, fsync=False)
            buf = RowBuffer(labelled=True)
    if len(buf):
        journal.write(buf.build().rb, fsync=False)
    journal.close()


def convert_run(batches: int, rounds: int) -> None:
    import statistics

    from kvctl.recording.convert import journal_to_parquet
    from kvctl.recording.journal import journal_metadata

    tmp = Path(tempfile.mkdtemp(prefix="kvctl-bench-convert-"))
    try:
        source = tmp / "source.journal"
        _write_journal(source, realistic_payloads(batches))
        rates, cpu_rates = [], []
        for _ in range(rounds):
            journal = tmp / "run.parquet.journal"
            shutil.copyfile(source, journal)
            target = tmp / "run.parquet"
            target.unlink(missing_ok=True)
            wall, cpu = time.perf_counter(), time.process_time()
            meta = journal_to_parquet(journal, target, journal_metadata(journal))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            events = meta["counts"]["events"]
            rates.append(events / wall)
            cpu_rates.append(events / cpu)
            print(f"  {events:,} events: {events / wall:,.0f}/s wall, {events / cpu:,.0f}/s CPU")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"conversion: {statistics.median(rates):,.0f} events/s wall (median; "
        f"{min(rates):,.0f}-{max(rates):,.0f}), {statistics.median(cpu_rates):,.0f} events/s "
        f"CPU ({min(cpu_rates):,.0f}-{max(cpu_rates):,.0f})"
    )


def main() -> None:
    import statistics

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", action="store_true", help="memory over a long run")
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=100_000)
    parser.add_argument("--convert", action="store_true", help="the conversion alone")
    args = parser.parse_args()
    if args.convert:
        convert_run(args.batches, args.rounds)
        return
    if args.long:
        long_run(args.events, args.rate)
        return
    payloads = realistic_payloads(args.batches)
    compare([Bare(), Record()], payloads, args.rounds)
    print(
        f"conversion left at close: {statistics.median(CLOSE_TIMES):.2f} s (median); "
        f"bytes on disk / raw msgpack bytes: {statistics.median(RATIOS):.3f} (random tokens)"
    )


if __name__ == "__main__":
    main()
