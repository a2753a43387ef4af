"""Routing policies as pure functions: given what an index says each (worker, dp rank) holds of a
prompt, by tier, and each one's load, the score every policy gives it, the decision, and the
formula with its numbers. No sockets, no clocks: ``kvctl query`` feeds it from an index's
``/query`` answer; the simulator's ``kv`` router (``kvctl.engine.fleet``) scores with
:func:`dynamo_cost`.

Policies:

- ``dynamo``: NVIDIA Dynamo 1.6's default worker selector (``DefaultWorkerSelector``, lib/kv-router
  ``scheduling/selector``; knobs and defaults of ``KvRouterConfig``). Per candidate::

      raw_prefill_blocks      = (active_prefill_tokens + prompt_tokens) / block_size
      overlap_credit_blocks   = overlap_score_credit * decay * device_blocks
                                + host_cache_hit_weight * host_blocks
                                + disk_cache_hit_weight * disk_blocks
      cost = prefill_load_scale * max(0, raw_prefill_blocks - overlap_credit_blocks)
             + (active_decode_blocks + request_blocks)
             + decode_active_request_weight * active_requests

  ``decay`` is 1 unless ``overlap_score_credit_decay`` k > 0: then
  ``1 / (1 + k * excess_prefill_blocks / request_blocks)``, the excess being this candidate's
  active prefill above the least loaded candidate's. Without prefill tracking the prefill term
  is 0. The lowest cost wins; at ``router_temperature`` 0 Dynamo picks uniformly at random among
  equal lowest costs (reservoir sampling), above 0 it samples a softmax of the costs normalised
  to [0, 1] and divided by the temperature. kvctl never picks silently: it reports the tie, or
  each candidate's probability. The shared-cache term (``shared_cache_multiplier``, off by
  default) is not modelled: no index query reports it.
- ``longest-prefix``: the most matched prompt blocks, in any tier; ties reported.
- ``llm-d``: llm-d's kv-cache ``LongestPrefixScorer``: each block of the matched prefix counts
  its tier's weight (gpu 1.0, cpu 0.8, storage 0.3 by default), and the inference scheduler's
  precise-prefix-cache scorer normalises the sums to [0, 1] over the pods with a hit
  (``(s - min) / (max - min)``; all equal: 1; no hit: 0). The highest wins; ties reported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

POLICIES = ("dynamo", "longest-prefix", "llm-d")

WorkerKey = tuple[int, int]
"""(worker id, dp rank)."""


def worker_label(key: WorkerKey) -> str:
    return f"{key[0]}:{key[1]}"


def worker_order(key: WorkerKey) -> tuple[bool, int, str, int]:
    """Workers in order: numeric ids by number, then named ones (a recording's labels) by
    name."""
    wid = key[0]
    numeric = type(wid) is int
    return (not numeric, wid if numeric else 0, "" if numeric else str(wid), key[1])


@dataclass(frozen=True)
class Overlap:
    """What an index holds of a prompt for one worker and dp rank: the matched prefix, in
    blocks, split by tier (device first, then host memory, then disk, as Dynamo matches)."""

    worker_id: int
    dp_rank: int = 0
    device_blocks: int = 0
    host_blocks: int = 0
    """Blocks past the device prefix found in host (CPU) memory."""
    disk_blocks: int = 0
    """Blocks past the device and host prefix found on disk (or external storage)."""

    @property
    def key(self) -> WorkerKey:
        return (self.worker_id, self.dp_rank)

    @property
    def matched_blocks(self) -> int:
        return self.device_blocks + self.host_blocks + self.disk_blocks


@dataclass(frozen=True)
class Load:
    """What a worker and dp rank is busy with, as Dynamo's router tracks it."""

    active_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    active_requests: int = 0


ZERO_LOAD = Load()


@dataclass(frozen=True)
class DynamoKnobs:
    """Dynamo 1.6's ``KvRouterConfig`` knobs that the cost uses, with Dynamo's defaults."""

    overlap_score_credit: float = 1.0
    overlap_score_credit_decay: float = 0.0
    prefill_load_scale: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    decode_active_request_weight: float = 0.0
    router_temperature: float = 0.0
    track_prefill_tokens: bool = True


DEFAULT_DYNAMO = DynamoKnobs()


@dataclass(frozen=True)
class LlmdKnobs:
    """llm-d's tier weights (``DefaultKVCacheBackendConfig``: gpu 1.0, cpu 0.8, storage 0.3)."""

    gpu_weight: float = 1.0
    cpu_weight: float = 0.8
    disk_weight: float = 0.3


def request_blocks(prompt_tokens: int, block_size: int) -> int:
    return -(-prompt_tokens // block_size)


class DynamoCost(NamedTuple):
    raw_prefill_blocks: float
    decay: float
    overlap_credit_blocks: float
    adjusted_prefill_blocks: float
    prefill_cost: float
    decode_blocks: float
    active_request_cost: float
    cost: float


def dynamo_cost(
    prompt_tokens: int,
    block_size: int,
    device_blocks: float,
    host_blocks: float = 0,
    disk_blocks: float = 0,
    active_prefill_tokens: int = 0,
    active_decode_blocks: int = 0,
    active_requests: int = 0,
    knobs: DynamoKnobs = DEFAULT_DYNAMO,
    min_active_prefill_tokens: int = 0,
) -> DynamoCost:
    """Dynamo 1.6's cost of sending a prompt of ``prompt_tokens`` to one candidate (lower is
    better), with every term (see the module docstring); the load is the candidate's
    :class:`Load`, field by field."""
    blocks = request_blocks(prompt_tokens, block_size)
    if knobs.track_prefill_tokens:
        raw_prefill = (active_prefill_tokens + prompt_tokens) / block_size
    else:
        raw_prefill = 0.0
    decay = 1.0
    if knobs.track_prefill_tokens and knobs.overlap_score_credit_decay > 0 and blocks:
        excess = max(active_prefill_tokens - min_active_prefill_tokens, 0) / block_size
        decay = 1.0 / (1.0 + knobs.overlap_score_credit_decay * excess / blocks)
    credit = (
        knobs.overlap_score_credit * decay * device_blocks
        + knobs.host_cache_hit_weight * host_blocks
        + knobs.disk_cache_hit_weight * disk_blocks
    )
    adjusted = max(raw_prefill - credit, 0.0)
    prefill_cost = knobs.prefill_load_scale * adjusted
    decode = float(active_decode_blocks + blocks)
    requests_cost = knobs.decode_active_request_weight * active_requests
    cost = prefill_cost + decode + requests_cost
    return DynamoCost(
        raw_prefill, decay, credit, adjusted, prefill_cost, decode, requests_cost, cost
    )


@dataclass(frozen=True)
class Score:
    worker: WorkerKey
    score: float
    probability: float
    """The chance this policy sends the prompt here (ties and softmax sampling spread it)."""
    explain: str
    """The formula with this candidate's numbers."""
    terms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    policy: str
    rule: str
    """How the policy decides, in words (and what it does with ties)."""
    formula: str
    scores: list[Score]
    chosen: list[WorkerKey]
    """The best candidates: one, or several when they tie (or are sampled from)."""
    knobs: dict[str, Any] = field(default_factory=dict)

    @property
    def tie(self) -> bool:
        return len(self.chosen) > 1

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "rule": self.rule,
            "formula": self.formula,
            "knobs": self.knobs,
            "chosen": [{"worker_id": w, "dp_rank": d} for w, d in self.chosen],
            "tie": self.tie,
            "scores": [
                {
                    "worker_id": s.worker[0],
                    "dp_rank": s.worker[1],
                    "score": s.score,
                    "probability": s.probability,
                    "terms": s.terms,
                    "explain": s.explain,
                }
                for s in self.scores
            ],
        }


def _best(scores: Mapping[WorkerKey, float], lowest: bool) -> list[WorkerKey]:
    target = min(scores.values()) if lowest else max(scores.values())
    return [key for key, value in scores.items() if value == target]


def _uniform(keys: Iterable[WorkerKey], chosen: list[WorkerKey]) -> dict[WorkerKey, float]:
    share = 1.0 / len(chosen)
    picked = set(chosen)
    return {key: share if key in picked else 0.0 for key in keys}


def dynamo_softmax(costs: Mapping[WorkerKey, float], temperature: float) -> dict[WorkerKey, float]:
    """Dynamo's sampling probabilities at ``temperature`` > 0: costs normalised to [0, 1] (all
    equal: uniform), ``exp(-normalised / temperature)``, normalised to sum 1."""
    low, high = min(costs.values()), max(costs.values())
    if low == high:
        return {key: 1.0 / len(costs) for key in costs}
    weights = {
        key: math.exp(-(cost - low) / ((high - low) * temperature)) for key, cost in costs.items()
    }
    total = sum(weights.values())
    return {key: weight / total for key, weight in weights.items()}


def _num(value: float) -> str:
    return f"{value:.6g}"


def _dynamo(
    candidates: list[Overlap],
    prompt_tokens: int,
    block_size: int,
    loads: Mapping[WorkerKey, Load],
    knobs: DynamoKnobs,
) -> Decision:
    min_prefill = min(
        (loads.get(c.key, ZERO_LOAD).active_prefill_tokens for c in candidates), default=0
    )
    costs: dict[WorkerKey, DynamoCost] = {}
    for c in candidates:
        load = loads.get(c.key, ZERO_LOAD)
        costs[c.key] = dynamo_cost(
            prompt_tokens,
            block_size,
            c.device_blocks,
            c.host_blocks,
            c.disk_blocks,
            load.active_prefill_tokens,
            load.active_decode_blocks,
            load.active_requests,
            knobs,
            min_prefill,
        )
    values = {key: cost.cost for key, cost in costs.items()}
    chosen = _best(values, lowest=True)
    if knobs.router_temperature > 0:
        probabilities = dynamo_softmax(values, knobs.router_temperature)
        rule = (
            f"softmax sampling at router_temperature {_num(knobs.router_temperature)}: "
            "probability ~ exp(-(cost - min) / ((max - min) * temperature)); "
            "the lowest cost is the most likely"
        )
    else:
        probabilities = _uniform(values, chosen)
        rule = "lowest cost; Dynamo picks uniformly at random among equal lowest costs"
    blocks = request_blocks(prompt_tokens, block_size)
    scores = []
    for c in candidates:
        t = costs[c.key]
        load = loads.get(c.key, ZERO_LOAD)
        prefill = (
            f"({load.active_prefill_tokens} + {prompt_tokens}) / {block_size}"
            if knobs.track_prefill_tokens
            else "0 (prefill not tracked)"
        )
        explain = (
            f"{_num(knobs.prefill_load_scale)} x max(0, {prefill} - "
            f"({_num(knobs.overlap_score_credit)} x {_num(t.decay)} x {c.device_blocks} + "
            f"{_num(knobs.host_cache_hit_weight)} x {c.host_blocks} + "
            f"{_num(knobs.disk_cache_hit_weight)} x {c.disk_blocks})) + "
            f"({load.active_decode_blocks} + {blocks}) + "
            f"{_num(knobs.decode_active_request_weight)} x {load.active_requests} = "
            f"{_num(t.prefill_cost)} + {_num(t.decode_blocks)} + "
            f"{_num(t.active_request_cost)} = {_num(t.cost)}"
        )
        scores.append(Score(c.key, t.cost, probabilities[c.key], explain, dict(t._asdict())))
    formula = (
        "cost = prefill_load_scale x max(0, raw_prefill_blocks - overlap_credit_blocks) "
        "+ decode_blocks + decode_active_request_weight x active_requests; "
        "raw_prefill_blocks = (active_prefill_tokens + prompt_tokens) / block_size; "
        "overlap_credit_blocks = overlap_score_credit x decay x gpu_blocks "
        "+ host_cache_hit_weight x cpu_blocks + disk_cache_hit_weight x disk_blocks; "
        "decode_blocks = active_decode_blocks + request_blocks"
    )
    return Decision("dynamo", rule, formula, scores, chosen, asdict(knobs))


def _longest_prefix(candidates: list[Overlap], block_size: int) -> Decision:
    values = {c.key: float(c.matched_blocks) for c in candidates}
    chosen = _best(values, lowest=False)
    probabilities = _uniform(values, chosen)
    scores = [
        Score(
            c.key,
            values[c.key],
            probabilities[c.key],
            f"{c.device_blocks} + {c.host_blocks} + {c.disk_blocks} = {c.matched_blocks} blocks "
            f"({c.matched_blocks * block_size} tokens)",
        )
        for c in candidates
    ]
    return Decision(
        "longest-prefix",
        "most matched blocks; equal lengths are a tie (a router breaks it its own way)",
        "score = gpu_blocks + cpu_blocks + disk_blocks (the matched prefix, any tier)",
        scores,
        chosen,
    )


def _llmd(candidates: list[Overlap], knobs: LlmdKnobs) -> Decision:
    raw = {
        c.key: knobs.gpu_weight * c.device_blocks
        + knobs.cpu_weight * c.host_blocks
        + knobs.disk_weight * c.disk_blocks
        for c in candidates
    }
    hits = {key: value for key, value in raw.items() if value > 0}
    low, high = (min(hits.values()), max(hits.values())) if hits else (0.0, 0.0)

    def normalised(key: WorkerKey) -> float:
        if key not in hits:
            return 0.0
        return 1.0 if low == high else (hits[key] - low) / (high - low)

    values = {key: normalised(key) for key in raw}
    chosen = _best(values, lowest=False)
    probabilities = _uniform(values, chosen)
    scores = []
    for c in candidates:
        weighted = (
            f"{_num(knobs.gpu_weight)} x {c.device_blocks} + {_num(knobs.cpu_weight)} x "
            f"{c.host_blocks} + {_num(knobs.disk_weight)} x {c.disk_blocks} = "
            f"{_num(raw[c.key])}"
        )
        if c.key not in hits:
            explain = f"{weighted}: no hit, normalised 0"
        elif low == high:
            explain = f"{weighted}: every pod with a hit scores the same, normalised 1"
        else:
            explain = (
                f"{weighted}; normalised ({_num(raw[c.key])} - {_num(low)}) / "
                f"({_num(high)} - {_num(low)}) = {_num(values[c.key])}"
            )
        scores.append(
            Score(c.key, values[c.key], probabilities[c.key], explain, {"weighted": raw[c.key]})
        )
    return Decision(
        "llm-d",
        "highest normalised prefix score; equal scores are a tie",
        "weighted = gpu_weight x gpu_blocks + cpu_weight x cpu_blocks + storage_weight x "
        "disk_blocks; score = (weighted - min) / (max - min) over the pods with a hit",
        scores,
        chosen,
        asdict(knobs),
    )


@dataclass(frozen=True)
class Explanation:
    """Every policy's decision for one prompt."""

    prompt_tokens: int
    block_size: int
    candidates: list[Overlap]
    loads: dict[WorkerKey, Load]
    decisions: list[Decision]

    @property
    def load_given(self) -> bool:
        return any(load != ZERO_LOAD for load in self.loads.values())


def explain(
    overlaps: Iterable[Overlap],
    prompt_tokens: int,
    block_size: int,
    loads: Mapping[WorkerKey, Load] | None = None,
    policies: Iterable[str] = POLICIES,
    dynamo: DynamoKnobs | None = None,
    llmd: LlmdKnobs | None = None,
    workers: Iterable[WorkerKey] = (),
) -> Explanation:
    """Each policy's scores and decision for a prompt of ``prompt_tokens``. The candidates are
    every worker and dp rank in ``overlaps``, ``workers`` (known to the index, matching nothing)
    and ``loads``; one that matches nothing has zero overlap. This is the seam every source of
    overlaps feeds: an index's ``/query`` answer, or an index model built from a recording."""
    if block_size < 1:
        raise ValueError("block size must be at least 1")
    if prompt_tokens < 1:
        raise ValueError("the prompt has no tokens")
    loads = dict(loads or {})
    by_key = {o.key: o for o in overlaps}
    for key in [*workers, *loads]:
        by_key.setdefault(key, Overlap(key[0], key[1]))
    candidates = [by_key[key] for key in sorted(by_key, key=worker_order)]
    decisions = []
    if candidates:
        for policy in policies:
            if policy == "dynamo":
                knobs = dynamo or DynamoKnobs()
                decisions.append(_dynamo(candidates, prompt_tokens, block_size, loads, knobs))
            elif policy == "longest-prefix":
                decisions.append(_longest_prefix(candidates, block_size))
            elif policy == "llm-d":
                decisions.append(_llmd(candidates, llmd or LlmdKnobs()))
            else:
                raise ValueError(f"unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    return Explanation(prompt_tokens, block_size, candidates, loads, decisions)
