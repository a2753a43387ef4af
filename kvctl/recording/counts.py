"""Running counts over rows of the recording schema: kept by the writers (a file's footer, the
manifest's totals), recomputed by the readers (``kvctl inspect``)."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


class Counts:
    """Running counts over Parquet-schema rows (kept by writers, recomputed by readers)."""

    FIELDS = ("rows", "batches", "events", "malformed", "gaps", "missing", "raw_bytes")

    def __init__(self) -> None:
        self.rows = self.batches = self.events = self.malformed = 0
        self.gaps = self.missing = self.raw_bytes = 0
        self.first_recv_ns: int | None = None
        self.last_recv_ns: int | None = None
        self.first_batch_index: int | None = None
        self.last_batch_index: int | None = None

    def add_record_batch(self, rb: pa.RecordBatch) -> None:
        n = rb.num_rows
        if not n:
            return
        self.rows += n
        self.events += n - rb.column("event_index").null_count
        raw_size = rb.column("raw_size")
        self.batches += n - raw_size.null_count
        self.malformed += n - rb.column("error").null_count
        self.raw_bytes += pc.sum(raw_size).as_py() or 0
        bi = rb.column("batch_index")
        if bi.null_count:
            for extra in rb.column("extra").filter(pc.is_null(bi)).to_pylist():
                self.gaps += 1
                self.missing += json.loads(extra).get("missing", 0) if extra else 0
        self._span("recv_ns", pc.min_max(rb.column("recv_ns")).as_py())
        self._span("batch_index", pc.min_max(bi).as_py())

    def _span(self, name: str, mm: dict[str, Any]) -> None:
        lo, hi = mm["min"], mm["max"]
        if lo is None:
            return
        first, last = f"first_{name}", f"last_{name}"
        if getattr(self, first) is None or lo < getattr(self, first):
            setattr(self, first, lo)
        if getattr(self, last) is None or hi > getattr(self, last):
            setattr(self, last, hi)

    def merge(self, other: Counts) -> None:
        for f in self.FIELDS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for name in ("recv_ns", "batch_index"):
            first = getattr(other, f"first_{name}")
            if first is not None:
                self._span(name, {"min": first, "max": getattr(other, f"last_{name}")})

    def as_dict(self) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in self.FIELDS}
        out.update(
            first_recv_ns=self.first_recv_ns,
            last_recv_ns=self.last_recv_ns,
            first_batch_index=self.first_batch_index,
            last_batch_index=self.last_batch_index,
        )
        return out
