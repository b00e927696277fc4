"""Batch jobs over HTTP: the same calls as `batchd.jobs.v1.Jobs` (jobs/service.py),
with the same owners, limits and messages.

    POST /v2/jobs?model=M[&version=V]   body: the JSONL job file, streamed to disk;
                                        201 and the job (Idempotency-Key: a job
                                        made by the same key before, as it is)
    GET  /v2/jobs[?status=S&limit=N]    {"jobs": [...]}, newest first
    GET  /v2/jobs/{id}                  the job
    POST /v2/jobs/{id}/cancel           the job, cancelled
    GET  /v2/jobs/{id}/results[?offset=B]  the results' JSON lines (application/x-ndjson)

A job is the JSON of protos/jobs.proto's Job, integers as numbers.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from google.protobuf.message import Message

from batchd.protos.to_json import as_json
from batchd.server.auth import bearer_header
from batchd.server.errors import InvalidInput, clip
from batchd.server.http_site import encoding
from batchd.server.jobs.service import Caller, JobsService
from batchd.server.pace import PatientStream

UPLOAD_PIECE = 1024 * 1024  # bytes of an upload read and written at a time
JSONL = "application/x-ndjson"


def _job(job: Message, status: int = 200) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(as_json(job, defaults=True)),
        content_type="application/json",
    )  # fmt: skip


def _offset(request: web.Request) -> int:
    if (offset := _int(request, "offset")) < 0:  # (it was taken for 0: the whole file)
        raise InvalidInput(f"offset must be a byte offset >= 0, got {offset}")
    return offset


def _int(request: web.Request, key: str) -> int:
    """A query's integer, in ASCII digits only (int() takes '5_0', ' +5 ' and other
    scripts' digits too)."""
    raw = request.query.get(key, "0")
    try:
        if re.fullmatch(r"-?[0-9]+", raw):
            return int(raw)
    except ValueError:  # (over 4,300 digits)
        pass
    raise InvalidInput(f"{key} must be an integer, got {clip(raw)}")


class JobRoutes:
    def __init__(self, jobs: JobsService, body_timeout_s: float, grace_s: float) -> None:
        self._jobs = jobs
        self._timeout_s = body_timeout_s or None  # for each piece of an upload; 0: none
        self._grace_s = grace_s  # for each piece of a download to be taken (0: none)

    def add_to(self, router: web.UrlDispatcher, expect: Callable[..., Awaitable[Any]]) -> None:
        """The routes; `expect` answers a POST's `Expect: 100-continue` (rest.py)."""
        router.add_post("/v2/jobs", self.submit, expect_handler=expect)
        router.add_get("/v2/jobs", self.listing)
        router.add_get("/v2/jobs/{job}", self.get)
        router.add_post("/v2/jobs/{job}/cancel", self.cancel, expect_handler=expect)
        router.add_route("GET", "/v2/jobs/{job}/results", self.results)
        router.add_route("HEAD", "/v2/jobs/{job}/results", self.results_head)

    def _caller(self, request: web.Request) -> Caller:
        return self._jobs.caller(bearer_header(request.headers.get("Authorization", "")))

    async def submit(self, request: web.Request) -> web.Response:
        if encoding(request):  # read as it streams to disk: no room for a bounded inflate
            raise web.HTTPUnsupportedMediaType(text="a job upload takes no Content-Encoding")

        async def pieces() -> AsyncIterator[bytes]:
            while True:
                async with asyncio.timeout(self._timeout_s):
                    data = await request.content.read(UPLOAD_PIECE)
                if not data:
                    return
                yield data

        query, key = request.query, request.headers.get("Idempotency-Key", "")
        job = await self._jobs.submit(
            self._caller(request), query.get("model", ""), query.get("version", ""), pieces(), key
        )
        return _job(job, 201)

    async def listing(self, request: web.Request) -> web.Response:
        found = await self._jobs.listing(
            self._caller(request), request.query.get("status", ""), _int(request, "limit")
        )
        jobs = [as_json(j, defaults=True) for j in found.jobs]
        return web.Response(body=orjson.dumps({"jobs": jobs}), content_type="application/json")

    async def get(self, request: web.Request) -> web.Response:
        return _job(await self._jobs.get(self._caller(request), request.match_info["job"]))

    async def cancel(self, request: web.Request) -> web.Response:
        return _job(await self._jobs.cancel(self._caller(request), request.match_info["job"]))

    async def _results(self, request: web.Request) -> AsyncIterator[bytes]:
        caller, job = self._caller(request), request.match_info["job"]
        return await self._jobs.results(caller, job, _offset(request))

    async def results_head(self, request: web.Request) -> web.Response:
        """What GET would answer, without its body (a job of another owner: 404 too)."""
        await self._results(request)
        return web.Response(headers={"Content-Type": JSONL})

    async def results(self, request: web.Request) -> web.StreamResponse:
        pieces = await self._results(request)
        # A caller that reads nothing is dropped past --max-connection-age-grace, as for any
        # answer: it held its connection, results file and ~1.2 MB for ever (review 57c).
        stream = PatientStream(request, self._grace_s, headers={"Content-Type": JSONL})
        await stream.prepare(request)
        async for data in pieces:
            await stream.write(data)
        await stream.write_eof()
        return stream
