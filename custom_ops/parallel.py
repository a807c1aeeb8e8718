"""Splitting a big kernel call over a few threads, and the row gather every op uses."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from . import buffers

#: an op moving fewer bytes than this runs on the calling thread only
_PARALLEL_MIN_BYTES = 16 << 20
_MAX_WORKERS = 4


@functools.cache
def _cpu_count() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def for_row_ranges(work: Callable[[int, int], None], rows: int, row_bytes: int) -> None:
    """Call ``work(start, stop)`` on contiguous ranges covering ``[0, rows)``.

    Large calls are split over a few threads: numpy's copies and ufuncs and the compiled
    loops of :mod:`.fused` release the GIL, and one core alone can neither saturate memory
    bandwidth nor page in a fresh output. Each output row is computed by one thread alone,
    so the result does not depend on the split.
    """
    parts = int(min(workers(), max(1, rows * row_bytes // _PARALLEL_MIN_BYTES)))
    if parts <= 1:
        work(0, rows)
        return
    run_ranges(work, np.linspace(0, rows, parts + 1).astype(np.int64))


def workers() -> int:
    """The most threads one kernel call uses."""
    return min(_cpu_count(), _MAX_WORKERS)


# The helper threads live for the process: starting a thread per call cost ~110 us here, a
# hand-off to a waiting one ~15 us, which at decode is a tenth of a kernel call.
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_on_helper = threading.local()  # set on the helpers: a range they run runs its own ranges inline


def _mark_helper() -> None:
    _on_helper.flag = True


def _helpers() -> ThreadPoolExecutor:
    """The process's helper threads (_MAX_WORKERS - 1 of them, started as first needed)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max(1, _MAX_WORKERS - 1), thread_name_prefix="moe-onnx-kernel", initializer=_mark_helper
            )
        return _pool


def _forget_helpers() -> None:
    """In a forked child the parent's helper threads do not exist: start afresh."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def run_ranges(work: Callable[[int, int], None], bounds: Sequence[int] | np.ndarray) -> None:
    """Call ``work(bounds[i], bounds[i + 1])`` once for every i. The calling thread and up to
    ``workers() - 1`` helper threads take the ranges in order, each the next one left as it
    finishes one (so a thread that gets no core, on a machine shared with other work, leaves
    its share to the others); from a helper thread every range runs inline, so no helper ever
    waits for another. Which thread runs a range never matters: each range's results are its
    own. An error stops the handing out; the first is raised here, after every range taken
    has ended (none is left writing into an output)."""
    parts = len(bounds) - 1
    ranges = [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]
    if parts <= 1 or getattr(_on_helper, "flag", False):
        for start, stop in ranges:
            work(start, stop)
        return
    left = iter(ranges)
    lock = threading.Lock()
    stopped = False

    def take_ranges() -> None:
        nonlocal stopped
        while True:
            with lock:
                taken = None if stopped else next(left, None)
            if taken is None:
                return
            try:
                work(*taken)
            except BaseException:
                stopped = True
                raise

    helpers = _helpers()
    futures: list[Future] = [helpers.submit(take_ranges) for _ in range(min(workers(), parts) - 1)]
    error: BaseException | None = None
    try:
        take_ranges()
    except BaseException as exc:  # noqa: BLE001 - raised below, once the helpers' ranges ended
        error = exc
    for future in futures:
        future.cancel()  # a helper that has not started has nothing left to take
    while True:  # an interrupt while waiting is raised once the helpers' ranges ended too
        try:
            wait(futures)
            break
        except BaseException as exc:  # noqa: BLE001 - the first error wins
            stopped = True
            error = error or exc
    for future in futures:
        if not future.cancelled():
            error = error or future.exception()
    if error is not None:
        raise error


def gather_rows(source: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``out[i] = source[index[i]]`` (bit-exact), a row of zeros where ``index[i] < 0``.

    Args:
        source: ``[R, ...]`` any dtype (R may be 0 when every index is negative).
        index: ``[N]`` integer, each in ``[-1, R)`` (checked by the caller).
    Returns:
        ``[N, ...]`` C-contiguous, dtype of ``source``.
    """
    out = buffers.empty((len(index),) + source.shape[1:], source.dtype)
    if len(source) == 0:
        source = np.zeros((1,) + source.shape[1:], source.dtype)

    def work(start: int, stop: int) -> None:
        part, rows = out[start:stop], index[start:stop]
        # mode="clip" writes straight into `out` (mode="raise" gathers into a temporary);
        # a negative index reads row 0 and is zeroed next
        np.take(source, rows, axis=0, out=part, mode="clip")
        empty = rows < 0
        if empty.any():
            part[empty] = 0

    for_row_ranges(work, len(index), source[0].nbytes)
    return out
