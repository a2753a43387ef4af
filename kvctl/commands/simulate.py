"""kvctl simulate: a synthetic engine fleet publishing realistic KV store/evict traffic."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import click

from ..help import NATS_FORMATS, ZMQ_ENCODINGS, KvctlCommand
from ..options import nats_auth_options, report_options
from ..text import plural

if TYPE_CHECKING:
    from ..output import Output
    from ..transports.nats import NatsOptions


@click.command("simulate", cls=KvctlCommand)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Simulated engines (one PUB socket each).",
)
@click.option(
    "--num-blocks",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="KV cache capacity of each worker, in blocks.",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Tokens per block.",
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="Scheduler token budget per step (chunked prefill).",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Request arrivals per second over the fleet (Poisson).",
)
@click.option(
    "--prefixes",
    type=click.IntRange(min=0),
    default=8,
    show_default=True,
    help="Shared system prompts (Zipf popularity).",
)
@click.option(
    "--router",
    type=click.Choice(["kv", "prefix", "random", "round-robin"]),
    default="kv",
    show_default=True,
    help="How requests are spread over workers.",
)
@click.option(
    "--trace",
    type=click.Path(exists=True, dir_okay=False),
    help="Mooncake-style JSONL trace to replay instead of the synthetic workload.",
)
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    metavar="N",
    help="Stop issuing requests after N (the fleet then drains).",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="Stop after this much simulated time (wall time at --speedup 1).",
)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Same seed (and --epoch) => byte-identical streams.",
)
@click.option(
    "--speedup",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Run simulated time this many times faster than real time.",
)
@click.option("--topspeed", is_flag=True, help="Publish as fast as possible (no pacing).")
@click.option(
    "--epoch",
    type=float,
    metavar="UNIX_SECONDS",
    help="Engine timestamp of simulated time 0 (default: now).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Interface the PUB sockets bind (0.0.0.0 exposes them).",
)
@click.option(
    "--base-port",
    type=click.IntRange(1, 65535),
    default=5557,
    show_default=True,
    help="Worker i publishes on base-port + i (like vLLM's DP ranks).",
)
@click.option(
    "--replay-base-port",
    type=click.IntRange(1, 65535),
    help="Also serve a replay ROUTER per worker on replay-base-port + i.",
)
@click.option(
    "--format",
    "encoding",
    type=click.Choice((*ZMQ_ENCODINGS, *NATS_FORMATS)),
    help="Wire format: vllm (default on ZMQ), vllm-array, sglang, seed; dynamo "
    "(default on NATS) or dynamo-json.",
)
@click.option(
    "--to",
    metavar="URL",
    help="Publish to NATS as Dynamo does (nats://HOST:PORT) instead of ZMQ sockets.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Write a recording instead of publishing (no sockets, as fast as possible).",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="With -o: replace an existing recording file (atomically, when the new one "
    "is complete). Without it an existing file is refused.",
)
@click.option("--namespace", default="dynamo", show_default=True, help="Dynamo namespace (NATS).")
@click.option("--component", default="backend", show_default=True, help="Dynamo component (NATS).")
@click.option(
    "--endpoint",
    "dynamo_endpoint",
    default="generate",
    show_default=True,
    help="Dynamo endpoint (NATS).",
)
@click.option(
    "--wait-subscribers",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Hold the first batch until N subscribers joined each worker's socket.",
)
@click.option(
    "--start-delay",
    type=click.FloatRange(min=0),
    default=0.0,
    metavar="SECONDS",
    help="Wait this long after binding before publishing.",
)
@nats_auth_options
@report_options
def command(
    workers: int,
    num_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    rate: float,
    prefixes: int,
    router: str,
    trace: str | None,
    requests: int | None,
    duration: float | None,
    seed: int,
    speedup: float,
    topspeed: bool,
    epoch: float | None,
    host: str,
    base_port: int,
    replay_base_port: int | None,
    encoding: str | None,
    to: str | None,
    output: str | None,
    overwrite: bool,
    namespace: str,
    component: str,
    dynamo_endpoint: str,
    wait_subscribers: int,
    start_delay: float,
    nats: NatsOptions,
    out: Output,
) -> None:
    """Run a synthetic engine fleet that publishes realistic KV-cache events.

    Each worker is a paged KV cache with prefix caching and LRU eviction fed by a workload of
    shared system prompts and multi-turn sessions (or a Mooncake trace); every full block is
    published as BlockStored, every eviction as BlockRemoved, one batch per scheduler step.
    Runs until --duration, --requests or Ctrl-C; prints a summary (hit rate per worker).

    \b
    Example:
      kvctl simulate --workers 8                       # PUB on 127.0.0.1:5557..5564
      kvctl tap tcp://127.0.0.1:5557 tcp://127.0.0.1:5558
      kvctl simulate --workers 2 --wait-subscribers 1 --requests 50 --router random
      kvctl simulate --to nats://127.0.0.1:4222 --duration 60
      kvctl simulate --trace conversation_trace.jsonl --num-blocks 65536 --speedup 10
    """
    from .. import publishing
    from ..engine import Fleet
    from ..engine.workload import TraceError
    from ..errors import UsageError
    from ..events import Batch
    from ..output import dumps
    from ..pacing import Schedule
    from ..publishing import open_target, say_delivery
    from ..recording.layout import output_conflict
    from ..redact import redact_argv, redact_url
    from ..session import on_interrupt
    from ..targets import RecordingTarget, Target

    if output:  # before any work: nothing of the user's is replaced unasked
        conflict = output_conflict(output, segmented=False, overwrite=overwrite)
        if conflict is not None:
            raise UsageError(conflict)
    try:  # the whole trace is checked here, before any socket or file is opened
        fleet = Fleet(
            workers=workers,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            rate=rate,
            prefixes=prefixes,
            router=router,
            trace=trace,
            requests=requests,
            duration=duration,
            seed=seed,
            speedup=1.0,
        )
    except TraceError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"{trace}: cannot read trace: {exc.strerror or exc}") from None
    url = to or f"tcp://{host}:{base_port}"
    if output and to:
        raise click.UsageError("-o writes a recording; --to publishes: choose one")
    if output:
        target: Any = RecordingTarget(
            output,
            encoding,
            metadata={"command": redact_argv(sys.argv[1:]), "simulated": True},
            overwrite=overwrite,
        )
        topspeed = True  # a dataset, not a live stream: no pacing
    else:
        publish_to = Target(
            url,
            encoding,
            per_worker=True,  # one socket per simulated worker
            replay_port=replay_base_port,
            namespace=namespace,
            component=component,
            dynamo_endpoint=dynamo_endpoint,
        )
        target = open_target(publish_to, nats, out)
    counts = {"batches": 0, "events": 0, "bytes": 0}
    started, cpu_started = time.monotonic(), time.process_time()
    display = None

    def interrupted() -> str:  # what was published so far, and who could have received it
        on_interrupt(None)
        if not out.as_json:
            say_delivery(target.delivery(), counts["batches"], out)
        return _summary_line(fleet, counts)

    try:
        if output:
            out.say(f"kvctl: {plural(workers, 'worker')} recording to {output}", "dim")
        elif hasattr(target, "open_slots"):
            endpoints = target.open_slots(workers)
            out.say(
                f"kvctl: {plural(workers, 'worker')} publishing on "
                f"{endpoints[0]} .. {endpoints[-1]}",
                "dim",
            )
        else:
            out.say(
                f"kvctl: {plural(workers, 'worker')} publishing to "
                f"{redact_url(url)} "
                f"({target.subject})",
                "dim",
            )
        publishing.wait_subscribers(target, wait_subscribers, out, where=" on every worker")
        if start_delay:
            time.sleep(start_delay)
        if epoch is None:
            epoch = time.time()
        # an engine's step times jitter by more than a sleep overshoot: no spinning needed
        schedule = Schedule(None if topspeed else speedup, spin_s=0.0)
        display = _live_display(fleet, out, counts)
        for t, worker, events in fleet.run():
            schedule.wait(t)
            batch = Batch(
                source=f"simulate://worker-{worker}",
                events=events,
                format="engine-map",
                ts=epoch + t,
                recv_ns=int((epoch + t) * 1e9),
                worker_id=worker,
                dp_rank=0,
            )
            counts["bytes"] += target.write(batch, events, slot=worker)
            counts["batches"] += 1
            counts["events"] += len(events)
            target.service()
            if display is not None:
                display.tick()
    finally:
        if display is not None:
            display.stop()
        target.close()
        # Ctrl-C stopped the simulation (not its closing): the target is closed, report it
        on_interrupt(interrupted, out.quiet)
    on_interrupt(None)
    delivery = target.delivery()
    result = {
        **fleet.stats(),
        **counts,
        "wall_s": round(time.monotonic() - started, 3),
        "cpu_s": round(time.process_time() - cpu_started, 3),
        "delivery": delivery,
    }
    if out.as_json:
        click.echo(dumps(result))
    else:
        _print_summary(fleet, counts, out)
        say_delivery(delivery, counts["batches"], out)


def _summary_line(fleet: Any, counts: dict[str, int]) -> str:
    total = fleet.stats()["total"]
    return (
        f"{plural(counts['batches'], 'batch')}, {plural(counts['events'], 'event')} "
        f"({plural(total['stored_blocks'], 'block')} stored, {total['removed_blocks']} "
        "evicted) in "
        f"{fleet.now:.1f} simulated s; prefix-cache hit rate {total['hit_rate']:.1%}"
    )


def _worker_table(fleet: Any, title: str, rates: list[tuple[float, float]] | None = None) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name in (
        "worker",
        "running",
        "waiting",
        "blocks in use",
        "cached/total",
        "hit rate",
        "stored",
        "evicted",
    ):
        table.add_column(name, justify="right")
    if rates is not None:
        table.add_column("stores/s", justify="right")
        table.add_column("evictions/s", justify="right")
    stats = fleet.stats()
    for i, s in enumerate(stats["workers"]):
        row = [
            str(i),
            str(s["running"]),
            str(s["waiting"]),
            str(s["blocks_used"]),
            f"{s['blocks_cached']}/{s['blocks_total']}",
            f"{s['hit_rate']:.1%}",
            str(s["stored_blocks"]),
            str(s["removed_blocks"]),
        ]
        if rates is not None:
            row += [f"{rates[i][0]:.0f}", f"{rates[i][1]:.0f}"]
        table.add_row(*row)
    t = stats["total"]
    table.add_row(
        "all",
        str(t["running"]),
        str(t["waiting"]),
        str(t["blocks_used"]),
        f"{t['blocks_cached']}/{t['blocks_total']}",
        f"{t['hit_rate']:.1%}",
        str(t["stored_blocks"]),
        str(t["removed_blocks"]),
        style="bold",
    )
    return table


def _print_summary(fleet: Any, counts: dict[str, int], out: Output) -> None:
    if out.quiet:
        return
    out.stderr_tables().print(_worker_table(fleet, "kvctl simulate: final state"))
    out.say("kvctl: " + _summary_line(fleet, counts), "dim")


class _LiveTable:
    """A per-worker table on stderr, refreshed about once a second while publishing."""

    def __init__(self, fleet: Any, console: Any, counts: dict[str, int]) -> None:
        from rich.live import Live

        self.fleet = fleet
        self.counts = counts
        self.last = time.monotonic()
        self.prev = [(0, 0)] * len(fleet.workers)
        self.live = Live(
            _worker_table(fleet, "kvctl simulate"),
            console=console,
            auto_refresh=False,
            transient=True,
        )
        self.live.start()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last < 1.0:
            return
        stats = self.fleet.stats()["workers"]
        current = [(s["stored_blocks"], s["removed_blocks"]) for s in stats]
        dt = now - self.last
        rates = [
            ((c[0] - p[0]) / dt, (c[1] - p[1]) / dt)
            for c, p in zip(current, self.prev, strict=True)
        ]
        self.prev, self.last = current, now
        title = (
            f"kvctl simulate · {self.fleet.now:.1f} s simulated · "
            f"{plural(self.counts['batches'], 'batch')} · "
            f"{plural(self.counts['events'], 'event')}"
        )
        self.live.update(_worker_table(self.fleet, title, rates), refresh=True)

    def stop(self) -> None:
        self.live.stop()


def _live_display(fleet: Any, out: Output, counts: dict[str, int]) -> Any:
    console = out.live_stderr()
    return None if console is None else _LiveTable(fleet, console, counts)
