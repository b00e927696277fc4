"""The ceiling a Python frontend can reach here: a bare grpc.aio Open Inference
Protocol server that answers ModelInfer with its own input (no queue, no
worker, no model). It answers the metadata RPCs perf_analyzer needs for a
model `echo` with INPUT0 FP32 [16] -> OUTPUT0 FP32 [16], max_batch_size 32.

    .venv/bin/python bench/echo_server.py --port 18100

With `--mlp` it is the unbatched floor instead: a model `mlp` (INPUT0 FP32
[512]) run inline, one request at a time, in the event loop on one torch
thread (examples/models/mlp): no queue, no batching, no worker process.

With `--batched` every call waits, as a batching server's do: it suspends on a
future, and one callback resumes all the calls that came by then. What that
costs gRPC and asyncio, with none of a batcher's own work.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc
import numpy as np

from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc

NAME, DIM = "echo", 16
TENSOR = {"datatype": "FP32", "shape": [-1, DIM]}
MODEL = None  # --mlp: the torch module run inline
BATCHED = False  # --batched: each call waits on a future, resolved with others in one callback


class Echo(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self) -> None:
        self._waiting: list[asyncio.Future[None]] = []

    def _answer_all(self) -> None:
        waiting, self._waiting = self._waiting, []
        for f in waiting:
            if not f.done():
                f.set_result(None)

    async def _wait_turn(self) -> None:
        """Suspend the call until one callback resumes every call that arrived by then."""
        if not self._waiting:
            asyncio.get_running_loop().call_soon(self._answer_all)
        f = asyncio.get_running_loop().create_future()
        self._waiting.append(f)
        await f

    async def ServerLive(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ServerMetadataResponse(name="echo", version="0")

    async def ModelMetadata(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ModelMetadataResponse(
            name=NAME,
            versions=["1"],
            platform="echo",
            inputs=[pb.TensorMetadata(name="INPUT0", **TENSOR)],
            outputs=[pb.TensorMetadata(name="OUTPUT0", **TENSOR)],
        )

    async def ModelConfig(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ModelConfigResponse(
            config=pb.ModelConfig(
                name=NAME,
                platform="echo",
                max_batch_size=32,
                input=[pb.ModelInput(name="INPUT0", data_type=pb.TYPE_FP32, dims=[DIM])],
                output=[pb.ModelOutput(name="OUTPUT0", data_type=pb.TYPE_FP32, dims=[DIM])],
            )
        )

    async def ModelInfer(self, request, context):  # type: ignore[no-untyped-def]
        t = request.inputs[0]
        raw = request.raw_input_contents
        if BATCHED:
            await self._wait_turn()
        if MODEL is not None:
            import torch  # only --mlp pays for it

            x = torch.from_numpy(np.frombuffer(raw[0], np.float32).reshape(list(t.shape)))
            with torch.inference_mode():
                raw = [MODEL(x).numpy().tobytes()]
        return pb.ModelInferResponse(
            model_name=request.model_name,
            id=request.id,
            outputs=[pb.InferOutputTensor(name="OUTPUT0", datatype=t.datatype, shape=t.shape)],
            raw_output_contents=raw,
        )


async def main(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"echo server on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=18100)
    p.add_argument("--mlp", action="store_true", help="serve examples' mlp inline, unbatched")
    p.add_argument(
        "--batched",
        action="store_true",
        help="each call waits for one callback that resumes all that came by then",
    )
    args = p.parse_args()
    BATCHED = args.batched
    if args.mlp:
        import sys

        import torch

        sys.path.insert(0, "examples/models/mlp")
        from model import build  # type: ignore[import-not-found]

        torch.set_num_threads(1)
        NAME, DIM, MODEL = "mlp", 512, build()
        TENSOR["shape"] = [-1, DIM]
    asyncio.run(main(args.port))
