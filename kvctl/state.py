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

import struct
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
# - the device tier is Dynamo's compressed tree: edges of blocks, each worker covering a whole
#   edge or its first k blocks. A removal ends the worker's coverage of that edge before the
#   block (the rest of the edge goes with it); the worker's blocks on edges below stay, out
#   of reach of queries until the block is stored again (StreamState drops the listed block
#   only). An edge that no worker covers whole any more loses its children, for every
#   worker. So what a removal inside a chain drops depends on where earlier stores split the
#   tree, exactly as in Dynamo (its query walk also compares worker counts before worker
#   sets at an edge without partial workers: kept here, it is what Dynamo answers);
# - ``AllBlocksCleared`` clears one (worker_id, dp_rank), every tier (StreamState: every dp
#   rank of the worker_id);
# - a store whose parent the worker does not hold (or holds under another engine hash than
#   the one the tree keeps for those tokens) is rejected whole on the device tier, as
#   ``StreamState(strict_parents=True)`` does; lower tiers take it;
# - a store whose ``block_size`` differs from the index's is dropped whole, and one whose
#   ``token_ids`` run short ends at the first incomplete block;
# - tiers are separate indexes: ``medium`` GPU (or none) is the device tier, CPU* the host
#   tier, DISK/STORAGE disk, EXTERNAL external; any other medium is not indexed. A query's
#   match continues on the host, then disk, then external tier from the engine hash where it
#   ended on the tier before.

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

SWEEP_FLOOR = 65_536
"""Blocks no worker holds that Dynamo lets pile up before it unlinks them."""

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
    prompt (a partial last block is not hashed), LoRA-seeded when ``lora_name`` is set: the
    rule of ``formats.dynamo.tokens_hash``, with the tokens packed once for the whole prompt
    (a 32k-token prompt is hashed in well under a millisecond)."""
    import xxhash

    from .formats.dynamo import TOKENS_HASH_SEED

    full = len(token_ids) - len(token_ids) % block_size
    if not full:
        return []
    seed = TOKENS_HASH_SEED
    if lora_name:
        seed = (seed + xxhash.xxh3_64_intdigest(lora_name.encode(), seed=0)) & U64_MASK
    try:
        data = memoryview(struct.pack(f"<{full}I", *token_ids[:full]))
    except struct.error:
        raise ValueError("token ids must be integers from 0 to 2**32 - 1") from None
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    return [digest(data[i : i + step], seed) for i in range(0, 4 * full, step)]


def event_local_hashes(ev: Event, count: int, block_size: int) -> list[int]:
    """The ``tokens_hash`` of the first ``count`` blocks a store names, as a router with blocks
    of ``block_size`` tokens computes them: as a Dynamo event carries them, else of the
    engine's ``token_ids``, block by block, ending at the first block without its full tokens.
    Empty when the event's own ``block_size`` is another (Dynamo does not index it)."""
    given = ev.get("tokens_hashes")
    if type(given) is list:
        return [h & U64_MASK if type(h) is int else 0 for h in given[:count]]
    size = ev.get("block_size")
    if size is not None and size != block_size:
        return []
    tokens = ev.get("token_ids")
    if type(tokens) is not list:
        return []
    usable = min(count, len(tokens) // block_size)
    lora = ev.get("lora_name")
    try:
        return dynamo_block_hashes(
            tokens[: usable * block_size], block_size, lora if type(lora) is str else None
        )
    except ValueError:  # a token id no u32 holds: Dynamo cannot decode the event either
        return []


class _Node:
    """A node of the device tier's compressed prefix tree, as Dynamo 1.6 keeps it: an edge of
    blocks (``tokens_hash`` and the engine hash of the worker that first stored it), the
    workers covering the whole edge (``full``) or only its first ``k`` blocks (``cut``),
    children by the ``tokens_hash`` of their first block. ``internal`` is sticky: a node that
    ever had children is never extended in place again."""

    __slots__ = ("local", "ext", "pos", "full", "cut", "children", "internal", "parent")

    def __init__(self, blocks: list[tuple[Any, int]], parent: _Node | None) -> None:
        self.local = [local for _, local in blocks]
        self.ext = [h for h, _ in blocks]
        self.pos = {h: i for i, h in enumerate(self.ext)}
        self.full: set[IndexWorker] = set()
        self.cut: dict[IndexWorker, int] = {}
        self.children: dict[int, _Node] = {}
        self.internal = False
        self.parent = parent

    def coverage(self, worker: IndexWorker) -> int:
        return len(self.local) if worker in self.full else self.cut.get(worker, 0)

    def cover(self, worker: IndexWorker, upto: int) -> None:
        """Extend ``worker``'s coverage to the first ``upto`` blocks (never shortens it)."""
        if upto >= len(self.local):
            self.full.add(worker)
            self.cut.pop(worker, None)
        elif upto > self.cut.get(worker, 0) and worker not in self.full:
            self.cut[worker] = upto

    def holders(self) -> dict[IndexWorker, int]:
        out = dict.fromkeys(self.full, len(self.local))
        out.update(self.cut)
        return out

    def append(self, worker: IndexWorker, blocks: list[tuple[Any, int]]) -> None:
        """Leaf extension by ``worker``: the other full workers now cover the old edge only."""
        old = len(self.local)
        for w in self.full:
            if w != worker:
                self.cut[w] = old
        self.full = {worker}
        for h, local in blocks:
            self.pos.setdefault(h, len(self.local))
            self.local.append(local)
            self.ext.append(h)

    def split(self, at: int) -> _Node:
        """Keep the first ``at`` blocks here; the rest becomes the only child (with the old
        children); returns that child."""
        tail = _Node(list(zip(self.ext[at:], self.local[at:], strict=True)), self)
        tail.children = self.children
        for child in tail.children.values():
            child.parent = tail
        tail.internal = self.internal
        tail.full = set(self.full)
        for w, k in self.cut.items():
            if k > at:
                tail.cut[w] = k - at
                self.full.add(w)
            elif k == at:
                self.full.add(w)
        self.cut = {w: k for w, k in self.cut.items() if k < at}
        del self.local[at:], self.ext[at:]
        self.pos = {h: i for i, h in enumerate(self.ext)}
        self.children = {tail.local[0]: tail}
        self.internal = True
        return tail


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
        self.root = _Node([], None)
        self.live_blocks = 0
        """Blocks on linked edges (about: the sweep recounts them)."""
        self.dead_blocks = 0
        """Blocks on edges no worker holds any more, since the last sweep."""
        self.lookup: dict[IndexWorker, dict[Any, _Node]] = {}
        self.lower: dict[str, dict[IndexWorker, _LowerTier]] = {t: {} for t in LOWER_TIERS}
        self.decisions: dict[tuple[str, str, str], int] = {}
        self.duplicate_stores = 0
        """Stores of a block the worker already held (applied; Dynamo warns)."""
        self.sources: dict[IndexWorker, str] = {}
        """The address each worker was heard from (``/workers``)."""

    @classmethod
    def from_dump(cls, dump: Any) -> RouterIndex:
        """The index a ``/dump`` describes (one model, as ``{key: {block_size, events}}``);
        ValueError (a DecodeError for a bad RouterEvent) names what is wrong."""
        from .formats.dynamo import router_event_to_event

        if not isinstance(dump, dict) or len(dump) != 1:
            raise ValueError("it holds one model, as {key: {block_size, events}}")
        key, body = next(iter(dump.items()))
        size = body.get("block_size") if isinstance(body, dict) else None
        if type(size) is not int or size < 1:
            raise ValueError(f"model {key!r} has no block_size")
        events = body.get("events")
        if not isinstance(events, list):
            raise ValueError(f"model {key!r} has no events array")
        model, _, group = str(key).rpartition(":")
        index = cls(size, model or str(key), group if model else "default")
        for i, obj in enumerate(events):
            try:
                event = router_event_to_event(obj)
            except ValueError as exc:
                raise ValueError(f"event {i}: {exc}") from None
            dp = event.get("dp_rank")
            worker = (dynamo_worker_id(event.get("worker_id")), dp if type(dp) is int else 0)
            index.sources.setdefault(worker, "snapshot")
            index.apply_event(event, worker)
        return index

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
            worker = (dynamo_worker_id(key[0]), key[1])
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
        if tier not in TIERS:  # counted under the medium that was sent
            self._count(name, str(ev.get("medium"))[:40], UNKNOWN_TIER)
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
            locals_ = event_local_hashes(ev, len(hashes), self.block_size)
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
        self.duplicate_stores += any(h in lookup for h, _ in blocks)
        if parent is None:
            node, at = self.root, 0
        else:
            found = lookup.get(parent)
            # the parent must sit where the worker's lookup says, under the engine hash the
            # edge keeps (a worker that stored the same tokens under other hashes misses)
            i = found.pos.get(parent) if found is not None else None
            if found is None or i is None or found.coverage(worker) <= i:
                return PARENT_NOT_FOUND
            node, at = found, i + 1
        i = 0
        while i < len(blocks):
            if at < len(node.local):  # inside an edge: reuse what matches, split where not
                j = at
                while i < len(blocks) and j < len(node.local) and node.local[j] == blocks[i][1]:
                    lookup[blocks[i][0]] = node
                    i += 1
                    j += 1
                if j < len(node.local) and i < len(blocks):
                    self._relink(node.split(j), node)
                node.cover(worker, j)
                at = j
                continue
            child = node.children.get(blocks[i][1])
            if child is not None:
                node, at = child, 0
            elif node is not self.root and not node.internal and worker in node.full:
                node.append(worker, blocks[i:])  # decode extension of the worker's own leaf
                self.live_blocks += len(blocks) - i
                for h, _ in blocks[i:]:
                    lookup[h] = node
                return OK
            else:
                child = node.children[blocks[i][1]] = _Node(blocks[i:], node)
                node.internal = True
                child.full.add(worker)
                self.live_blocks += len(blocks) - i
                for h, _ in blocks[i:]:
                    lookup[h] = child
                return OK
        return OK

    def _relink(self, tail: _Node, head: _Node) -> None:
        """After a split: lookups that named the head for a block now in the tail name the
        tail (Dynamo repairs them when it meets them; the outcome is the same)."""
        for w in tail.holders():
            lookup = self.lookup.get(w)
            if lookup is None:
                continue
            for h in tail.ext:
                if lookup.get(h) is head:
                    lookup[h] = tail

    def remove(self, worker: IndexWorker, hashes: list[Any], tier: str = DEVICE) -> str:
        """Remove blocks. Device tier, as Dynamo 1.6: the worker's coverage of the block's edge
        ends before it (the rest of that edge goes too; descendants on other edges stay,
        unreachable until the block is stored again); an edge no worker covers whole loses
        its children. Unknown hashes are skipped, the others still removed."""
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
            h = norm_hash(raw)
            node = lookup.pop(h, None)
            i = node.pos.get(h) if node is not None else None
            if node is None or i is None:
                status = BLOCK_NOT_FOUND
                continue
            covered = node.coverage(worker)
            if i >= covered:
                continue
            for gone in node.ext[i:covered]:
                if lookup.get(gone) is node:
                    del lookup[gone]
            node.full.discard(worker)
            if i:
                node.cut[worker] = i
            else:
                node.cut.pop(worker, None)
                if not node.full and not node.cut:
                    self.dead_blocks += len(node.local)
            if not node.full and node.children:
                node.children = {}
        self._maybe_sweep()
        return status

    def clear(self, worker: IndexWorker) -> None:
        """``AllBlocksCleared``: one worker and dp rank, every tier; an edge it leaves without
        a worker covering it whole loses its children, as on removal."""
        self.lookup.pop(worker, None)
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if worker in node.full or worker in node.cut:
                node.full.discard(worker)
                node.cut.pop(worker, None)
                if not node.full and not node.cut:
                    self.dead_blocks += len(node.local)
                if not node.full:  # nothing walks below an edge no worker covers whole
                    node.children = {}
        for tier in LOWER_TIERS:
            self.lower[tier].pop(worker, None)
        self._maybe_sweep()

    def _maybe_sweep(self) -> None:
        """Unlink leaves no worker holds once they are many: Dynamo's volume trigger (an
        eighth of the live blocks and at least 65,536), not its five-minute timer."""
        if self.dead_blocks < max(SWEEP_FLOOR, self.live_blocks // 8):
            return
        order: list[_Node] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        live = 0
        for node in reversed(order):  # deepest first: a parent sees its children gone
            parent = node.parent
            if not node.full and not node.cut and not node.children and parent is not None:
                if parent.children.get(node.local[0]) is node:
                    del parent.children[node.local[0]]
            else:
                live += len(node.local)
        self.live_blocks, self.dead_blocks = live, 0

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
        anchor: dict[IndexWorker, tuple[int, Any]] = {}  # blocks matched, last engine hash

        def score(w: IndexWorker, depth: int, last: Any) -> None:
            device[w] = depth
            anchor[w] = (depth, last)

        child = self.root.children.get(local_hashes[0]) if local_hashes else None
        active: set[IndexWorker] = set()
        depth = 0
        last: Any = None  # engine hash of the last block of the previous edge
        while child is not None:
            edge, ext = child.local, child.ext
            m = 1
            while m < min(len(edge), len(local_hashes) - depth):
                if edge[m] != local_hashes[depth + m]:
                    break
                m += 1
            if depth == 0:  # the first edge: its full workers walk on, the others score here
                active = set(child.full)
                for w, k in child.cut.items():
                    score(w, min(k, m), ext[min(k, m) - 1])
            elif child.cut:
                for w in list(active):
                    if w in child.full:
                        continue
                    active.discard(w)
                    k = min(child.cut.get(w, 0), m)
                    score(w, depth + k, ext[k - 1] if k else last)
            elif len(child.full) != len(active):
                # Dynamo compares counts before sets: a worker that lost a block above keeps
                # walking an edge that holds as many other workers (its own stale entries)
                for w in active - child.full:
                    active.discard(w)
                    score(w, depth, last)
            last = ext[m - 1]
            if not active:
                break
            depth += m
            if m < len(edge) or depth >= len(local_hashes):
                break
            child = child.children.get(local_hashes[depth])
        for w in active:
            score(w, depth, last)
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

    def _nodes(self) -> Iterator[_Node]:
        """Every node linked in the device tree, breadth first (parents before children)."""
        queue = list(self.root.children.values())
        while queue:
            yield from queue
            queue = [child for node in queue for child in node.children.values()]

    def dump(self) -> dict[str, Any]:
        """Dynamo's ``/dump`` JSON: the index as RouterEvents that rebuild it. Device tier: one
        store per edge of the tree per worker on it (the blocks it covers), breadth first from
        the root, under the last block of the edge above; lower tiers: one store per block,
        under the parent it was stored with."""
        events: list[dict[str, Any]] = []
        holders = ((node, w, k) for node in self._nodes() for w, k in node.holders().items())
        for event_id, (edge, worker, covered) in enumerate(holders):
            above = edge.parent
            parent = above.ext[-1] if above is not None and above is not self.root else None
            blocks = [_block(edge.ext[i], edge.local[i]) for i in range(covered)]
            events.append(_stored(worker, DEVICE, event_id, parent, blocks))
        for tier in LOWER_TIERS:
            event_id = 0
            for worker, held in self.lower[tier].items():
                for h, (parent, local) in held.blocks.items():
                    events.append(_stored(worker, tier, event_id, parent, [_block(h, local)]))
                    event_id += 1
        return {self.model_key: {"block_size": self.block_size, "events": events}}

    def blocks_per_worker(self) -> dict[tuple[IndexWorker, str], int]:
        """Blocks each worker holds on each tier (``/metrics``)."""
        out: dict[tuple[IndexWorker, str], int] = {}
        for node in self._nodes():
            for w, k in node.holders().items():
                out[(w, DEVICE)] = out.get((w, DEVICE), 0) + k
        for tier in LOWER_TIERS:
            out.update({(w, tier): len(held.blocks) for w, held in self.lower[tier].items()})
        return out

    @property
    def workers(self) -> list[IndexWorker]:
        seen = set(self.lookup) | set(self.sources)
        for tier in LOWER_TIERS:
            seen |= set(self.lower[tier])
        return sorted(seen, key=lambda w: (str(w[0]), w[1]))


def dynamo_worker_id(wid: Any) -> Any:
    """Dynamo's worker ids are integers: a label that reads as one is one."""
    if type(wid) is str and wid.isdigit():
        return int(wid)
    return wid


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
