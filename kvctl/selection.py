"""What a run keeps and when it stops: event filters and limits, pure values.

Below both the pipeline (which applies them) and the recording (whose conversion applies the
recorder's filters again when it re-decodes journalled frames), so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def apply(self, batch: Batch) -> list[Event]:
        events = batch.events
        if self.types:
            events = [e for e in events if e.get("type") in self.types]
        if self.workers and str(batch.worker_id) not in self.workers:
            events = [e for e in events if str(e.get("worker_id", batch.worker_id)) in self.workers]
        return events
