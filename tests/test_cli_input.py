"""Option input as a user gives it: environment variables, help, completion, plurals and
piped tables, through ``kvctl`` as typed (in-process, not a terminal)."""

from __future__ import annotations

import os

import pytest
from inprocess import run_main


@pytest.mark.parametrize(
    "variable,value,args,message",
    [
        ("KVCTL_TAP_COUNT", "abc", ["tap", "tcp://127.0.0.1:1"], "'abc' is not a valid integer"),
        ("KVCTL_SIMULATE_WORKERS", "0", ["simulate"], "0 is not in the range x>=1"),
        ("KVCTL_TAP_AS_JSON", "maybe", ["tap", "tcp://127.0.0.1:1"], "'maybe' is not a valid bool"),
        ("KVCTL_NATS_CREDS", ".", ["tap", "nats://127.0.0.1:1"], "'.' is a directory"),
    ],
)
def test_invalid_environment_variable_is_named(variable, value, args, message):
    result = run_main(*args, env={variable: value})
    assert result.code == 2
    assert result.err.splitlines() == [result.err.strip()], result.err  # one line
    assert result.err.startswith(f"kvctl: {variable}: ") and message in result.err, result.err


def test_invalid_option_on_the_command_line_still_names_the_option():
    result = run_main("tap", "tcp://127.0.0.1:1", "-c", "abc")
    assert result.code == 2 and "'-c' / '--count'" in result.err and "KVCTL_" not in result.err


LONG_SOURCE = "tcp://" + "very-long-engine-host-name-" * 4 + "0.example.internal:5557"
LONG_WORKER = "worker-" + "with-a-long-pod-label-" * 4 + "[0]"


@pytest.fixture
def long_named_recording(tmp_path) -> str:
    from kvctl.events import Batch
    from kvctl.recording.writer import RecordingWriter

    path = str(tmp_path / "long.parquet")
    writer = RecordingWriter(path)
    writer.write(
        Batch(
            source=LONG_SOURCE,
            publisher=LONG_SOURCE,
            worker_id=LONG_WORKER,
            format="engine-map",
            seq=0,
            ts=1.0,
            recv_ns=1,
            events=[{"type": "BlockRemoved", "block_hashes": [1]}],
        )
    )
    writer.close()
    return path


def test_inspect_tables_keep_long_values_when_piped(long_named_recording):
    result = run_main("inspect", long_named_recording)
    assert result.code == 0, result.err
    assert LONG_SOURCE in result.out and LONG_WORKER in result.out  # markup escaped, not cut
    assert "…" not in result.out
    assert "1 batch, 1 event, 0 malformed, 0 gaps (0 batches missing)" in result.out
    assert ", 1 file\n" in result.out


def test_simulate_summary_table_is_not_cut_when_piped(tmp_path):
    result = run_main(
        "simulate",
        "-o",
        str(tmp_path / "s.parquet"),
        "--workers",
        "12",
        "--requests",
        "30",
        "--num-blocks",
        "123456789",
    )
    assert result.code == 0, result.err
    table_rows = [line for line in result.err.splitlines() if line.startswith("│")]
    assert len(table_rows) == 13  # 12 workers and the total, one line each
    assert all("/123456789 " in row for row in table_rows[:12]), result.err
    assert "/1481481468 " in table_rows[-1] and "…" not in result.err
    assert "kvctl: 12 workers recording to" in result.err


def test_one_of_a_kind_is_singular(tmp_path):
    """`1 batch`, `1 event`, `1 worker`: counts of one read as English in summaries."""
    out = tmp_path / "one.parquet"
    result = run_main("simulate", "-o", str(out), "--workers", "1", "--requests", "1")
    assert result.code == 0 and "kvctl: 1 worker recording to" in result.err, result.err
    result = run_main("tap", str(out), "-c", "1")
    assert result.code == 0, result.err
    assert (
        "kvctl: 1 event (BlockStored 1) in 1 batch from 1 publisher; gaps 0 (0 batches "
        "missing" in result.err
    ), result.err


def test_bash_completion_completes_lazy_subcommands_and_options(tmp_path):
    """The README's `eval "$(_KVCTL_COMPLETE=bash_source kvctl)"`, in a real bash: subcommands
    (imported lazily) and each command's options and choices complete."""
    import shutil
    import subprocess
    import sys

    from conftest import REPO

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    (tmp_path / "kvctl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvctl "$@"\n')
    (tmp_path / "kvctl").chmod(0o755)

    def complete(*words: str) -> list[str]:
        script = (
            'eval "$(_KVCTL_COMPLETE=bash_source kvctl)"; COMP_WORDS=('
            + " ".join(f"'{w}'" for w in words)
            + f"); COMP_CWORD={len(words) - 1}; "
            '_kvctl_completion kvctl; printf "%s\\n" "${COMPREPLY[@]}"'
        )
        result = subprocess.run(
            [bash, "-c", script],
            capture_output=True,
            timeout=30,
            cwd=REPO,
            env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"},
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.decode().split()

    assert complete("kvctl", "t") == ["tap", "top"]
    assert "--idle-timeout" in complete("kvctl", "tap", "--id")
    assert complete("kvctl", "tap", "--type", "") == [
        "blockstored",
        "blockremoved",
        "allblockscleared",
    ]


@pytest.mark.parametrize(
    "args,message",
    [
        (["tap", "tcp://127.0.0.1:1", "-c", "abc"], "Invalid value for '-c' / '--count'"),
        (["tap", "--no-such-option"], "No such option '--no-such-option'"),
        (["tap"], "Missing argument 'SOURCE...'"),
        (["no-such-command"], "No such command 'no-such-command'"),
    ],
)
def test_usage_error_is_one_kvctl_line(args, message):
    """Like every other diagnostic: one line starting ``kvctl: ``, naming the help to read."""
    result = run_main(*args)
    assert result.code == 2
    assert result.err.splitlines() == [result.err.strip()], result.err  # one line
    assert result.err.startswith(f"kvctl: {message}") and "--help" in result.err, result.err


def test_bare_kvctl_shows_the_help():
    result = run_main()
    assert result.code == 2 and "Commands:" in result.err and "tap" in result.err
