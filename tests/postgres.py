"""A private PostgreSQL server for tests, from the distribution's package: initdb
into a temporary folder, listening on a free port of 127.0.0.1 only, trust
authentication, no fsync (a test's data need not outlive it). Installed with
apt-get when missing and the tests run as root; skipped, saying why, otherwise.
initdb refuses to run as root, so as root the server runs as the package's
`postgres` user."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.servers import distro_binary

BINARIES = "/usr/lib/postgresql/*/bin"  # where Debian's postgresql-NN puts them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresServer:
    def __init__(self) -> None:
        initdb = Path(distro_binary("initdb", "postgresql", BINARIES))
        self.bin = initdb.resolve().parent
        # Not under pytest's folders: those are root's alone, and the server may not be root.
        root = Path(tempfile.mkdtemp(prefix="batchd-postgres-"))
        self.root, self.data = root, root / "data"
        self.port = _free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root, and there is no postgres user to run initdb as")
            shutil.chown(root, "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/batchd"

    def _run(self, *cmd: str) -> None:
        done = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{cmd[0]} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")

    def start(self) -> PostgresServer:
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U",
                  "postgres", "-E", "UTF8", "--no-sync")  # fmt: skip
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l",
                  str(self.root / "postgres.log"), "-w", "start")  # fmt: skip
        self._run(str(self.bin / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U",
                  "postgres", "-c", "CREATE DATABASE batchd")  # fmt: skip
        return self

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
