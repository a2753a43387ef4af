"""Running a source into a printing sink with the conventions every reading command shares:
filters, stop conditions, diagnostics and the final summary on stderr, Ctrl-C -> 130."""

from __future__ import annotations

from typing import Any

from .errors import ExitCode, KvctlError, UsageError
from .output import JsonLinesSink, PrettySink, StderrDiagnostics
from .pipeline import Filters, Limits, LiveSource, RecordingSource, SourceSpec, Summary, run


class Interrupted(KvctlError):
    exit_code = ExitCode.INTERRUPTED


def open_source(sources: tuple[str, ...] | list[str], **connection: Any) -> Any:
    specs = [SourceSpec.parse(s) for s in sources]
    files = [s for s in specs if s.kind == "file"]
    if files and len(files) != len(specs):
        raise UsageError("recordings and live sources cannot be mixed in one command")
    if files:
        return RecordingSource([s.address for s in files])
    return LiveSource(specs, **connection)


def make_filters(params: dict[str, Any]) -> Filters:
    types = frozenset({"blockstored": "BlockStored", "blockremoved": "BlockRemoved",
                       "allblockscleared": "AllBlocksCleared"}[t.lower()]
                      for t in params.get("types") or ())
    return Filters(types=types, workers=frozenset(params.get("workers") or ()))


def make_limits(params: dict[str, Any]) -> Limits:
    return Limits(count=params.get("count"), duration=params.get("duration"),
                  idle_timeout=params.get("idle_timeout"))


def stream(params: dict[str, Any], connection: dict[str, Any] | None = None,
           on_batch: Any = None) -> Summary:
    """tap/cat: print events from SOURCEs until a stop condition, then the summary."""
    diagnostics = StderrDiagnostics(quiet=params.get("quiet", False))
    hash_style = params.get("hash_format", "unsigned")
    sink = JsonLinesSink(hash_style=hash_style) if params.get("as_json") else \
        PrettySink(hash_style=hash_style)
    source = open_source(params["sources"], **(connection or {}))
    diagnostics.say(f"kvctl: reading {', '.join(params['sources'])}", "dim")
    summary = Summary()
    try:
        run(source, sink, make_limits(params), make_filters(params), diagnostics,
            strict=params.get("strict", False), summary=summary, on_batch=on_batch)
    except KeyboardInterrupt:
        summary.stopped_by = "interrupt"
        raise Interrupted(summary.line()) from None
    finally:
        sink.close()
        source.close()
    diagnostics.say("kvctl: " + summary.line(), "dim")
    return summary
