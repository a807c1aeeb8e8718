"""What is known of a tensor (element type name and shape), and its ONNX spellings.

The one place that converts between :class:`TensorInfo` and ONNX's type protos, value infos
and type strings; the schemas, the executors and the rank launcher all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from . import dtypes

Dim = int | str | None  # known size, symbolic name, or unknown
Shape = tuple[Dim, ...]

#: ONNX's spelling of an element type in ``tensor(...)`` strings, where it differs from ours
_ONNX_NAMES = {"float32": "float", "float64": "double"}


@dataclass(frozen=True)
class TensorInfo:
    """What is known of a tensor: its element type name and shape (None = unknown)."""

    dtype: str | None
    shape: Shape | None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @staticmethod
    def of(array: np.ndarray) -> TensorInfo:
        return TensorInfo(dtypes.name_of(array) or str(array.dtype), tuple(array.shape))

    @staticmethod
    def from_type_proto(type_proto: onnx.TypeProto | None) -> TensorInfo:
        """Dims are ints, symbolic names, or None; anything but a tensor is unknown."""
        if type_proto is None or not type_proto.HasField("tensor_type"):
            return UNKNOWN
        tensor = type_proto.tensor_type
        dtype = dtypes.name_of_onnx(tensor.elem_type) if tensor.elem_type else None
        if not tensor.HasField("shape"):
            return TensorInfo(dtype, None)
        return TensorInfo(dtype, tuple(_dim(d) for d in tensor.shape.dim))

    @staticmethod
    def from_initializer(tensor: onnx.TensorProto) -> TensorInfo:
        return TensorInfo(dtypes.name_of_onnx(tensor.data_type), tuple(tensor.dims))

    def type_proto(self) -> onnx.TypeProto:
        if self.dtype is None:
            raise ValueError("a tensor of unknown element type has no ONNX type")
        return helper.make_tensor_type_proto(
            dtypes.onnx_type(self.dtype), None if self.shape is None else list(self.shape)
        )

    def value_info(self, name: str) -> onnx.ValueInfoProto:
        return helper.make_value_info(name, self.type_proto())

    @property
    def type_string(self) -> str:
        """onnxruntime's and ONNX's ``tensor(float)`` form ("tensor(undefined)" if unknown)."""
        return f"tensor({onnx_name(self.dtype) if self.dtype else 'undefined'})"


UNKNOWN = TensorInfo(None, None)


def onnx_name(dtype: str) -> str:
    """The type string ONNX uses in ``tensor(...)`` for the element type ``dtype``."""
    return _ONNX_NAMES.get(dtype, dtype)


def _dim(d: onnx.TensorShapeProto.Dimension) -> Dim:
    return d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
