"""GroupedMatmul: one matrix product per expert over that expert's rows (SPEC-layer 1.9).

The single-tensor node (every call site found; ``GroupedMatmulList`` is not built: the
torch_npu alias maps list arguments onto this node). ``X`` is ``x``, or ``x.T`` when
``transpose_x``; ``W`` is ``weight``, or ``weight`` with its last two axes swapped when
``transpose_weight`` (the weight is then stored ``[E, N, K]``: a transposed view on the NPU).

``group_list [E]`` int64 gives the groups: per-group counts (``group_list_type`` 1) or their
cumsum (0, the default); ``cnt = group_list if type 1 else diff([0] + group_list)``,
``off = [0] + cumsum(cnt)``. Group e owns rows ``off[e] .. off[e+1]-1`` (type 0) or columns
of ``X`` / rows of ``W`` ``off[e] .. off[e+1]-1`` (type 2)::

    group_type 0 (split M):  y[off[e]:off[e+1]] = X[off[e]:off[e+1]] @ W[e] + bias[e]
                             X [M, K], W [E, K, N], bias [E, N], y [M, N]
                             rows >= off[E]: the NPU leaves them unwritten; here they are 0
    group_type 2 (split K):  y[e] = X[:, off[e]:off[e+1]] @ W[off[e]:off[e+1]]
                             X [M, Ktot], W [Ktot, N], y [E, M, N]; no bias; empty group: 0
    group_type -1:           y = X @ W + bias, X [M, K], W [K, N], bias [N]; no group_list

``sum(cnt)`` may be below M (type 0) or Ktot (type 2): aclnn says "<=" and leaves the rest
alone (the torch doc says "=="; SPEC-layer 1.9 contradiction 1). Products accumulate in
float32 (float64 for float64 input to the bare kernel), then bias is added in float32 and
the result rounded once to nearest even. The bias is float16 with float16 x, float32 otherwise.

Three product paths, chosen per group by its row count (for types 2 and -1 the count is M),
by how the weight lies in memory and, for 65-96 float16 rows, by the size of the group's matrix:

* groups of 1 to ``LANE_DOT_ROWS`` = 8 float32/bfloat16 rows against a weight stored
  ``[N, K]`` (the checkpoint layout: ``transpose_weight`` on C-contiguous storage;
  :func:`row_dots`) go to :func:`.fused.lane_dot_products`: dot products over contiguous
  weight rows, each 16 float32 lane sums (k mod 16, k in order) added in a fixed tree, then
  the last K mod 16 products in order, the output columns split over the threads (decode:
  each hit expert's weights stream through once; one thread's time / OpenBLAS's GEMV for
  single float32 rows 0.49-0.93, / the fused few-rows kernel's for 2-8 rows 0.59-1.08);
* other float32 and bfloat16 groups of any size against a weight stored ``[N, K]``, float16
  groups of 2 to ``FEW_ROWS_AGAINST_ROWS`` = 64 rows against one (2 to
  ``FEW_ROWS_AGAINST_LARGE`` = 96 when the group's matrix has at least ``LARGE_WEIGHT`` = 2^20
  elements), groups of 2 to ``FEW_ROWS`` = 32 rows against one stored ``[K, N]`` (and
  float16/bfloat16 single rows; :func:`few_rows`) go to :func:`.fused.few_rows_products`, a
  fixed-order kernel: each output element is one float32 chain of fused multiply-adds over k
  in increasing order, the output columns the vector lanes (for float32 rows against ``[N,
  K]``, and bfloat16 groups of more than 64 rows, the group's rows, in pieces of up to 64: the
  weight is then read where it lies, not transposed, a bfloat16 element widened where it is
  broadcast; the same sums)
  and split over the threads (the output columns, or at prefill, with at least 4 groups a
  thread, 2 MiB of weights and no group over a thread's part of the work, whole groups:
  :func:`.fused.few_rows_products`);
* the other groups go to BLAS (numpy's matmul, float16/bfloat16 widened exactly first: a
  float32 copy of each such expert's weight; bfloat16 only against a weight stored ``[K, N]``) in
  blocks of at most ``BLOCK_ROWS`` rows, each one single-threaded call (:mod:`.blas`),
  handed to the threads as they come free, the biggest first.

The lane dots round each product before adding it (they stream weights: memory-bound); the
few-rows kernel's float32 sums take each product by a fused multiply-add, rounded once (its
groups are compute-bound: BLAS's own kernels fuse too; float64, the bare kernel's reference
type, rounds the product, then adds). Both widen float16/bfloat16 exactly as they are read, a
cache-sized piece at a time (never a float32 copy of a weight). So **a row's bits depend on
which path its group takes** (the same row in a group of 64 and of 65 float16 rows against an
[N, K] weight, 96 and 97 against a large one, 32 and 33 against [K, N], or 8 and 9
float32/bfloat16 rows against [N, K], or
against an [N, K] and a [K, N] weight, may differ in the last bits; all are float32
accumulations of the same terms), never on the thread count or the run, nor, within one path,
on the group's size. Deterministic: same inputs, same bits.

``split_item`` 2/3 (one output tensor; 0/1, one tensor per group, are the alias's split of
this one). ``output_dtype`` (an ONNX element type) may only name x's dtype; ``group_type`` 1
(split N) does not exist for one tensor; ``group_list_type`` 2 (``[E, 2]`` index/size pairs,
quantised int8 only on the NPU) is refused.
"""

from __future__ import annotations

import numpy as np

from . import blas, buffers, dtypes, fused
from .errors import BAD_DTYPE, MISSING_INPUT, MoeOpError
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature
from .parallel import run_ranges
from .targets import Target, known_dim

GROUP_TYPES = (-1, 0, 2)
#: the NPU's limits (op-plugin's npu_grouped_matmul doc): groups of one weight tensor, last dims
MAX_GROUPS = 1024
INNER_LIMIT = 65536


def group_offsets(group_list: np.ndarray, group_list_type: int, limit: int, what: str) -> np.ndarray:
    """``off [E + 1]`` int64 from ``group_list`` (cumsum for type 0, counts for type 1), checked:
    counts non-negative, the cumsum non-decreasing, ``off[E] <= limit``."""
    values = group_list.astype(np.int64)
    if group_list_type == 1:
        bad = np.flatnonzero((values < 0) | (values > limit))
        if len(bad):
            e = int(bad[0])
            raise MoeOpError(
                f"group_list (counts, group_list_type 1) must be in [0, {limit}] ({what}), got {values[e]} at {e}"
            )
        ends = np.cumsum(values)
    else:
        ends = values
        # compared, not differenced: a difference of two huge values wraps around in int64
        bad = np.flatnonzero(ends < np.concatenate([[0], ends[:-1]]))
        if len(bad):
            e = int(bad[0])
            before = 0 if e == 0 else int(ends[e - 1])
            raise MoeOpError(
                f"group_list (cumsum, group_list_type 0) must not decrease and start at >= 0: "
                f"group_list[{e}] = {ends[e]} after {before}"
            )
    total = int(ends[-1]) if len(ends) else 0
    if total > limit:
        raise MoeOpError(f"the groups cover {total} {what}, more than the {limit} there are (sum of counts <= {limit})")
    return np.concatenate([[0], ends]).astype(np.int64)


#: rows of one product block: each block is one single-threaded BLAS call (see :mod:`.blas`)
BLOCK_ROWS = 512
#: multiply-adds below which a call stays on the calling thread (at decode, a row or two per
#: expert, a call reads megabytes of weights for fewer: counting the weight read as 8 rows of
#: work put those calls on both cores, 1.04x -> 1.33x onnxruntime's MoE at T = 1 on the loaded
#: 2-core machine, where a second thread waits for a core: not taken)
_PARALLEL_MIN_MACS = 1 << 24


_BFLOAT16 = dtypes.numpy_dtype("bfloat16")
_ROW_DOT_DTYPES = (np.dtype(np.float32), _BFLOAT16)

#: groups of at most this many rows against a weight stored [K, N] are multiplied by
#: :func:`.fused.few_rows_products` (a fixed-order chain of fused multiply-adds per element in
#: vector lanes over the output columns, both cores on the columns) instead of BLAS, whose
#: sgemm packs the whole weight first. Kernel / BLAS time per expert product measured here
#: (docs/bench.md, "seventh step", 4 experts, [N, K] = [2048, 1024], [1536, 2048], [1024, 768],
#: [384, 512]), float32 [K, N]: 32 rows 0.82-1.02, 64 rows 1.07-1.39
FEW_ROWS = 32
#: ... and against a weight stored [N, K] (the checkpoint layout: the kernel's tiles are
#: transposed squares of it), where it gains further: float32 32 rows 0.66-0.76, 64 rows
#: 0.82-0.92, 96 rows 0.91-1.05, 128 rows 0.97-1.05; bfloat16 32 rows 0.44-0.83, 64 rows
#: 0.64-1.26 (1.26 the smallest weight, which BLAS widens fastest). Since the thirteenth step
#: for float16 only: float32 and bfloat16 groups of any size take the kernel (below)
FEW_ROWS_AGAINST_ROWS = 64
#: ... and of at most this many rows against a weight matrix stored [N, K] of at least
#: LARGE_WEIGHT elements, whose packing costs BLAS more. Kernel / BLAS time per product, 8-64
#: experts from memory, 2 threads (docs/bench.md, "eighth step"): float32 [N, K] of 1-3M
#: elements ([1024, 1024] to [1536, 2048]) 80 rows 0.87-0.89, 96 rows 0.95-0.98, 112 rows
#: 0.95-1.04; bfloat16 96 rows 0.77-1.02; smaller ones lose past 64 rows or sooner ([384, 512]
#: 64 rows 1.12, [1024, 256] 1.05, [2048, 384] 96 rows 1.01, bfloat16 1.20). The deepseek-like
#: layer at T = 512 (groups of 45-82 rows, half of them over 64): 223 -> 204 ms
FEW_ROWS_AGAINST_LARGE = 96
LARGE_WEIGHT = 1 << 20
# float32 groups of any size against a weight stored [N, K] go to the kernel too: their rows
# are its vector lanes (:data:`.fused.ROW_LANE_ROWS`), no tile transposed; so do bfloat16 groups
# (over :data:`.fused.BFLOAT16_TILE_ROWS` rows in the lanes: lanes / BLAS, which widened a
# float32 copy of each weight first, 0.65-0.79 at 256-512 rows). Up to the thirteenth
# step they went to BLAS past 80 rows (192 against LARGE_WEIGHT elements or more), where on a
# machine whose OpenBLAS ran its AVX-512 kernels the kernel / BLAS time per product was 0.99-1.05
# at 256 rows and 1.05 at 384 (docs/bench.md, "twelfth step"). On one that OpenBLAS reads as
# Haswell (AVX2 kernels, a Zen 5 here; the few-rows kernel is compiled for the machine it runs
# on) it is 0.65-0.95 at every size measured, 128-2048 rows against [384, 512] to [2048, 1024]
# with 2-64 experts (docs/bench.md, "thirteenth step"), and the layer at T = 2048 took 0.67-0.72x
# the time. One path for every size also keeps a row's bits off the BLAS build and its CPU
# detection, and off the group's size.
#: groups of at most this many float32/bfloat16 rows against a weight stored [N, K] are dot
#: products in lanes (:func:`.fused.lane_dot_products`) instead: no tile transposed. Its time /
#: the (fused) few-rows kernel's, 2 threads, 16 experts, six [N, K] shapes from [384, 512] to
#: [1536, 2048], float32 and bfloat16 (docs/bench.md, "seventh step"): 2 rows 0.59-0.93, 4 rows
#: 0.61-0.96, 6 rows 0.73-1.00, 8 rows 0.79-1.08, 12 rows 0.96-1.16; with the lane dots'
#: prefetch (docs/bench.md, "eighth step"; float32, 8-128 experts from memory, six shapes from
#: [384, 512] to [2048, 1024]): 6 rows 0.82-1.01, 8 rows 0.90-1.07, 12 rows 0.96-1.28
LANE_DOT_ROWS = 8


def few_rows(rows: int, dtype: np.dtype, stored_as_rows: bool, weight_elements: int = 0) -> bool:
    """Whether a group of ``rows`` rows (of x's ``dtype``) goes to the fixed-order kernel:
    1 to FEW_ROWS_AGAINST_ROWS rows against a weight stored ``[N, K]`` (``stored_as_rows``),
    1 to FEW_ROWS_AGAINST_LARGE against one of at least LARGE_WEIGHT elements (the matrix the
    group multiplies by, ``weight_elements`` = N * its K), for float32 and bfloat16 any number
    instead, 1 to FEW_ROWS against ``[K, N]``, except a
    float32/float64 single row, which stays on BLAS (its GEMV reads the weight once at the
    memory rate: the kernel measured 1.2-4.0x its time there on 7 of 8 shapes and layouts,
    0.75 on the eighth; float16 and bfloat16 single rows gain most, 0.21-0.72x, for BLAS first
    widens the whole weight)."""
    if rows == 1 and dtype in (np.float32, np.float64):
        return False
    if not stored_as_rows:
        return 1 <= rows <= FEW_ROWS
    if dtype in _ROW_DOT_DTYPES:  # float32 and bfloat16: the rows in lanes
        return rows >= 1
    most = FEW_ROWS_AGAINST_LARGE if weight_elements >= LARGE_WEIGHT else FEW_ROWS_AGAINST_ROWS
    return 1 <= rows <= most


def row_dots(rows: int, dtype: np.dtype, stored_as_rows: bool) -> bool:
    """Whether a group of ``rows`` rows goes to :func:`.fused.lane_dot_products`: 1 to
    LANE_DOT_ROWS float32 or bfloat16 rows against a weight stored ``[N, K]`` (the checkpoint
    layout, :func:`.fused.stored_as_rows`), whose dot products stream each weight row once."""
    return 1 <= rows <= LANE_DOT_ROWS and stored_as_rows and dtype in _ROW_DOT_DTYPES


def _wide(array: np.ndarray, cdt: np.dtype) -> np.ndarray:
    """``array`` as the compute type (itself when it already is; exact for float16/bfloat16),
    laid out as ``astype`` lays it out (a transposed view stays one: BLAS takes the same path)."""
    if array.dtype == cdt:
        return array
    if array.dtype == _BFLOAT16 and cdt == np.float32:
        if array.flags.c_contiguous:
            return _bfloat16_bits_widened(array)
        if array.T.flags.c_contiguous:
            return _bfloat16_bits_widened(array.T).T
    return array.astype(cdt)


def _bfloat16_bits_widened(array: np.ndarray) -> np.ndarray:
    """A C-contiguous bfloat16 array as float32: its 16 bits become the high half of each
    float32 (what the cast is, NaN payloads included), one numpy pass (1.6x ml_dtypes' cast)."""
    wide = np.empty(array.shape, np.uint32)
    np.left_shift(array.view(np.uint16), 16, out=wide, dtype=np.uint32)
    return wide.view(np.float32)


def _run_products(blocks: list[tuple], cdt: np.dtype) -> None:
    """``out[...] = round(a @ w + bias)`` for each block ``(out, a, w, bias, key)``: accumulated
    in ``cdt`` by BLAS on one thread, the bias added in ``cdt``, rounded once. The blocks are
    handed out one share at a time to the threads, the biggest shares first (a share: one
    block, or where the weight must be widened first, one key's consecutive blocks, so a
    thread widens each weight once); which thread runs a block never changes its bits (each
    is one single-threaded BLAS call)."""
    shares = _shares(blocks, widened=any(b[2].dtype != cdt for b in blocks))
    ordered = [block for share in shares for block in share]
    bounds = np.cumsum([0] + [len(share) for share in shares])

    def work(first: int, stop: int) -> None:
        key: int | None = None
        wide_weight = np.empty(0, cdt)
        for out, a, w, bias, block_key in ordered[first:stop]:
            if block_key != key:
                key, wide_weight = block_key, _wide(w, cdt)
            if out.dtype == cdt:
                product = np.matmul(a, wide_weight, out=out)
            else:
                product = np.matmul(_wide(a, cdt), wide_weight)
            if bias is not None:
                product += _wide(bias, cdt)
            if product is not out:
                out[...] = product  # rounds to nearest even (numpy / ml_dtypes casts)

    with blas.single_threaded():
        if sum(map(_macs, blocks)) < _PARALLEL_MIN_MACS:
            work(0, len(ordered))
        else:
            run_ranges(work, bounds)


def _shares(blocks: list[tuple], widened: bool) -> list[list[tuple]]:
    """The blocks in the shares the threads take, biggest (multiply-adds) first, ties in the
    blocks' order: each block alone, or with ``widened`` a key's consecutive blocks together.
    Handed out as the threads come free, biggest first, the shares end within about one small
    share of each other: two equal contiguous halves of ~128-row groups split 5 : 3 at the
    mixtral-like T = 512 (8 experts), 27.7 -> 22.5 ms for its up product (docs/bench.md)."""
    shares: list[list[tuple]] = []
    for block in blocks:
        if widened and shares and shares[-1][-1][4] == block[4]:
            shares[-1].append(block)
        else:
            shares.append([block])
    return sorted(shares, key=lambda share: -sum(map(_macs, share)))  # stable: ties keep their order


def _macs(block: tuple) -> int:
    """The multiply-adds of a block ``(out, a [M, K], w [K, N], bias, key)``: M * K * N."""
    return block[1].shape[0] * block[1].shape[1] * block[2].shape[1]


def _row_blocks(out, a, w, bias, key, first: int, stop: int) -> list[tuple]:
    """The blocks of ``out[first:stop] = a[first:stop] @ w + bias``, BLOCK_ROWS rows each."""
    return [
        (out[m : min(m + BLOCK_ROWS, stop)], a[m : min(m + BLOCK_ROWS, stop)], w, bias, key)
        for m in range(first, stop, BLOCK_ROWS)
    ]


def grouped_matmul(
    x,
    weight,
    bias=None,
    group_list=None,
    *,
    group_type,
    group_list_type=0,
    split_item=3,
    transpose_weight=0,
    transpose_x=0,
    output_dtype=None,
):
    """Per-group matrix products (see the module doc for the three group types).

    Args:
        x: ``[M, K]`` (``[K, M]`` with transpose_x); float32/float16/bfloat16 (float64: bare).
        weight: ``[E, K, N]`` (type 0), ``[Ktot, N]`` (type 2), ``[K, N]`` (type -1); the last
            two axes swapped with transpose_weight; x's dtype.
        bias: ``[E, N]`` (type 0) or ``[N]`` (type -1); float16 with float16 x, else float32.
        group_list: ``[E]`` int64, cumsum (type 0) or counts (type 1) of the grouped axis.
    Returns:
        ``(y,)``: ``[M, N]`` (types 0, -1) or ``[E, M, N]`` (type 2), x's dtype.
    """
    a = x.T if transpose_x else x
    w = np.swapaxes(weight, -1, -2) if transpose_weight else weight
    cdt = np.dtype(np.float64 if x.dtype == np.float64 else np.float32)
    rows, inner = a.shape
    blocks: list[tuple] = []
    jobs: list[tuple[int, int, int, int, int, int]] = []  # few_rows_products' (g, k0, k1, r0, r1, o)
    dots: list[tuple[int, int, int, int, int, int]] = []  # lane_dot_products' jobs, the same columns
    as_rows = fused.stored_as_rows(weight, bool(transpose_weight))

    def kernel_jobs(rows: int, depth: int) -> list | None:
        """Which fixed-order kernel's jobs a group of ``rows`` rows over ``depth`` of k joins
        (None: BLAS)."""
        if row_dots(rows, x.dtype, as_rows):
            return dots
        return jobs if few_rows(rows, x.dtype, as_rows, depth * w.shape[-1]) else None

    if group_type == -1:
        y = buffers.empty((rows, w.shape[-1]), x.dtype)
        if (taken := kernel_jobs(rows, inner)) is not None:
            taken.append((0, 0, inner, 0, rows, 0))
        else:
            blocks = _row_blocks(y, a, w, bias, 0, 0, rows)
    elif group_type == 0:
        offsets = group_offsets(group_list, group_list_type, rows, "rows of x (group_type 0)")
        y = buffers.empty((rows, w.shape[-1]), x.dtype)
        bounds = offsets.tolist()
        for e in np.flatnonzero(np.diff(offsets)).tolist():  # the groups with rows (decode: few of E)
            first, stop = bounds[e], bounds[e + 1]
            if (taken := kernel_jobs(stop - first, inner)) is not None:
                taken.append((e, 0, inner, first, stop, 0))
            else:
                blocks += _row_blocks(y, a, w[e], None if bias is None else bias[e], e, first, stop)
        y[int(offsets[-1]) :] = 0
    else:
        offsets = group_offsets(group_list, group_list_type, inner, "columns of x (group_type 2)")
        y = buffers.empty((len(offsets) - 1, rows, w.shape[-1]), x.dtype)
        sizes, bounds = np.diff(offsets), offsets.tolist()
        y[sizes == 0] = 0
        for e in np.flatnonzero(sizes).tolist():
            first, stop = bounds[e], bounds[e + 1]
            if (taken := kernel_jobs(rows, stop - first)) is not None:
                taken.append((0, first, stop, 0, rows, e))
            else:
                blocks += _row_blocks(y[e], a[:, first:stop], w[first:stop], None, e, 0, rows)
    if jobs or dots:
        stored_weight, grouped_bias, out = weight, bias, y
        if group_type != 0:  # one weight (and bias): as group 0 of a stack of one
            stored_weight, grouped_bias = weight[None], None if bias is None else bias[None]
        if group_type != 2:  # one output matrix
            out = y[None]
        if jobs:
            fused.few_rows_products(
                x, bool(transpose_x), stored_weight, bool(transpose_weight), grouped_bias, np.array(jobs, np.int64), out
            )
        if dots:
            weight_rows = stored_weight if transpose_weight else np.swapaxes(stored_weight, -1, -2)
            fused.lane_dot_products(x, bool(transpose_x), weight_rows, grouped_bias, np.array(dots, np.int64), out)
    if blocks:
        _run_products(blocks, cdt)
    return (y,)


def _stored(sig: Signature, name: str, transposed: bool) -> tuple[Dim, Dim]:
    """``(rows, columns)`` of the last two axes of input ``name`` as the math reads them."""
    shape = sig.input(name).shape
    if shape is None or len(shape) < 2:
        return None, None
    last = (shape[-2], shape[-1])
    return (last[1], last[0]) if transposed else last


def _infer(sig: Signature) -> None:
    x, weight = sig.input("x"), sig.input("weight")
    group_type, list_type = sig.attr("group_type"), sig.attr("group_list_type")
    sig.require(group_type != 1, "group_type 1 (split N) is not defined for the single-tensor GroupedMatmul")
    sig.require(group_type in GROUP_TYPES, f"group_type must be -1, 0 or 2, got {group_type}")
    if list_type == 2:
        sig.fail(
            "group_list_type 2 ([E, 2] group index / size pairs; quantised int8 only on the NPU) is not supported",
            BAD_DTYPE,
        )
    sig.require(list_type in (0, 1), f"group_list_type must be 0 (cumsum) or 1 (counts), got {list_type}")
    split_item = sig.attr("split_item")
    sig.require(0 <= split_item <= 3, f"split_item must be in 0..3, got {split_item}")
    sig.require(
        split_item in (2, 3),
        f"split_item {split_item} asks for one output per group; this node returns one tensor "
        "(split_item 2 or 3; the torch_npu alias splits it for 0/1)",
    )
    out_dtype = sig.attr("output_dtype")
    if out_dtype is not None and x.dtype is not None:
        sig.require(
            out_dtype == dtypes.onnx_type(x.dtype),
            f"output_dtype {out_dtype} ({dtypes.name_of_onnx(out_dtype) or 'unknown'}) is not supported: "
            f"only x's dtype ({x.dtype}, {dtypes.onnx_type(x.dtype)})",
            BAD_DTYPE,
        )
    if x.dtype is not None and weight.dtype is not None:
        sig.require(weight.dtype == x.dtype, f"weight must have x's dtype ({x.dtype}), got {weight.dtype}", BAD_DTYPE)
    want_rank = 3 if group_type == 0 else 2
    if weight.shape is not None:
        layout = {0: "[E, K, N]", 2: "[Ktot, N]", -1: "[K, N]"}[group_type]
        sig.require(
            len(weight.shape) == want_rank,
            f"weight must be {layout} for group_type {group_type}, got shape {list(weight.shape)}",
        )
    rows, inner = _stored(sig, "x", sig.attr("transpose_x") == 1)
    weight_inner, columns = _stored(sig, "weight", sig.attr("transpose_weight") == 1)
    sig.same(inner, weight_inner, "the inner (K) dims of x and weight must agree")

    has_list = sig.has("group_list")
    if group_type == -1:
        sig.require(not has_list, "group_type -1 takes no group_list (one product)")
    else:
        sig.require(has_list, f"group_type {group_type} needs group_list", MISSING_INPUT)
    groups = sig.dim("group_list", 0)
    if group_type == 0:
        sig.same(groups, sig.dim("weight", 0), "len(group_list) must equal E = weight dim 0")
    if sig.has("bias"):
        sig.require(group_type != 2, "group_type 2 (split K) takes no bias")
        want_bias = "float16" if x.dtype == "float16" else "float32"
        bias = sig.input("bias")
        if x.dtype is not None and bias.dtype is not None:
            sig.require(
                bias.dtype == want_bias, f"bias must be {want_bias} with {x.dtype} x, got {bias.dtype}", BAD_DTYPE
            )
        if bias.shape is not None:
            want = (sig.dim("weight", 0), columns) if group_type == 0 else (columns,)
            sig.require(
                len(bias.shape) == len(want),
                f"bias must be {'[E, N]' if group_type == 0 else '[N]'}, got shape {list(bias.shape)}",
            )
            for axis, dim in enumerate(want):
                sig.same(bias.shape[axis], dim, f"bias must be {'[E, N]' if group_type == 0 else '[N]'}: dim {axis}")
    shape = (groups, rows, columns) if group_type == 2 else (rows, columns)
    sig.output("y", x.dtype, shape)


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    found = []
    groups = known_dim(sig, "group_list", 0)
    if groups is not None and groups > MAX_GROUPS:
        found.append(f"len(group_list) = {groups} exceeds {MAX_GROUPS} groups (one weight tensor)")
    for name in ("x", "weight"):
        shape = sig.input(name).shape
        last = shape[-1] if shape else None
        if isinstance(last, int) and last >= INNER_LIMIT:
            found.append(f"{name}'s last dim {last} is not below the inner-axis limit {INNER_LIMIT}")
    if sig.attr("transpose_x") and sig.attr("group_type") != 2:
        found.append("x is transposed, which the NPU supports only with group_type 2 (split K)")
    return found


#: row 0 times expert 0's weight, rows 1-3 times expert 1's (group_list: the end rows)
_EXAMPLE = Example(
    inputs={
        "x": np.arange(8, dtype=np.float32).reshape(4, 2),
        "weight": np.arange(12, dtype=np.float32).reshape(2, 2, 3),
        "group_list": np.array([1, 4], np.int64),
    },
    attrs={"group_type": 0},
)


GROUPED_MATMUL = OpDef(
    "GroupedMatmul",
    __doc__,
    inputs=[
        Input("x", dtypes.FLOATS, "[M, K] rows (type 0/-1) or [M, Ktot] (type 2); [K, M] with transpose_x", (2,)),
        Input("weight", dtypes.FLOATS, "[E, K, N] (type 0), [Ktot, N] (type 2), [K, N] (type -1)", (2, 3)),
        Input("bias", ("float32", "float16"), "[E, N] (type 0) or [N] (type -1)", (1, 2), optional=True),
        Input("group_list", ("int64",), "[E] cumsum (group_list_type 0) or counts (1)", (1,), optional=True),
    ],
    outputs=[Output("y", dtypes.FLOATS, "[M, N] (type 0/-1) or [E, M, N] (type 2), x's dtype")],
    attrs=[
        Attr("group_type", "int", None, "0 split M, 2 split K, -1 one product", required=True),
        Attr("group_list_type", "int", 0, "0 = group_list is the cumsum, 1 = the counts"),
        Attr("split_item", "int", 3, "2 or 3: one output tensor"),
        Attr("transpose_weight", "int", 0, "1 = weight stored with its last two axes swapped", (0, 1)),
        Attr("transpose_x", "int", 0, "1 = x stored transposed", (0, 1)),
        Attr("output_dtype", "int", None, "ONNX element type of y: absent or x's"),
    ],
    infer=_infer,
    kernel=grouped_matmul,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [GROUPED_MATMUL]
