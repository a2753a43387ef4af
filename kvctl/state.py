"""The stream state model: what each worker has cached, rebuilt from its events in order.

Pure and clock-free: times come from the batches. Used by ``check``, ``stats`` and ``top``, and
by tests of replay/simulate that want to compare a stream with the cache that produced it.

Semantics follow NVIDIA Dynamo's KV indexer (``RadixTree::apply_event``), the consumer most
streams are written for:

- A worker is ``(worker_id, dp_rank)``. ``worker_id`` is the event's own ``worker_id`` key
  (Dynamo RouterEvents carry one each), else the batch's ``worker_id``, else the batch's
  ``source`` (one engine socket = one worker, so two engines never share a cache by accident).
  A missing ``dp_rank`` counts as rank 0, as in Dynamo.
- Hashes are keyed by their 64 bits: a signed and an unsigned int with the same bits are the same
  block (Dynamo decodes both into one u64). Byte-string hashes (vLLM with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) stay byte-string keys: they never equal an int.
  Ints that do not fit 64 bits keep their value as key (``check`` flags them).
- ``BlockRemoved`` drops exactly the listed blocks. Descendants of a removed block stay cached
  on that worker, with a parent link to a block that is gone: Dynamo does the same (it removes
  the block from the worker's lookup table only; the descendants merely become unreachable for
  prefix matching). Removing an unknown hash is reported and skipped; unlike Dynamo >= 1.x,
  which aborts the rest of the event at the first unknown hash, the remaining hashes are still
  removed, so one bad hash is reported once instead of cascading into later findings.
- ``BlockStored`` whose parent is not cached on the worker is reported. Dynamo rejects the whole
  store; with ``strict_parents=True`` so does this model (the router's view), by default the
  blocks are kept (the engine's view), so one lost event is reported once, not once per
  descendant.
- Storing a hash that is already cached is reported and overwrites the entry (Dynamo re-inserts).
- ``AllBlocksCleared`` empties every dp rank of that ``worker_id`` (Dynamo's
  ``clear_all_blocks`` matches on ``worker_id`` only).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

from .events import ALL_BLOCKS_CLEARED, BLOCK_REMOVED, BLOCK_STORED, U64_MASK, Batch, Event

_I64_MIN = -(1 << 63)
_U64_LIMIT = 1 << 64

# Anomaly kinds reported by StreamState.apply_event.
REMOVE_UNKNOWN = "remove-unknown"
PARENT_UNKNOWN = "parent-unknown"
DUPLICATE_STORE = "duplicate-store"
INVALID_EVENT = "invalid-event"
UNKNOWN_TYPE = "unknown-type"

WorkerKey = tuple[Any, int]


class Anomaly(NamedTuple):
    kind: str
    worker: WorkerKey
    hash: Any
    """The hash as sent (not normalised), or None."""
    detail: str = ""


class Block(NamedTuple):
    parent: Hashable | None
    """Normalised parent hash, or None for a chain that starts at token 0."""
    block_size: Any
    stored_at: float | None


def norm_hash(h: Any) -> Hashable:
    """The key a hash is cached under: its 64 bits as an unsigned int, bytes as bytes.

    Anything else (a float, a string, a list from a broken producer) gets a tagged key that
    cannot collide with a real hash, so the model never raises on bad input."""
    if type(h) is int:
        return h & U64_MASK if _I64_MIN <= h < _U64_LIMIT else h
    if type(h) is bytes:
        return h
    if isinstance(h, (bytearray, memoryview)):
        return bytes(h)
    return ("invalid", repr(h))


def batch_time(batch: Batch) -> float | None:
    """Engine time of a batch in seconds; the receive time when the producer sent none."""
    if batch.ts is not None:
        return batch.ts
    return batch.recv_ns / 1e9 if batch.recv_ns else None


def recv_time(batch: Batch) -> float | None:
    """Receive time in seconds (one clock across sources); engine time when not recorded."""
    return batch.recv_ns / 1e9 if batch.recv_ns else batch.ts


def worker_label(key: WorkerKey) -> str:
    """A stable string for a worker key, for JSON and tables: ``worker[dpN]``."""
    return f"{key[0]}[dp{key[1]}]"


class WorkerCache:
    """The blocks one (worker_id, dp_rank) holds, plus counters that are cheap to keep."""

    __slots__ = (
        "key",
        "blocks",
        "stored_events",
        "stored_blocks",
        "removed_events",
        "removed_blocks",
        "cleared",
        "max_blocks",
        "lifetimes",
    )

    def __init__(self, key: WorkerKey, track_lifetimes: bool = False) -> None:
        self.key = key
        # hash key -> (parent key, block_size, stored_at); plain tuples: cheapest to build.
        self.blocks: dict[Hashable, tuple[Hashable | None, Any, float | None]] = {}
        self.stored_events = 0
        self.stored_blocks = 0
        self.removed_events = 0
        self.removed_blocks = 0
        self.cleared = 0
        self.max_blocks = 0
        self.lifetimes: array | None = array("d") if track_lifetimes else None

    @property
    def occupancy(self) -> int:
        return len(self.blocks)

    @property
    def label(self) -> str:
        return worker_label(self.key)


class StreamState:
    """Per-(worker_id, dp_rank) cache contents, fed batch by batch (or event by event).

    ``apply(batch)`` returns the anomalies it met (empty list for a clean batch). Options:
    ``strict_parents`` rejects stores whose parent is unknown (Dynamo's behaviour, see module
    doc); ``track_lifetimes`` records store->remove durations per worker (seconds, engine time);
    ``track_sharing`` counts, per hash, how many workers hold it (reuse across workers).
    """

    def __init__(
        self,
        strict_parents: bool = False,
        track_lifetimes: bool = False,
        track_sharing: bool = False,
    ) -> None:
        self.strict_parents = strict_parents
        self.track_lifetimes = track_lifetimes
        self.workers: dict[WorkerKey, WorkerCache] = {}
        self._ranks: dict[Any, list[WorkerKey]] = {}  # worker_id -> its keys, for Cleared
        self.holders: dict[Hashable, int] | None = {} if track_sharing else None
        self.shared_hashes = 0
        """Hashes that were at some time cached on more than one worker at once."""
        self.cross_worker_stores = 0
        """Stores of a hash that another worker already held (a router could have reused it)."""
        self._shared_seen: set[Hashable] = set()

    # --- lookups ---------------------------------------------------------------------------

    def worker(self, key: WorkerKey) -> WorkerCache:
        cache = self.workers.get(key)
        if cache is None:
            cache = self.workers[key] = WorkerCache(key, self.track_lifetimes)
            self._ranks.setdefault(key[0], []).append(key)
        return cache

    def is_cached(self, key: WorkerKey, block_hash: Any) -> bool:
        cache = self.workers.get(key)
        return cache is not None and norm_hash(block_hash) in cache.blocks

    def block(self, key: WorkerKey, block_hash: Any) -> Block | None:
        cache = self.workers.get(key)
        entry = cache.blocks.get(norm_hash(block_hash)) if cache is not None else None
        return Block(*entry) if entry is not None else None

    def parent(self, key: WorkerKey, block_hash: Any) -> Hashable | None:
        """Normalised parent of a cached block (None for a root block or an unknown one)."""
        entry = self.block(key, block_hash)
        return entry.parent if entry is not None else None

    def occupancy(self) -> dict[WorkerKey, int]:
        return {k: len(c.blocks) for k, c in self.workers.items()}

    @property
    def total_blocks(self) -> int:
        return sum(len(c.blocks) for c in self.workers.values())

    def workers_holding(self, block_hash: Any) -> list[WorkerKey]:
        h = norm_hash(block_hash)
        return [k for k, c in self.workers.items() if h in c.blocks]

    def __iter__(self) -> Iterator[WorkerCache]:
        return iter(self.workers.values())

    # --- feeding ---------------------------------------------------------------------------

    @staticmethod
    def batch_key(batch: Batch) -> WorkerKey:
        wid = batch.worker_id if batch.worker_id is not None else batch.source
        return (wid, batch.dp_rank or 0)

    @staticmethod
    def event_key(event: Event, batch_key: WorkerKey) -> WorkerKey:
        """Dynamo events name their worker; engine events belong to the batch's worker."""
        wid = event.get("worker_id")
        if wid is None:
            return batch_key
        rank = event.get("dp_rank")
        key = (wid, rank if type(rank) is int else 0)
        try:
            hash(key)
        except TypeError:  # a worker_id that is a list or map: use its text
            key = (repr(wid), key[1])
        return key

    def apply(self, batch: Batch) -> list[Anomaly]:
        """Apply every event of a batch in order; malformed batches carry no events."""
        out: list[Anomaly] = []
        bkey = self.batch_key(batch)
        t = batch_time(batch)
        for ev in batch.events:
            if type(ev) is not dict:
                out.append(Anomaly(INVALID_EVENT, bkey, None, "event is not a map"))
                continue
            found = self.apply_event(ev, self.event_key(ev, bkey), t)
            if found:
                out.extend(found)
        return out

    def apply_event(self, ev: Event, key: WorkerKey, t: float | None) -> list[Anomaly] | None:
        """Apply one event to worker ``key`` at time ``t``; anomalies, or None when clean."""
        etype = ev.get("type")
        if etype == BLOCK_STORED:
            return self._store(ev, key, t)
        if etype == BLOCK_REMOVED:
            return self._remove(ev, key, t)
        if etype == ALL_BLOCKS_CLEARED:
            self._clear(key)
            return None
        return [Anomaly(UNKNOWN_TYPE, key, None, str(etype)[:80])]

    def _store(self, ev: Event, key: WorkerKey, t: float | None) -> list[Anomaly] | None:
        hashes = ev.get("block_hashes")
        if type(hashes) is not list:
            return [Anomaly(INVALID_EVENT, key, None, "block_hashes is not an array")]
        cache = self.workers.get(key) or self.worker(key)
        blocks = cache.blocks
        out: list[Anomaly] | None = None
        parent_raw = ev.get("parent_block_hash")
        parent = None if parent_raw is None else norm_hash(parent_raw)
        if parent is not None and parent not in blocks:
            out = [Anomaly(PARENT_UNKNOWN, key, parent_raw)]
            if self.strict_parents:
                return out
        size = ev.get("block_size")
        holders = self.holders
        cache.stored_events += 1
        for raw in hashes:
            h = norm_hash(raw)
            if h in blocks:
                if out is None:
                    out = []
                out.append(Anomaly(DUPLICATE_STORE, key, raw))
            elif holders is not None:
                n = holders.get(h, 0)
                if n:
                    self.cross_worker_stores += 1
                    if h not in self._shared_seen:
                        self._shared_seen.add(h)
                        self.shared_hashes += 1
                holders[h] = n + 1
            blocks[h] = (parent, size, t)
            parent = h
        cache.stored_blocks += len(hashes)
        if len(blocks) > cache.max_blocks:
            cache.max_blocks = len(blocks)
        return out

    def _remove(self, ev: Event, key: WorkerKey, t: float | None) -> list[Anomaly] | None:
        hashes = ev.get("block_hashes")
        if type(hashes) is not list:
            return [Anomaly(INVALID_EVENT, key, None, "block_hashes is not an array")]
        cache = self.workers.get(key) or self.worker(key)
        blocks = cache.blocks
        lifetimes = cache.lifetimes
        holders = self.holders
        out: list[Anomaly] | None = None
        cache.removed_events += 1
        for raw in hashes:
            h = norm_hash(raw)
            entry = blocks.pop(h, None)
            if entry is None:
                if out is None:
                    out = []
                out.append(Anomaly(REMOVE_UNKNOWN, key, raw))
                continue
            cache.removed_blocks += 1
            if lifetimes is not None and t is not None and entry[2] is not None:
                lifetimes.append(t - entry[2])
            if holders is not None:
                self._release(h)
        return out

    def _release(self, h: Hashable) -> None:
        holders = self.holders
        assert holders is not None
        n = holders.get(h, 0) - 1
        if n > 0:
            holders[h] = n
        else:
            holders.pop(h, None)

    def _clear(self, key: WorkerKey) -> None:
        if key not in self.workers:
            self.worker(key)
        for k in self._ranks.get(key[0], ()):
            cache = self.workers[k]
            if self.holders is not None:
                for h in cache.blocks:
                    self._release(h)
            cache.blocks = {}
            cache.cleared += 1
