"""batchd's private protobuf descriptor pool (see generate.py for why), and a
check of the protobuf backend that parses every request."""

from __future__ import annotations

import os

from google.protobuf import descriptor_pool
from google.protobuf.internal import api_implementation

POOL = descriptor_pool.DescriptorPool()
FAST_BACKENDS = ("upb", "cpp")


def slow_backend(kind: str | None = None) -> str | None:
    """Why messages will parse slowly in this process, or None when the backend is
    native. The pure-Python one (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python, or a
    platform without wheels) took the frontend's own work per request from 87 to
    301 µs (bench/hotpath.py --saturated, tiny, 2026-11-25)."""
    kind = kind or api_implementation.Type()
    if kind in FAST_BACKENDS:
        return None
    setting = os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION")
    why = f"PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION={setting}" if setting else "no native build"
    return (
        f"protobuf runs its {kind!r} implementation ({why}), not upb: every request "
        "costs the frontend several times the CPU; unset the variable or install a "
        "protobuf wheel for this platform"
    )
