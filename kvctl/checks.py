"""Stream rules for ``kvctl check``: each finding has a stable rule id, a severity, a count and
the first few examples (source, seq, ts, worker, hash).

Pure: feed decoded batches in arrival order, read findings. ``Checker.feed`` returns the new
findings of one batch (live mode prints them); ``Checker.finish`` returns the :class:`Report`.
Only the first ``max_examples`` findings of each rule are returned by ``feed`` and kept as
examples (``report_all=True`` returns every one): a broken stream repeats the same mistake
thousands of times a second, and the count says how often.

Design choices (also in the rule table, :data:`RULES`):

- Token count (KV201): each element of ``token_ids`` counts as one token, so SGLang EAGLE
  ``[a, b]`` bigram pairs count once per pair: a pair stands for one token position. Events
  without ``token_ids`` (Dynamo RouterEvents) or without ``block_size`` are not checked.
- Block size changes (KV203) are tracked per worker and ``group_idx``: hybrid models publish
  several KV groups whose sizes may legitimately differ.
- Missing parent links (KV105): a worker whose stores are almost all parentless single-block
  stores (after its first store) is very likely a custom engine that never passes
  ``parent_block_hash``: Dynamo then grafts every block at the root and reports false prefix
  hits. Fires once per worker when at least ``orphan_min`` (default 16) such stores make up at
  least ``orphan_ratio`` (default 0.8) of its stores. Parentless *multi*-block stores are
  normal (vLLM stores a whole new prompt at once) and do not count; SGLang's one-page stores
  are chained by parent and do not count either.
- Capacity (KV104) counts the times a worker's occupancy rises above ``num_blocks``, checked at
  the end of each batch (stores and the evictions that made room may come in either order).
- Wrong types (KV002, KV206 for a non-int hash): the decoders turn an event whose known fields
  carry a type no producer sends into a malformed message (KV001, the field named), so live
  streams and new recordings report KV001; these rules still catch such events in recordings
  of older kvctl versions and in batches fed directly.
- Router drift (KV501, KV502; ``router_view=True`` and :meth:`Checker.compare_router`): the
  engines' truth is the cache model below (``StreamState``), device tier only; the router's
  belief is a ``/dump`` (Dynamo's standalone indexer or ``kvctl index``). Blocks are compared
  per (worker_id, dp_rank) by their place in the prefix tree: the chain of Dynamo
  ``tokens_hash`` values from the first block to them, computed from the stream's token ids
  as a router computes them (the dump carries them). Engine block hashes would mislead: where
  two workers store the same tokens under different hashes, the router keeps the first
  storer's hash for both. Only blocks a prefix match can reach are compared, on either side
  (every block above them held by that worker): a block below a gap gives no cache hit, in
  the engine or the router, and each side drops such blocks by its own rules (Dynamo ends
  a worker's whole edge at a removal). A stored block without token ids (or block size) to
  hash cannot be indexed by any router: it is reported missing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .events import (
    ALL_BLOCKS_CLEARED,
    BLOCK_REMOVED,
    BLOCK_STORED,
    U64_MASK,
    Batch,
    present_hash,
)
from .sequence import DUPLICATE, GAP, RECOVERED, REORDER, RESTART, SequenceTracker
from .state import (
    DEVICE,
    DUPLICATE_STORE,
    INVALID_EVENT,
    PARENT_UNKNOWN,
    REMOVE_UNKNOWN,
    UNKNOWN_TYPE,
    StreamState,
    WorkerKey,
    batch_time,
    dynamo_worker_id,
    event_local_hashes,
    norm_hash,
    tier_of_medium,
    worker_label,
)

ERROR, WARNING, INFO = "error", "warning", "info"


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    name: str
    severity: str
    summary: str


RULES: dict[str, Rule] = {
    r.id: r
    for r in (
        Rule("KV001", "malformed-batch", ERROR, "a message could not be decoded (batch.error set)"),
        Rule(
            "KV002",
            "invalid-event",
            ERROR,
            "an event is not a map, or its block_hashes / token_ids are not arrays",
        ),
        Rule(
            "KV003",
            "unknown-event-type",
            INFO,
            "event type other than BlockStored, BlockRemoved, AllBlocksCleared",
        ),
        Rule("KV004", "unknown-field", INFO, "an event carries a field no known producer sends"),
        Rule(
            "KV101",
            "remove-unknown-block",
            ERROR,
            "BlockRemoved of a hash not cached on that worker",
        ),
        Rule(
            "KV102",
            "store-parent-unknown",
            ERROR,
            "BlockStored whose parent_block_hash is not cached on that worker (Dynamo rejects it)",
        ),
        Rule(
            "KV103",
            "duplicate-store",
            WARNING,
            "BlockStored of a hash already cached on that worker",
        ),
        Rule(
            "KV104",
            "capacity-exceeded",
            ERROR,
            "a worker holds more blocks than --num-blocks (evictions not published)",
        ),
        Rule(
            "KV105",
            "missing-parent-links",
            WARNING,
            "most stores of a worker are parentless single-block stores (parent never sent?)",
        ),
        Rule(
            "KV201",
            "token-count-mismatch",
            ERROR,
            "len(token_ids) != block_size x len(block_hashes)",
        ),
        Rule("KV202", "block-size-unexpected", ERROR, "block_size differs from --block-size"),
        Rule(
            "KV203", "block-size-changed", WARNING, "block_size changes within a worker (and group)"
        ),
        Rule(
            "KV204",
            "hash-sign-mixed",
            WARNING,
            "one worker sends negative (i64) and >= 2^63 (u64) hashes: two encoders in play",
        ),
        Rule(
            "KV205",
            "hash-bytes",
            WARNING,
            "hash sent as bytes (e.g. 32-byte SHA-256): u64 consumers such as Dynamo cannot use it",
        ),
        Rule(
            "KV206",
            "hash-invalid",
            ERROR,
            "hash is not an int or bytes, or an int that does not fit 64 bits",
        ),
        Rule("KV301", "seq-gap", ERROR, "a publisher's seq skipped batches (events lost)"),
        Rule("KV302", "seq-duplicate", WARNING, "a publisher's seq repeated"),
        Rule(
            "KV303", "seq-reorder", WARNING, "a batch arrived after a later one (filled a gap late)"
        ),
        Rule(
            "KV304",
            "seq-reset",
            WARNING,
            "a publisher's seq restarted at 0 (engine restart: the router's view is stale)",
        ),
        Rule("KV305", "ts-backwards", WARNING, "a publisher's batch timestamp went backwards"),
        Rule(
            "KV306",
            "worker-silent",
            ERROR,
            "an expected worker or source published nothing (--expect-workers, idle timeout)",
        ),
        Rule(
            "KV501",
            "router-stale-block",
            ERROR,
            "the router's index (--against) holds a block the engine evicted or never stored",
        ),
        Rule(
            "KV502",
            "router-missing-block",
            WARNING,
            "the engine holds a block the router's index (--against) never learned",
        ),
    )
}

_EVENT_TYPES = (BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED)
_I64_MIN, _I63, _U64_LIMIT = -(1 << 63), 1 << 63, 1 << 64


def rules_markdown() -> str:
    """The rule table as Markdown, for the README (kept equal by tests/test_contract.py);
    ``check --help`` lists the same ``RULES`` as plain lines."""
    lines = ["| id | name | severity | triggered by |", "|---|---|---|---|"]
    lines += [f"| {r.id} | {r.name} | {r.severity} | {r.summary} |" for r in RULES.values()]
    return "\n".join(lines)


@dataclass(slots=True)
class Finding:
    rule: str
    name: str
    severity: str
    message: str
    source: str
    seq: int | None
    ts: float | None
    worker: str | None = None
    hash: Any = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "name": self.name,
            "severity": self.severity,
            "message": self.message,
            "source": self.source,
            "seq": self.seq,
            "ts": self.ts,
            "worker": self.worker,
            "hash": None if self.hash is None else _json_hash(self.hash),
        }


def _json_hash(h: Any) -> Any:
    v = present_hash(h)
    return v if isinstance(v, (int, str)) else repr(v)


@dataclass(slots=True)
class RuleResult:
    rule: Rule
    count: int = 0
    examples: list[Finding] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {
            "id": self.rule.id,
            "name": self.rule.name,
            "severity": self.rule.severity,
            "summary": self.rule.summary,
            "count": self.count,
            "examples": [f.to_json() for f in self.examples],
        }
        if self.details:
            out["details"] = self.details
        return out


@dataclass(slots=True)
class Report:
    results: list[RuleResult]
    """Rules that fired, by id."""
    batches: int
    events: int
    workers: list[str]
    sources: list[str]
    against: dict[str, Any] | None = None
    """What the router's index was compared with, when it was (see ``compare_router``)."""

    def count(self, severity: str) -> int:
        return sum(r.count for r in self.results if r.rule.severity == severity)

    @property
    def has_errors(self) -> bool:
        return any(r.count and r.rule.severity == ERROR for r in self.results)

    @property
    def rule_ids(self) -> set[str]:
        return {r.rule.id for r in self.results if r.count}

    def get(self, rule_id: str) -> RuleResult | None:
        return next((r for r in self.results if r.rule.id == rule_id), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.has_errors,
            "errors": self.count(ERROR),
            "warnings": self.count(WARNING),
            "infos": self.count(INFO),
            "batches": self.batches,
            "events": self.events,
            "workers": self.workers,
            "sources": self.sources,
            "rules": [r.to_json() for r in self.results],
            **({"against": self.against} if self.against is not None else {}),
        }


class _WorkerCheck:
    """Per-worker checker state that StreamState does not keep."""

    __slots__ = ("sizes", "stores", "orphans", "orphan_flagged", "over", "neg", "high")

    def __init__(self) -> None:
        self.sizes: dict[Any, Any] = {}  # group_idx -> last block_size
        self.stores = 0
        self.orphans = 0
        self.orphan_flagged = False
        self.over = False
        self.neg: Any = None  # first negative hash seen
        self.high: Any = None  # first hash >= 2^63 seen


def idle_workers(last_seen_ns: dict[Any, int], now_ns: int, timeout_s: float) -> list[Any]:
    """Workers (or sources) whose last batch is older than ``timeout_s`` at ``now_ns``."""
    limit = now_ns - int(timeout_s * 1e9)
    return [k for k, seen in last_seen_ns.items() if seen < limit]


class Checker:
    """Feed batches in arrival order; see the module doc and :data:`RULES`."""

    def __init__(
        self,
        block_size: int | None = None,
        num_blocks: int | None = None,
        expect_workers: int | None = None,
        max_examples: int = 5,
        report_all: bool = False,
        orphan_min: int = 16,
        orphan_ratio: float = 0.8,
        router_view: bool = False,
    ) -> None:
        # imported by the checker, not the module: `kvctl check --help` lists the rules without
        # importing the codecs
        from .formats import KNOWN_FIELDS

        self.known_fields = KNOWN_FIELDS
        """Every field a codec's producers send: KV004 flags the rest."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.expect_workers = expect_workers
        self.max_examples = max_examples
        self.report_all = report_all
        self.orphan_min = orphan_min
        self.orphan_ratio = orphan_ratio
        self.state = StreamState()
        self.seq = SequenceTracker()
        self.results: dict[str, RuleResult] = {}
        self.batches = 0
        self.events = 0
        self.last_seen_ns: dict[str, int] = {}
        """Source -> receive time of its last batch (for live idle detection)."""
        self._wc: dict[WorkerKey, _WorkerCheck] = {}
        self._silent_reported: set[str] = set()
        self._new: list[Finding] = []
        self._locals: dict[WorkerKey, dict[Hashable, int | None]] | None = (
            {} if router_view else None
        )
        """``router_view``: per worker, the Dynamo ``tokens_hash`` of each device-tier block
        (None: no token ids to hash), for :meth:`compare_router`."""
        self.against: dict[str, Any] | None = None

    # --- reporting -------------------------------------------------------------------------

    def _emit(
        self,
        rule_id: str,
        batch: Batch | None,
        message: str,
        worker: WorkerKey | None = None,
        h: Any = None,
        source: str = "",
    ) -> RuleResult:
        res = self.results.get(rule_id)
        if res is None:
            res = self.results[rule_id] = RuleResult(RULES[rule_id])
        res.count += 1
        keep = res.count <= self.max_examples
        if keep or self.report_all:
            rule = res.rule
            f = Finding(
                rule.id,
                rule.name,
                rule.severity,
                message,
                batch.source if batch is not None else source,
                batch.seq if batch is not None else None,
                batch.ts if batch is not None else None,
                worker_label(worker) if worker is not None else None,
                h,
            )
            if keep:
                res.examples.append(f)
            self._new.append(f)
        return res

    # --- feeding ---------------------------------------------------------------------------

    def feed(self, batch: Batch) -> list[Finding]:
        """Check one batch; returns the findings it produced (see module doc for limits)."""
        self._new = []
        self.batches += 1
        if batch.recv_ns:
            self.last_seen_ns[batch.source] = batch.recv_ns
        else:
            self.last_seen_ns.setdefault(batch.source, 0)
        if batch.error is not None:
            self._emit("KV001", batch, f"malformed batch: {batch.error}")
        self._check_seq(batch)  # a malformed seq counts as everywhere (see kvctl.sequence)
        state = self.state
        bkey = state.batch_key(batch)
        t = batch_time(batch)
        # Capacity is checked at the end of the batch: an engine may publish a store and the
        # evictions that made room for it in either order within one batch.
        touched: set[WorkerKey] | None = set() if self.num_blocks is not None else None
        known_fields = self.known_fields
        for ev in batch.events:
            self.events += 1
            if type(ev) is not dict:
                self._emit("KV002", batch, "event is not a map", bkey)
                continue
            key = state.event_key(ev, bkey)
            etype = ev.get("type")
            if etype not in _EVENT_TYPES:
                self._emit("KV003", batch, f"unknown event type {str(etype)[:60]!r}", key)
                continue
            if not ev.keys() <= known_fields:
                extra = sorted(str(k) for k in ev.keys() - known_fields)
                res = self._emit("KV004", batch, f"{etype} has unknown fields {extra}", key)
                fields = res.details.setdefault("fields", {})
                for name in extra[:20]:
                    if name in fields or len(fields) < 100:
                        fields[name] = fields.get(name, 0) + 1
            if etype == BLOCK_STORED:
                self._check_store(batch, ev, key)
            elif etype == BLOCK_REMOVED:
                self._check_hashes(batch, ev.get("block_hashes"), key)
            found = state.apply_event(ev, key, t)
            if self._locals is not None:
                self._track_locals(ev, etype, key)
            if found:
                for a in found:
                    self._anomaly(batch, a.kind, key, a.hash, a.detail, ev)
            if touched is not None:
                touched.add(key)
        if touched:
            for key in touched:
                self._check_capacity(batch, key)
        return self._new

    def _wcheck(self, key: WorkerKey) -> _WorkerCheck:
        wc = self._wc.get(key)
        if wc is None:
            wc = self._wc[key] = _WorkerCheck()
        return wc

    def _anomaly(
        self, batch: Batch, kind: str, key: WorkerKey, h: Any, detail: str, ev: dict
    ) -> None:
        if kind == REMOVE_UNKNOWN:
            self._emit(
                "KV101", batch, "removal of a block never stored (or already removed)", key, h
            )
        elif kind == PARENT_UNKNOWN:
            self._emit(
                "KV102",
                batch,
                f"store of {len(ev.get('block_hashes') or ())} block(s)"
                " whose parent is not cached on this worker",
                key,
                h,
            )
        elif kind == DUPLICATE_STORE:
            self._emit("KV103", batch, "store of a hash already cached on this worker", key, h)
        elif kind == INVALID_EVENT:
            self._emit("KV002", batch, detail, key)
        elif kind == UNKNOWN_TYPE:  # pragma: no cover - filtered before apply_event
            self._emit("KV003", batch, detail, key)

    def _check_store(self, batch: Batch, ev: dict, key: WorkerKey) -> None:
        hashes = ev.get("block_hashes")
        self._check_hashes(batch, hashes, key)
        parent = ev.get("parent_block_hash")
        if parent is not None:
            self._check_hashes(batch, (parent,), key)
        if type(hashes) is not list:
            return  # reported as KV002 by the state model
        wc = self._wcheck(key)
        size = ev.get("block_size")
        if size is not None:
            if self.block_size is not None and size != self.block_size:
                self._emit(
                    "KV202",
                    batch,
                    f"block_size {size!r}, expected {self.block_size}",
                    key,
                    hashes[0] if hashes else None,
                )
            group = ev.get("group_idx")
            try:
                prev = wc.sizes.get(group)
            except TypeError:  # unhashable group_idx from a broken producer
                group = repr(group)
                prev = wc.sizes.get(group)
            if prev is None:
                wc.sizes[group] = size
            elif prev != size:
                wc.sizes[group] = size
                self._emit(
                    "KV203",
                    batch,
                    f"block_size changed from {prev!r} to {size!r}",
                    key,
                    hashes[0] if hashes else None,
                )
        tokens = ev.get("token_ids")
        if tokens is not None:
            if type(tokens) is not list:
                self._emit("KV002", batch, "token_ids is not an array", key)
            elif type(size) is int and len(tokens) != size * len(hashes):
                self._emit(
                    "KV201",
                    batch,
                    f"{len(tokens)} tokens for {len(hashes)} block(s) of {size}",
                    key,
                    hashes[0] if hashes else None,
                )
        # Missing-parent-link heuristic (see module doc); the first store may start a chain.
        wc.stores += 1
        if wc.stores > 1 and parent is None and len(hashes) == 1 and not wc.orphan_flagged:
            wc.orphans += 1
            if wc.orphans >= self.orphan_min and wc.orphans >= self.orphan_ratio * (wc.stores - 1):
                wc.orphan_flagged = True
                self._emit(
                    "KV105",
                    batch,
                    f"{wc.orphans} of {wc.stores} stores are parentless"
                    " single-block stores: is parent_block_hash ever sent?",
                    key,
                    hashes[0],
                )

    def _check_hashes(self, batch: Batch, hashes: Any, key: WorkerKey) -> None:
        if type(hashes) is not list and type(hashes) is not tuple:
            return
        wc = None
        for h in hashes:
            if type(h) is int:
                if 0 <= h < _I63:
                    continue  # the common case: same bits whether read signed or unsigned
                if _I64_MIN <= h < 0:
                    wc = wc or self._wcheck(key)
                    if wc.neg is None:
                        wc.neg = h
                        if wc.high is not None:
                            self._emit(
                                "KV204",
                                batch,
                                "negative hash after u64 hashes >= 2^63 on this worker",
                                key,
                                h,
                            )
                elif _I63 <= h < _U64_LIMIT:
                    wc = wc or self._wcheck(key)
                    if wc.high is None:
                        wc.high = h
                        if wc.neg is not None:
                            self._emit(
                                "KV204",
                                batch,
                                "hash >= 2^63 after negative i64 hashes on this worker",
                                key,
                                h,
                            )
                else:
                    self._emit(
                        "KV206", batch, f"hash does not fit 64 bits ({h.bit_length()} bits)", key, h
                    )
            elif isinstance(h, (bytes, bytearray, memoryview)):
                self._emit("KV205", batch, f"{len(h)}-byte hash", key, bytes(h))
            else:
                self._emit("KV206", batch, f"hash is a {type(h).__name__}", key, repr(h)[:80])

    def _check_capacity(self, batch: Batch, key: WorkerKey) -> None:
        cache = self.state.workers.get(key)
        if cache is None:
            return
        wc = self._wcheck(key)
        n = len(cache.blocks)
        if n > self.num_blocks:  # type: ignore[operator]
            if not wc.over:
                wc.over = True
                self._emit("KV104", batch, f"{n} blocks cached, capacity {self.num_blocks}", key)
        elif wc.over:  # back under capacity: a later rise is a new finding
            wc.over = False

    def _check_seq(self, batch: Batch) -> None:
        tracker = self.seq
        irregularity = tracker.observe(batch)
        if irregularity is not None:
            kind, expected, got = irregularity.kind, irregularity.expected, irregularity.got
            if kind == GAP:
                missing = irregularity.missing
                res = self._emit(
                    "KV301", batch, f"seq {got}, expected {expected}: {missing} batch(es) missing"
                )
                res.details["missing_batches"] = res.details.get("missing_batches", 0) + missing
            elif kind == DUPLICATE:
                self._emit("KV302", batch, f"seq {got} repeated (expected {expected})")
            elif kind == REORDER:
                self._emit("KV303", batch, f"seq {got} arrived late (after {expected - 1})")
            elif kind == RESTART:
                self._emit("KV304", batch, f"seq restarted at 0 after {expected - 1}")
            elif kind == RECOVERED:
                gaps = self.results.get("KV301")
                if gaps is not None:
                    gaps.details["recovered_batches"] = gaps.details.get("recovered_batches", 0) + 1
        if tracker.time_went_backwards(batch, irregularity):
            self._emit("KV305", batch, "batch timestamp earlier than the previous one")

    # --- the router's index ---------------------------------------------------------------

    def _track_locals(self, ev: dict, etype: Any, key: WorkerKey) -> None:
        """Keep the ``tokens_hash`` of each device-tier block beside the cache model, as
        ``StreamState`` keeps or drops the block."""
        held_by = self._locals
        assert held_by is not None
        if etype == ALL_BLOCKS_CLEARED:  # every dp rank of the worker, as StreamState clears
            for k in [k for k in held_by if k[0] == key[0]]:
                del held_by[k]
            return
        hashes = ev.get("block_hashes")
        if type(hashes) is not list:
            return
        held = held_by.get(key)
        if held is None:
            held = held_by[key] = {}
        tier = ev.get("storage_tier") or tier_of_medium(ev.get("medium"))
        if etype == BLOCK_REMOVED or tier != DEVICE:
            for raw in hashes:
                held.pop(norm_hash(raw), None)
            return
        size = ev.get("block_size")
        if type(size) is not int or size < 1:
            size = self.block_size  # a router hashes in its own block size
        given = type(ev.get("tokens_hashes")) is list
        hashed = event_local_hashes(ev, len(hashes), size or 1) if size or given else []
        for i, raw in enumerate(hashes):
            held[norm_hash(raw)] = hashed[i] if i < len(hashed) else None

    def compare_router(
        self, router: dict[WorkerKey, dict[Any, Hashable]], where: str
    ) -> list[Finding]:
        """KV501/KV502: the router's index (``dump_prefixes`` of the ``/dump`` fetched from or
        read at ``where``) against the cache model now, per worker (see the module doc). Call
        it once, after the last batch."""
        assert self._locals is not None, "Checker(router_view=True) keeps what this needs"
        self._new = []
        engine: dict[WorkerKey, dict[Any, Hashable]] = {}
        unhashed: set[tuple[WorkerKey, Hashable]] = set()
        for key, cache in self.state.workers.items():
            held = self._locals.get(key, {})
            worker = (dynamo_worker_id(key[0]), key[1])
            parents = {h: entry[0] for h, entry in cache.blocks.items() if h in held}
            engine.setdefault(worker, {}).update(prefix_keys(parents, held))
            unhashed.update((worker, h) for h in parents if held[h] is None)
        for worker in sorted(set(router) | set(engine), key=lambda w: (str(w[0]), w[1])):
            theirs, ours = router.get(worker, {}), engine.get(worker, {})
            label = worker_label(worker)
            for place, h in theirs.items():
                if place not in ours:
                    res = self._emit(
                        "KV501",
                        None,
                        "the router's index holds this block; the engine evicted it"
                        " (or never stored it in this stream)",
                        worker,
                        h,
                        where,
                    )
                    _count_worker(res, label)
            for place, h in ours.items():
                if place not in theirs:
                    why = (
                        " (no token ids to hash: a router cannot index it)"
                        if (worker, h) in unhashed
                        else ""
                    )
                    res = self._emit(
                        "KV502",
                        None,
                        f"the engine holds this block; the router's index does not{why}",
                        worker,
                        h,
                        where,
                    )
                    _count_worker(res, label)
        self.against = {
            "index": where,
            "workers": len(set(router) | set(engine)),
            "router_blocks": sum(len(v) for v in router.values()),
            "engine_blocks": sum(len(v) for v in engine.values()),
        }
        return self._new

    # --- silence ---------------------------------------------------------------------------

    @property
    def seen_workers(self) -> list[str]:
        """Workers that published at least one event, as labels."""
        return sorted(worker_label(k) for k in self.state.workers)

    def check_silent(self, sources: Iterable[str] = ()) -> list[Finding]:
        """KV306 for each of ``sources`` that delivered no batch, and once when fewer than
        ``expect_workers`` workers were seen. Idempotent: a silent source is reported once.
        The live command calls it when ``--idle-timeout`` has passed; ``finish`` calls it too."""
        self._new = []
        for src in sources:
            if src not in self.last_seen_ns and src not in self._silent_reported:
                self._silent_reported.add(src)
                self._emit("KV306", None, f"source {src} published nothing")
        seen = len(self.state.workers)
        if (
            self.expect_workers is not None
            and seen < self.expect_workers
            and "*expect" not in self._silent_reported
        ):
            self._silent_reported.add("*expect")
            res = self._emit(
                "KV306",
                None,
                f"{seen} of {self.expect_workers} expected workers"
                f" published events: {self.seen_workers}",
            )
            res.details["seen_workers"] = self.seen_workers
            res.details["expected_workers"] = self.expect_workers
        return self._new

    def finish(self, sources: Iterable[str] = ()) -> Report:
        """The final report; ``sources`` are all sources the command read (silent ones are
        flagged)."""
        self.check_silent(sources)
        results = [self.results[k] for k in sorted(self.results)]
        return Report(
            results,
            self.batches,
            self.events,
            self.seen_workers,
            sorted(self.last_seen_ns),
            self.against,
        )


def _count_worker(res: RuleResult, label: str) -> None:
    workers = res.details.setdefault("workers", {})
    workers[label] = workers.get(label, 0) + 1


_ROOT_PLACE = 0


def prefix_keys(
    parents: dict[Hashable, Hashable | None], local: dict[Hashable, int | None]
) -> dict[Any, Hashable]:
    """One worker's blocks (``parents``: block -> parent block, None at the first block) by
    their place in the prefix tree, a key for the chain of ``tokens_hash`` values from the first
    block to them -> the block. Blocks a prefix match cannot reach (an ancestor missing, a
    parent cycle) are left out; a block without a ``tokens_hash`` gets a place of its own,
    which no other block shares."""
    places: dict[Hashable, Any] = {}  # block -> its place, None when unreachable
    for block in parents:
        path: list[Hashable] = []
        seen: set[Hashable] = set()
        cur: Hashable | None = block
        base: Any = _ROOT_PLACE
        while cur is not None:  # bounded: each block is visited once (``seen``)
            if cur in places:
                base = places[cur]
                break
            if cur not in parents or cur in seen:
                base = None
                break
            seen.add(cur)
            path.append(cur)
            cur = parents[cur]
        for node in reversed(path):
            tokens = local.get(node)
            if base is not None:
                base = hash((base, tokens)) if tokens is not None else ("unhashed", node)
            places[node] = base
    return {place: block for block, place in places.items() if place is not None}


def dump_prefixes(dump: Any) -> dict[WorkerKey, dict[Any, Hashable]]:
    """The device-tier blocks a ``/dump`` (Dynamo's indexer's or ``kvctl index``'s: RouterEvents
    per model) says each (worker_id, dp_rank) holds, keyed by place as :func:`prefix_keys`;
    every model of the dump. ValueError names what is not a ``/dump``."""
    from .formats.dynamo import router_event_to_event

    if not isinstance(dump, dict):
        raise ValueError("a /dump is a JSON object of models, {key: {block_size, events}}")
    parents: dict[WorkerKey, dict[Hashable, Hashable | None]] = {}
    local: dict[WorkerKey, dict[Hashable, int | None]] = {}
    for model, body in dump.items():
        events = body.get("events") if isinstance(body, dict) else None
        if not isinstance(events, list):
            raise ValueError(f"model {str(model)[:60]!r} has no events array")
        for i, obj in enumerate(events):
            try:
                ev = router_event_to_event(obj)
            except ValueError as exc:  # a DecodeError
                raise ValueError(f"model {str(model)[:60]!r}, event {i}: {exc}") from None
            if (ev.get("storage_tier") or DEVICE) != DEVICE:
                continue
            dp = ev.get("dp_rank")
            worker = (dynamo_worker_id(ev.get("worker_id")), dp if type(dp) is int else 0)
            try:
                hash(worker)
            except TypeError:
                raise ValueError(f"model {str(model)[:60]!r}, event {i}: bad worker_id") from None
            held, tokens = parents.setdefault(worker, {}), local.setdefault(worker, {})
            etype, hashes = ev["type"], ev.get("block_hashes") or []
            if etype == ALL_BLOCKS_CLEARED:
                held.clear()
                tokens.clear()
            elif etype == BLOCK_REMOVED:
                for raw in hashes:
                    held.pop(norm_hash(raw), None)
            else:
                parent = ev.get("parent_block_hash")
                above = None if parent is None else norm_hash(parent)
                for raw, th in zip(hashes, ev.get("tokens_hashes") or [], strict=False):
                    h = norm_hash(raw)
                    held[h] = above
                    tokens[h] = th & U64_MASK if type(th) is int else None
                    above = h
    return {w: prefix_keys(held, local[w]) for w, held in parents.items()}


# --- merging the reports of a sharded check (kvctl check --partition I/N ... --merge) --------

_REPORT_KEYS = ("rules", "batches", "events", "workers", "sources", "fail_on")


class NotACheckReport(ValueError):
    """What ``check --merge`` was given is not the JSON report of ``kvctl check --json``."""


def validate_report(document: Any) -> dict[str, Any]:
    """``document`` if it is a ``check --json`` report, else :class:`NotACheckReport`."""
    if not isinstance(document, dict):
        raise NotACheckReport("not a JSON object")
    missing = [k for k in _REPORT_KEYS if k not in document]
    if missing:
        raise NotACheckReport(f"no {', '.join(missing)} (not a `kvctl check --json` report)")
    if not isinstance(document["rules"], list) or not all(
        isinstance(r, dict) and isinstance(r.get("id"), str) and type(r.get("count")) is int
        for r in document["rules"]
    ):
        raise NotACheckReport("its rules are not a list of {id, count, ...}")
    for key in ("batches", "events"):
        if type(document[key]) is not int:
            raise NotACheckReport(f"{key} is not an integer")
    for key in ("workers", "sources"):
        if not isinstance(document[key], list):
            raise NotACheckReport(f"{key} is not a list")
    return document


def _merge_values(a: Any, b: Any) -> Any:
    """Counts add up, maps merge key by key, lists concatenate; anything else is kept when
    equal, else the distinct values are listed."""
    if type(a) is int and type(b) is int or type(a) is float and type(b) is float:
        return a + b
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _merge_values(out[k], v) if k in out else v
        return out
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    return a if a == b else [a, b]


def _partition_order(report: dict[str, Any]) -> tuple[int, int]:
    part = report.get("partition")
    if isinstance(part, dict) and type(part.get("index")) is int:
        return (0, part["index"])
    return (1, 0)


def merge_reports(reports: list[dict[str, Any]], max_examples: int) -> dict[str, Any]:
    """The report one check of the whole would give, from the reports of checks of disjoint
    sets of workers (the partitions of a dataset or a stream): counts summed, workers and
    sources united (sorted, as a check lists them), each rule's examples concatenated in
    partition order (the order the reports were given without one) and cut at
    ``max_examples``, rules by id. Exact when every check read all its workers' messages
    and, for the examples, when no rule fired more than ``max_examples`` times in a shard;
    ``--expect-workers`` is judged per shard (KV306)."""
    ordered = sorted(reports, key=_partition_order)
    rules: dict[str, dict[str, Any]] = {}
    for report in ordered:
        for rule in report["rules"]:
            seen = rules.get(rule["id"])
            if seen is None:
                rules[rule["id"]] = {**rule, "examples": list(rule.get("examples") or [])}
                continue
            seen["count"] += rule["count"]
            seen["examples"] = seen["examples"] + list(rule.get("examples") or [])
            if "details" in rule:
                seen["details"] = _merge_values(seen.get("details", {}), rule["details"])
    for rule in rules.values():
        rule["examples"] = rule["examples"][:max_examples]
    merged_rules = [rules[k] for k in sorted(rules)]
    totals = {
        severity: sum(r["count"] for r in merged_rules if r.get("severity") == severity)
        for severity in (ERROR, WARNING, INFO)
    }
    merged: dict[str, Any] = {
        "ok": totals[ERROR] == 0,
        "errors": totals[ERROR],
        "warnings": totals[WARNING],
        "infos": totals[INFO],
        "batches": sum(r["batches"] for r in ordered),
        "events": sum(r["events"] for r in ordered),
        "workers": sorted({w for r in ordered for w in r["workers"]}),
        "sources": sorted({s for r in ordered for s in r["sources"]}),
        "rules": merged_rules,
    }
    against = [r["against"] for r in ordered if isinstance(r.get("against"), dict)]
    if against:
        value = against[0]
        for other in against[1:]:
            value = _merge_values(value, other)
        merged["against"] = value
    return merged
