"""Sequence tracking: one verdict per batch on whether a publisher's stream is whole and in order.

Every command that reads a stream (``tap``, ``record``, ``check``, ``stats``, ``top``) feeds its
batches, in arrival order, to one :class:`SequenceTracker`, so the same stream gets the same
verdict everywhere. Pure and clock-free.

A publisher is ``batch.publisher`` (one ZMQ socket, one Dynamo ``publisher_id``), else the
batch's ``source``: each publisher numbers its batches 0, 1, 2, ... The rules, per publisher:

- The first seq seen starts the count (a reader may join a stream at any point).
- The next expected seq is in order: no verdict. This is the hot path (``tap`` at 100k+
  batches/s): one dict lookup and one compare, nothing allocated.
- A seq beyond the next expected one opens a **gap**: the seqs in between are missing (lost
  unless they arrive late or are fetched from the engine's replay socket). The count goes on
  from the new seq.
- A seq inside an open gap fills it: a **reorder** (it arrived late), or **recovered** when the
  batch came from the replay socket (``batch.recovered``, or :meth:`SequenceTracker.fill`).
- Seq 0 after the publisher got past 0 (next expected > 1), not from the replay socket, is a
  **restart**: the engine restarted and numbers from 0 again, so the router's view of it is
  stale. Its open gaps are forgotten (the old numbering no longer applies); its missing count
  stays (those batches were lost).
- Any other old seq is a **duplicate**. So ``0, 0`` is a duplicate: a publisher that never got
  past 0 cannot have restarted, and calling it a restart would hide a repeated message.
- A malformed message whose seq parsed (``batch.error`` set) did arrive, so its seq is no gap:
  it advances the count when it is the one expected and fills a gap when it is missing. But it
  never opens a gap or a restart and gets no verdict: a seq from an otherwise unreadable
  message is not trusted that far (the malformed message is reported as such by the caller).
- Batches without an int seq are counted but not sequenced.

At most :data:`MAX_OPEN_GAPS` open gaps are remembered per publisher (the oldest is dropped), so
a stream that loses every other batch cannot grow memory; a late batch of a dropped gap then
counts as a duplicate.

Timestamps going backwards are a separate, optional observation
(:meth:`SequenceTracker.time_went_backwards`): only ``check`` and ``stats`` report them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .events import Batch

GAP = "gap"
REORDER = "reorder"
RECOVERED = "recovered"
DUPLICATE = "duplicate"
RESTART = "restart"

MAX_OPEN_GAPS = 64
"""Open gaps remembered per publisher, to bound memory."""


@dataclass(slots=True)
class Irregularity:
    """A batch that was not the next one expected from its publisher."""

    kind: str
    """:data:`GAP`, :data:`REORDER`, :data:`RECOVERED`, :data:`DUPLICATE` or :data:`RESTART`."""
    publisher: Any
    """The publisher key (see :func:`publisher_key`); pass it to :meth:`SequenceTracker.fill`."""
    expected: int
    """The seq that was expected next (before this batch)."""
    got: int
    """The batch's seq."""
    missing: int = 0
    """For a gap, how many seqs it skipped (``got - expected``); else 0."""


class PublisherSequence:
    """One publisher's sequence state and counters."""

    __slots__ = (
        "expected",
        "open_gaps",
        "last_ts",
        "batches",
        "gaps",
        "missing",
        "reorders",
        "recovered",
        "duplicates",
        "restarts",
        "ts_backwards",
    )

    def __init__(self) -> None:
        self.expected: int | None = None
        """The next seq expected; None until the first seq arrives."""
        self.open_gaps: list[list[int]] = []
        """Missing seqs as ``[first, end)`` ranges, oldest first, at most MAX_OPEN_GAPS."""
        self.last_ts: float | None = None
        self.batches = 0
        """Batches that were not malformed, with or without a seq."""
        self.gaps = 0
        self.missing = 0
        """Seqs skipped by gaps and not (yet) filled."""
        self.reorders = 0
        self.recovered = 0
        self.duplicates = 0
        self.restarts = 0
        self.ts_backwards = 0

    @property
    def last_seq(self) -> int | None:
        return None if self.expected is None else self.expected - 1

    def take(self, seq: int) -> bool:
        """Take ``seq`` out of the open gaps; False if it was not missing."""
        gaps = self.open_gaps
        for i, (first, end) in enumerate(gaps):
            if first <= seq < end:
                gaps[i : i + 1] = [r for r in ([first, seq], [seq + 1, end]) if r[0] < r[1]]
                self.missing -= 1
                return True
        return False


def publisher_key(batch: Batch) -> Any:
    """What a batch's seq counts within: its publisher, else its source."""
    key = batch.publisher
    return batch.source if key is None else key


class SequenceTracker:
    """Per-publisher sequence accounting by the rules of the module doc.

    Aggregate counters over all publishers (``gaps``, ``missing``, ``reorders``, ``recovered``,
    ``duplicates``, ``restarts``, ``ts_backwards``) are kept alongside the per-publisher ones
    in :attr:`publishers`.
    """

    def __init__(self) -> None:
        self.publishers: dict[Any, PublisherSequence] = {}
        self.gaps = 0
        self.missing = 0
        self.reorders = 0
        self.recovered = 0
        self.duplicates = 0
        self.restarts = 0
        self.ts_backwards = 0

    def observe(self, batch: Batch) -> Irregularity | None:
        """Account for ``batch``; its irregularity, or None when it is in order (or not
        sequenced: no int seq, or malformed)."""
        key = batch.publisher
        if key is None:
            key = batch.source
        pub = self.publishers.get(key)
        if pub is None:
            pub = self.publishers[key] = PublisherSequence()
        seq = batch.seq
        if batch.error is not None:
            self._malformed(pub, seq)
            return None
        pub.batches += 1
        if seq == pub.expected and seq is not None:
            pub.expected = seq + 1
            return None
        if type(seq) is not int:
            return None
        return self._irregular(pub, key, seq, batch.recovered)

    def _irregular(
        self, pub: PublisherSequence, key: Any, seq: int, recovered: bool
    ) -> Irregularity | None:
        expected = pub.expected
        if expected is None:
            pub.expected = seq + 1
            return None
        if seq > expected:
            missing = seq - expected
            pub.expected = seq + 1
            pub.gaps += 1
            pub.missing += missing
            self.gaps += 1
            self.missing += missing
            gaps = pub.open_gaps
            gaps.append([expected, seq])
            del gaps[:-MAX_OPEN_GAPS]
            return Irregularity(GAP, key, expected, seq, missing)
        if pub.take(seq):
            self.missing -= 1
            if recovered:
                pub.recovered += 1
                self.recovered += 1
                return Irregularity(RECOVERED, key, expected, seq)
            pub.reorders += 1
            self.reorders += 1
            return Irregularity(REORDER, key, expected, seq)
        if seq == 0 and expected > 1 and not recovered:
            pub.restarts += 1
            self.restarts += 1
            pub.expected = 1
            pub.open_gaps.clear()
            pub.last_ts = None  # a restarted engine may have a different clock
            return Irregularity(RESTART, key, expected, seq)
        pub.duplicates += 1
        self.duplicates += 1
        return Irregularity(DUPLICATE, key, expected, seq)

    def _malformed(self, pub: PublisherSequence, seq: Any) -> None:
        expected = pub.expected
        if type(seq) is not int or expected is None:
            return
        if seq == expected:
            pub.expected = seq + 1
        elif seq < expected and pub.take(seq):
            self.missing -= 1  # arrived, if unreadable: the caller counts it as malformed

    def fill(self, publisher: Any, seq: int) -> bool:
        """A batch of ``publisher`` (an :attr:`Irregularity.publisher`) fetched from the replay
        socket: count ``seq`` as recovered. False if it was not missing (nothing counted)."""
        pub = self.publishers.get(publisher)
        if pub is None or not pub.take(seq):
            return False
        pub.recovered += 1
        self.missing -= 1
        self.recovered += 1
        return True

    def time_went_backwards(self, batch: Batch, irregularity: Irregularity | None) -> bool:
        """Whether ``batch`` (already observed, ``irregularity`` its verdict) carries an engine
        timestamp earlier than its publisher's latest one.

        Batches that fill a gap are expected to be older and are not compared, nor are
        malformed batches, recovered ones and those without a timestamp; a restart forgets the
        publisher's latest timestamp (the restarted engine may have another clock)."""
        ts = batch.ts
        if ts is None or batch.error is not None or batch.recovered:
            return False
        if irregularity is not None and irregularity.kind in (REORDER, RECOVERED):
            return False
        pub = self.publishers[publisher_key(batch)]
        if pub.last_ts is not None and ts < pub.last_ts:
            pub.ts_backwards += 1
            self.ts_backwards += 1
            return True
        pub.last_ts = ts
        return False

    def summary(self) -> dict[str, dict[str, int]]:
        """Per publisher (as a string): batches, last_seq (-1 before any), gaps, missing,
        duplicates, reorders, resets (restarts), recovered."""
        return {
            str(key): {
                "batches": pub.batches,
                "last_seq": -1 if pub.expected is None else pub.expected - 1,
                "gaps": pub.gaps,
                "missing": pub.missing,
                "duplicates": pub.duplicates,
                "reorders": pub.reorders,
                "resets": pub.restarts,
                "recovered": pub.recovered,
            }
            for key, pub in self.publishers.items()
        }
