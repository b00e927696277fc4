"""Render the load balancers' configurations for batchd replicas.

    python deploy/render.py haproxy --listen 0.0.0.0:8001 --replica 10.0.0.11:8001 ... > haproxy.cfg
    python deploy/render.py nginx   --listen 0.0.0.0:8001 --replica 10.0.0.11:8001 ... > nginx.conf

deploy/haproxy/haproxy.cfg and deploy/nginx/nginx.conf are this script's output
for three replicas (tests/test_balancers.py checks that they still are).

haproxy's HTTP health check cannot send a gRPC request (a body, HTTP/2 framing),
so its check is a tcp-check that sends one whole `grpc.health.v1.Health/Check`
call as HTTP/2 frames and expects the bytes of a SERVING answer: those bytes are
built here, frame by frame, not pasted.
"""

from __future__ import annotations

import argparse
import re
import struct
import sys

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, HEADERS, DATA = 0x4, 0x1, 0x0
END_STREAM, END_HEADERS = 0x1, 0x4
SERVING, NOT_SERVING = 1, 2  # grpc.health.v1.HealthCheckResponse.ServingStatus


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    """One HTTP/2 frame (RFC 9113 4.1)."""
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _hpack_string(s: str) -> bytes:
    data = s.encode()
    assert len(data) < 127, "one-byte length prefix, no Huffman coding"
    return bytes([len(data)]) + data


def hpack_literal(headers: list[tuple[str, str]]) -> bytes:
    """A header block of literal fields without indexing, new names (RFC 7541 6.2.2):
    valid for any decoder, with no dynamic table to keep in step."""
    return b"".join(b"\x00" + _hpack_string(k) + _hpack_string(v) for k, v in headers)


def grpc_message(payload: bytes) -> bytes:
    """gRPC's length-prefixed message: not compressed, a 4-byte big-endian length."""
    return b"\x00" + struct.pack(">I", len(payload)) + payload


def health_check_request(service: str = "", authority: str = "batchd") -> bytes:
    """The bytes of a whole Health/Check call on a new connection: the preface, empty
    SETTINGS, HEADERS and one DATA frame ending the stream (HealthCheckRequest.service
    is field 1, a string; empty: the server as a whole)."""
    body = b"" if not service else b"\x0a" + _hpack_string(service)
    headers = hpack_literal([
        (":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Check"),
        (":authority", authority), ("content-type", "application/grpc"), ("te", "trailers"),
    ])  # fmt: skip
    return (
        PREFACE
        + frame(SETTINGS, 0, 0, b"")
        + frame(HEADERS, END_HEADERS, 1, headers)
        + frame(DATA, END_STREAM, 1, grpc_message(body))
    )


def health_check_reply(status: int = SERVING) -> bytes:
    """The gRPC message of a HealthCheckResponse with `status` (field 1, a varint), as it
    appears in the server's DATA frame."""
    return grpc_message(bytes([0x08, status]))


def haproxy(listen: str, replicas: list[str]) -> str:
    servers = "\n".join(f"    server replica{i} {r} check" for i, r in enumerate(replicas, 1))
    return f"""\
# batchd replicas behind haproxy (rendered by deploy/render.py; do not edit by hand).
# gRPC is HTTP/2: every call is a stream, and haproxy picks a replica per stream,
# so one client connection spreads over every replica (kube-proxy and other L4
# balancers pin it to one). Run each replica with --max-connection-age 0: ageing
# moves clients an L4 balancer pinned, and haproxy's own connections to a replica
# need none; a replica's GOAWAY as one aged out cut a call short now and then
# (UNKNOWN "Stream removed": 2 of 24,000 calls, haproxy 2.6, a 2 s age).
global
    maxconn 4096            # each connection takes two file descriptors: raise both together
    # A call lost with its replica is sent again only while haproxy holds its request
    # whole in one buffer: 16 KiB by default, so 2-4 mlp calls of 16 rows (32 KB) failed
    # each SIGKILL. Larger requests fail UNAVAILABLE then (the client's to retry). Each
    # stream in use holds up to two buffers, taken as needed (maxconn counts connections,
    # each of up to 100 streams): size memory by the calls in flight, 128 KiB each.
    tune.bufsize 65536

defaults
    mode http
    timeout connect 2s
    timeout client 10m      # long streams (step-wise outputs, job uploads and results)
    timeout server 10m
    # The server keeps the check's connection open after answering: a NOT_SERVING
    # answer fails the check when this runs out (a healthy one takes a few ms).
    timeout check 500ms

frontend grpc
    bind {listen} proto h2
    default_backend batchd

backend batchd
    balance roundrobin
    # A call that got no answer is sent again to another replica: the replica's port
    # refused it, or it closed the connection or the stream without an answer (it
    # died; it refused the stream after its GOAWAY, draining). Inference calls have
    # no side effects, so a retry cannot repeat one that counted. Only calls whose
    # request haproxy still holds whole can be retried (not a stream still being sent).
    retry-on conn-failure empty-response
    retries 3
    option redispatch 1
    # A job submission has one: a replica that stored the job and died before its
    # answer would get it twice. Sent again only when no replica took the connection
    # (a stopping one's refusal carries a pushback; the client sends that one again).
    http-request disable-l7-retry if {{ path /batchd.jobs.v1.Jobs/SubmitJob }}
    # The active health check: one grpc.health.v1.Health/Check call as raw HTTP/2
    # frames; a replica is up only while it answers SERVING (NOT_SERVING while its
    # models load, after it lost its workers, and once it drains).
    option tcp-check
    tcp-check connect
    tcp-check send-binary {health_check_request().hex()}
    tcp-check expect binary {health_check_reply(SERVING).hex()}
    default-server proto h2 inter 500ms fall 2 rise 2
{servers}
"""


def nginx(listen: str, replicas: list[str]) -> str:
    servers = "\n".join(f"        server {r} max_fails=1 fail_timeout=2s;" for r in replicas)
    return f"""\
# batchd replicas behind nginx (rendered by deploy/render.py; do not edit by hand).
# grpc_pass balances per call (per HTTP/2 stream). nginx's open-source build has no
# active health check: a replica is skipped for fail_timeout after a failed call,
# and a call goes to the next replica (grpc_next_upstream) only if it never reached
# one: nginx streams a gRPC request to its replica, so none is sent twice (a job
# submission neither). haproxy (deploy/haproxy) is the recommended one. Run each
# replica with --max-connection-age 0: ageing moves clients an L4 balancer pinned.
worker_processes 1;
error_log stderr warn;
pid nginx.pid;
events {{ worker_connections 4096; }}

http {{
    access_log off;
    client_body_temp_path body;
    upstream batchd {{
{servers}
        keepalive 32;
    }}
    server {{
        listen {listen} http2;
        client_max_body_size 0;         # off: an upload is one stream; batchd limits its own
        grpc_read_timeout 10m;
        grpc_send_timeout 10m;
        location / {{
            grpc_pass grpc://batchd;
            grpc_next_upstream error timeout non_idempotent;
            grpc_next_upstream_tries 3;
        }}
    }}
}}
"""


HOST = r"\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.-]+)?\]|[A-Za-z0-9_.-]+"  # [v6%zone], a name, v4


def host_port(text: str, listen: bool = False) -> str:
    """HOST:PORT ([v6]:PORT; to listen on, *:PORT and :PORT too), port 1-65535, nothing
    else: a value without its port gave an nginx config that sends gRPC to port 80, and
    one with a space or a newline a haproxy server line with other options (or without
    its health check)."""
    m = re.fullmatch(f"({HOST}{'|[*]|' if listen else ''}):([0-9]{{1,5}})", text)
    if m is None or not 1 <= int(m.group(m.lastindex or 0)) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (port 1-65535), got {text[:80]!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("balancer", choices=["haproxy", "nginx"])
    p.add_argument("--listen", default="0.0.0.0:8001", type=lambda t: host_port(t, True),
                   help="address:port the balancer binds")  # fmt: skip
    p.add_argument("--replica", action="append", required=True, metavar="HOST:PORT",
                   type=host_port,
                   help="a batchd replica's gRPC address (repeat for each)")  # fmt: skip
    args = p.parse_args(argv)
    render = haproxy if args.balancer == "haproxy" else nginx
    sys.stdout.write(render(args.listen, args.replica))
    return 0


if __name__ == "__main__":
    sys.exit(main())
