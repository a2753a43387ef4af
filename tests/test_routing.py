"""The routing policies (kvctl/routing.py): Dynamo 1.6's cost, longest prefix, llm-d's tier
weighted score; worked examples with the numbers a user reads in `kvctl query --explain`, and
invariants over any overlaps and loads."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.routing import (
    POLICIES,
    DynamoKnobs,
    LlmdKnobs,
    Load,
    Overlap,
    dynamo_cost,
    dynamo_softmax,
    explain,
)


def decisions(explanation):
    return {d.policy: d for d in explanation.decisions}


def test_a_worked_example_with_every_tier():
    # 20 tokens in blocks of 4; worker 1 holds 2 blocks on GPU and the 3rd in CPU memory,
    # worker 2 holds 2 on GPU but has 3 blocks of decode work, worker 3 holds nothing
    overlaps = [Overlap(1, 0, 2, 1, 0), Overlap(2, 0, 2, 0, 0), Overlap(3, 0, 0, 0, 0)]
    result = decisions(explain(overlaps, 20, 4, {(2, 0): Load(active_decode_blocks=3)}))
    dynamo = result["dynamo"]
    costs = {s.worker: s.score for s in dynamo.scores}
    # 1 x max(0, 20/4 - (2 + 0.75 x 1)) + (0 + 5) = 7.25
    assert costs == {(1, 0): 7.25, (2, 0): 3 + 8, (3, 0): 5 + 5}
    assert dynamo.chosen == [(1, 0)] and not dynamo.tie
    first = dynamo.scores[0].explain
    assert "(0 + 20) / 4" in first and "0.75 x 1" in first and first.endswith("= 7.25")
    assert result["longest-prefix"].chosen == [(1, 0)]
    llmd = result["llm-d"]
    assert {s.worker: s.terms["weighted"] for s in llmd.scores} == {
        (1, 0): pytest.approx(2.8),
        (2, 0): 2.0,
        (3, 0): 0.0,
    }
    assert [s.score for s in llmd.scores] == [1.0, 0.0, 0.0] and llmd.chosen == [(1, 0)]


def test_equal_costs_are_a_tie_with_even_chances_not_a_silent_pick():
    overlaps = [Overlap(1, 0, 3), Overlap(2, 0, 3), Overlap(3, 0, 1)]
    for decision in explain(overlaps, 64, 16).decisions:
        assert decision.tie and decision.chosen == [(1, 0), (2, 0)], decision.policy
        chances = {s.worker: s.probability for s in decision.scores}
        assert chances == {(1, 0): 0.5, (2, 0): 0.5, (3, 0): 0.0}


def test_load_moves_dynamo_off_the_cache_but_not_the_prefix_policies():
    overlaps = [Overlap(1, 0, 4), Overlap(2, 0, 0)]
    busy = {(1, 0): Load(active_prefill_tokens=4096, active_decode_blocks=500)}
    result = decisions(explain(overlaps, 128, 16, busy))
    assert result["dynamo"].chosen == [(2, 0)]
    assert result["longest-prefix"].chosen == [(1, 0)] == result["llm-d"].chosen


def test_knobs_change_the_cost_as_dynamo_documents():
    load = (32, 10, 3)  # active prefill tokens, decode blocks, requests
    base = dynamo_cost(64, 16, 2, 1, 1, *load, DynamoKnobs())
    assert base.raw_prefill_blocks == (32 + 64) / 16
    assert base.overlap_credit_blocks == 2 + 0.75 + 0.25
    assert base.cost == (6 - 3) + (10 + 4)
    scaled = dynamo_cost(64, 16, 2, 1, 1, *load, DynamoKnobs(prefill_load_scale=2))
    assert scaled.cost == 2 * 3 + 14
    per_request = dynamo_cost(64, 16, 2, 1, 1, *load, DynamoKnobs(decode_active_request_weight=2))
    assert per_request.cost == base.cost + 6
    untracked = dynamo_cost(64, 16, 2, 1, 1, *load, DynamoKnobs(track_prefill_tokens=False))
    assert untracked.cost == 14
    # a credit above the prefill never makes it negative
    clamped = dynamo_cost(64, 16, 4, knobs=DynamoKnobs(overlap_score_credit=5))
    assert clamped.adjusted_prefill_blocks == 0 and clamped.cost == 4


def test_credit_decay_shrinks_only_the_busier_workers_device_credit():
    knobs = DynamoKnobs(overlap_score_credit_decay=1.0)
    loads = {(1, 0): Load(active_prefill_tokens=64), (2, 0): Load(active_prefill_tokens=0)}
    result = decisions(explain([Overlap(1, 0, 4), Overlap(2, 0, 4)], 64, 16, loads, dynamo=knobs))
    terms = {s.worker: s.terms for s in result["dynamo"].scores}
    # 64 tokens above the least loaded = 4 blocks = 1 request of 4 blocks: decay 1 / (1 + 1)
    assert terms[(1, 0)]["decay"] == 0.5 and terms[(2, 0)]["decay"] == 1.0


def test_temperature_gives_dynamo_s_softmax_probabilities():
    costs = {(1, 0): 2.0, (2, 0): 4.0, (3, 0): 6.0}
    chances = dynamo_softmax(costs, 0.5)
    # normalised costs 0, 0.5, 1 over temperature 0.5: exp(0), exp(-1), exp(-2)
    total = 1 + math.exp(-1) + math.exp(-2)
    assert chances[(1, 0)] == pytest.approx(1 / total)
    assert chances[(3, 0)] == pytest.approx(math.exp(-2) / total)
    assert dynamo_softmax({(1, 0): 3.0, (2, 0): 3.0}, 1.0) == {(1, 0): 0.5, (2, 0): 0.5}
    overlaps = [Overlap(1, 0, 3), Overlap(2, 0, 1)]
    sampled = decisions(explain(overlaps, 64, 16, dynamo=DynamoKnobs(router_temperature=1.0)))
    assert sampled["dynamo"].chosen == [(1, 0)]
    assert 0 < sampled["dynamo"].scores[1].probability < sampled["dynamo"].scores[0].probability


def test_workers_known_to_the_index_or_named_by_load_are_candidates():
    result = explain([Overlap(1, 0, 2)], 64, 16, {(4, 1): Load(1, 2, 3)}, workers=[(2, 0)])
    assert [c.key for c in result.candidates] == [(1, 0), (2, 0), (4, 1)]
    assert result.load_given
    assert not explain([Overlap(1, 0, 2)], 64, 16).load_given
    assert explain([], 64, 16).decisions == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="block size"):
        explain([Overlap(1)], 10, 0)
    with pytest.raises(ValueError, match="no tokens"):
        explain([Overlap(1)], 0, 16)
    with pytest.raises(ValueError, match="unknown policy"):
        explain([Overlap(1)], 10, 16, policies=["fastest"])


# -- invariants ---------------------------------------------------------------------------------

BLOCK = 16


@st.composite
def fleets(draw):
    """Overlaps of one prompt on up to 8 workers (each a prefix of the prompt, by tier), the
    prompt's length, and optionally a load per worker."""
    prompt_blocks = draw(st.integers(1, 40))
    prompt_tokens = prompt_blocks * BLOCK - draw(st.integers(0, BLOCK - 1))
    full = prompt_tokens // BLOCK
    overlaps = []
    for worker in range(draw(st.integers(1, 8))):
        device = draw(st.integers(0, full))
        host = draw(st.integers(0, full - device))
        disk = draw(st.integers(0, full - device - host))
        overlaps.append(Overlap(worker, 0, device, host, disk))
    counts = st.integers(0, 10_000)
    loads = draw(
        st.one_of(
            st.just({}),
            st.dictionaries(
                st.sampled_from([o.key for o in overlaps]), st.builds(Load, counts, counts, counts)
            ),
        )
    )
    return overlaps, prompt_tokens, loads


@given(fleets())
def test_every_policy_spreads_a_probability_of_one_over_its_best(fleet):
    overlaps, prompt_tokens, loads = fleet
    for decision in explain(overlaps, prompt_tokens, BLOCK, loads).decisions:
        chances = [s.probability for s in decision.scores]
        assert sum(chances) == pytest.approx(1.0)
        chosen = {s.worker for s in decision.scores if s.probability > 0}
        assert chosen == set(decision.chosen), decision.policy


@given(fleets())
def test_longest_prefix_picks_every_worker_with_the_most_matched_blocks(fleet):
    overlaps, prompt_tokens, loads = fleet
    decision = decisions(explain(overlaps, prompt_tokens, BLOCK, loads))["longest-prefix"]
    most = max(o.matched_blocks for o in overlaps)
    assert set(decision.chosen) == {o.key for o in overlaps if o.matched_blocks == most}


@given(fleets())
def test_without_load_dynamo_follows_the_overlap_credit(fleet):
    overlaps, prompt_tokens, _ = fleet
    decision = decisions(explain(overlaps, prompt_tokens, BLOCK))["dynamo"]
    knobs = DynamoKnobs()

    def credit(o):
        return (
            o.device_blocks
            + knobs.host_cache_hit_weight * o.host_blocks
            + (knobs.disk_cache_hit_weight * o.disk_blocks)
        )

    best = max(map(credit, overlaps))
    assert set(decision.chosen) == {o.key for o in overlaps if credit(o) == best}


@given(fleets())
def test_with_gpu_blocks_only_the_three_policies_agree_without_load(fleet):
    overlaps, prompt_tokens, _ = fleet
    gpu_only = [Overlap(o.worker_id, o.dp_rank, o.device_blocks) for o in overlaps]
    chosen = {d.policy: d.chosen for d in explain(gpu_only, prompt_tokens, BLOCK).decisions}
    assert chosen["dynamo"] == chosen["longest-prefix"] == chosen["llm-d"]


@given(fleets(), st.floats(0.01, 100))
def test_softmax_prefers_lower_costs(fleet, temperature):
    overlaps, prompt_tokens, loads = fleet
    knobs = DynamoKnobs(router_temperature=temperature)
    decision = decisions(explain(overlaps, prompt_tokens, BLOCK, loads, dynamo=knobs))["dynamo"]
    ranked = sorted(decision.scores, key=lambda s: s.score)
    for lower, higher in zip(ranked, ranked[1:], strict=False):
        assert lower.probability >= higher.probability - 1e-12


@given(fleets(), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))
def test_llmd_scores_are_normalised_and_follow_the_weighted_sum(fleet, gpu, cpu, disk):
    overlaps, prompt_tokens, _ = fleet
    knobs = LlmdKnobs(gpu, cpu, disk)
    decision = decisions(explain(overlaps, prompt_tokens, BLOCK, llmd=knobs))["llm-d"]
    assert all(0.0 <= s.score <= 1.0 for s in decision.scores)
    weighted = {s.worker: s.terms["weighted"] for s in decision.scores}
    best = max(weighted.values())
    if best > 0:
        assert set(decision.chosen) == {k for k, v in weighted.items() if v == best}
    else:  # no pod has a hit: every pod scores 0
        assert len(decision.chosen) == len(overlaps)


def test_every_policy_is_explained():
    result = explain([Overlap(1, 0, 1)], 16, 16)
    assert [d.policy for d in result.decisions] == list(POLICIES)
    assert all(d.formula and d.rule and d.scores[0].explain for d in result.decisions)
