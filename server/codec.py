"""ModelInferRequest -> Request (validated) and results -> ModelInferResponse.

Pure functions, no I/O. Every rejection is InvalidInput with a message that
names the input and says what was expected and what came, quoting at most a
short prefix of what the client sent (errors.clip). Raw tensor bytes are
checked for size but never decoded into Python objects; typed contents are
converted to the raw form once, here.

Cost: every check that bounds work (input count, element counts, requested
outputs, ragged lengths) reads the header first, so the work is linear in the
request's size with a small constant. Only two paths touch elements one by one
in Python: the walk over BYTES length prefixes (bounded by the element count the
shape declares, so a buffer packed with more elements costs no more) and typed
contents. `decode_work` counts those elements from the header alone, so the
servicer can move a heavy request off the event loop before decoding it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence

from batchd.protos import inference_pb2 as pb
from batchd.protos.datatypes import DATATYPES
from batchd.protos.model_config import ModelConfig, TensorSpec
from batchd.protos.tensors import bounded_count, bytes_row_offsets, contents_to_raw
from batchd.server.config import Limits
from batchd.server.errors import InvalidInput, ResponseTooLarge, clip, clip_list, parameter_said
from batchd.server.request import Request, Tensor

_CONTENT_FIELDS = tuple(f.name for f in pb.InferTensorContents.DESCRIPTOR.fields)
_UNSERVED = frozenset({"classification", "shared_memory_region"})  # Triton's extensions
DEFAULT_LIMITS = Limits()
# A request's id is echoed in each of its responses: a step-wise request's, in each of
# up to max_steps, where a 4 MB id made 1 GB of responses outside its stream's budget.
MAX_ID_BYTES = 4096
WRAPPER_BYTES = 64  # a stream's ModelStreamInferResponse and final flag, around a response


def _names(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(repr(s.name) for s in specs)


def _wrong_rank(spec: TensorSpec, model: ModelConfig, dims: Sequence[int]) -> InvalidInput:
    """A shape of the wrong number of dimensions, refused from its length alone (O(1) on
    a repeated field) before a tuple of millions of dimensions is ever built."""
    expected = [-1, *spec.shape] if model.batches else list(spec.shape)
    first = " (batch dim first)" if model.batches else ""
    return InvalidInput(
        f"input {spec.name!r}: expected shape {expected}{first} of {len(expected)} "
        f"dimensions, got {len(dims)} dimensions: {clip_list(dims)}"
    )


def _check_shape(spec: TensorSpec, model: ModelConfig, shape: tuple[int, ...]) -> None:
    if min(shape, default=0) < 0:
        raise InvalidInput(
            f"input {spec.name!r}: shape {clip_list(shape)} has a negative dimension"
        )
    if not model.batches:
        if not spec.accepts(shape):
            raise InvalidInput(
                f"input {spec.name!r}: expected shape {list(spec.shape)}, got {clip_list(shape)}"
            )
        return
    if not spec.accepts(shape[1:]):  # of the right rank: _decode_inputs checked it
        raise InvalidInput(
            f"input {spec.name!r}: expected shape {[-1, *spec.shape]} (batch dim first), "
            f"got {clip_list(shape)}"
        )
    if shape[0] < 1:
        raise InvalidInput(f"input {spec.name!r}: the batch dim must be at least 1, got {shape[0]}")
    if spec.ragged:
        _check_length(spec, model, shape[1])
    per_batch = model.rows_per_batch(shape[1] if spec.ragged else 0)
    if shape[0] > (most := per_batch * model.batching.max_queue_size):
        raise InvalidInput(
            f"input {spec.name!r}: {shape[0]} rows would need more batches of {per_batch} "
            f"than model {model.name!r} queues ({model.batching.max_queue_size}); "
            f"send at most {most} rows a request"
        )


def _check_length(spec: TensorSpec, model: ModelConfig, length: int) -> None:
    if length < 1:
        raise InvalidInput(
            f"input {spec.name!r}: a ragged input needs at least one element per row, got 0"
        )
    limit, setting = model.length_limit(spec)
    if limit and length > limit:
        raise InvalidInput(
            f"input {spec.name!r}: rows of {length} elements, more than model "
            f"{model.name!r} takes ({setting} = {limit})"
        )


def _raw_data(spec: TensorSpec, shape: tuple[int, ...], data: bytes, batches: bool) -> Tensor:
    dt = DATATYPES[spec.datatype]
    if dt.is_bytes:
        return _bytes_tensor(spec, shape, data, batches)
    count = math.prod(shape)
    if len(data) != count * dt.itemsize:
        raise InvalidInput(
            f"input {spec.name!r}: {spec.datatype} shape {clip_list(shape)} needs "
            f"{count * dt.itemsize} bytes ({count} x {dt.itemsize}), raw contents hold {len(data)}"
        )
    return Tensor(spec.name, spec.datatype, shape, data)


def _bytes_tensor(spec: TensorSpec, shape: tuple[int, ...], data: bytes, batches: bool) -> Tensor:
    """A BYTES tensor with its row offsets, found in the one walk that validates it."""
    rows = shape[0] if batches else 1
    per_row = math.prod(shape[1:] if batches else shape)
    try:
        offsets = bytes_row_offsets(data, rows, per_row)
    except ValueError as e:
        raise InvalidInput(f"input {spec.name!r} of shape {clip_list(shape)}: {e}") from None
    return Tensor(spec.name, spec.datatype, shape, data, offsets)


def _typed_data(
    spec: TensorSpec, shape: tuple[int, ...], tensor: pb.InferInputTensor, batches: bool
) -> Tensor:
    dt = DATATYPES[spec.datatype]
    where = f"input {spec.name!r}"
    if dt.contents_field is None:
        raise InvalidInput(
            f"{where}: datatype {spec.datatype} exists only in raw form; "
            "send it in raw_input_contents"
        )
    contents = tensor.contents
    stray = [f for f in _CONTENT_FIELDS if f != dt.contents_field and len(getattr(contents, f))]
    if stray:
        raise InvalidInput(
            f"{where}: datatype {spec.datatype} reads contents.{dt.contents_field}, "
            f"but the request fills {', '.join(stray)}"
        )
    values = getattr(contents, dt.contents_field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidInput(
            f"{where}: shape {clip_list(shape)} needs {count} values, "
            f"contents.{dt.contents_field} holds {len(values)}"
        )
    try:
        data = contents_to_raw(spec.datatype, values)
    except (OverflowError, ValueError) as e:  # "UINT8 holds 0 to 255, got 300", as REST says
        raise InvalidInput(f"{where}: {e}") from None
    if dt.is_bytes:
        return _bytes_tensor(spec, shape, data, batches)
    return Tensor(spec.name, spec.datatype, shape, data)


def decode_work(msg: pb.ModelInferRequest, limits: Limits = DEFAULT_LIMITS) -> int:
    """How many elements decode_request would handle one by one in Python (BYTES
    elements, typed values), read from the header alone: a request over the limits
    counts 0, as it is refused before any such work."""
    if len(msg.inputs) > limits.max_inputs:
        return 0
    work = 0
    raw = bool(msg.raw_input_contents)
    for t in msg.inputs:
        if not raw:
            c = t.contents
            work += sum(len(getattr(c, f)) for f in _CONTENT_FIELDS)
        elif t.datatype == "BYTES":
            count = bounded_count(t.shape, limits.max_tensor_elements)
            work += count if 0 < count <= limits.max_tensor_elements else 0
    return work


def _int_param(msg: pb.ModelInferRequest, name: str, unit: str) -> int | None:
    if name not in msg.parameters:
        return None
    p = msg.parameters[name]
    kind = p.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise InvalidInput(
            f"parameter {name!r}: expected an integer {unit}, got {parameter_said(p)}"
        )
    value = int(p.int64_param if kind == "int64_param" else p.uint64_param)
    if value < 0:
        raise InvalidInput(f"parameter {name!r}: expected an integer {unit} >= 0, got {value}")
    return value


def _queue_deadline(msg: pb.ModelInferRequest, now: float, default_us: int) -> float:
    """The deadline set by the `timeout` parameter (which may only shorten the
    model's default_timeout_us) or by that default."""
    timeout_us = default_us
    value = _int_param(msg, "timeout", "of microseconds")
    if value and (not timeout_us or value < timeout_us):
        timeout_us = value
    return now + timeout_us / 1e6 if timeout_us else math.inf


def _level(msg: pb.ModelInferRequest, model: ModelConfig) -> int:
    """The 0-based priority level from parameter `priority`: 0 (or none) is the model's
    default_priority_level, 1 the highest, priority_levels the lowest. A model without
    priority levels ignores it (as Triton does), but not a value that is no level."""
    levels = model.batching.priority_levels
    if "priority" not in msg.parameters:
        value = 0
    else:
        p = msg.parameters["priority"]
        kind = p.WhichOneof("parameter_choice")
        value = int(p.int64_param if kind == "int64_param" else p.uint64_param)
        top = f"1 (highest) to {levels}" if levels else "1 (highest) and up"
        if kind not in ("int64_param", "uint64_param") or value < 0 or (levels and value > levels):
            got = value if kind in ("int64_param", "uint64_param") else parameter_said(p)
            raise InvalidInput(
                f"parameter 'priority': model {model.name!r} takes 0 (its default level, "
                f"{model.batching.default_priority_level or 'none'}) or a level {top}, got {got}"
            )
    if not levels:
        return 0
    return (value or model.batching.default_priority_level) - 1


def _decode_inputs(
    msg: pb.ModelInferRequest, model: ModelConfig, limits: Limits
) -> dict[str, Tensor]:
    raw = msg.raw_input_contents
    by_name: dict[str, Tensor] = {}
    for i, t in enumerate(msg.inputs):
        spec = model.input(t.name)
        if spec is None:
            raise InvalidInput(
                f"unknown input {clip(t.name)} for model {model.name!r}; "
                f"expected {_names(model.inputs)}"
            )
        if t.name in by_name:
            raise InvalidInput(f"input {t.name!r} appears twice")
        refuse_unserved("input", t.name, t.parameters)  # (shared memory: no data sent)
        if t.datatype != spec.datatype:
            raise InvalidInput(
                f"input {t.name!r}: expected datatype {spec.datatype}, "
                f"got {clip(t.datatype) if t.datatype else 'none'}"
            )
        if len(dims := t.shape) != len(spec.shape) + model.batches:
            raise _wrong_rank(spec, model, dims)
        shape = tuple(dims)
        _check_shape(spec, model, shape)
        if (count := math.prod(shape)) > limits.max_tensor_elements:
            raise InvalidInput(
                f"input {t.name!r}: shape {clip_list(shape)} has {count} elements, more than "
                f"the server's limit of {limits.max_tensor_elements} (--max-tensor-elements)"
            )
        if raw:
            if t.HasField("contents"):
                raise InvalidInput(
                    f"input {t.name!r} carries contents while the request "
                    "uses raw_input_contents; use one form for all inputs"
                )
            by_name[t.name] = _raw_data(spec, shape, raw[i], model.batches)
        else:
            by_name[t.name] = _typed_data(spec, shape, t, model.batches)
    return by_name


def _requested_outputs(msg: pb.ModelInferRequest, model: ModelConfig) -> tuple[str, ...]:
    """The outputs asked for, each at most once: a response never repeats an output."""
    if not msg.outputs:
        return model.output_names
    if len(msg.outputs) > len(model.outputs):
        raise InvalidInput(
            f"the request asks for {len(msg.outputs)} outputs; model {model.name!r} has "
            f"{len(model.outputs)} ({_names(model.outputs)}), and each may be asked for once"
        )
    for o in msg.outputs:
        refuse_unserved("output", o.name, o.parameters)
        if model.output(o.name) is None:
            raise InvalidInput(
                f"unknown output {clip(o.name)} requested from model {model.name!r}; "
                f"expected {_names(model.outputs)}"
            )
    if len(set(outputs := tuple(o.name for o in msg.outputs))) != len(outputs):
        twice = sorted({n for n in outputs if outputs.count(n) > 1})
        raise InvalidInput(f"output(s) {twice} requested more than once; ask for each once")
    return outputs


def refuse_unserved(kind: str, name: str, parameters: Collection[str]) -> None:  # (not ignored)
    if parameters and (unserved := _UNSERVED.intersection(parameters)):
        raise InvalidInput(f"{kind} {clip(name)}: parameter {min(unserved)!r} asks for a "
                           "Triton extension batchd does not serve")  # fmt: skip


def fixed_output_bytes(model: ModelConfig, names: Iterable[str], rows: int) -> tuple[int, bool]:
    """What outputs `names` (the model's, others skipped) hold for `rows` rows where the
    model's signature fixes their size, and whether it fixes every one's (not BYTES, nor
    a dim the model decides)."""
    total, whole = 0, True
    for name in names:
        if (out := model.output(name)) is None:
            continue
        size = DATATYPES[out.datatype].itemsize
        if not size or any(d < 0 for d in out.shape):
            whole = False
        else:
            total += rows * math.prod(out.shape) * size
    return total, whole


def too_large(size: int, most: int, what: str = "the outputs for this request hold") -> str:
    return (f"{what} {size} bytes, more than a response may carry ({most}, "
            "--max-message-bytes); ask for fewer rows or outputs")  # fmt: skip


def echoable(id_: str) -> bool:
    """Whether an id is short enough to come back in responses (MAX_ID_BYTES)."""
    return len(id_) <= MAX_ID_BYTES // 4 or len(id_.encode()) <= MAX_ID_BYTES


def check_inputs(count: int, limits: Limits) -> None:
    """A request's number of inputs, checked before any of them is read (HTTP's too)."""
    if count > limits.max_inputs:
        raise InvalidInput(
            f"the request has {count} inputs, more than the server's limit "
            f"of {limits.max_inputs} (--max-inputs-per-request)"
        )


def decode_request(
    msg: pb.ModelInferRequest,
    model: ModelConfig,
    now: float,
    deadline: float = math.inf,
    limits: Limits = DEFAULT_LIMITS,
) -> Request:
    """Validate `msg` against `model`'s signature and build the internal Request."""
    if not echoable(msg.id):
        raise InvalidInput(f"the request id holds {len(msg.id.encode())} bytes, more than an id "
                           f"may ({MAX_ID_BYTES}); it came as {clip(msg.id)}")  # fmt: skip
    check_inputs(count := len(msg.inputs), limits)
    raw = msg.raw_input_contents
    if raw and len(raw) != count:
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} entries, expected one per input ({count})"
        )
    outputs = _requested_outputs(msg, model)  # counted before any tensor is read
    by_name = _decode_inputs(msg, model, limits)

    if len(by_name) < len(model.inputs):  # each key is a distinct declared input
        missing = [s.name for s in model.inputs if s.name not in by_name]
        raise InvalidInput(f"model {model.name!r} needs input(s) {missing}, the request lacks them")
    inputs = [by_name[s.name] for s in model.inputs]
    rows = inputs[0].shape[0] if model.batches else 1
    for t in inputs[1:]:
        if model.batches and t.shape[0] != rows:
            raise InvalidInput(
                f"input {t.name!r} has batch size {t.shape[0]}, "
                f"input {inputs[0].name!r} has {rows}; they must agree"
            )

    if model.generate is None:  # (a fixed answer too large: refused before the model runs)
        size, _ = fixed_output_bytes(model, outputs, rows)
        if size > limits.max_response_bytes:
            what = "the outputs for this request would hold"
            raise ResponseTooLarge(too_large(size, limits.max_response_bytes, what))
    queue_deadline = _queue_deadline(msg, now, model.batching.default_timeout_us)
    return Request(
        model=model,
        id=msg.id,
        inputs=inputs,
        outputs=outputs,
        rows=rows,
        deadline=min(deadline, queue_deadline),
        level=_level(msg, model),
        queue_timeout=queue_deadline < deadline,
    )


def encode_response(
    request: Request, results: Sequence[Tensor], max_bytes: int = DEFAULT_LIMITS.max_response_bytes
) -> pb.ModelInferResponse:
    """The response for `request`, holding the requested outputs in the order asked.

    Each output at most once, and only this request's rows: the response is never
    larger than what the model produced for it. One over `max_bytes` (gRPC would
    refuse to send it) is refused before it is built.
    """
    by_name = {t.name: t for t in results}
    chosen = [by_name[name] for name in request.outputs]
    size = sum(len(t.data) for t in chosen)
    if size > max_bytes:
        raise ResponseTooLarge(too_large(size, max_bytes))
    response = pb.ModelInferResponse(
        model_name=request.model.name, model_version=request.model.version, id=request.id
    )
    for t in chosen:  # add() builds in place: cheaper than a list of InferOutputTensor
        response.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
    # Its own fields count too (names, shapes, an id of up to 4 KiB; each raw part's tag
    # and length; a stream's final flag and wrapper): outputs of exactly the limit were
    # sent, and gRPC failed the call, every other request of a stream with it.
    whole = response.ByteSize() + size + 6 * len(chosen) + WRAPPER_BYTES
    if whole > max_bytes:
        raise ResponseTooLarge(too_large(whole, max_bytes, "this response would take"))
    response.raw_output_contents.extend([bytes(t.data) for t in chosen])
    return response
