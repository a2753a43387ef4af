"""The router's index as kvctl keeps, serves and asks it: ``/dump`` snapshots, the HTTP server
with Dynamo 1.6's standalone-indexer endpoints, and, for ``kvctl query``, the overlaps of a
prompt from an index built from SOURCEs or from a running index (Dynamo's or kvctl's) over
HTTP. Shared by
``kvctl index`` (which serves it) and ``kvctl query`` (which asks it directly)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import KvctlError, TransportError, UsageError
from .events import DEFAULT_BLOCK_SIZE
from .redact import redact_url
from .routing import Overlap, WorkerKey, worker_order
from .state import DISK, EXTERNAL, HOST, RouterIndex

if TYPE_CHECKING:
    from .events import Batch
    from .output import Output
    from .selection import Limits, Until
    from .state import Overlap as IndexOverlap

U32_LIMIT = 1 << 32
QUERY_BODY_LIMIT = 8 * 1024 * 1024
"""Dynamo's ``/query`` body limit (a million tokens as JSON text)."""


# --- snapshots --------------------------------------------------------------------------------


def load_snapshot(path: Path) -> RouterIndex:
    """An index rebuilt from a ``/dump`` file (kvctl's ``-o`` or Dynamo's own)."""
    try:
        index = RouterIndex.from_dump(read_dump(path))
    except ValueError as exc:
        raise KvctlError(f"{path}: not a /dump snapshot: {exc}") from None
    index.sources = dict.fromkeys(index.sources, str(path))
    return index


def read_dump(path: Path) -> Any:
    """A ``/dump`` document saved in a file (``kvctl index -o``, or Dynamo's ``/dump`` saved)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise KvctlError(f"{path}: not a /dump snapshot: {reason}") from None


def is_snapshot(addresses: tuple[str, ...]) -> bool:
    return len(addresses) == 1 and addresses[0].endswith(".json") and Path(addresses[0]).is_file()


def write_snapshot(path: Path, index: RouterIndex) -> None:
    """Through a temporary file and a rename: a reader never sees half a snapshot."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(index.dump(), separators=(",", ":")))
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise KvctlError(f"cannot write {path}: {exc.strerror or exc}") from None


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


def _query_body_type() -> Any:
    """The ``/query`` body as msgspec decodes and checks it in one pass: a 32k-token prompt
    takes ~0.3 ms there, ~4 ms through ``json`` and a Python loop over the tokens."""
    from typing import Annotated

    import msgspec

    u32 = Annotated[int, msgspec.Meta(ge=0, lt=U32_LIMIT)]
    fields: list[Any] = [
        ("token_ids", list[u32]),
        ("model_name", str | None),
        ("routing_group", str | None, None),
        ("lora_name", str | None, None),
    ]
    return msgspec.json.Decoder(msgspec.defstruct("QueryBody", fields))


_query_body: Any = None


def query_request(body: bytes) -> tuple[int, str, Any]:
    """Validate a ``/query`` body as Dynamo does: (status, content type, parsed or message).
    A well-formed body takes the fast path; anything else is parsed again by ``json`` for
    the message Dynamo's answer would give."""
    global _query_body
    import msgspec

    if _query_body is None:
        _query_body = _query_body_type()
    try:
        fast = _query_body.decode(body)
    except msgspec.MsgspecError:
        return parse_query_request(body)
    group = fast.routing_group
    return (
        200,
        "application/json",
        {
            "token_ids": fast.token_ids,
            "model_name": fast.model_name,
            "routing_group": "default" if group is None else group,
            "lora_name": fast.lora_name,
        },
    )


def parse_query_request(body: bytes) -> tuple[int, str, Any]:
    """:func:`query_request` through ``json``: every message as Dynamo words it."""
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
            status, ctype, req = query_request(body)
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


def source_kind(addresses: tuple[str, ...]) -> str:
    """What ``/workers`` calls the sources (Dynamo's indexer: ``zmq``)."""
    schemes = {a.rpartition("=")[2].partition("://")[0] for a in addresses}
    if schemes <= {"tcp", "ipc"}:
        return "zmq"
    if schemes == {"nats"}:
        return "nats"
    return "recording" if all(Path(a).exists() for a in addresses) else "stream"


# --- an index for `kvctl query` ---------------------------------------------------------------


def ask_index(
    index: str,
    token_ids: list[int],
    model_name: str,
    lora_name: str | None,
    block_size: int | None,
    timeout: float,
    notes: list[str],
) -> tuple[list[Overlap], int, list[WorkerKey], str]:
    """A running index's answer: the overlaps, block size, known workers and its base URL."""
    base = index_base_url(index)
    known, index_block_size = index_workers(base, model_name, timeout)
    # asked first: an index that knows no such model says so in its own words
    answer = _post_query(base, token_ids, model_name, lora_name, timeout)
    if block_size is None:
        if index_block_size is None:
            raise UsageError(
                f"{base} does not say its block size for {model_name!r}: give --block-size"
            )
        block_size = index_block_size
    elif index_block_size is not None and index_block_size != block_size:
        notes.append(
            f"--block-size {block_size} differs from the index's {index_block_size} for "
            f"{model_name!r}: matched lengths are the index's, counted in blocks of {block_size}"
        )
    return overlaps_from_dynamo(answer, block_size, notes), block_size, known, base


def build_index(
    addresses: tuple[str, ...],
    until: Until | None,
    limits: Limits,
    block_size: int | None,
    model_name: str,
    out: Output,
) -> RouterIndex:
    """The index ``kvctl index`` would serve for these SOURCEs, built here."""
    from .options import Sources
    from .pipeline import Summary
    from .selection import Filters
    from .session import read

    if is_snapshot(addresses):
        snapshot = load_snapshot(Path(addresses[0]))
        if block_size is not None and block_size != snapshot.block_size:
            raise UsageError(f"{addresses[0]} holds blocks of {snapshot.block_size} tokens")
        return snapshot
    kind = source_kind(addresses)
    if until is not None and kind != "recording":
        raise UsageError("--until reads recordings (files or segment directories) only")
    stops = (limits.count, limits.duration, limits.idle_timeout)
    if kind != "recording" and all(stop is None for stop in stops):
        raise UsageError("live SOURCEs are read until -c, --duration or --idle-timeout")
    index = RouterIndex(block_size or DEFAULT_BLOCK_SIZE, model_name)

    def consume(batch: Batch) -> None:
        if until is None or until.keeps(batch):
            index.apply(batch)

    read(Sources(addresses), Filters(), limits, out, Summary(), consume)
    return index


def overlaps_from_index(found: IndexOverlap) -> list[Overlap]:
    """Overlaps from kvctl's own index: every tier per worker and dp rank, exactly."""
    host = found.lower.get(HOST, {})
    disk, external = found.lower.get(DISK, {}), found.lower.get(EXTERNAL, {})
    everyone = set(found.device) | set(host) | set(disk) | set(external)
    return [
        Overlap(
            wid,
            dp,
            found.device.get((wid, dp), 0),
            host.get((wid, dp), 0),
            disk.get((wid, dp), 0) + external.get((wid, dp), 0),
        )
        for wid, dp in sorted(everyone, key=worker_order)
    ]


# --- asking a running index over HTTP ---------------------------------------------------------


def index_base_url(url: str) -> str:
    """``http://HOST:PORT`` of an index given as its base URL or as its ``/dump`` URL."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"{redact_url(url)!r}: expected http://HOST:PORT")
    base = url.rstrip("/")
    return base[: -len("/dump")] if base.endswith("/dump") else base


def http_request(url: str, timeout: float, body: Any = None) -> tuple[int, bytes]:
    """(HTTP status, body) of a GET, or of a POST of ``body`` as JSON; an index that cannot be
    reached is a TransportError with one line."""
    import urllib.error
    import urllib.request

    shown = redact_url(url)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"} if data else {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            reason = "connection refused"
        elif isinstance(reason, TimeoutError):
            reason = f"no answer within {timeout:g} s"
        raise TransportError(f"{shown}: {reason}: is the index running there?") from None
    except TimeoutError:
        raise TransportError(f"{shown}: no answer within {timeout:g} s") from None
    except OSError as exc:  # a connection reset halfway, say
        raise TransportError(f"{shown}: {exc}") from None


def fetch_dump(base: str, timeout: float) -> Any:
    """The ``/dump`` document of the index at ``base`` (Dynamo's indexer or ``kvctl index``)."""
    url = f"{base}/dump"
    status, payload = http_request(url, timeout)
    if status != 200:
        text = " ".join(payload[:200].decode(errors="replace").split())
        raise TransportError(f"{redact_url(url)}: HTTP {status}: {text or 'no /dump here'}")
    return _json(url, status, payload)


def _json(url: str, status: int, payload: bytes) -> Any:
    """An index's answer as JSON; one that is not is a TransportError with one line."""
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        raise TransportError(
            f"{redact_url(url)}: HTTP {status} with a body that is not JSON: {payload[:120]!r}"
        ) from None


def index_workers(base: str, model: str, timeout: float) -> tuple[list[WorkerKey], int | None]:
    """The workers and dp ranks the index knows for ``model``, and its block size, from
    ``/workers`` (Dynamo's shape); nothing when the index has no such endpoint."""
    url = f"{base}/workers"
    status, payload = http_request(url, timeout)
    if status != 200:  # an index without /workers: the answer's workers are the candidates
        return [], None
    document = _json(url, status, payload)
    if not isinstance(document, list):
        return [], None
    keys: list[WorkerKey] = []
    block_sizes = set()
    for record in document:
        if not isinstance(record, dict) or record.get("model_name", model) != model:
            continue
        worker = record.get("instance_id")
        if type(worker) is not int:
            continue
        if type(record.get("block_size")) is int:
            block_sizes.add(record["block_size"])
        ranks = record.get("endpoints") or {"0": None}
        for rank in ranks:
            if str(rank).isdigit():
                keys.append((worker, int(rank)))
    return keys, (block_sizes.pop() if len(block_sizes) == 1 else None)


def _post_query(
    base: str, token_ids: list[int], model: str, lora: str | None, timeout: float
) -> dict[str, Any]:
    url = f"{base}/query"
    body: dict[str, Any] = {"token_ids": token_ids, "model_name": model}
    if lora is not None:
        body["lora_name"] = lora
    status, payload = http_request(url, timeout, body)
    if status != 200:
        try:
            message = json.loads(payload).get("error") or payload.decode(errors="replace")
        except (ValueError, AttributeError):
            message = payload.decode(errors="replace")
        raise KvctlError(f"{url}: HTTP {status}: {' '.join(str(message).split())}")
    answer = _json(url, status, payload)
    if not isinstance(answer, dict):
        raise TransportError(f"{url}: expected a JSON object, got {type(answer).__name__}")
    return answer


def overlaps_from_dynamo(
    answer: dict[str, Any], block_size: int, notes: list[str]
) -> list[Overlap]:
    """Overlaps from a Dynamo ``/query`` answer. Its counts are tokens: per worker ``dp`` (GPU
    prefix per dp rank), ``gpu``, and ``cpu``/``disk`` cumulative through the tiers before,
    the most of any dp rank. With one dp rank the tiers split exactly; with several, the CPU and
    disk extension cannot be told to a rank and is left out (said in ``notes``)."""
    overlaps = []
    instances = answer.get("instances")
    if not isinstance(instances, dict):
        raise TransportError("the index's /query answer has no 'instances' object")
    for name, summary in sorted(instances.items()):
        try:
            worker = int(name)
            ranks = {int(rank): int(tokens) for rank, tokens in summary["dp"].items()}
            gpu, cpu, disk = (int(summary[tier]) for tier in ("gpu", "cpu", "disk"))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise TransportError(
                f"the index's /query answer for worker {name!r} is not Dynamo's shape"
            ) from None
        host_blocks = max(cpu - gpu, 0) // block_size
        disk_blocks = max(disk - max(cpu, gpu), 0) // block_size
        if len(ranks) > 1 and (host_blocks or disk_blocks):
            notes.append(
                f"worker {worker} has {len(ranks)} dp ranks: the index reports CPU and disk "
                "matches per worker only, so no rank is credited with them"
            )
            host_blocks = disk_blocks = 0
        for rank, tokens in sorted(ranks.items()):
            overlaps.append(Overlap(worker, rank, tokens // block_size, host_blocks, disk_blocks))
    return overlaps
