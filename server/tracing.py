"""The frontend's spans of one inference request (protos/traces.py sets tracing up).

    infer <model>            SERVER, child of the caller's traceparent (gRPC metadata,
    │                        HTTP header) if it sent one
    ├── admission            arrival -> validated and queued
    ├── queue                queued -> sent in a batch; links to that batch's span
    ├── batch                sent -> its result back; in the trace of the first request
    │   │                    it carries, linked from every one (links to each)
    │   └── compute          recorded by the worker, under the traceparent on the wire
    └── response             result back -> response built

With tracing off `begin` returns None and a request carries no trace: the cost is
one `is None` test where each phase would be recorded. Phases are recorded when
they end, with the times they began and ended (time.time_ns).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from batchd.protos.traces import Tracing, extract, inject

# Batch spans of one request (three spans each: queue, batch, compute): one of 16,384
# rows split into 512 batches made 1,536, more than the exporter's queue of 2,048 holds
# for every request's spans together. The batches past this are counted on the request.
MAX_TRACED_BATCHES = 64

now_ns = time.time_ns


class RequestTrace:
    """One traced request's span and the start of its current phase."""

    __slots__ = ("batches", "context", "mark", "span", "tracer")

    def __init__(self, tracer: Any, span: Any) -> None:
        from opentelemetry import trace

        self.tracer, self.span = tracer, span
        self.context = trace.set_span_in_context(span)
        self.mark = now_ns()  # when the phase under way began
        self.batches = 0  # that carried it (a request split into many: the first traced)

    def phase(self, name: str, links: Sequence[Any] = (), **attributes: Any) -> None:
        """Record the phase that began at `mark` and ends now; the next begins now."""
        end = now_ns()
        span = self.tracer.start_span(
            name, context=self.context, start_time=self.mark, links=links, attributes=attributes
        )
        span.end(end_time=end)
        self.mark = end

    def end(self, error: BaseException | None) -> None:
        if self.batches > MAX_TRACED_BATCHES:
            self.span.set_attribute("batchd.batches_untraced", self.batches - MAX_TRACED_BATCHES)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
            self.span.set_attribute("batchd.error", type(error).__name__)
        self.span.end()


def begin(tracing: Tracing | None, model: str, request_id: str,
          carrier: Mapping[str, Any] | None) -> RequestTrace | None:  # fmt: skip
    """The trace of a request that has just arrived, or None (off, or not sampled)."""
    if tracing is None:
        return None
    from opentelemetry.trace import SpanKind

    span = tracing.tracer.start_span(
        f"infer {model}",
        context=extract(carrier),
        kind=SpanKind.SERVER,
        attributes={"batchd.model": model, "batchd.request_id": request_id[:64]},
    )
    if not span.is_recording():
        return None
    return RequestTrace(tracing.tracer, span)


def start_batch(traces: Sequence[RequestTrace], model: str, batch_id: int, worker: str,
                header: Any) -> Any:  # fmt: skip
    """The span of a batch carrying `traces` (at least one), its trace context set in
    its BATCH `header` (traceparent, tracestate); each request's queue phase ends here,
    linked to it. A request's batches past MAX_TRACED_BATCHES are counted, not traced:
    None if no request is left."""
    from opentelemetry.trace import Link

    for t in traces:
        t.batches += 1
    traces = [t for t in traces if t.batches <= MAX_TRACED_BATCHES]
    if not traces:
        return None
    first = traces[0]
    span = first.tracer.start_span(
        "batch",
        context=first.context,
        links=[Link(t.span.get_span_context()) for t in traces],
        attributes={"batchd.model": model, "batchd.batch_id": batch_id,
                    "batchd.worker": worker, "batchd.rows": header.rows},
    )  # fmt: skip
    link = [Link(span.get_span_context())]
    for t in traces:
        t.phase("queue", links=link)
    header.traceparent, header.tracestate = inject(span)
    return span


def end_batch(span: Any, error: str = "", **attributes: Any) -> None:
    if span is None:
        return
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error[:200]))
    span.set_attributes(attributes)
    span.end()
