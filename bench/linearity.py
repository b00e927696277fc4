"""The frontend's work and memory per request, as each dimension of a request grows
1x, 10x and 100x: rows (and so chunks), elements per row, BYTES elements and
their size, typed contents, ragged lengths.

For each request it runs the frontend's whole path as pure functions, as the
server does: decode_request, split_request into chunks, join_inputs for each
chunk's batch, split_outputs of an echoing worker's reply, join_results,
encode_response. It reports

  * ns per byte of the message, for the path and at each size (linear: the
    column stays flat as the size grows 100x);
  * the longest the event loop is held at once: the longest of the steps the
    server runs as one piece (decode, unless the servicer moves it to its
    decode thread, as it does above service.INLINE_WORK elements; the split into
    chunks; one batch's join; one reply's split; the answer's join and encode);
  * peak memory the path allocates (tracemalloc, numpy included) over the
    message's size, and the worst such ratio.

    .venv/bin/python bench/linearity.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from batchd.protos import inference_pb2 as pb
from batchd.protos import wire
from batchd.protos.model_config import BatchingConfig, ModelConfig, TensorSpec
from batchd.protos.tensors import bytes_row_offsets, serialize_bytes
from batchd.server.batching.split_join import (
    join_inputs,
    join_results,
    split_outputs,
    split_request,
)
from batchd.server.codec import Limits, decode_request, decode_work, encode_response
from batchd.server.service import INLINE_WORK

HERE = Path(__file__).resolve().parent
LIMITS = Limits(max_tensor_elements=1 << 30, max_response_bytes=1 << 31)


def model(name: str, datatype: str, shape: tuple[int, ...], ragged: bool = False) -> ModelConfig:
    spec = TensorSpec("X", datatype, shape, ragged=ragged)
    out = TensorSpec("Y", datatype, shape, ragged_like="X" if ragged else None)
    return ModelConfig(
        name=name,
        directory=HERE,
        artifact=HERE / "model.py",
        platform="python",
        max_batch_size=32,
        inputs=(spec,),
        outputs=(out,),
        batching=BatchingConfig(max_queue_size=1 << 20),
    )


def request(m: ModelConfig, shape: list[int], raw: bytes | None, typed: Any = None) -> Any:
    msg = pb.ModelInferRequest(model_name=m.name)
    t = msg.inputs.add(name="X", datatype=m.inputs[0].datatype, shape=shape)
    if raw is not None:
        msg.raw_input_contents.append(raw)
    else:
        field = "bytes_contents" if m.inputs[0].datatype == "BYTES" else "fp32_contents"
        getattr(t.contents, field).extend(typed)
    return msg


FP32_ROW = model("fp32_row", "FP32", (16,))
FP32_WIDE = model("fp32_wide", "FP32", (-1,))
BYTES_ROW = model("bytes_row", "BYTES", (1,))
BYTES_WIDE = model("bytes_wide", "BYTES", (-1,))
RAGGED = model("ragged", "INT64", (-1,), ragged=True)


def mixed(n: int, size: int = 1) -> bytes:
    """n BYTES elements of alternating lengths (0 and `size`): not one length, so
    the walk over them is the Python one, the slowest."""
    return serialize_bytes([b"" if i % 2 else b"x" * size for i in range(n)])


# name -> (dimension grown, builder of a message at scale k)
CASES: dict[str, tuple[str, Callable[[int], tuple[ModelConfig, Any]]]] = {
    "fp32 rows (x16)": ("rows", lambda k: (FP32_ROW, request(
        FP32_ROW, [320 * k, 16], np.zeros((320 * k, 16), np.float32).tobytes()))),
    "fp32 elements per row": ("elements/row", lambda k: (FP32_WIDE, request(
        FP32_WIDE, [64, 256 * k], np.zeros((64, 256 * k), np.float32).tobytes()))),
    "fp32 typed values": ("values", lambda k: (FP32_WIDE, request(
        FP32_WIDE, [64, 16 * k], None, [0.5] * (64 * 16 * k)))),
    "bytes rows, empty": ("rows", lambda k: (BYTES_ROW, request(
        BYTES_ROW, [640 * k, 1], b"\0\0\0\0" * (640 * k)))),
    "bytes rows, mixed lengths": ("rows", lambda k: (BYTES_ROW, request(
        BYTES_ROW, [640 * k, 1], mixed(640 * k)))),
    "bytes elements per row": ("elements/row", lambda k: (BYTES_WIDE, request(
        BYTES_WIDE, [64, 10 * k], mixed(640 * k)))),
    "bytes element size": ("bytes/element", lambda k: (BYTES_ROW, request(
        BYTES_ROW, [640, 1], mixed(640, 16 * k)))),
    "bytes typed values": ("values", lambda k: (BYTES_WIDE, request(
        BYTES_WIDE, [64, 10 * k], None, [b"" if i % 2 else b"x" for i in range(640 * k)]))),
    "ragged length": ("length", lambda k: (RAGGED, request(
        RAGGED, [32, 64 * k], np.ones((32, 64 * k), np.int64).tobytes()))),
    "ragged rows": ("rows", lambda k: (RAGGED, request(
        RAGGED, [320 * k, 64], np.ones((320 * k, 64), np.int64).tobytes()))),
}  # fmt: skip


def echo(headers: list[wire.Tensor], frames: list[Any]) -> tuple[list[wire.Tensor], list[Any]]:
    """What an echoing worker sends back for one batch."""
    h, f = headers[0], frames[0]
    data = bytes(memoryview(f).cast("B"))
    t = wire.Tensor(name="Y", datatype=h.datatype, shape=list(h.shape))
    if h.datatype == "BYTES":
        t.row_offsets.extend(bytes_row_offsets(data, h.shape[0], math.prod(h.shape[1:])).tolist())
    return [t], [data]


def path(m: ModelConfig, msg: Any) -> dict[str, float]:
    """Seconds of each step the server runs as one piece on its event loop: decode,
    split into chunks, each batch's join (the longest), each reply's split (the
    longest), the caller's join and encode. The worker's echo is not counted."""
    clock = time.perf_counter
    t = clock()
    r = decode_request(msg, m, now=0.0, limits=LIMITS)
    steps = {"decode": clock() - t}
    t = clock()
    per_batch = m.rows_per_batch(r.length)
    chunks = split_request(r, per_batch) if r.rows > per_batch else [r]
    steps["split"] = clock() - t
    parts, joins, splits = [], [], []
    for c in chunks:
        t = clock()
        headers, frames = join_inputs([c])
        joins.append(clock() - t)
        replies = echo(headers, frames)
        t = clock()
        parts.append(split_outputs([c], *replies)[0])
        splits.append(clock() - t)
    t = clock()
    results = join_results(parts) if len(parts) > 1 else parts[0]
    encode_response(r, results, LIMITS.max_response_bytes)
    steps["answer"] = clock() - t
    steps["batch"] = max(joins)
    steps["reply"] = max(splits)
    steps["total"] = steps["decode"] + steps["split"] + sum(joins) + sum(splits) + steps["answer"]
    return steps


def measure(m: ModelConfig, msg: Any, repeat: int = 3) -> dict[str, Any]:
    size = msg.ByteSize()
    best = min((path(m, msg) for _ in range(repeat)), key=lambda s: s["total"])
    tracemalloc.start()
    path(m, msg)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    inline = decode_work(msg, LIMITS) <= INLINE_WORK
    on_loop = ["split", "batch", "reply", "answer"] + (["decode"] if inline else [])
    longest = max(on_loop, key=lambda k: best[k])
    return {
        "bytes": size,
        "ns_per_byte": round(best["total"] / size * 1e9, 2),
        "decode_ms": round(best["decode"] * 1e3, 3),
        "loop_ms": round(best[longest] * 1e3, 3),
        "loop_step": longest,
        "decoded_aside": not inline,
        "memory_x": round(peak / size, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
         if ln.startswith("model name")), platform.processor(),
    )  # fmt: skip
    print(f"CPU: {cpu}; the frontend's path as pure functions, best of 3\n")
    print(
        "| case | grows | x | bytes | ns/byte | longest loop step, ms | decode ms | memory/size |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for name, (dim, build) in CASES.items():
        for k in (1, 10, 100):
            m, msg = build(k)
            r = {"case": name, "grows": dim, "x": k, **measure(m, msg)}
            rows.append(r)
            aside = " (aside)" if r["decoded_aside"] else ""
            print(
                f"| {name} | {dim} | {k} | {r['bytes']:,} | {r['ns_per_byte']} | "
                f"{r['loop_ms']} ({r['loop_step']}) | {r['decode_ms']}{aside} | {r['memory_x']} |",
                flush=True,
            )
    worst = max(rows, key=lambda r: r["memory_x"])
    growth = {  # ns/byte at 100x over 1x: above 1 would mean work growing faster than size
        name: round(
            next(r["ns_per_byte"] for r in rows if r["case"] == name and r["x"] == 100)
            / next(r["ns_per_byte"] for r in rows if r["case"] == name and r["x"] == 1),
            2,
        )
        for name in CASES
    }
    print(f"\nworst memory / size: {worst['memory_x']} ({worst['case']}, x{worst['x']})")
    print(f"longest loop hold: {max(r['loop_ms'] for r in rows)} ms")
    print("ns/byte at 100x over ns/byte at 1x, per case:", json.dumps(growth))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "rows": rows, "growth": growth}, indent=1))


if __name__ == "__main__":
    main()
