"""kvctl stats on a small live stream from a real ZMQ publisher: figures equal hand-computed
ones, tables render, --plot writes real PNGs, a missing matplotlib fails fast."""

from __future__ import annotations

import json
import struct

import pytest
from conftest import finish, free_port, removed, run_kvctl, start_kvctl, stored

from kvctl.formats.engine_zmq import encode_frames, encode_payload

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

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
    proc = start_kvctl("stats", engine.endpoint, "-c", "6", *args)
    engine.wait_for()
    publish(engine)
    return finish(proc)


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
    assert (a["max_blocks_cached"], a["blocks_cached"], b["max_blocks_cached"],
            b["cleared"]) == (3, 0, 1, 1)
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


def test_tables_and_plots(engine, tmp_path):
    plots = tmp_path / "charts"
    rc, out, err = run_stats(engine, "--plot", str(plots))
    assert rc == 0, err
    for text in ("kvctl stats: overall", "per worker", "a[dp0]", "b[dp0]", "block lifetime",
                 "2.50 s", "ad1", "CPU", "sequence per publisher"):
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


def test_plot_on_an_empty_stream_still_writes_charts(engine, tmp_path):
    proc = start_kvctl("stats", engine.endpoint, "--idle-timeout", "0.5", "--plot",
                       str(tmp_path), "-q")
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert all((tmp_path / n).read_bytes()[:8] == PNG_SIGNATURE
               for n in ("occupancy.png", "rates.png", "lifetimes.png"))


def test_missing_matplotlib_fails_before_reading(tmp_path):
    # A package named matplotlib that cannot be imported hides the real one.
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    # nothing listens on this port: the plot check must fail first, not the connection
    result = run_kvctl("stats", f"tcp://127.0.0.1:{free_port()}", "--plot", str(tmp_path),
                       env={"PYTHONPATH": str(fake.parent)})
    assert result.returncode == 1
    assert b"pip install 'kvctl[plot]'" in result.stderr
    assert b"connection" not in result.stderr


def test_help_has_example():
    assert "Example:" in run_kvctl("stats", "--help").stdout.decode()
