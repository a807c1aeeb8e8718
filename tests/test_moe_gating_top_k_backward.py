"""MoeGatingTopKBackward: against the chain rule written term by term in float64, against finite
differences of the forward kernel, session vs kernel, repeated experts, errors, target limits."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moe_onnx
from moe_onnx.custom_ops import TensorInfo, targets
from moe_onnx.custom_ops.moe_gating_top_k import moe_gating_top_k
from moe_onnx.custom_ops.moe_gating_top_k_backward import moe_gating_top_k_backward
from tests.references import FLOAT_DTYPES, f32, gating_backward_reference
from tests.support import assert_refused, assert_same_bits, run_node

OP = "MoeGatingTopKBackward"


@st.composite
def cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    tokens, experts = draw(st.integers(0, 6)), draw(st.integers(1, 10))
    top_k = draw(st.integers(1, experts))
    x_norm = (1 / (1 + np.exp(-rng.standard_normal((tokens, experts))))).astype(np.float32)
    if draw(st.booleans()):  # distinct experts, as the top-k gives them
        expert_idx = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    else:  # repeats, as a hash table may give them
        expert_idx = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
    grad_y = rng.standard_normal((tokens, top_k)).astype(draw(st.sampled_from(FLOAT_DTYPES)))
    attrs = {"routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])), "eps": draw(st.sampled_from([1e-20, 0.5]))}
    return x_norm, grad_y, expert_idx, attrs


@given(cases())
def test_kernel_matches_the_chain_rule(case):
    x_norm, grad_y, expert_idx, attrs = case
    (got,) = moe_onnx.OPS[OP](x_norm, grad_y, expert_idx, **attrs)
    want = gating_backward_reference(x_norm, grad_y, expert_idx, **attrs)
    assert got.dtype == grad_y.dtype and got.shape == x_norm.shape
    # float64 inside, rounded once to float32 (then to the dtype of grad_y)
    tolerance = 1e-6 if grad_y.dtype == np.float32 else 2**-7
    np.testing.assert_allclose(f32(got), want, rtol=tolerance, atol=1e-12)


@given(cases())
def test_session_matches_kernel(case):
    x_norm, grad_y, expert_idx, attrs = case
    (got,) = run_node(OP, {"x_norm": x_norm, "grad_y": grad_y, "expert_idx": expert_idx}, attrs)
    assert_same_bits(got, moe_gating_top_k_backward(x_norm, grad_y, expert_idx, **attrs)[0])


@pytest.mark.parametrize("seed", range(3))
def test_matches_finite_differences_of_the_forward(seed):
    """The gradient of MoeGatingTopK's y (sigmoid, grouped selection, bias) with the selection
    held fixed, by central differences of the forward kernel in float64-exact steps."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    bias = (rng.standard_normal(16) * 0.1).astype(np.float32)
    attrs = {
        "k": 4,
        "k_group": 2,
        "group_count": 4,
        "group_select_mode": 1,
        "norm_type": 1,
        "routed_scaling_factor": 2.5,
    }
    _, expert_idx, out = moe_gating_top_k(x, bias, **attrs)
    grad_y = rng.standard_normal((3, 4)).astype(np.float32)
    (grad_x,) = moe_gating_top_k_backward(out, grad_y, expert_idx, routed_scaling_factor=2.5)

    def loss(logits):
        s = 1 / (1 + np.exp(-logits))
        w = np.take_along_axis(s, expert_idx.astype(np.int64), axis=1)
        return float((grad_y * 2.5 * w / w.sum(axis=1, keepdims=True)).sum())

    step = 1e-6
    numeric = np.zeros(x.shape)
    for index in np.ndindex(x.shape):
        plus, minus = x.astype(np.float64), x.astype(np.float64)
        plus[index] += step
        minus[index] -= step
        numeric[index] = (loss(plus) - loss(minus)) / (2 * step)
    np.testing.assert_allclose(grad_x, numeric, rtol=1e-5, atol=1e-8)


def test_repeated_expert_gets_both_terms():
    """A hash row naming expert 1 twice: y = [s1, s1] / (2 s1) = [0.5, 0.5] whatever s1, so its
    gradient is zero; with one copy of the gradient only it is not."""
    x_norm = np.array([[0.2, 0.7, 0.4]], np.float32)
    expert_idx = np.array([[1, 1]], np.int32)
    (grad,) = moe_gating_top_k_backward(x_norm, np.ones((1, 2), np.float32), expert_idx)
    np.testing.assert_allclose(grad, 0, atol=1e-12)
    (grad,) = moe_gating_top_k_backward(x_norm, np.array([[1.0, 0.0]], np.float32), expert_idx)
    # d/dx1 of s1/(2 s1) * 1 = 0 too: both slots' terms cancel exactly
    np.testing.assert_allclose(grad, 0, atol=1e-12)
    (grad,) = moe_gating_top_k_backward(x_norm, np.array([[1.0, 0.0]], np.float32), np.array([[1, 2]], np.int32))
    want = gating_backward_reference(x_norm, np.array([[1.0, 0.0]]), np.array([[1, 2]]))
    np.testing.assert_allclose(grad, want, rtol=1e-6)
    assert grad[0, 0] == 0 and grad[0, 1] > 0 > grad[0, 2]


def test_doc_example_shape_and_dtype():
    """aclnnMoeGatingTopKBackward.md's example inputs: x_norm [4, 8], K = 2, factor 2.5."""
    x_norm = np.array(
        [
            [0.5, 0.7, 0.3, 0.8, 0.2, 0.6, 0.9, 0.4],
            [0.6, 0.4, 0.8, 0.1, 0.7, 0.5, 0.3, 0.9],
            [0.2, 0.9, 0.5, 0.6, 0.8, 0.3, 0.7, 0.4],
            [0.8, 0.3, 0.6, 0.5, 0.4, 0.7, 0.2, 0.9],
        ],
        np.float32,
    )
    grad_y = np.array([[1.0, 0.5], [0.8, 0.3], [0.6, 0.9], [0.4, 0.7]], np.float32)
    expert_idx = np.array([[3, 6], [2, 7], [1, 4], [0, 7]], np.int32)
    (grad,) = moe_gating_top_k_backward(x_norm, grad_y, expert_idx, routed_scaling_factor=2.5)
    np.testing.assert_allclose(grad, gating_backward_reference(x_norm, grad_y, expert_idx, 2.5), rtol=1e-6)
    assert np.count_nonzero(grad) == 8


# --- errors, targets ----------------------------------------------------------------------------

X_NORM = np.full((2, 4), 0.5, np.float32)
GRAD = np.ones((2, 2), np.float32)
IDX = np.array([[0, 1], [2, 3]], np.int32)


def run(x_norm=X_NORM, grad_y=GRAD, expert_idx=IDX, **attrs):
    return run_node(OP, {"x_norm": x_norm, "grad_y": grad_y, "expert_idx": expert_idx}, attrs)


def test_error_expert_out_of_range():
    bad = np.array([[0, 1], [4, 3]], np.int32)
    assert_refused(lambda: run(expert_idx=bad), 561002, "expert_idx must be in [0, E) = [0, 4), got 4 at [1, 0]")
    assert_refused(lambda: run(expert_idx=-IDX), 561002, "got -1 at [0, 1]")


def test_error_norm_type_other_than_sigmoid():
    assert_refused(lambda: run(norm_type=0), 561002, "'norm_type' must be one of [1], got 0")
    assert_refused(lambda: run(norm_type=2), 561002, "'norm_type' must be one of [1], got 2")


def test_error_shapes_and_dtypes():
    assert_refused(lambda: run(grad_y=np.ones((3, 2), np.float32)), 561002, "must have the same T (got 3 and 2)")
    assert_refused(
        lambda: run(expert_idx=IDX[:, :1]), 561002, "expert_idx and grad_y must have the same shape [T, K] (dim 1)"
    )
    assert_refused(lambda: run(x_norm=X_NORM.astype(np.float16)), 161002, "'x_norm' has dtype float16")
    assert_refused(lambda: run(expert_idx=IDX.astype(np.int64)), 161002, "'expert_idx' has dtype int64")


def test_target_limits():
    def check(tokens, experts, top_k):
        inputs = {
            "x_norm": TensorInfo("float32", (tokens, experts)),
            "grad_y": TensorInfo("bfloat16", (tokens, top_k)),
            "expert_idx": TensorInfo("int32", (tokens, top_k)),
        }
        return [v.split(": ", 1)[1] for v in targets.check(OP, inputs, {}, "ascend950")]

    assert check(2048, 192, 10) == []
    assert check(4, 1, 1) == ["E = 1 is outside [2, 2048]"]
    assert check(4, 4096, 8) == ["E = 4096 is outside [2, 2048]"]
    assert check(0, 8, 9) == ["empty tensors (T = 0) are not supported", "K = 9 is outside [1, E] = [1, 8]"]
