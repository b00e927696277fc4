"""The ceiling a Python frontend can reach here: a bare grpc.aio Open Inference
Protocol server that answers ModelInfer with its own input (no queue, no
worker, no model). It answers the metadata RPCs perf_analyzer needs for a
model `echo` with INPUT0 FP32 [16] -> OUTPUT0 FP32 [16], max_batch_size 32.

    .venv/bin/python bench/echo_server.py --port 18100
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

from batchd.protos import inference_pb2 as pb
from batchd.protos import inference_pb2_grpc as pb_grpc

TENSOR = {"datatype": "FP32", "shape": [-1, 16]}


class Echo(pb_grpc.GRPCInferenceServiceServicer):
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
            name="echo",
            versions=["1"],
            platform="echo",
            inputs=[pb.TensorMetadata(name="INPUT0", **TENSOR)],
            outputs=[pb.TensorMetadata(name="OUTPUT0", **TENSOR)],
        )

    async def ModelConfig(self, request, context):  # type: ignore[no-untyped-def]
        return pb.ModelConfigResponse(
            config=pb.ModelConfig(
                name="echo",
                platform="echo",
                max_batch_size=32,
                input=[pb.ModelInput(name="INPUT0", data_type=pb.TYPE_FP32, dims=[16])],
                output=[pb.ModelOutput(name="OUTPUT0", data_type=pb.TYPE_FP32, dims=[16])],
            )
        )

    async def ModelInfer(self, request, context):  # type: ignore[no-untyped-def]
        t = request.inputs[0]
        return pb.ModelInferResponse(
            model_name=request.model_name,
            id=request.id,
            outputs=[pb.InferOutputTensor(name="OUTPUT0", datatype=t.datatype, shape=t.shape)],
            raw_output_contents=request.raw_input_contents,
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
    asyncio.run(main(p.parse_args().port))
