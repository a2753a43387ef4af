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


# --- the router's view: Dynamo's KV indexer --------------------------------------------------
#
# ``StreamState`` above is the engine's view, keyed by the engine's block hashes. A KV router
# keys what it believes by token content: Dynamo's indexer walks a prefix tree of
# ``tokens_hash`` values (xxh3_64 of each block's tokens, ``LocalBlockHash``), and each worker's
# engine hashes only name positions in that tree. ``RouterIndex`` is that view, with the
# decisions Dynamo 1.6 makes, observed on its standalone indexer (``python -m dynamo.indexer``)
# and kept by tests/test_index_dynamo.py. Where ``check`` (StreamState) decides otherwise, on
# purpose, for a checker that reports each lost event once:
#
# - a removal drops the block and every descendant the worker holds below it (StreamState
#   drops the listed block only);
# - ``AllBlocksCleared`` clears one (worker_id, dp_rank), every tier (StreamState: every dp
#   rank of the worker_id);
# - a store whose parent the worker does not hold is rejected whole on the device tier, as
#   ``StreamState(strict_parents=True)`` does; lower tiers take it;
# - a store whose ``block_size`` differs from the index's is dropped whole, and one whose
#   ``token_ids`` run short ends at the first incomplete block;
# - tiers are separate indexes: ``medium`` GPU (or none) is the device tier, CPU* the host
#   tier, DISK/STORAGE disk, EXTERNAL external; any other medium is not indexed.

DEVICE, HOST, DISK, EXTERNAL = "device", "host_pinned", "disk", "external"
TIERS = (DEVICE, HOST, DISK, EXTERNAL)
LOWER_TIERS = (HOST, DISK, EXTERNAL)
"""Walked in this order after the device tier, each continuing where the previous one ended."""

# Decisions (``status`` in the counters), Dynamo's names where it has one.
OK = "ok"
PARENT_NOT_FOUND = "parent_block_not_found"
BLOCK_NOT_FOUND = "block_not_found"
"""A removal that named a block the worker does not hold (the other blocks are removed)."""
INVALID_BLOCK = "invalid_block"
"""A store whose block size differs from the index's, or without a full block of tokens."""
UNKNOWN_TIER = "unknown_medium"
UNSUPPORTED_DOMAIN = "unsupported_residency_domain"

IndexWorker = tuple[Any, int]
"""(worker_id, dp_rank), as Dynamo's ``WorkerWithDpRank``."""


def tier_of_medium(medium: Any) -> str | None:
    """The Dynamo storage tier an engine's ``medium`` lands in; None: not indexed."""
    if medium is None or medium == "GPU":
        return DEVICE
    if type(medium) is not str:
        return None
    if medium.startswith("CPU"):
        return HOST
    if medium in ("DISK", "STORAGE"):
        return DISK
    if medium == "EXTERNAL":
        return EXTERNAL
    return None


def dynamo_block_hashes(
    token_ids: list[int], block_size: int, lora_name: str | None = None
) -> list[int]:
    """Dynamo's ``compute_block_hash_for_seq``: the ``tokens_hash`` of every full block of a
    prompt (a partial last block is not hashed), LoRA-seeded when ``lora_name`` is set."""
    from .formats.dynamo import tokens_hash

    full = len(token_ids) - len(token_ids) % block_size
    return [
        tokens_hash(token_ids[i : i + block_size], lora_name) for i in range(0, full, block_size)
    ]


class _Node:
    """A block of the device tier's prefix tree: the workers holding it, each with its own
    engine hash, and ``block_hash``, the engine hash of the first worker that stored it (what
    Dynamo shows in ``/dump`` and anchors lower-tier walks on)."""

    __slots__ = ("local", "block_hash", "parent", "children", "workers")

    def __init__(self, local: int, block_hash: Any, parent: _Node | None) -> None:
        self.local = local
        self.block_hash = block_hash
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.workers: dict[IndexWorker, Any] = {}


class _LowerTier:
    """One worker's blocks on a lower tier: Dynamo keeps them by engine hash, chained by the
    parent hash each store named (whether or not that parent is held)."""

    __slots__ = ("blocks", "children")

    def __init__(self) -> None:
        self.blocks: dict[Any, tuple[Any, int]] = {}  # hash -> (parent hash, tokens_hash)
        self.children: dict[tuple[Any, int], Any] = {}  # (parent hash, tokens_hash) -> hash


class Overlap(NamedTuple):
    """What ``RouterIndex.query`` found, in blocks: ``device`` per worker that matched at least
    one device block, ``lower[tier]`` the blocks each worker's match continued on that tier."""

    device: dict[IndexWorker, int]
    lower: dict[str, dict[IndexWorker, int]]


class RouterIndex:
    """What a Dynamo KV router believes each worker holds (see the section comment above).

    Pure: fed batches (``apply``) or single events (``apply_event``), asked with token ids
    (``query``) or Dynamo block hashes (``query_hashes``). ``response`` and ``dump`` build the
    JSON of Dynamo's indexer endpoints ``/query`` and ``/dump``; ``decisions`` counts every
    event by (event type, tier, status), ``duplicate_stores`` the stores of a block already held."""

    def __init__(
        self, block_size: int, model_name: str = "default", routing_group: str = "default"
    ) -> None:
        self.block_size = block_size
        self.model_name = model_name
        self.routing_group = routing_group
        self.root = _Node(0, None, None)
        self.lookup: dict[IndexWorker, dict[Any, _Node]] = {}
        self.lower: dict[str, dict[IndexWorker, _LowerTier]] = {t: {} for t in LOWER_TIERS}
        self.decisions: dict[tuple[str, str, str], int] = {}
        self.duplicate_stores = 0
        """Stores of a block the worker already held (applied; Dynamo warns)."""
        self.sources: dict[IndexWorker, str] = {}
        """The address each worker was heard from (``/workers``)."""

    @property
    def model_key(self) -> str:
        """Dynamo's key of this index in ``/dump``: ``model_name:routing_group``."""
        return f"{self.model_name}:{self.routing_group}"

    # --- feeding ---------------------------------------------------------------------------

    def apply(self, batch: Batch) -> None:
        """Every event of a batch: its worker is the event's own ``worker_id``/``dp_rank``
        (Dynamo RouterEvents), else the batch's worker id (a source label, an llm-d topic, the
        source address) and the batch's dp rank (the payload's, else the label's, else 0)."""
        bkey = StreamState.batch_key(batch)
        for ev in batch.events:
            if type(ev) is not dict:
                continue
            key = StreamState.event_key(ev, bkey)
            worker = (_worker_id(key[0]), key[1])
            if worker not in self.sources:
                self.sources[worker] = batch.source
            self.apply_event(ev, worker)

    def _count(self, etype: str, tier: str, status: str) -> None:
        k = (etype, tier, status)
        self.decisions[k] = self.decisions.get(k, 0) + 1

    def apply_event(self, ev: Event, worker: IndexWorker) -> str:
        """Apply one event for ``worker``; returns the decision (a status name)."""
        etype = ev.get("type")
        if etype == ALL_BLOCKS_CLEARED:
            self.clear(worker)
            self._count("cleared", DEVICE, OK)
            return OK
        if etype not in (BLOCK_STORED, BLOCK_REMOVED):
            return UNKNOWN_TYPE
        name = "stored" if etype == BLOCK_STORED else "removed"
        tier = ev.get("storage_tier") or tier_of_medium(ev.get("medium"))
        if tier not in TIERS:
            self._count(name, str(tier), UNKNOWN_TIER)
            return UNKNOWN_TIER
        if ev.get("residency_domain") not in (None, "worker"):
            self._count(name, tier, UNSUPPORTED_DOMAIN)
            return UNSUPPORTED_DOMAIN
        hashes = ev.get("block_hashes")
        if type(hashes) is not list:
            self._count(name, tier, INVALID_BLOCK)
            return INVALID_BLOCK
        if etype == BLOCK_REMOVED:
            status = self.remove(worker, hashes, tier)
        else:
            locals_ = self._local_hashes(ev, len(hashes))
            if not locals_:
                status = INVALID_BLOCK
            else:
                parent = ev.get("parent_block_hash")
                # a store whose tokens run short keeps its first blocks (zip stops there)
                pairs = list(zip([norm_hash(h) for h in hashes], locals_, strict=False))
                status = self.store(
                    worker, None if parent is None else norm_hash(parent), pairs, tier
                )
        self._count(name, tier, status)
        return status

    def _local_hashes(self, ev: Event, count: int) -> list[int]:
        """The blocks' ``tokens_hash``: as a Dynamo event carries them, else of the engine's
        ``token_ids``, block by block, ending at the first block without its full tokens."""
        given = ev.get("tokens_hashes")
        if type(given) is list:
            return [h & U64_MASK if type(h) is int else 0 for h in given[:count]]
        size = ev.get("block_size")
        if size is not None and size != self.block_size:
            return []
        tokens = ev.get("token_ids")
        if type(tokens) is not list:
            return []
        size = self.block_size
        usable = min(count, len(tokens) // size)
        lora = ev.get("lora_name")
        return dynamo_block_hashes(
            tokens[: usable * size], size, lora if type(lora) is str else None
        )

    def store(
        self, worker: IndexWorker, parent: Any, blocks: list[tuple[Any, int]], tier: str = DEVICE
    ) -> str:
        """Store ``(engine hash, tokens_hash)`` blocks chained under ``parent`` (an engine
        hash the worker holds, or None from the root)."""
        if tier != DEVICE:
            held = self.lower[tier].setdefault(worker, _LowerTier())
            duplicate = False
            for h, local in blocks:
                duplicate |= h in held.blocks
                held.blocks[h] = (parent, local)
                held.children[(parent, local)] = h
                parent = h
            self.duplicate_stores += duplicate
            return OK
        lookup = self.lookup.setdefault(worker, {})
        if parent is None:
            node = self.root
        else:
            found = lookup.get(parent)
            if found is None:
                return PARENT_NOT_FOUND
            node = found
        duplicate = False
        for h, local in blocks:
            child = node.children.get(local)
            if child is None:
                child = node.children[local] = _Node(local, h, node)
            duplicate |= h in lookup
            child.workers[worker] = h
            lookup[h] = child
            node = child
        self.duplicate_stores += duplicate
        return OK

    def remove(self, worker: IndexWorker, hashes: list[Any], tier: str = DEVICE) -> str:
        """Remove blocks (on the device tier with everything the worker holds below them);
        unknown hashes are skipped, the others still removed."""
        status = OK
        if tier != DEVICE:
            held = self.lower[tier].get(worker)
            for raw in hashes:
                entry = held.blocks.pop(norm_hash(raw), None) if held else None
                if entry is None:
                    status = BLOCK_NOT_FOUND
                elif held is not None and held.children.get(entry) == norm_hash(raw):
                    del held.children[entry]
            return status
        lookup = self.lookup.get(worker, {})
        for raw in hashes:
            node = lookup.get(norm_hash(raw))
            if node is None:
                status = BLOCK_NOT_FOUND
                continue
            self._drop_subtree(worker, node, lookup)
        return status

    def _drop_subtree(self, worker: IndexWorker, top: _Node, lookup: dict[Any, _Node]) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            h = node.workers.pop(worker, None)
            if h is None:
                continue
            if lookup.get(h) is node:
                del lookup[h]
            stack.extend(c for c in node.children.values() if worker in c.workers)
            self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Unlink blocks no worker holds and nothing hangs below, up the chain."""
        while node.parent is not None and not node.workers and not node.children:
            parent = node.parent
            del parent.children[node.local]
            node = parent

    def clear(self, worker: IndexWorker) -> None:
        """``AllBlocksCleared``: one worker and dp rank, every tier."""
        lookup = self.lookup.pop(worker, {})
        for node in list(lookup.values()):
            node.workers.pop(worker, None)
        for node in lookup.values():
            self._prune(node)
        for tier in LOWER_TIERS:
            self.lower[tier].pop(worker, None)

    # --- asking ----------------------------------------------------------------------------

    def query(self, token_ids: list[int], lora_name: str | None = None) -> Overlap:
        """Matched blocks per worker and tier for a prompt, hashed as Dynamo's ``/query``."""
        return self.query_hashes(dynamo_block_hashes(token_ids, self.block_size, lora_name))

    def query_hashes(self, local_hashes: list[int]) -> Overlap:
        """Device tier: blocks matched from the first one on, per worker (a worker drops out
        at its first missing block). Lower tiers, in order, continue each worker's match where
        it ended, anchored on the engine hash of its last matched block; a worker with no
        match so far enters a tier from its root."""
        device: dict[IndexWorker, int] = {}
        anchor: dict[IndexWorker, tuple[int, Any]] = {}
        node = self.root
        active: dict[IndexWorker, Any] | None = None
        for depth, local in enumerate(local_hashes, 1):
            child = node.children.get(local)
            if child is None:
                break
            holders = child.workers
            active = dict(holders) if active is None else {w: 0 for w in active if w in holders}
            if not active:
                break
            for w in active:
                device[w] = depth
                anchor[w] = (depth, child.block_hash)
            node = child
        lower: dict[str, dict[IndexWorker, int]] = {}
        for tier in LOWER_TIERS:
            held_by = self.lower[tier]
            if not held_by:
                continue
            hits: dict[IndexWorker, int] = {}
            for w, held in held_by.items():
                start, parent = anchor.get(w, (0, None))
                pos = start
                while pos < len(local_hashes):
                    h = held.children.get((parent, local_hashes[pos]))
                    if h is None:
                        break
                    parent = h
                    pos += 1
                if pos > start:
                    hits[w] = pos - start
                    anchor[w] = (pos, parent)
            lower[tier] = hits
        return Overlap(device, lower)

    def response(self, overlap: Overlap) -> dict[str, Any]:
        """Dynamo's ``/query`` JSON: ``scores`` (device tier, per worker and dp rank),
        ``frequencies`` (always empty in Dynamo 1.6) and ``instances`` (per worker: matched
        tokens on the GPU per dp rank, and cumulative through the CPU and disk tiers)."""
        size = self.block_size
        scores: dict[str, dict[str, int]] = {}
        for (wid, dp), n in overlap.device.items():
            scores.setdefault(str(wid), {})[str(dp)] = n * size
        everyone = set(overlap.device)
        for hits in overlap.lower.values():
            everyone.update(hits)
        instances: dict[str, dict[str, Any]] = {}
        for w in everyone:
            gpu = overlap.device.get(w, 0)
            cpu = gpu + overlap.lower.get(HOST, {}).get(w, 0)
            disk = (
                cpu
                + overlap.lower.get(DISK, {}).get(w, 0)
                + overlap.lower.get(EXTERNAL, {}).get(w, 0)
            )
            s = instances.setdefault(
                str(w[0]), {"longest_matched": 0, "gpu": 0, "dp": {}, "cpu": 0, "disk": 0}
            )
            s["dp"][str(w[1])] = gpu * size
            s["gpu"] = max(s["gpu"], gpu * size)
            s["cpu"] = max(s["cpu"], cpu * size)
            s["disk"] = max(s["disk"], disk * size)
            s["longest_matched"] = max(s["gpu"], s["cpu"], s["disk"])
        return {"scores": scores, "frequencies": [], "instances": instances}

    def dump(self) -> dict[str, Any]:
        """Dynamo's ``/dump`` JSON: the index as RouterEvents that rebuild it. Device tier: one
        store per worker per run of blocks without a branch, breadth first from the root;
        lower tiers: one store per block, under the parent it was stored with."""
        events: list[dict[str, Any]] = []
        event_id = 0
        queue = list(self.root.children.values())
        while queue:
            nxt: list[_Node] = []
            for start in queue:
                run = _run(start)
                above = start.parent
                parent = above.block_hash if above is not None and above is not self.root else None
                for worker in start.workers:
                    blocks = [_block(n.block_hash, n.local) for n in run]
                    events.append(_stored(worker, DEVICE, event_id, parent, blocks))
                    event_id += 1
                nxt.extend(run[-1].children.values())
            queue = nxt
        for tier in LOWER_TIERS:
            event_id = 0
            for worker, held in self.lower[tier].items():
                for h, (parent, local) in held.blocks.items():
                    events.append(_stored(worker, tier, event_id, parent, [_block(h, local)]))
                    event_id += 1
        return {self.model_key: {"block_size": self.block_size, "events": events}}

    def blocks_per_worker(self) -> dict[tuple[IndexWorker, str], int]:
        """Blocks each worker holds on each tier (``/metrics``)."""
        out = {(w, DEVICE): len(lookup) for w, lookup in self.lookup.items()}
        for tier in LOWER_TIERS:
            out.update({(w, tier): len(held.blocks) for w, held in self.lower[tier].items()})
        return out

    @property
    def workers(self) -> list[IndexWorker]:
        seen = set(self.lookup) | set(self.sources)
        for tier in LOWER_TIERS:
            seen |= set(self.lower[tier])
        return sorted(seen, key=lambda w: (str(w[0]), w[1]))


def _worker_id(wid: Any) -> Any:
    """Dynamo's worker ids are integers: a label that reads as one is one."""
    if type(wid) is str and wid.isdigit():
        return int(wid)
    return wid


def _run(start: _Node) -> list[_Node]:
    """The blocks from ``start`` down to the first branch, or to a block another set of
    workers holds: one stored event per worker in ``/dump``, as Dynamo's compressed tree
    keeps a run without branches in one node."""
    run = [start]
    node = start
    while len(node.children) == 1:
        child = next(iter(node.children.values()))
        if child.workers.keys() != node.workers.keys():
            break
        run.append(child)
        node = child
    return run


def _block(block_hash: Any, local: int) -> dict[str, Any]:
    return {"block_hash": block_hash, "tokens_hash": local, "mm_extra_info": None}


def _stored(
    worker: IndexWorker, tier: str, event_id: int, parent: Any, blocks: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "worker_id": worker[0],
        "storage_tier": tier,
        "residency_domain": "worker",
        "event": {
            "event_id": event_id,
            "data": {"stored": {"parent_hash": parent, "start_position": None, "blocks": blocks}},
            "dp_rank": worker[1],
        },
    }
