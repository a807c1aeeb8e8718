"""Splitting a big kernel call over a few threads, and the row gather every op uses."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np

from . import buffers

#: an op moving fewer bytes than this runs on the calling thread only
_PARALLEL_MIN_BYTES = 16 << 20
_MAX_WORKERS = 4


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


def run_ranges(work: Callable[[int, int], None], bounds: np.ndarray) -> None:
    """Call ``work(bounds[i], bounds[i + 1])`` for every i, each range on a thread of its own
    (the first on the calling thread); an error on any of them is raised here."""
    parts = len(bounds) - 1
    if parts <= 1:
        if parts == 1:
            work(int(bounds[0]), int(bounds[1]))
        return
    errors: list[BaseException] = []

    def run(start: int, stop: int) -> None:
        try:
            work(start, stop)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(int(bounds[i]), int(bounds[i + 1]))) for i in range(1, parts)]
    for thread in threads:
        thread.start()
    run(int(bounds[0]), int(bounds[1]))
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


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
