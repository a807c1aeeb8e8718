"""MoeTokenUnpermute and MoeTokenUnpermuteGrad (SPEC 1.12): kernel against loop references
written from the SPEC, the gradient against the forward's vector-Jacobian product, sessions
against the kernel, the rules real callers rely on (cut-off rows, prob 0 over a NaN row,
repeated rows after ``abs()``), errors and the target check's flag."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moe_onnx
from moe_onnx.custom_ops import TensorInfo, targets
from tests.references import (
    FLOAT_DTYPES,
    assert_same,
    f32,
    jacobian,
    token_unpermute_grad_reference,
    token_unpermute_reference,
)
from tests.support import assert_refused, assert_same_bits, run_node

UNPERMUTE = moe_onnx.OPS["MoeTokenUnpermute"]
UNPERMUTE_GRAD = moe_onnx.OPS["MoeTokenUnpermuteGrad"]


@st.composite
def unpermute_cases(draw):
    """(permuted [A, H], sorted_indices [T*K], probs [T, K] or None): a permutation of the slots'
    rows, cut to A rows, or any rows (repeats), some probs exactly 0."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    n_tokens, top_k, hidden = draw(st.integers(0, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    with_probs = draw(st.booleans())
    top_k = top_k if with_probs else 1
    slots = n_tokens * top_k
    rows = draw(st.integers(0, slots + 2))
    if draw(st.booleans()):
        sorted_indices = rng.permutation(slots)
    else:
        sorted_indices = rng.integers(0, max(rows, 1) + 1, slots)
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    permuted = rng.standard_normal((rows, hidden)).astype(dtype)
    probs = None
    if with_probs:
        probs = (rng.random((n_tokens, top_k)) * (rng.random((n_tokens, top_k)) < 0.8)).astype(
            draw(st.sampled_from(FLOAT_DTYPES))
        )
    return permuted, sorted_indices.astype(np.int32), probs


@given(unpermute_cases())
def test_unpermute_matches_reference(case):
    permuted, sorted_indices, probs = case
    (got,) = UNPERMUTE(permuted, sorted_indices, probs)
    assert_same(got, token_unpermute_reference(permuted, sorted_indices, probs))


@given(unpermute_cases(), st.booleans())
def test_unpermute_grad_matches_reference(case, give_rows):
    permuted, sorted_indices, probs = case
    rows = len(permuted)
    grad = (
        np.random.default_rng(2)
        .standard_normal((len(sorted_indices) // (1 if probs is None else probs.shape[1]), permuted.shape[1]))
        .astype(permuted.dtype)
    )
    keep = probs is not None or give_rows
    got_rows, got_probs = UNPERMUTE_GRAD(
        permuted if keep else None, grad, sorted_indices, probs, **({} if keep else {"permuted_tokens_num": rows})
    )
    want_rows, want_probs = token_unpermute_grad_reference(grad, sorted_indices, rows, permuted, probs)
    assert_same(got_rows, want_rows)
    if probs is None:
        assert got_probs is None
    else:
        assert got_probs.dtype == probs.dtype
        np.testing.assert_allclose(
            f32(got_probs), f32(want_probs), rtol=2e-2 if probs.itemsize == 2 else 1e-5, atol=1e-5
        )


def test_grad_is_the_vector_jacobian_product_of_the_forward():
    """float64 through the bare kernels: the gradient in permuted_tokens is J^T g of the forward
    (linear in permuted_tokens), that in probs the forward's partial derivatives."""
    rng = np.random.default_rng(4)
    n_tokens, top_k, hidden, rows = 4, 3, 2, 10
    sorted_indices = np.array([0, 3, 9, 1, 4, 12, 2, 5, 8, 6, 6, 11], np.int32)  # a repeat, two cut off
    probs = rng.random((n_tokens, top_k))
    probs[1, 1] = 0.0
    permuted = rng.standard_normal((rows, hidden))
    grad = rng.standard_normal((n_tokens, hidden))
    forward = UNPERMUTE.kernel
    j = jacobian(lambda x: forward(x, sorted_indices, probs)[0], permuted)
    got_rows, got_probs = UNPERMUTE_GRAD.kernel(permuted, grad, sorted_indices, probs)
    np.testing.assert_allclose(got_rows.reshape(-1), j.T @ grad.reshape(-1), rtol=1e-12, atol=1e-12)
    # d out[t] / d probs[t, j] = permuted[d] (0 when d >= A), also for a zero prob
    for t in range(n_tokens):
        for k in range(top_k):
            d = sorted_indices[t * top_k + k]
            want = 0.0 if d >= rows else float(grad[t] @ permuted[d])
            assert got_probs[t, k] == pytest.approx(want, abs=1e-12)


def test_cut_off_rows_and_zero_probs_add_nothing():
    """A row >= A (num_out_tokens cut it) and a slot of prob 0 are not read: NaN stays out (the
    NPU kernel's ``needCopyIn = idx < num_out_tokens && prob != 0``)."""
    permuted = np.array([[1.0, 2.0], [np.nan, np.inf], [4.0, 8.0]], np.float32)
    sorted_indices = np.array([0, 1, 2, 5], np.int32)
    probs = np.array([[0.5, 0.0], [0.25, 1.0]], np.float32)
    (out,) = UNPERMUTE(permuted, sorted_indices, probs)
    assert np.array_equal(out, [[0.5, 1.0], [1.0, 2.0]])
    (plain,) = UNPERMUTE(permuted, sorted_indices)
    assert np.array_equal(plain[[0, 2, 3]], [[1, 2], [4, 8], [0, 0]]) and np.isnan(plain[1, 0])


def test_abs_of_dropped_slots_reads_row_one_with_prob_zero():
    """vllm-ascend's AllGather combine: ``npu_moe_token_unpermute(x, abs(expanded_row_idx), probs)``
    after a partial expert range, whose -1 slots get probability 0."""
    rng = np.random.default_rng(8)
    rows = rng.standard_normal((5, 3)).astype(ml_dtypes.bfloat16)
    expanded_row_idx = np.array([0, -1, 3, -1, 1, 2], np.int32)  # slots of non-local experts: -1
    probs = rng.random((3, 2)).astype(np.float32)
    masked = np.where(expanded_row_idx.reshape(3, 2) < 0, 0, probs).astype(np.float32)
    (out,) = UNPERMUTE(rows, np.abs(expanded_row_idx), masked)
    want = np.stack([probs[0, 0] * f32(rows[0]), probs[1, 0] * f32(rows[3]), probs[2, 0] * f32(rows[1])])
    want[2] += probs[2, 1] * f32(rows[2])
    assert_same(out, want.astype(ml_dtypes.bfloat16))
    (grad_rows, grad_probs) = UNPERMUTE_GRAD(
        rows, np.ones((3, 3), ml_dtypes.bfloat16), np.abs(expanded_row_idx), masked
    )
    assert np.array_equal(f32(grad_rows[4]), [0, 0, 0])  # row 4 is read by no slot
    assert f32(grad_probs)[0, 1] == pytest.approx(float(f32(rows[1]).sum()), rel=1e-2)  # d out / d prob: row 1


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize(
    "probs_dtype", [None, *FLOAT_DTYPES], ids=lambda d: "no-probs" if d is None else np.dtype(d).name
)
def test_sessions_match_kernel(dtype, probs_dtype):
    rng = np.random.default_rng(9)
    top_k = 1 if probs_dtype is None else 3
    n_tokens, hidden = 5, 4
    sorted_indices = rng.permutation(n_tokens * top_k).astype(np.int32)
    permuted = rng.standard_normal((n_tokens * top_k - 2, hidden)).astype(dtype)  # two slots cut off
    probs = None if probs_dtype is None else rng.random((n_tokens, top_k)).astype(probs_dtype)
    inputs = {"permuted_tokens": permuted, "sorted_indices": sorted_indices, "probs": probs}
    (got,) = run_node("MoeTokenUnpermute", inputs, {"restore_shape": [n_tokens, hidden]})
    assert_same_bits(got, UNPERMUTE(permuted, sorted_indices, probs)[0])
    grad = rng.standard_normal(got.shape).astype(dtype)
    inputs = {
        "permuted_tokens": permuted if probs is not None else None,
        "unpermuted_tokens_grad": grad,
        "sorted_indices": sorted_indices,
        "probs": probs,
    }
    attrs = {} if probs is not None else {"permuted_tokens_num": len(permuted)}
    outputs = ["permuted_tokens_grad", "probs_grad" if probs is not None else ""]
    got_grad = run_node("MoeTokenUnpermuteGrad", inputs, attrs, outputs)
    want = [w for w in UNPERMUTE_GRAD(*inputs.values(), **attrs) if w is not None]
    assert len(got_grad) == len(want)
    for g, w in zip(got_grad, want):
        assert_same_bits(g, w)


def test_grad_rows_default_to_the_index_length():
    """Without permuted_tokens nor permuted_tokens_num, A = len(sorted_indices) (the NPU's
    InferShape); without probs each row is a bit-exact copy of its slot's gradient."""
    grad = np.array([[np.nan, -0.0], [1.0, 2.0], [3.0, 4.0]], np.float32)
    grad.view(np.uint32)[0, 0] = 0x7FC01234  # a NaN payload, kept by a copy
    rows, probs_grad = UNPERMUTE_GRAD(None, grad, np.array([2, 0, 1], np.int32))
    assert probs_grad is None
    assert_same_bits(rows, grad[[1, 2, 0]])
    assert UNPERMUTE_GRAD(None, grad, np.array([2, 0, 1], np.int32), permuted_tokens_num=5)[0].shape == (5, 2)


# --- errors ------------------------------------------------------------------------------------


def test_errors():
    permuted, index = np.ones((6, 2), np.float32), np.arange(6, dtype=np.int32)
    probs = np.ones((3, 2), np.float32)

    def run(permuted=permuted, index=index, probs=probs, **attrs):
        return run_node(
            "MoeTokenUnpermute", {"permuted_tokens": permuted, "sorted_indices": index, "probs": probs}, attrs
        )

    assert_refused(lambda: run(padded_mode=1), 561002, "padded_mode=1 is not supported")
    assert_refused(lambda: run(probs=np.ones((3, 4), np.float32)), 561002, "multiple of K", "got 6 rows for 4")
    assert_refused(lambda: run(probs=np.ones((2, 2), np.float32)), 561002, "T*K = len(sorted_indices) (got 2 and 3)")
    assert_refused(lambda: run(index=index - 1), 561002, "sorted_indices must be >= 0", "got -1 at slot 0")
    assert_refused(lambda: run(index=index.reshape(3, 2)), 561002, "'sorted_indices' must have rank 1")
    assert_refused(lambda: run(probs=np.ones((3, 2), np.float64)), 161002, "'probs' has dtype float64")


def test_grad_errors():
    grad, index, probs = np.ones((3, 2), np.float32), np.arange(6, dtype=np.int32), np.ones((3, 2), np.float32)
    rows = np.ones((6, 2), np.float32)

    def run(permuted=rows, grad=grad, index=index, probs=probs, **attrs):
        inputs = {"permuted_tokens": permuted, "unpermuted_tokens_grad": grad, "sorted_indices": index, "probs": probs}
        outputs = ["permuted_tokens_grad", "probs_grad" if probs is not None else ""]
        return run_node("MoeTokenUnpermuteGrad", inputs, attrs, outputs)

    assert_refused(lambda: run(permuted=None), 561002, "input permuted_tokens is required with probs")
    assert_refused(lambda: run(grad=np.ones((4, 2), np.float32)), 561002, "probs [T, K] must have T = ")
    assert_refused(lambda: run(probs=None), 561002, "len(sorted_indices) must equal T*K", "got 6 and 3")
    assert_refused(lambda: run(permuted=np.ones((6, 2), np.float16)), 161002, "permuted_tokens must have the dtype")
    assert_refused(lambda: run(permuted_tokens_num=5), 561002, "permuted_tokens_num must equal A", "got 6 and 5")
    assert_refused(lambda: run(permuted_tokens_num=-2), 561002, "permuted_tokens_num must be >= 0")
    assert_refused(lambda: run(index=index - 3), 561002, "sorted_indices must be >= 0")
    assert_refused(lambda: run(padded_mode=1), 561002, "padded_mode=1 is not supported")


def test_target_check_flags_repeated_rows_only():
    inputs = {
        "permuted_tokens": np.ones((4, 2), np.float32),
        "unpermuted_tokens_grad": np.ones((2, 2), np.float32),
        "sorted_indices": np.array([0, 1, 1, 3], np.int32),
        "probs": np.ones((2, 2), np.float32),
    }
    (message,) = targets.check("MoeTokenUnpermuteGrad", inputs, {}, "ascend910b")
    assert "names row 1 2 times" in message and "the last write wins" in message
    inputs["sorted_indices"] = np.array([0, 1, 7, 3], np.int32)  # a cut-off row is no repeat
    assert targets.check("MoeTokenUnpermuteGrad", inputs, {}, "ascend910b") == []
    as_info = {k: TensorInfo.of(v) for k, v in inputs.items()}  # shapes only: no value to judge
    assert targets.check("MoeTokenUnpermuteGrad", as_info, {}, "ascend950") == []
    big_k = {"permuted_tokens": np.ones((513, 1)), "sorted_indices": np.zeros(513, np.int32)}
    big_k["probs"] = TensorInfo("float32", (1, 513))
    assert targets.check("MoeTokenUnpermute", big_k, {}, "ascend910b") == [
        "MoeTokenUnpermute on ascend910b: K = 513 exceeds 512"
    ]
