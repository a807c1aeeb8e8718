"""Memory for kernel outputs, reused once nothing references it.

Kernels allocate their large outputs with :func:`empty`. Outside :func:`recycled_outputs`
that is ``np.empty``. Inside it (the runtimes wrap every kernel call), a buffer handed out
earlier on this thread is handed out again once no array, view or onnxruntime value refers
to it any more: fresh memory costs the OS zeroing its pages, about as much as the copy the
op makes. Whoever still holds an earlier output keeps its buffer out of reach.

A caller may instead hand :func:`empty` its own allocator for one call
(:func:`allocated_by`): the torch frontend's returns numpy views of ``torch.empty`` tensors,
so the outputs a kernel writes are ordinary torch allocations without a copy. Kernels stay
ignorant of who allocates.
"""

from __future__ import annotations

import math
import sys
import threading
from contextlib import contextmanager

import numpy as np

#: smaller outputs are not worth tracking
MIN_BYTES = 1 << 20
#: buffers kept per thread between calls
KEEP = 8

_local = threading.local()


class _Pool:
    def __init__(self):
        self.buffers: list[np.ndarray] = []  # uint8, smallest first

    def _unreferenced(self, i: int) -> bool:
        # the list's slot and getrefcount's argument: every view holds its base
        return sys.getrefcount(self.buffers[i]) == 2

    def take(self, nbytes: int) -> np.ndarray:
        for i in range(len(self.buffers)):  # by index: a loop variable would be a reference
            if nbytes <= self.buffers[i].nbytes <= 2 * nbytes and self._unreferenced(i):
                return self.buffers[i]
        buffer = np.empty(nbytes, np.uint8)
        if len(self.buffers) >= KEEP:
            unused = [i for i in range(len(self.buffers)) if self._unreferenced(i)]
            if not unused:
                return buffer
            del self.buffers[unused[0]]
        self.buffers = sorted(self.buffers + [buffer], key=lambda b: b.nbytes)
        return buffer


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous output array (see module doc)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    nbytes = math.prod(shape) * dtype.itemsize
    allocator = getattr(_local, "allocator", None)
    if allocator is not None:
        return allocator(shape, dtype)
    pool = getattr(_local, "active", None)
    if pool is None or nbytes < MIN_BYTES:
        return np.empty(shape, dtype)
    return pool.take(nbytes)[:nbytes].view(dtype).reshape(shape)


def zeros(shape, dtype) -> np.ndarray:
    out = empty(shape, dtype)
    out.fill(0)
    return out


@contextmanager
def recycled_outputs():
    """On this thread, let :func:`empty` reuse buffers that nothing references any more."""
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = _Pool()
    _local.active = pool
    try:
        yield
    finally:
        _local.active = None


@contextmanager
def no_reuse():
    """On this thread, a pool with nothing in it, for as long as the block runs: what a call
    costs when no earlier output can be reused (the bench's peak memory). The pool before is
    put back after."""
    before = getattr(_local, "pool", None)
    _local.pool = _Pool()
    try:
        yield
    finally:
        _local.pool = before


@contextmanager
def allocated_by(allocator):
    """On this thread, let :func:`empty` (and :func:`zeros`) call ``allocator(shape, dtype)``,
    which returns an uninitialised C-contiguous array of that shape and numpy dtype."""
    outer = getattr(_local, "allocator", None)
    _local.allocator = allocator
    try:
        yield
    finally:
        _local.allocator = outer
