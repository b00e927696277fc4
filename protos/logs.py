"""batchd's log lines, shared by the frontend and its workers.

    text: 2026-11-22 07:31:27,849 INFO batchd.dispatch: worker cpu0#0 ready ...
    json: {"ts": "2026-11-22T07:31:27.849Z", "level": "INFO", "logger": "batchd.dispatch",
           "msg": "worker cpu0#0 ready ...", "pid": 123, "worker": "cpu0#0", ...}

Events pass their ids as `extra={"model": ..., "worker": ..., "batch": ...,
"request": ...}`: JSON lines carry them as fields. Nothing is logged per
request at INFO.
"""

from __future__ import annotations

import json
import logging
import time

FIELDS = ("model", "worker", "batch", "request", "device", "reason")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# C0 controls but tab and newline, DEL and C1, written as \xNN: text a client or a model
# put in a message (a model's error may quote a request) cannot clear a terminal,
# return to the line's start, or make grep take the log for binary.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0)) if c not in (9, 10)}
_ESCAPES |= {0x2028: "\\u2028", 0x2029: "\\u2029"}  # (line breaks to splitlines() too)


class TextFormatter(logging.Formatter):
    """A record's first line starts with its time, every line more with spaces: a
    newline in a message continues it, and cannot forge a line of its own."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).translate(_ESCAPES).replace("\n", "\n    ")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        line.update({k: getattr(record, k) for k in FIELDS if hasattr(record, k)})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class CallOver(logging.Filter):
    """gRPC logs an answer its core refused because the call had ended (its caller
    cancelled, or its deadline passed, as the answer went out) at ERROR, with a
    traceback: for a unary call, which returned before, about 1 in 3,000 calls of 5-300
    ms deadlines (review 58b; a stream's write says so itself: server/streaming.py).
    Nothing failed but the caller's wait: DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        refused = type(e).__name__ == "ExecuteBatchError" or str(record.msg).startswith(
            "ExecuteBatchError raised in core"
        )
        if record.levelno < logging.ERROR or not refused:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once, for a frontend or a worker process."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    grpc_core = logging.getLogger("grpc._cython.cygrpc")
    grpc_core.filters[:] = [f for f in grpc_core.filters if not isinstance(f, CallOver)]
    grpc_core.addFilter(CallOver())
    # A model's or a library's warnings (torch's among them) are log lines too: written
    # to stderr by `warnings` itself, they broke the one-JSON-object-a-line stream.
    logging.captureWarnings(True)
