"""What a run keeps and when it stops: event filters and limits, pure values.

Below both the pipeline (which applies them) and the recording (whose conversion applies the
recorder's filters again when it re-decodes journalled frames), so neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from .events import Batch, Event


@dataclass
class Limits:
    count: int | None = None
    duration: float | None = None
    idle_timeout: float | None = None


@dataclass
class Filters:
    types: frozenset[str] = frozenset()
    workers: frozenset[str] = frozenset()
    partition: tuple[int, int] | None = None
    """``(I, N)``: only the workers of partition I of N (``kvctl check --partition``): those
    :func:`kvctl.partitions.partition_of` puts there, by :func:`batch_partition_key`."""

    needs_frames: bool = True
    """The consumer reads batches' raw frames; False lets a dataset leave them unread (a
    batch then comes without frames): ``kvctl stats`` only models the events."""

    since_ns: int | None = None
    until_ns: int | None = None
    """A receive-time window (ns, inclusive) a dataset need not read outside of: its files,
    row groups and rows there are skipped. Not applied by :meth:`apply`: a command that sets
    it applies its own rule too (``kvctl index --until TIME``)."""

    def keeps_batch(self, batch: Batch) -> bool:
        """The batch belongs to the selected partition (always, without one)."""
        if self.partition is None:
            return True
        from .partitions import partition_of

        index, count = self.partition
        return partition_of(batch_partition_key(batch), count) == index

    def apply(self, batch: Batch) -> list[Event]:
        if not self.keeps_batch(batch):
            return []
        events = batch.events
        if self.types:
            events = [e for e in events if e.get("type") in self.types]
        if self.workers and str(batch.worker_id) not in self.workers:
            events = [e for e in events if str(e.get("worker_id", batch.worker_id)) in self.workers]
        return events


def batch_partition_key(batch: Batch) -> str:
    """What a batch is partitioned by (:func:`kvctl.partitions.partition_key`): its worker
    label as the recording's ``worker_id`` column shows it, else its source."""
    from .partitions import partition_key

    return partition_key(batch.worker_id, batch.source)


@dataclass(frozen=True)
class Until:
    """``--until``: the batches an index as it stood at a moment is built from: received at or
    before a time (unix seconds), or numbered at most N by their own publisher."""

    kind: str
    """``time`` or ``seq``."""
    limit: float

    @classmethod
    def parse(cls, text: str) -> Until:
        """``seq:N``, unix seconds or an ISO-8601 time (local time without a zone, as people
        mean it); ValueError says what is wrong."""
        if text.startswith("seq:"):
            try:
                return cls("seq", int(text[4:]))
            except ValueError:
                raise ValueError(f"{text!r}: seq:N needs an integer N") from None
        try:
            seconds = float(text)
        except ValueError:
            pass
        else:
            if not math.isfinite(seconds):
                raise ValueError(f"{text!r} is not a time")
            return cls("time", seconds)
        try:
            moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise ValueError(
                f"{text!r} is neither seq:N, unix seconds nor an ISO-8601 time"
            ) from None
        if moment.tzinfo is None:
            moment = moment.astimezone()
        return cls("time", moment.timestamp())

    def keeps(self, batch: Batch) -> bool:
        """A batch without a seq (or a receive time) cannot be placed, and is kept."""
        if self.kind == "seq":
            return batch.seq is None or batch.seq <= self.limit
        return batch.recv_ns / 1e9 <= self.limit if batch.recv_ns else True
