"""kvctl stats on a small live stream from a real ZMQ publisher: figures equal hand-computed
ones, tables render, --plot writes real PNGs (in-process, the publisher in a thread), a missing
matplotlib or numpy (a process whose import path hides it) fails fast or is not needed."""

from __future__ import annotations

import json
import re
import struct
from importlib.util import find_spec

import pytest
from conftest import REPO, free_port, removed, run_kvctl, stored
from inprocess import run_main, run_while

from kvctl.formats.engine_zmq import encode_frames, encode_payload

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(
    find_spec("matplotlib") is None,
    reason="matplotlib is not installed (the plot extra): pip install 'matplotlib>=3.7'",
)


def hidden(tmp_path, module: str) -> dict[str, str]:
    """Environment for a kvctl whose ``import module`` fails, as when it is not installed: a
    package of that name that raises ImportError comes first on the path."""
    fake = tmp_path / f"without-{module}" / module
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"raise ImportError('No module named {module}')\n")
    return {"PYTHONPATH": str(fake.parent)}


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> str:
    """A simulated recording with evictions (a small cache), on the wall clock."""
    path = tmp_path_factory.mktemp("sim") / "sim.parquet"
    result = run_main(
        "simulate",
        "-o",
        str(path),
        "--workers",
        "2",
        "--duration",
        "30",
        "--num-blocks",
        "256",
        "--seed",
        "7",
        "-q",
    )
    assert result.code == 0, result.err
    return str(path)


# One engine socket, two llm-d style workers named by topic (kv@<worker>@<model>), engine times
# chosen by hand. Worker a: stores 1,2 at 100.0 and 3 (child of 2, LoRA ad1, on CPU) at 100.5;
# removes 1 at 101.2, 2 and 3 at 103.0. Worker b: stores 2 at 100.2 while a holds it (one
# block on two workers), clears at 102.1. Seq 4 is never sent: one gap of one batch.
STREAM = [
    (b"kv@a@m", 0, 100.0, [stored([1, 2])]),
    (b"kv@b@m", 1, 100.2, [stored([2])]),
    (b"kv@a@m", 2, 100.5, [stored([3], parent=2, lora_name="ad1", medium="CPU")]),
    (b"kv@a@m", 3, 101.2, [removed([1])]),
    (b"kv@b@m", 5, 102.1, [{"type": "AllBlocksCleared"}]),
    (b"kv@a@m", 6, 103.0, [removed([2, 3])]),
]


def publish(engine) -> None:
    for topic, seq, ts, events in STREAM:
        engine.send_raw(encode_frames(topic, seq, encode_payload(events, ts)))


def run_stats(engine, *args: str) -> tuple[int, str, str]:
    def send() -> None:
        engine.wait_for()
        publish(engine)

    return run_while(send, "stats", engine.endpoint, "-c", "6", *args)


def test_json_figures_equal_hand_computed(engine):
    rc, out, err = run_stats(engine, "--json")
    assert rc == 0, err
    r = json.loads(out)
    o = r["overall"]
    assert (o["batches"], o["events"], o["workers"], o["blocks_cached"]) == (6, 6, 2, 0)
    assert o["events_by_type"] == {"AllBlocksCleared": 1, "BlockRemoved": 2, "BlockStored": 3}
    assert o["blocks_by_type"] == {"BlockStored": 4, "BlockRemoved": 3}
    a, b = r["workers"]["a[dp0]"], r["workers"]["b[dp0]"]
    assert a["blocks_by_type"] == {"BlockStored": 3, "BlockRemoved": 3}
    assert (a["max_blocks_cached"], a["blocks_cached"], b["max_blocks_cached"], b["cleared"]) == (
        3,
        0,
        1,
        1,
    )
    # lifetimes: 1: 1.2 s, 2: 3.0 s, 3: 2.5 s (engine clock); b's cleared block is no removal
    lt = r["lifetime_s"]
    assert lt["count"] == 3 and lt["p50"] == pytest.approx(2.5)
    assert (lt["min"], lt["max"]) == (pytest.approx(1.2), pytest.approx(3.0))
    assert lt["mean"] == pytest.approx(6.7 / 3) and lt["p90"] == pytest.approx(2.9)
    assert b["lifetime_s"] == {"count": 0}
    assert r["reuse"] == {"hashes_on_multiple_workers": 1, "extra_stores": 1}
    assert r["lora"] == {"ad1": 1, "none": 3}
    assert r["medium"] == {"stored": {"CPU": 1, "GPU": 3}, "removed": {"GPU": 3}}
    pub = r["gaps"]["publishers"][engine.endpoint]
    assert (pub["batches"], pub["gaps"], pub["missing"], pub["last_seq"]) == (6, 1, 1, 6)
    # rates use receive time (not deterministic here), but they account for every event
    assert sum(bucket[1] for bucket in r["rates"]["buckets"]) == 6
    assert r["stream"]["gaps"] == 1 and r["stream"]["stopped_by"] == "--count"


@needs_matplotlib
def test_tables_and_plots(engine, tmp_path):
    plots = tmp_path / "charts"
    rc, out, err = run_stats(engine, "--plot", str(plots))
    assert rc == 0, err
    for text in (
        "kvctl stats: overall",
        "per worker",
        "a[dp0]",
        "b[dp0]",
        "block lifetime",
        "2.50 s",
        "ad1",
        "CPU",
        "sequence per publisher",
    ):
        assert text in out, text
    names = sorted(p.name for p in plots.iterdir())
    assert names == ["lifetimes.png", "occupancy.png", "rates.png"]
    for path in plots.iterdir():
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE, path
        width, height = struct.unpack(">II", data[16:24])  # IHDR
        assert (width, height) == (900, 450)
        assert len(data) > 10_000, f"{path} looks empty ({len(data)} bytes)"
    assert str(plots / "occupancy.png") in err


@needs_matplotlib
def test_plot_on_an_empty_stream_still_writes_charts(engine, tmp_path):
    result = run_main(
        "stats", engine.endpoint, "--idle-timeout", "0.5", "--plot", str(tmp_path), "-q"
    )
    assert result.code == 0, result.err
    assert all(
        (tmp_path / n).read_bytes()[:8] == PNG_SIGNATURE
        for n in ("occupancy.png", "rates.png", "lifetimes.png")
    )


def test_missing_matplotlib_fails_before_reading(tmp_path):
    # nothing listens on this port: the plot check must fail first, not the connection
    result = run_kvctl(
        "stats",
        f"tcp://127.0.0.1:{free_port()}",
        "--plot",
        str(tmp_path),
        env=hidden(tmp_path, "matplotlib"),
    )
    assert result.returncode == 1
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    # a command that works from a checkout too (kvctl[plot] needs kvctl on an index): the
    # plot extra's own requirement
    extra = re.search(r'^plot = \["([^"]+)"\]', (REPO / "pyproject.toml").read_text(), re.M)
    assert extra and f"pip install '{extra.group(1)}'" in lines[0]
    assert "kvctl[plot]" not in lines[0]


@pytest.mark.parametrize(
    "command", [["stats"], ["cat", "--json"], ["check"], ["top", "--json"], ["tap", "-c", "5"]]
)
def test_recordings_read_without_numpy(recording, tmp_path, command):
    # numpy is no dependency: the plain install has none (matplotlib, the plot extra, pulls it in)
    result = run_kvctl(command[0], recording, *command[1:], env=hidden(tmp_path, "numpy"))
    assert result.returncode == 0, result.stderr.decode()[-800:]
    assert b"Traceback" not in result.stderr and result.stdout


@needs_matplotlib
def test_plots_of_a_recording_with_capacity(recording, tmp_path):
    charts = tmp_path / "charts"
    result = run_main("stats", recording, "--num-blocks", "256", "--plot", str(charts), "-q")
    assert result.code == 0, result.err
    for name in ("occupancy.png", "rates.png", "lifetimes.png"):
        data = (charts / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000, name


def test_help_has_example():
    assert "Example:" in run_main("stats", "--help").out
