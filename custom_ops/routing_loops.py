"""The numba loop behind MoeInitRoutingV3's dropless dispatch: where each slot's row goes.
Imported on first use (numba is slow to import).

At decode a dispatch is a dozen numpy calls over a few dozen slots (a stable argsort, its
inverse, masks, counts), each a microsecond or two of call overhead, and more after a GEMM has
pushed the interpreter out of the caches (~90 us in a layer, 30 us hot). One pass over the
slots does it: a counting sort by expert, which is the stable argsort of the same keys.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def dropless_slots(flat, top_k, start, end, expert_num, rows, rows_by_row):
    """Where each slot of a dropless dispatch goes, ids checked ``< expert_num`` already.

    The slots sort by key ``id`` (ids below ``start``, negative ones included, as ``INT32_MAX``:
    last), stably: destination ``d`` holds slot ``order[d] = p`` (p = t * top_k + j). The
    first ``available`` (ids in ``[start, end)``) are the range's rows, of which the first
    ``filled = min(rows, available)`` are kept.

    Args:
        flat: ``[T * K]`` int32/int64 expert ids, slot order.
        rows: rows of expanded_x (``active_num``'s cap, or every slot).
        rows_by_row: expanded_row_idx as row -> slot (``row_idx_type`` 1) instead of slot -> row.
    Returns:
        ``destination [T*K]`` int64 (slot -> kept row, -1: not kept), ``expanded_row_idx
        [T*K]`` int32 (slot -> row in the range or -1; or row -> slot), ``row_token [rows]``
        intp (row -> its token, -1: no token), ``range_counts [end - start]`` int64 (rows of
        each expert of the range), ``filled``.
    """
    slots = flat.size
    below = expert_num - start  # the bucket of ids below start, after those of [start, E)
    first = np.zeros(below + 2, np.int64)  # first[b + 1]: slots in bucket b, then a running start
    for p in range(slots):
        expert = np.int64(flat[p])
        first[(expert - start if expert >= start else below) + 1] += 1
    range_counts = first[1 : end - start + 1].copy()
    for b in range(below + 1):
        first[b + 1] += first[b]
    available = first[end - start]
    filled = min(rows, available)
    order = np.empty(slots, np.int64)  # order[d] = p
    destination = np.empty(slots, np.int64)
    expanded_row_idx = np.empty(slots, np.int32)
    for p in range(slots):
        expert = np.int64(flat[p])
        bucket = expert - start if expert >= start else below
        d = first[bucket]
        first[bucket] = d + 1
        order[d] = p
        destination[p] = d if d < filled else -1
        if not rows_by_row:
            expanded_row_idx[p] = d if d < available else -1
    if rows_by_row:
        for d in range(slots):
            expanded_row_idx[d] = order[d]
    row_token = np.full(rows, -1, np.intp)
    for d in range(filled):
        row_token[d] = order[d] // top_k
    return destination, expanded_row_idx, row_token, range_counts, filled
