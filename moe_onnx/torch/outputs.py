"""Kernel outputs as ordinary torch allocations (SPEC-layer 1.18 amended, "outputs").

torch_npu's outputs come from op-plugin's ``apply_tensor_without_format``: tensors whose storage
torch owns, so ``untyped_storage().resize_(0)`` (vLLM-Ascend frees its all-to-all buffers that
way), ``set_`` and in-place ops work. A tensor made by ``torch.from_numpy`` has storage numpy
owns, which cannot be resized. So :class:`TorchOutputs` hands the kernels (through
``buffers.allocated_by``) numpy views of ``torch.empty`` tensors to write their outputs into,
and maps each returned array back to its tensor. An output the kernel did not allocate that
way (a view of an input, an array numpy computed) is copied into a fresh ``torch.empty``
tensor: the one copy that cannot be avoided.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from ..custom_ops import buffers, dtypes
from .arrays import TORCH_DTYPES, to_numpy


def _array_on(tensor: torch.Tensor) -> np.ndarray:
    """The writable numpy view of a fresh contiguous CPU tensor (bfloat16 etc. as ml_dtypes)."""
    return to_numpy(tensor)


class TorchOutputs:
    """The tensors one kernel call allocated, and the arrays the kernel saw of them."""

    def __init__(self):
        self._allocated: list[tuple[torch.Tensor, np.ndarray]] = []
        self.copied: list[int] = []  # the output positions that needed a copy (tests read it)

    def allocate(self, shape, dtype) -> np.ndarray:
        """``buffers.empty``'s allocator: ``torch.empty`` of ``shape`` and the numpy ``dtype``."""
        name = dtypes.name_of(np.empty(0, dtype))
        if name is None:
            return np.empty(shape, dtype)  # not a tensor type: the kernel's scratch, never an output
        tensor = torch.empty(tuple(shape), dtype=TORCH_DTYPES[name])
        array = _array_on(tensor)
        self._allocated.append((tensor, array))
        return array

    @contextmanager
    def installed(self):
        """Kernels called inside allocate their ``buffers.empty`` outputs through :meth:`allocate`."""
        with buffers.allocated_by(self.allocate):
            yield self

    def tensor(self, array: np.ndarray, position: int) -> torch.Tensor:
        """The torch tensor holding output ``array``: the allocation it is (zero-copy), else a
        fresh ``torch.empty`` tensor with ``array`` copied in."""
        name = dtypes.name_of(array)
        if name is None:
            raise TypeError(f"numpy dtype {array.dtype} has no torch counterpart here")
        if array.size and array.flags.c_contiguous:
            address = array.__array_interface__["data"][0]
            for i, (tensor, _) in enumerate(self._allocated):
                if tensor.data_ptr() == address and tensor.dtype == TORCH_DTYPES[name] and tensor.numel() == array.size:
                    del self._allocated[i]  # one tensor per output: a custom op's outputs never alias
                    return tensor if tuple(tensor.shape) == array.shape else tensor.view(array.shape)
        out = torch.empty(array.shape, dtype=TORCH_DTYPES[name])
        if array.size:
            _array_on(out)[...] = array
            self.copied.append(position)
        return out
