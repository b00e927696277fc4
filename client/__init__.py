"""batchd.client: Client / AsyncClient over gRPC; numpy in, numpy out.

Works against any Open Inference Protocol server (batchd, Triton, ...).
"""

from batchd.client.client import AsyncClient, Client
from batchd.client.errors import (
    BatchdClientError,
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    ModelNotFound,
    ServerBusy,
    ServerUnavailable,
    Unauthenticated,
)

__all__ = [
    "AsyncClient",
    "BatchdClientError",
    "Client",
    "DeadlineExceeded",
    "InferenceFailed",
    "InvalidInput",
    "ModelNotFound",
    "ServerBusy",
    "ServerUnavailable",
    "Unauthenticated",
]
