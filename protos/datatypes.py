"""The Open Inference Protocol datatype table: one row per datatype string.

Every other module asks this table instead of spelling sizes, numpy dtypes or
typed-contents fields out again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class DataType:
    name: str  # the OIP string: "FP32"
    itemsize: int  # bytes per element; 0 for BYTES (variable)
    numpy: np.dtype  # little-endian numpy dtype; BF16 travels as its uint16 bits
    contents_field: str | None  # InferTensorContents field; None: raw form only
    config_enum: int  # ModelConfig DataType value (TYPE_<name>)

    @property
    def is_bytes(self) -> bool:
        return self.itemsize == 0


def _row(name: str, size: int, np_type: str, field: str | None, enum: int) -> DataType:
    return DataType(name, size, np.dtype(np_type), field, enum)


DATATYPES: dict[str, DataType] = {
    d.name: d
    for d in (
        _row("BOOL", 1, "?", "bool_contents", 1),
        _row("UINT8", 1, "u1", "uint_contents", 2),
        _row("UINT16", 2, "<u2", "uint_contents", 3),
        _row("UINT32", 4, "<u4", "uint_contents", 4),
        _row("UINT64", 8, "<u8", "uint64_contents", 5),
        _row("INT8", 1, "i1", "int_contents", 6),
        _row("INT16", 2, "<i2", "int_contents", 7),
        _row("INT32", 4, "<i4", "int_contents", 8),
        _row("INT64", 8, "<i8", "int64_contents", 9),
        _row("FP16", 2, "<f2", None, 10),
        _row("FP32", 4, "<f4", "fp32_contents", 11),
        _row("FP64", 8, "<f8", "fp64_contents", 12),
        _row("BYTES", 0, "O", "bytes_contents", 13),  # TYPE_STRING in ModelConfig
        _row("BF16", 2, "<u2", None, 14),
    )
}

DATATYPE_NAMES = ", ".join(DATATYPES)


def datatype_of(arr: np.ndarray) -> str:
    """The OIP datatype string for a numpy array (BYTES for object/bytes/str arrays)."""
    kind = arr.dtype.kind
    if kind in "OSU":
        return "BYTES"
    for d in DATATYPES.values():
        if d.name != "BF16" and not d.is_bytes and d.numpy == arr.dtype.newbyteorder("<"):
            return d.name
    raise ValueError(f"numpy dtype {arr.dtype} has no Open Inference Protocol datatype")


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even."""
    bits = values.astype("<f4").view("<u4")
    rounded: np.ndarray = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return rounded


def element(datatype: str, value: float) -> np.generic:
    """`value` as one element of `datatype` (BF16: its bits), or ValueError saying why
    it is not one: an integer type takes whole numbers in its range, BOOL 0 or 1, a
    float type any number within its range (and inf, nan)."""
    dt = DATATYPES[datatype]
    kind = "f" if datatype == "BF16" else dt.numpy.kind  # (BF16 travels as uint16 bits)
    if kind in "iub":
        if not float(value).is_integer():
            raise ValueError(f"{datatype} takes whole numbers, got {value!r}")
        low, high = (0, 1) if kind == "b" else (np.iinfo(dt.numpy).min, np.iinfo(dt.numpy).max)
        if not low <= int(value) <= high:
            raise ValueError(f"{datatype} holds {low} to {high}, got {value!r}")
        whole: np.generic = np.array([int(value)], dt.numpy)[0]
        return whole
    if kind != "f":
        raise ValueError(f"a {datatype} tensor has no such element")
    bits, past = float_elements(np.array([value], np.float64), datatype)
    if past[0]:
        raise ValueError(f"{datatype} cannot hold {value!r}: past its largest number")
    one: np.generic = bits[0]
    return one


def float_elements(values: np.ndarray, datatype: str) -> tuple[np.ndarray, np.ndarray]:
    """Numbers as elements of the float `datatype` (BF16: their bits), and where a
    finite number is past the type's largest (the cast made it inf)."""
    with np.errstate(over="ignore"):
        as_float = values.astype(np.float32 if datatype == "BF16" else DATATYPES[datatype].numpy)
        bits = bf16_bits(as_float) if datatype == "BF16" else as_float
        back = (bits.astype("<u4") << 16).view("<f4") if datatype == "BF16" else bits
    return bits, np.isinf(back) & np.isfinite(values)
