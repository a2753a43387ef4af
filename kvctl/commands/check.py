"""kvctl check: read KV-event streams (live or recorded) and report what would break a
KV-aware router."""

from __future__ import annotations

import inspect
import time
from typing import TYPE_CHECKING, Any

import click

from ..checks import ERROR, INFO, RULES, WARNING, Checker, Finding, Report
from ..errors import ExitCode, KvctlError
from ..events import Batch
from ..help import KvctlCommand
from ..options import (
    Sources,
    filter_options,
    index_timeout_option,
    limit_options,
    reporting,
    source_arguments,
    stream_options,
)
from ..redact import shown_sources
from ..selection import Filters, Limits
from ..text import plural

if TYPE_CHECKING:
    from ..output import Output
    from ..pipeline import Summary

_SEVERITY_STYLE = {ERROR: "red", WARNING: "yellow", INFO: "cyan"}


def finding_line(f: Finding) -> str:
    where = [f.source] if f.source else []
    if f.seq is not None:
        where.append(f"seq {f.seq}")
    if f.worker is not None:
        where.append(f"worker {f.worker}")
    if f.hash is not None:
        where.append(f"hash {f.to_json()['hash']}")
    return f"{f.rule} {f.severity} {f.name}: {f.message}" + (
        f" ({', '.join(where)})" if where else ""
    )


def failed(report: Report, fail_on: str) -> bool:
    if fail_on == "never":
        return False
    if fail_on == "warning":
        return report.count(ERROR) + report.count(WARNING) > 0
    return report.has_errors


def print_report(report: Report, summary: Summary, fail: bool, console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    counts = (
        f"{plural(report.count(ERROR), 'error')}, "
        f"{plural(report.count(WARNING), 'warning')}, {plural(report.count(INFO), 'info')}"
        f" in {plural(report.batches, 'batch')} / {plural(report.events, 'event')} from "
        f"{plural(len(report.workers), 'worker')}"
    )
    if report.results:
        # A compact table first (fits 80 columns), then the examples of each rule as plain
        # lines: examples carry long endpoints and hashes that a table cell would mangle.
        table = Table(title="kvctl check: findings by rule", title_justify="left")
        table.add_column("rule", no_wrap=True)
        table.add_column("name", no_wrap=True)
        table.add_column("severity", no_wrap=True)
        table.add_column("count", justify="right")
        table.add_column("summary", overflow="fold")
        for res in report.results:
            style = _SEVERITY_STYLE.get(res.rule.severity, "")
            table.add_row(
                res.rule.id,
                res.rule.name,
                f"[{style}]{res.rule.severity}[/]",
                str(res.count),
                escape(res.rule.summary),
            )
        console.print(table)
        console.print("First examples:")
        for res in report.results:  # the checker kept --max-examples of each rule
            for f in res.examples:
                console.print(f"  {escape(finding_line(f))}")
            if res.count > len(res.examples):
                console.print(f"  [dim]{res.rule.id}: … {res.count - len(res.examples)} more[/]")
    if report.against is not None:
        a = report.against
        drift = {
            r.rule.id: r.details.get("workers", {})
            for r in report.results
            if r.rule.id in ("KV501", "KV502")
        }
        per_worker = "; ".join(
            f"{rule} on {', '.join(f'{w}: {n}' for w, n in sorted(by.items()))}"
            for rule, by in drift.items()
        )
        console.print(
            f"Router index {escape(a['index'])}: {plural(a['router_blocks'], 'block')} it "
            f"holds, {plural(a['engine_blocks'], 'block')} the engines hold, on "
            f"{plural(a['workers'], 'worker')}: "
            + (escape(per_worker) if per_worker else "no drift")
        )
    verdict = "[bold red]FAIL[/]" if fail else "[bold green]OK[/]"
    workers = f": {escape(', '.join(report.workers))}" if 0 < len(report.workers) <= 8 else ""
    console.print(f"{verdict}: {counts}{workers}; stopped by {summary.stopped_by}")


@click.command("check", cls=KvctlCommand)
@source_arguments
@filter_options
@limit_options
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    metavar="N",
    help="Block size (tokens per block) the router expects; other sizes are KV202.",
)
@click.option(
    "--num-blocks",
    type=click.IntRange(min=1),
    metavar="N",
    help="KV-cache capacity per worker in blocks; holding more is KV104.",
)
@click.option(
    "--expect-workers",
    type=click.IntRange(min=1),
    metavar="N",
    help="Workers that must publish (KV306 when fewer did, checked once "
    "--idle-timeout has passed, else at the end).",
)
@click.option(
    "--fail-on",
    type=click.Choice(["error", "warning", "never"]),
    default="error",
    show_default=True,
    help="Lowest severity that makes the exit code 3.",
)
@click.option(
    "--max-examples",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    metavar="N",
    help="Findings printed live and kept as examples, per rule.",
)
@click.option(
    "--against",
    metavar="URL|FILE",
    help="Compare a router's index with the stream at the end of the run (KV501/KV502): "
    "the /dump of Dynamo's standalone indexer or of kvctl index at URL, or a /dump saved in "
    "FILE.",
)
@index_timeout_option("--against")
@stream_options
@click.option(
    "--merge",
    is_flag=True,
    help="SOURCEs are the --json reports of checks of disjoint workers (--partition I/N): "
    "print the report one check of them all gives, and exit as it would.",
)
@reporting("No live findings or summary on stderr.")
def command(
    sources: Sources, selection: Filters, limits: Limits, out: Output, **params: Any
) -> None:
    """Check KV-event streams for what breaks KV-aware routing.

    Reads SOURCEs like tap (ZMQ endpoints, NATS servers, or a recording) until a stop
    condition (-c, --duration, --idle-timeout, end of a recording, Ctrl-C). Findings print on
    stderr as they happen, one line each with its rule id; at the end a report grouped by rule
    (id, name, severity, count, first examples) goes to stdout, or one JSON object with --json.

    Exit status: 0 when no error-severity finding (warnings and infos alone exit 0 unless
    --fail-on warning), 3 when there were (use it in CI), 1 when a source cannot be read, 130
    on Ctrl-C (the report is still printed). Sources that published nothing are KV306.
    --worker narrows the check to some workers; --type hides the other event types from the
    cache model too, so expect KV101/KV102 findings with it.

    A dataset (the segments of partitioned recorders in a directory, or s3://bucket/prefix) is
    read in receive-time order. A big one is checked in shards, one per partition, and the
    reports merged; the merge equals one check of the whole (rules are per worker). A fleet
    stream (--stream NAME) is sharded alike, --partition I/N reading only partition I's
    subject; of other live sources it skips the other partitions' workers:

    \b
      kvctl check data/ --partition 0/4 --json > r0.json   # ... up to 3/4
      kvctl check --merge r0.json r1.json r2.json r3.json

    \b
    Example:
      kvctl check tcp://127.0.0.1:5557 --block-size 16 --duration 60
      kvctl check 0=tcp://10.0.0.1:5557 1=tcp://10.0.0.2:5557 --expect-workers 2 \\
          --idle-timeout 30 --json > report.json
      kvctl check nats://127.0.0.1:4222 --num-blocks 8192 --fail-on warning -c 100000
      kvctl check 1=tcp://10.0.0.1:5557 2=tcp://10.0.0.2:5557 --idle-timeout 10 \\
          --against http://127.0.0.1:8090
      kvctl check run.parquet --against snapshot.json
      kvctl check nats://10.0.0.5:4222 --stream fleet --partition 2/8 --duration 60 --json

    --against compares what a router's index holds (its /dump, fetched when the run ends, or a
    /dump FILE) with what the stream says each engine holds, per worker and dp rank: blocks
    the router believes in that the engine evicted (KV501), blocks the engine holds that the
    router never learned (KV502). Read the stream from the engines' start, and let a live
    stream go quiet before the end (--idle-timeout): events still in flight show as drift.
    """
    from ..errors import UsageError
    from ..pipeline import Summary
    from ..session import live_addresses, on_interrupt, read

    if params["merge"]:
        merge_command(list(sources.addresses), out, params["fail_on"], params["max_examples"])
        return
    partition = None
    if params["partition_spec"] is not None:
        from ..partitions import parse_partitions

        try:
            chosen, count = parse_partitions(params["partition_spec"])
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if len(chosen) != 1:  # a report (and --merge) carries one partition
            raise UsageError(
                f"--partition {params['partition_spec']}: check takes one partition, I/N "
                "(run one check per partition and --merge the reports)"
            )
        partition = (chosen[0], count)
        if sources.stream is None:  # a fleet stream is read from partition I's subject only
            selection.partition = partition
    quiet = out.quiet
    max_examples = params["max_examples"]
    against = _RouterIndex.open(params["against"], params["index_timeout"])
    checker = Checker(
        block_size=params["block_size"],
        num_blocks=params["num_blocks"],
        expect_workers=params["expect_workers"],
        max_examples=max_examples,
        router_view=against is not None,
    )
    printed: dict[str, int] = {}
    addresses: list[str] = []

    def say(findings: list[Finding]) -> None:
        if quiet:
            return
        for f in findings:
            out.say(f"kvctl: {finding_line(f)}", _SEVERITY_STYLE.get(f.severity, ""))
            # said after the last finding printed (the router comparison gives all at once)
            printed[f.rule] = printed.get(f.rule, 0) + 1
            if printed[f.rule] == max_examples:
                out.say(f"kvctl: {f.rule}: further findings are counted, not printed", "dim")

    def consume(batch: Batch) -> None:
        if not selection.keeps_batch(batch):  # a live source's workers of other partitions
            return
        found = checker.feed(batch)
        if found:
            say(found)

    idle = limits.idle_timeout
    started = time.monotonic()
    silent_checked = False

    def tick() -> bool:
        # Expected workers must have published within --idle-timeout of the start; the
        # pipeline's own idle stop only fires when *every* source is quiet.
        nonlocal silent_checked
        if idle is not None and not silent_checked and time.monotonic() - started >= idle:
            silent_checked = True
            say(checker.check_silent(addresses))
        return True

    def on_open(source: Any) -> None:
        nonlocal started
        started = time.monotonic()  # --idle-timeout counts from the start, like the pipeline's
        # none of a fleet stream: which of its engines must publish is --expect-workers's
        live = live_addresses(source, sources)
        if partition is not None and live:
            live = _in_partition(list(sources.addresses), live, partition)
        addresses.extend(live)
        out.say(f"kvctl: checking {shown_sources(sources.addresses)}", "dim")

    summary = Summary()

    def report(interrupted: bool) -> bool:
        """Print the report (a Ctrl-C still gets it); whether the check failed."""
        on_interrupt(None)
        if interrupted:
            summary.stopped_by = "interrupt"
        say(checker.check_silent(addresses))
        if against is not None:
            try:
                say(against.compare(checker))
            except KvctlError as exc:
                if not interrupted:
                    raise
                out.say(f"kvctl: {exc}", "red")  # Ctrl-C: the report still comes
        found = checker.finish(addresses)
        fail = failed(found, params["fail_on"])
        code = ExitCode.INTERRUPTED if interrupted else ExitCode.FINDINGS if fail else ExitCode.OK
        if out.as_json:
            out.json(
                {
                    **found.to_json(),
                    "failed": fail,
                    "fail_on": params["fail_on"],
                    "exit_code": int(code),
                    "stream": summary.to_json(),
                    **(
                        {"partition": {"index": partition[0], "count": partition[1]}}
                        if partition is not None
                        else {}
                    ),
                }
            )
        else:
            print_report(found, summary, fail, out.stdout)
        return fail

    def interrupted() -> str:
        report(interrupted=True)
        return summary.line()

    on_interrupt(interrupted, quiet)
    read(sources, selection, limits, out, summary, consume, tick, on_open)
    fail = report(interrupted=False)
    out.say(f"kvctl: {summary.line()}", "dim")
    if fail:
        raise click.exceptions.Exit(int(ExitCode.FINDINGS))


def _in_partition(
    arguments: list[str], addresses: list[str], partition: tuple[int, int]
) -> list[str]:
    """The live sources whose silence partition I's check reports (KV306): a ZMQ engine whose
    label (else address) lands in partition I; a NATS server, carrying many workers, always."""
    from ..partitions import partition_key, partition_of
    from ..pipeline import SourceSpec

    kept = []
    for argument, address in zip(arguments, addresses, strict=True):
        spec = SourceSpec.parse(argument)
        key = partition_key(spec.worker_id, spec.address)
        if spec.kind != "zmq" or partition_of(key, partition[1]) == partition[0]:
            kept.append(address)
    return kept


def merge_command(paths: list[str], out: Output, fail_on: str, max_examples: int) -> None:
    """``--merge``: one report from the shards' reports; exit 3 when it fails (--fail-on)."""
    import json
    from pathlib import Path

    from ..checks import NotACheckReport, Report, RuleResult, merge_reports, validate_report
    from ..errors import UsageError
    from ..pipeline import Summary

    reports = []
    counts: list[tuple[Any, Any]] = []
    for path in paths:
        try:
            report = validate_report(json.loads(Path(path).read_text()))
        except OSError as exc:
            raise UsageError(f"{path}: cannot read: {exc.strerror or exc}") from None
        except (ValueError, NotACheckReport) as exc:
            why = str(exc) if isinstance(exc, NotACheckReport) else "not JSON"
            raise UsageError(f"{path}: not a kvctl check --json report ({why})") from None
        part = report.get("partition")
        if isinstance(part, dict):
            counts.append((part.get("index"), part.get("count")))
        reports.append(report)
    if counts:
        if len(counts) != len(reports) or len({n for _, n in counts}) != 1:
            raise UsageError("--merge: every report must come from --partition I/N, one same N")
        if len(set(counts)) != len(counts):
            raise UsageError("--merge: a partition is given twice")
    merged = merge_reports(reports, max_examples)
    try:
        results = [
            RuleResult(
                RULES[r["id"]],
                r["count"],
                [Finding(**e) for e in r["examples"]],
                r.get("details") or {},
            )
            for r in merged["rules"]
        ]
    except (KeyError, TypeError):
        raise UsageError(
            "--merge: a report names a rule or example this kvctl does not know"
        ) from None
    whole = Report(
        results, merged["batches"], merged["events"], merged["workers"], merged["sources"]
    )
    fail = failed(whole, fail_on)
    code = ExitCode.FINDINGS if fail else ExitCode.OK
    streams = [r["stream"] for r in reports if isinstance(r.get("stream"), dict)]
    summary = Summary()
    stopped = sorted({str(s.get("stopped_by")) for s in streams}) or ["end of input"]
    summary.stopped_by = ", ".join(stopped)
    if out.as_json:
        stream: dict[str, Any] = {}
        for s in streams:
            stream = s if not stream else _merge_stream(stream, s)
        out.json(
            {
                **merged,
                "failed": fail,
                "fail_on": fail_on,
                "exit_code": int(code),
                "stream": stream,
                "merged": len(reports),
            }
        )
    else:
        print_report(whole, summary, fail, out.stdout)
    if fail:
        raise click.exceptions.Exit(int(ExitCode.FINDINGS))


def _merge_stream(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Shards' stream summaries: counts summed, the longest elapsed time, the stop reasons."""
    from ..checks import _merge_values

    out = {k: v for k, v in a.items() if k not in ("elapsed_s", "stopped_by")}
    for k, v in b.items():
        if k not in ("elapsed_s", "stopped_by"):
            out[k] = _merge_values(out[k], v) if k in out else v
    out["elapsed_s"] = max(a.get("elapsed_s") or 0, b.get("elapsed_s") or 0)
    reasons = {r for s in (a, b) for r in str(s.get("stopped_by")).split(", ")}
    out["stopped_by"] = ", ".join(sorted(reasons))
    return out


class _RouterIndex:
    """``--against``: a running index (reached at the start, so that a wrong URL fails before
    a long run; its ``/dump`` fetched when the run ends) or a ``/dump`` file (read at once)."""

    def __init__(self, shown: str, base: str | None, timeout: float) -> None:
        self.shown = shown
        self.base = base
        self.timeout = timeout
        self.blocks: dict[Any, Any] | None = None
        """A file's blocks per worker, read at the start."""

    @classmethod
    def open(cls, where: str | None, timeout: float) -> _RouterIndex | None:
        from pathlib import Path

        from ..indexing import http_request, index_base_url, read_dump
        from ..redact import redact_url

        if where is None:
            return None
        if "://" not in where:
            index = cls(where, None, timeout)
            index.blocks = index.parse(read_dump(Path(where)))
            return index
        base = index_base_url(where)
        http_request(f"{base}/health", timeout)  # any answer will do: the index is there
        return cls(redact_url(base), base, timeout)

    def parse(self, document: Any) -> dict[Any, Any]:
        from ..checks import dump_prefixes

        try:
            return dump_prefixes(document)
        except ValueError as exc:
            raise KvctlError(f"{self.shown}: not a /dump: {exc}") from None

    def compare(self, checker: Checker) -> list[Finding]:
        """KV501/KV502 findings: the index now (or the file) against the checker's model."""
        from ..indexing import fetch_dump

        blocks = self.blocks
        if blocks is None:
            assert self.base is not None
            blocks = self.parse(fetch_dump(self.base, self.timeout))
        return checker.compare_router(blocks, self.shown)


# The rule table in --help too: one source of truth (kvctl.checks.RULES).
command.help = (
    inspect.cleandoc(command.help or "")
    + "\n\n\b\nRules:\n"
    + "\n".join(f"  {r.id}  {r.severity:<7}  {r.name}: {r.summary}" for r in RULES.values())
)
