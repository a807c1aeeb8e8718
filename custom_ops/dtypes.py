"""Element types by name: ONNX enum <-> numpy (ml_dtypes for bfloat16 and float8)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto

# name -> (ONNX enum, numpy dtype)
_TABLE: dict[str, tuple[int, np.dtype]] = {
    "float32": (TensorProto.FLOAT, np.dtype(np.float32)),
    "float64": (TensorProto.DOUBLE, np.dtype(np.float64)),
    "float16": (TensorProto.FLOAT16, np.dtype(np.float16)),
    "bfloat16": (TensorProto.BFLOAT16, np.dtype(ml_dtypes.bfloat16)),
    "float8e4m3fn": (TensorProto.FLOAT8E4M3FN, np.dtype(ml_dtypes.float8_e4m3fn)),
    "float8e5m2": (TensorProto.FLOAT8E5M2, np.dtype(ml_dtypes.float8_e5m2)),
    "float8e8m0": (TensorProto.FLOAT8E8M0, np.dtype(ml_dtypes.float8_e8m0fnu)),
    "int8": (TensorProto.INT8, np.dtype(np.int8)),
    "uint8": (TensorProto.UINT8, np.dtype(np.uint8)),
    "int16": (TensorProto.INT16, np.dtype(np.int16)),
    "uint16": (TensorProto.UINT16, np.dtype(np.uint16)),
    "int32": (TensorProto.INT32, np.dtype(np.int32)),
    "int64": (TensorProto.INT64, np.dtype(np.int64)),
    "bool": (TensorProto.BOOL, np.dtype(np.bool_)),
}
_BY_ENUM = {enum: name for name, (enum, _) in _TABLE.items()}
_BY_NUMPY = {dt: name for name, (_, dt) in _TABLE.items()}

FLOATS = ("float32", "float16", "bfloat16")
FLOAT8 = ("float8e4m3fn", "float8e5m2")
INDEX = ("int32", "int64")
#: types numpy has only through ml_dtypes (onnxruntime's OrtValue.numpy() refuses them)
ML_DTYPES = ("bfloat16", "float8e4m3fn", "float8e5m2", "float8e8m0")


def onnx_type(name: str) -> int:
    """ONNX ``TensorProto`` enum of the element type ``name``."""
    return _TABLE[name][0]


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype of the element type ``name``."""
    return _TABLE[name][1]


def name_of_onnx(enum: int) -> str | None:
    """Element type name of an ONNX enum (None when this package does not know it)."""
    return _BY_ENUM.get(enum)


def name_of(array: np.ndarray) -> str | None:
    """Element type name of a numpy array (None when this package does not know it)."""
    return _BY_NUMPY.get(array.dtype)


def native(value) -> np.ndarray:
    """``value`` as a C-contiguous array in native byte order: a byte-swapped (``>f4``) array
    is converted, since onnxruntime and the kernels read memory as native."""
    array = np.asarray(value, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))
