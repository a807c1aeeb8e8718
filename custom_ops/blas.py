"""BLAS on one thread while a kernel runs its products (the kernel threads them itself).

OpenBLAS splits a product over its threads in a way that changes the float32 result: on this
project's machines ``x @ w`` gave other bits with 1 thread than with 2 (tests/test_grouped_matmul
checks the kernels do not). So a kernel that multiplies splits the work itself into blocks of
a fixed shape, each one single-threaded BLAS call, and runs the blocks on its threads: the bits
depend on the shapes only. The thread limit is process-wide (threadpoolctl); it is taken by the
first kernel call that needs it and given back by the last one still running, so concurrent
calls (ranks on threads) all see one thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_lock = threading.Lock()
_users = 0
_limiter: Any = None


@functools.cache
def _controller() -> Any:
    import threadpoolctl  # imported on first use, like numba

    return threadpoolctl.ThreadpoolController()


@contextmanager
def single_threaded() -> Iterator[None]:
    """Every BLAS library numpy uses runs on one thread inside this block."""
    global _users, _limiter
    with _lock:
        if _users == 0:
            _limiter = _controller().limit(limits=1, user_api="blas")
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                _limiter.restore_original_limits()
                _limiter = None
