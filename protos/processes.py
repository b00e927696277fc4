"""The processes below one: what a model's code started in its worker, ended with it.

A worker its frontend started ignores SIGTERM (a signal to the whole process group,
systemd stopping the unit, must not end it while its frontend drains), and so does
every process a model's code forks or spawns from it: multiprocessing's terminate()
at the worker's exit ended none of them, and they lived on (review 52e, 53e). The
worker ends its own with SIGKILL as it leaves (worker/loader.leave), and the frontend
a worker's with the worker when it kills a hung one (server/supervisor.py). Linux
only (/proc); elsewhere there is nothing to find.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """The pids below `pid` (children first), from one read of /proc."""
    below: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    # (the name, in parentheses, may hold spaces: the state and ppid follow)
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    below.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in below.get(todo.pop(), []):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of `pids` that is still there."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
