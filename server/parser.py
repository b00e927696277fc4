"""Large JSON parsed in a child process, so that no parse holds the frontend's GIL.

orjson parses a document in one C call, and the lists it makes become numpy arrays
in another: the thread that runs them keeps the GIL throughout, and the event loop
waits. An 8 MiB inference header (the most json_body takes) or job line held it
75-240 ms (bench/big_json.py); every caller of the frontend waited with it. So
`run(fn, size, *args)` calls `fn(*args)` here when `size` is at most ASIDE_BYTES
(a few milliseconds of parsing at most) or on the event loop's own thread, and
else in one child process (`python -m batchd.server.parser`), started at the first
large document and kept; a job's lines (`background`) in another such child, so that
an online document never waits for one (a shared child held an online call behind a
hostile job's lines 1.1-1.6 s each, review 53a). The calling thread (the decode
thread, a job's reader) waits for it without the GIL. What a parse leaves on the heap
stays in the child, which gives it back to the system when idle: it has no event loop
to stall.

One document at a time in each child. `fn` and what it returns or raises cross as
pickles (fn by reference: a module-level function).
Every wait is bounded: an online turn, and a document's answer, by TIMEOUT_S
(Unavailable; a child that does not answer is killed); a job's line waits its
turn. A child that dies is started again and the document tried once more;
dying again, it fails with INTERNAL (ParserLost).
A child that cannot start (it says it is ready first) leaves documents parsed
here for NO_CHILD_S. The child ends with its pipe, or with the server (PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import fcntl
import gc
import logging
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from batchd.server.errors import BatchdError, Unavailable

log = logging.getLogger("batchd.parser")
T = TypeVar("T")
ASIDE_BYTES = 256 * 1024  # a larger document is parsed in the child
TIMEOUT_S = 10.0  # for a turn, and for an answer (8 MiB of nested JSON: ~0.2 s)
START_S = 30.0  # for a new child to say it is ready
NO_CHILD_S = 60.0  # after a child could not start, documents are parsed here this long
IDLE_S = 0.2  # the child gives its free heap back after this long without a document
_HEAD = 8  # bytes of a frame's length
_READY = b"ready"
_PIPE_BYTES = 1 << 20  # (F_SETPIPE_SZ: fewer round trips for a document of megabytes)


# Threads to call run() from for a document the child parses: each waits for it without
# the GIL, the decode thread kept for decoding (one client's hostile 8 MiB bodies held it
# 3-7 s each, every large request of the others 2-20 s behind them: review 57c).
WAITING = ThreadPoolExecutor(4, thread_name_prefix="batchd-parse")


class ParserLost(BatchdError):
    """The child ended twice while it parsed one document (INTERNAL)."""


class _NoChild(Exception):
    """A child that could not start."""


def _frame(obj: object) -> tuple[bytes, bytes]:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return len(data).to_bytes(_HEAD, "little"), data


def _wait(fd: int, event: int, deadline: float) -> None:
    """Till `fd` is ready for `event` (or hung up); TimeoutError at `deadline`."""
    left = deadline - time.monotonic()
    poll = select.poll()
    poll.register(fd, event)
    if left <= 0 or not poll.poll(None if left == float("inf") else left * 1000):
        raise TimeoutError


def _send(fd: int, obj: object, deadline: float) -> None:
    for part in _frame(obj):
        view = memoryview(part)
        while view:
            _wait(fd, select.POLLOUT, deadline)
            with contextlib.suppress(BlockingIOError):
                view = view[os.write(fd, view[:_PIPE_BYTES]) :]


def _receive(fd: int, deadline: float) -> bytearray:
    """One frame's pickle; EOFError at the pipe's end."""

    def exactly(n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            _wait(fd, select.POLLIN, deadline)
            with contextlib.suppress(BlockingIOError):
                data = os.read(fd, min(n - got, _PIPE_BYTES))
                if not data:
                    raise EOFError("the pipe ended")
                view[got : got + len(data)] = data
                got += len(data)
        return buf

    return exactly(int.from_bytes(exactly(_HEAD), "little"))


class _Child:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._busy = False  # a document in the child
        # Turns go in the order they were asked (tickets): the first free thread took it,
        # and a request behind one client's hostile documents waited out 10 s and was
        # refused (1 in 15-37, late review 57d); `_gone`: tickets of those that gave up.
        self._tickets = self._serving = 0
        self._gone: set[int] = set()
        self._proc: subprocess.Popen[bytes] | None = None
        self._no_child_until = 0.0
        self.pid = 0

    def call(self, fn: Callable[..., T], args: tuple[Any, ...], background: bool) -> T:
        self._take_turn(background)
        try:
            return self._call(fn, args, background)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def _take_turn(self, background: bool) -> None:
        """A job's line waits as long as it takes (each turn ends within TIMEOUT_S):
        refused, it would be an error line for good."""
        with self._cv:
            ticket, self._tickets = self._tickets, self._tickets + 1
            turn = lambda: not self._busy and self._serving == ticket  # noqa: E731
            if not self._cv.wait_for(turn, None if background else TIMEOUT_S):
                self._gone.add(ticket)  # (its turn, if it comes, passes on)
                self._next()
                raise Unavailable(f"the JSON parser was busy for {TIMEOUT_S:g} s; retry later")
            self._busy, self._serving = True, ticket + 1
            self._next()

    def _next(self) -> None:
        """The turn passes over tickets given up (with the lock held)."""
        while self._serving in self._gone:
            self._gone.discard(self._serving)
            self._serving += 1
        self._cv.notify_all()

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...], background: bool) -> T:
        """Once more after a child that died, or for a job's line (which has no
        deadline, and cannot be sent again) one that did not answer."""
        for attempt in range(2):
            if time.monotonic() < self._no_child_until:
                return fn(*args)
            try:
                proc = self._proc or self._start()
            except _NoChild as e:  # (a broken install, no memory, no pids): parse here
                log.error("cannot start the JSON parser process (%s); large JSON is parsed "
                          "on the frontend's threads for %g s", e, NO_CHILD_S)  # fmt: skip
                self._no_child_until = time.monotonic() + NO_CHILD_S
                return fn(*args)
            assert proc.stdin is not None and proc.stdout is not None
            deadline = time.monotonic() + TIMEOUT_S
            try:
                _send(proc.stdin.fileno(), (fn, args), deadline)
                answer = _receive(proc.stdout.fileno(), deadline)
            except TimeoutError:
                self._lost(proc)
                log.warning("the JSON parser process did not answer in %g s: killed", TIMEOUT_S)
                if background and not attempt:
                    continue
                raise Unavailable(f"the JSON parser process did not answer within {TIMEOUT_S:g} "
                                  "s; it was restarted: retry") from None  # fmt: skip
            except BaseException as e:  # a frame half sent or read: no later caller's
                code = self._lost(proc)  # answer may be this one's rest
                if not isinstance(e, OSError | EOFError):
                    raise
                log.warning("the JSON parser process ended (%s, exit %s)", e, code)
                if attempt:
                    raise ParserLost(f"the JSON parser process ended (exit {code}) twice while "
                                     "it read this document") from None  # fmt: skip
                continue
            try:
                ok, value = pickle.loads(answer)
            except Exception as e:  # (the frame was read whole: the child is in step)
                raise BatchdError(f"the parser process's answer did not unpickle: {e}") from None
            if ok:
                return value  # type: ignore[no-any-return]
            try:
                raise value
            finally:  # its traceback keeps this frame: neither a cycle (value) nor the document
                del value, args  # (an inflated body counts until freed, http_site.InflateBudget)
        raise AssertionError("unreachable")

    def _start(self) -> subprocess.Popen[bytes]:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "batchd.server.parser", str(os.getpid())], bufsize=0,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                start_new_session=True,  # (a Ctrl-C to the server's group is not its)
            )  # fmt: skip
        except OSError as e:
            raise _NoChild(str(e)) from None
        assert proc.stdin is not None and proc.stdout is not None
        for pipe in (proc.stdin, proc.stdout):
            os.set_blocking(pipe.fileno(), False)
            with contextlib.suppress(OSError, AttributeError):
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        try:
            said = bytes(_receive(proc.stdout.fileno(), time.monotonic() + START_S))
        except (OSError, EOFError, TimeoutError) as e:
            said = repr(e).encode()
        if said != _READY:
            code = self._lost(proc)
            raise _NoChild(f"it exited {code} before it was ready: {said[:200]!r}")
        self._proc, self.pid = proc, proc.pid
        return proc

    def _lost(self, proc: subprocess.Popen[bytes]) -> int | None:
        if self._proc is proc:
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
        with self._cv:
            self._cv.wait_for(lambda: not self._busy, TIMEOUT_S)
            if self._proc is not None:
                self._lost(self._proc)
            self._no_child_until = 0.0


_child, _jobs_child = _Child(), _Child()  # online documents', a job's lines'


def run(fn: Callable[..., T], size: int, *args: Any, background: bool = False) -> T:
    """`fn(*args)`, in the child when `size` (the document's bytes) passes ASIDE_BYTES,
    but not on an event loop's thread (whose callers wait on no process); `background`:
    a job's line, parsed in a child of its own, which has no deadline."""
    if size <= ASIDE_BYTES or _on_a_loop():
        return fn(*args)
    return (_jobs_child if background else _child).call(fn, args, background)


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def child_pid(background: bool = False) -> int:
    """The online documents' child's pid (`background`: the job lines'); 0: none runs."""
    return (_jobs_child if background else _child).pid


def close() -> None:
    """End the children, if they run (they end with the server anyway), and forget one
    that could not start."""
    _child.close()
    _jobs_child.close()


def _refuse(message: str) -> None:
    raise BatchdError(message)


def _portable(e: Exception) -> Exception:
    """`e`, or a BatchdError saying it, where `e` would not come out of a pickle."""
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:
        return BatchdError(f"{type(e).__name__}: {e}")
    return e


def _serve(inp: int, out: int, server: int) -> None:
    """The child: answer each frame on `inp` with a frame on `out`, till `inp` ends;
    `server`: its parent's pid."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    with contextlib.suppress(AttributeError):  # (Linux) killed with the server, even stopped
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != server:
        return  # (the server went before prctl; not ppid 1: the server may be pid 1)
    trim = getattr(libc, "malloc_trim", lambda _: 0)
    for part in (len(_READY).to_bytes(_HEAD, "little"), _READY):
        os.write(out, part)
    never = float("inf")
    while True:
        if not select.select([inp], [], [], IDLE_S)[0]:
            trim(0)  # idle: give the free heap back (no event loop here for it to stall)
        try:
            frame = _receive(inp, never)
        except EOFError:
            return
        try:
            fn, args = pickle.loads(frame)
        except Exception as e:  # (the frame was read whole: the next is in step)
            fn, args = _refuse, (f"the parser process could not take the call: {e}",)
        gc.disable()  # (a document's millions of lists set off collection after collection,
        try:  # each walking them all: 2.7M empty lists took 2.25 s, 0.39 s without: 57c)
            answer: tuple[bool, object] = (True, fn(*args))
        except Exception as e:  # the caller's to raise (InvalidInput, ValueError, ...)
            answer = (False, _portable(e))
        finally:
            gc.enable()
        _send(out, answer, never)
        del frame, fn, args, answer


if __name__ == "__main__":
    pipe = os.dup(1)
    os.dup2(2, 1)  # a print() anywhere goes to the log, not into the answers' pipe
    _serve(0, pipe, int(sys.argv[1]))
