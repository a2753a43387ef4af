"""Recordings never lose or leak what the user had: recover and record refuse to replace,
delete or mix data they did not write in this run (issue 10)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pytest
from inprocess import run_main

from kvctl.formats import decode_zmq
from kvctl.formats import engine_zmq as ez
from kvctl.recording.reader import open_recording
from kvctl.recording.writer import RecordingWriter


def kvctl(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """Run the command line in-process, as a user types it: (exit code, stdout, stderr)."""
    result = run_main(*map(str, args))
    return result.code, result.out, result.err


def engine_batches(first: int, count: int, recv_ns: int = 1_000) -> list:
    out = []
    for seq in range(first, first + count):
        payload = ez.encode_payload(
            [{"type": "BlockRemoved", "block_hashes": [seq]}], 1.5, 0, "vllm"
        )
        out.append(
            decode_zmq(
                ez.encode_frames(b"", seq, payload), "tcp://127.0.0.1:1", recv_ns=recv_ns + seq
            )
        )
    return out


def write_recording(path: Path, first: int, count: int, **kw) -> None:
    w = RecordingWriter(path, background=False, converter=False, **kw)
    for b in engine_batches(first, count):
        w.write_message(b)
    w.close()


def leave_journal(path: Path, first: int, count: int) -> Path:
    """What a recorder killed with -9 leaves: ``path.journal`` with ``count`` flushed batches
    (written elsewhere and moved, so that ``path`` may already exist)."""
    work = Path(tempfile.mkdtemp(prefix="killed-", dir=path.parent.parent))
    w = RecordingWriter(work / path.name, background=False, converter=False)
    for b in engine_batches(first, count):
        w.write_message(b)
    w.flush()  # never closed: the process "died" here
    journal = path.with_name(path.name + ".journal")
    shutil.copyfile(work / journal.name, journal)
    return journal


def seqs(path: Path) -> list[int]:
    return [b.seq for b in open_recording(path)]


def listing(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_recover_never_replaces_an_existing_recording(tmp_path, capsys):
    path = tmp_path / "x.parquet"
    journal = leave_journal(path, 100, 7)  # the new run, killed
    write_recording(tmp_path / "old" / "x.parquet", 0, 3)
    shutil.copyfile(tmp_path / "old" / "x.parquet", path)  # an earlier run of the same name
    before = listing(tmp_path)

    code, out, err = kvctl(capsys, "recover", path)
    assert code == 1, err
    assert err.count("\n") == 1 and "-o" in err and "Traceback" not in err
    assert listing(tmp_path) == before  # old file intact, journal kept, no temp files
    assert seqs(path) == [0, 1, 2]

    code, out, err = kvctl(capsys, "recover", path, "-o", tmp_path / "y.parquet")
    assert code == 0, err
    assert seqs(tmp_path / "y.parquet") == list(range(100, 107))
    assert not journal.exists() and seqs(path) == [0, 1, 2]
    # -o never replaces either
    journal = leave_journal(path, 200, 2)
    code, _, err = kvctl(capsys, "recover", journal, "-o", tmp_path / "y.parquet")
    assert code == 1 and journal.exists(), err
    assert seqs(tmp_path / "y.parquet") == list(range(100, 107))


def test_recover_finishes_a_conversion_interrupted_before_the_journal_was_removed(tmp_path, capsys):
    path = tmp_path / "x.parquet"
    journal = leave_journal(path, 0, 5)
    saved = journal.read_bytes()
    assert kvctl(capsys, "recover", path)[0] == 0
    journal.write_bytes(saved)  # the crash came between the rename and the unlink
    code, _, err = kvctl(capsys, "recover", path)
    assert code == 0, err
    assert not journal.exists() and seqs(path) == list(range(5))


@pytest.mark.parametrize("content", ["text", "arrow"])
def test_recover_refuses_what_is_not_a_kvctl_journal(tmp_path, capsys, content):
    foreign = tmp_path / "notes.journal"
    if content == "text":
        foreign.write_text("my notes, not a journal\n")
    else:  # a valid Arrow IPC stream another tool wrote
        table = pa.table({"a": [1, 2, 3]})
        with pa.OSFile(str(foreign), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    before = listing(tmp_path)
    for arg in (foreign, tmp_path / "notes"):
        code, _, err = kvctl(capsys, "recover", arg)
        assert code == 1 and "not a kvctl journal" in err, err
        assert err.count("\n") == 1 and listing(tmp_path) == before


def test_recover_of_a_directory_without_a_recording_writes_nothing(tmp_path, capsys):
    (tmp_path / "thesis.tex").write_text("precious")
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    before = listing(tmp_path)
    code, _, err = kvctl(capsys, "recover", tmp_path)
    assert code == 1 and "no kvctl recording" in err, err
    assert listing(tmp_path) == before


def test_record_refuses_an_existing_file_unless_overwrite(tmp_path, capsys):
    source = tmp_path / "in.parquet"
    write_recording(source, 0, 4)
    out = tmp_path / "out.parquet"
    out.write_text("someone's file")
    code, _, err = kvctl(capsys, "record", source, "-o", out, "-q")
    assert code == 2 and "--overwrite" in err and err.count("\n") == 1, err
    assert out.read_text() == "someone's file"
    code, _, err = kvctl(capsys, "record", source, "-o", out, "-q", "--overwrite")
    assert code == 0, err
    assert seqs(out) == [0, 1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet", "out.parquet"]


def test_record_never_truncates_an_unconverted_journal(tmp_path, capsys):
    source = tmp_path / "in.parquet"
    write_recording(source, 0, 4)
    out = tmp_path / "out.parquet"
    journal = leave_journal(out, 50, 3)
    saved = journal.read_bytes()
    for extra in ([], ["--overwrite"]):
        code, _, err = kvctl(capsys, "record", source, "-o", out, "-q", *extra)
        assert code == 2 and "kvctl recover" in err, err
        assert journal.read_bytes() == saved and not out.exists()


def test_record_refuses_a_directory_without_rotation(tmp_path, capsys):
    source = tmp_path / "in.parquet"
    write_recording(source, 0, 2)
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("keep")
    code, _, err = kvctl(capsys, "record", source, "-o", home, "-q")
    assert code == 2 and "is a directory" in err, err
    assert listing(home) == {"notes.txt": b"keep"}


def test_rotation_directory_of_another_run_needs_append(tmp_path, capsys):
    source = tmp_path / "in.parquet"
    write_recording(source, 0, 3)
    later = tmp_path / "later.parquet"
    write_recording(later, 10, 2)
    run = tmp_path / "run"
    assert kvctl(capsys, "record", source, "-o", run, "--rotate-size", "1G", "-q")[0] == 0
    before = listing(run)
    code, _, err = kvctl(capsys, "recover", run)  # complete: its manifest is not rewritten
    assert code == 1 and "no journal to recover" in err and listing(run) == before, err
    code, _, err = kvctl(capsys, "record", later, "-o", run, "--rotate-size", "1G", "-q")
    assert code == 2 and "--append" in err, err
    assert listing(run) == before
    code, _, err = kvctl(
        capsys, "record", later, "-o", run, "--rotate-size", "1G", "-q", "--append"
    )
    assert code == 0, err
    assert seqs(run) == [0, 1, 2, 10, 11]
    import json

    manifest = json.loads((run / "_manifest.json").read_text())
    assert [s["file"] for s in manifest["segments"]] == ["part-00000.parquet", "part-00001.parquet"]
    assert manifest["counts"]["batches"] == 5
    # --append needs rotation; a directory of other files is not a recording to append to
    assert kvctl(capsys, "record", later, "-o", tmp_path / "f.parquet", "--append")[0] == 2
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x")
    code, _, err = kvctl(
        capsys, "record", later, "-o", other, "--rotate-size", "1G", "--append", "-q"
    )
    assert code == 2 and listing(other) == {"x.txt": b"x"}, err


# --- foreign and damaged files (issue 10, item 8) -----------------------------------------------


def reading_commands(path: Path) -> list[list]:
    from conftest import free_port

    return [
        ["cat", path],
        ["cat", path, "--json"],
        ["inspect", path],
        ["inspect", path, "--json"],
        ["check", path],
        ["stats", path],
        ["tap", path],
        ["replay", path, "--to", f"tcp://127.0.0.1:{free_port()}", "--topspeed"],
    ]


def assert_refused(capsys, path: Path, expected: str) -> None:
    for args in reading_commands(path):
        code, out, err = kvctl(capsys, *args)
        assert code == 1, (args, code, out, err)
        # one line says why (commands may announce what they read first), no traceback
        assert sum(expected in line for line in err.splitlines()) == 1, (args, err)
        assert "Traceback" not in err and "events" not in out, (args, err)


def test_a_parquet_file_kvctl_did_not_write_is_refused(tmp_path, capsys):
    import pyarrow.parquet as pq

    foreign = tmp_path / "sales.parquet"
    pq.write_table(pa.table({"region": ["eu", "us"], "amount": [3, 4]}), foreign)
    assert_refused(capsys, foreign, "not a kvctl recording (no kvctl metadata)")
    # the same file among the segments of a recording directory
    run = tmp_path / "run"
    assert kvctl(capsys, "record", _tiny(tmp_path), "-o", run, "--rotate-size", "1G", "-q")[0] == 0
    shutil.copyfile(foreign, run / "part-00007.parquet")
    assert_refused(capsys, run, "part-00007.parquet: not a kvctl recording")


def _tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.parquet"
    if not path.exists():
        write_recording(path, 0, 3)
    return path


def test_a_column_of_the_wrong_type_is_named(tmp_path, capsys):
    import pyarrow.parquet as pq

    good = _tiny(tmp_path)
    table = pq.read_table(good)
    bad = tmp_path / "bad.parquet"
    index = table.schema.get_field_index("seq")
    table = table.set_column(index, "seq", table.column("seq").cast(pa.string()))
    with pq.ParquetWriter(bad, table.schema) as writer:  # kvctl's footer, one column retyped
        writer.write_table(table)
        writer.add_key_value_metadata(
            {"kvctl": pq.ParquetFile(good).metadata.metadata[b"kvctl"].decode()}
        )
    assert_refused(capsys, bad, "column seq has type string, expected uint64")


def test_a_damaged_recording_is_one_line(tmp_path, capsys):
    good = _tiny(tmp_path)
    bad = tmp_path / "torn.parquet"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for args in reading_commands(bad):
        code, out, err = kvctl(capsys, *args)
        assert code == 1 and "Traceback" not in err, (args, err)
        assert sum("cannot read recording" in line for line in err.splitlines()) == 1, err


def test_a_file_that_appears_at_the_output_during_recording_is_not_replaced(
    engine, tmp_path, capsys
):
    from conftest import removed
    from inprocess import Live

    path = tmp_path / "run.parquet"

    def meanwhile(live: Live) -> None:
        assert live.wait_for_stderr("\n").startswith("kvctl: recording")
        engine.wait_for()
        path.write_text("written by someone else meanwhile")
        for i in range(3):
            engine.send([removed([i])])

    result = run_main(
        "record",
        engine.endpoint,
        "-o",
        str(path),
        "--idle-timeout",
        "2",
        timeout=60,
        alongside=meanwhile,
    )
    rc, err = result.code, result.err
    assert rc == 1 and "Traceback" not in err, err
    assert "recover" in err and "-o NEW.parquet" in err, err
    assert path.read_text() == "written by someone else meanwhile"
    journal = tmp_path / "run.parquet.journal"
    assert journal.exists()
    assert not list(tmp_path.glob(".*.tmp")), list(tmp_path.iterdir())
    code, _, err = kvctl(capsys, "recover", path, "-o", tmp_path / "mine.parquet")
    assert code == 0 and not journal.exists(), err
    assert seqs(tmp_path / "mine.parquet") == [0, 1, 2]


@pytest.mark.parametrize("rotate", [[], ["--rotate-size", "1G"]])
def test_recover_leaves_a_running_recorders_journal_alone(engine, tmp_path, capsys, rotate):
    from conftest import finish, read_line, removed, start_kvctl

    path = tmp_path / ("seg" if rotate else "run.parquet")
    proc = start_kvctl("record", engine.endpoint, "-o", str(path), *rotate)
    assert read_line(proc.stderr).startswith("kvctl: recording")
    engine.wait_for()
    engine.send([removed([1])])
    journals: list = []
    deadline = time.monotonic() + 15
    while not journals and time.monotonic() < deadline:  # the first flush is the signal
        journals = (
            list(path.glob(".*.journal"))
            if rotate
            else [j for j in [tmp_path / "run.parquet.journal"] if j.exists()]
        )
        time.sleep(0.05)
    before = {j: j.read_bytes() for j in journals}
    code, _, err = kvctl(capsys, "recover", path)
    assert code == 1 and "running recorder" in err, err
    assert {j: j.read_bytes() for j in journals} == before
    assert not (path / "_manifest.json").exists() if rotate else not path.exists()
    proc.send_signal(signal.SIGINT)
    rc, _, err = finish(proc, timeout=30)
    assert rc == 130, err
    assert [b.events[0]["block_hashes"] for b in open_recording(path)] == [[1]]


def test_a_doctored_row_is_one_line_not_a_traceback(tmp_path, capsys):
    import pyarrow.parquet as pq

    good = _tiny(tmp_path)
    table = pq.read_table(good)
    deep = "[" * 5000 + "]" * 5000  # valid JSON no kvctl writer produces
    index = table.schema.get_field_index("extra")
    table = table.set_column(index, "extra", pa.array([deep] * table.num_rows, pa.string()))
    bad = tmp_path / "doctored.parquet"
    with pq.ParquetWriter(bad, table.schema) as writer:
        writer.write_table(table)
        writer.add_key_value_metadata(
            {"kvctl": pq.ParquetFile(good).metadata.metadata[b"kvctl"].decode()}
        )
    for args in (["cat", bad], ["check", bad], ["tap", bad, "--json"]):
        code, out, err = kvctl(capsys, *args)
        assert code == 1 and "Traceback" not in err, (args, err)
        assert sum("damaged recording" in line for line in err.splitlines()) == 1, (args, err)


def test_recover_quiet_says_nothing_but_errors(tmp_path, capsys):
    path = tmp_path / "x.parquet"
    leave_journal(path, 0, 3)
    assert kvctl(capsys, "recover", path, "-q") == (0, "", "")
    assert seqs(path) == [0, 1, 2]
    code, _, err = kvctl(capsys, "recover", tmp_path / "none.parquet", "-q")
    assert code == 1 and err.startswith("kvctl: "), err


def _children() -> list[str]:
    """Command lines of this process's live children (from /proc: no ps needed)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(cmdline)
    return found


@pytest.mark.skipif(
    not os.access("/proc", os.W_OK), reason="needs /proc to look writable (Linux, as root)"
)
def test_a_journal_that_cannot_be_opened_leaves_no_converter_running():
    """/proc passes record's check that the output's directory is writable, yet no file can
    be made there: the journal fails at the first flush. record exits 1 with one line, and its
    converter process does not outlive it (in-process: nothing left behind)."""
    result = run_main(
        "record", "tcp://127.0.0.1:1", "-o", "/proc/kvctl-test.parquet", "--duration", "0.5"
    )
    assert result.code == 1 and "cannot write" in result.err, result.err
    assert not [c for c in _children() if "kvctl.recording.converter" in c]
