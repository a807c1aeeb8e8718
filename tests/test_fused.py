"""The compiled row loops: exact widening, round-to-nearest-even narrowing, sums that do not
depend on how rows are split over threads."""

import ml_dtypes
import numpy as np
import pytest
from numba import njit

from moe_onnx.custom_ops import fused, fused_loops


@njit
def _narrow(source, target, kind):
    fused_loops._narrow(source, target, kind)


@njit
def _widen(source, target, kind):
    fused_loops._widen(source, target, kind)


def _float32_patterns() -> np.ndarray:
    """A million random float32 bit patterns plus the edges: ties, subnormals, overflow, NaNs."""
    rng = np.random.default_rng(0)
    edges = [
        0,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7F800001,
        0x7FC00000,
        0xFFBFFFFF,
        0x00000001,
        0x007FFFFF,
        0x00800000,
        0x3F808000,
        0x3F818000,
        0x3F807FFF,
        0x7F7FFFFF,
        0x477FEFFF,
        0x477FF000,
        0x33000000,
        0x33000001,
        0x387FC000,
        0x38800000,
        0x7F800100,
        0x7F802000,
    ]
    ties = (rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint32) << 16) | 0x8000  # halfway to bfloat16
    sample = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.array(edges, np.uint32), ties, sample, sample ^ 0x1000]).view(np.float32)


@pytest.mark.parametrize("dtype, kind", [(ml_dtypes.bfloat16, fused.BFLOAT16), (np.float16, fused.FLOAT16)])
def test_narrowing_rounds_like_numpy(dtype, kind):
    values = _float32_patterns()
    got = np.empty(len(values), np.uint16)
    _narrow(values, got, kind)
    with np.errstate(all="ignore"):
        want = values.astype(dtype).view(np.uint16)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype, kind", [(ml_dtypes.bfloat16, fused.BFLOAT16), (np.float16, fused.FLOAT16)])
@pytest.mark.parametrize("wide", [np.float32, np.float64])
def test_widening_is_exact_for_every_pattern(dtype, kind, wide):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(len(bits), wide)
    _widen(bits, got, kind)
    want = bits.view(dtype).astype(np.float32).astype(wide)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))  # NaN payloads too


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64])
def test_segment_sums_add_in_order(dtype):
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((50, 37)).astype(dtype)
    index = rng.integers(-1, 50, 120)
    segment_start = np.sort(rng.integers(0, 121, 31))
    segment_start[0], segment_start[-1] = 0, 120
    weights = rng.standard_normal(120).astype(np.float32)
    got = fused.segment_sums(rows, index, segment_start, weights)
    wide = np.float64 if dtype == np.float64 else np.float32
    want = np.zeros((30, 37), wide)
    for s in range(30):
        for i in range(segment_start[s], segment_start[s + 1]):
            if index[i] >= 0:
                want[s] += rows[index[i]].astype(wide) * wide(weights[i])
    np.testing.assert_array_equal(got.view(np.uint8), want.astype(dtype).view(np.uint8))


def test_split_over_threads_gives_the_same_bits(monkeypatch):
    """Big calls are split over threads; each row is one thread's work, so the bits agree."""
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((4096, 1024)).astype(ml_dtypes.bfloat16)  # 8 MB of rows
    index = rng.permutation(4096 * 4) % 4096
    segment_start = np.arange(0, 4096 * 4 + 1, 4)
    scale = rng.standard_normal(4096).astype(np.float32)
    split = (
        fused.segment_sums(rows, index, segment_start),
        *fused.scaled_rows_and_dots(rows, index[:4096], scale, rows),
    )
    monkeypatch.setattr("moe_onnx.custom_ops.parallel._PARALLEL_MIN_BYTES", 1 << 62)
    whole = (
        fused.segment_sums(rows, index, segment_start),
        *fused.scaled_rows_and_dots(rows, index[:4096], scale, rows),
    )
    for a, b in zip(split, whole):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_dot_is_pairwise_and_close_to_float64():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((3, 1001)).astype(np.float32)
    _, dots = fused.scaled_rows_and_dots(rows, np.array([0, 1, 2]), np.ones(3, np.float32), rows[::-1].copy())
    want = (rows.astype(np.float64) * rows[::-1].astype(np.float64)).sum(axis=1)
    np.testing.assert_allclose(dots, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8])
def test_copy_rows_to_is_the_inverse_gather(dtype):
    """Source-major copy == gather by the inverse permutation; out-of-range entries skipped."""
    rng = np.random.default_rng(4)
    source = rng.integers(-100, 100, (40, 3, 5)).astype(dtype)
    destination = rng.permutation(120)
    n_rows = 100  # entries >= 100 are skipped, as in active mode
    got = fused.copy_rows_to(source, destination, fused.fanout_starts(40, 3), n_rows)
    inverse = np.empty(120, np.intp)
    inverse[destination] = np.repeat(np.arange(40), 3)
    np.testing.assert_array_equal(got.view(np.uint8), source[inverse[:n_rows]].view(np.uint8))
    empty = fused.copy_rows_to(source[:0], destination[:0], fused.fanout_starts(0, 3), 4)
    assert empty.shape == (4, 3, 5)  # no source: every row is the caller's to fill


def test_destinations_by_source_inverts_a_gather_map():
    rng = np.random.default_rng(5)
    index = rng.integers(-1, 7, 200)
    order, start = fused.destinations_by_source(index, 9)  # sources 7 and 8 feed nothing
    assert start[0] == 0 and start[-1] == len(order) == (index >= 0).sum()
    for s in range(9):
        np.testing.assert_array_equal(order[start[s] : start[s + 1]], np.flatnonzero(index == s))
    order, start = fused.destinations_by_source(np.full(4, -1), 0)
    assert len(order) == 0 and list(start) == [0]


def test_scaled_rows_and_dots_match_the_gather_it_replaces():
    """Source-major, same bits as widening rows[index[d]] per destination; empty rows zero."""
    rng = np.random.default_rng(6)
    rows = rng.standard_normal((30, 17)).astype(ml_dtypes.bfloat16)
    index = rng.integers(-1, 30, 90)
    scale = rng.standard_normal(90).astype(np.float32)
    dot_with = rng.standard_normal((90, 17)).astype(ml_dtypes.bfloat16)
    out, dots = fused.scaled_rows_and_dots(rows, index, scale, dot_with)
    gathered = np.where((index >= 0)[:, None], rows.astype(np.float32)[np.maximum(index, 0)], 0)
    want = (gathered * scale[:, None]).astype(ml_dtypes.bfloat16)
    want[index < 0] = 0  # +0.0, whatever the sign of the scale
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    np.testing.assert_allclose(dots, (gathered * dot_with.astype(np.float32)).sum(axis=1), rtol=1e-5, atol=1e-5)
    assert (dots[index < 0] == 0).all()
