"""The ``/query`` body of ``kvctl index``: the msgspec fast path accepts exactly what the json
path accepts, with the same values (the json path words Dynamo's errors)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.indexing import parse_query_request, query_request

tokens = st.one_of(
    st.integers(0, 2**32 - 1),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=3),
    st.none(),
)
names = st.one_of(
    st.none(), st.text(max_size=5), st.integers(), st.lists(st.integers(), max_size=2)
)


@st.composite
def bodies(draw) -> bytes:
    body: dict = {}
    if draw(st.booleans()) or draw(st.booleans()):
        body["token_ids"] = draw(
            st.one_of(
                st.lists(st.integers(0, 2**32 - 1), max_size=40), st.lists(tokens, max_size=8)
            )
        )
    for field in ("model_name", "routing_group", "lora_name", "extra"):
        if draw(st.booleans()):
            body[field] = draw(names)
    shape = draw(st.sampled_from(["map", "list", "broken"]))
    if shape == "list":
        return json.dumps([body]).encode()
    text = json.dumps(body)
    return (text[: len(text) // 2] if shape == "broken" else text).encode()


def used(answer: tuple) -> tuple:
    """What the server reads of an accepted body (other fields are ignored)."""
    status, ctype, req = answer
    if status != 200:
        return answer
    fields = ("token_ids", "model_name", "routing_group", "lora_name")
    return status, ctype, {f: req.get(f) for f in fields}


@settings(max_examples=500)
@given(bodies())
def test_fast_path_answers_as_the_json_path(body):
    assert used(query_request(body)) == used(parse_query_request(body))


def test_duplicate_fields_and_an_empty_routing_group_are_kept_as_json_reads_them():
    for body in (
        b'{"token_ids": [1], "model_name": "a", "model_name": "b"}',
        b'{"token_ids": [1], "token_ids": [2, 3], "model_name": "m"}',
        b'{"token_ids": [1], "model_name": "m", "routing_group": ""}',
        b'{"token_ids": [true], "model_name": "m"}',
        b'{"token_ids": [1.0], "model_name": "m"}',
        b'\xef\xbb\xbf{"token_ids": [1], "model_name": "m"}',
    ):
        assert used(query_request(body)) == used(parse_query_request(body)), body
