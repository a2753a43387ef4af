"""tap --json throughput vs the bare-Python limit, in the same run.

Both consumers drain the same pre-queued stream of realistic vLLM batches from a real ZMQ PUB
in another process: the bare loop does ``recv_multipart`` + ``msgpack.unpackb`` and nothing
else; kvctl runs tap's code path (LiveSource opened typed, as ``tap --json`` opens it ->
decode -> seq tracking -> filters/limits -> JsonLinesSink writing every event as a JSON line to
/dev/null). Rates are given per wall second and per CPU second of the consumer's process.

    python bench/tap_throughput.py [--batches 50000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

from _stream import PREQUEUED_QUEUE_BYTES, Bare, compare, realistic_payloads


class Tap:
    name = "kvctl tap --json > /dev/null"

    def connect(self, endpoint: str) -> None:
        from kvctl.pipeline import LiveSource, SourceSpec

        self.source = LiveSource(
            [SourceSpec.parse(endpoint)], max_queue=PREQUEUED_QUEUE_BYTES, typed=True
        )

    def consume(self, batches: int) -> tuple[float, float, int]:
        from kvctl.output import JsonLinesSink
        from kvctl.pipeline import run
        from kvctl.selection import Limits

        with open("/dev/null", "wb") as devnull:
            sink = JsonLinesSink(devnull, chunk_bytes=JsonLinesSink.CHUNK_BYTES)  # as tap's
            start, cpu = time.perf_counter(), time.process_time()
            summary = run(self.source, [sink], Limits(idle_timeout=0.5))
            elapsed = time.perf_counter() - start - 0.5  # minus the idle wait that ended it
            cpu = time.process_time() - cpu  # the idle wait: a few polls
            sink.close()
        self.source.close()
        assert summary.batches == batches, f"kvctl saw {summary.batches} of {batches} batches"
        return elapsed, cpu, summary.total_events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    compare([Bare(), Tap()], realistic_payloads(args.batches), args.rounds)


if __name__ == "__main__":
    main()
