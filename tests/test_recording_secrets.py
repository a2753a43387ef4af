"""No credential at rest or on screen (issue 10, item 7): a NATS password given as an option
or in the URL never reaches any byte of any file record writes (journal, Parquet, footer),
nor the output of record, recover, inspect or cat."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import NatsServer, finish, read_line, start_kvctl
from inprocess import Live, run_main
from test_tap_nats import publish

from kvctl.formats.dynamo import encode_envelope, router_event
from kvctl.recording.journal import read_journal
from kvctl.redact import redact_argv, redact_url

SECRET = "s3cret"
SUBJECT = "namespace.n.component.c.endpoint.e.kv-events"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory):
    server = NatsServer(tmp_path_factory.mktemp("nats-auth"), "--user", "u", "--pass", SECRET)
    yield server
    server.stop()


def assert_no_secret_in_files(directory: Path) -> None:
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        assert SECRET.encode() not in path.read_bytes(), path
        if path.suffix == ".parquet":  # compressed pages: look at the decoded values too
            pf = pq.ParquetFile(path)
            assert SECRET not in repr(pf.metadata.metadata), path
            assert SECRET not in repr(pf.read().to_pylist()), path


def messages() -> list[tuple[str, bytes]]:
    ev = router_event({"type": "BlockRemoved", "block_hashes": [7]}, 5, 0)
    return [
        (SUBJECT, encode_envelope([ev], 5, 0, 1000)),
        (SUBJECT, b"\xc1 not msgpack"),  # malformed: shown on stderr with its source
        (SUBJECT, encode_envelope([ev], 5, 1, 1001)),
    ]


def check_readers(path: Path) -> None:
    for args in (
        ["inspect", str(path)],
        ["inspect", str(path), "--json"],
        ["cat", str(path), "--json"],
    ):
        result = run_main(*args)
        assert result.code == 0, result.err
        assert SECRET not in result.out + result.err, args


def test_password_option_never_written_or_shown(auth_server, tmp_path):
    out = tmp_path / "rec"
    out.mkdir()
    path = out / "run.parquet"

    def publish_when_recording(live: Live) -> None:
        first = live.wait_for_stderr("\n").partition("\n")[0]
        assert first.startswith("kvctl: recording") and SECRET not in first, first
        publish(f"nats://u:{SECRET}@127.0.0.1:{auth_server.port}", messages())

    result = run_main(
        "record",
        auth_server.url,
        "--nats-user",
        "u",
        "--nats-password",
        SECRET,
        "-o",
        str(path),
        "--idle-timeout",
        "2",
        "--json",
        alongside=publish_when_recording,
    )
    rc, stdout, stderr = result.code, result.out, result.err
    assert rc == 0, stderr
    assert SECRET not in stdout + stderr and "malformed 1" in stderr
    assert_no_secret_in_files(out)
    check_readers(path)


def test_password_in_the_url_never_written_or_shown_even_after_kill_9(auth_server, tmp_path):
    out = tmp_path / "rec"
    out.mkdir()
    path = out / "run.parquet"
    journal = out / "run.parquet.journal"
    url = f"nats://u:{SECRET}@127.0.0.1:{auth_server.port}"
    proc = start_kvctl("record", url, "-o", str(path))
    first = read_line(proc.stderr)
    assert first.startswith("kvctl: recording") and SECRET not in first, first
    publish(url, messages())
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the flushed journal is the readiness signal
        if journal.exists() and sum(rb.num_rows for rb in read_journal(journal)) == 3:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the journal never held the 3 messages")
    os.kill(proc.pid, signal.SIGKILL)
    _, stdout, stderr = finish(proc)
    assert SECRET not in stdout + stderr, stderr
    assert_no_secret_in_files(out)  # the journal, as the crash left it
    result = run_main("recover", str(path), "--json")
    assert result.code == 0, result.err
    assert SECRET not in result.out + result.err
    assert_no_secret_in_files(out)
    check_readers(path)


def test_redaction_functions():
    assert redact_url("nats://u:pw@h:4222") == "nats://u:***@h:4222"
    assert redact_url("1=nats://tok3n@h:4222/subj") == "1=nats://***@h:4222/subj"
    assert redact_url("nats://h:4222?token=abc&x=1") == "nats://h:4222?token=***&x=1"
    assert redact_url("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"
    assert redact_argv(
        [
            "record",
            "nats://u:pw@h",
            "--nats-password",
            "pw",
            "--nats-token=t",
            "--nats-creds",
            "/c.creds",
            "--tls-key",
            "k.pem",
            "-o",
            "x",
        ]
    ) == [
        "record",
        "nats://u:***@h",
        "--nats-password",
        "***",
        "--nats-token=***",
        "--nats-creds",
        "***",
        "--tls-key",
        "***",
        "-o",
        "x",
    ]


@pytest.mark.parametrize("command", ["tap", "check", "bridge"])
def test_a_wrong_password_in_a_source_url_is_not_shown(auth_server, command):
    wrong = "wr0ngpass"
    url = f"nats://u:{wrong}@127.0.0.1:{auth_server.port}"
    extra = ["--to", "tcp://127.0.0.1:0"] if command == "bridge" else []
    result = run_main(command, url, *extra, "--duration", "5", timeout=30)
    err = result.err
    assert result.code == 1, err
    assert wrong not in err + result.out and "Traceback" not in err
    assert "u:***@" in err  # still says which server refused
