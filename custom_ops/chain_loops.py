"""The numba loops behind :mod:`.expert_chain`: an MoE layer's gating, dispatch, experts and
combine at decode in one compiled call, each step the loop its op runs (so the op's bits), the
two products posted to the helpers from compiled code. Imported on first use (numba is slow to
import)."""

from __future__ import annotations

import numpy as np
from numba import njit

from .fused import BFLOAT16, NATIVE
from .fused_loops import (
    _D_BITS,
    _D_BOUNDS,
    _D_G,
    _D_J,
    _D_JOBS,
    _D_K,
    _D_M,
    _D_N,
    _D_O,
    _D_OUT,
    _D_PARTS,
    _D_SEATS,
    _D_SUMS,
    _D_W,
    _D_X,
    _D_X_COLUMNS,
    _D_X_ROWS,
    _D_XS,
    _D_XS_DEPTH,
    _D_XS_ROWS,
    _copy_rows_to,
    _finalize_rows,
    _float32_as_int32,
    _float32_to_bfloat16,
    _int32_as_float32,
    _run_lane_dot_shares,
    _swiglu,
)
from .gating_loops import SOFTMAX, scores_and_choice
from .parallel import COMPILED, DESCRIPTOR_SLOTS, INSIDE, NEXT, OPEN, POSTED, SEAT
from .routing_loops import dropless_slots
from .spin import exchange, load_acquire, wait_until_zero

#: the slots of a call with no shares and no seats (what wakes the helpers)
WAKE_UP_SLOTS = _D_BOUNDS + 1


@njit(nogil=True, cache=True)
def _post_compiled_call(counters, d, descriptor):
    """From compiled code: ``descriptor`` into the helpers' ``d`` and a new call posted, as
    ``parallel._Helpers.run_compiled`` posts one (the slots first, the call number last, so a
    helper that sees the number sees the call). Only after every helper of the last call left."""
    base = counters.ctypes.data
    number = load_acquire(base + 8 * POSTED) + 1
    d[: len(descriptor)] = descriptor
    d[len(descriptor) :] = 0
    exchange(base + 8 * NEXT, 0)
    exchange(base + 8 * SEAT, 1)
    exchange(base + 8 * OPEN, number)
    exchange(base + 8 * COMPILED, number)
    exchange(base + 8 * POSTED, number)


@njit(nogil=True, cache=True)
def _run_posted_call(counters, d, polls):
    """The caller's shares of the posted call, then close it and wait for every helper inside
    to leave (they write into arrays the caller reads next): ``polls`` polls, then it gives its
    core up between polls."""
    base = counters.ctypes.data
    _run_lane_dot_shares(counters, d, 0)
    exchange(base + 8 * OPEN, 0)
    wait_until_zero(base + 8 * INSIDE, polls)


@njit(nogil=True, cache=True)
def run_expert_chain(
    counters, d, polls, done, down_call, gate_up, kind, act, down, source, scales, y, total, term, bias_row
):
    """The caller's side of GroupedMatmul -> SwiGlu -> GroupedMatmul -> MoeFinalizeRoutingV2
    (:func:`.expert_chain.experts_and_combine`): the gate-up lane dots (posted already, in
    ``d``), SwiGlu on every row, the down lane dots (``down_call``, posted here), the combine;
    each step the same loop the op runs, so the same bits. Returns True: every helper has left
    (``done[0]`` set: called again, as after an interrupt, it returns at once)."""
    if done[0]:
        return True
    _run_posted_call(counters, d, polls)
    _swiglu(gate_up, kind, act, 0, gate_up.shape[0])
    _post_compiled_call(counters, d, down_call)
    _run_posted_call(counters, d, polls)
    _finalize_rows(down, kind, source, scales, None, None, None, None, y, 0, y.shape[0], total, term, bias_row)
    done[0] = 1
    return True


@njit(nogil=True, cache=True)
def _describe_lane_dots(descriptor, bits, x, w, jobs, n_jobs, out, xs, sums, shares):
    """Fill ``descriptor`` (the ``_D_*`` layout) for the lane dots of ``x [M, K]`` against
    ``w [G, N, K]`` (C-contiguous carriers) over ``jobs[:n_jobs]`` into ``out [M, N]``,
    the output columns split as ``fused.column_share_bounds`` splits them: ``shares`` holds
    (threads, shares per worker, the bytes of weight per share, the column alignment)."""
    threads, per_worker, share_bytes, align = shares[0], shares[1], shares[2], shares[3]
    groups, columns, depth = w.shape
    weight_rows, rows_most = 0, 1
    for j in range(n_jobs):
        weight_rows += jobs[j, 2] - jobs[j, 1]
        rows_most = max(rows_most, jobs[j, 4] - jobs[j, 3])
    parts = min(
        threads * per_worker, max(1, weight_rows * columns * w.itemsize // share_bytes), max(1, columns // align)
    )
    parts = min(parts, DESCRIPTOR_SLOTS - _D_BOUNDS - 1)  # what a descriptor holds (16 at most today)
    descriptor[:] = 0
    descriptor[_D_BITS] = bits
    descriptor[_D_X], descriptor[_D_X_ROWS], descriptor[_D_X_COLUMNS] = x.ctypes.data, x.shape[0], x.shape[1]
    descriptor[_D_W], descriptor[_D_G], descriptor[_D_N], descriptor[_D_K] = w.ctypes.data, groups, columns, depth
    descriptor[_D_JOBS], descriptor[_D_J] = jobs.ctypes.data, n_jobs
    descriptor[_D_OUT], descriptor[_D_O], descriptor[_D_M] = out.ctypes.data, 1, out.shape[0]
    descriptor[_D_XS], descriptor[_D_SEATS] = xs.ctypes.data, min(threads, parts)
    descriptor[_D_XS_ROWS], descriptor[_D_XS_DEPTH] = rows_most, depth
    descriptor[_D_SUMS], descriptor[_D_PARTS] = sums.ctypes.data, parts
    aligned = columns // align
    for i in range(parts):
        descriptor[_D_BOUNDS + i] = aligned * i // parts * align
    descriptor[_D_BOUNDS + parts] = columns


@njit(nogil=True, cache=True)
def _group_jobs(sizes, depth, jobs):
    """``jobs[:J]`` = ``(e, 0, depth, first, stop, 0)`` for the experts e with rows, whose rows
    follow one another in expert order; J."""
    count, first = 0, 0
    for e in range(sizes.shape[0]):
        if sizes[e] > 0:
            jobs[count, 0], jobs[count, 1], jobs[count, 2] = e, 0, depth
            jobs[count, 3], jobs[count, 4], jobs[count, 5] = first, first + sizes[e], 0
            first += sizes[e]
            count += 1
    return count


@njit(inline="always")
def _round_to_bfloat16(values):
    """Each float32 of ``values`` rounded to bfloat16 (nearest even), kept as float32 (exact)."""
    for p in range(values.shape[0]):
        bits = np.uint32(_float32_as_int32(values[p]))
        values[p] = _int32_as_float32(np.int32(np.uint32(_float32_to_bfloat16(bits)) << np.uint32(16)))


@njit(nogil=True, cache=True)
def run_dispatch_and_expert_chain(
    counters,
    d,
    polls,
    done,
    plan,
    logits,
    exps,
    kept,
    ids,
    x_words,
    rows_words,
    row_idx,
    counts,
    rows,
    w_gate_up,
    gate_up,
    gate_up_halves,
    act,
    w_down,
    down,
    up_jobs,
    down_jobs,
    xs,
    sums,
    up_call,
    down_call,
    source,
    scales,
    y,
    total,
    term,
    bias_row,
):
    """The caller's side of MoeInitRoutingV3 (dropless) -> GroupedMatmul -> SwiGlu ->
    GroupedMatmul -> MoeFinalizeRoutingV2 (:func:`.expert_chain.dispatch_experts_and_combine`),
    after a call with no shares (posted to wake the helpers): the dispatch as the op computes it
    (:func:`.routing_loops.dropless_slots`, the rows copied source-major), then the chain as
    :func:`run_expert_chain`, its two calls described and posted here. ``done[1]`` says how
    far it went: 0 every output, 1 the dispatch only (a group the lane dots do not take), 2
    nothing (an expert id out of range: the op raises). Returns True: every helper has left.

    ``plan``: top_k, expert_num, cumulative counts (1) or sizes (0), the most rows of a group
    the lane dots take, row-arranged slots (1: drop_pad_mode 2) or column-arranged (0), bfloat16
    bits (1) or float32 (0), the four numbers of :func:`_describe_lane_dots`' ``shares``, then
    whether MoeGatingTopKSoftmax comes first (1: ``logits [T, E]`` and their softmax exps from
    numpy give ``ids [T, K]`` and ``scales``, its probabilities, as gating.gate does), then the
    logits' kind (NATIVE: float32; BFLOAT16: their bits, and the probabilities rounded to
    bfloat16, the op's ``y``, which the combine then scales by).
    """
    if done[0]:
        return True
    base = counters.ctypes.data
    exchange(base + 8 * OPEN, 0)  # the wake-up call: closed, and nobody inside it
    wait_until_zero(base + 8 * INSIDE, polls)
    top_k, experts, cumulative, lane_rows, by_row, bits = plan[0], plan[1], plan[2], plan[3], plan[4], plan[5]
    shares = plan[6:10]
    done[0] = 1
    if plan[10]:  # MoeGatingTopKSoftmax first: its pass after numpy's exp (gating.gate), into ids and scales
        logit_kind = plan[11]
        no_offset, no_hash = None, None
        scores_and_choice(
            logits, logit_kind, exps, SOFTMAX, no_offset, 1, 1, False, no_hash, False, 1.0, 0.0, kept, ids, scales
        )
        if logit_kind == BFLOAT16:
            _round_to_bfloat16(scales.reshape(scales.size))
    flat = ids.reshape(ids.size)
    for p in range(flat.shape[0]):
        if flat[p] < 0 or flat[p] >= experts:
            done[1] = 2
            return True
    tokens = ids.shape[0]
    destination, slot_rows, _, sizes, _ = dropless_slots(flat, top_k, 0, experts, experts, flat.shape[0], False)
    starts = np.arange(tokens + 1) * top_k
    _copy_rows_to(x_words, destination, starts, rows_words, 0, tokens)
    row_idx[:] = slot_rows
    total_rows = 0
    for e in range(experts):
        total_rows += sizes[e]
        counts[e] = total_rows if cumulative else sizes[e]
        if sizes[e] > lane_rows:
            done[1] = 1
    if done[1] == 1:
        return True
    n_jobs = _group_jobs(sizes, w_gate_up.shape[2], up_jobs)
    _group_jobs(sizes, w_down.shape[2], down_jobs)
    _describe_lane_dots(up_call, bits, rows, w_gate_up, up_jobs, n_jobs, gate_up, xs, sums, shares)
    _post_compiled_call(counters, d, up_call)
    _run_posted_call(counters, d, polls)
    kind = BFLOAT16 if bits else NATIVE
    _swiglu(gate_up_halves, kind, act, 0, act.shape[0])
    _describe_lane_dots(down_call, bits, act, w_down, down_jobs, n_jobs, down, xs, sums, shares)
    _post_compiled_call(counters, d, down_call)
    _run_posted_call(counters, d, polls)
    for t in range(tokens):
        for j in range(top_k):
            source[t, j] = slot_rows[t * top_k + j] if by_row else slot_rows[j * tokens + t]
    _finalize_rows(down, kind, source, scales, None, None, None, None, y, 0, tokens, total, term, bias_row)
    return True
