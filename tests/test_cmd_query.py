"""kvctl query without an index to answer: bad input and an unreachable index are one line on
stderr with the documented exit code; Dynamo's /query answer (as its standalone indexer 1.6
sends it) becomes overlaps by tier; --text tokenizes with a local tokenizer.json. The answers of
a real index are in test_interop_query.py."""

from __future__ import annotations

import json

import pytest
from conftest import finish, free_port, interrupt, read_until, run_kvctl, start_kvctl
from hypothesis import given
from hypothesis import strategies as st
from inprocess import run_main

from kvctl.commands.query import parse_token_ids, tokenize
from kvctl.errors import ExitCode, UsageError
from kvctl.indexing import overlaps_from_dynamo
from kvctl.recording.source import RecordingSource
from kvctl.routing import Overlap
from kvctl.state import RouterIndex


def query(*args: str):
    return run_main("query", *args)


def one_line_error(result, code: int, *words: str) -> None:
    assert result.code == code, result
    assert result.out == ""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvctl: "), result.err
    assert "Traceback" not in result.err
    for word in words:
        assert word in lines[0], result.err


def test_an_unreachable_index_is_one_line_and_exit_1():
    port = free_port()  # nothing listens there
    result = query("--index", f"http://127.0.0.1:{port}", "--tokens", "1,2,3")
    one_line_error(result, ExitCode.ERROR, f"127.0.0.1:{port}", "connection refused")


def test_an_index_that_never_answers_is_given_up_after_timeout():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never answers
        port = silent.getsockname()[1]
        args = ("--index", f"http://127.0.0.1:{port}", "--tokens", "1", "--index-timeout", "0.3")
        one_line_error(query(*args), ExitCode.ERROR, "no answer within 0.3 s")


@pytest.mark.parametrize(
    "args,words",
    [
        (["--tokens", "1,x,3"], ["--tokens", "not token ids"]),
        (["--tokens", "1,-2"], ["not a u32"]),
        (["--tokens", str(2**32)], ["not a u32"]),
        (["--tokens", " , "], ["no token ids"]),
        ([], ["give the prompt once"]),
        (["--tokens", "1", "--text", "hi"], ["give the prompt once"]),
        (["--text", "hi"], ["--text needs --tokenizer"]),
        (["--tokens", "1", "--decode-blocks", "1"], ["not WORKER[:DP]=N"]),
        (["--tokens", "1", "--decode-blocks", "a=1"], ["not WORKER[:DP]"]),
        (["--tokens", "1", "--decode-blocks", "1=many"], ["not a count"]),
        (["--tokens", "1", "--prefill-tokens", "1:0=-5"], ["not a count"]),
    ],
)
def test_bad_input_is_a_usage_error(args, words):
    port = free_port()  # refused: input is checked before the index is asked
    one_line_error(query("--index", f"http://127.0.0.1:{port}", *args), ExitCode.USAGE, *words)


def test_an_index_that_is_not_an_http_url_is_a_usage_error():
    one_line_error(query("--index", "tcp://127.0.0.1:1", "--tokens", "1"), 2, "http://HOST:PORT")


@pytest.mark.parametrize(
    "content,words",
    [
        ("{", ["not JSON"]),
        ("[" * 5000, ["not JSON"]),
        ("[1]", ["expected"]),
        ('{"1": {"active_decode_blocks": -1}}', ["not a count"]),
        ('{"1": {"decode": 3}}', ["expected an object with"]),
        ('{"w": {}}', ["not WORKER[:DP]"]),
    ],
)
def test_a_bad_load_file_is_a_usage_error(tmp_path, content, words):
    load = tmp_path / "load.json"
    load.write_text(content)
    args = ("--index", "http://127.0.0.1:1", "--tokens", "1", "--load", str(load))
    one_line_error(query(*args), ExitCode.USAGE, "load.json", *words)


def test_token_ids_in_either_form():
    assert parse_token_ids("[1, 2, 3]", "f") == [1, 2, 3]
    assert parse_token_ids("1,2\n3 4", "f") == [1, 2, 3, 4]
    with pytest.raises(UsageError, match="not an array of integers"):
        parse_token_ids('[1, "2"]', "f")
    with pytest.raises(UsageError, match="not token ids"):
        parse_token_ids("[" * 5000, "f")


@pytest.mark.parametrize(
    "content,words",
    [(b"\xff\xfe garbage", ["cannot read token ids"]), (b"[true]", ["not an array of integers"])],
)
def test_a_bad_tokens_file_is_a_usage_error(tmp_path, content, words):
    path = tmp_path / "prompt.txt"
    path.write_bytes(content)
    args = ("--index", "http://127.0.0.1:1", "--tokens-file", str(path))
    one_line_error(query(*args), ExitCode.USAGE, "prompt.txt", *words)


@given(st.text(max_size=40))
def test_any_text_is_token_ids_or_a_usage_error(text):
    try:
        ids = parse_token_ids(text, "--tokens")
    except UsageError:
        return
    assert ids and all(0 <= i < 2**32 for i in ids)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50), st.sampled_from([",", " "]))
def test_token_ids_round_trip(ids, separator):
    assert parse_token_ids(separator.join(map(str, ids)), "--tokens") == ids
    assert parse_token_ids(json.dumps(ids), "--tokens") == ids


# What Dynamo's standalone indexer (ai-dynamo-runtime 1.6.1, block size 4) answered to a /query
# of 20 tokens: worker 1 holds 2 blocks on GPU then 1 in CPU memory, worker 2 one block on GPU
# (its next two were stored with a medium Dynamo does not count), worker 3 has two dp ranks.
DYNAMO_ANSWER = {
    "scores": {"1": {"0": 8}, "2": {"0": 4}, "3": {"0": 8, "1": 4}},
    "frequencies": [],
    "instances": {
        "1": {"longest_matched": 12, "gpu": 8, "dp": {"0": 8}, "cpu": 12, "disk": 12},
        "2": {"longest_matched": 4, "gpu": 4, "dp": {"0": 4}, "cpu": 4, "disk": 4},
        "3": {"longest_matched": 16, "gpu": 8, "dp": {"0": 8, "1": 4}, "cpu": 8, "disk": 16},
    },
}


def test_dynamo_s_answer_in_tokens_becomes_blocks_by_tier():
    notes: list[str] = []
    overlaps = overlaps_from_dynamo(DYNAMO_ANSWER, 4, notes)
    assert overlaps == [
        Overlap(1, 0, 2, 1, 0),
        Overlap(2, 0, 1, 0, 0),
        # two dp ranks: the disk match is the worker's, not a rank's
        Overlap(3, 0, 2, 0, 0),
        Overlap(3, 1, 1, 0, 0),
    ]
    assert notes == [
        "worker 3 has 2 dp ranks: the index reports CPU and disk matches per worker only, "
        "so no rank is credited with them"
    ]
    assert overlaps_from_dynamo({"scores": {}, "frequencies": [], "instances": {}}, 4, []) == []


@pytest.mark.parametrize(
    "answer",
    [{}, {"instances": []}, {"instances": {"x": {}}}, {"instances": {"1": {"dp": {"0": 4}}}}],
)
def test_an_answer_that_is_not_dynamo_s_shape_is_refused(answer):
    from kvctl.errors import TransportError

    with pytest.raises(TransportError, match="/query answer"):
        overlaps_from_dynamo(answer, 4, [])


def tiny_tokenizer(path):
    """A word-level tokenizer.json made here (nothing downloaded): one id per word."""
    tokenizers = pytest.importorskip(
        "tokenizers", reason="the 'tokenizer' extra (Hugging Face tokenizers) is not installed"
    )
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(64)}}
    made = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    made.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    made.save(str(path))
    return path


def test_text_is_tokenized_with_a_local_tokenizer_json(tmp_path):
    path = tiny_tokenizer(tmp_path / "tokenizer.json")
    assert tokenize("w0 w5 w63 unknown", str(path)) == [1, 6, 64, 0]


def test_a_file_that_is_not_a_tokenizer_is_a_usage_error(tmp_path):
    pytest.importorskip("tokenizers", reason="the 'tokenizer' extra is not installed")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    args = ("--index", "http://127.0.0.1:1", "--text", "w1", "--tokenizer", str(bad))
    one_line_error(query(*args), ExitCode.USAGE, "not a tokenizer.json")


def test_text_without_the_extra_says_how_to_get_it(tmp_path):
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the 'tokenizer' extra is installed: nothing to say")
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    args = ("--index", "http://127.0.0.1:1", "--text", "hi", "--tokenizer", str(path))
    one_line_error(query(*args), ExitCode.ERROR, "kvctl[tokenizer]")


# --- asking SOURCEs directly --------------------------------------------------------------------


def matched(answer: dict) -> dict:
    """What a user compares between two answers: who holds how much of the prompt, by tier,
    and each policy's decision."""
    holders = {
        (w["worker_id"], w["dp_rank"]): w["blocks_by_tier"]
        for w in answer["workers"]
        if w["matched_blocks"]
    }
    chosen = {policy["policy"]: policy["chosen"] for policy in answer["policies"]}
    return {"holders": holders, "chosen": chosen}


def test_a_recording_is_answered_as_kvctl_index_serving_it_answers(tmp_path):
    rec = str(tmp_path / "sim.parquet")
    done = run_kvctl(
        "simulate", "--workers", "3", "--requests", "40", "--num-blocks", "150", "--seed", "5",
        "--epoch", "1700000000", "-o", rec, "-q",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    first = next(
        b for b in RecordingSource([rec]).batches() if b.events[0]["type"] == "BlockStored"
    )
    stored = first.events[0]
    blocks = min(len(stored["block_hashes"]), 12)
    prompt = ",".join(map(str, stored["token_ids"][: 16 * blocks] + [7, 7, 7]))
    until = f"seq:{first.seq}"

    direct = query(rec, "--until", until, "--tokens", prompt, "--json")
    assert direct.code == 0, direct.err
    answer = json.loads(direct.out)
    assert answer["sources"] == [rec]
    holders = matched(answer)["holders"]
    assert holders[(first.worker_id, first.dp_rank or 0)]["gpu"] == blocks

    snapshot = str(tmp_path / "then.json")
    assert run_kvctl("index", rec, "--until", until, "-o", snapshot).returncode == 0
    from_snapshot = query(snapshot, "--tokens", prompt, "--json")
    assert from_snapshot.code == 0, from_snapshot.err
    assert matched(json.loads(from_snapshot.out)) == matched(answer)

    server = start_kvctl("index", snapshot, "--port", "0", "--json")
    try:
        url = json.loads(read_until(server.stdout, '"serving"')[-1])["serving"]
        served = query("--index", url, "--tokens", prompt, "--json")
    finally:
        interrupt(server)
        finish(server)
    assert served.code == 0, served.err
    assert matched(json.loads(served.out)) == matched(answer)

    # the whole recording: what the index model holds at its end
    whole = RouterIndex(16)
    for batch in RecordingSource([rec]).batches():
        whole.apply(batch)
    found = whole.query([int(t) for t in prompt.split(",")])
    later = query(rec, "--tokens", prompt, "--json")
    assert later.code == 0, later.err
    assert {k: v["gpu"] for k, v in matched(json.loads(later.out))["holders"].items()} == {
        k: n for k, n in found.device.items() if n
    }


@pytest.mark.parametrize(
    "args,words",
    [
        ((), ["--index URL", "SOURCEs"]),
        (("tcp://127.0.0.1:1",), ["-c", "--duration", "--idle-timeout"]),
        (("--index", "http://127.0.0.1:1", "--until", "seq:3"), ["--until", "recordings"]),
    ],
)
def test_where_to_ask_is_checked_before_asking(args, words):
    one_line_error(query(*args, "--tokens", "1,2"), ExitCode.USAGE, *words)
