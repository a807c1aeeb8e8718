"""The numba loops behind :mod:`.fused`: widen a row to the compute type, narrow it back,
and the three row loops. Imported on first use (numba is slow to import)."""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np
from llvmlite import ir as llvm_ir
from numba import carray, njit, types, uint16, uint32
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .fused import BFLOAT16, FLOAT16, LANE_SQUARE, NATIVE, ROW_LANES
from .parallel import (
    CALLER_CPU,
    COMPILED,
    HOLD,
    IDLE,
    INSIDE,
    NEXT,
    ON_CALLERS_CORE,
    OPEN,
    POSTED,
    PYTHON_CALL,
    SEAT,
    register_compiled_server,
)
from .spin import current_cpu, exchange, fetch_add, load_acquire, poll_pause

_ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
#: 16-bit patterns -> float32, exact (numpy's and ml_dtypes' conversions; NaN payloads kept)
_FLOAT16_TO_FLOAT32 = _ALL_BITS.view(np.float16).astype(np.float32)
_BFLOAT16_TO_FLOAT32 = _ALL_BITS.view(ml_dtypes.bfloat16).astype(np.float32)


# --- one row at a time: widen to the compute type, narrow back --------------------------


def _widen(source, target, kind):
    """``target[h] = float(source[h])``: overloaded below for numba."""


def _narrow(source, target, kind):
    """``target[h] = source[h]`` rounded to the target's type: overloaded below for numba."""


@overload(_widen)
def _widen_impl(source, target, kind):
    if isinstance(source.dtype, types.Float):

        def widen_float(source, target, kind):
            _float_to_float(source, target)

        return widen_float

    if target.dtype != types.float32:

        def widen_into_float64(source, target, kind):
            _widen_by_table(source, target, kind)

        return widen_into_float64

    def widen_bits(source, target, kind):
        if kind == BFLOAT16:  # bfloat16 is the top half of a float32: a shift, vectorised
            wide = target.view(np.uint32)
            for h in range(source.shape[0]):
                wide[h] = np.uint32(source[h]) << np.uint32(16)
        else:
            _widen_by_table(source, target, kind)

    return widen_bits


@njit(inline="always")
def _float_to_float(source, target):
    """float32/float64 either way (narrowing rounds to nearest even)."""
    for h in range(source.shape[0]):
        target[h] = source[h]


@njit(inline="always")
def _widen_by_table(source, target, kind):
    table = _BFLOAT16_TO_FLOAT32 if kind == BFLOAT16 else _FLOAT16_TO_FLOAT32
    for h in range(source.shape[0]):
        target[h] = table[source[h]]


@overload(_narrow)
def _narrow_impl(source, target, kind):
    if isinstance(target.dtype, types.Float):

        def narrow_float(source, target, kind):
            _float_to_float(source, target)

        return narrow_float

    def narrow_bits(source, target, kind):  # the source is float32 (see compute_dtype)
        bits = source.view(np.uint32)
        if kind == BFLOAT16:
            for h in range(source.shape[0]):
                target[h] = _float32_to_bfloat16(bits[h])
        else:
            for h in range(source.shape[0]):
                target[h] = _float32_to_float16(bits[h])

    return narrow_bits


def _widen_one(source, h, kind):
    """``float(source[h])`` (``h`` an index or an index tuple): the element itself for
    float32/float64 arrays, its float32 value for float16/bfloat16 bits (exact). Overloaded
    below for numba."""


def _narrow_one(value, target, h, kind):
    """``target[h] = value`` rounded to the target's type (nearest even; a float32 value for
    float16/bfloat16 bits). Overloaded below for numba."""


@overload(_widen_one)
def _widen_one_impl(source, h, kind):
    if isinstance(source.dtype, types.Float):
        return lambda source, h, kind: source[h]

    def widen_bits_one(source, h, kind):
        if kind == BFLOAT16:  # the top half of a float32
            return _int32_as_float32(np.int32(np.uint32(source[h]) << np.uint32(16)))
        return _FLOAT16_TO_FLOAT32[source[h]]

    return widen_bits_one


@overload(_narrow_one)
def _narrow_one_impl(value, target, h, kind):
    if isinstance(target.dtype, types.Float):

        def narrow_float_one(value, target, h, kind):
            target[h] = value

        return narrow_float_one

    def narrow_bits_one(value, target, h, kind):
        bits = np.uint32(_float32_as_int32(value))
        if kind == BFLOAT16:
            target[h] = _float32_to_bfloat16(bits)
        else:
            target[h] = _float32_to_float16(bits)

    return narrow_bits_one


def _bitcast(source, target) -> Any:
    """A numba intrinsic reinterpreting a scalar of numba type ``source`` as ``target`` (same
    width): an LLVM bitcast, no conversion and no memory."""

    def typer(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(target))

        return target(source), codegen

    return intrinsic(typer)


#: the bits of a float32 as an int32, and back; the same for float64 and int64
_float32_as_int32 = _bitcast(types.float32, types.int32)
_int32_as_float32 = _bitcast(types.int32, types.float32)
_float64_as_int64 = _bitcast(types.float64, types.int64)
_int64_as_float64 = _bitcast(types.int64, types.float64)


@njit(inline="always")
def _float32_to_bfloat16(bits):
    """Round-to-nearest-even of float32 ``bits`` to bfloat16 bits; NaN -> quiet NaN, same sign
    (ml_dtypes' rule). The casts keep numba's integer arithmetic in 32 bits (it widens to 64
    otherwise), which lets the loop run twice as many lanes."""
    lowest_kept = uint32(bits >> 16) & uint32(1)
    rounded = uint16(uint32(bits + uint32(0x7FFF) + lowest_kept) >> 16)
    quiet_nan = uint16(uint32(bits >> 16) | uint32(0x7FC0)) & uint16(0xFFC0)
    return quiet_nan if uint32(bits & uint32(0x7FFFFFFF)) > uint32(0x7F800000) else rounded


@njit(inline="always")
def _float32_to_float16(bits):
    """Round-to-nearest-even of float32 ``bits`` to float16 bits (overflow -> inf); NaN keeps
    its sign and the top 10 payload bits, and stays a NaN when those are zero (numpy's rule)."""
    sign = np.uint16((bits >> np.uint32(16)) & np.uint32(0x8000))
    magnitude = bits & np.uint32(0x7FFFFFFF)
    if magnitude > np.uint32(0x7F800000):
        payload = np.uint16((magnitude >> np.uint32(13)) & np.uint32(0x3FF))
        return sign | np.uint16(0x7C00) | (payload if payload else np.uint16(1))
    if magnitude >= np.uint32(0x477FF000):  # rounds to 65520 or more: inf
        return sign | np.uint16(0x7C00)
    if magnitude < np.uint32(0x38800000):  # below float16's smallest normal: a subnormal
        if magnitude < np.uint32(0x33000000):  # at most half the smallest subnormal: zero
            return sign
        exponent = magnitude >> np.uint32(23)
        mantissa = (magnitude & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        shift = np.uint32(126) - exponent  # 14..24: value = mantissa * 2^(exponent - 150)
        half = np.uint32(1) << (shift - np.uint32(1))
        rest = mantissa & ((np.uint32(1) << shift) - np.uint32(1))
        result = mantissa >> shift
        if rest > half or (rest == half and (result & np.uint32(1))):
            result += np.uint32(1)
        return sign | np.uint16(result)
    rounding = np.uint32(0xFFF) + ((magnitude >> np.uint32(13)) & np.uint32(1))
    return sign | np.uint16((magnitude - np.uint32(0x38000000) + rounding) >> np.uint32(13))


@njit(inline="always")
def _dot_into(a, b):
    """``sum_h a[h] * b[h]``, overwriting ``b``: the products, then halving sums (the top half,
    odd element included, is added onto the bottom half until one is left). A fixed order
    that vectorises, and as accurate as pairwise summation."""
    n = b.shape[0]
    if n == 0:
        return a.dtype.type(0)
    for h in range(n):
        b[h] = a[h] * b[h]
    while n > 1:
        half = (n + 1) // 2
        for h in range(n - half):
            b[h] += b[half + h]
        n = half
    return b[0]


# --- the loops ----------------------------------------------------------------------------


@njit(nogil=True, cache=True)
def _segment_sums(rows, kind, index, segment_start, weights, out, first, stop, total, term):
    """``out[s] = sum_{i in segment s} weights[i] * rows[index[i]]`` for s in ``[first, stop)``.

    Args:
        rows: ``[R, H]`` source rows (carrier of ``kind``).
        index: ``[M]`` source row of term i; a negative index is a skipped term.
        segment_start: ``[S + 1]``; segment s is terms ``segment_start[s] .. segment_start[s+1]-1``.
        weights: ``[M]`` factor of term i (compute type), or None for 1.
        out: ``[S, H]`` (carrier of ``kind``); an empty segment gives a row of +0.0.
        total, term: ``[H]`` scratch of the compute type (float32 or float64).
    """
    for s in range(first, stop):
        total[:] = 0
        for i in range(segment_start[s], segment_start[s + 1]):
            row = index[i]
            if row < 0:
                continue
            _widen(rows[row], term, kind)
            if weights is None:
                for h in range(total.shape[0]):
                    total[h] = total[h] + term[h]
            else:
                w = weights[i]
                for h in range(total.shape[0]):
                    total[h] = total[h] + term[h] * w
        _narrow(total, out[s], kind)


@njit(nogil=True, cache=True)
def _copy_rows_to(source, order, start, out, first, stop):
    """``out[order[i]] = source[r]`` for r in ``[first, stop)``, entries in range."""
    for r in range(first, stop):
        for i in range(start[r], start[r + 1]):
            row = order[i]
            if 0 <= row < out.shape[0]:
                for h in range(source.shape[1]):  # an explicit loop: the slice copy is slower
                    out[row, h] = source[r, h]


@njit(nogil=True, cache=True)
def _scaled_rows_and_dots(
    rows, kind, order, start, scale, dot_with, dot_kind, out, dots, first, stop, row, scaled, other
):
    """For each source s in ``[first, stop)`` and each ``d = order[i]``, ``start[s] <= i < start[s+1]``:
    ``out[d] = scale[d] * rows[s]`` and ``dots[d] = sum_h rows[s, h] * dot_with[d, h]``
    (order: see ``_dot_into``).

    Args:
        rows: ``[R, H]``; order, start: the rows fed by each source (:func:`destinations_by_source`).
        scale: ``[N]`` compute type; dot_with: ``[N, H]`` (carrier of ``dot_kind``).
        out: ``[N, H]`` (carrier of ``kind``); dots: ``[N]`` compute type.
        row, scaled, other: ``[H]`` scratch of the compute type.
    """
    for s in range(first, stop):
        _widen(rows[s], row, kind)
        for i in range(start[s], start[s + 1]):
            d = order[i]
            factor = scale[d]
            for h in range(row.shape[0]):
                scaled[h] = row[h] * factor
            _narrow(scaled, out[d], kind)
            _widen(dot_with[d], other, dot_kind)
            dots[d] = _dot_into(row, other)


# --- sigmoid, for the SwiGLU pair ---------------------------------------------------------

# float32 exp(t) = 2^k * exp(r), k = round(t / ln 2), r = t - k ln 2 (in two parts, exact to
# float32), exp(r) by the Cephes expf polynomial (|r| <= ln 2 / 2); the sigmoid is within 2.5
# ulps (tests/test_swi_glu.py). numba's own exp is
# a libm call per element (no SVML here: llvmlite is not patched for it), which cost 14x the
# copy floor; this one vectorises.
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_POLY = tuple(
    np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 0.5)
)
#: exp(t) overflows float32 above ln(FLT_MAX): +inf there, as float32 arithmetic gives; below
#: _EXP_LOW it is taken as 0 (1 + exp(t) is 1 in float32 from t < -17 on)
_EXP_HIGH = np.float32(88.72283)
_EXP_LOW = np.float32(-87.0)


def _sigmoid_into(a, s, scratch, b=None):
    """``s[h] = 1 / (1 + exp(-a[h]))``, or with ``b`` the SwiGLU product ``a[h] * s[h] * b[h]``
    (in the same pass): overloaded below for numba (``scratch``: ``[H]`` int32, unused by the
    float32 loop, which scales by 2^k on the bits of each element in registers)."""


@njit(inline="always", error_model="numpy")
def _sigmoid32(a):
    """``1 / (1 + exp(-a))`` in float32 (the exp of the module comment above)."""
    p0, p1, p2, p3, p4, p5 = _EXP_POLY
    one = np.float32(1)
    t = -a  # exp(-a) = 2^k p, k in [-126, 128]
    t = t if t < _EXP_HIGH else _EXP_HIGH  # (a NaN stays NaN in the product of the caller)
    t = t if t > _EXP_LOW else _EXP_LOW
    k = np.floor(t * _LOG2E + np.float32(0.5))
    r = t - k * _LN2_HI
    r = r - k * _LN2_LO
    p = ((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5
    p = p * r * r + r + one
    top = k > np.float32(127)  # 2^128 is no float32: 2p * 2^127
    p = p + p if top else p
    shift = np.int32(np.int32(k - one if top else k) << np.int32(23))
    p = _int32_as_float32(np.int32(_float32_as_int32(p) + shift))  # times 2^k: k added to the exponent field
    t = -a
    e = np.float32(np.inf) if t > _EXP_HIGH else (np.float32(0) if t < _EXP_LOW else p)
    return one / (one + e)


def _sigmoid(a):
    """``1 / (1 + exp(-a))`` of one float32 (the vectorised exp) or float64 (libm)."""


@overload(_sigmoid)
def _sigmoid_impl(a):
    if a == types.float64:
        return lambda a: 1.0 / (1.0 + np.exp(-a))
    return lambda a: _sigmoid32(a)


@overload(_sigmoid_into)
def _sigmoid_into_impl(a, s, scratch, b=None):
    with_product = not (b is None or isinstance(b, (types.NoneType, types.Omitted)))
    if a.dtype == types.float64:  # bare-kernel gradient checks: libm, one element at a time

        def sigmoid_float64(a, s, scratch, b=None):
            for h in range(a.shape[0]):
                s[h] = 1.0 / (1.0 + np.exp(-a[h]))
                if with_product:
                    s[h] = a[h] * s[h] * b[h]

        return sigmoid_float64

    def sigmoid_float32(a, s, scratch, b=None):
        for h in range(a.shape[0]):  # one pass: the loop vectorises whole
            if with_product:
                s[h] = a[h] * _sigmoid32(a[h]) * b[h]
            else:
                s[h] = _sigmoid32(a[h])

    return sigmoid_float32


@njit(inline="always", error_model="numpy")
def _swiglu_row(gate, up, target, kind):
    for h in range(target.shape[0]):
        a = _widen_one(gate, h, kind)
        _narrow_one(a * _sigmoid(a) * _widen_one(up, h, kind), target, h, kind)


@njit(nogil=True, cache=True, error_model="numpy")
def _swiglu(x, kind, out, first, stop):
    """``out[r] = a * sigmoid(a) * b`` with ``a, b = x[r, 0], x[r, 1]``, for r in ``[first, stop)``.

    One pass per row, each element widened, computed and narrowed in registers (``kind`` is
    tested once per row, so that each loop is compiled for one element type and vectorises).

    Args:
        x: ``[R, 2, I]`` (carrier of ``kind``): the gate half, then the other half.
        out: ``[R, I]`` (carrier of ``kind``).
    """
    for r in range(first, stop):
        if kind == BFLOAT16:
            _swiglu_row(x[r, 0], x[r, 1], out[r], BFLOAT16)
        else:
            _swiglu_row(x[r, 0], x[r, 1], out[r], FLOAT16)


@njit(nogil=True, cache=True, error_model="numpy")
def _swiglu_grad(grad, grad_kind, x, kind, out, first, stop, g, a, b, s, scratch):
    """The gradient of :func:`_swiglu` for r in ``[first, stop)``, with ``s = sigmoid(a)``:
    ``out[r, 0] = g*b*s*(1 + a*(1 - s))`` and ``out[r, 1] = g*a*s``.

    Args:
        grad: ``[R, I]`` (carrier of ``grad_kind``); x: ``[R, 2, I]``; out: ``[R, 2, I]``
            (carrier of ``kind``).
        g, a, b, s: ``[I]`` scratch of the compute type; scratch: ``[I]`` int32.
    """
    one = np.float32(1)  # (with float64 scratch the arithmetic is float64)
    for r in range(first, stop):
        _widen(grad[r], g, grad_kind)
        _widen(x[r, 0], a, kind)
        _widen(x[r, 1], b, kind)
        _sigmoid_into(a, s, scratch)
        for h in range(s.shape[0]):
            gate = g[h] * a[h] * s[h]  # d/db
            g[h] = g[h] * b[h] * s[h] * (one + a[h] * (one - s[h]))  # d/da
            b[h] = gate
        _narrow(g, out[r, 0], kind)
        _narrow(b, out[r, 1], kind)


# --- finalize routing: skips, then each token's K weighted rows --------------------------


@njit(inline="always")
def _add_scaled_row(total, row, bias_row, factor, kind):
    """``total[h] = total[h] + (row[h] + bias_row[h]) * factor`` (``bias_row`` already widened,
    or None; ``factor`` None = 1), each element of ``row`` widened in registers."""
    if bias_row is None:
        if factor is None:
            for h in range(total.shape[0]):
                total[h] = total[h] + _widen_one(row, h, kind)
        else:
            for h in range(total.shape[0]):
                total[h] = total[h] + _widen_one(row, h, kind) * factor
    elif factor is None:
        for h in range(total.shape[0]):
            total[h] = total[h] + (_widen_one(row, h, kind) + bias_row[h])
    else:
        for h in range(total.shape[0]):
            total[h] = total[h] + (_widen_one(row, h, kind) + bias_row[h]) * factor


@njit(inline="always")
def _finalize_terms(rows, kind, source, scales, bias, expert, i, total, term, bias_row):
    """Add token i's K terms to ``total`` in j order (see :func:`_finalize_rows`)."""
    for j in range(source.shape[1]):
        row = source[i, j]
        factor = None if scales is None else scales[i, j]
        if bias is not None:
            _widen(bias[expert[i, j]], bias_row, kind)
        if row >= 0:
            _add_scaled_row(total, rows[row], None if bias is None else bias_row, factor, kind)
            continue
        term[:] = 0  # a dropped slot: a zero row, plus the bias (0 * factor keeps its sign and NaN)
        if bias is not None:
            for h in range(term.shape[0]):
                term[h] = term[h] + bias_row[h]
        if factor is None:
            for h in range(total.shape[0]):
                total[h] = total[h] + term[h]
        else:
            for h in range(total.shape[0]):
                total[h] = total[h] + term[h] * factor


@njit(nogil=True, cache=True)
def _finalize_rows(rows, kind, source, scales, bias, expert, x1, x2, out, first, stop, total, term, bias_row):
    """``out[i] = x1[i] + x2[i] + sum_j scales[i, j] * (rows[source[i, j]] + bias[expert[i, j]])``
    for i in ``[first, stop)``, terms added in j order after the skips; each source row is
    widened as it is added (one pass over it).

    Args:
        rows: ``[N, H]`` (carrier of ``kind``); source: ``[R, K]`` int64, the row of each term,
            -1 = a zero row (a dropped slot still adds its scaled bias).
        scales: ``[R, K]`` compute type or None (factor 1); bias: ``[E, H]`` (carrier of
            ``kind``) or None, with expert: ``[R, K]`` int64.
        x1, x2: ``[R, H]`` (carrier of ``kind``) or None; x2 only with x1.
        out: ``[R, H]`` (carrier of ``kind``); total, term, bias_row: ``[H]`` compute type.
    """
    for i in range(first, stop):
        if x1 is None:
            total[:] = 0
        else:
            _widen(x1[i], total, kind)
            if x2 is not None:
                _widen(x2[i], term, kind)
                for h in range(total.shape[0]):
                    total[h] = total[h] + term[h]
        if kind == BFLOAT16:  # one loop body per element type (see _swiglu)
            _finalize_terms(rows, BFLOAT16, source, scales, bias, expert, i, total, term, bias_row)
        else:
            _finalize_terms(rows, FLOAT16, source, scales, bias, expert, i, total, term, bias_row)
        _narrow(total, out[i], kind)


# --- MoeComputeExpertTokens ---------------------------------------------------------------


@njit(nogil=True, cache=True)
def _expert_ends(sorted_experts, ends):
    """``ends[e]`` = the number of entries ``<= e`` (a binary search per expert) when
    ``sorted_experts [N]`` is non-decreasing and ``>= 0``; returns whether it is (if not,
    ``ends`` is unwritten). The check is one branch-free pass (it vectorises): the op is a few
    microseconds, where numpy's compare-and-any costs more than the searches."""
    n = sorted_experts.shape[0]
    falls = n > 0 and sorted_experts[0] < 0
    for i in range(1, n):
        falls |= sorted_experts[i] < sorted_experts[i - 1]
    if falls:
        return False
    for e in range(ends.shape[0]):
        low, high = 0, n
        while low < high:
            middle = (low + high) >> 1
            if sorted_experts[middle] <= e:
                low = middle + 1
            else:
                high = middle
        ends[e] = low
    return True


# --- GroupedMatmul: products of a few rows, in a fixed order ----------------------------
# The output columns are independent sums, so they are the vector lanes. For each block of
# output columns and each tile of k, the tile of W is made a C-contiguous [k, n] block of the
# compute type (a stored [N, K] weight transposed, in 16 x 16 squares of LLVM vectors for
# float32 and bfloat16: _transposed_square; float16/bfloat16 widened; a float32 [K, N] weight
# is read where it lies; the tile sizes: fused._TILES); then, for k in order, every row adds
# x[r, k] * tile[k, n] to its running sums. Each weight element is read from memory once per
# job; the tile stays in cache for all the job's rows. Nothing is carried between lanes, so the
# loop vectorises with no reassociation. float32 sums take each product by a fused
# multiply-add (one rounding per step: the products of these groups are compute-bound, and a
# separate multiply and add take two instructions on the same ports: 32 rows against [N, K]
# weights took 0.66-0.76x BLAS's time with it, 0.91-0.93x without, docs/bench.md "seventh
# step"; a CPU without FMA instructions gets libm's fmaf from LLVM: the same bits, slowly);
# float64 (the bare kernel's reference type) keeps a rounded product and an add. The float32
# loop is written in LLVM vectors (_vector_block_sums: the running sums of 8 rows x 32 columns
# held in registers across the k run: AVX-512's 32 registers; AVX2's 16 cannot hold them all),
# for LLVM's own vectorisation of the plain loop keeps the sums in memory (a load and a store
# per multiply-add: 3x slower), and its SLP pass leaves the same sums written as scalar locals
# scalar.
_BLOCK_ROWS = 8
_LANES = 16
_BLOCK_VECTORS = 2
_BLOCK_COLUMNS = _LANES * _BLOCK_VECTORS


def _int32s(values: list[int]) -> Any:
    """An LLVM constant vector of int32 ``values`` (a shuffle mask, a shift)."""
    return llvm_ir.Constant(llvm_ir.VectorType(llvm_ir.IntType(32), len(values)), values)


def _splat(builder, value, lanes) -> Any:
    """An LLVM vector of ``lanes`` copies of the scalar ``value``."""
    undef = llvm_ir.Constant(llvm_ir.VectorType(value.type, lanes), llvm_ir.Undefined)
    first = builder.insert_element(undef, value, llvm_ir.Constant(llvm_ir.IntType(32), 0))
    return builder.shuffle_vector(first, undef, _int32s([0] * lanes))


def _fused_multiply_add_of(builder, kind) -> Any:
    """LLVM's fused multiply-add (``llvm.fma``: ``a * b + c`` rounded once) for values of the
    LLVM type ``kind``: float32, or a vector of float32."""
    suffix = f"v{kind.count}f32" if isinstance(kind, llvm_ir.VectorType) else "f32"
    return cgutils.get_or_insert_function(builder.module, llvm_ir.FunctionType(kind, [kind] * 3), f"llvm.fma.{suffix}")


def _prefetch(builder, address) -> None:
    """Ask for the cache line at the LLVM pointer ``address`` (``llvm.prefetch``: a read, kept
    in every cache level; it never faults, past an array's end included)."""
    bytes_pointer, i32 = llvm_ir.IntType(8).as_pointer(), llvm_ir.IntType(32)
    prefetch = cgutils.get_or_insert_function(
        builder.module, llvm_ir.FunctionType(llvm_ir.VoidType(), [bytes_pointer, i32, i32, i32]), "llvm.prefetch.p0"
    )
    builder.call(prefetch, [builder.bitcast(address, bytes_pointer), i32(0), i32(3), i32(1)])


def _vector_block_sums(rows, vectors, lanes) -> Any:
    """A numba intrinsic ``(x_addr, x_step, tile_addr, tile_step, acc_addr, acc_step, depth)``:
    ``acc[i, n] = fma(x[i, kk], tile[kk, n], acc[i, n])`` for kk in ``[0, depth)`` in order
    (each step rounded once: LLVM's ``llvm.fma``), for i < ``rows`` and n < ``vectors * lanes``
    (all float32; an address is that of element [0, 0], a step the elements between rows).
    The sums are ``<lanes x float>`` values in registers across the whole run."""
    void_of_ints = types.void(*([types.intp] * 7))

    def typer(typingctx, x_addr, x_step, tile_addr, tile_step, acc_addr, acc_step, depth):
        def codegen(context, builder, signature, args):
            x_addr, x_step, tile_addr, tile_step, acc_addr, acc_step, depth = args
            f32, i64 = llvm_ir.FloatType(), llvm_ir.IntType(64)
            vec = llvm_ir.VectorType(f32, lanes)
            x = builder.inttoptr(x_addr, f32.as_pointer())
            tile = builder.inttoptr(tile_addr, f32.as_pointer())
            acc = builder.inttoptr(acc_addr, f32.as_pointer())

            def at(base, row, step, column):  # &base[row * step + column] as a vector pointer
                index = builder.add(builder.mul(row, step), llvm_ir.Constant(i64, column))
                return builder.bitcast(builder.gep(base, [index]), vec.as_pointer())

            def acc_at(i, v):
                return at(acc, llvm_ir.Constant(i64, i), acc_step, v * lanes)

            fma = _fused_multiply_add_of(builder, vec)
            sums = [[cgutils.alloca_once(builder, vec) for _ in range(vectors)] for _ in range(rows)]
            for i in range(rows):
                for v in range(vectors):
                    builder.store(builder.load(acc_at(i, v), align=4), sums[i][v])
            with cgutils.for_range(builder, depth) as loop:
                k = loop.index
                weights = [builder.load(at(tile, k, tile_step, v * lanes), align=4) for v in range(vectors)]
                for i in range(rows):
                    offset = builder.add(builder.mul(llvm_ir.Constant(i64, i), x_step), k)
                    u = _splat(builder, builder.load(builder.gep(x, [offset])), lanes)
                    for v in range(vectors):
                        total = builder.call(fma, [u, weights[v], builder.load(sums[i][v])])
                        builder.store(total, sums[i][v])
            for i in range(rows):
                for v in range(vectors):
                    builder.store(builder.load(sums[i][v]), acc_at(i, v), align=4)
            return context.get_dummy_value()

        return void_of_ints, codegen

    return intrinsic(typer)


_block_sums_1 = _vector_block_sums(1, _BLOCK_VECTORS, _LANES)
_block_sums_2 = _vector_block_sums(2, _BLOCK_VECTORS, _LANES)
_block_sums_3 = _vector_block_sums(3, _BLOCK_VECTORS, _LANES)
_block_sums_4 = _vector_block_sums(4, _BLOCK_VECTORS, _LANES)
_block_sums_8 = _vector_block_sums(_BLOCK_ROWS, _BLOCK_VECTORS, _LANES)


def _fused_multiply_add_typer(typingctx, a, b, c):
    """``a * b + c`` rounded once (``llvm.fma``), for float32 ``a``, ``b``, ``c``."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        f32 = llvm_ir.FloatType()
        fma = _fused_multiply_add_of(builder, f32)
        return builder.call(fma, list(args))

    return types.float32(a, b, c), codegen


_fused_multiply_add: Any = intrinsic(_fused_multiply_add_typer)


def _multiply_add(a, b, c):
    """``a * b + c`` as the few-rows kernel takes it: fused (one rounding) for float32, the
    product rounded then added for float64: overloaded below for numba."""


@overload(_multiply_add)
def _multiply_add_impl(a, b, c):
    # (a uint16 b only types the in-place branch of a float16/bfloat16 call, which never runs it)
    if a == b == c == types.float32:
        return lambda a, b, c: _fused_multiply_add(a, b, c)
    return lambda a, b, c: a * b + c


def _transposed_square(bits16) -> Any:
    """A numba intrinsic ``(source_addr, source_step, tile_addr, tile_step)``:
    ``tile[j, i] = float(source[i, j])`` for i, j < 16 (source float32, or bfloat16 bits when
    ``bits16``: widened exactly, the bits shifted into the top half), by 16 vector loads,
    four rounds of lane shuffles (each swaps the off-diagonal blocks of one size) and 16 vector
    stores. An address is that of element [0, 0]; a step, the elements between rows."""
    void_of_ints = types.void(*([types.intp] * 4))

    def typer(typingctx, source_addr, source_step, tile_addr, tile_step):
        def codegen(context, builder, signature, args):
            source_addr, source_step, tile_addr, tile_step = args
            f32, i64, i32 = llvm_ir.FloatType(), llvm_ir.IntType(64), llvm_ir.IntType(32)
            vec = llvm_ir.VectorType(f32, 16)
            element = llvm_ir.IntType(16) if bits16 else f32
            loaded = llvm_ir.VectorType(element, 16)
            source = builder.inttoptr(source_addr, element.as_pointer())
            tile = builder.inttoptr(tile_addr, f32.as_pointer())

            def row_at(base, i, step, kind):
                index = builder.mul(llvm_ir.Constant(i64, i), step)
                return builder.bitcast(builder.gep(base, [index]), kind.as_pointer())

            rows = []
            for i in range(16):
                row = builder.load(row_at(source, i, source_step, loaded), align=2 if bits16 else 4)
                if bits16:  # the top half of a float32
                    wide = builder.zext(row, llvm_ir.VectorType(i32, 16))
                    row = builder.bitcast(builder.shl(wide, _int32s([16] * 16)), vec)
                rows.append(row)
            for size in (1, 2, 4, 8):
                # rows i and i + size (i without the bit size): lanes with the bit set in row i
                # trade places with lanes without it in row i + size
                low = _int32s([n if n & size == 0 else 16 + n - size for n in range(16)])
                high = _int32s([n + size if n & size == 0 else 16 + n for n in range(16)])
                for i in range(16):
                    if i & size == 0:
                        a, b = rows[i], rows[i + size]
                        rows[i] = builder.shuffle_vector(a, b, low)
                        rows[i + size] = builder.shuffle_vector(a, b, high)
            for j in range(16):
                builder.store(rows[j], row_at(tile, j, tile_step, vec), align=4)
            return context.get_dummy_value()

        return void_of_ints, codegen

    return intrinsic(typer)


_transposed_float32 = _transposed_square(False)
_transposed_bfloat16 = _transposed_square(True)


# The same sums with a group's rows as the lanes (up to fused.ROW_LANE_ROWS float32 rows
# against a weight stored [N, K], in vectors of fused.ROW_LANES = 16 rows): the group's rows
# are transposed once per call into slots of [K, 16] (_rows_in_lanes), and each weight element
# is broadcast where it lies instead of every tile being transposed per job (at 8-16 rows the
# transposition took as long as the products: docs/bench.md "ninth step"). Each output element
# is still one float32 chain of fused multiply-adds over k in increasing order: the same bits
# as the tiles. A bfloat16 weight element is widened where it is broadcast (its bits shifted
# into the top half of a float32: exact), never a float32 copy of the weight.
#: columns of a block of sums for 1-4 vectors of rows (columns * vectors <= 24 vectors in
#: registers; four by 6: 10 loads to 24 fused multiply-adds a k where three by 8 take 11)
_LANE_BLOCK_COLUMNS = (0, 16, 8, 8, 6)


def _emit_row_lane_sums(builder, columns, vectors, bits16, args) -> None:
    """Emit, for n < ``columns``, v < ``vectors`` and the 16 lanes m, ``acc[16 (vectors n + v)
    + m] = fma(xt[v xt_step + 16 kk + m], w[n w_step + kk], acc[...])`` for kk in ``[0,
    depth)`` in order (``llvm.fma``: one rounding a step), all float32 but w, bfloat16 bits
    when ``bits16`` (widened exactly); ``args`` are ``(xt_addr, xt_step, w_addr, w_step,
    acc_addr, depth)``: addresses of element 0, steps in elements (xt_step: between a job's
    slots of 16 rows). Each round of 16 k prefetches every weight row _ROW_LANE_AHEAD elements on."""
    xt_addr, xt_step, w_addr, w_step, acc_addr, depth = args
    f32, i64, i32 = llvm_ir.FloatType(), llvm_ir.IntType(64), llvm_ir.IntType(32)
    vec = llvm_ir.VectorType(f32, 16)
    xt = builder.inttoptr(xt_addr, f32.as_pointer())
    w = builder.inttoptr(w_addr, (llvm_ir.IntType(16) if bits16 else f32).as_pointer())
    acc = builder.inttoptr(acc_addr, f32.as_pointer())
    fma = _fused_multiply_add_of(builder, vec)
    sixteen = llvm_ir.Constant(i64, 16)

    def acc_at(n, v):
        return builder.bitcast(builder.gep(acc, [llvm_ir.Constant(i64, 16 * (vectors * n + v))]), vec.as_pointer())

    def weight_at(n, k):
        return builder.gep(w, [builder.add(builder.mul(llvm_ir.Constant(i64, n), w_step), k)])

    sums = {(n, v): cgutils.alloca_once(builder, vec) for n in range(columns) for v in range(vectors)}
    for (n, v), sum_ in sums.items():
        builder.store(builder.load(acc_at(n, v), align=4), sum_)

    def step(k):  # every column's sums take x[:, k] * w[n, k]
        xvs = []
        for v in range(vectors):
            at = builder.gep(xt, [builder.add(builder.mul(llvm_ir.Constant(i64, v), xt_step), builder.mul(k, sixteen))])
            xvs.append(builder.load(builder.bitcast(at, vec.as_pointer()), align=4))
        for n in range(columns):
            element = builder.load(weight_at(n, k))
            if bits16:  # the top half of a float32
                wide = builder.shl(builder.zext(element, i32), llvm_ir.Constant(i32, 16))
                element = builder.bitcast(wide, f32)
            value = _splat(builder, element, 16)
            for v in range(vectors):
                builder.store(builder.call(fma, [xvs[v], value, builder.load(sums[n, v])]), sums[n, v])

    rounds = builder.udiv(depth, sixteen)
    with cgutils.for_range(builder, rounds) as loop:  # 16 k a round, one prefetch a row
        k0 = builder.mul(loop.index, sixteen)
        for n in range(columns):
            _prefetch(builder, weight_at(n, builder.add(k0, llvm_ir.Constant(i64, _ROW_LANE_AHEAD))))
        for kk in range(16):
            step(builder.add(k0, llvm_ir.Constant(i64, kk)))
    done = builder.mul(rounds, sixteen)
    with cgutils.for_range(builder, builder.sub(depth, done)) as loop:
        step(builder.add(done, loop.index))
    for (n, v), sum_ in sums.items():
        builder.store(builder.load(sum_), acc_at(n, v), align=4)


def _row_lane_sums(bits16) -> Any:
    """A numba intrinsic ``(vectors, whole, xt_addr, xt_step, w_addr, w_step, acc_addr,
    depth)``: :func:`_emit_row_lane_sums`'s sums for 1-4 ``vectors`` of rows and a block of
    _LANE_BLOCK_COLUMNS[vectors] columns (``whole`` != 0) or one column, against a float32
    weight or (``bits16``) a bfloat16 one."""
    void_of_ints = types.void(*([types.intp] * 8))

    def typer(typingctx, vectors, whole, xt_addr, xt_step, w_addr, w_step, acc_addr, depth):
        def codegen(context, builder, signature, args):
            vectors, whole, sums_args = args[0], args[1], args[2:]
            i64 = llvm_ir.IntType(64)
            for count in range(1, len(_LANE_BLOCK_COLUMNS)):
                with builder.if_then(builder.icmp_signed("==", vectors, llvm_ir.Constant(i64, count))):
                    is_whole = builder.icmp_signed("!=", whole, llvm_ir.Constant(i64, 0))
                    with builder.if_else(is_whole) as (block, column):
                        with block:
                            _emit_row_lane_sums(builder, _LANE_BLOCK_COLUMNS[count], count, bits16, sums_args)
                        with column:
                            _emit_row_lane_sums(builder, 1, count, bits16, sums_args)
            return context.get_dummy_value()

        return void_of_ints, codegen

    return intrinsic(typer)


#: elements ahead of a round's k that its prefetch asks for, per weight row (4 lines): the
#: layer at 16 rows per expert ran 4-6% slower with none, 5-7% with 256
_ROW_LANE_AHEAD = 64
_float32_lane_sums, _bfloat16_lane_sums = _row_lane_sums(False), _row_lane_sums(True)


@njit(nogil=True, cache=True)
def _row_lane_block(vectors):
    """The columns of a block of :func:`_row_lane_sums` for a job of ``vectors`` vectors of rows."""
    return _LANE_BLOCK_COLUMNS[vectors]


@njit(nogil=True, cache=True)
def _add_row_lane_sums(vectors, whole, bits16, xt_addr, xt_step, w_addr, w_step, acc_addr, depth):
    """:func:`_row_lane_sums` of a whole block (``whole``) or of one column, for 1-4 vectors,
    of a float32 weight or (``bits16``) a bfloat16 one."""
    if bits16:
        _bfloat16_lane_sums(vectors, 1 if whole else 0, xt_addr, xt_step, w_addr, w_step, acc_addr, depth)
    else:
        _float32_lane_sums(vectors, 1 if whole else 0, xt_addr, xt_step, w_addr, w_step, acc_addr, depth)


@njit(nogil=True, cache=True)
def _rows_in_lanes(x, kind, x_transposed, jobs, slots, xt):
    """``xt[slots[j] + v, kk, m] = X[row_first + 16 v + m, k_first + kk]`` for each job j with
    ``slots[j] >= 0`` (X = x, or x.T when x_transposed; float32, or the carrier of ``kind``
    widened exactly), m < 16, v over the job's
    vectors of 16 rows: the job's rows as the lanes of :func:`_row_lane_sums`. In 16 x 16
    squares where 16 rows of x from the vector's first lie in x (the lanes past the job's rows
    then hold the rows after it, whose sums are never written out); else one element at a
    time, the lanes past its rows 0."""
    squares = not x_transposed and x.strides[1] == x.itemsize
    for j in range(jobs.shape[0]):
        if slots[j] < 0:
            continue
        g, k_first, k_stop, job_first, row_stop, o = jobs[j]
        depth = k_stop - k_first
        for v in range((row_stop - job_first + ROW_LANES - 1) // ROW_LANES):
            slot, row_first, done = slots[j] + v, job_first + ROW_LANES * v, 0
            if squares and row_first + ROW_LANES <= x.shape[0]:
                x_step = x.strides[0] // x.itemsize
                done = depth // 16 * 16
                for kk in range(0, done, 16):
                    source = x.ctypes.data + x.itemsize * (row_first * x_step + k_first + kk)
                    target = xt.ctypes.data + 4 * (slot * (xt.strides[0] // 4) + kk * 16)
                    if x.itemsize == 2:  # bfloat16 bits (float16 never takes the lanes)
                        _transposed_bfloat16(source, x_step, target, 16)
                    else:
                        _transposed_float32(source, x_step, target, 16)
            xt[slot, done:depth, :] = 0
            for m in range(min(ROW_LANES, row_stop - row_first)):
                for kk in range(done, depth):
                    at = (k_first + kk, row_first + m) if x_transposed else (row_first + m, k_first + kk)
                    xt[slot, kk, m] = _widen_one(x, at, kind)


def _tile_transposed(w, kind, g, k_first, n_first, depth, width, tile):
    """``tile[kk, n] = float(w[g, n_first + n, k_first + kk])`` for kk < depth, n < width:
    overloaded below for numba (squares of 16 in vectors for bfloat16; float32 weights stored
    [N, K] are the row lanes' instead, in GroupedMatmul never tiles)."""


@overload(_tile_transposed)
def _tile_transposed_impl(w, kind, g, k_first, n_first, depth, width, tile):
    if tile.dtype != types.float32 or w.dtype != types.uint16:

        def one_at_a_time(w, kind, g, k_first, n_first, depth, width, tile):
            for n in range(width):
                for kk in range(depth):
                    tile[kk, n] = _widen_one(w, (g, n_first + n, k_first + kk), kind)

        return one_at_a_time

    def in_squares(w, kind, g, k_first, n_first, depth, width, tile):
        if kind != BFLOAT16:  # float16: the exact table, one at a time
            for n in range(width):
                for kk in range(depth):
                    tile[kk, n] = _widen_one(w, (g, n_first + n, k_first + kk), kind)
            return
        w_step, tile_step = w.strides[1] // 2, tile.strides[0] // 4
        squares_n, squares_k = width // 16 * 16, depth // 16 * 16
        for n in range(0, squares_n, 16):
            for kk in range(0, squares_k, 16):
                source = w.ctypes.data + 2 * (g * w.strides[0] // 2 + (n_first + n) * w_step + k_first + kk)
                target = tile.ctypes.data + 4 * (kk * tile_step + n)
                _transposed_bfloat16(source, w_step, target, tile_step)
        for n in range(width):  # the edges, one at a time
            for kk in range(squares_k if n < squares_n else 0, depth):
                tile[kk, n] = _widen_one(w, (g, n_first + n, k_first + kk), kind)

    return in_squares


@njit(inline="always")
def _tile_into(w, kind, g, k_first, n_first, depth, width, transposed, tile):
    """``tile[kk, n] = W[g, k_first + kk, n_first + n]`` widened, kk < depth, n < width
    (W = w, or w with its last two axes swapped when transposed)."""
    if transposed:
        _tile_transposed(w, kind, g, k_first, n_first, depth, width, tile)
    else:
        for kk in range(depth):
            _widen(w[g, k_first + kk, n_first : n_first + width], tile[kk, :width], kind)


@njit(inline="always")
def _add_products_plainly(xs, rows, x_first, tile, t_first, t_column, depth, width, acc, a_column):
    """``acc[m, a_column + n] += xs[m, x_first + kk] * tile[t_first + kk, t_column + n]`` for kk
    in ``[0, depth)`` in order, each step a :func:`_multiply_add`; m < rows, n < width."""
    for kk in range(depth):
        for m in range(rows):
            u = xs[m, x_first + kk]
            for n in range(width):
                acc[m, a_column + n] = _multiply_add(u, tile[t_first + kk, t_column + n], acc[m, a_column + n])


def _add_tile_products(xs, rows, x_first, tile, t_first, t_column, depth, width, acc):
    """``acc[m, n] += xs[m, x_first + kk] * tile[t_first + kk, t_column + n]`` for kk in
    ``[0, depth)`` in order (m < rows, n < width; all of the compute type, C-contiguous rows):
    overloaded below for numba."""


@overload(_add_tile_products)
def _add_tile_products_impl(xs, rows, x_first, tile, t_first, t_column, depth, width, acc):
    if xs.dtype != types.float32:

        def plain(xs, rows, x_first, tile, t_first, t_column, depth, width, acc):
            _add_products_plainly(xs, rows, x_first, tile, t_first, t_column, depth, width, acc, 0)

        return plain

    def in_vectors(xs, rows, x_first, tile, t_first, t_column, depth, width, acc):
        x_step, tile_step, acc_step = xs.strides[0] // 4, tile.strides[0] // 4, acc.strides[0] // 4
        x_base = xs.ctypes.data + 4 * x_first
        tile_base = tile.ctypes.data + 4 * (t_first * tile_step + t_column)
        blocked = width // _BLOCK_COLUMNS * _BLOCK_COLUMNS
        for c in range(0, blocked, _BLOCK_COLUMNS):
            m = 0
            while m < rows:  # blocks of 8 rows, then at most one of 4 and one of 1 to 3
                x_at = x_base + 4 * m * x_step
                acc_at = acc.ctypes.data + 4 * (m * acc_step + c)
                left = rows - m
                m += _BLOCK_ROWS if left >= _BLOCK_ROWS else 4
                if left >= _BLOCK_ROWS:
                    _block_sums_8(x_at, x_step, tile_base + 4 * c, tile_step, acc_at, acc_step, depth)
                elif left >= 4:
                    _block_sums_4(x_at, x_step, tile_base + 4 * c, tile_step, acc_at, acc_step, depth)
                elif left == 3:
                    _block_sums_3(x_at, x_step, tile_base + 4 * c, tile_step, acc_at, acc_step, depth)
                elif left == 2:
                    _block_sums_2(x_at, x_step, tile_base + 4 * c, tile_step, acc_at, acc_step, depth)
                else:
                    _block_sums_1(x_at, x_step, tile_base + 4 * c, tile_step, acc_at, acc_step, depth)
        if blocked < width:  # the last few columns
            _add_products_plainly(
                xs, rows, x_first, tile, t_first, t_column + blocked, depth, width - blocked, acc, blocked
            )

    return in_vectors


def _same_type(a, b):
    """Whether arrays ``a`` and ``b`` have one element type (a constant: overloaded below)."""


@overload(_same_type)
def _same_type_impl(a, b):
    same = a.dtype == b.dtype
    return lambda a, b: same


@njit(nogil=True, cache=True)
def _few_rows_products(
    x,
    x_kind,
    x_transposed,
    w,
    w_transposed,
    bias,
    bias_kind,
    jobs,
    out,
    col_first,
    col_stop,
    xs,
    acc,
    tile,
    slots,
    xt,
    lane_sums,
):
    """``out[o, r, n] = round(sum_{k in order} X[r, k] * W[g, k, n] + bias[g, n])`` for each job
    ``(g, k_first, k_stop, row_first, row_stop, o)`` of ``jobs [J, 6]``, the rows r of the job,
    k from k_first up (one accumulator per output element, starting at +0.0, each step a
    :func:`_multiply_add`: fused for float32), and the output columns n in ``[col_first, col_stop)``.

    A sum does not depend on which columns a call takes, so any split of the columns over
    threads gives the same bits; nor on the weight's layout or element type (widening is exact).

    Args:
        x: ``[M, Ktot]`` (``[Ktot, M]`` when x_transposed), carrier of ``x_kind``.
        w: ``[G, Ktot, N]`` (``[G, N, Ktot]`` when w_transposed), carrier of ``x_kind``.
        bias: ``[G, N]`` carrier of ``bias_kind``, or None.
        out: ``[O, M, N]`` carrier of ``x_kind``.
        xs: ``[R, D]`` compute type, R >= the rows and D >= the depth of every job;
        acc: ``[R, C]`` and tile: ``[T, C]``, compute type: the running sums of a block of C
            output columns, and a tile of T k of the weight's block.
        slots, xt, lane_sums: the jobs whose rows are lanes (:func:`_row_lane_sums`; only
            against a float32 or bfloat16 weight stored ``[N, K]``): ``slots [J]`` each job's first slot
            in ``xt [S, D, 16]`` (one a vector of 16 rows, filled by :func:`_rows_in_lanes`;
            -1: tiles), and the running sums of the columns, ``lane_sums [(col_stop - col_first) * 64
            + 256]`` float32 (the last 256: a 16 x 16 square of them transposed).
    """
    in_place = not w_transposed and _same_type(w, xs)  # a float32/float64 [K, N] weight
    direct = _same_type(out, lane_sums) and out.strides[2] == 4  # float32 rows of sums: stored as they are
    columns, k_tile = acc.shape[1], tile.shape[0]
    w_step, w_size = w.strides[1] // w.itemsize, w.itemsize
    bits16 = w_size == 2  # bfloat16 bits (the lanes take no float16)
    for j in range(jobs.shape[0]):
        g, k_first, k_stop, row_first, row_stop, o = jobs[j]
        rows, depth = row_stop - row_first, k_stop - k_first
        if slots[j] >= 0:  # the rows in lanes, the weight read where it lies
            vectors = (rows + ROW_LANES - 1) // ROW_LANES
            lanes, block = ROW_LANES * vectors, _row_lane_block(vectors)
            xt_step = xt.strides[0] // 4
            xt_addr = xt.ctypes.data + 4 * slots[j] * xt_step
            base = w.ctypes.data + w_size * (g * (w.strides[0] // w_size) + k_first)
            lane_sums[: (col_stop - col_first) * lanes] = 0
            for n0 in range(col_first, col_stop, block):
                width = min(block, col_stop - n0)
                at = base + w_size * n0 * w_step
                sums = lane_sums.ctypes.data + 4 * lanes * (n0 - col_first)
                if width == block:
                    _add_row_lane_sums(vectors, True, bits16, xt_addr, xt_step, at, w_step, sums, depth)
                else:
                    for n in range(width):
                        at_n, sums_n = at + w_size * n * w_step, sums + 4 * lanes * n
                        _add_row_lane_sums(vectors, False, bits16, xt_addr, xt_step, at_n, w_step, sums_n, depth)
            square = lane_sums[lane_sums.shape[0] - LANE_SQUARE :].reshape((ROW_LANES, ROW_LANES))
            out_step = out.strides[1] // 4
            for n0 in range(col_first, col_stop, 16):  # 16 columns of 16 rows at a time
                width = min(16, col_stop - n0)
                for v in range(vectors):
                    first, count = row_first + 16 * v, min(16, rows - 16 * v)
                    at = lane_sums.ctypes.data + 4 * ((n0 - col_first) * lanes + 16 * v)
                    if width == 16 and count == 16 and bias is None and direct:  # straight into out
                        _transposed_float32(
                            at,
                            lanes,
                            out.ctypes.data + 4 * (o * (out.strides[0] // 4) + first * out_step + n0),
                            out_step,
                        )
                        continue
                    if width == 16:  # the sums of rows 16 v + m, columns n0 + n, as square[m, n]
                        _transposed_float32(at, lanes, square.ctypes.data, 16)
                    else:
                        for n in range(width):
                            for m in range(16):
                                square[m, n] = lane_sums[(n0 - col_first + n) * lanes + 16 * v + m]
                    for m in range(count):  # whole rows of the square: the loops vectorise
                        if bias is not None:
                            for n in range(width):
                                square[m, n] = square[m, n] + _widen_one(bias, (g, n0 + n), bias_kind)
                        _narrow(square[m, :width], out[o, first + m, n0 : n0 + width], x_kind)
            continue
        for m in range(rows):  # the job's rows of X, widened
            if x_transposed:
                for kk in range(depth):
                    xs[m, kk] = _widen_one(x, (k_first + kk, row_first + m), x_kind)
            else:
                _widen(x[row_first + m, k_first:k_stop], xs[m, :depth], x_kind)
        for n0 in range(col_first, col_stop, columns):
            width = min(columns, col_stop - n0)
            acc[:rows, :width] = 0
            for k0 in range(0, depth, k_tile):
                run = min(k_tile, depth - k0)
                if in_place:
                    _add_tile_products(xs, rows, k0, w[g], k_first + k0, n0, run, width, acc)
                else:
                    _tile_into(w, x_kind, g, k_first + k0, n0, run, width, w_transposed, tile)
                    _add_tile_products(xs, rows, k0, tile, 0, 0, run, width, acc)
            for m in range(rows):  # whole rows: the loops vectorise
                if bias is not None:
                    for n in range(width):
                        acc[m, n] = acc[m, n] + _widen_one(bias, (g, n0 + n), bias_kind)
                _narrow(acc[m, :width], out[o, row_first + m, n0 : n0 + width], x_kind)


# --- GroupedMatmul: rows against a stored [N, K] weight, as dot products ----------------
# Against W stored [N, K] (the checkpoint layout) a group's products are dot products of its
# rows with contiguous weight rows: the lanes are k, not n, so no tile is transposed and the
# weight streams through once. Each dot product keeps 16 partial sums (lane j: the products
# with k = j mod 16, in increasing k, each rounded before it is added), adds them in a fixed
# tree (lanes j and j + 8, then j and j + 4, j + 2, j + 1), then adds the last depth % 16
# products in k order: a fixed order whatever the thread, the split of the columns, the
# blocking of the rows or the run. Blocks of up to 4 rows of x by 4 weight rows keep their 16
# sums in vector registers; the 4 weight rows stay in cache while the group's rows pass.
# Each step of a 4-row block also asks for the same 16 elements of the weight rows
# _PREFETCH_ROWS further on (a software prefetch: no value changes): the rows a block reads
# are four streams at once, which the hardware prefetchers follow too late when the products
# take time between the loads. Measured per call (float32, [N, K] = [384, 512] x 128 experts
# from memory, 2 threads, medians of 3 alternating runs): 1 row 3.44 -> 3.10 ms, 2 rows
# 4.02 -> 2.99, 4 rows 6.34 -> 3.47, 8 rows 8.40 -> 6.14; 4, 12 and 16 rows ahead, or a
# distance of 8-32 KiB whatever the row length, did no better (docs/bench.md, "eighth step").
_DOT_BLOCK = 4
_PREFETCH_ROWS = 8


def _vector_dots(x_rows, w_rows, bits16) -> Any:
    """A numba intrinsic ``(x_addr, x_step, w_addr, w_step, depth, out_addr, out_step)``: for
    m < ``x_rows`` and r < ``w_rows``, ``out[m * out_step + r]`` = the tree of the 16 lane sums
    of ``x[m * x_step + k] * w[r * w_step + k]`` over k < ``depth`` (a multiple of 16), lane
    k mod 16, k in order. x and out are float32; w is float32, or bfloat16 bits widened exactly
    when ``bits16``. Addresses are of element 0, steps in elements. With 4 weight rows, each
    step prefetches the weight rows _PREFETCH_ROWS further on."""
    void_of_ints = types.void(*([types.intp] * 7))

    def typer(typingctx, x_addr, x_step, w_addr, w_step, depth, out_addr, out_step):
        def codegen(context, builder, signature, args):
            x_addr, x_step, w_addr, w_step, depth, out_addr, out_step = args
            f32, i64, i32 = llvm_ir.FloatType(), llvm_ir.IntType(64), llvm_ir.IntType(32)
            vec = llvm_ir.VectorType(f32, 16)
            element = llvm_ir.IntType(16) if bits16 else f32
            loaded = llvm_ir.VectorType(element, 16)
            x = builder.inttoptr(x_addr, f32.as_pointer())
            w = builder.inttoptr(w_addr, element.as_pointer())
            out = builder.inttoptr(out_addr, f32.as_pointer())

            def offset(row, step, k):
                return builder.add(builder.mul(llvm_ir.Constant(i64, row), step), k)

            sums = [[cgutils.alloca_once(builder, vec) for _ in range(w_rows)] for _ in range(x_rows)]
            for m in range(x_rows):
                for r in range(w_rows):
                    builder.store(llvm_ir.Constant(vec, [0.0] * 16), sums[m][r])
            blocks = builder.udiv(depth, llvm_ir.Constant(i64, 16))
            with cgutils.for_range(builder, blocks) as loop:
                k = builder.mul(loop.index, llvm_ir.Constant(i64, 16))
                weights = []
                for r in range(w_rows):
                    if w_rows == _DOT_BLOCK:  # the rows a later block reads (a block of 1 row: the last few)
                        _prefetch(builder, builder.gep(w, [offset(r + _PREFETCH_ROWS, w_step, k)]))
                    at = builder.bitcast(builder.gep(w, [offset(r, w_step, k)]), loaded.as_pointer())
                    wv = builder.load(at, align=2 if bits16 else 4)
                    if bits16:  # the top half of a float32
                        wide = builder.zext(wv, llvm_ir.VectorType(i32, 16))
                        wv = builder.bitcast(builder.shl(wide, _int32s([16] * 16)), vec)
                    weights.append(wv)
                for m in range(x_rows):
                    at = builder.bitcast(builder.gep(x, [offset(m, x_step, k)]), vec.as_pointer())
                    xv = builder.load(at, align=4)
                    for r in range(w_rows):
                        total = builder.fadd(builder.load(sums[m][r]), builder.fmul(xv, weights[r]))
                        builder.store(total, sums[m][r])
            for m in range(x_rows):
                for r in range(w_rows):
                    total = builder.load(sums[m][r])
                    for half in (8, 4, 2, 1):  # lanes j and j + half, j < half
                        low = builder.shuffle_vector(total, total, _int32s(list(range(half))))
                        high = builder.shuffle_vector(total, total, _int32s(list(range(half, 2 * half))))
                        total = builder.fadd(low, high)
                    lane = builder.extract_element(total, llvm_ir.Constant(i32, 0))
                    builder.store(lane, builder.gep(out, [offset(m, out_step, llvm_ir.Constant(i64, r))]))
            return context.get_dummy_value()

        return void_of_ints, codegen

    return intrinsic(typer)


_dots_f32_1x1, _dots_f32_1x4 = _vector_dots(1, 1, False), _vector_dots(1, 4, False)
_dots_f32_2x1, _dots_f32_2x4 = _vector_dots(2, 1, False), _vector_dots(2, 4, False)
_dots_f32_3x1, _dots_f32_3x4 = _vector_dots(3, 1, False), _vector_dots(3, 4, False)
_dots_f32_4x1, _dots_f32_4x4 = _vector_dots(4, 1, False), _vector_dots(4, 4, False)
_dots_bf16_1x1, _dots_bf16_1x4 = _vector_dots(1, 1, True), _vector_dots(1, 4, True)
_dots_bf16_2x1, _dots_bf16_2x4 = _vector_dots(2, 1, True), _vector_dots(2, 4, True)
_dots_bf16_3x1, _dots_bf16_3x4 = _vector_dots(3, 1, True), _vector_dots(3, 4, True)
_dots_bf16_4x1, _dots_bf16_4x4 = _vector_dots(4, 1, True), _vector_dots(4, 4, True)


@njit(inline="always")
def _dots_block(x_rows, w_rows, bits, x_at, x_step, w_at, w_step, depth, out_at, out_step):
    """The intrinsic of ``x_rows`` (1-4) by ``w_rows`` (1 or 4) rows, float32 or bfloat16 bits."""
    if bits:
        if w_rows == 4:
            if x_rows == 4:
                _dots_bf16_4x4(x_at, x_step, w_at, w_step, depth, out_at, out_step)
            elif x_rows == 3:
                _dots_bf16_3x4(x_at, x_step, w_at, w_step, depth, out_at, out_step)
            elif x_rows == 2:
                _dots_bf16_2x4(x_at, x_step, w_at, w_step, depth, out_at, out_step)
            else:
                _dots_bf16_1x4(x_at, x_step, w_at, w_step, depth, out_at, out_step)
        elif x_rows == 4:
            _dots_bf16_4x1(x_at, x_step, w_at, w_step, depth, out_at, out_step)
        elif x_rows == 3:
            _dots_bf16_3x1(x_at, x_step, w_at, w_step, depth, out_at, out_step)
        elif x_rows == 2:
            _dots_bf16_2x1(x_at, x_step, w_at, w_step, depth, out_at, out_step)
        else:
            _dots_bf16_1x1(x_at, x_step, w_at, w_step, depth, out_at, out_step)
    elif w_rows == 4:
        if x_rows == 4:
            _dots_f32_4x4(x_at, x_step, w_at, w_step, depth, out_at, out_step)
        elif x_rows == 3:
            _dots_f32_3x4(x_at, x_step, w_at, w_step, depth, out_at, out_step)
        elif x_rows == 2:
            _dots_f32_2x4(x_at, x_step, w_at, w_step, depth, out_at, out_step)
        else:
            _dots_f32_1x4(x_at, x_step, w_at, w_step, depth, out_at, out_step)
    elif x_rows == 4:
        _dots_f32_4x1(x_at, x_step, w_at, w_step, depth, out_at, out_step)
    elif x_rows == 3:
        _dots_f32_3x1(x_at, x_step, w_at, w_step, depth, out_at, out_step)
    elif x_rows == 2:
        _dots_f32_2x1(x_at, x_step, w_at, w_step, depth, out_at, out_step)
    else:
        _dots_f32_1x1(x_at, x_step, w_at, w_step, depth, out_at, out_step)


@njit(nogil=True, cache=True)
def _lane_dot_products(x, x_kind, x_transposed, w, bias, bias_kind, jobs, out, col_first, col_stop, xs, sums):
    """``out[o, r, n] = round(dots(X[r, k_first:k_stop], W[g, n, k_first:k_stop]) + bias[g, n])``
    for each job ``(g, k_first, k_stop, row_first, row_stop, o)`` of ``jobs [J, 6]``, its rows
    r and the output columns n in ``[col_first, col_stop)``; ``dots`` is the order of this
    section's comment (16 lane sums, a fixed tree, the tail in order), float32.

    Args:
        x: ``[M, Ktot]`` (``[Ktot, M]`` when x_transposed), float32 or bfloat16 bits (x_kind).
        w: ``[G, N, Ktot]`` C-contiguous, x's carrier.
        bias: ``[G, N]`` float32, or None.
        out: ``[O, M, N]`` x's carrier.
        xs: ``[R, D]`` float32, R >= the rows and D >= the depth of every job (its rows,
            widened); sums: ``[4, 4]`` float32.
    """
    w_step = w.strides[1] // w.itemsize
    x_step, sums_step = xs.strides[0] // 4, sums.strides[0] // 4
    bits = not _same_type(w, xs)
    for j in range(jobs.shape[0]):
        g, k_first, k_stop, row_first, row_stop, o = jobs[j]
        rows, depth = row_stop - row_first, k_stop - k_first
        for m in range(rows):
            if x_transposed:
                for kk in range(depth):
                    xs[m, kk] = _widen_one(x, (k_first + kk, row_first + m), x_kind)
            else:
                _widen(x[row_first + m, k_first:k_stop], xs[m, :depth], x_kind)
        vector_depth = depth // 16 * 16
        for n0 in range(col_first, col_stop, _DOT_BLOCK):
            count = min(_DOT_BLOCK, col_stop - n0)
            w_at = w.ctypes.data + w.itemsize * (g * (w.strides[0] // w.itemsize) + n0 * w_step + k_first)
            for m0 in range(0, rows, _DOT_BLOCK):
                x_rows = min(_DOT_BLOCK, rows - m0)
                x_at = xs.ctypes.data + 4 * m0 * x_step
                if count == _DOT_BLOCK:
                    _dots_block(x_rows, 4, bits, x_at, x_step, w_at, w_step, vector_depth, sums.ctypes.data, sums_step)
                else:
                    for r in range(count):
                        at = w_at + w.itemsize * r * w_step
                        _dots_block(
                            x_rows, 1, bits, x_at, x_step, at, w_step, vector_depth, sums.ctypes.data + 4 * r, sums_step
                        )
                for m in range(x_rows):
                    for r in range(count):
                        total = sums[m, r]
                        for kk in range(vector_depth, depth):
                            total = total + xs[m0 + m, kk] * _widen_one(w, (g, n0 + r, k_first + kk), x_kind)
                        if bias is not None:
                            total = total + _widen_one(bias, (g, n0 + r), bias_kind)
                        _narrow_one(total, out, (o, row_first + m0 + m, n0 + r), x_kind)


# --- GroupedMatmul's lane dots as a compiled call: shares handed out without the GIL -------
# A helper that picks up a share through Python first waits for the GIL (held by the caller,
# which is still in Python preparing its own share); on a virtual machine a thread that waits
# gives its core back, and getting it again took ~50 us at each end of a decode-size call. As a
# compiled call (parallel.run_compiled) the helpers, polling in serve_compiled_calls, rebuild
# the call's arrays from a descriptor of addresses and sizes and take its column shares with
# an atomic counter: no Python between the post and the end. The arrays stay the caller's: it
# closes the call and waits for every helper inside to leave before it returns.
(
    _D_BITS,  # 1: bfloat16 bits (uint16 carriers), 0: float32
    _D_X,  # x as stored ([M, Ktot], or [Ktot, M] when _D_X_T), C-contiguous: address, rows, columns
    _D_X_ROWS,
    _D_X_COLUMNS,
    _D_X_T,
    _D_W,  # weight rows [G, N, Ktot], C-contiguous: address, G, N, Ktot
    _D_G,
    _D_N,
    _D_K,
    _D_BIAS,  # [G, N] float32 address, or 0
    _D_JOBS,  # [J, 6] int64: address, J
    _D_J,
    _D_OUT,  # [O, M, N] C-contiguous: address, O, M
    _D_O,
    _D_M,
    _D_XS,  # scratch [seats, rows, depth] float32: address, seats, rows, depth
    _D_SEATS,
    _D_XS_ROWS,
    _D_XS_DEPTH,
    _D_SUMS,  # scratch [seats, 4, 4] float32 address
    _D_PARTS,  # column shares: their count, then PARTS + 1 bounds
    _D_BOUNDS,
) = range(22)


def _pointer_of(element) -> Any:
    """A numba intrinsic: an address (int) as a pointer to ``element``, for numba.carray."""

    @intrinsic
    def pointer(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(element)))

        return types.CPointer(element)(types.intp), codegen

    return pointer


_float32_at, _uint16_at, _int64_at = _pointer_of(types.float32), _pointer_of(types.uint16), _pointer_of(types.int64)


@njit(nogil=True, cache=True)
def _take_lane_dot_shares(counters, d, seat, x, kind, w, bias, out):
    """Run column shares of the described call (numbered from counters[NEXT]) until none is left."""
    jobs = carray(_int64_at(d[_D_JOBS]), (d[_D_J], 6))
    rows, depth = d[_D_XS_ROWS], d[_D_XS_DEPTH]
    xs = carray(_float32_at(d[_D_XS] + 4 * seat * rows * depth), (rows, depth))
    sums = carray(_float32_at(d[_D_SUMS] + 64 * seat), (4, 4))
    next_share = counters.ctypes.data + 8 * NEXT
    while True:
        share = fetch_add(next_share, 1)
        if share >= d[_D_PARTS]:
            return
        first, stop = d[_D_BOUNDS + share], d[_D_BOUNDS + share + 1]
        _lane_dot_products(x, kind, d[_D_X_T] != 0, w, bias, NATIVE, jobs, out, first, stop, xs, sums)


@njit(nogil=True, cache=True)
def _run_lane_dot_shares(counters, d, seat):
    """The described call's arrays, typed; then its shares (:func:`_take_lane_dot_shares`)."""
    g, n, k = d[_D_G], d[_D_N], d[_D_K]
    x_shape, out_shape = (d[_D_X_ROWS], d[_D_X_COLUMNS]), (d[_D_O], d[_D_M], n)
    if d[_D_BITS]:
        x, w, out = (
            carray(_uint16_at(d[_D_X]), x_shape),
            carray(_uint16_at(d[_D_W]), (g, n, k)),
            carray(_uint16_at(d[_D_OUT]), out_shape),
        )
        if d[_D_BIAS]:
            _take_lane_dot_shares(counters, d, seat, x, BFLOAT16, w, carray(_float32_at(d[_D_BIAS]), (g, n)), out)
        else:
            _take_lane_dot_shares(counters, d, seat, x, BFLOAT16, w, None, out)
    else:
        x, w, out = (
            carray(_float32_at(d[_D_X]), x_shape),
            carray(_float32_at(d[_D_W]), (g, n, k)),
            carray(_float32_at(d[_D_OUT]), out_shape),
        )
        if d[_D_BIAS]:
            _take_lane_dot_shares(counters, d, seat, x, NATIVE, w, carray(_float32_at(d[_D_BIAS]), (g, n)), out)
        else:
            _take_lane_dot_shares(counters, d, seat, x, NATIVE, w, None, out)


@njit(nogil=True, cache=True)
def serve_compiled_calls(counters, d, seen, polls, moved_for):
    """On a helper: poll for calls numbered after ``seen``; run a compiled one's shares here
    (when it is still open, in a free seat) and poll on. Returns ``(number seen, why)``:
    PYTHON_CALL at a Python call; ON_CALLERS_CORE (the number before that call's) when this
    helper runs on the core the call's caller ran on as it posted (``counters[CALLER_CPU]``:
    the two would share one core, polling in turn), unless the call is ``moved_for`` (the
    helper tried to move for it already: it joins wherever it runs); IDLE after ``polls`` polls without a call
    (the counter is read once even when ``polls`` is 0) while ``counters[HOLD]`` is clear
    (set, a compiled caller is running that posts calls itself, which no notify announces)."""
    posted_at, base = counters.ctypes.data + 8 * POSTED, counters.ctypes.data
    idle = 0
    while True:
        posted = load_acquire(posted_at)
        if posted == seen:
            if idle >= polls and load_acquire(base + 8 * HOLD) == 0:
                return seen, IDLE
            poll_pause(idle)
            idle += 1
            continue
        if load_acquire(base + 8 * COMPILED) != posted:
            return posted, PYTHON_CALL
        caller_cpu = load_acquire(base + 8 * CALLER_CPU)
        if posted != moved_for and caller_cpu >= 0 and current_cpu() == caller_cpu:
            return posted - 1, ON_CALLERS_CORE
        seen = posted
        fetch_add(base + 8 * INSIDE, 1)  # in, then check the call is open: the caller closes, then checks nobody is in
        if load_acquire(base + 8 * OPEN) == posted:
            seat = fetch_add(base + 8 * SEAT, 1)
            if seat < d[_D_SEATS]:
                _run_lane_dot_shares(counters, d, seat)
        fetch_add(base + 8 * INSIDE, -1)
        idle = 0


@njit(nogil=True, cache=True)
def run_compiled_call(counters, d, polls):
    """On the caller (seat 0): its shares, then close the call and poll up to ``polls`` times
    for the helpers inside to leave; whether they have (call again until they have)."""
    base = counters.ctypes.data
    _run_lane_dot_shares(counters, d, 0)
    exchange(base + 8 * OPEN, 0)
    for poll in range(polls):
        if load_acquire(base + 8 * INSIDE) == 0:
            return True
        poll_pause(poll)
    return load_acquire(base + 8 * INSIDE) == 0


@functools.cache
def serve_compiled_lane_dots() -> None:
    """Compile (or load from numba's cache: ~0.3 s) the compiled-call loops, then give them to
    the helpers. On the caller, before its first compiled call: a helper compiling would hold
    the GIL for seconds while calls go on without it."""
    serve_compiled_calls(np.zeros(9, np.int64), np.zeros(_D_BOUNDS + 2, np.int64), 0, 0, 0)
    run_compiled_call(np.zeros(9, np.int64), np.zeros(_D_BOUNDS + 2, np.int64), 0)
    register_compiled_server(serve_compiled_calls, run_compiled_call)
