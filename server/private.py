"""Frontend 0's private folder (TMPDIR/batchd-*, 0700) and the Unix sockets in it or
given by flag: the workers' (ipc://), each frontend's for the others (--frontends N),
and the models and tokens a child frontend starts with (at-start.pickle).

A /tmp cleaner may remove any of them while the server runs: each socket is listened
on again (`keep_bound`), the folder made again. A folder of its name that another user
made meanwhile is not trusted (`untrusted`): nothing of ours goes into it, and nothing
read from it is believed (a pickle there would be code run in a child frontend)."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from batchd.protos.model_config import ConfigError

log = logging.getLogger("batchd.server")


def untrusted(folder: Path) -> str:
    """Why `folder` is not one that only this user (or root) may put files in ("": it is;
    a sticky one, /tmp, lets none replace ours): another user who made a folder of its
    name, once a cleaner removed ours, could put a socket or a pickle of theirs there
    (late review 59b)."""
    try:
        st = os.lstat(folder)
    except OSError as e:
        return f"{folder}: {e.strerror or e}"
    mode, ours = st.st_mode, st.st_uid in (os.geteuid(), 0)
    if stat.S_ISDIR(mode) and ours and (not mode & 0o022 or mode & stat.S_ISVTX):
        return ""
    return (f"{folder} is not a folder of this user's (uid {os.geteuid()}) that only it may "
            f"write in: uid {st.st_uid}, {stat.filemode(mode)}")  # fmt: skip


def save(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all (a child may be reading it), 0600 (token digests),
    in a folder that is ours alone (OSError if it is not)."""
    if why := untrusted(path.parent):
        raise PermissionError(why)
    fd = os.open(writing := f"{path}.new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "wb") as f:
        f.write(data)
    os.replace(writing, path)


def read(path: Path) -> bytes:
    """What `save` wrote: OSError if it, or its folder, is not this user's alone."""
    if why := untrusted(path.parent):
        raise PermissionError(why)
    with path.open("rb") as f:
        if (owner := os.fstat(f.fileno()).st_uid) != os.geteuid():
            raise PermissionError(f"{path} is uid {owner}'s, not this user's ({os.geteuid()})")
        return f.read()


def _file(path: str) -> tuple[int, int] | None:
    """Which file `path` is (None: none there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


async def keep_bound(path: str, bind: Callable[[], Any], what: str, every_s: float = 1.0) -> None:
    """Listen on the Unix socket `path` again, `bind()` (awaited if a coroutine's), whenever
    its file is gone (its folders too): a /tmp cleaner that removed the workers' left
    every restarted worker unable to connect, for good, the server live and unready
    (review 58c); a frontend's for the others (--frontends N), every scrape and statistics
    without it. A second listener: closing the first (unbind) cut every worker's
    connection, their work run again (late review 58e). A file another process put there
    (a second server on the same path) is its: said once, not taken back (each took it
    from the other every second). Its folder, made again by another user, is not
    trusted: said, and looked at again each second."""
    folder = os.path.dirname(path)
    bound, said = _file(path), False
    while bound is not None:
        await asyncio.sleep(every_s)
        if (now := _file(path)) == bound:
            continue
        if now is not None:  # (another's: ours cannot be found there again)
            log.warning("%s %s was replaced by another process's; what connects there from "
                        "now reaches that one", what, path)  # fmt: skip
            return
        if not said:
            log.warning("%s %s was removed; listening there again", what, path)
        try:
            os.makedirs(folder, 0o700, exist_ok=True)
            if why := untrusted(Path(folder)):
                raise PermissionError(why)
            if asyncio.iscoroutine(again := bind()):
                await again
        except (OSError, zmq.ZMQError, ConfigError) as e:
            if not said:
                log.error("cannot listen on %s again (%s); trying each second", path, e)
            said = True
            continue
        bound, said = _file(path), False
