"""Pacing: sending recorded batches on a schedule (replay), so that a paced source runs through
the same pipeline as a live one (bridge)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from .events import Batch

Window = tuple[str, float]
"""A ``--start``/``--end`` bound: ``("time", seconds from the recording's start)`` or
``("seq", n)``."""


class Schedule:
    """An absolute send schedule: item k is due at ``start + offset_k / speed``.

    Every wait is computed from the start, never from the previous send, so errors do not
    accumulate; it sleeps until shortly before the due time and spins the rest, because
    ``time.sleep`` overshoots by up to a scheduler tick (``spin_s=0`` trades that precision for
    idle CPU, as the simulator does). ``speed=None`` sends at top speed.
    """

    def __init__(self, speed: float | None = 1.0, spin_s: float = 0.0005) -> None:
        self.speed = speed
        self.spin_s = spin_s
        self.start = time.perf_counter()
        self.lateness: list[float] = []

    def wait(self, offset_s: float) -> float:
        """Block until ``offset_s`` (schedule seconds) is due; return how late we are (s)."""
        if self.speed is None:
            return 0.0
        due = self.start + offset_s / self.speed
        now = time.perf_counter()
        if due - now > self.spin_s:
            time.sleep(due - now - self.spin_s)
        while (now := time.perf_counter()) < due:
            pass
        late = now - due
        self.lateness.append(late)
        return late

    def report(self) -> dict[str, float]:
        """Lateness against the schedule: median, p99, max (ms), and sends later than 1 ms."""
        if not self.lateness:
            return {}
        values = sorted(self.lateness)
        n = len(values)
        p99 = values[min(n - 1, int(n * 0.99))]
        return {
            "median_ms": values[n // 2] * 1e3,
            "p99_ms": p99 * 1e3,
            "max_ms": values[-1] * 1e3,
            "late_over_1ms": sum(v > 0.001 for v in values),
        }


class PacedSource:
    """Batches of a recording source, each handed over when the schedule says it is due: at
    the recorded pace scaled by the schedule's speed, or ``rate`` batches per second; idle
    stretches capped at ``max_gap`` schedule seconds; the recording played ``loops`` times
    (0: until interrupted); only what lies between ``start`` and ``end``.

    ``on_loop(n)`` runs before loop n (0-based) starts; ``on_read()`` at every batch read,
    inside the window or not (a progress bar). The schedule starts when the first batch is at
    hand (``cpu_start`` is taken then too), not when the recording is opened."""

    def __init__(
        self,
        recording: Any,
        schedule: Schedule,
        rate: float | None = None,
        max_gap: float | None = None,
        loops: int = 1,
        start: Window | None = None,
        end: Window | None = None,
        on_loop: Callable[[int], None] | None = None,
        on_read: Callable[[], None] | None = None,
    ) -> None:
        self.recording = recording
        self.schedule = schedule
        self.rate = rate
        self.max_gap = max_gap
        self.loops = loops
        self.start, self.end = start, end
        self.on_loop = on_loop
        self.on_read = on_read
        self.cpu_start = time.process_time()

    def batches(self) -> Iterator[Batch]:
        schedule = self.schedule
        max_gap_s = None
        if self.max_gap is not None:  # in recorded seconds
            max_gap_s = self.max_gap * (schedule.speed or 1.0)
        offset = 0.0
        loop = 0
        while self.loops == 0 or loop < self.loops:
            if self.on_loop is not None:
                self.on_loop(loop)
            previous: float | None = None
            first: float | None = None
            for batch in self.recording.batches():
                if self.on_read is not None:
                    self.on_read()
                when = (batch.recv_ns or int((batch.ts or 0) * 1e9)) / 1e9
                if first is None:
                    first = when
                    if loop == 0:
                        schedule.start = time.perf_counter()
                        self.cpu_start = time.process_time()
                if not _in_window(batch, when - first, self.start, self.end):
                    end = self.end
                    if end is not None and end[0] == "time" and when - first > end[1]:
                        break  # seq windows cannot stop early: seqs count per publisher
                    continue
                if self.rate:
                    offset += 1.0 / self.rate
                elif previous is not None:
                    gap = max(0.0, when - previous)
                    if max_gap_s is not None:
                        gap = min(gap, max_gap_s)
                    offset += gap
                previous = when
                schedule.wait(offset)
                yield batch
            loop += 1

    def close(self) -> None:
        self.recording.close()


def _in_window(batch: Batch, offset: float, start: Window | None, end: Window | None) -> bool:
    if start is not None:
        value = offset if start[0] == "time" else batch.seq
        if value is None or value < start[1]:
            return False
    if end is not None:
        value = offset if end[0] == "time" else batch.seq
        if value is None or value > end[1]:
            return False
    return True
