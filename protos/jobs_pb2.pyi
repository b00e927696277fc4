from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubmitJobRequest(_message.Message):
    __slots__ = ("model_name", "model_version", "data", "idempotency_key")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    data: bytes
    idempotency_key: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., data: _Optional[bytes] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("id", "model_name", "model_version", "status", "total", "completed", "failed", "created_at", "started_at", "finished_at", "rows_per_second", "eta_seconds", "error", "input_bytes", "results_bytes")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ETA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESULTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    id: str
    model_name: str
    model_version: str
    status: str
    total: int
    completed: int
    failed: int
    created_at: float
    started_at: float
    finished_at: float
    rows_per_second: float
    eta_seconds: float
    error: str
    input_bytes: int
    results_bytes: int
    def __init__(self, id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., status: _Optional[str] = ..., total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., rows_per_second: _Optional[float] = ..., eta_seconds: _Optional[float] = ..., error: _Optional[str] = ..., input_bytes: _Optional[int] = ..., results_bytes: _Optional[int] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("status", "limit")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    status: str
    limit: int
    def __init__(self, status: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class JobResultsRequest(_message.Message):
    __slots__ = ("id", "offset")
    ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    id: str
    offset: int
    def __init__(self, id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class JobResultsChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
