"""GroupedMatmul -> SwiGlu -> GroupedMatmul -> MoeFinalizeRoutingV2 at decode as one compiled call.

At decode each of the four nodes is a few microseconds of compiled work behind tens of
microseconds of Python (checks, buffers, a numba dispatch), three to five times more right
after a GEMM has streamed megabytes of weights through the caches: ~200 us of a ~1 ms layer.
When every group of rows goes to the lane dots (what GroupedMatmul itself picks:
:func:`.grouped_matmul.row_dots`), the four run here as one call of
:func:`.chain_loops.run_expert_chain`: the same kernels on the same rows (the same column shares
of the same lane dot loop, SwiGlu's and the combine's row loops), so the same bits as the four
ops, for any thread count. Anything else returns None and the caller runs the four ops, whose
checks then raise what they raise.

A runtime (the split executor's chain step) calls this for four adjacent nodes, computing::

    gate_up [M, 2I] = GroupedMatmul(rows [M, H], w_gate_up [E, 2I, H], counts [E];
                                    group_type 0, transpose_weight 1)
    act [M, I]      = SwiGlu(gate_up; dim -1)
    down [M, H]     = GroupedMatmul(act, w_down [E, H, I], counts; the same)
    y [T, H]        = MoeFinalizeRoutingV2(down, row_idx [T*K], scales=scales [T, K];
                                           drop_pad_mode 0 or 2)

``counts`` holds group sizes (group_list_type 1) or their running sum (0): the rows of
expert e are the e-th run of ``rows``; ``row_idx`` maps slot to row (source to destination):
slot ``t*K + j`` (mode 2) or ``j*T + t`` (mode 0) of token t went to row ``row_idx[slot]``.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import numpy as np

from . import buffers, dtypes, fused
from .errors import MoeOpError
from .moe_finalize_routing_v2 import slots_by_token
from .parallel import DESCRIPTOR_SLOTS, run_compiled, workers

_BFLOAT16 = dtypes.numpy_dtype("bfloat16")
#: the logits the compiled gating takes (MoeGatingTopKSoftmax's y is then of their dtype)
GATED_LOGITS = (np.dtype(np.float32), _BFLOAT16)
#: the module, not its function of the same name (which the package exports): its rules are
#: looked up when called, as GroupedMatmul looks them up
_grouped_matmul = importlib.import_module(f"{__package__}.grouped_matmul")
_gating = importlib.import_module(f"{__package__}.gating")


def experts_and_combine(
    rows: np.ndarray,
    w_gate_up: np.ndarray,
    w_down: np.ndarray,
    counts: np.ndarray,
    cumulative: bool,
    row_idx: np.ndarray,
    scales: np.ndarray,
    drop_pad_mode: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(gate_up, act, down, y)`` as the four ops give them (module doc), or None when this
    route does not apply: rows not float32/bfloat16, weights not C-contiguous ``[E, N, K]``
    with their rows' dtype, a group GroupedMatmul would not give the lane dots, counts or row_idx the
    ops would refuse, scales of another dtype, a product too small to split (under 2 MiB of
    weights read: GroupedMatmul runs it on the calling thread), one worker thread or the helpers
    busy.

    Args:
        rows: ``[M, H]`` C-contiguous; w_gate_up: ``[E, 2I, H]``; w_down: ``[E, H, I]``.
        counts: ``[E]`` integer, sizes (``cumulative`` False) or running sums of the groups.
        row_idx: ``[T*K]`` int32, slot -> row of ``rows``; scales: ``[T, K]``.
    """
    dtype = rows.dtype
    if (
        dtype not in (np.dtype(np.float32), _BFLOAT16)
        or rows.ndim != 2
        or not rows.flags.c_contiguous
        or any(w.ndim != 3 or w.dtype != dtype or not w.flags.c_contiguous for w in (w_gate_up, w_down))
        or scales.dtype not in (dtype, np.dtype(np.float32))
        or scales.ndim != 2
        or drop_pad_mode not in (0, 2)
    ):
        return None
    m, hidden = rows.shape
    experts, double_inner, _ = w_gate_up.shape
    inner = w_down.shape[2]
    offsets = _group_offsets(counts, cumulative, m)
    tokens, top_k = scales.shape
    if (
        offsets is None
        or w_gate_up.shape[2] != hidden
        or w_down.shape != (experts, hidden, inner)
        or double_inner != 2 * inner
        or len(counts) != experts
        or row_idx.shape != (tokens * top_k,)
    ):
        return None
    sizes = np.diff(offsets)
    hit = np.flatnonzero(sizes)
    # the product path GroupedMatmul takes for each group (its own rule, as it is at the time)
    if len(hit) == 0 or not all(_grouped_matmul.row_dots(size, dtype, True) for size in set(sizes[hit].tolist())):
        return None
    index = row_idx.astype(np.int64)
    if len(index) and (index.min() < 0 or index.max() >= m):  # MoeFinalizeRoutingV2 refuses it
        return None

    gate_up = buffers.empty((m, double_inner), dtype)
    act = buffers.empty((m, inner), dtype)
    down = buffers.empty((m, hidden), dtype)
    y = buffers.empty((tokens, hidden), dtype)
    filled = int(offsets[-1])
    gate_up[filled:] = 0  # GroupedMatmul's rows past the groups
    down[filled:] = 0
    first, stop = offsets[hit], offsets[hit + 1]

    def call(x: np.ndarray, weight: np.ndarray, out: np.ndarray):
        jobs = np.zeros((len(hit), 6), np.int64)
        jobs[:, 0], jobs[:, 2], jobs[:, 3], jobs[:, 4] = hit, weight.shape[2], first, stop
        source, kind = fused.carrier(x)
        target, _ = fused.carrier(out)
        stored, _ = fused.carrier(weight)
        bounds = fused.column_share_bounds(jobs, weight.shape[1], weight.itemsize)
        rows_most = int((stop - first).max())
        return fused.lane_dot_call(
            source, kind, False, stored, None, jobs, target[None], rows_most, weight.shape[2], bounds
        ), jobs

    up_call, up_jobs = call(rows, w_gate_up, gate_up)
    down_call, down_jobs = call(act, w_down, down)
    if up_call is None or down_call is None:
        return None
    source = slots_by_token(index, tokens, top_k, drop_pad_mode == 0)
    factors = scales.astype(np.float32, copy=False)
    gate_up_bits, kind = fused.carrier(gate_up)
    scratch = [np.empty(hidden, np.float32) for _ in range(3)]
    arguments = (
        np.zeros(1, np.int64),  # done
        down_call.descriptor,
        gate_up_bits.reshape(m, 2, inner),
        kind,
        fused.carrier(act)[0],
        fused.carrier(down)[0],
        source,
        factors,
        fused.carrier(y)[0],
        *scratch,
    )
    # (up_jobs, down_jobs and the calls' scratch stay referenced here: the descriptors point at them)
    if not run_compiled(up_call.descriptor, up_call.parts, _chain_loops().run_expert_chain, arguments):
        return None
    return gate_up, act, down, y


def _group_offsets(counts: np.ndarray, cumulative: bool, rows: int) -> np.ndarray | None:
    """GroupedMatmul's ``[E + 1]`` group starts, or None where it refuses the list (its error
    is then raised by the node)."""
    try:
        return _grouped_matmul.group_offsets(counts, 0 if cumulative else 1, rows, "rows of x (group_type 0)")
    except MoeOpError:
        return None


@dataclass(frozen=True)
class Dispatched:
    """What :func:`dispatch_experts_and_combine` computed: MoeGatingTopKSoftmax's probabilities
    and experts (when it gated), MoeInitRoutingV3's outputs, and the chain's
    (:func:`experts_and_combine`) unless a group was one the lane dots do not take."""

    probs: np.ndarray | None
    ids: np.ndarray | None
    rows: np.ndarray
    row_idx: np.ndarray
    counts: np.ndarray
    chain: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None


def dispatch_experts_and_combine(
    x: np.ndarray,
    w_gate_up: np.ndarray,
    w_down: np.ndarray,
    cumulative: bool,
    drop_pad_mode: int,
    *,
    ids: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    logits: np.ndarray | None = None,
    top_k: int = 0,
) -> Dispatched | None:
    """MoeInitRoutingV3 (dropless, every slot a row, the counts as sizes or running sums) and
    the chain of :func:`experts_and_combine` on its outputs, in one compiled call; with
    ``logits`` MoeGatingTopKSoftmax(k = ``top_k``) before them gives the ids and the scales.
    None when nothing was computed (what :func:`experts_and_combine` declines, logits neither
    float32 nor bfloat16, an expert id the dispatch refuses, more slots than the lane dots
    take in all the groups together); the gating and the dispatch alone when a group of rows
    is one GroupedMatmul would not give the lane dots.

    Args:
        x: ``[T, H]`` C-contiguous; w_gate_up: ``[E, 2I, H]``; w_down: ``[E, H, I]``.
        ids: ``[T, K]`` int32, token t's j-th expert; scales: ``[T, K]`` (without logits).
        logits: ``[T, E']`` float32 or bfloat16 (instead of ids and scales).
    """
    dtype = x.dtype
    lane_rows = _lane_dot_rows(dtype)
    gated = logits is not None
    if gated:
        assert logits is not None
        if logits.dtype not in GATED_LOGITS or logits.ndim != 2 or not logits.flags.c_contiguous:
            return None
        slots = (len(logits), top_k)
    else:
        assert ids is not None and scales is not None
        if ids.dtype != np.int32 or not ids.flags.c_contiguous or scales.dtype not in (dtype, np.dtype(np.float32)):
            return None
        slots = ids.shape
    if (
        dtype not in (np.dtype(np.float32), _BFLOAT16)
        or lane_rows == 0
        or workers() <= 1
        or x.ndim != 2
        or not x.flags.c_contiguous
        or len(slots) != 2
        or (not gated and scales.shape != slots)  # type: ignore[union-attr]
        or any(w.ndim != 3 or w.dtype != dtype or not w.flags.c_contiguous for w in (w_gate_up, w_down))
        or drop_pad_mode not in (0, 2)
    ):
        return None
    tokens, hidden = x.shape
    top_k = slots[1]
    experts, double_inner, _ = w_gate_up.shape
    inner = w_down.shape[2]
    if (
        tokens == 0
        or top_k < 1
        or slots[0] != tokens
        or w_gate_up.shape[2] != hidden
        or w_down.shape != (experts, hidden, inner)
        or double_inner != 2 * inner
        # more rows than the lane dots take in every group: some group has more (prefill), so
        # the call would only gate and dispatch, on one thread, where the ops copy the rows on
        # every thread (the qwen3-like layer at T = 2048: 10-12 ms against 6.6)
        or tokens * top_k > lane_rows * experts
    ):
        return None
    logits_kind = fused.NATIVE
    if gated:  # gating.gate's first two steps (numpy's exp is not numba's: the same bits need it)
        assert logits is not None
        logits, logits_kind = fused.carrier(logits)
        exps: np.ndarray = np.empty(logits.shape, np.float64)
        _gating.loops().exp_arguments(logits, logits_kind, _gating.SOFTMAX, exps)
        with np.errstate(all="ignore"):
            np.exp(exps, out=exps)
        kept: np.ndarray = np.empty(logits.shape, np.float32)
        ids, factors = np.empty(slots, np.int32), np.empty(slots, np.float32)
    else:
        logits, exps, kept = _NO_LOGITS, _NO_EXPS, _NO_LOGITS
        factors = scales.astype(np.float32, copy=False)  # type: ignore[union-attr]
        # the compiled function writes both when it gates: numba types read-only arrays apart
        # and refuses the write even in the branch this call does not take
        assert ids is not None
        ids, factors = _writeable(ids), _writeable(factors)
    m = tokens * top_k
    rows = buffers.empty((m, hidden), dtype)
    row_idx = np.empty(m, np.int32)
    counts = np.empty(experts, np.int64)
    gate_up = buffers.empty((m, double_inner), dtype)
    act = buffers.empty((m, inner), dtype)
    down = buffers.empty((m, hidden), dtype)
    y = buffers.empty((tokens, hidden), dtype)
    threads = workers()
    gate_up_bits, kind = fused.carrier(gate_up)
    flags = [top_k, experts, int(cumulative), lane_rows, int(drop_pad_mode == 2), int(kind == fused.BFLOAT16)]
    plan = np.array([*flags, *fused.column_shares(threads), int(gated), logits_kind], np.int64)
    done = np.zeros(2, np.int64)
    arguments = (
        done,
        plan,
        logits,
        exps,
        kept,
        ids,
        fused.row_words(x),
        fused.row_words(rows),
        row_idx,
        counts,
        fused.carrier(rows)[0],
        fused.carrier(w_gate_up)[0],
        gate_up_bits,
        gate_up_bits.reshape(m, 2, inner),
        fused.carrier(act)[0],
        fused.carrier(w_down)[0],
        fused.carrier(down)[0],
        np.empty((experts, 6), np.int64),  # the gate-up jobs
        np.empty((experts, 6), np.int64),  # the down jobs
        np.empty(threads * lane_rows * max(hidden, inner), np.float32),  # the lane dots' scratch
        np.empty(threads * 16, np.float32),
        np.empty(DESCRIPTOR_SLOTS, np.int64),  # the two calls' descriptors
        np.empty(DESCRIPTOR_SLOTS, np.int64),
        np.empty((tokens, top_k), np.int64),  # the combine's row of each slot
        factors,
        fused.carrier(y)[0],
        *[np.empty(hidden, np.float32) for _ in range(3)],
    )
    loops = _chain_loops()
    fused.serve_compiled_calls()
    wake_up = np.zeros(loops.WAKE_UP_SLOTS, np.int64)  # no shares, no seats: it wakes the helpers
    if not run_compiled(wake_up, threads, loops.run_dispatch_and_expert_chain, arguments) or done[1] == 2:
        return None
    chain = None if done[1] == 1 else (gate_up, act, down, y)
    probs = None
    if gated:  # the gating's y, in the logits' dtype (bfloat16: the rounded values, exactly)
        probs = factors if logits_kind == fused.NATIVE else factors.astype(_BFLOAT16)
    return Dispatched(probs, ids if gated else None, rows, row_idx, counts, chain)


_NO_LOGITS, _NO_EXPS = np.zeros((0, 0), np.float32), np.zeros((0, 0), np.float64)


def _writeable(array: np.ndarray) -> np.ndarray:
    """``array``, or a copy of it when it is read-only (an initializer, a read-only feed)."""
    return array if array.flags.writeable else array.copy()


@functools.cache
def _chain_loops():
    from . import chain_loops

    return chain_loops


def _lane_dot_rows(dtype: np.dtype) -> int:
    """The most rows of a group GroupedMatmul gives its lane dots (against ``[N, K]``-stored
    weights), as its rule says now: 0 when none."""
    rows = 0
    while rows < 64 and _grouped_matmul.row_dots(rows + 1, dtype, True):
        rows += 1
    return rows
