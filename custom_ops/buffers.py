"""Memory for kernel outputs, recycled between calls where the caller allows it.

Kernels allocate their large outputs with :func:`empty`. Outside :func:`recycled_outputs`
that is ``np.empty``. Inside it (the onnxruntime glue wraps every kernel call), memory handed
out by this thread's previous call is handed out again: the glue copies each output into
onnxruntime's own tensor before the next kernel runs on the thread, so it is free by then.
Fresh memory costs the OS zeroing its pages, about as much as the copy the op makes.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np

#: smaller outputs are not worth tracking
MIN_BYTES = 1 << 20
#: free buffers kept per thread between calls
KEEP = 8

_local = threading.local()


class _Pool:
    def __init__(self):
        self.free: list[np.ndarray] = []  # uint8 buffers, smallest first
        self.lent: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        for i, buffer in enumerate(self.free):
            if nbytes <= buffer.nbytes <= 2 * nbytes:
                self.lent.append(self.free.pop(i))
                return self.lent[-1]
        buffer = np.empty(nbytes, np.uint8)
        self.lent.append(buffer)
        return buffer

    def reclaim(self) -> None:
        """Everything lent is free again (the previous call's outputs have been copied)."""
        self.free = sorted(self.free + self.lent, key=lambda b: b.nbytes)[-KEEP:]
        self.lent = []


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous output array (see module doc)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
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
    """On this thread, let :func:`empty` reuse the outputs of the previous call made in this
    context. Only for callers that copy the outputs away before their next call."""
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = _Pool()
    else:
        pool.reclaim()
    _local.active = pool
    try:
        yield
    finally:
        _local.active = None

