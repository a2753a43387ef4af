"""kvctl.sequence: one set of rules for every command that sequences a stream."""

from __future__ import annotations

import ast
import json
import re

from conftest import REPO, finish, removed, start_kvctl
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.events import Batch
from kvctl.sequence import (
    DUPLICATE,
    GAP,
    MAX_OPEN_GAPS,
    RECOVERED,
    REORDER,
    RESTART,
    Irregularity,
    SequenceTracker,
    publisher_key,
)


def batch(
    seq: int | None,
    ts: float | None = None,
    recovered: bool = False,
    pub: str | None = "p",
    error: str | None = None,
) -> Batch:
    return Batch(
        source="s",
        events=[],
        format="x",
        seq=seq,
        ts=ts,
        publisher=pub,
        recovered=recovered,
        error=error,
    )


def kinds(tracker: SequenceTracker, seqs: list[int]) -> list[str | None]:
    out = []
    for seq in seqs:
        irregularity = tracker.observe(batch(seq))
        out.append(None if irregularity is None else irregularity.kind)
    return out


def test_rules():
    tr = SequenceTracker()
    assert kinds(tr, [0, 0, 1, 3, 2, 5, 0, 1]) == [
        None,
        DUPLICATE,  # a publisher that never got past 0 did not restart
        None,
        GAP,
        REORDER,
        GAP,
        RESTART,
        None,
    ]
    assert tr.summary() == {
        "p": {
            "batches": 8,
            "last_seq": 1,
            "gaps": 2,
            "missing": 1,  # seq 4 never came; the restart forgot the gap, not the loss
            "duplicates": 1,
            "reorders": 1,
            "resets": 1,
            "recovered": 0,
        }
    }
    assert (tr.gaps, tr.missing, tr.duplicates, tr.reorders, tr.restarts) == (2, 1, 1, 1, 1)


def test_irregularity_fields():
    tr = SequenceTracker()
    assert tr.observe(batch(4)) is None  # the first seq starts the count
    assert tr.observe(batch(9)) == Irregularity(GAP, "p", 5, 9, 4)
    assert tr.observe(batch(6)) == Irregularity(REORDER, "p", 10, 6)
    assert tr.observe(batch(7, recovered=True)) == Irregularity(RECOVERED, "p", 10, 7)
    assert tr.observe(batch(6)) == Irregularity(DUPLICATE, "p", 10, 6)
    assert tr.observe(batch(0, recovered=True)) == Irregularity(DUPLICATE, "p", 10, 0)
    assert tr.observe(batch(0)) == Irregularity(RESTART, "p", 10, 0)
    assert tr.publishers["p"].open_gaps == []


def test_fill_counts_recovered_once():
    tr = SequenceTracker()
    tr.observe(batch(0))
    gap = tr.observe(batch(4))
    assert gap is not None and (gap.expected, gap.got) == (1, 4)
    assert tr.fill(gap.publisher, 2)
    assert not tr.fill(gap.publisher, 2)  # not missing any more
    assert not tr.fill(gap.publisher, 4)
    assert not tr.fill("nobody", 1)
    assert tr.publishers["p"].open_gaps == [[1, 2], [3, 4]]
    assert (tr.missing, tr.recovered) == (2, 1)
    assert tr.summary()["p"]["recovered"] == 1


def test_publishers_count_apart_and_fall_back_to_source():
    tr = SequenceTracker()
    assert kinds(tr, [0, 1]) == [None, None]
    assert tr.observe(batch(0, pub="other")) is None
    assert tr.observe(batch(5, pub=None)) is None
    assert publisher_key(batch(5, pub=None)) == "s"
    assert sorted(tr.summary()) == ["other", "p", "s"]


def test_unsequenced_batches_are_counted_not_sequenced():
    tr = SequenceTracker()
    assert tr.observe(batch(None)) is None
    assert tr.observe(batch(None)) is None
    assert tr.summary()["p"]["batches"] == 2 and tr.summary()["p"]["last_seq"] == -1


def test_malformed_seq_arrives_but_never_opens_a_gap_or_restart():
    tr = SequenceTracker()
    assert tr.observe(batch(3, error="bad")) is None  # no count started by it
    assert tr.summary()["p"]["last_seq"] == -1
    tr.observe(batch(0))
    assert tr.observe(batch(1, error="bad")) is None  # the one expected: advances
    assert tr.observe(batch(2)) is None
    assert tr.observe(batch(9, error="bad")) is None  # no gap
    assert tr.observe(batch(3)) is None
    tr.observe(batch(6))  # gap 4, 5
    assert tr.observe(batch(4, error="bad")) is None  # fills, no reorder
    assert tr.observe(batch(0, error="bad")) is None  # no restart
    s = tr.summary()["p"]
    assert (s["batches"], s["gaps"], s["missing"], s["reorders"], s["resets"]) == (4, 1, 1, 0, 0)
    assert tr.missing == 1


def test_open_gaps_are_bounded():
    tr = SequenceTracker()
    for i in range(0, 1000, 2):
        tr.observe(batch(i))
    pub = tr.publishers["p"]
    assert len(pub.open_gaps) == MAX_OPEN_GAPS
    assert pub.gaps == 499 and pub.missing == 499
    assert tr.observe(batch(1)).kind == DUPLICATE  # its gap was forgotten


def test_time_went_backwards():
    tr = SequenceTracker()

    def obs(seq, ts=None, recovered=False, pub="p"):
        b = batch(seq, ts, recovered, pub)
        irregularity = tr.observe(b)
        found = [irregularity.kind] if irregularity else []
        return found + (["ts-backwards"] if tr.time_went_backwards(b, irregularity) else [])

    assert obs(0, 1.0) == []
    assert obs(1, 2.0) == []
    assert obs(5, 3.0) == [GAP]
    assert obs(2, 1.0, recovered=True) == [RECOVERED]
    assert obs(3, 2.5) == [REORDER]  # a late batch may carry an older ts
    assert obs(6, 3.5) == []
    assert obs(7, 3.2) == ["ts-backwards"]
    assert obs(5, 1.0) == [DUPLICATE, "ts-backwards"]
    assert obs(8, 4.0) == []
    assert obs(0, 0.5) == [RESTART]  # restart: clock history forgotten too
    assert obs(None, 0.4) == ["ts-backwards"]
    assert obs(0, pub="other") == []
    assert tr.ts_backwards == 3 and tr.publishers["p"].ts_backwards == 3
    malformed = batch(1, 0.1, error="bad")
    tr.observe(malformed)
    assert not tr.time_went_backwards(malformed, None)


# --- any stream: the counters add up ------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["live", "recovered", "malformed", "fill", "noseq"]),
        st.sampled_from(["a", "b"]),
        st.integers(0, 40),
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_counters_stay_consistent(stream):
    tr = SequenceTracker()
    verdicts: dict[str, dict[str | None, int]] = {}
    sequenced: dict[str, int] = {}
    batches: dict[str, int] = {}
    fills: dict[str, int] = {}
    for op, pub, seq in stream:
        if op == "fill":
            fills[pub] = fills.get(pub, 0) + tr.fill(pub, seq)
            continue
        b = batch(
            None if op == "noseq" else seq,
            recovered=op == "recovered",
            pub=pub,
            error="bad" if op == "malformed" else None,
        )
        irregularity = tr.observe(b)
        if op == "malformed" or op == "noseq":
            assert irregularity is None
        else:
            v = verdicts.setdefault(pub, {})
            kind = None if irregularity is None else irregularity.kind
            v[kind] = v.get(kind, 0) + 1
            sequenced[pub] = sequenced.get(pub, 0) + 1
            if irregularity is not None:
                assert irregularity.publisher == pub and irregularity.got == seq
                assert (irregularity.missing > 0) == (irregularity.kind == GAP)
        if op != "malformed":
            batches[pub] = batches.get(pub, 0) + 1
    totals = dict.fromkeys(["gaps", "missing", "duplicates", "reorders", "restarts"], 0)
    totals["recovered"] = 0
    for pub, p in tr.publishers.items():
        v = verdicts.get(pub, {})
        # every sequenced batch got exactly one verdict, and each verdict one count
        assert sum(v.values()) == sequenced.get(pub, 0)
        assert p.batches == batches.get(pub, 0)
        assert (p.gaps, p.duplicates, p.reorders, p.restarts) == (
            v.get(GAP, 0),
            v.get(DUPLICATE, 0),
            v.get(REORDER, 0),
            v.get(RESTART, 0),
        )
        assert p.recovered == v.get(RECOVERED, 0) + fills.get(pub, 0)
        # what is still open is missing; missing never goes below it (nor below 0)
        assert len(p.open_gaps) <= MAX_OPEN_GAPS
        assert all(first < end <= p.expected for first, end in p.open_gaps)
        assert p.missing >= sum(end - first for first, end in p.open_gaps) >= 0
        for name in totals:
            totals[name] += getattr(p, name)
    assert totals == {name: getattr(tr, name) for name in totals}


# --- one stream, one verdict: tap, check and stats read the same irregular stream ---------

# 0 again before the publisher got past it: a duplicate; 3 opens a gap that 2 fills late; 5
# opens one that stays (4 never comes); 0 after 5: the engine restarted.
IRREGULAR = (0, 0, 1, 3, 2, 5, 0, 1)
VERDICT = {"gaps": 2, "missing": 1, "duplicates": 1, "reorders": 1, "restarts": 1}


def test_tap_check_and_stats_give_one_verdict(engine):
    count = str(len(IRREGULAR))  # one event per batch; every batch is delivered
    tap = start_kvctl("tap", engine.endpoint, "-c", count, "--json")
    check = start_kvctl("check", engine.endpoint, "-c", count, "--json", "-q")
    stats = start_kvctl("stats", engine.endpoint, "-c", count, "--json", "-q")
    engine.wait_for(3)
    for seq in IRREGULAR:
        engine.send([removed([seq])], seq=seq)
    tap_rc, _, tap_err = finish(tap)
    check_rc, check_out, check_err = finish(check)
    stats_rc, stats_out, stats_err = finish(stats)
    assert (tap_rc, check_rc, stats_rc) == (0, 3, 0), (tap_err, check_err, stats_err)

    line = re.search(
        r"gaps (\d+) \((\d+) batch(?:es)? missing, 0 recovered\), duplicates (\d+), "
        r"reorders (\d+)",
        tap_err,
    )
    assert line is not None, tap_err
    gaps, missing, duplicates, reorders = map(int, line.groups())
    restarts = tap_err.count("restart from")
    tap_verdict = (gaps, missing, duplicates, reorders, restarts)
    assert dict(zip(VERDICT, tap_verdict, strict=True)) == VERDICT

    report = json.loads(check_out)
    rules = {r["id"]: r for r in report["rules"]}
    assert {
        "gaps": rules["KV301"]["count"],
        # KV301 adds up what each gap skipped; the late seq 2 is counted by KV303
        "missing": rules["KV301"]["details"]["missing_batches"] - rules["KV303"]["count"],
        "duplicates": rules["KV302"]["count"],
        "reorders": rules["KV303"]["count"],
        "restarts": rules["KV304"]["count"],
    } == VERDICT
    stream = report["stream"]  # the pipeline's count, as tap's
    assert {
        "gaps": stream["gaps"],
        "missing": stream["missing_batches"],
        "duplicates": stream["duplicates"],
        "reorders": stream["reorders"],
        "restarts": stream["restarts"],
    } == VERDICT

    (publisher,) = json.loads(stats_out)["gaps"]["publishers"].values()
    assert {
        "gaps": publisher["gaps"],
        "missing": publisher["missing"],
        "duplicates": publisher["duplicates"],
        "reorders": publisher["reorders"],
        "restarts": publisher["resets"],
    } == VERDICT


def test_tap_counts_with_the_one_tracker():
    # tap and record count in kvctl.pipeline: the verdict above is one verdict by construction
    # only once the pipeline has no sequence rules of its own.
    tree = ast.parse((REPO / "kvctl" / "pipeline.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    assert "sequence" in imported and "SeqTracker" not in classes
