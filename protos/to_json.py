"""Protobuf messages as plain JSON values (the HTTP edge's metadata, config, stats,
jobs), integers as numbers: protobuf's own JSON writes 64-bit ones as strings."""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message


def as_json(msg: Message, defaults: bool = False) -> dict[str, Any]:
    """A protobuf message as JSON values, integers as numbers (protobuf's own JSON
    writes 64-bit ones as strings); `defaults`: every field, set or not, but a message
    field that is not set (as protobuf's JSON with default values: its absence says
    something, as a config's dynamic_batching does)."""
    out: dict[str, Any] = {}
    fields = [f for f, _ in msg.ListFields()] if not defaults else [
        f for f in msg.DESCRIPTOR.fields
        if f.is_repeated or f.message_type is None or msg.HasField(f.name)
    ]  # fmt: skip
    for f in fields:
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = {k: _value(v) for k, v in value.items()}
        elif f.is_repeated:
            out[f.name] = [_value(v, f, defaults) for v in value]
        else:
            out[f.name] = _value(value, f, defaults)
    return out


def _value(value: Any, f: Any = None, defaults: bool = False) -> Any:
    if isinstance(value, Message):
        return as_json(value, defaults)
    if f is not None and f.enum_type is not None:
        return f.enum_type.values_by_number[value].name
    return value
