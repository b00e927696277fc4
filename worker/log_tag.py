"""Every line a worker process logs names the worker.

Several workers write to one terminal or journal (a frontend's local workers
inherit its stderr), so "loaded model tiny" must say which worker loaded it.
Text lines carry the id after the logger's name, JSON lines a `worker` field:

    2026-11-25 09:38:02,780 INFO batchd.worker[cpu0#1]: loaded model tiny version 1 ...
    {"ts": ..., "logger": "batchd.worker", "msg": "loaded model tiny ...", "worker": "cpu0#1"}

It is set once, on the process's log handlers, so it holds for every logger
in the worker (torch's too), not only for the lines batchd writes.
"""

from __future__ import annotations

import logging

from batchd.protos.logs import TEXT_FORMAT, JsonFormatter, TextFormatter


class WorkerIdFilter(logging.Filter):
    """Stamps each record with the worker's id (the `worker` field)."""

    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.worker_id
        return True


def tag_log_lines(worker_id: str) -> None:
    """Make the root logger's handlers (set up by protos.logs.setup_logging) name the
    worker on every line."""
    text = TextFormatter(TEXT_FORMAT.replace("%(name)s", "%(name)s[%(worker)s]", 1))
    for handler in logging.getLogger().handlers:
        handler.addFilter(WorkerIdFilter(worker_id))
        if not isinstance(handler.formatter, JsonFormatter):
            handler.setFormatter(text)
