"""kvctl replay: play recordings into any engine or router format at controlled rates."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..help import KvctlCommand
from ..options import filter_options, nats_auth_options, report_options, target_options
from ..pacing import Window
from ..publishing import (
    Sending,
    linger,
    make_report,
    open_target,
    print_report,
    wait_subscribers,
)
from ..selection import Filters

if TYPE_CHECKING:
    from ..output import Output
    from ..targets import Target
    from ..transports.nats import NatsOptions


def parse_window(value: str | None) -> Window | None:
    """``--start/--end``: seconds from the recording's start, or ``seq:N``."""
    if value is None:
        return None
    kind, _, number = value.partition(":") if value.startswith("seq:") else ("time", "", value)
    try:
        return kind, float(number)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected SECONDS or seq:N") from None


class RecordingLocation(click.Path):
    """A recording path that must exist, or a dataset's ``s3://bucket/prefix`` (read, and
    checked, when the replay starts)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.startswith("s3://"):
            return value
        return super().convert(value, param, ctx)


@click.command("replay", cls=KvctlCommand)
@click.argument(
    "recordings",
    nargs=-1,
    required=True,
    metavar="RECORDING...",
    type=RecordingLocation(exists=True),
)
@target_options
@nats_auth_options
@click.option(
    "--speed",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Scale the recorded timing (2 = twice as fast).",
)
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    metavar="BATCHES_PER_S",
    help="Send at a fixed rate of batches per second instead of recorded timing.",
)
@click.option("--topspeed", is_flag=True, help="Send as fast as possible.")
@click.option(
    "--max-gap",
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="Cap idle gaps of the recording at this many (schedule) seconds.",
)
@click.option(
    "--loop",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Play the recording N times (0: until interrupted).",
)
@click.option(
    "--unique-hashes",
    is_flag=True,
    help="Re-salt block hashes on every loop after the first, so a router sees new "
    "blocks (implies re-encoding).",
)
@click.option("--start", metavar="SECONDS|seq:N", help="Skip what comes before this point.")
@click.option("--end", metavar="SECONDS|seq:N", help="Stop at this point.")
@filter_options
@click.option("-c", "--count", type=click.IntRange(min=1), metavar="N", help="Stop after N events.")
@click.option(
    "--prepare",
    is_flag=True,
    help="Build the frames cache of each RECORDING for --format (and --array-layout, "
    "--worker-topics) and exit; no --to needed.",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    envvar="KVCTL_CACHE_DIR",
    metavar="DIR",
    help="Keep frames caches here instead of beside the recordings.",
)
@click.option(
    "--no-cache",
    is_flag=True,
    help="Decode and encode the recording while sending; no frames cache is read or written.",
)
@report_options
def command(
    recordings: tuple[str, ...],
    to: Target,
    nats: NatsOptions,
    speed: float,
    rate: float | None,
    topspeed: bool,
    max_gap: float | None,
    loop: int,
    unique_hashes: bool,
    start: str | None,
    end: str | None,
    selection: Filters,
    count: int | None,
    prepare: bool,
    cache_dir: str | None,
    no_cache: bool,
    out: Output,
) -> None:
    """Replay recordings into an engine (ZMQ PUB that binds) or a router (Dynamo on NATS),
    in any producer's format, at the recorded pace, scaled, or at a fixed rate.

    Every send is scheduled from the start time (never from the previous send), so timing
    does not drift. Ends with a tcpreplay-style report of what was sent and how late.

    To a ZMQ target the sender never decodes: like tcpreplay's tcpprep, the first replay of a
    recording in a format prepares the frames it sends (and their timing) into a frames cache,
    which later replays memory-map. The cache is a hidden file beside the recording
    (.NAME.<variant>.kvctl-frames), or in --cache-dir / KVCTL_CACHE_DIR, or, when the
    recording's directory is not writable (or is a segment directory and one segment is
    replayed, or the recording is a dataset on s3://bucket/prefix), in the per-user cache
    directory ($XDG_CACHE_HOME/kvctl/frames, else
    ~/.cache/kvctl/frames). It is rebuilt whenever the
    recording (its files' sizes and times), the format options or kvctl change, and whenever
    it is damaged; delete it at any time. --prepare builds it ahead. Filters, -c, the salted
    loops of --unique-hashes and NATS targets encode while sending, as does --no-cache.

    \b
    Example:
      kvctl replay run.parquet --to tcp://127.0.0.1:5557
      kvctl replay run.parquet --to tcp://127.0.0.1:5557 --format vllm-array --speed 10
      kvctl replay run.parquet --to nats://127.0.0.1:4222 --format dynamo --rate 1000
      kvctl replay run.parquet --to tcp://127.0.0.1:5557 --topspeed --loop 5 --unique-hashes
      kvctl replay --prepare run.parquet --format vllm-array
      kvctl replay s3://bucket/fleet --to tcp://127.0.0.1:5557
    """
    from ..pacing import PacedSource, Schedule, batch_time
    from ..pipeline import run
    from ..recording.source import RecordingSource
    from ..selection import Limits
    from ..session import on_interrupt
    from ..targets import DECODED, Sender, ZmqTarget, bind_workers, frames_variant

    if prepare:
        _prepare(recordings, to, Path(cache_dir) if cache_dir else None, out)
        return
    if to.url is None:
        raise click.MissingParameter(param_hint="'--to'", param_type="option")
    if to.encoding == "raw" and (unique_hashes or selection.types or selection.workers or count):
        raise click.UsageError(
            "--format raw sends recorded bytes unchanged: it cannot be "
            "combined with filters, -c or --unique-hashes"
        )
    window_start, window_end = parse_window(start), parse_window(end)
    # paced sends must not stall while the next chunk is decoded (256 rows: ~3 ms stalls)
    recording = RecordingSource(list(recordings), chunk_rows=4096 if topspeed else 256)
    target = open_target(to, nats, out)
    caches: list[Any] | None = None
    if isinstance(target, ZmqTarget) and not (
        no_cache or selection.types or selection.workers or count
    ):
        opened: list[Any] = []
        try:
            variant = frames_variant(to)
            where = Path(cache_dir) if cache_dir else None
            for path in recordings:
                opened.append(_frames(path, variant, where, out))
        except BaseException:
            for cache in opened:
                if cache is not None:
                    cache.close()
            target.close()
            raise
        caches = opened
        if any(c is None for c in caches):  # one recording is read: all are (one order)
            for cache in caches:
                if cache is not None:
                    cache.close()
            caches = None
    schedule = Schedule(None if topspeed else (1.0 if rate else speed))
    sender = Sender(target, to.encoding)
    progress = _Progress(out, list(recordings), loop, sender)
    elapsed = 0.0

    def send_report() -> None:
        on_interrupt(None)
        cpu_s = time.process_time() - source.cpu_start
        print_report(make_report(sender, elapsed, schedule, cpu_s), out)

    def interrupted() -> str:
        send_report()
        return "interrupted"

    def next_loop(loop: int) -> None:
        sender.salt = _salt(loop) if unique_hashes else 0

    def prepared_rows(loop: int) -> Iterator[tuple[Any, ...]]:
        if sender.salt:  # salted hashes change the bytes: this loop encodes while sending
            for batch in recording.batches():
                yield (batch_time(batch), batch.seq, DECODED, 0, None, b"", b"", batch)
            return
        per_worker = to.per_worker
        for cache in caches or ():
            for chunk in cache.chunks(per_worker, rows=4096 if topspeed else 256):
                yield from chunk

    source = PacedSource(
        recording,
        schedule,
        rate=rate,
        max_gap=max_gap,
        loops=loop,
        start=window_start,
        end=window_end,
        on_loop=next_loop,
        on_read=progress.advance if progress.bar is not None else None,
    )
    try:
        if to.per_worker and isinstance(target, ZmqTarget):
            if caches is not None:
                bind_workers(target, [key for cache in caches for key in cache.open_keys()])
            else:
                target.open_for(b for b in recording.batches() if b is not None and b.error is None)
        wait_subscribers(target, to.wait_subscribers, out)
        if caches is not None:
            # A full collection walks every object the imports made (ms: late sends); frozen,
            # the collector looks only at what the send loop makes, which dies young.
            gc.freeze()
            try:
                sender.send_prepared(source.rows(prepared_rows))
            finally:
                gc.unfreeze()
        else:
            # raw sends every message, one without events too
            sending = Sending(sender, send_empty=to.encoding == "raw")
            run(source, [sending], Limits(count=count), selection)
        linger(target, to.linger)
    finally:
        progress.stop()
        elapsed = time.perf_counter() - schedule.start
        target.close()
        for cache in caches or ():
            cache.close()
        # Ctrl-C stopped the replay (not its closing): the report of what was sent
        on_interrupt(interrupted, out.quiet)
    send_report()


# --prepare needs no target: --to is checked in the command instead (same message)
next(p for p in command.params if p.name == "to").required = False


def _frames(path: str, variant: dict[str, Any], cache_dir: Path | None, out: Output) -> Any:
    """The frames cache of one recording for ``variant``, built first if missing or stale;
    None when replay must read the recording instead (it cannot be prepared, or the cache
    cannot be written)."""
    frames, _ = _cached_frames(path, variant, cache_dir, out)
    if frames is not None and frames.unpreparable:
        frames.close()
        return None
    return frames


def _cached_frames(
    path: str, variant: dict[str, Any], cache_dir: Path | None, out: Output
) -> tuple[Any, float | None]:
    """(the valid cache or None, seconds spent building it, None if it was there)."""
    from ..recording.frames import CacheUnusable, cache_key, cache_path, open_cache, write_cache
    from ..recording.source import RecordingSource
    from ..targets import NotPreparable, prepared_rows

    try:
        key = cache_key(path, variant)  # an s3:// dataset: from its listing
    except OSError as exc:
        from ..errors import TransportError

        raise TransportError(f"{path}: cannot read recording: {exc}") from None
    where = cache_path(path, variant, cache_dir)
    frames = open_cache(where, key)
    if frames is not None:
        return frames, None
    started = time.monotonic()
    batches = RecordingSource([path]).batches()
    try:
        try:
            write_cache(where, key, prepared_rows(batches, variant))
        except NotPreparable as exc:
            write_cache(where, key, [], unpreparable=str(exc))
    except CacheUnusable as exc:
        out.say(f"kvctl: cannot keep a frames cache ({exc}): replaying without one", "yellow")
        return None, None
    built = time.monotonic() - started
    if built >= 1.0:
        out.say(f"kvctl: prepared {path} for replay in {built:.1f} s ({where})", "dim")
    return open_cache(where, key), built


def _prepare(recordings: tuple[str, ...], to: Target, cache_dir: Path | None, out: Output) -> None:
    """``--prepare``: the frames cache of every recording, built unless it is up to date."""
    from ..help import NATS_FORMATS
    from ..recording.frames import cache_path
    from ..targets import frames_variant

    if (to.url or "").startswith(("nats://", "tls://")) or to.encoding in NATS_FORMATS:
        raise click.UsageError(
            "--prepare: NATS targets encode while sending; only ZMQ formats are prepared"
        )
    variant = frames_variant(to)
    for path in recordings:
        frames, built = _cached_frames(path, variant, cache_dir, out)
        if frames is None:
            continue
        result = {
            "recording": path,
            "cache": str(cache_path(path, variant, cache_dir)),
            "messages": frames.rows,
            "built": built is not None,
            "seconds": round(built or 0.0, 3),
            "unpreparable": frames.unpreparable,
        }
        frames.close()
        if out.as_json:
            out.json(result)
        elif frames.unpreparable:
            out.say(f"{path}: not prepared ({frames.unpreparable}); replay reads it", "yellow")
        else:
            state = f"prepared in {built:.1f} s" if built is not None else "up to date"
            out.say(f"{path}: {result['messages']:,} messages {state}: {result['cache']}")


def _salt(loop: int) -> int:
    import xxhash

    return 0 if loop == 0 else xxhash.xxh3_64_intdigest(b"kvctl-loop-%d" % loop)


class _Progress:
    """A progress bar on stderr while sending (terminals only): batches read of the
    recording's total (all loops), percent, ETA and the send rate. The total comes from the
    recording's footer (or manifest); without one (a journal) the bar shows the count alone."""

    def __init__(self, out: Any, recordings: list[str], loops: int, sender: Any) -> None:
        self.bar: Any = None
        if out.quiet or not out.console.is_terminal:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )

        per_loop = recorded_batches(recordings)
        total = per_loop * loops if per_loop is not None and loops else None
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TaskProgressColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[rate]}"),
            console=out.console,
            transient=True,
        )
        self.task = self.bar.add_task("replaying", total=total, rate="")
        self.bar.start()
        self.sender = sender
        self.read = 0
        self.started = self.shown = time.monotonic()

    def advance(self) -> None:
        """One batch read from the recording (sent, filtered out or outside the window)."""
        if self.bar is None:
            return
        self.read += 1
        now = time.monotonic()
        if now - self.shown >= 0.1:  # rich redraws 10 times a second: no need to tell it more
            self.shown = now
            rate = self.sender.batches / max(now - self.started, 1e-9)
            self.bar.update(self.task, completed=self.read, rate=f"{rate:,.0f} batches/s sent")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def recorded_batches(paths: list[str]) -> int | None:
    """Batches (messages) in these recordings, from the counts every writer stores in a
    Parquet file's footer or a segment directory's manifest: no row is read. None when a
    recording has no such counts (a journal, a directory still being written)."""
    import json
    from pathlib import Path

    import pyarrow.parquet as pq

    total = 0
    for path in map(Path, paths):
        try:
            if path.is_dir():
                manifest = json.loads((path / "_manifest.json").read_text())
                if not manifest.get("complete"):
                    return None
                counts = manifest.get("counts") or {}
            else:
                footer = pq.ParquetFile(path).metadata.metadata or {}
                counts = json.loads(footer.get(b"kvctl", b"{}")).get("counts") or {}
        except (OSError, ValueError):  # a journal, a missing manifest: no total, no harm
            return None
        if not isinstance(counts.get("batches"), int):
            return None
        total += counts["batches"]
    return total
