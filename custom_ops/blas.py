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
_restore: list[tuple[Any, int]] = []  # (BLAS library, its thread count before the first user)


@functools.cache
def _blas_libraries() -> tuple[Any, ...]:
    """threadpoolctl's controllers of the BLAS libraries loaded (found once; imported on first
    use, like numba). Setting their thread count directly costs ~1.5 us a call; a
    ``ThreadpoolController.limit`` re-reads every library's state, ~12 us."""
    import threadpoolctl

    return tuple(threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers)


@contextmanager
def single_threaded() -> Iterator[None]:
    """Every BLAS library numpy uses runs on one thread inside this block."""
    global _users
    with _lock:
        if _users == 0:
            for library in _blas_libraries():
                _restore.append((library, library.num_threads))
                library.set_num_threads(1)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                while _restore:
                    library, threads = _restore.pop()
                    library.set_num_threads(threads)
