"""N synthetic workers, a router and a discrete-event clock: a pure stream of event batches.

:meth:`Fleet.run` yields ``(time_s, worker_index, events)`` for every worker step that produced
events, in non-decreasing simulated time. A step is decided and applied when it starts and its
batch is published when it ends (start + modelled step time); arrivals at the same instant as a
step end are routed first. Nothing reads a clock or sleeps: pacing (``--speedup``) is the
caller's business, e.g. ``sleep_until(t0 + time_s / speedup)`` before sending a batch.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from random import Random
from typing import Any

from ..events import Event
from ..routing import dynamo_cost
from .cache import extend_hashes
from .engine import DEFAULT_STEP_OVERHEAD_S, DEFAULT_TOKEN_COST_S, Request, Worker
from .workload import ChatParams, SyntheticWorkload, TraceWorkload

ROUTERS = ("random", "round-robin", "kv", "prefix")


@dataclass
class FleetConfig:
    workers: int = 8
    num_blocks: int = 4096
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    rate: float = 10.0
    """Requests per second over the whole fleet (synthetic workload)."""
    prefixes: int = 8
    requests: int | None = None
    """Stop issuing requests after this many (the fleet then drains)."""
    duration: float | None = None
    """Stop at this simulated time (seconds)."""
    seed: int = 0
    router: str = "kv"
    trace: str | None = None
    """Mooncake-style JSONL trace to replay instead of the synthetic workload."""
    speedup: float = 1.0
    """Trace timestamps are divided by this."""
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    token_cost_s: float = DEFAULT_TOKEN_COST_S
    chat: ChatParams = field(default_factory=ChatParams)


class Fleet:
    """Workers + workload + router. Iterate :meth:`run` once; read :meth:`stats` any time."""

    def __init__(self, config: FleetConfig | None = None, **overrides: Any) -> None:
        cfg = config or FleetConfig()
        if overrides:
            cfg = FleetConfig(**{**cfg.__dict__, **overrides})
        if cfg.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}")
        if cfg.workers < 1:
            raise ValueError("need at least one worker")
        self.config = cfg
        self.workers = [
            Worker(
                cfg.num_blocks,
                cfg.block_size,
                cfg.max_num_batched_tokens,
                cfg.max_num_seqs,
                cfg.step_overhead_s,
                cfg.token_cost_s,
            )
            for _ in range(cfg.workers)
        ]
        if cfg.trace:
            self.workload: SyntheticWorkload | TraceWorkload = TraceWorkload(
                cfg.trace, speedup=cfg.speedup, seed=cfg.seed, requests=cfg.requests
            )
        else:
            self.workload = SyntheticWorkload(
                cfg.rate, cfg.prefixes, cfg.seed, cfg.requests, cfg.block_size, cfg.chat
            )
        self._router_rng = Random(cfg.seed * 4)
        self._rr = 0
        self.now = 0.0
        self.routed = [0] * cfg.workers

    # -- routing ---------------------------------------------------------------------------
    def route(self, req: Request) -> int:
        """Worker index for a new request. ``random``; ``round-robin``; ``prefix``: the worker
        with the longest cached prefix, ties by load (requests queued + running); ``kv``: the
        lowest Dynamo cost (:func:`kvctl.routing.dynamo_cost` with Dynamo's defaults: blocks to
        prefill there, queued ones included, less the cached prefix, plus blocks in use there),
        ties by load. ``prefix`` piles every request sharing a first block onto one worker;
        ``kv`` trades hits against load."""
        n = len(self.workers)
        router = self.config.router
        if router == "random":
            return self._router_rng.randrange(n)
        if router == "round-robin":
            i = self._rr
            self._rr = (i + 1) % n
            return i
        bs = self.config.block_size
        limit = (req.prompt_len - 1) // bs
        extend_hashes(req.hashes, req.tokens, limit, bs)
        # the simulator counts prefill in whole blocks (the prompt rounded up, the queue down),
        # as it always has: seeded streams stay what they were
        prompt_tokens = (req.prompt_len + bs - 1) // bs * bs
        best, best_key = 0, None
        for i, w in enumerate(self.workers):
            hit = w.cached_prefix_blocks(req.hashes, limit)
            if router == "prefix":
                key: tuple[float, ...] = (-hit, w.load)
            else:
                queued = w.queued_tokens() // bs * bs
                cost = dynamo_cost(prompt_tokens, bs, hit, 0, 0, queued, w.pool.used)
                key = (cost.cost, w.load)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    # -- the clock -------------------------------------------------------------------------
    def run(self) -> Iterator[tuple[float, int, list[Event]]]:
        """Simulate; yield ``(time_s, worker_index, events)`` per step that produced events."""
        workers = self.workers
        workload = self.workload
        duration = self.config.duration
        pending: list[tuple[list[Event], list[Request]] | None] = [None] * len(workers)
        heap: list[tuple[float, int]] = []  # (end time of the running step, worker)
        push, pop = heapq.heappush, heapq.heappop

        while True:
            t_arr = workload.peek()
            if t_arr is not None and (not heap or t_arr <= heap[0][0]):
                if duration is not None and t_arr > duration:
                    break
                self.now = t_arr
                req = workload.take()
                i = self.route(req)
                w = workers[i]
                busy = pending[i] is not None
                if w.add(req):
                    self.routed[i] += 1
                    if not busy:
                        events, dt, finished = w.step(t_arr)
                        pending[i] = (events, finished)
                        push(heap, (t_arr + dt, i))
                continue
            if not heap:
                break
            t, i = pop(heap)
            if duration is not None and t > duration:
                break
            self.now = t
            done = pending[i]
            assert done is not None
            events, finished = done
            pending[i] = None
            for req in finished:
                req.finish_time = t
                workload.finished(req, t)
            if events:
                yield t, i, events
            w = workers[i]
            if w.running or w.waiting:
                events, dt, finished = w.step(t)
                pending[i] = (events, finished)
                push(heap, (t + dt, i))

    # -- reporting -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per-worker stats plus fleet totals (``hit_rate`` = hit tokens / prompt tokens)."""
        per = [w.stats() for w in self.workers]
        total: dict[str, Any] = {}
        for key in per[0]:
            if key != "hit_rate":
                total[key] = sum(s[key] for s in per)
        total["hit_rate"] = (
            total["hit_tokens"] / total["prompt_tokens"] if total["prompt_tokens"] else 0.0
        )
        return {"time_s": self.now, "workers": per, "total": total}
