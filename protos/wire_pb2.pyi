from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("name", "datatype", "shape", "row_offsets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    row_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., row_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "device", "pid", "models", "protocol", "frontends", "instance", "held", "reconnected")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    RECONNECTED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device: str
    pid: int
    models: _containers.RepeatedScalarFieldContainer[str]
    protocol: int
    frontends: int
    instance: str
    held: _containers.RepeatedScalarFieldContainer[str]
    reconnected: bool
    def __init__(self, worker_id: _Optional[str] = ..., device: _Optional[str] = ..., pid: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., protocol: _Optional[int] = ..., frontends: _Optional[int] = ..., instance: _Optional[str] = ..., held: _Optional[_Iterable[str]] = ..., reconnected: _Optional[bool] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("kind", "batch_id", "model", "tensors", "error", "worker", "compute_ns", "version", "active", "round", "steps", "loaded", "alone", "forward_rows", "traceparent", "rows", "credit", "invalid", "occupied", "waited_ns", "busy_ns", "idle_ns", "running", "busy_limit_s", "held", "outputs", "bounced", "files", "folder", "max_response_bytes", "too_large", "tracestate", "dropping")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Header.Kind]
        READY: _ClassVar[Header.Kind]
        HEARTBEAT: _ClassVar[Header.Kind]
        BATCH: _ClassVar[Header.Kind]
        RESULT: _ClassVar[Header.Kind]
        ERROR: _ClassVar[Header.Kind]
        STOP: _ClassVar[Header.Kind]
        LOAD: _ClassVar[Header.Kind]
        LOADED: _ClassVar[Header.Kind]
        UNLOAD: _ClassVar[Header.Kind]
        START: _ClassVar[Header.Kind]
        STEP: _ClassVar[Header.Kind]
        CANCEL: _ClassVar[Header.Kind]
        PASS: _ClassVar[Header.Kind]
        CREDIT: _ClassVar[Header.Kind]
    KIND_UNSPECIFIED: Header.Kind
    READY: Header.Kind
    HEARTBEAT: Header.Kind
    BATCH: Header.Kind
    RESULT: Header.Kind
    ERROR: Header.Kind
    STOP: Header.Kind
    LOAD: Header.Kind
    LOADED: Header.Kind
    UNLOAD: Header.Kind
    START: Header.Kind
    STEP: Header.Kind
    CANCEL: Header.Kind
    PASS: Header.Kind
    CREDIT: Header.Kind
    class OccupiedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    ALONE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ROWS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    OCCUPIED_FIELD_NUMBER: _ClassVar[int]
    WAITED_NS_FIELD_NUMBER: _ClassVar[int]
    BUSY_NS_FIELD_NUMBER: _ClassVar[int]
    IDLE_NS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    BUSY_LIMIT_S_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    BOUNCED_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOO_LARGE_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    DROPPING_FIELD_NUMBER: _ClassVar[int]
    kind: Header.Kind
    batch_id: int
    model: str
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    error: str
    worker: WorkerInfo
    compute_ns: int
    version: str
    active: int
    round: int
    steps: _containers.RepeatedCompositeFieldContainer[Step]
    loaded: bool
    alone: bool
    forward_rows: int
    traceparent: str
    rows: int
    credit: int
    invalid: bool
    occupied: _containers.ScalarMap[str, int]
    waited_ns: int
    busy_ns: int
    idle_ns: int
    running: _containers.RepeatedScalarFieldContainer[int]
    busy_limit_s: float
    held: bool
    outputs: _containers.RepeatedScalarFieldContainer[str]
    bounced: bool
    files: str
    folder: str
    max_response_bytes: int
    too_large: bool
    tracestate: str
    dropping: bool
    def __init__(self, kind: _Optional[_Union[Header.Kind, str]] = ..., batch_id: _Optional[int] = ..., model: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., error: _Optional[str] = ..., worker: _Optional[_Union[WorkerInfo, _Mapping]] = ..., compute_ns: _Optional[int] = ..., version: _Optional[str] = ..., active: _Optional[int] = ..., round: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[Step, _Mapping]]] = ..., loaded: _Optional[bool] = ..., alone: _Optional[bool] = ..., forward_rows: _Optional[int] = ..., traceparent: _Optional[str] = ..., rows: _Optional[int] = ..., credit: _Optional[int] = ..., invalid: _Optional[bool] = ..., occupied: _Optional[_Mapping[str, int]] = ..., waited_ns: _Optional[int] = ..., busy_ns: _Optional[int] = ..., idle_ns: _Optional[int] = ..., running: _Optional[_Iterable[int]] = ..., busy_limit_s: _Optional[float] = ..., held: _Optional[bool] = ..., outputs: _Optional[_Iterable[str]] = ..., bounced: _Optional[bool] = ..., files: _Optional[str] = ..., folder: _Optional[str] = ..., max_response_bytes: _Optional[int] = ..., too_large: _Optional[bool] = ..., tracestate: _Optional[str] = ..., dropping: _Optional[bool] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("id", "tensors", "final", "error", "invalid", "need", "too_large")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    NEED_FIELD_NUMBER: _ClassVar[int]
    TOO_LARGE_FIELD_NUMBER: _ClassVar[int]
    id: int
    tensors: int
    final: bool
    error: str
    invalid: bool
    need: int
    too_large: bool
    def __init__(self, id: _Optional[int] = ..., tensors: _Optional[int] = ..., final: _Optional[bool] = ..., error: _Optional[str] = ..., invalid: _Optional[bool] = ..., need: _Optional[int] = ..., too_large: _Optional[bool] = ...) -> None: ...
