"""Test-time certificates (the openssl CLI) and tokens, for the security tests."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")

INFER_TOKEN = "infer-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"


# ---- certificates ----


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-set_serial", str(time.monotonic_ns()), "-days", "1", "-out", f"{name}.pem",
        "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip


def make_certs(d: Path) -> Path:
    """ca.pem signs server.pem (127.0.0.1, localhost) and client.pem; stranger-ca signs
    stranger.pem, a client certificate the server must not accept."""
    _ca(d, "ca")
    _ca(d, "stranger-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "stranger", "stranger-ca", "extendedKeyUsage=clientAuth\n")
    return d


def write_tokens(path: Path) -> Path:
    path.write_text(f"# batchd tokens\ninfer: {INFER_TOKEN}\n\nadmin: {ADMIN_TOKEN}  # ops\n")
    path.chmod(0o600)
    return path
