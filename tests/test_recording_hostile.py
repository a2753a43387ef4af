"""No input can ruin a recording (issue 10, item 2): a message holding a value nested far
deeper than any KV event is recorded as Malformed with its raw frames, and the recording and
its journal stay readable by every command."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import msgpack
import pytest
from conftest import removed
from inprocess import run_main, run_while

from kvctl.formats import decode_zmq
from kvctl.recording.writer import RecordingWriter


def deep_payload(levels: int = 500) -> bytes:
    value: object = 1
    for _ in range(levels):
        value = [value]
    event = {
        "type": "BlockStored",
        "block_hashes": [2],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "nested": value,
    }
    return msgpack.packb([1_700_000_000.5, [event], 0])  # ~1 KB


def test_a_deeply_nested_value_is_recorded_as_malformed(engine, tmp_path):
    path = tmp_path / "deep.parquet"
    payload = deep_payload()

    def send() -> None:
        engine.wait_for()
        engine.send([removed([1])])
        engine.send_raw([b"", (1).to_bytes(8, "big"), payload])
        engine.seq = 2
        engine.send([removed([3])])

    rc, _, err = run_while(
        send, "record", engine.endpoint, "-o", str(path), "--idle-timeout", "1.5", timeout=60
    )
    assert rc == 0 and "Traceback" not in err, err
    assert path.exists() and not Path(str(path) + ".journal").exists()
    info = json.loads(run_main("inspect", str(path), "--json").out)
    assert (info["batches"], info["events"], info["malformed"], info["gaps"]) == (3, 2, 1, 0)
    cat = run_main("cat", str(path), "--json")
    assert cat.code == 0 and "nests deeper than" in cat.err, cat.err
    assert [json.loads(x)["block_hashes"] for x in cat.out.splitlines()] == [[1], [3]]
    from kvctl.recording.reader import open_recording

    assert [b.frames[2] for b in open_recording(path) if b.error] == [payload]


@pytest.mark.parametrize("command", [["cat"], ["inspect"], ["check"], ["recover"]])
def test_a_journal_holding_a_deep_value_stays_readable(tmp_path, command):
    payload = deep_payload()
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    w = RecordingWriter(work / "run.parquet", background=False, converter=False)
    for seq, frames in enumerate(
        [msgpack.packb([1.5, [{"type": "AllBlocksCleared"}], 0]), payload]
    ):
        w.write_message(decode_zmq([b"", seq.to_bytes(8, "big"), frames], "tcp://127.0.0.1:1"))
    w.flush()  # the recorder "died" here: only the journal is left
    journal = tmp_path / "run.parquet.journal"
    shutil.copyfile(work / journal.name, journal)
    target = journal if command != ["recover"] else tmp_path / "run.parquet"
    result = run_main(*command, str(target))
    err = result.err
    assert "Traceback" not in err and result.code in (0, 3), err
    if command == ["recover"]:
        assert result.code == 0 and not journal.exists()
        info = json.loads(run_main("inspect", str(target), "--json").out)
        assert (info["batches"], info["events"], info["malformed"]) == (2, 1, 1)
