"""kvctl index: what a Dynamo KV router believes, served over HTTP as Dynamo's indexer does."""

from __future__ import annotations

import json
import math
import threading
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import KvctlError, UsageError
from ..help import KvctlCommand
from ..options import Sources, filter_options, limit_options, reporting, source_arguments
from ..redact import shown_sources
from ..selection import Filters, Limits
from ..state import RouterIndex

if TYPE_CHECKING:
    from ..events import Batch
    from ..output import Output
    from ..pipeline import Summary

U32_LIMIT = 1 << 32
QUERY_BODY_LIMIT = 8 * 1024 * 1024
"""Dynamo's ``/query`` body limit (a million tokens as JSON text)."""


# --- --until ----------------------------------------------------------------------------------


def parse_until(text: str) -> tuple[str, float]:
    """``seq:N`` -> ("seq", N); ISO-8601 or unix seconds -> ("time", unix seconds)."""
    if text.startswith("seq:"):
        try:
            return "seq", int(text[4:])
        except ValueError:
            raise click.BadParameter(f"{text!r}: seq:N needs an integer N") from None
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise click.BadParameter(f"{text!r} is not a time")
        return "time", seconds
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is neither seq:N, unix seconds nor an ISO-8601 time"
        ) from None
    if moment.tzinfo is None:
        moment = moment.astimezone()  # a time without a zone is local time, as people mean it
    return "time", moment.timestamp()


def until_keeps(until: tuple[str, float] | None, batch: Batch) -> bool:
    """The batches an index ``--until`` is built from: received at or before the time, or
    numbered at most N by their own publisher (a batch without a seq cannot be placed, and is
    kept)."""
    if until is None:
        return True
    kind, limit = until
    if kind == "seq":
        return batch.seq is None or batch.seq <= limit
    return batch.recv_ns / 1e9 <= limit if batch.recv_ns else True


# --- snapshots --------------------------------------------------------------------------------


def load_snapshot(path: Path) -> RouterIndex:
    """An index rebuilt from a ``/dump`` file (kvctl's ``-o`` or Dynamo's own)."""
    try:
        index = RouterIndex.from_dump(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # a DecodeError is a ValueError
        raise KvctlError(f"{path}: not a /dump snapshot: {exc}") from None
    index.sources = dict.fromkeys(index.sources, str(path))
    return index


def is_snapshot(addresses: tuple[str, ...]) -> bool:
    return len(addresses) == 1 and addresses[0].endswith(".json") and Path(addresses[0]).is_file()


# --- the HTTP server --------------------------------------------------------------------------


class Served:
    """The index and the lock that keeps readers from seeing half a batch: the pipeline
    applies a batch under it, a request answers under it."""

    def __init__(self, index: RouterIndex, source_kind: str) -> None:
        self.index = index
        self.lock = threading.Lock()
        self.source_kind = source_kind

    def apply(self, batch: Batch) -> None:
        with self.lock:
            self.index.apply(batch)

    def workers(self) -> list[dict[str, Any]]:
        """``/workers`` as Dynamo lists its registered instances."""
        ix = self.index
        by_id: dict[Any, dict[str, Any]] = {}
        for wid, dp in ix.workers:
            address = ix.sources.get((wid, dp), "")
            entry = by_id.setdefault(
                wid,
                {
                    "instance_id": wid,
                    "source": self.source_kind,
                    "status": "active",
                    "model_name": ix.model_name,
                    "routing_group": ix.routing_group,
                    "block_size": ix.block_size,
                    "endpoints": {},
                    "listeners": {},
                },
            )
            entry["endpoints"][str(dp)] = address
            entry["listeners"][str(dp)] = {"endpoint": address, "status": "active"}
        return list(by_id.values())

    def metrics(self) -> str:
        """Prometheus text: events by decision, blocks per worker and tier, and Dynamo's own
        applied-events counter (device tier, where Dynamo counts an unknown removal as ok)."""
        ix = self.index
        lines = [
            "# HELP kvctl_index_events_applied_total KV events applied to the index, by decision",
            "# TYPE kvctl_index_events_applied_total counter",
        ]
        dynamo: dict[tuple[str, str], int] = {}
        for (etype, tier, status), n in sorted(ix.decisions.items()):
            lines.append(
                "kvctl_index_events_applied_total"
                f"{_labels(event_type=etype, storage_tier=tier, status=status)} {n}"
            )
            if tier == "device":
                key = (etype, "ok" if status == "block_not_found" else status)
                dynamo[key] = dynamo.get(key, 0) + n
        lines += [
            "# HELP kvctl_index_duplicate_stores_total Stores of a block the worker already held",
            "# TYPE kvctl_index_duplicate_stores_total counter",
            f"kvctl_index_duplicate_stores_total {ix.duplicate_stores}",
            "# HELP kvctl_index_blocks Blocks each worker holds in the index",
            "# TYPE kvctl_index_blocks gauge",
        ]
        for ((wid, dp), tier), n in sorted(ix.blocks_per_worker().items(), key=str):
            labels = _labels(worker_id=wid, dp_rank=dp, storage_tier=tier)
            lines.append(f"kvctl_index_blocks{labels} {n}")
        lines += [
            "# HELP dynamo_kvrouter_kv_cache_events_applied Total number of KV cache events "
            "applied to index",
            "# TYPE dynamo_kvrouter_kv_cache_events_applied counter",
        ]
        for (etype, status), n in sorted(dynamo.items()):
            labels = _labels(event_type=etype, status=status)
            lines.append(f"dynamo_kvrouter_kv_cache_events_applied{labels} {n}")
        return "\n".join(lines) + "\n"


def _labels(**labels: Any) -> str:
    def escape(value: Any) -> str:
        return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "}"


def _query_request(body: bytes) -> tuple[int, str, Any]:
    """Validate a ``/query`` body as Dynamo does: (status, content type, parsed or message)."""
    try:
        req = json.loads(body)
    except ValueError as exc:
        return 400, "text/plain", f"Failed to parse the request body as JSON: {exc}"
    bad = "Failed to deserialize the JSON body into the target type: "
    if not isinstance(req, dict):
        return 422, "text/plain", bad + "expected a map"
    for field in ("token_ids", "model_name"):
        if field not in req:
            return 422, "text/plain", bad + f"missing field `{field}`"
    tokens = req["token_ids"]
    if not isinstance(tokens, list) or not all(
        type(t) is int and 0 <= t < U32_LIMIT for t in tokens
    ):
        return 422, "text/plain", bad + "token_ids: expected a sequence of u32"
    for field in ("model_name", "routing_group", "lora_name"):
        value = req.get(field)
        if value is not None and not isinstance(value, str):
            return 422, "text/plain", bad + f"{field}: expected a string"
    if req.get("routing_group") is None:
        req["routing_group"] = "default"
    return 200, "application/json", req


def make_handler(served: Served) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kvctl-index"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # stderr is for kvctl's own lines; an access log is not asked for

        def reply(self, status: int, body: bytes = b"", ctype: str | None = None) -> None:
            self.send_response(status)
            if ctype:
                self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def reply_json(self, status: int, obj: Any) -> None:
            self.reply(status, json.dumps(obj, separators=(",", ":")).encode(), "application/json")

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self.reply(200)
            elif path == "/workers":
                with served.lock:
                    workers = served.workers()
                self.reply_json(200, workers)
            elif path == "/dump":
                with served.lock:
                    dump = served.index.dump()
                self.reply_json(200, dump)
            elif path == "/metrics":
                with served.lock:
                    text = served.metrics()
                self.reply(200, text.encode(), "text/plain; version=0.0.4")
            elif path == "/query":
                self.reply(405)
            else:
                self.reply(404)

        def do_POST(self) -> None:
            if self.path.split("?", 1)[0] != "/query":
                self.reply(405 if self.path in ("/health", "/workers", "/dump") else 404)
                return
            length = int(self.headers.get("content-length") or 0)
            if length > QUERY_BODY_LIMIT:
                self.reply(413, b"length limit exceeded", "text/plain; charset=utf-8")
                return
            body = self.rfile.read(length)
            if "application/json" not in (self.headers.get("content-type") or ""):
                message = b"Expected request with `Content-Type: application/json`"
                self.reply(415, message, "text/plain; charset=utf-8")
                return
            status, ctype, req = _query_request(body)
            if status != 200:
                self.reply(status, req.encode(), ctype + "; charset=utf-8")
                return
            ix = served.index
            if (req["model_name"], req["routing_group"]) != (ix.model_name, ix.routing_group):
                error = (
                    f"no indexer for model={req['model_name']} routing_group={req['routing_group']}"
                )
                self.reply_json(404, {"error": error})
                return
            with served.lock:
                answer = ix.response(ix.query(req["token_ids"], req.get("lora_name")))
            self.reply_json(200, answer)

    return Handler


def start_server(served: Served, host: str, port: int) -> ThreadingHTTPServer:
    try:
        server = ThreadingHTTPServer((host, port), make_handler(served))
    except OSError as exc:
        raise KvctlError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvctl-index-http", daemon=True).start()
    return server


# --- the command ------------------------------------------------------------------------------


@click.command("index", cls=KvctlCommand)
@source_arguments
@filter_options
@limit_options
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Interface the HTTP server binds (0.0.0.0 exposes it).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8090,
    show_default=True,
    help="HTTP port (Dynamo's indexer default; 0 picks a free one, shown on stderr).",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Tokens per block, as the engines' kv_block_size: events of another size are not "
    "indexed, as in Dynamo.",
)
@click.option(
    "--model-name",
    default="default",
    show_default=True,
    help="Model name /query answers for (Dynamo's --model-name).",
)
@click.option(
    "--until",
    metavar="TIME|seq:N",
    callback=lambda ctx, param, value: parse_until(value) if value else None,
    help="Recordings: the index as it stood then: batches received at or before TIME "
    "(ISO-8601 or unix seconds), or numbered at most N by their own publisher.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the index as a /dump JSON snapshot here and exit instead of serving.",
)
@click.option("--overwrite", is_flag=True, help="With -o: replace an existing snapshot file.")
@reporting("No progress or summary on stderr.")
def command(
    sources: Sources, selection: Filters, limits: Limits, out: Output, **params: Any
) -> None:
    """Build the prefix index a Dynamo KV router would hold and serve it over HTTP.

    The same endpoints, requests and responses as Dynamo 1.6's standalone indexer (python -m
    dynamo.indexer), so tools written for it work unchanged: GET /health, GET /workers, GET
    /dump (RouterEvents that rebuild the index), POST /query ({"token_ids": [...],
    "model_name": ..., optional "lora_name"} -> matched tokens per worker and dp rank, and
    per tier: gpu, cpu, disk), plus GET /metrics (Prometheus text: events by decision, blocks
    per worker and tier). Query tokens are hashed as Dynamo does (xxh3_64, seed 1337, LoRA
    seeded) in blocks of --block-size; the index makes Dynamo's decisions (README: kvctl
    index). SOURCEs are live streams (ZMQ, NATS: every format tap reads; the index keeps
    updating while it serves), recordings (read to the end, or --until), or one /dump
    snapshot (.json) to serve. Label ZMQ sources WORKER[:DP]=tcp://... as Dynamo's --workers
    does. The server runs until Ctrl-C (exit 130); with -o the snapshot is written and the
    command exits 0.

    \b
    Example:
      kvctl index 0=tcp://127.0.0.1:5557 1=tcp://127.0.0.1:5558 --port 8090
      curl -s localhost:8090/query -H content-type:application/json \\
        -d '{"token_ids": [1,2,3], "model_name": "default"}'
      kvctl index run.parquet --until seq:1200 -o snapshot.json
      kvctl index snapshot.json --port 8091 --json
    """
    from ..pipeline import Summary
    from ..session import on_interrupt, read

    until: tuple[str, float] | None = params["until"]
    output: Path | None = params["output"]
    snapshot = is_snapshot(sources.addresses)
    if snapshot:
        index = load_snapshot(Path(sources.addresses[0]))
        kind = "snapshot"
    else:
        index = RouterIndex(params["block_size"], params["model_name"])
        kind = _kind(sources.addresses)
    if until is not None and kind != "recording":
        raise UsageError("--until reads recordings (files or segment directories) only")
    if output is not None and output.exists() and not params["overwrite"]:
        raise UsageError(f"{output} exists (--overwrite replaces it)")
    served = Served(index, kind)
    server = None
    if output is None:
        server = start_server(served, params["host"], params["port"])
        url = f"http://{params['host']}:{server.server_port}"
        if out.as_json:
            out.json({"serving": url, "model": index.model_key, "block_size": index.block_size})
        out.say(f"kvctl: serving {index.model_key} on {url}", "dim")
    summary = Summary()
    try:
        if not snapshot:
            out.say(f"kvctl: reading {shown_sources(sources.addresses)}", "dim")

            def consume(batch: Batch) -> None:
                if until_keeps(until, batch):
                    served.apply(batch)

            on_interrupt(lambda: _closing(summary), out.quiet)
            read(sources, selection, limits, out, summary, consume)
        status = _status(index, summary if not snapshot else None)
        if out.as_json:
            out.json({"indexed": status})
        out.say(
            f"kvctl: indexed {status['blocks']:,} blocks of {len(status['workers'])} workers"
            + (f"; {summary.line()}" if not snapshot else ""),
            "dim",
        )
        if output is not None:
            _write_snapshot(output, index)
            out.say(f"kvctl: wrote {output}", "dim")
            return
        on_interrupt(lambda: "kvctl: stopped serving", out.quiet)
        threading.Event().wait()  # serve until Ctrl-C or SIGTERM
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


def _kind(addresses: tuple[str, ...]) -> str:
    """What ``/workers`` calls the sources (Dynamo's indexer: ``zmq``)."""
    schemes = {a.rpartition("=")[2].partition("://")[0] for a in addresses}
    if schemes <= {"tcp", "ipc"}:
        return "zmq"
    if schemes == {"nats"}:
        return "nats"
    return "recording" if all(Path(a).exists() for a in addresses) else "stream"


def _closing(summary: Summary) -> str:
    summary.stopped_by = "interrupt"
    return f"kvctl: {summary.line()}"


def _status(index: RouterIndex, summary: Summary | None) -> dict[str, Any]:
    blocks = index.blocks_per_worker()
    return {
        "model": index.model_key,
        "block_size": index.block_size,
        "workers": [f"{w}:{dp}" for w, dp in index.workers],
        "blocks": sum(blocks.values()),
        "decisions": {"/".join(k): n for k, n in sorted(index.decisions.items())},
        "duplicate_stores": index.duplicate_stores,
        "batches": summary.batches if summary is not None else None,
    }


def _write_snapshot(path: Path, index: RouterIndex) -> None:
    """Through a temporary file and a rename: a reader never sees half a snapshot."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(index.dump(), separators=(",", ":")))
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise KvctlError(f"cannot write {path}: {exc.strerror or exc}") from None
