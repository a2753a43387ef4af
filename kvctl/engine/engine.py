"""One synthetic engine (worker): requests, a vLLM-v1-like scheduler and a step-time model.

Scheduling, per :meth:`Worker.step`:

1. Running requests in order each get ``min(tokens still to compute, budget left)`` tokens
   (a prefill chunk, or 1 token when decoding) out of ``max_num_batched_tokens``. Blocks for
   those tokens are allocated first; when the pool cannot supply them even by evicting, the
   last running request is preempted (its blocks are released, it goes back to the front of
   the waiting queue and later recomputes prompt + output so far), as vLLM does.
2. If nothing was preempted, waiting requests are admitted in order while budget and
   ``max_num_seqs`` allow: the longest cached prefix is looked up (at most all but the last
   token, so at least one token is computed), hit blocks are referenced (no events), and blocks
   for the first chunk are allocated (no preemption for admissions).
3. The batch "runs": every block that became full is hashed and committed; newly cached ones
   are published as ``BlockStored`` (consecutive blocks of one request in one event, with the
   parent hash). Blocks evicted by this step's allocations come first, as one ``BlockRemoved``.
   A request whose computed tokens reach its known tokens emits one output token; it finishes
   after ``output_len`` tokens and releases its blocks (tail first).

Step time (seconds) = ``step_overhead_s + token_cost_s * tokens scheduled``; defaults 8 ms +
25 µs/token, roughly an 8B model on one H100-class GPU (a 2048-token prefill chunk ~59 ms,
a decode step of 32 requests ~9 ms).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from kvctl.events import BLOCK_REMOVED, BLOCK_STORED, Event

from .cache import BlockPool, extend_hashes

DEFAULT_STEP_OVERHEAD_S = 0.008
DEFAULT_TOKEN_COST_S = 25e-6


class Request:
    """One generation request. ``tokens`` is prompt + output (the output is fixed up front so
    the simulation is deterministic and a follow-up turn can extend it)."""

    __slots__ = (
        "rid",
        "tokens",
        "prompt_len",
        "output_len",
        "last",
        "arrival",
        "hashes",
        "known",
        "computed",
        "n_held",
        "n_blocks",
        "counted",
        "hit_tokens",
        "session",
        "finish_time",
    )

    def __init__(
        self,
        rid: int,
        tokens: list[int],
        prompt_len: int,
        arrival: float = 0.0,
        hashes: list[int] | None = None,
        session: Any = None,
    ) -> None:
        if not 0 < prompt_len < len(tokens):
            raise ValueError("need 1 <= prompt_len < len(tokens) (at least one output token)")
        self.rid = rid
        self.tokens = tokens
        self.prompt_len = prompt_len
        self.output_len = len(tokens) - prompt_len
        self.last = len(tokens) - 1  # tokens computed when it finishes (the last needs no KV)
        self.arrival = arrival
        self.hashes: list[int] = hashes if hashes is not None else []
        """Chained hashes of the full blocks of ``tokens``, computed lazily (a valid prefix)."""
        self.known = prompt_len  # tokens known so far: prompt + outputs generated
        self.computed = 0  # tokens whose KV is in the cache
        self.n_held = 0  # cached blocks held (== hashes[:n_held])
        self.n_blocks = 0  # blocks held: the n_held cached ones, then those not full yet
        self.counted = False  # prompt/hit tokens counted (first admission only)
        self.hit_tokens = 0
        self.session = session
        self.finish_time: float | None = None

    @property
    def generated(self) -> int:
        return self.known - self.prompt_len

    def max_blocks(self, block_size: int) -> int:
        """Blocks held at the busiest moment (all tokens but the last one have KV)."""
        return (len(self.tokens) - 1 + block_size - 1) // block_size


class Worker:
    """One engine: a :class:`BlockPool` plus a scheduler. :meth:`step` advances one step."""

    def __init__(
        self,
        num_blocks: int = 4096,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S,
        token_cost_s: float = DEFAULT_TOKEN_COST_S,
        medium: str = "GPU",
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.step_overhead_s = step_overhead_s
        self.token_cost_s = token_cost_s
        self.medium = medium
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._queued_tokens = 0
        """Tokens still to compute over running + waiting, kept up to date by every change of
        a request's ``known``/``computed`` (the KV router asks for it per worker per arrival)."""
        # counters
        self.steps = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.store_events = 0
        self.remove_events = 0
        self.preemptions = 0
        self.finished = 0
        self.rejected = 0
        self.tokens_computed = 0

    # -- queue -----------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def add(self, req: Request) -> bool:
        """Queue a request; False (and counted as rejected) if it can never fit in the pool."""
        if req.max_blocks(self.block_size) > self.pool.num_blocks:
            self.rejected += 1
            return False
        self.waiting.append(req)
        self._queued_tokens += req.known - req.computed
        return True

    def queued_tokens(self) -> int:
        """Tokens still to compute for the requests queued and running here."""
        return self._queued_tokens

    def cached_prefix_blocks(self, hashes: Sequence[int], limit: int | None = None) -> int:
        """Blocks of ``hashes`` (a chained prefix) cached here: what a KV-aware router sees."""
        return self.pool.match_sorted(hashes, limit)

    # -- the scheduler step ----------------------------------------------------------------
    def step(self, now: float = 0.0) -> tuple[list[Event], float, list[Request]]:
        """Run one scheduler step at time ``now``: (events, duration in s, finished requests).

        Scheduling a request advances its ``computed``/``known`` at once; only requests with a
        block that became full are visited again, to commit it, after every allocation of the
        step (the order the pool sees: allocations and evictions, then commits, then
        releases). A request scheduled here is never a preemption victim in the same step:
        victims are taken from the tail of ``running``, past the request being scheduled."""
        pool = self.pool
        bs = self.block_size
        budget = self.max_num_batched_tokens
        removed: list[int] = []
        filled: list[Request] = []  # scheduled requests with a block that became full, in order
        finished: list[Request] = []
        running = self.running
        preempted = False
        queued = self._queued_tokens

        # Iterating ``running`` while preemption pops its tail is safe: the iterator stops at
        # the shortened end, and a request that preempts itself ends the loop.
        for req in running:
            if budget <= 0:
                break
            computed = req.computed
            known = req.known
            n = known - computed
            if n > budget:
                n = budget
            c = computed + n
            if c > req.n_blocks * bs:  # its blocks cannot hold c tokens: allocate more
                need = (c + bs - 1) // bs - req.n_blocks
                while not pool.allocate(need, removed):
                    victim = running.pop()
                    queued += self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                else:
                    req.n_blocks += need
                    need = 0
                if need:  # it preempted itself: no room for it this step
                    break
            req.computed = c
            budget -= n
            if c // bs > req.n_held:
                filled.append(req)
            if c == known:
                req.known = c + 1
                queued += 1 - n
                if c == req.last:
                    finished.append(req)
            else:
                queued -= n

        if not preempted:
            waiting = self.waiting
            refs = pool.refs
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                req = waiting[0]
                known = req.known
                max_hit = (known - 1) // bs
                hashes = req.hashes
                if len(hashes) < max_hit:
                    extend_hashes(hashes, req.tokens, max_hit, bs)
                m = pool.match_sorted(hashes, max_hit)
                computed = m * bs
                n = known - computed
                if n > budget:
                    n = budget
                need = (computed + n + bs - 1) // bs - m
                if need > pool.empty:
                    # hit blocks in the free list stop being evictable once referenced
                    pinned = list(map(refs.__getitem__, hashes[:m])).count(0)
                    if pool.empty + len(pool.free) - pinned < need:
                        break
                waiting.popleft()
                if m:
                    pool.touch(hashes[:m])
                pool.allocate(need, removed)
                req.n_held = m
                req.n_blocks = m + need
                if not req.counted:
                    req.counted = True
                    req.hit_tokens = computed
                    self.prompt_tokens += req.prompt_len
                    self.hit_tokens += computed
                running.append(req)
                budget -= n
                c = computed + n
                queued -= c - req.computed
                req.computed = c
                if c // bs > m:
                    filled.append(req)
                if c == known:
                    req.known = c + 1
                    queued += 1
                    if c == req.last:
                        finished.append(req)

        events: list[Event] = []
        if removed:
            events.append({"type": BLOCK_REMOVED, "block_hashes": removed, "medium": self.medium})
            self.removed_blocks += len(removed)
            self.remove_events += 1
        for req in filled:
            self._commit(req, req.computed // bs, events)
        if finished:
            for req in finished:
                running.remove(req)
                queued -= req.known - req.computed
                pool.release(req.hashes[: req.n_held], req.n_blocks - req.n_held)
                req.n_held = req.n_blocks = 0
                req.finish_time = now
            self.finished += len(finished)
        self._queued_tokens = queued
        tokens = self.max_num_batched_tokens - budget
        self.tokens_computed += tokens
        self.steps += 1
        return events, self.step_overhead_s + self.token_cost_s * tokens, finished

    def _commit(self, req: Request, full: int, events: list[Event]) -> None:
        bs = self.block_size
        hashes = req.hashes
        first = req.n_held
        if len(hashes) < full:
            extend_hashes(hashes, req.tokens, full, bs)
        refs = self.pool.refs
        if full == first + 1:  # one block, as in every decode step: no run to track
            h = hashes[first]
            if h in refs:
                self.pool.commit(h)
            else:
                refs[h] = 1
                self._emit(req, first, full, events)
            req.n_held = full
            return
        start = -1
        for k in range(first, full):
            h = hashes[k]
            if h not in refs:
                refs[h] = 1
                if start < 0:
                    start = k
            else:
                self.pool.commit(h)  # already cached: share it, free the copy
                if start >= 0:
                    self._emit(req, start, k, events)
                    start = -1
        if start >= 0:
            self._emit(req, start, full, events)
        req.n_held = full

    def _emit(self, req: Request, a: int, b: int, events: list[Event]) -> None:
        bs = self.block_size
        hashes = req.hashes
        events.append(
            {
                "type": BLOCK_STORED,
                "block_hashes": hashes[a:b],
                "parent_block_hash": hashes[a - 1] if a else None,
                "token_ids": req.tokens[a * bs : b * bs],
                "block_size": bs,
                "lora_id": None,
                "medium": self.medium,
                "lora_name": None,
            }
        )
        self.stored_blocks += b - a
        self.store_events += 1

    def _preempt(self, req: Request) -> int:
        """Send ``req`` back to the front of the queue; returns the tokens it has to compute
        again (added to the queued tokens)."""
        self.pool.release(req.hashes[: req.n_held], req.n_blocks - req.n_held)
        req.n_held = req.n_blocks = 0
        recompute = req.computed
        req.computed = 0
        self.waiting.appendleft(req)
        self.preemptions += 1
        return recompute

    # -- reporting -------------------------------------------------------------------------
    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate: prompt tokens served from cache / prompt tokens admitted."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def stats(self) -> dict[str, Any]:
        pool = self.pool
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "blocks_used": pool.used,
            "blocks_cached": pool.cached,
            "blocks_total": pool.num_blocks,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_rate,
            "stored_blocks": self.stored_blocks,
            "removed_blocks": self.removed_blocks,
            "store_events": self.store_events,
            "remove_events": self.remove_events,
            "preemptions": self.preemptions,
            "finished": self.finished,
            "rejected": self.rejected,
            "steps": self.steps,
            "tokens_computed": self.tokens_computed,
        }
