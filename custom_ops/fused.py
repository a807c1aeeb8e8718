"""Single-pass row loops for the ops that add rows, compiled with numba.

In numpy every step of ``out[t] = sum_i w[i] * rows[index[i]]`` is a pass over memory of
its own (gather, widen bfloat16 to float32, scale, add, round back), and each pass costs
about as much as the op's whole floor. These loops read each source row once and write
each output row once, widening, scaling, adding and rounding one row at a time in cache.

Element types: float32 and float64 arrays are used as they are. numba knows neither float16
nor bfloat16, so those cross as their uint16 bits with a ``kind`` saying which (see
:func:`carrier`). Widening is exact; narrowing rounds to nearest even (see ``_narrow``).
Arithmetic is plain IEEE (no fast-math): a product is rounded to the compute type before it
is added; sums add their terms in the order given, starting from +0.0, and dot products add
pairwise in a fixed order (``_dot_into``), except :func:`few_rows_products` (GroupedMatmul's
small groups, compute-bound), whose float32 sums take k in order, each step a fused
multiply-add (one rounding), and :func:`lane_dot_products` (its small groups against [N, K]
weights), whose sums are 16 lane sums added in a fixed tree; so the same input gives the same
bits on every run, on any number of threads.

The compiled loops (:mod:`.fused_loops`) release the GIL and work on a range ``[first, stop)``
of output rows; the functions here split big calls over threads
(:func:`.parallel.for_row_ranges`). numba is imported with the loops, on first use: it
takes longer to import than the rest of the op library.
"""

from __future__ import annotations

import functools
import queue
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from . import buffers
from .parallel import DESCRIPTOR_SLOTS, for_row_ranges, run_compiled, run_ranges, workers


@functools.cache
def _loops():
    from . import fused_loops

    return fused_loops


NATIVE, BFLOAT16, FLOAT16 = 0, 1, 2


def carrier(array: np.ndarray) -> tuple[np.ndarray, int]:
    """``(array as numba can take it, kind)``: float16 / bfloat16 as their uint16 bits."""
    if array.dtype == ml_dtypes.bfloat16:
        return array.view(np.uint16), BFLOAT16
    if array.dtype == np.float16:
        return array.view(np.uint16), FLOAT16
    return array, NATIVE


def compute_dtype(rows: np.ndarray) -> np.dtype:
    """float32, or float64 for float64 rows (bare-kernel gradient checks); factors are cast
    to it."""
    return np.dtype(np.float64 if rows.dtype == np.float64 else np.float32)


def segment_sums(
    rows: np.ndarray, index: np.ndarray, segment_start: np.ndarray, weights: np.ndarray | None = None
) -> np.ndarray:
    """``out[s] = sum_{i in segment s} weights[i] * rows[index[i]]``, terms added in i order.

    Args:
        rows: ``[R, H]`` float32/float16/bfloat16/float64.
        index: ``[M]`` integer, the source row of term i; negative = a skipped term.
        segment_start: ``[S + 1]`` integer, non-decreasing; segment s is terms
            ``segment_start[s] .. segment_start[s + 1] - 1``.
        weights: ``[M]`` float factor of each term, or None for 1.
    Returns:
        ``[S, H]`` in the dtype of ``rows``, summed in :func:`compute_dtype`,
        rounded to nearest even; an empty segment gives zeros.
    """
    hidden = rows.shape[1]
    cdt = compute_dtype(rows)
    out = buffers.empty((len(segment_start) - 1, hidden), rows.dtype)
    source, kind = carrier(rows)
    target, _ = carrier(out)
    w = None if weights is None else weights.astype(cdt, copy=False)

    def work(first: int, stop: int) -> None:
        _loops()._segment_sums(
            source, kind, index, segment_start, w, target, first, stop, np.empty(hidden, cdt), np.empty(hidden, cdt)
        )

    terms_per_row = len(index) / max(len(out), 1)
    for_row_ranges(work, len(out), int((1 + terms_per_row) * hidden * rows.itemsize))
    return out


def scaled_rows_and_dots(
    rows: np.ndarray, index: np.ndarray, scale: np.ndarray, dot_with: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``out[d] = scale[d] * rows[index[d]]`` and ``dots[d] = sum_h rows[index[d], h] * dot_with[d, h]``.

    Source-major, as :func:`copy_rows_to`: each source row is read and widened once for all
    the rows it feeds.

    Args:
        rows: ``[R, H]``; index: ``[N]`` source row of d, negative = an empty row.
        scale: ``[N]`` float; dot_with: ``[N, H]``.
    Returns:
        ``out [N, H]`` in the dtype of ``rows`` (zeros where ``index < 0``), and ``dots [N]``
        in the compute type (0 where ``index < 0``), summed pairwise in a fixed order.
    """
    n, hidden = len(index), rows.shape[1]
    cdt = compute_dtype(rows)
    out = buffers.empty((n, hidden), rows.dtype)
    dots = np.empty(n, cdt)
    source, kind = carrier(rows)
    target, _ = carrier(out)
    other, other_kind = carrier(dot_with)
    factors = scale.astype(cdt, copy=False)
    order, start = destinations_by_source(index, len(rows))

    def work(first: int, stop: int) -> None:
        _loops()._scaled_rows_and_dots(
            source,
            kind,
            order,
            start,
            factors,
            other,
            other_kind,
            target,
            dots,
            first,
            stop,
            np.empty(hidden, cdt),
            np.empty(hidden, cdt),
            np.empty(hidden, cdt),
        )

    fanout = len(order) / max(len(rows), 1)
    for_row_ranges(work, len(rows), int((1 + 2 * fanout) * hidden * rows.itemsize))
    empty = np.flatnonzero(index < 0)
    target[empty] = 0
    dots[empty] = 0
    return out, dots


def destinations_by_source(index: np.ndarray, n_sources: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of a gather map: source s feeds rows ``order[start[s]:start[s + 1]]``.

    Args:
        index: ``[N]`` integer, source row of destination d, in ``[-1, n_sources)``;
            negative = no source.
    Returns:
        ``order [M]`` int64, the d with ``index[d] >= 0`` grouped by source, increasing
        within a group; ``start [n_sources + 1]`` int64.
    """
    filled = np.flatnonzero(index >= 0)
    source = index[filled]
    order = filled[np.argsort(source, kind="stable")].astype(np.int64)
    start = np.zeros(n_sources + 1, np.int64)
    np.cumsum(np.bincount(source, minlength=n_sources), out=start[1:])
    return order, start


def fanout_starts(n_sources: int, k: int) -> np.ndarray:
    """``start [n_sources + 1]`` of a map in which source r feeds entries ``r*k .. r*k + k - 1``."""
    return np.arange(n_sources + 1, dtype=np.int64) * k


def row_words(array: np.ndarray) -> np.ndarray:
    """A C-contiguous ``[R, ...]`` array as ``[R, W]`` unsigned words, the widest that tile a
    row (a byte loop copies ~5x slower than uint64)."""
    row_bytes = int(np.prod(array.shape[1:], dtype=np.int64)) * array.itemsize
    word = np.dtype(f"u{next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)}")
    return array.view(np.uint8).reshape(len(array), row_bytes).view(word)


def copy_rows_to(source: np.ndarray, order: np.ndarray, start: np.ndarray, n_rows: int) -> np.ndarray:
    """``out[order[i]] = source[r]`` for ``start[r] <= i < start[r + 1]`` (bit-exact).

    Source-major: each source row is read once and written to its places while it is in
    cache; a gather by destination would read it from memory once per place.

    Args:
        source: ``[R, ...]`` any dtype.
        order, start: the output rows of each source row, as :func:`destinations_by_source`
            gives them (``start [R + 1]``). No output row may appear twice; entries outside
            ``[0, n_rows)`` are skipped.
    Returns:
        ``[n_rows, ...]`` in the dtype of ``source``; rows that no entry names are left
        uninitialised (the caller fills them).
    """
    out = buffers.empty((n_rows,) + source.shape[1:], source.dtype)
    row_bytes = int(np.prod(source.shape[1:], dtype=np.int64)) * source.itemsize
    source_words, out_words = row_words(np.ascontiguousarray(source)), row_words(out)

    def work(first: int, stop: int) -> None:
        _loops()._copy_rows_to(source_words, order, start, out_words, first, stop)

    fanout = len(order) / max(len(source), 1)
    for_row_ranges(work, len(source), int((1 + fanout) * row_bytes))
    return out


def swiglu(x: np.ndarray) -> np.ndarray:
    """``y[r] = a * sigmoid(a) * b`` with ``a, b = x[r, 0], x[r, 1]`` (SPEC 1.10).

    Args:
        x: ``[R, 2, I]`` float32/float16/bfloat16/float64, C-contiguous: the gate half first.
    Returns:
        ``[R, I]`` in the dtype of ``x``, computed in :func:`compute_dtype` (sigmoid by a
        vectorised exp, see ``fused_loops._sigmoid32``), rounded to nearest even once.
    """
    rows, _, inner = x.shape
    out = buffers.empty((rows, inner), x.dtype)
    source, kind = carrier(x)
    target, _ = carrier(out)

    def work(first: int, stop: int) -> None:
        _loops()._swiglu(source, kind, target, first, stop)

    for_row_ranges(work, rows, 3 * inner * x.itemsize)
    return out


def swiglu_grad(grad: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The gradient of :func:`swiglu` with respect to ``x``: ``[R, 2, I]`` in ``x``'s dtype.

    Args:
        grad: ``[R, I]`` (any of the float dtypes); x: ``[R, 2, I]``, both C-contiguous.
    """
    rows, _, inner = x.shape
    cdt = compute_dtype(x)
    out = buffers.empty(x.shape, x.dtype)
    grad_source, grad_kind = carrier(grad)
    source, kind = carrier(x)
    target, _ = carrier(out)

    def work(first: int, stop: int) -> None:
        scratch = [np.empty(inner, cdt) for _ in range(4)]
        _loops()._swiglu_grad(
            grad_source, grad_kind, source, kind, target, first, stop, *scratch, np.empty(inner, np.int32)
        )

    for_row_ranges(work, rows, 5 * inner * x.itemsize)
    return out


def finalize_rows(
    rows: np.ndarray,
    source: np.ndarray,
    scales: np.ndarray | None,
    bias: np.ndarray | None,
    expert: np.ndarray | None,
    x1: np.ndarray | None,
    x2: np.ndarray | None,
) -> np.ndarray:
    """``out[i] = x1[i] + x2[i] + sum_j scales[i, j] * (rows[source[i, j]] + bias[expert[i, j]])``.

    Args:
        rows: ``[N, H]`` float32/float16/bfloat16/float64; source: ``[R, K]`` integer, the row
            of each term, -1 = a zero row (its scaled bias still counts).
        scales: ``[R, K]`` float or None (1); bias: ``[E, H]`` of ``rows``' dtype or None,
            with expert: ``[R, K]`` integer in ``[0, E)``.
        x1, x2: ``[R, H]`` of ``rows``' dtype or None (x2 only with x1).
    Returns:
        ``[R, H]`` in ``rows``' dtype: the skips added first, then the K terms in order, in
        :func:`compute_dtype` (each product rounded before it is added), rounded once.
    """
    n_tokens, top_k = source.shape
    hidden = rows.shape[1]
    cdt = compute_dtype(rows)
    out = buffers.empty((n_tokens, hidden), rows.dtype)
    source_rows, kind = carrier(rows)
    target, _ = carrier(out)
    factors = None if scales is None else scales.astype(cdt, copy=False)
    bias_rows = None if bias is None else carrier(bias)[0]
    experts = None if expert is None else expert.astype(np.int64, copy=False)
    skips = [None if s is None else carrier(s)[0] for s in (x1, x2)]
    index = source.astype(np.int64, copy=False)

    def work(first: int, stop: int) -> None:
        scratch = [np.empty(hidden, cdt) for _ in range(3)]
        _loops()._finalize_rows(
            source_rows, kind, index, factors, bias_rows, experts, *skips, target, first, stop, *scratch
        )

    terms = top_k + (x1 is not None) + (x2 is not None) + 1
    for_row_ranges(work, n_tokens, terms * hidden * rows.itemsize)
    return out


def expert_ends(sorted_experts: np.ndarray, num_experts: int) -> np.ndarray | None:
    """``[num_experts]`` int32: per expert e, the number of entries ``<= e`` of the
    non-decreasing ``sorted_experts [N]`` (MoeComputeExpertTokens); None when it is not
    non-decreasing or has an entry < 0 (the caller says which)."""
    ends = np.empty(num_experts, np.int32)  # (a few bytes: buffers.empty's bookkeeping would cost more)
    return ends if _loops()._expert_ends(sorted_experts, ends) else None


#: output columns of the threads' shares are multiples of this: the few-rows kernel's block of
#: columns held in vector registers (2 vectors of float32); a share's last columns short of a
#: block take its scalar loop (shares of 48 columns ran 4-5x slower than of 64)
_COLUMN_ALIGN = 32
#: the kernel's (block of output columns, tile of k) for a stored [K, N] (False) and [N, K]
#: (True) weight, measured (docs/bench.md): a [K, N] tile reads a row segment per k, so it is
#: wide and shallow (narrow ones, 64 x 128, ran 2-3x slower for bfloat16); an [N, K] tile is
#: transposed from 32 rows of 64 k (64-column tiles ran up to 1.8x slower)
_TILES = {False: (512, 16), True: (32, 64)}
#: float32 rows against a weight stored [N, K] are the few-rows kernel's vector lanes
#: (fused_loops._row_lane_sums: the same sums, the weight read where it lies instead of
#: transposed into tiles), ROW_LANES rows a vector, a job's rows in equal pieces of at most
#: ROW_LANE_ROWS (four vectors by 6 columns, 24 sums in registers, 10 loads to 24 fused
#: multiply-adds a k, where three by 8 took 11: one thread, 4 experts [1024, 1024] in L3, 64
#: rows 187 GFLOP/s against 160 for three vectors; 2 threads, 8-64 experts from memory, time /
#: pieces of up to 48 rows: 128-512 rows 0.81-0.89, 64 rows 0.81-1.03; the layer at T = 512
#: and 2048 0.87-0.92x, docs/bench.md "thirteenth step"; four by 4 read the rows' 64 KB per
#: k from L2 at K = 256: 1.0-1.07x the time of three by 8 at 45-128 rows).
#: Time / the tiles', 2 threads, 256 MB of weights from memory, four shapes from [1024, 256]
#: to [1536, 2048] (docs/bench.md, "ninth step" for up to 16 rows, "tenth step"): 9 rows
#: 0.81-1.05, 16 rows 0.68-1.01, 24 rows 0.72-0.86, 32 rows 0.62-0.73, 48 rows 0.73-0.84,
#: 64 rows 0.73-0.87; for bfloat16, whose weights the tiles widen in vectors, 1.05-1.51 at
#: 9-16 rows: not taken
ROW_LANES = 16
ROW_LANE_ROWS = 64
#: bfloat16 groups of up to this many rows against a weight stored [N, K] take the tiles (the
#: weight widened and transposed a tile at a time), bigger ones the lanes, the weight widened
#: where each element is broadcast (before, BLAS after a float32 copy of each expert's
#: weight): the same sums either way. Lanes / tiles time, 2 threads, from memory: 32 rows 0.90,
#: 64 rows 1.00-1.10, 96 rows 1.09; lanes / BLAS 256-512 rows 0.65-0.79 (docs/bench.md,
#: "thirteenth step")
BFLOAT16_TILE_ROWS = ROW_LANE_ROWS
#: floats at the end of the row lanes' running sums: a 16 x 16 square of them, transposed
LANE_SQUARE = ROW_LANES * ROW_LANES
#: weight bytes a call reads below which it stays on the calling thread
_PARALLEL_MIN_WEIGHT_BYTES = 1 << 20


#: column shares per worker thread: the threads take them one at a time (run_ranges), so one
#: that gets no core for a while (a machine shared with other work) leaves its rest to the others
_SHARES_PER_WORKER = 4
#: jobs per worker thread from which :func:`few_rows_products` splits the jobs over the threads
#: instead of the output columns (prefill: many experts, each with tens of rows). A column share
#: reads every job's rows again (float32 against [N, K]: their transposed lanes, megabytes,
#: from L3 once per share), where a share of whole jobs transposes its jobs' rows and uses them
#: while they are in L2. Time / the column shares', 2 threads, the real expert counts of the
#: layers of bench_layer_e2e (docs/bench.md, "twelfth step"): qwen3-like T = 512 gate/up
#: 0.83-0.88, down 0.88-0.95; deepseek-like T = 512 0.93 and 0.97; qwen3-like T = 128 0.89-0.92,
#: 0.94-0.96; bfloat16 qwen3-like T = 512 0.96-0.98; with 8 jobs (the mixtral-like layer's 8
#: experts) T = 64 0.97-0.98, T = 128 0.95-0.98, T = 512 0.95
_JOBS_PER_WORKER = 4
#: job shares per worker thread (ranges of consecutive jobs of about equal work, handed out
#: the biggest first, for the reason of _SHARES_PER_WORKER)
_JOB_SHARES_PER_WORKER = 8
#: output columns a job share takes at a time: the kernel's running sums of a block of columns
#: (up to ROW_LANE_ROWS floats a column) stay in L2 (512 KiB at 64 rows; a weight of 28672 rows would need 7 MB)
_JOB_SHARE_COLUMNS = 2048


def column_share_bounds(jobs: np.ndarray, columns: int, itemsize: int) -> list[int]:
    """Bounds of shares of the ``columns`` output columns (multiples of _COLUMN_ALIGN but the
    last): one share per _PARALLEL_MIN_WEIGHT_BYTES of weight the ``jobs`` read, at most
    _SHARES_PER_WORKER per worker (one in all when there is one worker)."""
    threads, per_worker, share_bytes, align = column_shares(workers())
    weight_bytes = _weight_bytes(jobs, columns * itemsize)
    parts = min(threads * per_worker, max(1, weight_bytes // share_bytes), max(1, columns // align))
    aligned = columns // _COLUMN_ALIGN
    return [aligned * i // parts * _COLUMN_ALIGN for i in range(parts)] + [columns]


def _weight_bytes(jobs: np.ndarray, column_bytes: int) -> int:
    """The weight bytes ``jobs`` rows ``(g, k0, k1, r0, r1, o)`` read: each job's k range
    times ``column_bytes`` (the bytes of one k's output columns)."""
    return int((jobs[:, 2] - jobs[:, 1]).sum()) * column_bytes


def column_shares(threads: int) -> tuple[int, int, int, int]:
    """``(threads, shares per worker, weight bytes per share, column alignment)``: the numbers
    of :func:`column_share_bounds` (the compiled chain splits its calls by them too)."""
    return threads, _SHARES_PER_WORKER if threads > 1 else 1, _PARALLEL_MIN_WEIGHT_BYTES, _COLUMN_ALIGN


def _over_column_shares(work: Callable[[int, int], None], jobs: np.ndarray, columns: int, itemsize: int) -> None:
    """``work(first, stop)`` over the column shares (:func:`column_share_bounds`), taken by
    the threads one at a time."""
    run_ranges(work, column_share_bounds(jobs, columns, itemsize))


def _job_extent(jobs: np.ndarray) -> tuple[int, int]:
    """The most rows and the deepest k range of ``jobs`` rows ``(g, k0, k1, r0, r1, o)``: the
    kernels' scratch sizes."""
    return int((jobs[:, 4] - jobs[:, 3]).max()), int((jobs[:, 2] - jobs[:, 1]).max())


def _in_pieces(jobs: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cut, pieces)``: ``jobs`` rows ``(g, k0, k1, r0, r1, o)`` with every job of more than
    ``most`` rows cut into as few pieces as hold it (``pieces [J]``, in order in ``cut``), of
    equal size rounded up to whole vectors of ROW_LANES rows, the last one the rest (the same
    sums: each output element is one job's alone). With most = 48, 64 rows were 32 + 32, which
    ran 0.85-1.0x the time of 48 + 16 (three vectors, then one); 256 rows at 64 are 4 x 64."""
    rows = jobs[:, 4] - jobs[:, 3]
    pieces = -(-rows // most)
    if rows.max() <= most:
        return jobs, pieces
    size = np.repeat((-(-rows // pieces) + ROW_LANES - 1) // ROW_LANES * ROW_LANES, pieces)
    cut = np.repeat(jobs, pieces, axis=0)
    piece = np.arange(len(cut)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    cut[:, 3] = np.repeat(jobs[:, 3], pieces) + piece * size
    cut[:, 4] = np.minimum(cut[:, 3] + size, np.repeat(jobs[:, 4], pieces))
    return cut, pieces


def _contiguous_weight(weight: np.ndarray, transposed: bool) -> tuple[np.ndarray, bool]:
    """``(weight, transposed)`` as C-contiguous storage of the same matrices W (the kernel reads
    tiles by address): itself, else its last two axes swapped with the flag flipped (a
    transposed view), else a C-contiguous copy."""
    if weight.flags.c_contiguous:
        return weight, transposed
    swapped = np.swapaxes(weight, -1, -2)
    if swapped.flags.c_contiguous:
        return swapped, not transposed
    return np.ascontiguousarray(weight), transposed


def few_rows_products(
    x: np.ndarray,
    x_transposed: bool,
    weight: np.ndarray,
    weight_transposed: bool,
    bias: np.ndarray | None,
    jobs: np.ndarray,
    out: np.ndarray,
) -> None:
    """``out[o, r] = round(X[r, k0:k1] @ W[g, k0:k1] + bias[g])`` for the rows r of each job,
    every sum taken over k in increasing order with one float32 (float64 for float64 x)
    accumulator per output element, no reassociation, each float32 step a fused multiply-add
    (rounded once; float64: the product rounded, then added), the bias added last, the result
    rounded once to nearest even. The output columns are split over the threads, or at
    prefill whole jobs (:func:`_job_shares`); the bits are those of the order above, whatever
    the split and the thread count.

    Args:
        x: ``[M, Ktot]`` (``[Ktot, M]`` stored when x_transposed), float32/float16/bfloat16/float64.
        weight: ``[G, Ktot, N]`` (``[G, N, Ktot]`` stored when weight_transposed), x's dtype.
        bias: ``[G, N]`` (float16 with float16 x, float32 otherwise; float64 with float64 x) or None.
        jobs: ``[J, 6]`` int64 rows ``(g, k_first, k_stop, row_first, row_stop, o)``: output
            rows ``row_first .. row_stop - 1`` of ``out[o]`` from weight g over k in
            ``[k_first, k_stop)`` (x's columns and the weight's K axis alike); rows >= 1.
        out: ``[O, M, N]``, x's dtype, written in the jobs' rows only.
    """
    if len(jobs) == 0:
        return
    cdt = compute_dtype(x)
    columns = out.shape[2]
    source, kind = carrier(x)
    weight, weight_transposed = _contiguous_weight(weight, weight_transposed)
    stored, _ = carrier(weight)
    target, _ = carrier(out)
    bias_rows, bias_kind = (None, NATIVE) if bias is None else carrier(bias)
    column_block, k_tile = _TILES[bool(weight_transposed)]
    vectors = np.zeros(len(jobs), np.int64)
    pieces = np.ones(len(jobs), np.int64)
    if weight_transposed and (kind == BFLOAT16 or stored.dtype == np.float32):  # the rows in lanes
        in_lanes = jobs[:, 4] - jobs[:, 3] > (BFLOAT16_TILE_ROWS if kind == BFLOAT16 else 0)
        jobs, pieces = _in_pieces(jobs, ROW_LANE_ROWS)
        job_rows = jobs[:, 4] - jobs[:, 3]
        vectors = np.where(np.repeat(in_lanes, pieces), -(-job_rows // ROW_LANES), 0)
    rows, depth = _job_extent(jobs)
    first_slot = np.cumsum(vectors) - vectors  # of each job in one array of every job's lanes
    lanes_per_column = ROW_LANES * int(vectors.max(initial=0))

    def products(job_first: int, job_stop: int, first: int, stop: int, slots: np.ndarray, xt: np.ndarray) -> None:
        """The jobs ``[job_first, job_stop)`` over the output columns ``[first, stop)``, their
        rows in lanes in ``xt`` from ``slots`` (-1: none)."""
        _loops()._few_rows_products(
            source,
            kind,
            bool(x_transposed),
            stored,
            bool(weight_transposed),
            bias_rows,
            bias_kind,
            jobs[job_first:job_stop],
            target,
            first,
            stop,
            np.empty((rows, depth), cdt),
            np.empty((rows, column_block), cdt),
            np.empty((k_tile, column_block), cdt),
            slots,
            xt,
            np.empty((stop - first) * lanes_per_column + LANE_SQUARE, np.float32),
        )

    shares = _job_shares(jobs, pieces, columns * weight.itemsize)
    if shares is None:  # the columns over the threads, every job's rows in lanes first
        slots = np.where(vectors > 0, first_slot, -1)
        # (megabytes at prefill: from the recycled outputs' pool in a session, no fresh pages a call)
        xt = buffers.empty((int(vectors.sum()), depth, ROW_LANES), np.float32)
        if len(xt):
            _rows_into_lanes(source, kind, bool(x_transposed), jobs, slots, xt, vectors)
        _over_column_shares(
            lambda first, stop: products(0, len(jobs), first, stop, slots, xt), jobs, columns, weight.itemsize
        )
        return

    # a share's rows in lanes in one of a few arrays, one a thread at a time: not the whole x
    # transposed at once (at T = 2048 as large as x), and the memory stays in the caches
    share_vectors = max(int(vectors[first:stop].sum()) for first, stop in shares)
    lane_arrays: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
    for _ in range(min(workers(), len(shares))):
        lane_arrays.put(buffers.empty((share_vectors, depth, ROW_LANES), np.float32))

    def share_of_jobs(first: int, stop: int) -> None:
        for job_first, job_stop in shares[first:stop]:
            part = slice(job_first, job_stop)
            xt = lane_arrays.get()
            try:
                slots = np.where(vectors[part] > 0, first_slot[part] - first_slot[job_first], -1)
                if share_vectors:
                    _loops()._rows_in_lanes(source, kind, bool(x_transposed), jobs[part], slots, xt)
                for column in range(0, columns, _JOB_SHARE_COLUMNS):  # (the running sums stay in L2)
                    products(job_first, job_stop, column, min(column + _JOB_SHARE_COLUMNS, columns), slots, xt)
            finally:
                lane_arrays.put(xt)

    run_ranges(share_of_jobs, range(len(shares) + 1))


def _job_shares(jobs: np.ndarray, pieces: np.ndarray, column_bytes: int) -> list[tuple[int, int]] | None:
    """Ranges ``(first, stop)`` of ``jobs`` rows ``(g, k0, k1, r0, r1, o)`` for the threads to
    take whole, every output column each, the biggest (rows x depth) first; or None when the
    columns are to be split instead: fewer than _JOBS_PER_WORKER jobs a worker, one worker,
    too little weight for a second thread, or one of the caller's jobs more work than a
    thread's part (its thread would work alone at the end). A range starts where one of the caller's jobs
    starts: ``pieces [J0]`` is how many rows of ``jobs`` each of them became (its pieces
    share a weight block, read once from memory by one thread)."""
    threads = workers()
    weight_bytes = _weight_bytes(jobs, column_bytes)
    if threads <= 1 or len(pieces) < _JOBS_PER_WORKER * threads or weight_bytes < 2 * _PARALLEL_MIN_WEIGHT_BYTES:
        return None
    work = (jobs[:, 4] - jobs[:, 3]) * (jobs[:, 2] - jobs[:, 1])
    starts = np.cumsum(pieces) - pieces  # the rows of jobs where a caller's job starts
    done = np.cumsum(work)[starts + pieces - 1]  # the work up to the end of each caller's job
    if np.diff(done, prepend=0).max() * threads > done[-1]:  # one job over a thread's part: columns
        return None
    parts = min(len(pieces), _JOB_SHARES_PER_WORKER * threads)
    # a share ends with the caller's job in which one of the parts' equal marks of work falls
    last = np.unique(np.searchsorted(done, np.arange(1, parts) * (done[-1] / parts), side="left"))
    bounds = [0, *starts[last[last < len(pieces) - 1] + 1].tolist(), len(jobs)]
    shares = list(zip(bounds[:-1], bounds[1:]))
    return sorted(shares, key=lambda share: -int(work[share[0] : share[1]].sum()))  # stable: ties in order


def _rows_into_lanes(
    x: np.ndarray,
    kind: int,
    x_transposed: bool,
    jobs: np.ndarray,
    slots: np.ndarray,
    xt: np.ndarray,
    vectors: np.ndarray,
) -> None:
    """Fill ``xt`` with the lane jobs' rows (fused_loops._rows_in_lanes), the jobs split over
    the threads in ranges of equal vectors when xt holds a megabyte or more (each slot is one
    job's alone: the split changes no value). One thread took 1.3 ms of the qwen3-like T =
    512 gate/up product's 24 before the threads shared it."""
    parts = min(2 * workers(), max(1, xt.nbytes // _PARALLEL_MIN_WEIGHT_BYTES))

    def transpose(first: int, stop: int) -> None:
        _loops()._rows_in_lanes(x, kind, x_transposed, jobs[first:stop], slots[first:stop], xt)

    if parts <= 1:
        transpose(0, len(jobs))
        return
    done = np.cumsum(vectors)
    bounds = np.searchsorted(done, np.linspace(0, done[-1], parts + 1), side="left")
    bounds[0], bounds[-1] = 0, len(jobs)
    run_ranges(transpose, np.unique(bounds))


def stored_as_rows(weight: np.ndarray, transposed: bool) -> bool:
    """Whether the matrices W (``weight``, or its last two axes swapped when ``transposed``)
    lie in memory as C-contiguous ``[..., N, K]``: each output column's weights one run."""
    return (weight if transposed else np.swapaxes(weight, -1, -2)).flags.c_contiguous


def lane_dot_products(
    x: np.ndarray,
    x_transposed: bool,
    weight_rows: np.ndarray,
    bias: np.ndarray | None,
    jobs: np.ndarray,
    out: np.ndarray,
) -> None:
    """``out[o, r, n] = round(dot(X[r, k0:k1], W[g, k0:k1, n]) + bias[g, n])`` for the rows r of
    each job, a dot product being 16 float32 partial sums (lane j: the products with
    ``k - k0 = j mod 16``, k in increasing order, each product rounded before it is added, no
    fused multiply-add) added as a fixed tree (lanes j and j + 8, then + 4, + 2, + 1), then the
    last ``(k1 - k0) mod 16`` products in k order, then the bias, rounded once to nearest even.
    The output columns are split over the threads; the bits are those of this order, whatever
    the split, the thread count and the group's row count.

    Args:
        x: ``[M, Ktot]`` (``[Ktot, M]`` stored when x_transposed), float32 or bfloat16.
        weight_rows: ``[G, N, Ktot]`` C-contiguous (W[g] transposed: :func:`stored_as_rows`), x's dtype.
        bias: ``[G, N]`` float32, or None.
        jobs: ``[J, 6]`` int64 rows ``(g, k_first, k_stop, row_first, row_stop, o)``: output
            rows ``row_first .. row_stop - 1`` of ``out[o]`` from weight g over k in
            ``[k_first, k_stop)``; rows >= 1.
        out: ``[O, M, N]``, x's dtype, written in the jobs' rows only.
    """
    if len(jobs) == 0:
        return
    assert weight_rows.flags.c_contiguous
    columns = out.shape[2]
    source, kind = carrier(x)
    stored, _ = carrier(weight_rows)
    target, _ = carrier(out)
    bias_rows, bias_kind = (None, NATIVE) if bias is None else carrier(bias)
    rows, depth = _job_extent(jobs)
    bounds = column_share_bounds(jobs, columns, weight_rows.itemsize)
    if _as_compiled_call(source, kind, bool(x_transposed), stored, bias_rows, jobs, target, rows, depth, bounds):
        return

    def work(first: int, stop: int) -> None:
        _loops()._lane_dot_products(
            source,
            kind,
            bool(x_transposed),
            stored,
            bias_rows,
            bias_kind,
            jobs,
            target,
            first,
            stop,
            np.empty((rows, depth), np.float32),
            np.empty((4, 4), np.float32),
        )

    run_ranges(work, bounds)


def serve_compiled_calls() -> None:
    """The helpers' compiled server, compiled (or loaded from numba's cache) and registered
    with :mod:`.parallel` (once a process): before any compiled call is posted."""
    _loops().serve_compiled_lane_dots()


def _as_compiled_call(x, kind, x_transposed, weight_rows, bias, jobs, out, rows, depth, bounds) -> bool:
    """Run :func:`lane_dot_products`' shares as one compiled call (:func:`.parallel.run_compiled`:
    the helpers take them without the GIL); False when it cannot (:func:`lane_dot_call`, or
    the helpers busy)."""
    call = lane_dot_call(x, kind, x_transposed, weight_rows, bias, jobs, out, rows, depth, bounds)
    return call is not None and run_compiled(call.descriptor, call.parts)


@dataclass(frozen=True)
class LaneDotCall:
    """A lane dot call as the compiled loops read it (``fused_loops._D_*``): the descriptor of
    addresses and sizes, and the arrays it points to that nobody else holds (the scratch)."""

    descriptor: np.ndarray  # int64 [_D_BOUNDS + parts + 1]
    parts: int
    scratch: tuple[np.ndarray, ...]


def lane_dot_call(x, kind, x_transposed, weight_rows, bias, jobs, out, rows, depth, bounds) -> LaneDotCall | None:
    """The compiled call of :func:`lane_dot_products`' shares ``bounds`` (its carriers, jobs,
    scratch extent); None when it cannot be one (C-contiguous float32 or bfloat16 arrays only,
    a float32 bias, more than one share and at most what a descriptor holds)."""
    loops, parts = _loops(), len(bounds) - 1
    if (
        parts <= 1
        or loops._D_BOUNDS + parts + 1 > DESCRIPTOR_SLOTS
        or kind not in (NATIVE, BFLOAT16)
        or not (x.flags.c_contiguous and out.flags.c_contiguous and jobs.flags.c_contiguous)
        or (bias is not None and (bias.dtype != np.float32 or not bias.flags.c_contiguous))
    ):
        return None
    serve_compiled_calls()
    seats = min(workers(), parts)
    xs, sums = np.empty((seats, rows, depth), np.float32), np.empty((seats, 4, 4), np.float32)
    g, n, k = weight_rows.shape
    descriptor = np.array(
        [
            int(kind == BFLOAT16),
            x.ctypes.data,
            *x.shape,
            int(x_transposed),
            weight_rows.ctypes.data,
            g,
            n,
            k,
            0 if bias is None else bias.ctypes.data,
            jobs.ctypes.data,
            len(jobs),
            out.ctypes.data,
            out.shape[0],
            out.shape[1],
            xs.ctypes.data,
            seats,
            rows,
            depth,
            sums.ctypes.data,
            parts,
            *bounds,
        ],
        np.int64,
    )
    assert len(descriptor) == loops._D_BOUNDS + parts + 1
    return LaneDotCall(descriptor, parts, (xs, sums))
