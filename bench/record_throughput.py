"""record throughput with zero loss vs the bare-Python limit, in the same run; disk ratio.

The recorder runs record's code path (LiveSource -> decode -> RecordingSink ->
RecordingWriter journal) on a pre-queued stream of realistic vLLM batches; its rate counts the
ingest (every batch taken off the socket and journalled). The Parquet conversion at close is
timed separately, and the file's size is compared with the raw msgpack payload bytes.

    python bench/record_throughput.py [--batches 50000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from _stream import Bare, compare, realistic_payloads

CLOSE_TIMES: list[float] = []
RATIOS: list[float] = []


class Record:
    name = "kvctl record (ingest)"

    def connect(self, endpoint: str) -> None:
        from kvctl.pipeline import LiveSource, SourceSpec

        self.source = LiveSource([SourceSpec.parse(endpoint)])

    def consume(self, batches: int) -> tuple[float, int]:
        from kvctl.commands.record import RecordingSink
        from kvctl.output import StderrDiagnostics
        from kvctl.pipeline import Limits, run
        from kvctl.transports.files import RecordingWriter

        tmp = Path(tempfile.mkdtemp(prefix="kvctl-bench-"))
        try:
            writer = RecordingWriter(tmp / "run.parquet")
            sink = RecordingSink(writer, StderrDiagnostics(quiet=True))
            start = time.perf_counter()
            summary = run(self.source, sink, Limits(idle_timeout=0.5), diagnostics=sink)
            elapsed = time.perf_counter() - start - 0.5
            closing = time.perf_counter()
            result = writer.close()
            CLOSE_TIMES.append(time.perf_counter() - closing)
            RATIOS.append(result["bytes"] / result["raw_bytes"])
        finally:
            shutil.rmtree(tmp)
        self.source.close()
        assert summary.batches == batches == result["batches"], "the recorder lost batches"
        return elapsed, summary.total_events


def main() -> None:
    import statistics

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    payloads = realistic_payloads(args.batches)
    compare([Bare(), Record()], payloads, args.rounds)
    print(f"conversion to Parquet at close: {statistics.median(CLOSE_TIMES):.2f} s (median); "
          f"bytes on disk / raw msgpack bytes: {statistics.median(RATIOS):.3f}")


if __name__ == "__main__":
    main()
