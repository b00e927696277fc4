"""OpenTelemetry set-up, shared by the frontend and its workers.

Tracing is off unless an OTLP endpoint is given: `--otlp-endpoint` (a worker gets
it from its frontend) or the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
OTEL_EXPORTER_OTLP_ENDPOINT; OTEL_SDK_DISABLED=true turns it off whatever is set.
Off, the SDK is not even imported. On, each process has one TracerProvider that
exports by OTLP/gRPC from a background thread (BatchSpanProcessor), and the SDK
reads the rest of the standard variables itself: OTEL_TRACES_SAMPLER[_ARG],
OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS, ...

The trace context crosses the wire (wire.proto, Header.traceparent and tracestate)
as W3C `traceparent` and `tracestate` strings.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from batchd.protos._toml_reader import ConfigError

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# The SDK's loggers that judge a caller's traceparent and tracestate: a bad one is
# ignored, as the W3C says, not logged for every request that carries it.
CALLERS_DATA_LOGGERS = ("opentelemetry.trace.span", "opentelemetry.trace.propagation.tracecontext")


def endpoint(flag: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """Where traces go, or None: tracing is off. ConfigError, saying what is wrong, for
    one that is not a URL (the exporter would raise urllib's bare error at start-up)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    url = flag or next((env[k] for k in ENDPOINT_VARIABLES if env.get(k)), None)
    if url is not None:
        try:
            bare = "://" not in url  # the exporter takes HOST:PORT for TLS unless *_INSECURE
            if bare and not any(
                env.get(f"OTEL_EXPORTER_OTLP{k}_INSECURE") for k in ("", "_TRACES")
            ):
                raise ValueError("http:// (plaintext) or https:// (TLS) must say which, or "
                                 "OTEL_EXPORTER_OTLP_INSECURE")  # fmt: skip
            parts = urlsplit(f"http://{url}" if bare else url)
            empty_port = parts.port is None and ":" in parts.netloc.rpartition("]")[2]
            if parts.scheme not in ("http", "https"):
                raise ValueError(f"the scheme {parts.scheme[:20]!r} is neither http nor https")
            if not parts.hostname or empty_port:
                raise ValueError("no host, or an empty port")
        except ValueError as e:
            raise ConfigError(
                f"the OTLP endpoint {url[:100]!r} is not a URL ({e}); expected one like "
                "http://collector:4317"
            ) from None
    return url


class Tracing:
    """One process's tracer and its provider (to flush at exit)."""

    def __init__(self, tracer: Any, provider: Any = None) -> None:
        self.tracer = tracer
        self._provider = provider

    @classmethod
    def start(cls, process: str, endpoint: str, exporter: Any = None) -> Tracing:
        """A provider exporting to `endpoint` (or to `exporter`, e.g. the SDK's
        in-memory one in tests); spans carry `batchd.process`."""
        from opentelemetry.sdk.resources import OTELResourceDetector, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
        own = {"batchd.process": process}
        if "service.name" not in OTELResourceDetector().detect().attributes:  # (the SDK's,
            own["service.name"] = "batchd"  # from OTEL_SERVICE_NAME or ..._RESOURCE_ATTRIBUTES;
        resource = Resource.create(own)  # the latter's was overridden: review 57c)
        for name in CALLERS_DATA_LOGGERS:  # a WARNING per request, quoting what it sent
            logging.getLogger(name).setLevel(logging.ERROR)
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider.get_tracer("batchd"), provider)

    def shutdown(self, timeout_s: float = 3.0) -> None:
        """Export what is left, for at most `timeout_s`: a collector that is down must
        not hold the process's stop (its exporter retries for many seconds)."""
        if self._provider is not None:
            done = threading.Thread(target=self._provider.shutdown, daemon=True)
            done.start()
            done.join(timeout_s)


def inject(span: Any) -> tuple[str, str]:
    """The W3C traceparent and tracestate ("": none) of `span` (a caller's tracestate,
    its spans carry it: the worker's compute span lost it, review 57c)."""
    ctx = span.get_span_context()
    state = ctx.trace_state.to_header() if ctx.trace_state else ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}", state


def extract(carrier: Mapping[str, Any] | None) -> Any:
    """The OpenTelemetry context of a carrier's `traceparent` (and `tracestate`), if any."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if not carrier:
        return None
    return TraceContextTextMapPropagator().extract(carrier)


def compute_spans(tracing: Tracing | None, headers: Sequence[Any], start_ns: int,
                  compute_ns: int, rows: int) -> None:  # fmt: skip
    """A worker's `compute` span under each traced BATCH of one forward of `rows` rows
    (several batches when those of several frontends were merged), from its wall-clock
    start."""
    if tracing is None:
        return
    for h in headers:
        if h.traceparent:
            span = tracing.tracer.start_span(
                "compute",
                context=extract({"traceparent": h.traceparent, "tracestate": h.tracestate}),
                start_time=start_ns,
                attributes={"batchd.model": h.model, "batchd.batch_id": h.batch_id,
                            "batchd.forward_rows": rows, "batchd.merged": len(headers)},
            )  # fmt: skip
            span.end(end_time=start_ns + compute_ns)
