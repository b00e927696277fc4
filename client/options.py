"""The command-line options every client command shares: how to reach a secured server."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_security(p: argparse.ArgumentParser) -> None:
    sec = p.add_argument_group("a secured server (see README, Security)")
    sec.add_argument("--tls", action="store_true", help="TLS, verified against the system's CAs")
    sec.add_argument("--ca-cert", help="PEM CA to verify the server against (implies --tls)")
    sec.add_argument("--client-cert", help="PEM client certificate (mutual TLS)")
    sec.add_argument("--client-key", help="PEM key of --client-cert")
    sec.add_argument("--token-file", help="file holding the bearer token to send")


def connection(args: argparse.Namespace) -> dict[str, Any]:
    """Client keyword arguments for the server's TLS and token settings."""
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    return {
        "tls": args.tls,
        "ca_cert": args.ca_cert,
        "client_cert": args.client_cert,
        "client_key": args.client_key,
        "token": token,
    }
