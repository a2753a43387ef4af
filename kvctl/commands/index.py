"""kvctl index: what a Dynamo KV router believes, served over HTTP as Dynamo's indexer does."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import UsageError
from ..events import DEFAULT_BLOCK_SIZE
from ..help import KvctlCommand
from ..options import (
    Sources,
    filter_options,
    limit_options,
    reporting,
    source_arguments,
    stream_options,
    until_option,
)
from ..redact import shown_sources
from ..selection import Filters, Limits, Until

if TYPE_CHECKING:
    from ..events import Batch
    from ..output import Output
    from ..pipeline import Summary
    from ..state import RouterIndex


@click.command("index", cls=KvctlCommand)
@source_arguments
@stream_options
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
    default=DEFAULT_BLOCK_SIZE,
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
@until_option
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
    from ..indexing import (
        Served,
        is_snapshot,
        load_snapshot,
        source_kind,
        start_server,
        write_snapshot,
    )
    from ..pipeline import Summary
    from ..session import on_interrupt, read
    from ..state import RouterIndex

    until: Until | None = params["until"]
    output: Path | None = params["output"]
    snapshot = is_snapshot(sources.addresses)
    if snapshot:
        index = load_snapshot(Path(sources.addresses[0]))
        kind = "snapshot"
    else:
        index = RouterIndex(params["block_size"], params["model_name"])
        kind = source_kind(sources.addresses)
    if until is not None and kind != "recording":
        raise UsageError("--until reads recordings (files or segment directories) only")
    if until is not None and until.kind == "time":
        # a dataset's later files stay unread; 1 ms of slack for the float seconds, since
        # until.keeps (below) decides what is indexed
        selection.until_ns = int(until.limit * 1e9) + 1_000_000
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
                if until is None or until.keeps(batch):
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
            write_snapshot(output, index)
            out.say(f"kvctl: wrote {output}", "dim")
            return
        on_interrupt(lambda: "kvctl: stopped serving", out.quiet)
        threading.Event().wait()  # serve until Ctrl-C or SIGTERM
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()


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
