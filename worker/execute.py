"""Running one batch: raw frames in, model forward, raw frames out.

Inputs become tensors with one copy (host->device on a GPU; a private writable
copy on the CPU, so a model that writes into its inputs cannot touch ZeroMQ's
buffers). Outputs are checked against the declared signature, so a model that
returns the wrong dtype or row count fails its batch with a clear message
instead of corrupting a reply. BYTES tensors reach the model as numpy object
arrays of `bytes`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence, Sized
from typing import Any

import numpy as np
import torch

from batchd.protos import wire
from batchd.protos.datatypes import DATATYPES
from batchd.protos.model_config import ModelConfig, TensorSpec
from batchd.protos.tensors import bytes_row_offsets, from_raw, raw_view, serialize_bytes
from batchd.worker import InputRefused
from batchd.worker.loader import ModelFn, forked_off

# What the compute thread owes an answer for: a STOP waits for those (a sequence
# counts until its last STEP).
COUNTED = (wire.Header.BATCH, wire.Header.LOAD, wire.Header.START)
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "FP32": torch.float32,
    "FP64": torch.float64,
    "BF16": torch.bfloat16,
}


class BatchError(Exception):
    """The batch cannot be answered; the message goes back to its callers."""


class OutputTooLarge(BatchError):
    """An output no response may carry (ERROR's too_large: RESOURCE_EXHAUSTED)."""


WHY_CHARS = 4096  # of a model's exception message, at most, in a reply


def why(e: BaseException) -> str:
    """What a model's exception says, for its callers: the message alone for ours
    (BatchError) and a refusal (InputRefused), else the type too. Never raises: an
    exception whose __str__ fails is named by its type."""
    try:
        text = str(e)
    except BaseException:  # SystemExit out of a __str__ would end the worker's thread
        text = "(its message could not be read)"
    if len(text) > WHY_CHARS:  # (a status's details travel in a trailer: clients take 8 KiB)
        text = f"{text[:WHY_CHARS]}... ({len(text)} characters)"
    return text if isinstance(e, BatchError | InputRefused) else f"{type(e).__name__}: {text}"


def count(values: Any) -> int:
    """How many `values` a model's start() or step() returned; -1: not a list of them."""
    return len(values) if isinstance(values, Sized) else -1


def counted(values: Any, what: str) -> str:  # (None was "raised: TypeError: object of
    """What a start() or step() returned, said: `N what`, or what it was instead."""
    if isinstance(values, Sized):  # type 'NoneType' has no len()": review 57f)
        return f"{len(values)} {what}"
    return f"{type(values).__name__}, not a list of {what},"


def failed(header: wire.Header, e: Exception) -> tuple[list[Any], int]:
    """The reply owed for work that raised outside the model's own guard, and the units
    of work it ends: ERROR for a batch, LOADED for a load, a final STEP for a sequence."""
    error, h = wire.text(f"the worker failed on it: {why(e)}"), header
    if h.kind not in COUNTED:
        return [], 0
    kind = {wire.Header.BATCH: wire.Header.ERROR, wire.Header.LOAD: wire.Header.LOADED}
    out = wire.Header(kind=kind.get(h.kind, wire.Header.STEP), model=h.model, version=h.version)
    if h.kind == wire.Header.START:
        out.steps.add(id=h.batch_id, final=True, error=error)
    else:
        out.batch_id, out.error = h.batch_id, error
    return wire.pack(out), 1


def to_model_input(t: wire.Tensor, frame: Any, device: torch.device) -> Any:
    arr = from_raw(t.datatype, tuple(t.shape), memoryview(frame))
    if t.datatype == "BYTES":
        return arr
    if device.type == "cpu":
        tensor = torch.from_numpy(arr.copy())
    else:
        with warnings.catch_warnings():  # read-only view; .to(device) copies it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(arr).to(device)
    return tensor.view(torch.bfloat16) if t.datatype == "BF16" else tensor


def _outputs_in_order(cfg: ModelConfig, result: Any) -> list[Any]:
    names = [o.name for o in cfg.outputs]
    if isinstance(result, dict):
        missing = [n for n in names if n not in result]
        if missing:
            raise BatchError(
                f"the model returned a dict without output(s) {missing}; "
                f"it has keys {sorted(map(str, result))}"
            )
        return [result[n] for n in names]
    values = list(result) if isinstance(result, (tuple, list)) else [result]
    if len(values) != len(names):
        raise BatchError(
            f"the model returned {len(values)} output(s), model.toml declares {len(names)}: {names}"
        )
    return values


def _encode(spec_name: str, datatype: str, value: Any) -> tuple[list[int], Any]:
    where = f"output {spec_name!r}"
    if datatype == "BYTES":
        arr = np.asarray(value, dtype=object)
        try:
            return list(arr.shape), serialize_bytes(arr)
        except TypeError as e:
            raise BatchError(f"{where} is declared BYTES: {e}") from None
    if isinstance(value, torch.Tensor):
        want = TORCH_DTYPES[datatype]
        if value.dtype != want:
            raise BatchError(
                f"{where} is declared {datatype} ({want}), the model returned {value.dtype}"
            )
        if value.layout != torch.strided or value.is_nested or value.is_meta:  # (torch's own
            kind = "nested" if value.is_nested else "meta" if value.is_meta else value.layout
            raise BatchError(  # text on copying them names a kernel, not the layout)
                f"{where} is a {str(kind).removeprefix('torch.')} tensor, expected a dense "
                "(strided) one"
            )
        # A copy of the model's memory: the reply leaves zero-copy after the next forward
        # may have started, and a model may return the same buffer every time (out=).
        t = value.detach().to("cpu", copy=True).contiguous()
        arr = t.view(torch.int16).numpy().view(np.uint16) if datatype == "BF16" else t.numpy()
    elif isinstance(value, np.ndarray):
        arr = np.array(value, order="C", copy=True)  # (a copy, as for a tensor)
        if arr.dtype.newbyteorder("<") != DATATYPES[datatype].numpy:
            raise BatchError(
                f"{where} is declared {datatype}, the model returned numpy {arr.dtype}"
            )
    else:
        raise BatchError(f"{where}: the model returned {type(value).__name__}, expected a tensor")
    return list(arr.shape), raw_view(arr.astype(DATATYPES[datatype].numpy, copy=False))


def run_batch(
    fn: ModelFn,
    cfg: ModelConfig,
    device: torch.device,
    tensors: Sequence[wire.Tensor],
    frames: Sequence[Any],
    rows: int = 0,  # the batch's rows (Header.rows); 0: its first input's first dim
    most: int = 0,  # the bytes a response may carry (Header.max_response_bytes); 0: any
) -> tuple[list[wire.Tensor], list[Any]]:
    """Run the model on one batch; raise BatchError (or the model's own error).
    Inputs are made under inference_mode too: inference tensors, which a model may
    view as a torch.nested jagged tensor (packed inputs) without a copy."""
    by_name = dict(zip((t.name for t in tensors), zip(tensors, frames, strict=True), strict=True))
    names = [s.name for s in cfg.inputs] + [b.name for b in cfg.batch_inputs]
    rows = rows or (int(tensors[0].shape[0]) if cfg.batches and tensors else 0)
    with torch.inference_mode():
        try:
            args = [to_model_input(*by_name[name], device) for name in names]
        except KeyError as e:
            raise BatchError(f"batch lacks input {e}") from None
        try:
            result = fn(*args)
        finally:
            forked_off()
    # A packed input's elements: the first dim of the outputs `ragged_like` it; a padded
    # one's width: their second (the frontend cuts each request's positions from it).
    elements = {s.name: int(by_name[s.name][0].shape[0]) for s in cfg.inputs if s.packed}
    widths = {s.name: int(by_name[s.name][0].shape[1]) for s in cfg.inputs
              if s.ragged and not s.packed and cfg.batches}  # fmt: skip
    out_headers, out_frames = [], []
    for spec, value in zip(cfg.outputs, _outputs_in_order(cfg, result), strict=True):
        like = spec.ragged_like or ""
        header, frame = encode_output(
            spec, value, cfg.batches, rows, elements.get(like), widths.get(like), most
        )
        out_headers.append(header)
        out_frames.append(frame)
    return out_headers, out_frames


def encode_output(
    spec: TensorSpec, value: Any, batches: bool, rows: int | None = None,
    packed: int | None = None, width: int | None = None, most: int = 0,
) -> tuple[wire.Tensor, Any]:  # fmt: skip
    """One output, checked against its declaration: its wire header and raw frame.
    `rows`: the batch's rows, when the model batches (dim 0 must match); `packed`: the
    elements of the packed input it is `ragged_like`, then its dim 0 instead; `width`:
    the padded length of the padded input it is `ragged_like`, its dim 1 (a position
    more or fewer would hand requests another's values, or fail the whole batch);
    `most`: the bytes a response may carry (0: any), which no row of it may pass."""
    # A tensor's or an array's shape (and size) is checked before the copy: an expanded
    # view of gigabytes, of the wrong shape or past `most`, is refused without being made.
    known = isinstance(value, torch.Tensor | np.ndarray) and not getattr(value, "is_nested", 0)
    fixed = DATATYPES[spec.datatype].itemsize  # (0: BYTES, its size known once encoded)
    even = most > 0 and packed is None and width is None  # (a ragged one's rows differ)
    if known:
        _check_shape(spec, list(value.shape), batches, rows, packed, width)
        if even and fixed:
            _check_room(spec, list(value.shape), math.prod(value.shape) * fixed, batches, most)
    shape, frame = _encode(spec.name, spec.datatype, value)
    if not known:
        _check_shape(spec, shape, batches, rows, packed, width)
    if even and not fixed:
        _check_room(spec, shape, memoryview(frame).nbytes, batches, most)
    if packed is not None:
        return wire.Tensor(name=spec.name, datatype=spec.datatype, shape=shape), frame
    header = wire.Tensor(name=spec.name, datatype=spec.datatype, shape=shape)
    if spec.datatype == "BYTES" and batches:  # the frontend cuts rows by these
        header.row_offsets.extend(bytes_row_offsets(frame, shape[0], math.prod(shape[1:])).tolist())
    return header, frame


def use_threads(given: int, loaded: bool) -> None:
    """The worker's `given` intra-op threads from now, one fewer (at least one) if the
    batch's model is `loaded` (each batch says): 2 cores, mlp: 2 make a lone row ~30%
    faster, under load cost 16-20% of req/s."""
    threads = max(1, given - 1) if loaded else given
    if threads != torch.get_num_threads():  # (not the count set last: a model may set
        torch.set_num_threads(threads)  # its own, which stuck for every batch after it)


def _check_room(spec: TensorSpec, shape: list[int], size: int, batches: bool, most: int) -> None:
    """Refuse an output whose every row takes more than a response may carry: none could
    carry it, and the frontend, which would refuse it, would get it whole first."""
    rows = (shape[0] if shape else 1) if batches else 1
    if rows and size // rows > most:
        each = " a row" if batches else ""
        raise OutputTooLarge(
            f"output {spec.name!r} holds {size // rows} bytes{each} (shape {shape}, "
            f"{spec.datatype}), more than a response may carry ({most}, --max-message-bytes)"
        )


def _check_shape(spec: TensorSpec, shape: list[int], batches: bool, rows: int | None,
                 packed: int | None, width: int | None) -> None:  # fmt: skip
    if packed is not None:  # [elements, ...]: its declared -1 is the packed dim
        if not shape or shape[0] != packed or not spec.accepts(tuple(shape)):
            raise BatchError(
                f"output {spec.name!r}: expected shape {[packed, *spec.shape[1:]]} (packed like "
                f"{spec.ragged_like!r}), the model returned {shape}"
            )
        return
    inner = shape[1:] if batches else shape
    wrong_width = width is not None and (len(shape) < 2 or shape[1] != width)
    if (batches and (not shape or shape[0] != rows)) or not spec.accepts(tuple(inner)) \
            or wrong_width:  # fmt: skip
        declared = ([rows] if batches else []) + list(spec.shape)
        if width is not None:
            declared[1] = width
        raise BatchError(
            f"output {spec.name!r}: expected shape {declared}"
            + (f" (padded like {spec.ragged_like!r})" if width is not None else "")
            + f", the model returned {shape}"
        )
