"""numpy <-> ModelInferRequest / ModelInferResponse for the client. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from batchd.protos import inference_pb2 as pb
from batchd.protos.datatypes import DATATYPES
from batchd.protos.tensors import from_raw, set_parameter, to_raw


def build_request(
    model: str,
    inputs: Mapping[str, Any],
    outputs: Sequence[str] | None = None,
    *,
    request_id: str = "",
    version: str = "",
    datatypes: Mapping[str, str] | None = None,
    parameters: Mapping[str, int | str | bool | float] | None = None,
) -> pb.ModelInferRequest:
    msg = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, value in inputs.items():
        datatype, shape, raw = to_raw(_array(value), (datatypes or {}).get(name))
        msg.inputs.add(name=name, datatype=datatype, shape=shape)
        msg.raw_input_contents.append(raw)
    for name in outputs or ():
        msg.outputs.add(name=name)
    for key, v in (parameters or {}).items():
        if not set_parameter(msg.parameters[key], v):
            msg.parameters[key].string_param = str(v)
    return msg


def _array(value: Any) -> np.ndarray:
    """An input as an array. Bytes or str not yet in one (a list) go into an object
    array: a fixed-width S/U array, what np.asarray makes, drops trailing NULs."""
    if isinstance(value, np.ndarray):
        return value
    a = np.asarray(value)
    return np.array(value, dtype=object) if a.dtype.kind in "SU" else a


def _typed(t: pb.InferOutputTensor) -> np.ndarray:
    dt = DATATYPES[t.datatype]
    if dt.contents_field is None:
        raise ValueError(f"output {t.name!r}: {t.datatype} came without raw contents")
    values = list(getattr(t.contents, dt.contents_field))
    return np.asarray(values, dtype=dt.numpy).reshape(tuple(t.shape))


def parse_response(msg: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Each output as a writable numpy array (BF16 as its uint16 bit patterns)."""
    raw = msg.raw_output_contents
    out = {}
    for i, t in enumerate(msg.outputs):
        if raw:
            out[t.name] = from_raw(t.datatype, tuple(t.shape), raw[i]).copy()
        else:
            out[t.name] = _typed(t)
    return out
