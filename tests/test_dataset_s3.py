"""Datasets on S3 (`kvctl record nats://... --stream NAME -o s3://bucket/prefix`), end to end
against a local S3 server (moto's server mode, tests/conftest.py): segments appear only
complete, a recorder resumes from what the bucket lists, every reading command reads the S3
dataset as it reads the same dataset downloaded, and failures are one line, bounded in time,
with nothing acked that is not stored."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from conftest import S3Server, free_port
from inprocess import run_main
from test_cmd_replay import subscriber
from test_record_stream import init_stream, publish, stream_name, stream_seqs_on_disk, workload

from kvctl.recording.dataset import Segment

_prefixes = iter(range(10**6))


def prefix() -> str:
    return f"ds{os.getpid()}-{next(_prefixes)}"


def objects(fs: pafs.FileSystem, root: str) -> list[pafs.FileInfo]:
    """Every object under ``root`` (S3 lists objects; its "directories" are key prefixes)."""
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return [i for i in infos if i.type == pafs.FileType.File]


def download(fs: pafs.FileSystem, root: str, to: Path) -> Path:
    for info in objects(fs, root):
        target = to / info.path[len(root) :].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(info.path) as src:
            target.write_bytes(src.read())
    return to


def record_s3(url: str, stream: str, location: str, *extra: str) -> Any:
    return run_main(
        "record", url, "--stream", stream, "-o", location, "--idle-timeout", "1.5", *extra
    )


@pytest.fixture(scope="module")
def s3_env(s3_server) -> Iterator[S3Server]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.env.items():
            mp.setenv(key, value)
        yield s3_server


@pytest.fixture(scope="module")
def recorded(s3_env, nats_server, tmp_path_factory) -> dict[str, Any]:
    """A hive dataset recorded into S3 in two runs (the second resumes), and its download."""
    name = stream_name()
    layout = init_stream(nats_server.url, name, 2)
    seqs = publish(nats_server.url, layout, workload(workers=4, per_worker=60))
    where = prefix()
    location = s3_env.url(where)
    first = record_s3(
        nats_server.url, name, location, "--layout", "hive", "--rotate-size", "8K", "--json"
    )
    assert first.code == 0, first.err
    more = publish(nats_server.url, layout, workload(workers=4, per_worker=20, start_seq=100))
    second = record_s3(nats_server.url, name, location, "--layout", "hive", "--json")
    assert second.code == 0, second.err
    root = f"{s3_env.BUCKET}/{where}"
    local = download(s3_env.filesystem, root, tmp_path_factory.mktemp("s3copy"))
    return {
        "name": name,
        "location": location,
        "root": root,
        "local": local,
        "seqs": seqs,
        "more": more,
        "runs": [json.loads(r.out)["summary"] for r in (first, second)],
    }


# --- 1. the recorder writes into S3 ------------------------------------------------------------


def test_segments_appear_only_complete_with_the_local_names_and_footers(s3_env, recorded):
    listed = objects(s3_env.filesystem, recorded["root"])
    assert len(listed) >= 4
    for info in listed:
        relative = info.path[len(recorded["root"]) :].lstrip("/")
        # no temp object, no directory marker: segments only, in hive directories
        parts = relative.split("/")
        assert len(parts) == 4 and parts[0].startswith("dt=") and parts[1].startswith("hour=")
        segment = Segment.parse(parts[3])
        assert segment is not None and parts[2] == f"part={segment.partition:02d}"
        assert not any(p.startswith((".", "_")) for p in parts)
    everything = recorded["seqs"] | recorded["more"]
    on_s3 = stream_seqs_on_disk(recorded["local"], recorded["name"], everything)
    assert sorted(on_s3) == sorted(everything)  # zero loss, zero duplicates, tiled, footers
    first, second = recorded["runs"]
    assert first["messages"] == len(recorded["seqs"]) and first["segments"] >= 4
    # the second run resumed from the segments S3 lists: only the new messages
    assert second["messages"] == len(recorded["more"])
    assert second["skipped_already_recorded"] == 0
    assert second["committed_through"] == {
        str(p): max(s for s, q in everything.items() if q == p) for p in (0, 1)
    }


def test_the_same_messages_make_the_same_segments_on_s3_as_on_disk(s3_env, nats_server, tmp_path):
    """One workload into two streams, one recorded into S3, the other into a directory: the
    same paths (the stream's name aside), footers and rows."""
    items = workload(workers=3, per_worker=30)
    names = stream_name(), stream_name()
    for name in names:
        publish(nats_server.url, init_stream(nats_server.url, name, 2), items)
    where = prefix()
    options = ("--layout", "hive", "--rotate-size", "4K")
    assert record_s3(nats_server.url, names[0], s3_env.url(where), *options).code == 0
    assert record_s3(nats_server.url, names[1], str(tmp_path / "disk"), *options).code == 0
    on_s3 = download(s3_env.filesystem, f"{s3_env.BUCKET}/{where}", tmp_path / "s3")

    def segments(root: Path, name: str) -> dict[str, Any]:
        out = {}
        for path in sorted(root.rglob("*.parquet")):
            meta = json.loads(pq.read_metadata(path).metadata[b"kvctl"])
            for varying in ("stream", "recorder", "command"):
                meta.pop(varying)
            rows = pq.read_table(path).to_pylist()
            out[path.relative_to(root).as_posix().replace(name, "STREAM")] = (meta, rows)
        return out

    assert segments(on_s3, names[0]) == segments(tmp_path / "disk", names[1])
    assert len(segments(on_s3, names[0])) >= 4


def test_kill_9_leaves_no_partial_object_and_a_restart_records_everything_once(
    s3_env, nats_server, tmp_path
):
    name = stream_name()
    layout = init_stream(nats_server.url, name, 2)
    seqs = publish(nats_server.url, layout, workload(workers=4, per_worker=300))
    where = prefix()
    root = f"{s3_env.BUCKET}/{where}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvctl", "record", nats_server.url, "--stream", name]
        + ["-o", s3_env.url(where), "--rotate-size", "8K", "--idle-timeout", "20"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, **s3_env.env},
    )
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(objects(s3_env.filesystem, root)) < 4:
            time.sleep(0.05)  # objects appearing in the bucket are the only sign of progress
        assert len(objects(s3_env.filesystem, root)) >= 4, "no segments were written"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the segment writer process too, mid-upload
        proc.wait(10)
    # every object there is a whole segment: its Parquet footer reads, its rows are all there
    for info in objects(s3_env.filesystem, root):
        with s3_env.filesystem.open_input_file(info.path) as f:
            meta = pq.ParquetFile(f).metadata
            assert b"kvctl" in meta.metadata and meta.num_rows > 0
    result = record_s3(nats_server.url, name, s3_env.url(where), "--json")
    assert result.code == 0, result.err
    local = download(s3_env.filesystem, root, tmp_path / "copy")
    on_s3 = stream_seqs_on_disk(local, name, seqs)
    assert sorted(on_s3) == sorted(seqs) and len(on_s3) == len(set(on_s3))


_HALF_UPLOAD = """
import sys, time
from kvctl.recording.dataset import open_root
fs, root = open_root(sys.argv[1])
stream = fs.open_output_stream(root + "/" + sys.argv[2])
stream.write(b"x" * int(sys.argv[3]))  # past one part: a multipart upload is under way
stream.flush()
print("written", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("size", [1_000, 12_000_000], ids=["one request", "multipart"])
def test_an_upload_killed_halfway_leaves_no_object(s3_env, size):
    """What pyarrow's S3 output stream leaves when its process is killed before close: no
    object, whether the file fits one request (sent at close) or not (a multipart upload,
    which S3 makes an object of only once completed)."""
    where = prefix()
    proc = subprocess.Popen(
        [sys.executable, "-c", _HALF_UPLOAD, s3_env.url(where), "seg.parquet", str(size)],
        stdout=subprocess.PIPE,
        env={**os.environ, **s3_env.env},
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"written\n"
    finally:
        proc.kill()
        proc.wait(10)
    assert objects(s3_env.filesystem, f"{s3_env.BUCKET}/{where}") == []
    # what stays: an incomplete multipart upload (invisible; a lifecycle rule aborts it)
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=s3_env.endpoint,
        aws_access_key_id="kvctl",
        aws_secret_access_key="kvctl",
        region_name="us-east-1",
    )
    uploads = s3.list_multipart_uploads(Bucket=s3_env.BUCKET, Prefix=where).get("Uploads", [])
    assert len(uploads) == (1 if size > 10_000_000 else 0)


# --- 2. every reading command reads the S3 dataset ----------------------------------------------


def run_ok(*args: str) -> str:
    result = run_main(*args)
    assert result.code == 0, result.err
    return result.out


def same_paths(text: str, recorded: dict[str, Any]) -> str:
    """The output with the dataset's location and its files' paths made the same."""
    return (
        text.replace(recorded["location"], "DATASET")
        .replace(recorded["root"], "DATASET")
        .replace(str(recorded["local"]), "DATASET")
    )


@pytest.mark.parametrize(
    "args",
    [
        ("cat", "--json"),
        ("inspect", "--json"),
        ("stats", "--json"),
        ("check", "--json"),
        ("check", "--partition", "1/2", "--json"),
        ("top", "--json"),
    ],
    ids=lambda a: " ".join(a),
)
def test_a_reading_command_says_on_s3_what_it_says_on_the_download(s3_env, recorded, args):
    command, *options = args
    s3_run = run_main(command, recorded["location"], *options)
    local_run = run_main(command, str(recorded["local"]), *options)
    # check exits 3: the synthetic workload's stores name parents no worker cached
    assert s3_run.code == local_run.code == (3 if command == "check" else 0), s3_run.err
    on_s3, local = s3_run.out, local_run.out
    if command in ("stats", "check"):  # their timing aside
        on_s3, local = (json.loads(same_paths(t, recorded)) for t in (on_s3, local))
        for report in (on_s3, local):
            report.get("stream", {}).pop("elapsed_s", None)
    elif command == "top":  # its last frame's table, wall-clock rates aside
        keep = ("worker", "blocks_cached", "last_seq", "gaps", "batches", "events")
        on_s3, local = (
            [{k: w[k] for k in keep} for w in json.loads(t.splitlines()[-1])["workers"]]
            for t in (on_s3, local)
        )
    elif command != "cat":
        on_s3, local = same_paths(on_s3, recorded), same_paths(local, recorded)
    assert on_s3 == local
    assert on_s3
    assert same_paths(s3_run.err, recorded) == same_paths(local_run.err, recorded)


def test_index_builds_the_same_snapshot_from_s3(s3_env, recorded, tmp_path):
    run_ok("index", recorded["location"], "-o", str(tmp_path / "s3.json"))
    run_ok("index", str(recorded["local"]), "-o", str(tmp_path / "local.json"))
    snapshot = json.loads((tmp_path / "s3.json").read_text())
    assert snapshot == json.loads((tmp_path / "local.json").read_text()) and snapshot


def sent(source: str, count: int, *options: str) -> tuple[list[list[bytes]], str]:
    to = f"tcp://127.0.0.1:{free_port()}"
    received, receive = subscriber(to, count)
    result = run_main(
        "replay",
        source,
        "--to",
        to,
        "--wait-subscribers",
        "1",
        "--topspeed",
        *options,
        alongside=receive,
    )
    assert result.code == 0, result.err
    assert len(received) == count
    return [frames[1:] for frames in received], result.err


def test_replay_sends_from_s3_what_it_sends_from_the_download(
    s3_env, recorded, tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    count = len(recorded["seqs"]) + len(recorded["more"])
    local, _ = sent(str(recorded["local"]), count, "--no-cache")
    assert sent(recorded["location"], count, "--no-cache")[0] == local
    # the frames cache of an S3 dataset: in the per-user cache, keyed by the S3 listing
    assert sent(recorded["location"], count)[0] == local
    caches = list((tmp_path / "cache" / "kvctl" / "frames").iterdir())
    assert len(caches) == 1 and caches[0].name.endswith(".kvctl-frames")
    built = caches[0].stat().st_mtime_ns
    assert sent(recorded["location"], count)[0] == local  # read from the cache
    assert caches[0].stat().st_mtime_ns == built
    prepared = json.loads(run_ok("replay", "--prepare", recorded["location"], "--json"))
    assert prepared["built"] is False and prepared["cache"] == str(caches[0])


def test_duckdb_reads_the_s3_dataset(s3_env, recorded):
    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    try:
        con.execute("LOAD httpfs")
    except duckdb.Error as exc:  # not bundled; installing it needs the internet
        reason = str(exc).splitlines()[0]
        pytest.skip(
            f"DuckDB's httpfs extension is not installed, and needs the internet ({reason})"
        )
    endpoint = s3_env.env["AWS_ENDPOINT_URL"].removeprefix("http://")
    con.execute(
        f"CREATE SECRET (TYPE s3, KEY_ID 'kvctl', SECRET 'kvctl', REGION 'us-east-1', "
        f"ENDPOINT '{endpoint}', URL_STYLE 'path', USE_SSL false)"
    )
    query = "select count(*), sum(seq) from read_parquet('{}')"
    on_s3 = con.execute(query.format(recorded["location"] + "/**/*.parquet")).fetchall()
    local = con.execute(query.format(str(recorded["local"]) + "/**/*.parquet")).fetchall()
    assert on_s3 == local


# --- 3. failures --------------------------------------------------------------------------------


def one_line_error(result: Any, *needles: str) -> str:
    assert result.code == 1, (result.code, result.err)
    line = result.err.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, result.err
    for needle in needles:
        assert needle in line, line
    return line


@pytest.mark.parametrize("command", ["cat", "inspect", "check", "replay", "record"])
def test_an_unknown_bucket_is_one_line(s3_env, nats_server, command):
    location = "s3://kvctl-no-such-bucket/fleet"
    if command == "record":
        name = stream_name()
        init_stream(nats_server.url, name, 1)
        result = record_s3(nats_server.url, name, location)
    elif command == "replay":
        result = run_main("replay", location, "--to", f"tcp://127.0.0.1:{free_port()}", "-q")
    else:
        result = run_main(command, location, *(() if command == "inspect" else ("-q",)))
    one_line_error(result, location, "bucket kvctl-no-such-bucket does not exist")


@pytest.mark.parametrize("command", ["cat", "record"])
def test_an_unreachable_endpoint_fails_in_bounded_time(s3_env, nats_server, monkeypatch, command):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # a closed port
    location = s3_env.url(prefix())
    started = time.monotonic()
    if command == "record":
        name = stream_name()
        layout = init_stream(nats_server.url, name, 1)
        seqs = publish(nats_server.url, layout, workload(workers=1, per_worker=3))
        result = record_s3(nats_server.url, name, location)
    else:
        result = run_main(command, location, "-q")
    assert time.monotonic() - started < 15
    one_line_error(result, location, "cannot reach the S3 endpoint")
    if command == "record":  # nothing was acked: the stream keeps every message
        s3_env_restored = {**os.environ, "AWS_ENDPOINT_URL": s3_env.env["AWS_ENDPOINT_URL"]}
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env_restored["AWS_ENDPOINT_URL"])
        again = record_s3(nats_server.url, name, location, "--json")
        assert again.code == 0, again.err
        assert json.loads(again.out)["summary"]["messages"] == len(seqs)


class AuthServer(S3Server):
    """A moto server that checks credentials (moto's IAM auth, on after the first requests:
    a user and its key made with those)."""

    def __init__(self) -> None:
        os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "4"
        try:
            super().__init__()  # the bucket: two requests
        finally:
            del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            aws_access_key_id="kvctl",
            aws_secret_access_key="kvctl",
            region_name="us-east-1",
        )
        iam.create_user(UserName="kvctl")
        key = iam.create_access_key(UserName="kvctl")["AccessKey"]
        self.env = {
            **self.env,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }


@pytest.mark.parametrize("command", ["cat", "record"])
def test_wrong_credentials_are_one_line_without_the_secret(nats_server, monkeypatch, command):
    server = AuthServer()
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-zzz")
        location = server.url(prefix())
        if command == "record":
            name = stream_name()
            init_stream(nats_server.url, name, 1)
            result = record_s3(nats_server.url, name, location)
        else:
            result = run_main(command, location, "-q")
        line = one_line_error(result, location, "access denied")
        assert "not-the-secret-zzz" not in line
        # a secret given in the URL is masked too
        shown = server.url(prefix()).replace("s3://", "s3://AKID:url-secret-zzz@")
        result = run_main("cat", shown, "-q")
        line = one_line_error(result)
        assert "url-secret-zzz" not in line and "s3://AKID:***@" in line
    finally:
        server.stop()


class Relay:
    """A TCP relay in front of an S3 server: stopping it is the server going away for the
    recorder (connections cut, the port closed), while the server keeps its objects."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.start()

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            upstream.settimeout(None)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        assert self.listener is not None
        self.listener.close()
        with self.lock:
            for s in self.conns:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            self.conns = []


def test_s3_going_away_mid_run_stops_the_recorder_and_a_restart_records_everything_once(
    nats_server, tmp_path, monkeypatch
):
    server = S3Server()  # our own: the relay in front of it goes away, not the session's
    relay = Relay(server.port)
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{relay.port}")
        name = stream_name()
        layout = init_stream(nats_server.url, name, 2)
        seqs = publish(nats_server.url, layout, workload(workers=4, per_worker=100))
        where = prefix()
        root = f"{server.BUCKET}/{where}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "record", nats_server.url, "--stream", name]
            + ["-o", server.url(where), "--rotate-size", "8K", "--rotate-every", "1"]
            + ["--idle-timeout", "20"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ),
        )
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(objects(server.filesystem, root)) < 2:
                time.sleep(0.05)
            relay.stop()  # S3 goes away while messages keep coming
            seqs |= publish(nats_server.url, layout, workload(4, 50, start_seq=1000))
            _, err = proc.communicate(timeout=25)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == 1, err
        line = err.decode().strip().splitlines()[-1]
        assert "cannot reach the S3 endpoint" in line and server.url(where) in line
        assert "nothing unwritten was acked" in line and "Traceback" not in err.decode()
        relay.start()  # S3 is back
        result = record_s3(nats_server.url, name, server.url(where), "--json")
        assert result.code == 0, result.err
        local = download(server.filesystem, root, tmp_path / "copy")
        on_s3 = stream_seqs_on_disk(local, name, seqs)
        assert sorted(on_s3) == sorted(seqs) and len(on_s3) == len(set(on_s3))
    finally:
        relay.stop()
        server.stop()


def test_s3_requests_are_bounded_and_uploads_single_request_when_small():
    """What open_root gives pyarrow (a pyarrow that changed its options would silently lose
    them: kvctl falls back to its defaults)."""
    from kvctl.recording.dataset import S3_CONNECT_TIMEOUT, S3_REQUEST_TIMEOUT, open_root

    fs, root = open_root("s3://bucket/some/prefix/?endpoint_override=http://127.0.0.1:1")
    options = fs.__reduce__()[1][0]
    assert root == "bucket/some/prefix"
    assert options["connect_timeout"] == S3_CONNECT_TIMEOUT
    assert options["request_timeout"] == S3_REQUEST_TIMEOUT
    assert options["allow_delayed_open"] is True
    assert options["endpoint_override"] == "http://127.0.0.1:1"
