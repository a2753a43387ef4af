"""Aggregations for ``kvctl stats`` (and the data behind ``--plot``): pure, JSON-ready.

Clocks: rates and the occupancy timeline use the receive time (``recv_ns``, one clock across
all sources; the engine ``ts`` when no receive time was recorded); block lifetimes use engine
time (``ts``; the receive time as fallback), since a store and its removal come from the same
engine clock. Times in the result are seconds relative to the first bucket's start ``t0``.

The cache model is :class:`kvctl.state.StreamState` (engine view: stores with an unknown parent
are kept), so occupancy is what the engine holds, not what a strict router would index.
"""

from __future__ import annotations

import math
import random
from array import array
from typing import Any

from .events import BLOCK_REMOVED, BLOCK_STORED, Batch
from .sequence import SequenceTracker
from .state import StreamState, WorkerKey, batch_time, recv_time, worker_label

PERCENTILES = (50, 90, 99)


def percentile(sorted_values: Any, q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default) of an already sorted sequence."""
    n = len(sorted_values)
    if n == 0:
        return None
    pos = (n - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def lifetime_summary(values: Any) -> dict[str, Any]:
    """count, min, max, mean, p50/p90/p99 and a log2 histogram (seconds) of lifetimes."""
    # Non-finite values only come from broken timestamps; they would break the histogram.
    vals = sorted(v for v in values if math.isfinite(v))
    if not vals:
        return {"count": 0}
    out: dict[str, Any] = {
        "count": len(vals),
        "min": vals[0],
        "max": vals[-1],
        "mean": sum(vals) / len(vals),
    }
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(vals, q)
    # Power-of-two bucket edges from 1 ms: lifetimes span ms (decode churn) to hours (prefixes).
    edges = [0.0, 0.001]
    while edges[-1] <= vals[-1]:
        edges.append(edges[-1] * 2)
    counts = [0] * (len(edges) - 1)
    i = 0
    for v in vals:  # sorted, so one pass
        while i < len(counts) - 1 and v >= edges[i + 1]:
            i += 1
        counts[i] += 1
    out["histogram"] = {"edges_s": edges, "counts": counts}
    return out


class _Counts:
    __slots__ = ("batches", "events", "stored_blocks", "removed_blocks", "by_type", "malformed")

    def __init__(self) -> None:
        self.batches = self.events = self.stored_blocks = self.removed_blocks = 0
        self.malformed = 0
        self.by_type: dict[str, int] = {}

    def to_json(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "events": self.events,
            "malformed": self.malformed,
            "events_by_type": dict(sorted(self.by_type.items())),
            "blocks_by_type": {
                BLOCK_STORED: self.stored_blocks,
                BLOCK_REMOVED: self.removed_blocks,
            },
        }


class StatsCollector:
    """Feed batches in arrival order, then read :meth:`result`.

    ``bucket_s`` is the rate/occupancy resolution; when a stream spans more than
    ``max_buckets`` buckets they are merged pairwise (bucket width doubles), so memory stays
    bounded on long recordings. At most ``max_lifetimes`` lifetimes per worker are kept
    (reservoir sampling with a fixed seed beyond that: deterministic results), and the overall
    lifetime summary is of at most ``max_lifetimes`` of them, drawn from each worker's in
    proportion to the removals it saw: memory does not grow with the row count.
    """

    def __init__(
        self, bucket_s: float = 1.0, max_buckets: int = 3600, max_lifetimes: int = 100_000
    ) -> None:
        self.bucket_s = bucket_s
        self.max_buckets = max_buckets
        self.max_lifetimes = max_lifetimes
        self.state = StreamState(track_lifetimes=True, track_sharing=True)
        self.seq = SequenceTracker()
        self.total = _Counts()
        self.per_worker: dict[WorkerKey, _Counts] = {}
        self.lora: dict[str, int] = {}
        self.medium_stored: dict[str, int] = {}
        self.medium_removed: dict[str, int] = {}
        self.t0: float | None = None
        # bucket index -> [batches, events, stored blocks, removed blocks]
        self.rates: list[list[int]] = []
        self.worker_rates: dict[WorkerKey, list[int]] = {}  # events per bucket
        self.occupancy: list[dict[WorkerKey, int]] = []  # sampled at the end of each bucket
        self._cur = -1  # bucket of the latest batch (occupancy sampling point)
        self._rng = random.Random(0)
        self._seen_lifetimes: dict[WorkerKey, int] = {}

    # --- feeding ---------------------------------------------------------------------------

    def feed(self, batch: Batch) -> None:
        # A malformed message's seq counts as everywhere (see kvctl.sequence).
        tracker = self.seq
        tracker.time_went_backwards(batch, tracker.observe(batch))
        total = self.total
        total.batches += 1
        if batch.error is not None:
            total.malformed += 1
        bucket = self._bucket(recv_time(batch))
        row = self.rates[bucket] if bucket is not None else None
        if row is not None:
            row[0] += 1
            if bucket > self._cur:  # type: ignore[operator]
                self._sample(bucket)  # type: ignore[arg-type]
        state = self.state
        bkey = state.batch_key(batch)
        t = batch_time(batch)
        per_worker = self.per_worker
        for ev in batch.events:
            if type(ev) is not dict:
                continue
            key = state.event_key(ev, bkey)
            wc = per_worker.get(key)
            if wc is None:
                wc = per_worker[key] = _Counts()
            etype = ev.get("type")
            etype_s = etype if type(etype) is str else repr(etype)
            total.events += 1
            wc.events += 1
            total.by_type[etype_s] = total.by_type.get(etype_s, 0) + 1
            wc.by_type[etype_s] = wc.by_type.get(etype_s, 0) + 1
            hashes = ev.get("block_hashes")
            n = len(hashes) if type(hashes) is list else 0
            if etype == BLOCK_STORED:
                total.stored_blocks += n
                wc.stored_blocks += n
                lora = ev.get("lora_name") or ev.get("lora_id")
                lk = str(lora) if lora else "none"
                self.lora[lk] = self.lora.get(lk, 0) + n
                mk = str(ev.get("medium") or ev.get("storage_tier") or "none")
                self.medium_stored[mk] = self.medium_stored.get(mk, 0) + n
                if row is not None:
                    row[2] += n
            elif etype == BLOCK_REMOVED:
                total.removed_blocks += n
                wc.removed_blocks += n
                mk = str(ev.get("medium") or ev.get("storage_tier") or "none")
                self.medium_removed[mk] = self.medium_removed.get(mk, 0) + n
                if row is not None:
                    row[3] += n
            if row is not None:
                row[1] += 1
                wr = self.worker_rates.get(key)
                if wr is None:
                    wr = self.worker_rates[key] = [0] * len(self.rates)
                elif len(wr) < len(self.rates):
                    wr.extend([0] * (len(self.rates) - len(wr)))
                wr[bucket] += 1  # type: ignore[index]
            state.apply_event(ev, key, t)
        if total.batches & 1023 == 0:
            self._cap_lifetimes()

    def _bucket(self, t: float | None) -> int | None:
        if t is None or not math.isfinite(t):
            return None  # no usable time: counted in totals, not in the timeline
        if self.t0 is None:
            self.t0 = t
        if not math.isfinite(t - self.t0):  # times apart beyond a float: no decoder passes them
            return None
        idx = int((t - self.t0) // self.bucket_s)
        if idx < 0:
            idx = 0  # a source whose clock is behind the first one's: count in the first bucket
        while idx >= self.max_buckets:
            self._coarsen()
            idx = int((t - self.t0) // self.bucket_s)
        rates = self.rates
        while len(rates) <= idx:
            rates.append([0, 0, 0, 0])
        return idx

    def _coarsen(self) -> None:
        """Merge buckets pairwise: sums for rates, the later sample for occupancy."""
        self.bucket_s *= 2
        rates = self.rates
        self.rates = [
            [a + b for a, b in zip(rates[i], rates[i + 1], strict=True)]
            if i + 1 < len(rates)
            else rates[i]
            for i in range(0, len(rates), 2)
        ]
        for key, wr in self.worker_rates.items():
            self.worker_rates[key] = [sum(wr[i : i + 2]) for i in range(0, len(wr), 2)]
        # occupancy[i] is the sample of bucket i < _cur; merged bucket i ends with old 2i+1.
        self._cur = max(self._cur // 2, 0) if self._cur >= 0 else -1
        self.occupancy = [self.occupancy[2 * i + 1] for i in range(max(self._cur, 0))]

    def _snapshot(self) -> dict[WorkerKey, int]:
        return {k: len(c.blocks) for k, c in self.state.workers.items()}

    def _sample(self, bucket: int) -> None:
        # Occupancy only changes on events, so it is sampled when time moves into a new bucket
        # (before that batch applies): the sample of a bucket is the occupancy after its last
        # event, and quiet buckets repeat the previous value. Per-bucket, not per-batch, work.
        if self._cur >= 0:
            snap = self._snapshot()
            occ = self.occupancy
            while len(occ) < bucket:
                occ.append(snap)
        self._cur = bucket

    def _cap_lifetimes(self) -> None:
        # Reservoir sampling keeps a uniform sample of each worker's lifetimes once the cap is hit.
        cap = self.max_lifetimes
        for key, cache in self.state.workers.items():
            lt = cache.lifetimes
            if lt is None or len(lt) <= cap:
                continue
            seen = self._seen_lifetimes.get(key, cap)
            keep = lt[:cap]
            for v in lt[cap:]:
                seen += 1
                j = self._rng.randrange(seen)
                if j < cap:
                    keep[j] = v
            self._seen_lifetimes[key] = seen
            cache.lifetimes = array("d", keep)

    # --- result ----------------------------------------------------------------------------

    def _overall_lifetimes(self) -> Any:
        """Every worker's lifetimes while they fit ``max_lifetimes``; beyond, a sample of that
        size, each worker's share in proportion to the removals it saw (a fixed seed)."""
        kept = {k: c.lifetimes for k, c in self.state.workers.items() if c.lifetimes is not None}
        if sum(len(v) for v in kept.values()) <= self.max_lifetimes:
            out = array("d")
            for key in sorted(kept, key=worker_label):
                out.extend(kept[key])
            return out
        seen = {k: max(self._seen_lifetimes.get(k, len(v)), len(v)) for k, v in kept.items()}
        total = sum(seen.values())
        rng = random.Random(0)
        sample = array("d")
        for key in sorted(kept, key=worker_label):
            share = min(len(kept[key]), round(self.max_lifetimes * seen[key] / total))
            sample.extend(rng.sample(list(kept[key]), share))
        return sample

    def result(self) -> dict[str, Any]:
        """Everything as a JSON-ready dict (string keys, no bytes)."""
        self._cap_lifetimes()
        state = self.state
        workers: dict[str, Any] = {}
        all_lifetimes = self._overall_lifetimes()
        for key in sorted(self.per_worker, key=worker_label):
            counts = self.per_worker[key]
            cache = state.workers.get(key)
            w = counts.to_json()
            w.pop("batches")
            w.pop("malformed")
            w["blocks_cached"] = len(cache.blocks) if cache else 0
            w["max_blocks_cached"] = cache.max_blocks if cache else 0
            w["cleared"] = cache.cleared if cache else 0
            lts = cache.lifetimes if cache and cache.lifetimes is not None else []
            w["lifetime_s"] = lifetime_summary(lts)
            w["lifetime_s"].pop("histogram", None)
            wr = self.worker_rates.get(key, [])
            w["events_per_bucket"] = wr + [0] * (len(self.rates) - len(wr))
            workers[worker_label(key)] = w
        labels = {k: worker_label(k) for k in state.workers}
        occupancy = self.occupancy + ([self._snapshot()] if self._cur >= 0 else [])
        overall = self.total.to_json()
        overall["workers"] = len(self.per_worker)
        overall["blocks_cached"] = state.total_blocks
        return {
            "overall": overall,
            "workers": workers,
            "rates": {
                "t0": self.t0,
                "bucket_s": self.bucket_s,
                "columns": ["batches", "events", "stored_blocks", "removed_blocks"],
                "buckets": self.rates,
                "peak_events_per_s": (
                    max(r[1] for r in self.rates) / self.bucket_s if self.rates else 0.0
                ),
            },
            "occupancy": {
                "t0": self.t0,
                "bucket_s": self.bucket_s,
                "samples": [{labels[k]: v for k, v in snap.items()} for snap in occupancy],
            },
            "lifetime_s": lifetime_summary(all_lifetimes),
            "reuse": {
                "hashes_on_multiple_workers": state.shared_hashes,
                "extra_stores": state.cross_worker_stores,
            },
            "lora": dict(sorted(self.lora.items())),
            "medium": {
                "stored": dict(sorted(self.medium_stored.items())),
                "removed": dict(sorted(self.medium_removed.items())),
            },
            "gaps": {
                "publishers": self.seq.summary(),
                "ts_backwards": self.seq.ts_backwards,
            },
        }
