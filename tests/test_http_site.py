"""The HTTP edge's connection bounds (server/http_site.py), against real servers:
compressed bodies inflated off the loop and only to the body limit, encodings it
cannot read refused before the body, HEAD on every GET route, and an answer its
caller never reads dropped with its connection."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.client
import json
import random
import socket
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from aiohttp import streams, web
from aiohttp.test_utils import make_mocked_request

from batchd.client import Client
from batchd.server import http_site, parser
from batchd.server.config import Connections
from batchd.server.errors import QueueFull
from batchd.server.http_site import PIECE, InflateBudget, Inflated, Inflating, same_site
from batchd.server.jobs.service import JobsService
from batchd.server.rest import INLINE_BYTES, RestApi, _aside
from tests.servers import ServerProcess, wait_for
from tests.test_rest import TINY, assert_serving, call, tiny_body, triton_http

BIG_ROW = 4_000_000  # FP32 values in one row of `wide`'s answer: 16 MB


@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "deflate"])
def test_compressed_bodies_are_answered_as_plain_ones(
    example_server: ServerProcess, coding: str
) -> None:
    """tritonclient.http compresses bodies on request (gzip or deflate): the answer is
    the one the same body gets uncompressed."""
    body = json.dumps(tiny_body(0.5)).encode()
    packed = zlib.compress(body) if coding == "deflate" else gzip.compress(body)
    plain = call(example_server, "POST", TINY, body)
    got = call(example_server, "POST", TINY, packed, {"Content-Encoding": coding.upper()})
    assert plain.status == got.status == 200, got.body[:300]
    assert got.json()["outputs"] == plain.json()["outputs"]
    # every JSON route, not only infer: these were "not valid JSON" once inflated
    generate = {"id": "g", "PROMPT": [5, 6, 7], "MAX_NEW_TOKENS": 3}
    for path, doc in [
        ("/v2/models/decoder/generate", generate),
        ("/v2/models/decoder/generate_stream", generate),
        ("/v2/repository/index", {"ready": True}),
    ]:
        body = json.dumps(doc).encode()
        packed = zlib.compress(body) if coding == "deflate" else gzip.compress(body)
        plain = call(example_server, "POST", path, body)
        got = call(example_server, "POST", path, packed, {"Content-Encoding": coding})
        assert plain.status == got.status == 200, (path, got.body[:300])
        assert got.body == plain.body, path


@pytest.mark.parametrize(
    ("accept", "coding"),
    [("gzip", "gzip"), ("deflate", "deflate"), ("deflate;q=0.5, GZIP", "gzip"),
     ("gzip;q=0, deflate;q=0.2", "deflate"), ("gzip;q=0", ""), ("br", ""), ("*", "gzip"),
     ("identity", ""), ("gzip;q=nan, deflate;q=x", ""), ("deflate, *", "deflate"),
     ("gzip;q=0, *", "deflate"), ("identity;q=1, gzip;q=0.5", ""), ("gzip, identity", "gzip"),
     ("*;q=0", ""), ("gzip;q=nan, deflate;q=0.5", "deflate"), ("x-gzip;q=0.3, deflate;q=0.2",
     "gzip")],
)  # fmt: skip
def test_an_answer_s_coding_is_the_one_its_caller_weighs_most(accept: str, coding: str) -> None:
    request = make_mocked_request("POST", TINY, headers={"Accept-Encoding": accept})
    assert http_site.accepted(request) == coding


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
@pytest.mark.parametrize("rows", [1, 32])  # its answer written on the loop; aside
def test_an_answer_is_compressed_as_its_caller_asks(
    example_server: ServerProcess, coding: str, rows: int
) -> None:
    """tritonclient.http's response_compression_algorithm sends Accept-Encoding, and
    Triton compresses the answer; batchd sent it plain (review 56a), JSON or binary."""
    x = np.random.default_rng(rows).standard_normal((rows, 512), dtype=np.float32)
    body = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [rows, 512],
                        "data": x.ravel().tolist()}]}  # fmt: skip
    plain = call(example_server, "POST", "/v2/models/mlp/infer", body)
    got = call(example_server, "POST", "/v2/models/mlp/infer", body, {"Accept-Encoding": coding})
    assert (got.status, got.headers["Content-Encoding"], got.headers["Vary"]) == (
        200, coding, "Accept-Encoding",
    )  # fmt: skip
    assert zlib.decompress(got.body, 31 if coding == "gzip" else 15) == plain.body
    with triton_http.InferenceServerClient(f"127.0.0.1:{example_server.http_port}") as h:
        for binary in (False, True):
            inp = triton_http.InferInput("INPUT0", [rows, 512], "FP32")
            inp.set_data_from_numpy(x, binary_data=binary)
            out = [triton_http.InferRequestedOutput("OUTPUT0", binary_data=binary)]
            want = h.infer("mlp", [inp], outputs=out).as_numpy("OUTPUT0")
            answer = h.infer("mlp", [inp], outputs=out, response_compression_algorithm=coding)
            np.testing.assert_array_equal(answer.as_numpy("OUTPUT0"), want)
    generate = {"id": "g", "PROMPT": [5, 6, 7], "MAX_NEW_TOKENS": 3}
    plain = call(example_server, "POST", "/v2/models/decoder/generate", generate)
    got = call(example_server, "POST", "/v2/models/decoder/generate", generate,
               {"Accept-Encoding": coding})  # fmt: skip
    assert got.headers["Content-Encoding"] == coding
    assert zlib.decompress(got.body, 31 if coding == "gzip" else 15) == plain.body


def test_a_web_page_s_own_requests_are_refused(example_server: ServerProcess) -> None:
    """With loopback and no tokens, a page the user merely visited could infer, submit
    jobs or unload models (POST with a cross-site Origin: 200), and read jobs and results
    through a name of its site resolved to 127.0.0.1 (DNS rebinding: Host evil.example)."""
    port, body = example_server.http_port, json.dumps(tiny_body(0.5)).encode()
    for origin in ("http://evil.example", "null", f"http://evil.example:{port}"):
        r = call(example_server, "POST", TINY, body, {"Origin": origin})
        assert r.status == 403 and "a request from a web page of another site" in r.error
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        r = call(example_server, "GET", "/v2/jobs", None, {"Host": host})
        assert r.status == 403 and f"Host {host.partition(':')[0]!r}" in r.error
        assert "is not a name of this server, which listens on loopback" in r.error
    for headers in ({}, {"Host": f"localhost:{port}"}, {"Host": "[::1]"}, {"Host": "localhost."},
                    {"Host": f"[::ffff:127.0.0.1]:{port}"},
                    {"Origin": f"http://127.0.0.1:{port}"}, {"Host": "a.localhost"},
                    {"Origin": "http://localhost:3000", "Host": f"localhost:{port}"}):  # fmt: skip
        assert call(example_server, "POST", TINY, body, headers).status == 200, headers


def test_the_loopback_names_of_etc_hosts_are_this_machine_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Debian's ip6-localhost, RHEL's localhost.localdomain were refused (late review)."""
    hosts = tmp_path / "hosts"
    hosts.write_bytes(
        b"127.0.0.1 localhost localhost.localdomain # a comment\n"
        b"::1 ip6-localhost ip6-loopback\n10.0.0.1 elsewhere\n\n#127.0.0.1 nope\n"
        b"caf\xe9 \xff\n127.0.0.1 loopname\n"  # (a byte not UTF-8 lost every line)
        b"localhost evil.example\n"  # led by a name: glibc reads no address there
    )
    monkeypatch.setattr(http_site, "HOSTS", str(hosts))

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    check = same_site("127.0.0.1")
    served = {"localhost.localdomain", "IP6-LOCALHOST:8000", "ip6-loopback.", "loopname"}
    for host in [*served, "elsewhere", "nope", "evil.example"]:
        request = make_mocked_request("GET", "/v2", headers={"Host": host})
        if host in served:
            assert asyncio.run(check(request, ok)).status == 200, host
        else:
            with pytest.raises(web.HTTPForbidden):
                asyncio.run(check(request, ok))
    # --host given as such a name listens on loopback: the Host check is on (it was off)
    rebound = make_mocked_request("GET", "/v2", headers={"Host": "rebind.example"})
    for name in ("loopname", "localhost.localdomain", "::1", "[::1]"):
        with pytest.raises(web.HTTPForbidden):
            asyncio.run(same_site(name)(rebound, ok))


def test_off_loopback_any_host_is_served_but_no_other_site_s_page() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    check = same_site("0.0.0.0")
    named = make_mocked_request("GET", "/v2", headers={"Host": "batchd.example:8000"})
    assert asyncio.run(check(named, ok)).status == 200  # a name of its own, through DNS
    page = make_mocked_request(
        "POST", "/v2", headers={"Host": "batchd.example", "Origin": "https://evil.example"}
    )
    with pytest.raises(web.HTTPForbidden):
        asyncio.run(check(page, ok))


def test_a_compression_bomb_inflates_only_to_the_body_limit(
    example_server: ServerProcess,
) -> None:
    """200 KB of gzip that would inflate to 200 MB, past --max-message-bytes (64 MiB):
    413 naming the limit, and the server serves on. aiohttp inflated it whole, on the
    event loop, even to answer 401 or 404."""
    bomb = gzip.compress(b"\0" * (200 * 1024 * 1024), compresslevel=9)
    for path in (TINY, "/v2/models/nope/infer"):
        r = call(example_server, "POST", path, bomb, {"Content-Encoding": "gzip"})
        if path == TINY:
            assert r.status == 413, r.body[:300]
            assert f"the gzip body inflates to more than {64 * 1024 * 1024} bytes" in r.error
        else:
            assert r.status == 404, r.body[:300]
    assert_serving(example_server)


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(
    ("coding", "pack"),
    [
        ("deflate", _raw_deflate),  # no zlib header: .NET's DeflateStream, some others
        ("gzip", lambda b: gzip.compress(b[:10]) + gzip.compress(b[10:])),  # two members
    ],
    ids=["raw deflate", "gzip of two members"],
)
def test_every_form_of_gzip_and_deflate_aiohttp_read_is_read(
    example_server: ServerProcess, coding: str, pack: Any
) -> None:
    body = json.dumps(tiny_body(0.25)).encode()
    plain = call(example_server, "POST", TINY, body)
    got = call(example_server, "POST", TINY, pack(body), {"Content-Encoding": coding})
    assert got.status == 200 and got.json()["outputs"] == plain.json()["outputs"], got.body
    empty = call(example_server, "POST", "/v2/repository/index", b"", {"Content-Encoding": coding})
    assert empty.status == 200, empty.body


def test_a_json_body_of_many_values_is_parsed_off_the_loop_one_of_few_on_it() -> None:
    """Bodies up to 256 KiB were parsed on the event loop: one of 227 KiB (8,000 output
    entries, or 50,000 rows of one number) held it 60-90 ms, every other caller with it.
    One of thousands of values goes aside; one of a few long values stays (a thread's
    hop, and a place among the decode thread's 64, would cost it more)."""

    class Service:
        asides = 0

        async def aside(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
            Service.asides += 1
            return fn(*args)

    async def scenario() -> None:
        api = RestApi(Service(), None, JobsService(None), None,  # type: ignore[arg-type]
                      max_body_bytes=1 << 24, connections=Connections())  # fmt: skip
        few = json.dumps({"id": "x" * 30_000, "data": [0.123456789] * 100}).encode()
        many = json.dumps({"data": [[0]] * 5_000}).encode()
        deep = json.dumps({"data": [[[[[[[[0]]]]]]]] * 3_000}).encode()  # (3,000 commas)
        assert len(few) > len(many)
        assert (await api._parse(few, json.loads))["data"] and Service.asides == 0
        assert (await api._parse(many, json.loads))["data"] and Service.asides == 1
        assert (await api._parse(deep, json.loads))["data"] and Service.asides == 2

    asyncio.run(scenario())


def test_a_document_in_the_parser_process_holds_up_no_other_request_s_decoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large document waited for the parser process on the decode thread: one client's
    hostile 8 MiB bodies (3-7 s each in the child) held every other client's request
    that needed that thread 2-20 s behind them (review 57c). It waits on one of its own."""
    entered, release = threading.Event(), threading.Event()

    def slow_child(fn: Any, args: Any, background: bool) -> Any:  # (a hostile document)
        entered.set()
        release.wait(60)
        return fn(*args)

    monkeypatch.setattr(parser._child, "call", slow_child)
    decoder = ThreadPoolExecutor(1)  # (as service.InferenceService's)

    class Service:
        async def aside(self, fn: Any, *args: Any, bounded: bool = True, pool: Any = None) -> Any:
            return await asyncio.get_running_loop().run_in_executor(pool or decoder, fn, *args)

    async def scenario() -> None:
        api = RestApi(Service(), None, JobsService(None), None,  # type: ignore[arg-type]
                      max_body_bytes=1 << 24, connections=Connections())  # fmt: skip
        big = json.dumps({"data": "x" * parser.ASIDE_BYTES}).encode()
        many = json.dumps({"data": [[0]] * 5_000}).encode()  # (the decode thread's)
        slow = asyncio.ensure_future(api._parse(big, _aside(json.loads)))
        assert await asyncio.to_thread(entered.wait, 60)
        try:
            got = await asyncio.wait_for(api._parse(many, _aside(json.loads)), 30)
            assert len(got["data"]) == 5_000 and not slow.done()
        finally:
            release.set()
        assert (await slow)["data"]

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        decoder.shutdown()


def test_a_small_compressed_body_is_inflated_on_the_loop_a_large_one_aside() -> None:
    """Every compressed body went to the decode thread, counted as a heavy request, so
    tritonclient's compressed calls were refused 429 past 64 at once. Now the first
    INLINE_BYTES inflate on the loop: only a larger body goes aside."""

    class Service:
        asides = 0

        async def aside(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
            Service.asides += 1
            return fn(*args)

    async def read(api: RestApi, body: bytes) -> bytes:
        payload = streams.StreamReader(mock.Mock(_reading_paused=False), 2**16,
                                       loop=asyncio.get_running_loop())  # fmt: skip
        payload.feed_data(body)
        payload.feed_eof()
        headers = {"Content-Encoding": "gzip", "Content-Length": str(len(body))}
        request = make_mocked_request("POST", TINY, headers=headers, payload=payload)
        return await api._body(request)

    async def scenario() -> None:
        api = RestApi(Service(), None, JobsService(None), None,  # type: ignore[arg-type]
                      max_body_bytes=1 << 24, connections=Connections())  # fmt: skip
        small, large = b"x" * 1000, b"y" * (INLINE_BYTES + 1)
        assert await read(api, gzip.compress(small)) == small and Service.asides == 0
        assert await read(api, gzip.compress(large)) == large and Service.asides == 1

    asyncio.run(scenario())


def test_head_of_a_job_s_results_answers_without_its_body(example_server: ServerProcess) -> None:
    """A stream's HEAD sent the whole body without framing, breaking the connection;
    then it was refused (405), though every GET route answers HEAD."""
    lines = [{"custom_id": "a", "inputs": [{"name": "INPUT0", "datatype": "FP32",
                                            "shape": [1, 16], "data": [0.0] * 16}]}]  # fmt: skip
    with Client(example_server.url) as c:
        job = c.submit_job("tiny", lines)
    conn = http.client.HTTPConnection("127.0.0.1", example_server.http_port, timeout=30)
    try:
        conn.request("HEAD", f"/v2/jobs/{job.id}/results")
        head = conn.getresponse()
        assert (head.status, head.read()) == (200, b"")
        assert head.headers["Content-Type"] == "application/x-ndjson"
        conn.request("GET", "/v2/health/live")  # the same connection: still sound
        assert conn.getresponse().status == 200
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"not gzip at all", "the gzip body does not inflate: Error -3"),
        (gzip.compress(json.dumps(tiny_body()).encode())[:30], "ends inside its compressed"),
        (gzip.compress(json.dumps(tiny_body()).encode()) + b"junk", "does not inflate"),
        (gzip.compress(b"") * 100_000, "the gzip body holds more than 64 members"),
    ],
    ids=["not gzip", "cut short", "junk after it", "100,000 empty members"],
)
def test_a_broken_gzip_body_is_a_400(
    example_server: ServerProcess, body: bytes, message: str
) -> None:
    r = call(example_server, "POST", TINY, body, {"Content-Encoding": "gzip"})
    assert r.status == 400 and message in r.error, r.body[:300]


def test_an_encoding_batchd_cannot_read_is_415_before_the_body(
    example_server: ServerProcess,
) -> None:
    for path in (TINY, "/v2/jobs?model=tiny"):
        r = call(example_server, "POST", path, b"\x8b\x00" * 1000, {"Content-Encoding": "br"})
        assert r.status == 415, r.body[:300]
    r = call(example_server, "POST", TINY, b"x", {"Content-Encoding": "zstd, gzip"})
    assert r.status == 415 and "'zstd, gzip' is not supported: send identity, gzip" in r.error
    jobs = call(example_server, "POST", "/v2/jobs?model=tiny", gzip.compress(b"{}\n"),
                {"Content-Encoding": "gzip"})  # fmt: skip
    assert jobs.status == 415 and "a job upload takes no Content-Encoding" in jobs.error
    # a Transfer-Encoding batchd does not read: 501, not the gzip bytes read as JSON
    for path in (TINY, "/v2/jobs?model=tiny"):
        with socket.create_connection(("127.0.0.1", example_server.http_port)) as s:
            packed = gzip.compress(b"{}")
            head = b"POST %s HTTP/1.1\r\nHost: [::1]\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            s.sendall(head % path.encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed))
            s.settimeout(30)
            head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 501") and b"'gzip, chunked' is not supported" in head
    # an upload naming no model is told how, over HTTP (it named the gRPC field alone)
    unnamed = call(example_server, "POST", "/v2/jobs", b"{}\n")
    assert (unnamed.status, unnamed.error) == (
        400, "a job must name its model (gRPC: model_name; HTTP: ?model=NAME)")  # fmt: skip


@pytest.mark.parametrize("path", ["/v2/health/live", "/v2/health/ready", "/v2/models/tiny"])
def test_head_is_answered_on_get_routes(example_server: ServerProcess, path: str) -> None:
    """Load balancers probe with HEAD: it was 405."""
    r = call(example_server, "HEAD", path)
    assert r.status == 200 and r.body == b""


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`wide` answers 16 MB a row; answers unread for 1 s are dropped. One server for the
    module's tests: each judges only what it did (log lines written after it began, counts
    that grew), so none passes on what another left."""
    tmp_path = tmp_path_factory.mktemp("wide-site")
    d = tmp_path / "repo" / "wide"
    d.mkdir(parents=True)
    (d / "model.toml").write_text(
        'max_batch_size = 4\n[[input]]\nname = "X"\ndatatype = "FP32"\nshape = [1]\n'
        f'[[output]]\nname = "Y"\ndatatype = "FP32"\nshape = [{BIG_ROW}]\n'
    )
    (d / "model.py").write_text(
        "import torch\n"
        "def load(device):\n"
        f"    return lambda x: {{'Y': x.expand(-1, {BIG_ROW}).contiguous()}}\n"
    )
    server = ServerProcess(d.parent, "--max-connection-age-grace", "1", log_dir=tmp_path)
    yield server.start()
    assert server.stop() == 0, server.log()


def test_an_answer_its_caller_never_reads_is_dropped_with_its_connection(
    wide: ServerProcess,
) -> None:
    """A caller asks for 16 MB and reads nothing: the server held the answer (and its
    memory) as long as the connection lived. Past --max-connection-age-grace it
    closes the connection; the caller then finds the answer cut short."""
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [7.0]}],
            "parameters": {"binary_data_output": True}}  # fmt: skip
    raw = json.dumps(body).encode()
    seen = len(wide.log())  # (the server is the module's: only what it logs from now on)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.connect(("127.0.0.1", wide.http_port))
        s.sendall(
            b"POST /v2/models/wide/infer HTTP/1.1\r\nHost: [::1]\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n%s" % (len(raw), raw)
        )
        dropped = "its answer was not read within 1 s"
        wait_for(lambda: dropped in wide.log()[seen:], 30, "dropped")
        s.settimeout(30)
        got = bytearray()
        try:
            while chunk := s.recv(1 << 20):
                got += chunk
        except ConnectionResetError:
            pass
    assert got.startswith(b"HTTP/1.1 200")
    assert len(got) < 4 * BIG_ROW  # cut short: the whole answer is larger
    # a caller that reads gets all of it
    r = call(wide, "POST", "/v2/models/wide/infer", body)
    head_length = int(r.headers["Inference-Header-Content-Length"])
    values = np.frombuffer(r.body[head_length:], np.float32)
    assert r.status == 200 and values.size == BIG_ROW and (values == 7.0).all()


def test_a_job_s_results_their_caller_never_reads_are_dropped_with_the_connection(
    wide: ServerProcess,
) -> None:
    """GET /v2/jobs/ID/results was a plain stream: a caller that read nothing held its
    connection, its results file and ~1.2 MB for ever, past --max-connection-age-grace
    (review 57c: 150 such callers, 180 MB and 300 descriptors). It is dropped too."""
    line = {"custom_id": "a", "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1],
                                          "data": [7.0]}]}  # fmt: skip
    with Client(wide.url) as c:
        job = c.submit_job("wide", [line])
        wait_for(lambda: c.job(job.id).status == "completed", 60, "the job's end")
    seen = len(wide.log())  # (the server is the module's: only what it logs from now on)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        s.connect(("127.0.0.1", wide.http_port))
        s.sendall(b"GET /v2/jobs/%s/results HTTP/1.1\r\nHost: [::1]\r\n\r\n" % job.id.encode())
        dropped = "results: its caller read nothing for "  # (1 s, and the time to read what
        wait_for(lambda: dropped in wide.log()[seen:], 60, "dropped")  # the buffers took)
        s.settimeout(30)
        got = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(1 << 20):
                got += chunk
    assert got.startswith(b"HTTP/1.1 200") and not got.endswith(b"0\r\n\r\n")  # cut short
    whole = call(wide, "GET", f"/v2/jobs/{job.id}/results")  # a caller that reads: all of it
    assert whole.status == 200 and json.loads(whole.body)["custom_id"] == "a"


def test_an_answer_too_large_for_json_is_refused_and_counted_failed(wide: ServerProcess) -> None:
    """16 MB of FP32 asked for as JSON: about 50 MB of text written holding the GIL, past
    --max-message-bytes. Refused, naming binary_data_output, before the model runs (its
    size is fixed: it ran first, and then the answer was refused); and counted a failure
    (it was counted a success, and traced as one)."""
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1], "data": [7.0]}]}

    def counts() -> tuple[int, int, int]:
        stats = call(wide, "GET", "/v2/models/wide/stats").json()["model_stats"][0]
        infer, ran = stats.get("inference_stats", {}), int(stats.get("execution_count", 0))
        return infer.get("success", {}).get("count", 0), infer.get("fail", {}).get("count", 0), ran

    before = counts()
    r = call(wide, "POST", "/v2/models/wide/infer", body)
    assert r.status == 400 and "ask for them in binary form (binary_data_output)" in r.error
    assert "the answer's JSON outputs would hold 16000000 bytes of tensors" in r.error
    assert counts() == (before[0], before[1] + 1, before[2])  # (the model never ran)


def test_expect_100_continue_refuses_a_body_over_the_limit_before_it_comes(
    example_server: ServerProcess,
) -> None:
    """curl sends a large body after `Expect: 100-continue`: it was told to go on, then
    refused once it had sent it all. Over the limit it is now refused at once; under
    it, told to go on."""
    big = 65 * 1024 * 1024  # over --max-message-bytes, 64 MiB
    for length, first in ((big, b"HTTP/1.1 413"), (10, b"HTTP/1.1 100 Continue")):
        with socket.create_connection(("127.0.0.1", example_server.http_port), timeout=30) as s:
            s.sendall(
                b"POST /v2/models/tiny/infer HTTP/1.1\r\nHost: [::1]\r\nExpect: 100-continue\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length
            )
            answer = s.recv(4096)
            assert answer.startswith(first), answer[:200]
            if length == big:  # the body it announced never comes: no next request either
                assert b"the body is 68157440 bytes, more than 67108864" in answer
                assert b"Connection: close" in answer


def test_finish_inflates_all_where_one_step_of_the_limit_stops_short() -> None:
    """A step's budget counts bytes read as well as made (gzip's headers and trailers
    too), so run(limit + 1) may stop before the end of a body that inflates to exactly
    the limit; the decode thread's finish() runs to the end."""
    data = random.Random(0).randbytes(1000)  # incompressible: read about as much as made
    body = b"".join(gzip.compress(data) for _ in range(10))
    step = Inflating(body, "gzip", len(data) * 10)
    assert not step.run(len(data) * 10 + 1)
    whole = Inflating(body, "gzip", len(data) * 10)
    whole.finish()
    assert bytes(whole.out) == data * 10


def test_a_body_is_inflated_a_piece_at_a_time_off_the_loop_too() -> None:
    """Each piece zlib makes is copied into the body with the GIL held: 58 KB of gzip
    inflating to 60 MB came as one piece in finish() (the decode thread's), a 38 ms
    stall of the event loop for every such request."""
    pieces: list[int] = []

    class Recording(Inflated):
        def __iadd__(self, got: Any) -> Recording:  # type: ignore[override,misc]
            pieces.append(len(got))
            return super().__iadd__(got)  # type: ignore[return-value]

    body = gzip.compress(bytes(8 * PIECE))
    inflating = Inflating(body, "gzip", 64 * PIECE)
    inflating.out = Recording()
    inflating.finish()
    assert len(inflating.out) == 8 * PIECE and max(pieces) <= PIECE, max(pieces)


def test_inflated_bodies_hold_at_most_their_budget_until_each_is_freed() -> None:
    """A 60 KB gzip body inflates to 60 MB, held until its request ends: forty of them
    (2.4 MB sent) held 2.7 GB of the frontend. Over all requests, inflated bodies hold
    at most the budget; one more is refused as a full queue is (429, to retry), and
    what a body held is given back once it is freed."""
    data = b"\0" * 1_000_000
    body = gzip.compress(data)
    budget = InflateBudget(2_500_000)
    first, second = Inflating(body, "gzip", 2**24, budget), Inflating(body, "gzip", 2**24, budget)
    first.finish()
    second.finish()
    assert budget.held == 2_000_000 and bytes(first.out) == data
    third = Inflating(body, "gzip", 2**24, budget)
    with pytest.raises(QueueFull, match=r"inflated request bodies hold \d+ bytes, the most"):
        third.finish()
    del first, third
    assert budget.held == 1_000_000
    again = Inflating(body, "gzip", 2**24, budget)
    again.finish()
    assert budget.held == 2_000_000


def test_bodies_as_they_came_hold_at_most_their_budget_till_each_is_freed() -> None:
    """Slow connections, each bringing its body within its rate, pinned memory without
    bound (review 54g: 16 of them at 70 KB/s held 50 MB, growing as they sent). Bodies
    being read and held count against a budget: past it, a full queue's refusal (429,
    to retry); what a body held comes back once it is freed, a refused one's too."""

    class Content:
        def __init__(self, *pieces: bytes) -> None:
            self.pieces = list(pieces)

        async def readany(self) -> bytes:
            return self.pieces.pop(0) if self.pieces else b""

    def request(*pieces: bytes) -> Any:
        return mock.Mock(content=Content(*pieces))

    async def scenario() -> None:
        budget = http_site.InflateBudget(1000, "request bodies")
        first = await http_site.read_body(request(b"x" * 600), 10_000, None, budget)
        assert budget.held == 600 and first == b"x" * 600
        with pytest.raises(QueueFull, match=r"request bodies hold 900 bytes, the most"):
            await http_site.read_body(request(b"y" * 300, b"y" * 300), 10_000, None, budget)
        assert budget.held == 600  # (the refused body's 300: back)
        del first
        assert budget.held == 0

    asyncio.run(scenario())


def test_a_parser_refusal_names_the_fault_and_quotes_nothing_of_what_came() -> None:
    """The C parser says its fault, then quotes the bytes after a blank line: the fault
    is said. The pure-Python parser's messages (where aiohttp's C extension is missing)
    quote what came bare: a bad chunk size's whole message was the caller's bytes, and
    non-ASCII ones failed the JSON answer (a 500)."""
    from aiohttp import http_exceptions as he

    from batchd.server.http_serve import _fault

    assert _fault(he.BadHttpMessage("Invalid header value char:\n\n  b'X: a\\x01'\n  ^")) == (
        "Invalid header value char")  # fmt: skip
    assert _fault(he.BadHttpMethod("\x16\x03\x01")) == "Received HTTPS traffic on an HTTP port"
    assert _fault(he.LineTooLong("Bearer secret", "8190")) == (
        "a request line or header over 8190 bytes")  # fmt: skip
    for bare in (
        he.TransferEncodingError("SECRET-TOKEN-abc"),
        he.TransferEncodingError("\udcff\udcfeZ"),
        he.InvalidURLError("http://[::1"),
    ):
        assert _fault(bare) == type(bare).__name__
