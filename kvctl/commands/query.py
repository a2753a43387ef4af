"""kvctl query: ask a prefix index which workers hold a prompt, and explain where each routing
policy would send it (Dynamo 1.6's cost, longest prefix, llm-d's tier-weighted score)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from ..errors import KvctlError, UsageError
from ..help import KvctlCommand
from ..options import index_timeout_option, limit_options, reporting, until_option
from ..redact import redact_url
from ..routing import (
    POLICIES,
    ZERO_LOAD,
    DynamoKnobs,
    Explanation,
    LlmdKnobs,
    Load,
    WorkerKey,
    request_blocks,
    worker_label,
)
from ..routing import explain as explain_prompt

if TYPE_CHECKING:
    from rich.console import Console

    from ..output import Output
    from ..selection import Limits, Until

_DYNAMO = DynamoKnobs()
_LLMD = LlmdKnobs()
_MAX_TOKEN = 2**32 - 1
"""Dynamo hashes token ids as u32."""
_LOAD_FIELDS = ("active_prefill_tokens", "active_decode_blocks", "active_requests")


def _knob(flag: str, default: float, help_text: str) -> Any:
    return click.option(
        flag,
        type=click.FloatRange(min=0),
        default=default,
        show_default=True,
        metavar="X",
        help=help_text,
    )


@click.command("query", cls=KvctlCommand)
@click.argument("sources", nargs=-1, metavar="[SOURCE]...")
@click.option(
    "--index",
    metavar="URL",
    help="A running prefix index: Dynamo's standalone indexer (python -m dynamo.indexer) or "
    "kvctl index, e.g. http://127.0.0.1:8090. Instead of SOURCEs.",
)
@until_option
@limit_options
@click.option("--tokens", metavar="IDS", help="The prompt's token ids: 1,2,3 (or 1 2 3).")
@click.option(
    "--tokens-file",
    type=click.File("r"),
    metavar="FILE",
    help="The prompt's token ids from a file ('-' for stdin): a JSON array, or ids separated "
    "by commas or whitespace.",
)
@click.option("--text", metavar="TEXT", help="The prompt as text, tokenized with --tokenizer.")
@click.option(
    "--tokenizer",
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="A Hugging Face tokenizer.json for --text (the 'tokenizer' extra; read locally, "
    "nothing is downloaded).",
)
@click.option(
    "--no-special-tokens",
    is_flag=True,
    help="--text: do not add the tokenizer's special tokens (BOS...).",
)
@click.option(
    "--model-name",
    default="default",
    show_default=True,
    metavar="NAME",
    help="The model the index keeps the prompt's blocks under (Dynamo's indexer --model-name).",
)
@click.option("--lora-name", metavar="NAME", help="The LoRA adapter the prompt runs with.")
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    metavar="TOKENS",
    help="Tokens per block. Default: the index's, from its /workers (16 for an index built "
    "from SOURCEs, as kvctl index).",
)
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(POLICIES),
    help="Explain only this policy (repeatable). Default: all.",
)
@click.option(
    "--load",
    type=click.File("r"),
    metavar="FILE",
    help='Load per worker from JSON: {"WORKER[:DP]": {"active_prefill_tokens": N, '
    '"active_decode_blocks": N, "active_requests": N}, ...}. Without load, load is zero.',
)
@click.option(
    "--prefill-tokens",
    multiple=True,
    metavar="WORKER[:DP]=N",
    help="Prompt tokens still being prefilled on a worker (repeatable; overrides --load).",
)
@click.option(
    "--decode-blocks",
    multiple=True,
    metavar="WORKER[:DP]=N",
    help="KV blocks of the requests active on a worker (repeatable; overrides --load).",
)
@click.option(
    "--active-requests",
    multiple=True,
    metavar="WORKER[:DP]=N",
    help="Requests active on a worker (repeatable; overrides --load).",
)
@_knob(
    "--overlap-score-credit",
    _DYNAMO.overlap_score_credit,
    "dynamo: credit per block cached on the device (GPU).",
)
@_knob(
    "--overlap-score-credit-decay",
    _DYNAMO.overlap_score_credit_decay,
    "dynamo: shrink the device credit of workers with more active prefill than the least "
    "loaded (0: off).",
)
@_knob(
    "--prefill-load-scale",
    _DYNAMO.prefill_load_scale,
    "dynamo: weight of the prefill term (was overlap_score_weight).",
)
@_knob(
    "--host-cache-hit-weight",
    _DYNAMO.host_cache_hit_weight,
    "dynamo: credit per block found in host (CPU) memory.",
)
@_knob(
    "--disk-cache-hit-weight",
    _DYNAMO.disk_cache_hit_weight,
    "dynamo: credit per block found on disk.",
)
@_knob(
    "--decode-active-request-weight",
    _DYNAMO.decode_active_request_weight,
    "dynamo: blocks of cost per active request.",
)
@_knob(
    "--router-temperature",
    _DYNAMO.router_temperature,
    "dynamo: 0 takes the lowest cost; above 0 samples a softmax of the costs (kvctl shows "
    "each worker's probability).",
)
@click.option(
    "--no-track-prefill-tokens",
    is_flag=True,
    help="dynamo: leave prefill out of the cost (router_track_prefill_tokens false).",
)
@_knob("--llmd-gpu-weight", _LLMD.gpu_weight, "llm-d: score per block on the GPU.")
@_knob("--llmd-cpu-weight", _LLMD.cpu_weight, "llm-d: score per block in CPU memory.")
@_knob("--llmd-storage-weight", _LLMD.disk_weight, "llm-d: score per block on storage (disk).")
@click.option(
    "--explain",
    is_flag=True,
    help="Print each policy's formula with every worker's numbers.",
)
@index_timeout_option("--index")
@reporting("No notes on stderr (errors are still shown).")
def command(
    sources: tuple[str, ...],
    index: str | None,
    until: Until | None,
    limits: Limits,
    tokens: str | None,
    tokens_file: Any,
    text: str | None,
    tokenizer: str | None,
    no_special_tokens: bool,
    model_name: str,
    lora_name: str | None,
    block_size: int | None,
    policies: tuple[str, ...],
    load: Any,
    prefill_tokens: tuple[str, ...],
    decode_blocks: tuple[str, ...],
    active_requests: tuple[str, ...],
    overlap_score_credit: float,
    overlap_score_credit_decay: float,
    prefill_load_scale: float,
    host_cache_hit_weight: float,
    disk_cache_hit_weight: float,
    decode_active_request_weight: float,
    router_temperature: float,
    no_track_prefill_tokens: bool,
    llmd_gpu_weight: float,
    llmd_cpu_weight: float,
    llmd_storage_weight: float,
    explain: bool,
    index_timeout: float,
    out: Output,
) -> None:
    """Ask a prefix index which workers hold a prompt, and explain where each routing policy
    would send it.

    The index is a running one (--index URL: Dynamo's standalone indexer, or kvctl index), or
    built here from SOURCEs as kvctl index builds it: recordings (to the end, or --until), a
    /dump snapshot (.json), or live streams read until -c, --duration or --idle-timeout. It
    answers with each worker's matched
    prefix by tier (GPU, CPU, disk); kvctl scores every worker and dp rank under Dynamo 1.6's
    cost (prefill minus cache credit, plus decode load), pure longest prefix, and llm-d's
    tier-weighted prefix score, and prints the decision of each. A tie is shown as a tie (Dynamo
    picks at random among equal costs), never as a silent pick. Load (prefill tokens, decode
    blocks, requests per worker) comes from --load or the options; without it load is zero, and
    the output says so.

    \b
    Example:
      kvctl query --index http://127.0.0.1:8090 --tokens 1,2,3,4,5,6,7,8
      kvctl query run.parquet --until 2026-12-01T10:15:00Z --tokens-file prompt.json
      kvctl query --index http://127.0.0.1:8090 --text "You are a helpful assistant." \\
          --tokenizer tokenizer.json --explain
      kvctl query --index http://127.0.0.1:8090 --tokens-file prompt.json \\
          --decode-blocks 1=300 --prefill-tokens 2=4096 --policy dynamo --json
    """
    token_ids = _prompt(tokens, tokens_file, text, tokenizer, not no_special_tokens)
    loads = _loads(load, prefill_tokens, decode_blocks, active_requests)
    from ..indexing import ask_index, build_index, overlaps_from_index

    notes: list[str] = []
    if (index is None) == (not sources):
        raise UsageError("ask a running index (--index URL) or SOURCEs: one of the two")
    if index is None:
        local = build_index(sources, until, limits, block_size, model_name, out)
        block_size, known = local.block_size, local.workers
        overlaps = overlaps_from_index(local.query(token_ids, lora_name))
        where: dict[str, Any] = {"sources": [redact_url(a) for a in sources]}
    else:
        if until is not None:
            raise UsageError("--until builds an index from recordings: give them as SOURCEs")
        overlaps, block_size, known, base = ask_index(
            index, token_ids, model_name, lora_name, block_size, index_timeout, notes
        )
        where = {"index": base}
    explanation = explain_prompt(
        overlaps,
        len(token_ids),
        block_size,
        loads,
        policies or POLICIES,
        DynamoKnobs(
            overlap_score_credit=overlap_score_credit,
            overlap_score_credit_decay=overlap_score_credit_decay,
            prefill_load_scale=prefill_load_scale,
            host_cache_hit_weight=host_cache_hit_weight,
            disk_cache_hit_weight=disk_cache_hit_weight,
            decode_active_request_weight=decode_active_request_weight,
            router_temperature=router_temperature,
            track_prefill_tokens=not no_track_prefill_tokens,
        ),
        LlmdKnobs(llmd_gpu_weight, llmd_cpu_weight, llmd_storage_weight),
        known,
    )
    context = {**where, "model_name": model_name, "lora_name": lora_name}
    show(explanation, context, notes, out, explain)


# -- input --------------------------------------------------------------------------------------


def parse_token_ids(text: str, where: str) -> list[int]:
    """Token ids from ``1,2,3``, ``1 2 3`` or a JSON array."""
    stripped = text.strip()
    try:
        if stripped.startswith("["):
            values = json.loads(stripped)
            if not isinstance(values, list) or not all(type(v) is int for v in values):
                raise ValueError("not an array of integers")
        else:
            values = [int(part) for part in stripped.replace(",", " ").split()]
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"{where}: not token ids ({exc})") from None
    if not values:
        raise UsageError(f"{where}: no token ids")
    bad = [v for v in values if not 0 <= v <= _MAX_TOKEN]
    if bad:
        raise UsageError(f"{where}: token id {bad[0]} is not a u32 (0..{_MAX_TOKEN})")
    return values


def tokenize(text: str, tokenizer_file: str, special_tokens: bool = True) -> list[int]:
    """``text`` tokenized by a Hugging Face tokenizer.json (the optional ``tokenizer`` extra)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise KvctlError(
            "--text needs Hugging Face tokenizers: pip install 'kvctl[tokenizer]' "
            "(or give --tokens)"
        ) from None
    try:
        loaded = Tokenizer.from_file(tokenizer_file)
    except Exception as exc:  # tokenizers raises its own untyped errors for a bad file
        raise UsageError(f"{tokenizer_file}: not a tokenizer.json ({exc})") from None
    ids = list(loaded.encode(text, add_special_tokens=special_tokens).ids)
    if not ids:
        raise UsageError("--text: the tokenizer made no tokens of it")
    return ids


def _prompt(
    tokens: str | None, tokens_file: Any, text: str | None, tokenizer: str | None, special: bool
) -> list[int]:
    if sum(value is not None for value in (tokens, tokens_file, text)) != 1:
        raise UsageError("give the prompt once: --tokens, --tokens-file or --text")
    if tokens is not None:
        return parse_token_ids(tokens, "--tokens")
    if tokens_file is not None:
        try:
            content = tokens_file.read()
        except (OSError, ValueError) as exc:  # unreadable, or not text
            raise UsageError(f"{tokens_file.name}: cannot read token ids ({exc})") from None
        return parse_token_ids(content, tokens_file.name)
    assert text is not None
    if tokenizer is None:
        raise UsageError("--text needs --tokenizer tokenizer.json")
    return tokenize(text, tokenizer, special)


def parse_worker(text: str, where: str) -> WorkerKey:
    """``WORKER[:DP]`` as a (worker id, dp rank) key; the dp rank defaults to 0."""
    worker, _, rank = text.strip().partition(":")
    try:
        key = (int(worker), int(rank) if rank else 0)
    except ValueError:
        raise UsageError(f"{where}: {text!r} is not WORKER[:DP] (integers)") from None
    if key[1] < 0:
        raise UsageError(f"{where}: dp rank {key[1]} is negative")
    return key


def _count(value: Any, where: str) -> int:
    if type(value) is not int or value < 0:
        raise UsageError(f"{where}: {value!r} is not a count (an integer >= 0)")
    return value


def _loads(
    load_file: Any,
    prefill_tokens: tuple[str, ...],
    decode_blocks: tuple[str, ...],
    active_requests: tuple[str, ...],
) -> dict[WorkerKey, Load]:
    fields: dict[WorkerKey, dict[str, int]] = {}
    if load_file is not None:
        where = load_file.name
        try:
            document = json.load(load_file)
        except (OSError, ValueError, RecursionError) as exc:
            raise UsageError(f"{where}: not JSON ({exc})") from None
        if not isinstance(document, dict):
            raise UsageError(f'{where}: expected {{"WORKER[:DP]": {{...}}, ...}}')
        for name, values in document.items():
            key = parse_worker(name, where)
            if not isinstance(values, dict) or set(values) - set(_LOAD_FIELDS):
                raise UsageError(
                    f"{where}: worker {name!r}: expected an object with {', '.join(_LOAD_FIELDS)}"
                )
            fields.setdefault(key, {}).update(
                {k: _count(v, f"{where}: worker {name!r} {k}") for k, v in values.items()}
            )
    for field, flag, values in zip(
        _LOAD_FIELDS,
        ("--prefill-tokens", "--decode-blocks", "--active-requests"),
        (prefill_tokens, decode_blocks, active_requests),
        strict=True,
    ):
        for item in values:
            name, sep, number = item.partition("=")
            if not sep:
                raise UsageError(f"{flag}: {item!r} is not WORKER[:DP]=N")
            try:
                count = int(number)
            except ValueError:
                raise UsageError(f"{flag}: {item!r}: {number!r} is not a count") from None
            key = parse_worker(name, flag)
            fields.setdefault(key, {})[field] = _count(count, f"{flag} {item}")
    return {key: Load(**values) for key, values in fields.items()}


# -- output -------------------------------------------------------------------------------------


def to_json(explanation: Explanation, context: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The whole answer as one JSON object."""
    from dataclasses import asdict

    return {
        **context,
        "prompt_tokens": explanation.prompt_tokens,
        "block_size": explanation.block_size,
        "request_blocks": request_blocks(explanation.prompt_tokens, explanation.block_size),
        "load": "given" if explanation.load_given else "zero",
        "workers": [
            {
                "worker_id": c.worker_id,
                "dp_rank": c.dp_rank,
                "matched_blocks": c.matched_blocks,
                "matched_tokens": c.matched_blocks * explanation.block_size,
                "blocks_by_tier": {
                    "gpu": c.device_blocks,
                    "cpu": c.host_blocks,
                    "disk": c.disk_blocks,
                },
                "load": asdict(explanation.loads.get(c.key, ZERO_LOAD)),
            }
            for c in explanation.candidates
        ],
        "policies": [decision.to_json() for decision in explanation.decisions],
        "notes": notes,
    }


def show(
    explanation: Explanation,
    context: dict[str, Any],
    notes: list[str],
    out: Output,
    show_formulas: bool = False,
) -> None:
    """Print an explanation: one JSON object with ``--json``, else a table and one line per
    policy (with ``show_formulas``, every worker's formula too); notes on stderr."""
    for note in notes:
        out.say(f"kvctl: {note}", "yellow")
    if out.as_json:
        out.json(to_json(explanation, context, notes))
        return
    _print(explanation, context, out.stdout, show_formulas)


def _print(
    explanation: Explanation, context: dict[str, Any], console: Console, show_formulas: bool
) -> None:
    from rich.markup import escape
    from rich.table import Table

    from ..text import plural

    bs = explanation.block_size
    lora = f", LoRA {context['lora_name']}" if context.get("lora_name") else ""
    console.print(
        f"[bold]kvctl query[/] {escape(context.get('index') or ', '.join(context['sources']))}: "
        f"{plural(explanation.prompt_tokens, 'token')}, "
        f"{plural(request_blocks(explanation.prompt_tokens, bs), 'block')} of {bs} "
        f"(model {escape(str(context.get('model_name')))}{escape(lora)})"
    )
    if not explanation.load_given:
        console.print(
            "load: zero on every worker (no --load, --prefill-tokens, --decode-blocks or "
            "--active-requests): decisions rest on the cache alone"
        )
    if not explanation.candidates:
        console.print("no workers: the index knows none for this model, and no load names any")
        return
    table = Table(title_justify="left")
    for title in ("worker:dp", "gpu", "cpu", "disk", "matched tokens"):
        table.add_column(title, justify="right")
    if explanation.load_given:
        for title in ("prefill tokens", "decode blocks", "requests"):
            table.add_column(title, justify="right")
    for decision in explanation.decisions:
        table.add_column(decision.policy, justify="right")
    scores = {d.policy: {s.worker: s for s in d.scores} for d in explanation.decisions}
    for c in explanation.candidates:
        row = [
            worker_label(c.key),
            str(c.device_blocks),
            str(c.host_blocks),
            str(c.disk_blocks),
            str(c.matched_blocks * bs),
        ]
        if explanation.load_given:
            load = explanation.loads.get(c.key, ZERO_LOAD)
            row += [str(getattr(load, field)) for field in _LOAD_FIELDS]
        for decision in explanation.decisions:
            score = scores[decision.policy][c.key]
            mark = "*" if c.key in decision.chosen else ""
            chance = (
                f" ({score.probability:.0%})"
                if 0 < score.probability < 1 or decision.policy == "dynamo" and decision.tie
                else ""
            )
            row.append(f"{_value(score.score)}{mark}{chance}")
        table.add_row(*row)
    console.print(table)
    console.print("gpu, cpu, disk: matched blocks by tier; * best; (n%) the chance of each pick")
    for decision in explanation.decisions:
        console.print(f"[bold]{decision.policy}[/]: {escape(_verdict(decision))}")
        if show_formulas:
            console.print(f"  rule: {escape(decision.rule)}")
            console.print(f"  formula: {escape(decision.formula)}")
            for score in decision.scores:
                console.print(f"  {worker_label(score.worker)}: {escape(score.explain)}")


def _value(number: float) -> str:
    return f"{number:.4g}" if number != int(number) else str(int(number))


def _verdict(decision: Any) -> str:
    chosen = ", ".join(worker_label(key) for key in decision.chosen)
    best = {s.worker: s for s in decision.scores}[decision.chosen[0]].score
    what = "cost" if decision.policy == "dynamo" else "score"
    if decision.policy == "dynamo" and decision.knobs.get("router_temperature", 0) > 0:
        likely = max(decision.scores, key=lambda s: s.probability)
        return (
            f"sampled: {worker_label(likely.worker)} most likely ({likely.probability:.0%}); "
            f"lowest {what} {_value(best)} at {chosen}"
        )
    if decision.tie:
        how = (
            "Dynamo picks one of them at random"
            if decision.policy == "dynamo"
            else "the router breaks it its own way"
        )
        return f"tie between {chosen} ({what} {_value(best)} each): {how}"
    others = [s.score for s in decision.scores if s.worker not in decision.chosen]
    if not others:
        return f"{chosen} ({what} {_value(best)}, the only worker)"
    runner_up = min(others) if decision.policy == "dynamo" else max(others)
    return f"{chosen} ({what} {_value(best)}; next best {_value(runner_up)})"
