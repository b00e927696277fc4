"""Large JSON parsed in a child process, so that no parse holds the frontend's GIL.

orjson parses a document in one C call, and the lists it makes become numpy arrays
in another: the thread that runs them keeps the GIL throughout, and the event loop
waits. An 8 MiB inference header (the most json_body takes) or job line held it
75-240 ms (bench/big_json.py); every caller of the frontend waited with it. So
`run(fn, size, *args)` calls `fn(*args)` here when `size` is at most ASIDE_BYTES
(a few milliseconds of parsing at most), and else in one child process
(`python -m batchd.server.parser`), started at the first large document and kept.
The calling thread (the decode thread, a job's reader) waits for it without the
GIL. What a parse leaves on the heap stays in the child, which gives it back to
the system after each large document: it has no event loop for malloc_trim to stall.

One document at a time: calls from several threads take turns. `fn` and what it
returns or raises cross as pickles (fn by reference: a module-level function).
The child ends when its pipe does, the server's end included. A child that dies
(killed, out of memory) is started again and the document tried once more; if it
dies again, the call fails with INTERNAL and the next document gets a new child.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, Any, TypeVar

from batchd.server.errors import BatchdError

log = logging.getLogger("batchd.parser")
T = TypeVar("T")
ASIDE_BYTES = 256 * 1024  # a larger document is parsed in the child
_HEAD = 8  # bytes of a frame's length


class ParserLost(BatchdError):
    """The child ended twice while it parsed one document (INTERNAL)."""


def _write(out: IO[bytes], obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(len(data).to_bytes(_HEAD, "little"))
    out.write(data)  # (not joined to its head: a document of megabytes is not copied again)
    out.flush()


def _read(inp: IO[bytes]) -> bytes:
    """One frame's pickle."""
    head = inp.read(_HEAD)
    if len(head) < _HEAD:
        raise EOFError("the pipe ended")
    size = int.from_bytes(head, "little")
    data = inp.read(size)
    if len(data) < size:
        raise EOFError("the pipe ended within a frame")
    return data


class _Child:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self.pid = 0

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            for attempt in range(2):
                try:
                    proc = self._proc or self._start()
                except OSError as e:  # no process to be had (pids, memory): parse it here
                    log.warning("cannot start the JSON parser process (%s): parsing here", e)
                    return fn(*args)
                try:
                    assert proc.stdin is not None and proc.stdout is not None
                    _write(proc.stdin, (fn, args))
                    answer = _read(proc.stdout)
                except (OSError, EOFError) as e:
                    code = self._lost(proc)
                    log.warning("the JSON parser process ended (%s, exit %s)", e, code)
                    if attempt:
                        raise ParserLost(
                            f"the JSON parser process ended (exit {code}) twice while it "
                            "read this document; the server log has more"
                        ) from None
                    continue
                try:
                    ok, value = pickle.loads(answer)
                except Exception as e:  # (the frame was read whole: the child is in step)
                    raise BatchdError(
                        f"the parser process's answer did not unpickle: {e}"
                    ) from None
                if ok:
                    return value  # type: ignore[no-any-return]
                raise value
        raise AssertionError("unreachable")

    def _start(self) -> subprocess.Popen[bytes]:
        self._proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "batchd.server.parser"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            start_new_session=True,  # (a Ctrl-C to the server's group is not its)
        )  # fmt: skip
        self.pid = self._proc.pid
        return self._proc

    def _lost(self, proc: subprocess.Popen[bytes]) -> int | None:
        self._proc, self.pid = None, 0
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        for pipe in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                pipe and pipe.close()
        return proc.returncode

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                proc = self._proc
                with contextlib.suppress(OSError):
                    proc.stdin and proc.stdin.close()  # it ends at its pipe's end
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                if proc.stdout:
                    proc.stdout.close()
                self._proc, self.pid = None, 0


_child = _Child()


def run(fn: Callable[..., T], size: int, *args: Any) -> T:
    """`fn(*args)`, in the child when `size` (the document's bytes) passes ASIDE_BYTES."""
    if size <= ASIDE_BYTES:
        return fn(*args)
    return _child.call(fn, *args)


def child_pid() -> int:
    """The child's pid (0: none running)."""
    return _child.pid


def close() -> None:
    """End the child, if one runs (the server's stop; it ends with the server anyway)."""
    _child.close()


def _trim() -> Callable[[], object]:
    """glibc's malloc_trim (hands the freed heap back to the system), or nothing."""
    name = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    return (lambda: fn(0)) if fn is not None else (lambda: None)


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    trim = _trim()
    while True:
        try:
            frame = _read(inp)
        except EOFError:
            return
        try:
            fn, args = pickle.loads(frame)
        except Exception as e:  # (the frame was read whole: the next is in step)
            fn, args = _refuse, (f"the parser process could not take the call: {e}",)
        try:
            answer: tuple[bool, object] = (True, fn(*args))
        except Exception as e:  # the caller's to raise (InvalidInput, ValueError, ...)
            answer = (False, _portable(e))
        _write(out, answer)
        del frame, fn, args, answer
        trim()


def _refuse(message: str) -> None:
    raise BatchdError(message)


def _portable(e: Exception) -> Exception:
    """`e`, or a BatchdError saying it, where `e` would not come out of a pickle."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return BatchdError(f"{type(e).__name__}: {e}")
    return e


if __name__ == "__main__":
    pipe = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a print() anywhere goes to the log, not into the answers' pipe
    _serve(sys.stdin.buffer, pipe)
