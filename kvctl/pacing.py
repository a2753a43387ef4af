"""Pacing: sending recorded batches on a schedule (replay), so that a paced source runs through
the same pipeline as a live one (bridge)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .events import Batch

Row = tuple[Any, ...]
"""What :meth:`PacedSource.rows` paces: ``(when, seq, ...)``."""

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
        def timed(loop: int) -> Iterator[tuple[float, int | None, Batch]]:
            return ((batch_time(b), b.seq, b) for b in self.recording.batches())

        for row in self.rows(timed):
            yield row[2]

    def rows(self, rows_of_loop: Callable[[int], Iterable[Row]]) -> Iterator[Row]:
        """The pacing itself, over any rows that start with ``(when, seq)`` (a recorded
        batch, or a prepared message of replay's frames cache): ``rows_of_loop(n)`` gives
        loop n's rows, and each row is handed over when it is due."""
        schedule = self.schedule
        wait = schedule.wait
        rate, on_read = self.rate, self.on_read
        window_start, window_end = self.start, self.end
        windowed = window_start is not None or window_end is not None
        time_end = window_end[1] if window_end is not None and window_end[0] == "time" else None
        max_gap_s = None
        if self.max_gap is not None:  # in recorded seconds
            max_gap_s = self.max_gap * (schedule.speed or 1.0)
        step = 1.0 / rate if rate else 0.0
        offset = 0.0
        loop = 0
        while self.loops == 0 or loop < self.loops:
            if self.on_loop is not None:
                self.on_loop(loop)
            previous: float | None = None
            first: float | None = None
            for row in rows_of_loop(loop):
                if on_read is not None:
                    on_read()
                when = row[0]
                if first is None:
                    first = when
                    if loop == 0:
                        schedule.start = time.perf_counter()
                        self.cpu_start = time.process_time()
                if windowed and not _in_window(row[1], when - first, window_start, window_end):
                    if time_end is not None and when - first > time_end:
                        break  # seq windows cannot stop early: seqs count per publisher
                    continue
                if step:
                    offset += step
                elif previous is not None:
                    gap = when - previous
                    if gap > 0.0:
                        offset += gap if max_gap_s is None or gap < max_gap_s else max_gap_s
                previous = when
                wait(offset)
                yield row
            loop += 1

    def close(self) -> None:
        self.recording.close()


def batch_time(batch: Batch) -> float:
    """When a recorded batch arrived (its engine time if it has no receive time), in seconds:
    what replay paces by."""
    return (batch.recv_ns or int((batch.ts or 0) * 1e9)) / 1e9


def _in_window(seq: int | None, offset: float, start: Window | None, end: Window | None) -> bool:
    if start is not None:
        value = offset if start[0] == "time" else seq
        if value is None or value < start[1]:
            return False
    if end is not None:
        value = offset if end[0] == "time" else seq
        if value is None or value > end[1]:
            return False
    return True
