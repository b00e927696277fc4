"""CURVE keys for the frontend<->worker link: who may register as a worker.

    DIR/server.key_secret    the frontend's key pair (stays on the frontend host)
    DIR/server.key           the frontend's public key (copied to every worker host)
    DIR/worker.key_secret    a worker key pair (copied to the worker hosts)
    DIR/worker.key           its public key
    DIR/authorized/*.key     the worker public keys the frontend accepts

`batchd keys generate DIR` writes all of them, with worker.key already in
authorized/. More worker pairs: generate another DIR, copy its worker.key into
the frontend's authorized/ under any name, and restart the frontend. The files
are ZeroMQ certificates (zmq.auth.create_certificates / load_certificate).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

from batchd.protos._toml_reader import ConfigError

SERVER, WORKER, AUTHORIZED = "server", "worker", "authorized"
PAIRS = (SERVER, WORKER)


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 characters
    secret: bytes


def generate(directory: Path) -> list[Path]:
    """Write a server pair, a worker pair and authorized/worker.key; refuse to overwrite."""
    if any((directory / f"{name}.key_secret").exists() for name in PAIRS):
        raise ConfigError(f"{directory}: holds keys already; not overwriting them")
    made = not directory.exists()  # one of the user's (`batchd keys generate ~`) keeps its mode
    (directory / AUTHORIZED).mkdir(mode=0o700, parents=True, exist_ok=True)
    if made:
        os.chmod(directory, 0o700)
    written, umask = [], os.umask(0o077)  # a secret is private from its first byte
    try:  # (pyzmq writes it under the umask: 0644 until a chmod after, in a folder of 0755)
        for name in PAIRS:
            public, secret = zmq.auth.create_certificates(directory, name)
            os.chmod(public, 0o644)
            written += [Path(public), Path(secret)]
    finally:
        os.umask(umask)
    authorized = directory / AUTHORIZED / f"{WORKER}.key"
    shutil.copyfile(directory / f"{WORKER}.key", authorized)
    os.chmod(authorized, 0o644)  # (copied under the caller's umask: 0666 under 000)
    return [*written, authorized]


def warn_loose(log: logging.Logger, *secrets: Path) -> None:
    """A warning for each of `secrets` that other users may read."""
    for path in secrets:
        if path.exists() and path.stat().st_mode & 0o077:
            log.warning("%s is readable by other users: chmod 600 it", path)


def warn_writable(log: logging.Logger, directory: Path) -> None:
    """A warning if others may write `directory`'s authorized/ (or a key in it): whoever
    can add a key there may register as a worker, and see every batch."""
    folder = directory / AUTHORIZED
    with contextlib.suppress(OSError):
        for path in [folder, *folder.iterdir()]:
            if path.stat().st_mode & 0o022:
                log.warning("%s may be written by other users: chmod go-w it (whoever adds "
                            "a key there may register as a worker)", path)  # fmt: skip


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read a CURVE key: {e}") from None
    if secret and secret_key is None:
        raise ConfigError(f"{path}: holds no secret key")
    return public, secret_key


def load_pair(directory: Path, name: str) -> KeyPair:
    public, secret = _load(directory / f"{name}.key_secret", secret=True)
    assert secret is not None
    return KeyPair(public, secret)


def load_public(directory: Path, name: str) -> bytes:
    return _load(directory / f"{name}.key", secret=False)[0]


def load_authorized(directory: Path) -> set[bytes]:
    """The worker public keys in DIR/authorized/ (at least one)."""
    folder = directory / AUTHORIZED
    keys = {_load(p, secret=False)[0] for p in sorted(folder.glob("*.key"))}
    if not keys:
        raise ConfigError(f"{folder}: no worker public keys (*.key); no worker could register")
    return keys


def make_curve_server(socket: zmq.Socket[Any], directory: Path) -> None:
    """Make `socket` (the frontend's ROUTER) a CURVE server; call before bind()."""
    pair = load_pair(directory, SERVER)
    socket.curve_secretkey = pair.secret
    socket.curve_publickey = pair.public
    socket.curve_server = True
    socket.zap_domain = b"batchd"


def make_curve_client(socket: zmq.Socket[Any], directory: Path) -> None:
    """Make `socket` (a worker's DEALER) a CURVE client of the frontend; call before connect()."""
    pair = load_pair(directory, WORKER)
    socket.curve_secretkey = pair.secret
    socket.curve_publickey = pair.public
    socket.curve_serverkey = load_public(directory, SERVER)
