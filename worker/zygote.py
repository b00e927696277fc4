"""python -m batchd.worker.zygote: the process local workers are forked from.

Its frontend's supervisor starts it once, in a session of its own (server/zygote.py).
It imports torch and the worker's modules once, runs no torch op, starts no thread and
touches no CUDA, then forks each worker its frontend asks for: a worker is running its
main in milliseconds, where `python -m batchd.worker` took 1.3 s (2 CPU-s) importing
torch, and the pages of what was imported are shared, copy-on-write.

Its stdin takes one JSON line per worker, the worker's argv; its stdout answers
{"ready": ZYGOTE_PID} once, then {"pid": N} for each worker forked ({"error": why}
if none could be) and {"exit": N, "code": C} as worker N ends (C as Popen's
returncode: the exit status, or -signal). A worker is born as an exec'd one was: in
a session of its own (setsid, done before its pid is told, so that it leads its
process group when its frontend looks), SIGINT and SIGTERM blocked (it unblocks them
once it takes them: supervisor._start), the dispositions a new Python has, stdin
/dev/null, stdout the frontend's (--stdout-fd), stderr this process's (the
frontend's), and none of this process's pipes; it runs the worker's run() as `python
-m batchd.worker ARGV` would and never comes back here. Its --parent-pid is this
process: at EOF on stdin (its frontend stopped them all, or is gone) this process
exits at once, and each worker left sees its parent change and stops, finishing what
it holds, as it did when the frontend it was exec'd by died (a SIGTERM would not do:
a worker its frontend started takes it and does nothing). It ignores SIGINT and
SIGTERM itself: it ends at EOF.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch  # (imported here once: what the fork saves)

import batchd.worker.__main__ as worker_main
from batchd.worker import loader

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def single_threaded() -> bool:
    """Whether this process runs one thread, after a fork with nothing in the child: a
    library's own threads (numpy's OpenBLAS starts its pool at import) stop at a fork
    (their pthread_atfork handlers) and start again at their next use, which never
    comes here. Forked with another thread running, a worker could inherit a lock held."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    return threading.active_count() == 1 and tasks == 1


def fork_safe() -> str:
    """Why no worker may be forked from this process ("": they may)."""
    if torch.cuda.is_initialized():  # (a forked child cannot use CUDA then)
        return "CUDA was initialised by an import"
    if not single_threaded():
        return "more than one thread runs after the imports"
    return ""


class Forker:
    """The zygote's loop: a worker forked for each argv read, each exit told."""

    def __init__(self, requests: int, answers: int) -> None:
        self.requests, self.answers = requests, answers
        self.children: set[int] = set()
        self.dispositions: dict[int, Any] = {s: signal.getsignal(s) for s in SIGNALS}
        self.dispositions[signal.SIGCHLD] = signal.getsignal(signal.SIGCHLD)
        self.wake, self.woken = os.pipe()  # (SIGCHLD writes to `woken`: set_wakeup_fd)
        for fd in (self.wake, self.woken):
            os.set_blocking(fd, False)

    def serve(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)  # (a worker is born with both blocked)
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler: the wakeup fd is written)
        signal.set_wakeup_fd(self.woken, warn_on_full_buffer=False)
        self.answer({"ready": os.getpid()})
        pending, reading = b"", True
        while True:
            self.reap()
            if not reading:
                return  # (EOF: out at once; its workers stop as their parent changes)
            ready, _, _ = select.select([self.requests, self.wake], [], [])
            if self.wake in ready:
                while _drained(self.wake):
                    pass
            if self.requests in ready:
                data = os.read(self.requests, 65536)
                reading, pending = bool(data), pending + data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    self.spawn(json.loads(line))

    def spawn(self, argv: list[str]) -> None:
        settled, told = os.pipe()  # the child closes `told` once it leads its own session
        try:
            pid = os.fork()
        except OSError as e:
            os.close(settled)
            os.close(told)
            self.answer({"error": str(e)})
            return
        if pid == 0:
            os.close(settled)
            _child(argv, told, self.child_setup)
        os.close(told)
        os.read(settled, 1)  # (EOF: its setsid is done, or it is dead)
        os.close(settled)
        self.children.add(pid)
        self.answer({"pid": pid})

    def child_setup(self) -> None:
        """What this process set for itself undone in a worker forked from it."""
        signal.set_wakeup_fd(-1)
        for sig, disposition in self.dispositions.items():
            signal.signal(sig, disposition)
        for fd in (self.requests, self.answers, self.wake, self.woken):
            os.close(fd)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.answer({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def answer(self, message: dict[str, Any]) -> None:
        line = json.dumps(message).encode() + b"\n"
        try:
            while line:
                line = line[os.write(self.answers, line) :]
        except OSError:  # (EPIPE: its frontend is gone; EOF on stdin follows)
            pass


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _child(argv: list[str], told: int, setup: Callable[[], None]) -> None:
    """(In a worker just forked.) Become a worker, as `python -m batchd.worker ARGV`."""
    try:
        os.setsid()
        os.close(told)
        setup()
        loader._PID = os.getpid()  # (forked_off: a model's own fork is told by this pid)
        if "numpy.random" in sys.modules:  # (its seed is the zygote's: each gets its own)
            sys.modules["numpy.random"].seed()
        torch.seed()  # (torch's too: exec'd, each worker drew its own; forked, one shared it)
        sys.modules["__main__"] = worker_main  # (a spawned helper imports no zygote)
        sys.argv = [worker_main.__file__, *argv]
        worker_main.run()  # (it leaves by os._exit: loader.leave)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(1)


def main(argv: list[str]) -> int:
    """argv: [--stdout-fd N]: the frontend's stdout, a worker's stdout."""
    requests, answers = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    out = int(argv[1]) if argv[:1] == ["--stdout-fd"] else null
    os.dup2(out, 1)
    for fd in {null, out}:
        os.close(fd)
    if why := fork_safe():
        print(f"batchd zygote: {why}; not forking", file=sys.stderr)
        return 1
    Forker(requests, answers).serve()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(code)  # (no finalization of torch and every module: 0.3 CPU-s, for nothing)
