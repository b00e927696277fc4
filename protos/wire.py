"""The frontend<->worker wire: one `Header` frame, then one raw frame per tensor.

    worker  --READY(worker info)-->  frontend     once connected, and again if
                                                  the frontend goes silent
    both    --HEARTBEAT-->           peer         every HEARTBEAT_INTERVAL_S
    frontend --LOAD(model, version)--> worker     for every model it should serve
    worker  --LOADED(model, version[, error])--> frontend
    frontend --BATCH(id, model, version, tensors)--> worker
    worker  --RESULT(id, tensors) | ERROR(id, error)--> frontend
    frontend --UNLOAD(model, version)--> worker   once that version has drained
    frontend --STOP--> worker                     finish the batch at hand, exit
    frontend --START(id, model, version, tensors)--> worker   a sequence joins a step loop
    worker  --STEP(round, steps: [id, tensors, final | error | need])--> frontend
                                                  each step round's outputs, streamed
    frontend --CREDIT(id, credit)--> worker       the sequence may send that much more
    frontend --CANCEL(id)--> worker               drop the sequence before its next step

A peer silent for LIVENESS heartbeats is dead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchd.protos.wire_pb2 import Header, Step, Tensor, WorkerInfo

__all__ = [
    "HEARTBEAT_INTERVAL_S",
    "LIVENESS",
    "NOT_HELD",
    "OUTPUT_COST",
    "PROTOCOL_VERSION",
    "Header",
    "Step",
    "Tensor",
    "WorkerInfo",
    "pack",
    "unpack",
]

PROTOCOL_VERSION = 19  # 3: BYTES outputs carry row_offsets; 4: step-wise START/STEP/CANCEL;
# 5: BATCH says whether the model is under load (the worker's torch threads follow);
# 6: BATCH says its rows (packed inputs); 7: PASS, WorkerInfo.frontends (one forward
# for several frontends' batches); 8: CREDIT, START's credit (per-sequence
# flow control of step-wise outputs); 9: Header.invalid, Step.invalid (a model refusing
# its inputs: INVALID_ARGUMENT); 10: HEARTBEAT's occupied (step-wise slots, every
# frontend's); 11: RESULT's waited_ns (a staged batch's wait is queue time); 12: HEARTBEAT's
# busy_ns, idle_ns, running, busy_limit_s (a forward timed from its start); LOAD's held;
# 13: Step.need (a step past its sequence's credit is held at the worker, not sent);
# 14: START's outputs (only those asked for are sent and charged), OUTPUT_COST per tensor;
# 15: WorkerInfo.held (a version retired while its worker was away is unloaded) and
# .reconnected (what was on the wire when a connection reset is taken back); 16: ERROR's
# bounced and HEARTBEAT's alone (a retry runs alone whichever frontends share its worker);
# 17: LOAD's files and folder (the worker checks it reads the files the version was
# numbered for, where it reads the folder they were read in); 18: BATCH's
# max_response_bytes, ERROR's too_large (an output no response may carry stays unsent);
# 19: HEARTBEAT's dropping (a worker dropping a model is not idle)
HEARTBEAT_INTERVAL_S = 1.0
NOT_HELD = "this worker does not hold it"  # LOADED's error for a LOAD with `held`
# What each tensor of a step's outputs takes from its sequence's credit (Header.credit)
# beyond its bytes, for the objects that carry it (on the frontend, about 1 KiB an
# output: 487 MiB for 500,000 unread outputs of 8 bytes; a response of 32 tensors, 11
# KiB); the frontend's stream budget counts the same.
OUTPUT_COST = 1024
LIVENESS = 3
ZERO_COPY_MIN_BYTES = 64 * 1024  # below this, copying a frame is cheaper than tracking it


def text(message: str) -> str:
    """`message` as a string field takes it: a lone surrogate (an exception naming a
    file by its undecodable bytes) is escaped, where protobuf would raise."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


def pack(header: Header, frames: Sequence[Any] = ()) -> list[Any]:
    """The multipart message for `header` and its tensor frames."""
    return [header.SerializeToString(), *frames]


MAX_HEADER_BYTES = 16 * 1024 * 1024  # a Header frame: metadata, a model's error message


def unpack(parts: Sequence[Any]) -> tuple[Header, list[Any]]:
    """Parse a multipart message; raise ValueError if the frame count is wrong."""
    header = Header.FromString(bytes(parts[0]))
    frames = list(parts[1:])
    if len(frames) != len(header.tensors):
        raise ValueError(f"header lists {len(header.tensors)} tensors, {len(frames)} frames came")
    return header, frames
