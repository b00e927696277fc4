"""A job's input, read a chunk at a time into decoded lines for its model (job_model),
and a chunk's answers encoded as results lines (jobs/runner.py runs them).

A chunk is up to CHUNK_LINES lines or CHUNK_BYTES of input. Lines are decoded by
codec.decode_request exactly as online requests are, except that a job's requests
have no deadline (lines.py); a line that does not parse or is refused by the codec
becomes that line's error line. A long line's JSON is parsed in the JSON parser
process (parser.py), so that its parse does not hold the GIL the event loop needs.

A chunk's lines are written as they are answered, in input order: `answered()` is
how far its lines are answered without a gap, `written` how far they are in the
results, and `through()` the input offset a checkpoint then covers (the end of the
last line written), so progress moves line by line, not a chunk at a time.
"""

from __future__ import annotations

import asyncio
import errno
import math
import sqlite3
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from batchd.protos.model_config import ModelConfig
from batchd.server import parser
from batchd.server.codec import decode_request
from batchd.server.config import Limits
from batchd.server.errors import BatchdError, clip, first_names
from batchd.server.jobs import lines
from batchd.server.request import Request, Tensor

CHUNK_LINES = 256
CHUNK_BYTES = 4 * 1024 * 1024
YIELD_S = 0.001  # GilYield


@dataclass(slots=True)
class Line:
    number: int  # 1-based, in the file
    custom_id: str | None
    request: Request | None = None
    error: lines.LineError | None = None
    future: asyncio.Future[list[Tensor]] | None = None
    end_offset: int = 0  # input bytes consumed through this line

    def answered(self, cancelling: bool) -> bool:
        """Its result is known: an error line, or its future done (one the job's cancel
        cancelled is not answered; one the core cancelled is, as an error)."""
        f = self.future
        return f is None or (f.done() and not (cancelling and f.cancelled()))

    def result(self) -> object:
        """What encode() takes for an answered line."""
        f = self.future
        if f is None:
            return self.error
        if f.cancelled():
            return asyncio.CancelledError("the line was cancelled in the core")
        e = f.exception()
        return f.result() if e is None else e


@dataclass(slots=True)
class Chunk:
    lines: list[Line]
    end_offset: int  # input bytes consumed through this chunk
    lines_read: int  # physical lines consumed through this chunk
    futures: list[asyncio.Future[list[Tensor]]] = field(default_factory=list)
    written: int = 0  # lines[:written] are in the results

    def submit(self, submit: Callable[[Request], asyncio.Future[list[Tensor]]]) -> None:
        """Its lines' requests to the core (`submit`); one refused is its error line."""
        for line in self.lines:
            if line.request is not None:
                try:
                    line.future = submit(line.request)
                    self.futures.append(line.future)
                except BatchdError as e:
                    line.error = lines.LineError(line.custom_id, e.message, e.code.name)

    @property
    def whole(self) -> bool:
        return self.written == len(self.lines)

    def pending(self) -> asyncio.Future[list[Tensor]] | None:
        """The future of the first line not written, if it is not answered yet."""
        if self.whole:
            return None
        f = self.lines[self.written].future
        return None if f is None or f.done() else f

    def answered(self, cancelling: bool) -> int:
        """The end of the lines answered without a gap from `written` on."""
        end = self.written
        while end < len(self.lines) and self.lines[end].answered(cancelling):
            end += 1
        return end

    def through(self) -> tuple[int, int]:
        """(input offset, lines read) through the lines written: where a resume reads on."""
        if self.whole:
            return self.end_offset, self.lines_read
        assert self.written, "no line of the chunk is written"
        last = self.lines[self.written - 1]
        return last.end_offset, last.number


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
        size, yield_gil = 0, GilYield()
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
                yield_gil()
            else:
                continue
            out[-1].end_offset = self.offset
        return Chunk(out, self.offset, self.lines_read)


class JobFailed(Exception):
    """The job cannot go on (its model is gone): it ends `failed` with this message."""


class ModelGone(JobFailed):
    """The job's model is not here, or has no live worker: shared, given back; else failed."""


class NotOneShot(JobFailed):
    """The job's model is step-wise: its lines would have no one answer each."""


class Stalled(Exception):
    """This server's own storage failed the run (a full or read-only disk, an I/O error):
    not the job's fault, so it runs on from its last checkpoint later, never failed."""


# The errors of a disk or a file system as a whole, which pass or an operator mends: not
# those of one job's files (EFBIG: its results past a size limit; a file that is gone),
# which would fail it again each time it ran
STORAGE = {
    errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM,
    errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EBUSY, errno.ESTALE,
    errno.ENOLCK, errno.ETIMEDOUT, errno.EINTR,
}  # fmt: skip


def stalls(e: BaseException) -> bool:
    """Whether `e` is this server's storage failing (Stalled), not the job or a bug."""
    if isinstance(e, sqlite3.Error):  # (full, locked, read-only, an I/O error: SQLite's)
        return not isinstance(e, sqlite3.ProgrammingError | sqlite3.InterfaceError)
    return isinstance(e, OSError) and e.errno in STORAGE


def job_model(models: Mapping[str, ModelConfig], name: str, version: str) -> ModelConfig:
    """The model a job's lines go to; JobFailed saying why there is none."""
    cfg = models.get(name)
    if cfg is None:
        raise ModelGone(f"model {clip(name)} is not loaded (loaded: {first_names(models)})")
    if version and version != cfg.version:
        raise JobFailed(  # not given back: a version is each server's own count of its loads
            f"model {name!r} has no version {clip(version)} loaded (it has {cfg.version!r})"
        )
    if cfg.generate is not None:
        raise NotOneShot(f"model {name!r} is step-wise (decoupled); jobs run one-shot models only")
    return cfg


def decode(raw: bytes, number: int, model: ModelConfig, limits: Limits) -> Line:
    cid: str | None = None
    try:  # a long line's JSON in the parser process: its parse holds no GIL of the loop's
        cid, msg = parser.run(
            lines.request_of,
            len(raw),
            raw,
            model.name,
            model.version,
            limits,
            len(model.outputs),
            background=True,
        )
        request = decode_request(msg, model, time.monotonic(), limits=limits)
    except lines.LineError as e:  # (a new one: this one's traceback holds the parsed line)
        return Line(number, e.custom_id, error=lines.LineError(e.custom_id, e.message, e.code))
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


def encode(answered: list[Line], results: list[object]) -> tuple[bytes, int, int]:
    """The results lines of answered lines (their Line.result()), and how many answered
    and failed."""
    parts, ok, failed, yield_gil = [], 0, 0, GilYield()
    for line, result in zip(answered, results, strict=True):
        if isinstance(result, list):
            assert line.custom_id is not None and line.request is not None
            by_name = {t.name: t for t in result}
            chosen = [by_name[n] for n in line.request.outputs]
            parts.append(lines.encode_outputs(line.custom_id, chosen))
            ok += 1
            yield_gil()
            continue
        if isinstance(result, lines.LineError):
            code, message = result.code, result.message
        elif isinstance(result, BatchdError):
            code, message = result.code.name, result.message
        else:
            code, message = "INTERNAL", f"{type(result).__name__}: {result}"
        parts.append(lines.encode_error(line.custom_id, code, message, line.number))
        failed += 1
        yield_gil()
    return b"".join(parts), ok, failed


class GilYield:
    """Called between two lines parsed or encoded on a thread: every YIELD_S of work, it
    gives the GIL up, so the event loop's thread, if it waits for it, takes it then,
    not after the interpreter's 5 ms switch interval (the loop gives the GIL up at each
    of its system calls, and waited that long to get it back while a job's chunk was
    read). Not after every line: the loop, busy, then kept the reader from the GIL,
    and jobs ran 4x slower."""

    def __init__(self) -> None:
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._since > YIELD_S:
            time.sleep(0)
            self._since = time.perf_counter()
