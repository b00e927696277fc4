"""A request body's JSON: what the HTTP paths read an object from.

orjson parses it; a body that orjson refuses but that holds NaN or Infinity
(Python's json, and so tritonclient.http, writes them) is read by Python's json,
which also lets through what orjson refuses on purpose: a string holding half a
UTF-16 surrogate pair, which no UTF-8 (nor protobuf) can carry on. Such a body
is refused here, as orjson refuses it, not failed later as a defect.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

from batchd.server.errors import InvalidInput

MAX_JSON_BYTES = 8 * 1024 * 1024  # of JSON in one body: tensors beyond go in binary form


def json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, int | float) else "null"
    )


def _refuse_lone_surrogates(value: Any, what: str) -> None:
    """InvalidInput for a string (or key) holding half a UTF-16 surrogate pair, which
    no UTF-8 can carry on: walked without recursion, as deep as Python's json read."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError as e:
                raise InvalidInput(
                    f"{what} is not valid JSON: a string holds a lone UTF-16 surrogate "
                    f"(\\u{ord(item[e.start]):x} at character {e.start})"
                ) from None


def _finite(text: str) -> float:
    """A number literal as Python's json reads it, but one past a double's range (1e999)
    is refused as orjson refuses it: the NaN and Infinity constants are not literals."""
    if math.isinf(value := float(text)):
        raise ValueError(f"number {text[:20]} is infinity when parsed as double")
    return value


def with_nan(raw: bytes, what: str) -> Any:
    """What orjson refused, read by Python's json where it holds NaN or Infinity (which
    Python's json, and so tritonclient.http, writes), its strings checked for lone
    surrogates (InvalidInput: orjson refuses them, Python's json does not); None where
    it holds neither or Python's json does not read it either. InvalidInput past Python's
    json's depth (for a job's line too: it was orjson's message about the NaN)."""
    if b"NaN" not in raw and b"Infinity" not in raw:
        return None
    try:
        value = json.loads(raw, parse_float=_finite)
    except ValueError:  # (orjson's reason is the one told: for 1e999, "infinity")
        return None
    except RecursionError:  # past the interpreter's limit: 1,000 levels on 3.11, 8,000 on 3.12
        raise InvalidInput(
            f"{what} is not valid JSON: it holds NaN or Infinity, read by Python's json, "
            "and nests deeper than Python's json reads (a tensor's data: at most 32 levels)"
        ) from None
    _refuse_lone_surrogates(value, what)
    return value


def load_json(body: bytes | memoryview, what: str = "the request body") -> dict[str, Any]:
    """A JSON object, or InvalidInput saying where the JSON broke. At most MAX_JSON_BYTES:
    parsing holds the GIL (about 0.3 s per 20 MB here, more for deep nesting), so larger
    tensors must come in binary form. NaN and Infinity, which Python's json (and so
    tritonclient.http) writes, are read too."""
    if len(body) > MAX_JSON_BYTES:
        raise InvalidInput(
            f"{what} is {len(body)} bytes of JSON, more than {MAX_JSON_BYTES}: send large "
            "tensors in binary form (binary_data_size, Inference-Header-Content-Length)"
        )
    try:  # (orjson takes no subclass of bytearray: an inflated body, http_site.Inflated)
        value = orjson.loads(memoryview(body))
    except orjson.JSONDecodeError as e:
        value = with_nan(bytes(body), what)
        if value is None:
            raise InvalidInput(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{what} must be a JSON object, got {json_kind(value)}")
    return value
