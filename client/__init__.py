"""batchd.client: Client / AsyncClient over gRPC; numpy in, numpy out.

Works against any Open Inference Protocol server (batchd, Triton, ...).
"""

from batchd.client.client import AsyncClient, Client
from batchd.client.errors import (
    BadResponse,
    BatchdClientError,
    DeadlineExceeded,
    InferenceFailed,
    InvalidInput,
    JobNotFound,
    LimitExceeded,
    ModelNotFound,
    ServerBusy,
    ServerUnavailable,
    Unauthenticated,
)
from batchd.client.views import BatchStats, Duration, ModelStats

__all__ = [
    "AsyncClient",
    "BadResponse",
    "BatchStats",
    "BatchdClientError",
    "Client",
    "DeadlineExceeded",
    "Duration",
    "InferenceFailed",
    "InvalidInput",
    "JobNotFound",
    "LimitExceeded",
    "ModelNotFound",
    "ModelStats",
    "ServerBusy",
    "ServerUnavailable",
    "Unauthenticated",
]
