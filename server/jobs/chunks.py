"""A job's input, read a chunk at a time into decoded lines, and a chunk's answers
encoded as results lines (jobs/runner.py runs them).

A chunk is up to CHUNK_LINES lines or CHUNK_BYTES of input. Lines are decoded by
codec.decode_request exactly as online requests are, except that a job's requests
have no deadline (lines.py); a line that does not parse or is refused by the codec
becomes that line's error line.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchd.protos.model_config import ModelConfig
from batchd.server.codec import decode_request
from batchd.server.config import Limits
from batchd.server.errors import BatchdError
from batchd.server.jobs import lines
from batchd.server.request import Request, Tensor

CHUNK_LINES = 256
CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(slots=True)
class Line:
    number: int  # 1-based, in the file
    custom_id: str | None
    request: Request | None = None
    error: lines.LineError | None = None
    future: asyncio.Future[list[Tensor]] | None = None


@dataclass(slots=True)
class Chunk:
    lines: list[Line]
    end_offset: int  # input bytes consumed through this chunk
    lines_read: int  # physical lines consumed through this chunk
    futures: list[asyncio.Future[list[Tensor]]] = field(default_factory=list)


class Reader:
    """The job's input from a byte offset on, a chunk at a time (called in a thread)."""

    def __init__(self, path: Path, offset: int, lines_read: int) -> None:
        self._file = path.open("rb")
        self._file.seek(offset)
        self.offset, self.lines_read = offset, lines_read
        self.eof = False

    def close(self) -> None:
        self._file.close()

    def read(self, model: ModelConfig, limits: Limits) -> Chunk:
        out: list[Line] = []
        size = 0
        while len(out) < CHUNK_LINES and size < CHUNK_BYTES:
            raw, length, too_long = lines.read_line(self._file)
            if not length:
                self.eof = True
                break
            self.offset += length
            self.lines_read += 1
            size += len(raw)
            if too_long:
                error = lines.LineError(None, f"the line is over {lines.MAX_LINE_BYTES} bytes")
                out.append(Line(self.lines_read, None, error=error))
            elif raw.strip():
                out.append(decode(raw, self.lines_read, model, limits))
        return Chunk(out, self.offset, self.lines_read)


def decode(raw: bytes, number: int, model: ModelConfig, limits: Limits) -> Line:
    cid: str | None = None
    try:
        doc = lines.load(raw)
        cid = lines.custom_id_of(doc)
        msg = lines.parse(doc, model.name, model.version)
        request = decode_request(msg, model, time.monotonic(), limits=limits)
    except ValueError as e:
        return Line(number, cid, error=lines.LineError(cid, str(e)))
    except BatchdError as e:
        return Line(number, cid, error=lines.LineError(cid, e.message, e.code.name))
    # The job lane has no deadlines (lines.py): not even the model's default_timeout_us,
    # whose expiry the lane would never answer, leaving the job waiting for ever.
    request.background, request.deadline, request.queue_timeout = True, math.inf, False
    request.level = 0  # the lane has one level, below every online one (not the model's)
    request.id = cid
    return Line(number, cid, request)


def encode(chunk: Chunk, results: list[Any]) -> tuple[bytes, int, int]:
    """The chunk's results lines, and how many answered and failed."""
    parts, ok, failed = [], 0, 0
    for line, result in zip(chunk.lines, results, strict=True):
        if isinstance(result, list):
            assert line.custom_id is not None and line.request is not None
            by_name = {t.name: t for t in result}
            chosen = [by_name[n] for n in line.request.outputs]
            parts.append(lines.encode_outputs(line.custom_id, chosen))
            ok += 1
            continue
        if isinstance(result, lines.LineError):
            code, message = result.code, result.message
        elif isinstance(result, BatchdError):
            code, message = result.code.name, result.message
        else:
            code, message = "INTERNAL", f"{type(result).__name__}: {result}"
        parts.append(lines.encode_error(line.custom_id, code, message, line.number))
        failed += 1
    return b"".join(parts), ok, failed
