"""The frontend's own Python per request, without gRPC, ZeroMQ or a worker.

What one ModelInfer costs in batchd's code: parse the request message, the
servicer's infer() (validate, admit, plan, batch), join the batch's inputs,
split a fake worker reply, resolve the futures, encode and serialize the
response. gRPC's own per-call cost (about 0.2-0.3 ms of CPU on the 2-core
machine) is not in it: this is the part of the frontend that batchd's code
decides, measured steadily enough to compare two versions on a noisy machine.

    .venv/bin/python bench/hotpath.py [--model tiny] [--batch 24] [--saturated]

Requests arrive `--batch` at a time while the fake worker is busy, then the
worker frees and takes them as one batch: the pattern of a saturated frontend.
With `--filling` the worker is idle instead while a patient (saturated)
scheduler lets the batch fill, and the arrival that fills it sends it: each
arrival is a batching decision (set `--batch` to the model's max_batch_size).
Prints microseconds per request (best of --rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path

import numpy as np

from batchd.protos import inference_pb2 as pb
from batchd.protos import wire
from batchd.protos.model_config import ModelConfig
from batchd.protos.repository import find_model
from batchd.server.batching.decision import IDLE, NO_CAPACITY, Capacity
from batchd.server.batching.scheduler import Scheduler
from batchd.server.batching.split_join import join_inputs, split_outputs
from batchd.server.request import Request
from batchd.server.service import InferenceService
from batchd.server.stats import Stats

ROOT = Path(__file__).resolve().parent.parent


class FakeWorker:
    """One worker with one credit; a sent batch waits until `reply()`."""

    def __init__(self) -> None:
        self.batch: list[Request] | None = None

    def capacity(self, key: str) -> Capacity:
        return IDLE if self.batch is None else NO_CAPACITY

    def requests_out(self, key: str) -> int:
        return len(self.batch or ())

    def held(self, key: str) -> bool:
        return True

    def jobs_paused(self, key: str) -> float:
        return 0.0

    def send(self, model: ModelConfig, requests: list[Request]) -> None:
        tensors, _frames = join_inputs(requests)
        wire.Header(kind=wire.Header.BATCH, batch_id=1, tensors=tensors).SerializeToString()
        self.batch = requests

    def reply(self, scheduler: Scheduler) -> None:
        requests, self.batch = self.batch, None
        assert requests is not None
        rows = sum(r.rows for r in requests)
        width = math.prod(requests[0].model.outputs[0].shape)
        out = wire.Tensor(name="OUTPUT0", datatype="FP32", shape=[rows, width])
        frame = np.zeros((rows, width), np.float32).data.cast("B")
        for r, result in zip(requests, split_outputs(requests, [out], [frame]), strict=True):
            r.future.set_result(result)
        scheduler.pump()


class Core:
    def __init__(self, scheduler: Scheduler, cfg: ModelConfig, stats: Stats) -> None:
        self.scheduler = scheduler
        self.models = {cfg.name: cfg}
        self.stats = stats

    def submit(self, request: Request) -> asyncio.Future:
        return self.scheduler.submit(request)

    def check_room(self, key: str) -> None:
        self.scheduler.check_room(key)


async def measure(
    cfg: ModelConfig, batch: int, saturated: bool, n: int, filling: bool = False
) -> float:
    worker = FakeWorker()
    now = [0.0]  # the scheduler's clock: each batch's window has run out when the worker frees
    scheduler = Scheduler(worker, clock=lambda: now[0], patient=lambda: saturated)
    scheduler.add_model(cfg)
    stats = Stats()
    stats.model(cfg.name)
    service = InferenceService(Core(scheduler, cfg, stats))  # type: ignore[arg-type]
    width = math.prod(cfg.inputs[0].shape)
    wire_msg = pb.ModelInferRequest(
        model_name=cfg.name,
        id="r",
        inputs=[pb.InferInputTensor(name="INPUT0", datatype="FP32", shape=[1, width])],
        raw_input_contents=[np.zeros((1, width), np.float32).tobytes()],
    ).SerializeToString()

    async def one() -> None:
        msg = pb.ModelInferRequest.FromString(wire_msg)
        response = await service.infer(msg, None)
        response.SerializeToString()

    async def one_batch(filling: bool) -> None:
        worker.batch = None if filling else []  # busy: the `batch` requests queue behind it
        tasks = [asyncio.ensure_future(one()) for _ in range(batch)]
        await asyncio.sleep(0)  # each task runs up to its await: all are queued
        if not filling:  # (filling: the last arrival filled the batch and sent it)
            now[0] += 0.1  # past any delay (at most 20 ms), not a silence that resets callers
            worker.batch = None  # the busy worker frees and takes the queue as one batch ...
            scheduler.pump()
        worker.reply(scheduler)  # ... which comes back at once
        await asyncio.gather(*tasks)

    if filling:  # the scheduler first sees `batch` callers present, as a loaded server has
        await one_batch(False)
    start = time.perf_counter()
    for _ in range(n // batch):
        await one_batch(filling)
    return (time.perf_counter() - start) / (n // batch * batch) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a model of examples/models with INPUT0 FP32")
    p.add_argument("--batch", type=int, default=24, help="requests per batch")
    p.add_argument("--saturated", action="store_true", help="the scheduler's patient mode")
    p.add_argument("--filling", action="store_true", help="idle worker, batches fill (saturated)")
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    cfg = find_model(ROOT / "examples" / "models", args.model)
    best = min(
        asyncio.run(
            measure(cfg, args.batch, args.saturated or args.filling, args.requests, args.filling)
        )
        for _ in range(args.rounds)
    )
    mode = "filling" if args.filling else "saturated" if args.saturated else "eager"
    print(f"{args.model}: {best:.1f} us per request (batches of {args.batch}, {mode})")


if __name__ == "__main__":
    main()
