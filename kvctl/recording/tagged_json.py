"""Tagged JSON: any value a decoder produces, as JSON and back, losslessly.

Used for what no typed column holds: the ``extra`` and ``batch_extra`` columns of the recording
schema, and the journal's labels and exactly-recorded batches. A few one-key wrappers say what
JSON cannot (bytes, tuples, maps with non-string keys, non-finite floats, timestamps).
"""

from __future__ import annotations

import base64
import datetime
import json
import math
from typing import Any

from ..events import MAX_DEPTH

# MAX_DEPTH (kvctl.events, shared with the decoders): containers nested deeper inside one value
# are not recorded as values: the message is recorded as Malformed with its raw frames.


class NestingTooDeep(ValueError):
    """A value nests containers deeper than :data:`MAX_DEPTH`."""


def to_json_value(v: Any, _depth: int = 0) -> Any:
    """Make ``v`` JSON-safe, losslessly: bytes, tuples, odd maps, non-finite floats and
    timestamps get a one-key ``{"$b"|"$t"|"$m"|"$f"|"$d": ...}`` wrapper, everything else stays
    readable JSON (anything else becomes its ``repr`` under ``"$r"``). Containers nested
    deeper than :data:`MAX_DEPTH` raise :class:`NestingTooDeep` (never a RecursionError)."""
    t = type(v)
    if v is None or t is str or t is bool or t is int:
        return v
    if t is float:
        return v if math.isfinite(v) else {"$f": repr(v)}
    if t is list or t is dict or t is tuple:
        if _depth >= MAX_DEPTH:
            raise NestingTooDeep(f"a value nests deeper than {MAX_DEPTH} levels")
        d = _depth + 1
        if t is list:
            return [to_json_value(x, d) for x in v]
        if t is tuple:
            return {"$t": [to_json_value(x, d) for x in v]}
        if all(type(k) is str and not k.startswith("$") for k in v):
            return {k: to_json_value(x, d) for k, x in v.items()}
        return {"$m": [[to_json_value(k, d), to_json_value(x, d)] for k, x in v.items()]}
    if t is bytes or t is bytearray or t is memoryview:
        return {"$b": base64.b64encode(bytes(v)).decode()}
    if t is datetime.datetime:  # a msgpack timestamp
        return {"$d": v.isoformat()}
    return {"$r": repr(v)}  # not from any decoder; kept as text rather than refused


def from_json_value(v: Any) -> Any:
    """The inverse of :func:`to_json_value`."""
    t = type(v)
    if t is list:
        return [from_json_value(x) for x in v]
    if t is dict:
        if len(v) == 1:
            ((key, x),) = v.items()
            if key == "$b":
                return base64.b64decode(x)
            if key == "$t":
                return tuple(from_json_value(y) for y in x)
            if key == "$m":
                return {from_json_value(k): from_json_value(y) for k, y in x}
            if key == "$f":
                return float(x)
            if key == "$d":
                return datetime.datetime.fromisoformat(x)
            if key == "$r":
                return x
        return {k: from_json_value(x) for k, x in v.items()}
    return v


def dumps(obj: Any) -> str:
    """Compact JSON (no spaces; NaN refused: tagged values never hold one)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)
