"""torch tensors <-> numpy arrays without copies, bfloat16 and float8 included.

numpy has bfloat16 and float8 only through ml_dtypes and torch cannot share them with numpy
directly, so those tensors cross as their bits: a torch ``uint16``/``uint8`` view on one side,
an ml_dtypes view of the same memory on the other.
"""

from __future__ import annotations

import numpy as np
import torch

from ..custom_ops import dtypes

#: element type name (as the op library spells it) -> torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8e4m3fn": torch.float8_e4m3fn,
    "float8e5m2": torch.float8_e5m2,
    "float8e8m0": torch.float8_e8m0fnu,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
#: dtypes that cross as the unsigned integers of their width
_AS_BITS = {
    torch.bfloat16: torch.uint16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
    torch.float8_e8m0fnu: torch.uint8,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The op library's name of a torch dtype (e.g. ``"bfloat16"``)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no ONNX counterpart here; supported: {sorted(_NAMES.values())}") from None


class _Memory:
    """What ``np.asarray`` reads a tensor's memory through: ``tensor.numpy()`` would mark the
    storage not resizable for good, and torch_npu's callers resize their tensors' storage
    (vLLM-Ascend's ``untyped_storage().resize_(0)``). The view holds the tensor alive."""

    def __init__(self, tensor: torch.Tensor, typestr: str):
        self.tensor = tensor
        self.__array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": typestr,
            "data": (tensor.data_ptr(), False),
            "version": 3,
        }


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array on ``tensor``'s memory (a copy only if it is not contiguous or on CPU),
    leaving its storage resizable."""
    tensor = tensor.detach().cpu().contiguous()
    bits = _AS_BITS.get(tensor.dtype)
    real = dtypes.numpy_dtype(dtype_name(tensor.dtype))
    if tensor.numel() == 0:
        return np.empty(tuple(tensor.shape), real)
    if bits is None:
        return np.asarray(_Memory(tensor, real.str))
    return np.asarray(_Memory(tensor, np.dtype(np.uint16 if bits == torch.uint16 else np.uint8).str)).view(real)


def to_torch(array: np.ndarray) -> torch.Tensor:
    """A tensor on ``array``'s memory (copied first if numpy cannot lend it: read-only or
    negatively strided)."""
    if not array.flags.writeable or any(s < 0 for s in array.strides):
        array = array.copy()
    name = dtypes.name_of(array)
    if name is None:
        raise TypeError(f"numpy dtype {array.dtype} has no torch counterpart here")
    dtype = TORCH_DTYPES[name]
    bits = _AS_BITS.get(dtype)
    if bits is None:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(np.uint16 if bits == torch.uint16 else np.uint8)).view(dtype)


def tensor_problem(value) -> str | None:
    """Why ``value`` cannot be an input of our ops (not a tensor, not on the CPU, a dtype the ops
    do not know), or None. A tensor elsewhere, meta included, would otherwise reach the CPU
    kernel as an unwritten copy or not at all (SPEC-layer 1.18 amended, "inputs")."""
    if not isinstance(value, torch.Tensor):
        return f"a tensor goes here, got {type(value).__name__}"
    if value.device.type != "cpu":
        return f"the tensor is on {value.device}: the CPU golden computes CPU tensors only (no output is written)"
    if value.dtype not in _NAMES:
        return f"dtype {value.dtype} is not supported (the ops take {', '.join(sorted(TORCH_DTYPES))})"
    return None
