"""`stats` figures equal hand-computed ones on a small two-worker stream."""

from __future__ import annotations

import json
import re
from importlib.util import find_spec

import pytest

from kvctl.events import Batch
from kvctl.formats import decode_zmq, engine_zmq
from kvctl.output import dumps
from kvctl.stats import StatsCollector, lifetime_summary, percentile


def stored(hashes, parent=None, lora_name=None, medium="GPU"):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(4 * len(hashes))),
        "block_size": 4,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
    }


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def mk(source, seq, t, events):
    return Batch(
        source=source,
        events=events,
        format="engine-map",
        seq=seq,
        ts=t,
        recv_ns=round(t * 1e9),
        publisher=source,
    )


# Worker a: stores 1,2 at 100.0 and 3 (child of 2) at 100.5; removes 1 at 101.2, 2 and 3 at 103.
# Worker b: stores 2 at 100.2 (already cached on a: one extra store), clears at 102.1.
# a's seqs 0,1,2,4: one gap of one batch.
STREAM = [
    mk("a", 0, 100.0, [stored([1, 2])]),
    mk("b", 0, 100.2, [stored([2], lora_name="ad1", medium="CPU")]),
    mk("a", 1, 100.5, [stored([3], parent=2)]),
    mk("a", 2, 101.2, [removed([1])]),
    mk("b", 1, 102.1, [{"type": "AllBlocksCleared"}]),
    mk("a", 4, 103.0, [removed([2, 3])]),
]


@pytest.fixture
def result():
    sc = StatsCollector()
    for b in STREAM:
        sc.feed(b)
    out = sc.result()
    json.dumps(out)  # JSON-ready
    return out


def test_counts(result):
    o = result["overall"]
    assert o["batches"] == 6 and o["events"] == 6 and o["workers"] == 2
    assert o["events_by_type"] == {"AllBlocksCleared": 1, "BlockRemoved": 2, "BlockStored": 3}
    assert o["blocks_by_type"] == {"BlockStored": 4, "BlockRemoved": 3}
    assert o["blocks_cached"] == 0
    a, b = result["workers"]["a[dp0]"], result["workers"]["b[dp0]"]
    assert a["events_by_type"] == {"BlockRemoved": 2, "BlockStored": 2}
    assert a["blocks_by_type"] == {"BlockStored": 3, "BlockRemoved": 3}
    assert (a["max_blocks_cached"], a["blocks_cached"], a["cleared"]) == (3, 0, 0)
    assert (b["max_blocks_cached"], b["blocks_cached"], b["cleared"]) == (1, 0, 1)


def test_rates_and_occupancy(result):
    r = result["rates"]
    assert (r["t0"], r["bucket_s"]) == (100.0, 1.0)
    # [batches, events, stored blocks, removed blocks] per second
    assert r["buckets"] == [[3, 3, 4, 0], [1, 1, 0, 1], [1, 1, 0, 0], [1, 1, 0, 2]]
    assert r["peak_events_per_s"] == 3.0
    assert result["workers"]["a[dp0]"]["events_per_bucket"] == [2, 1, 0, 1]
    assert result["workers"]["b[dp0]"]["events_per_bucket"] == [1, 0, 1, 0]
    assert result["occupancy"]["samples"] == [
        {"a[dp0]": 3, "b[dp0]": 1},
        {"a[dp0]": 2, "b[dp0]": 1},
        {"a[dp0]": 2, "b[dp0]": 0},
        {"a[dp0]": 0, "b[dp0]": 0},
    ]


def test_lifetimes(result):
    lt = result["lifetime_s"]
    # 1: 100.0 -> 101.2; 2: 100.0 -> 103.0; 3: 100.5 -> 103.0. b's cleared block is no eviction.
    assert lt["count"] == 3
    assert lt["min"] == pytest.approx(1.2) and lt["max"] == pytest.approx(3.0)
    assert lt["mean"] == pytest.approx(6.7 / 3)
    assert lt["p50"] == pytest.approx(2.5)
    assert lt["p90"] == pytest.approx(2.9)
    assert sum(lt["histogram"]["counts"]) == 3
    assert result["workers"]["a[dp0]"]["lifetime_s"]["p50"] == pytest.approx(2.5)
    assert result["workers"]["b[dp0]"]["lifetime_s"] == {"count": 0}


def test_reuse_lora_medium_gaps(result):
    assert result["reuse"] == {"hashes_on_multiple_workers": 1, "extra_stores": 1}
    assert result["lora"] == {"ad1": 1, "none": 3}
    assert result["medium"] == {"stored": {"CPU": 1, "GPU": 3}, "removed": {"GPU": 3}}
    pubs = result["gaps"]["publishers"]
    assert pubs["a"]["gaps"] == 1 and pubs["a"]["missing"] == 1 and pubs["a"]["last_seq"] == 4
    assert pubs["b"]["gaps"] == 0
    assert result["gaps"]["ts_backwards"] == 0


def test_percentile_and_histogram():
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    h = lifetime_summary([0.0005, 0.0015, 0.0015, 0.003])["histogram"]
    assert h["edges_s"] == [0.0, 0.001, 0.002, 0.004]
    assert h["counts"] == [1, 2, 1]


def test_buckets_coarsen_on_long_streams():
    sc = StatsCollector(bucket_s=1.0, max_buckets=4)
    for i in range(10):
        sc.feed(mk("a", i, float(i), [stored([i + 1])]))
    r = sc.result()
    assert r["rates"]["bucket_s"] == 4.0
    assert [b[1] for b in r["rates"]["buckets"]] == [4, 4, 2]
    assert [s["a[dp0]"] for s in r["occupancy"]["samples"]] == [4, 8, 10]
    assert r["workers"]["a[dp0]"]["events_per_bucket"] == [4, 4, 2]


def test_lifetime_reservoir_is_bounded_and_deterministic():
    def run():
        sc = StatsCollector(max_lifetimes=50)
        for i in range(3000):
            sc.feed(mk("a", 2 * i, float(i), [stored([i + 1])]))
            sc.feed(mk("a", 2 * i + 1, i + 0.5, [removed([i + 1])]))
        return sc.result()

    r1, r2 = run(), run()
    assert r1["lifetime_s"]["count"] == 50
    assert r1["lifetime_s"]["p50"] == pytest.approx(0.5)
    assert r1 == r2


def test_bytes_hashes_and_decoded_batches():
    evs = [stored([bytes(32), b"\x01" * 32]), removed([bytes(32)])]
    payload = engine_zmq.encode_payload(evs, ts=5.0, encoding="vllm")
    sc = StatsCollector()
    sc.feed(decode_zmq(engine_zmq.encode_frames(b"", 0, payload), "tcp://x:1", recv_ns=5 * 10**9))
    sc.feed(decode_zmq([b"bad"], "tcp://x:1"))
    out = sc.result()
    json.dumps(out)
    assert out["overall"]["malformed"] == 1
    assert out["overall"]["blocks_cached"] == 1


def test_odd_timestamps():
    sc = StatsCollector(max_buckets=16)
    for ts in [1.0, float("nan"), float("inf"), 1e300, -1e300, 2.0]:
        sc.feed(Batch(source="s", events=[stored([1])], format="x", ts=ts))
        sc.feed(Batch(source="s", events=[removed([1])], format="x", ts=ts))
    out = sc.result()
    json.dumps(out)
    assert sum(b[0] for b in out["rates"]["buckets"]) == 8  # nan and inf have no bucket
    assert out["overall"]["batches"] == 12
    assert out["lifetime_s"]["count"] == 4


def test_stats_never_raise_on_odd_batches():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    junk = st.one_of(
        st.none(),
        st.integers(-(1 << 70), 1 << 70),
        st.floats(),
        st.text(max_size=3),
        st.binary(max_size=4),
        st.lists(st.integers(), max_size=2),
    )
    event = st.one_of(
        junk,
        st.fixed_dictionaries(
            {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"])},
            optional={
                "block_hashes": st.one_of(st.lists(junk, max_size=3), junk),
                "parent_block_hash": junk,
                "lora_name": junk,
                "lora_id": junk,
                "medium": junk,
                "worker_id": junk,
                "dp_rank": junk,
            },
        ),
    )
    batch = st.builds(
        Batch,
        source=st.just("s"),
        events=st.lists(event, max_size=4),
        format=st.just("x"),
        seq=st.one_of(st.none(), st.integers(0, 5)),
        ts=st.one_of(st.none(), st.floats()),
        recv_ns=st.one_of(st.just(0), st.integers(0, 10**12)),
    )

    @settings(max_examples=100, deadline=None)
    @given(st.lists(batch, max_size=8))
    def check(bs):
        sc = StatsCollector(max_buckets=16)
        for b in bs:
            sc.feed(b)
        result = sc.result()
        # `kvctl stats --json` prints it as one JSON object, and it accounts for the stream:
        # every batch, every event (what is not an event map is skipped, never counted)
        overall = json.loads(dumps(result))["overall"]
        assert overall["batches"] == len(bs)
        events = sum(type(e) is dict for b in bs for e in b.events)
        assert overall["events"] == events == sum(overall["events_by_type"].values())

    check()


# --- charts (stats --plot): what a reader of the PNG sees ---------------------------------

needs_matplotlib = pytest.mark.skipif(
    find_spec("matplotlib") is None,
    reason="matplotlib is not installed (the plot extra): pip install 'matplotlib>=3.7'",
)

WALL = 1_796_000_000.0  # 2026-11-30, a wall-clock receive time


def wall_clock_result() -> dict:
    """Worker a on the wall clock: lifetimes of 0.3 s, 3 s and 30 s."""
    sc = StatsCollector()
    for seq, (t, events) in enumerate(
        [
            (0.0, [stored([1, 2, 3])]),
            (0.3, [removed([1])]),
            (3.0, [removed([2])]),
            (30.0, [removed([3])]),
        ]
    ):
        sc.feed(mk("a", seq, WALL + t, events))
    return sc.result()


def tick_labels(fig, axis) -> list[str]:
    fig.canvas.draw()
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]


@needs_matplotlib
def test_rates_chart_one_unit_per_axis_stored_and_removed_apart():
    from kvctl.plots import rates_figure

    fig = rates_figure(wall_clock_result())
    blocks_ax, events_ax = fig.axes
    assert (blocks_ax.get_ylabel(), events_ax.get_ylabel()) == ("blocks/s", "events/s")
    stored_line, removed_line = blocks_ax.get_lines()
    assert [t.get_text() for t in blocks_ax.get_legend().get_texts()] == ["stored", "removed"]
    assert stored_line.get_color() != removed_line.get_color()
    assert stored_line.get_linestyle() != removed_line.get_linestyle()


@needs_matplotlib
def test_charts_run_on_the_wall_clock():
    from kvctl.plots import occupancy_figure, rates_figure

    for fig in (rates_figure(wall_clock_result()), occupancy_figure(wall_clock_result())):
        ax = fig.axes[-1]
        assert ax.get_xlabel().startswith("time (")
        labels = tick_labels(fig, ax.xaxis)
        assert labels and all(re.fullmatch(r"\d\d:\d\d(:\d\d)?", t) for t in labels), labels


@needs_matplotlib
def test_charts_of_an_engine_clock_count_seconds(result):
    # the hand-made stream's clock starts at 100 s: no wall clock to show
    from kvctl.plots import rates_figure

    assert rates_figure(result).axes[-1].get_xlabel() == "time since the first event (s)"


@needs_matplotlib
def test_occupancy_capacity_line_only_when_known():
    from kvctl.plots import occupancy_figure

    (ax,) = occupancy_figure(wall_clock_result(), capacity=8).axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["a[dp0]", "capacity (8 blocks per worker)"]
    assert ax.get_ylim()[1] >= 8
    (ax,) = occupancy_figure(wall_clock_result()).axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a[dp0]"]


@needs_matplotlib
def test_lifetimes_in_seconds_on_a_log_axis():
    from kvctl.plots import lifetimes_figure

    fig = lifetimes_figure(wall_clock_result())
    (ax,) = fig.axes
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "lifetime (s)"
    assert {"0.1", "1", "10"} <= set(tick_labels(fig, ax.xaxis))


def test_times_a_float_cannot_subtract_are_left_out_of_the_timeline():
    """Found by the property test above: two timestamps so far apart that their difference
    is infinite. Such batches count in the totals, not in the timeline."""
    sc = StatsCollector()
    for t in (1.6458397736531637e297, -1.7976931348458574e308):
        sc.feed(Batch(source="s", events=[], format="x", ts=t))
    assert sc.result()["overall"]["batches"] == 2
