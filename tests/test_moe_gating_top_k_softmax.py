"""MoeGatingTopKSoftmax: kernel vs the loop reference, session vs kernel, ties, finished rows,
row_idx, errors, shape inference, target limits."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.custom_ops import targets
from moe_onnx.custom_ops.moe_gating_top_k_softmax import moe_gating_top_k_softmax
from tests.references import FLOAT_DTYPES, assert_same, gating_softmax_reference
from tests.support import assert_refused, assert_same_bits, inferred_types, node_model, run_node

OP = "MoeGatingTopKSoftmax"


def tied_logits(rng, shape, dtype):
    """Logits on a coarse grid: many exact ties inside a row (and at the k-th place)."""
    return (rng.integers(-6, 7, shape) / 4).astype(np.float32).astype(dtype)


@st.composite
def cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    experts = draw(st.integers(1, 12))
    lead = draw(st.sampled_from([(draw(st.integers(0, 6)),), (draw(st.integers(1, 3)), draw(st.integers(0, 4)))]))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    shape = lead + (experts,)
    x = tied_logits(rng, shape, dtype) if draw(st.booleans()) else rng.standard_normal(shape).astype(dtype)
    finished = (rng.random(lead) < 0.3) if draw(st.booleans()) else None
    return x, finished, draw(st.integers(1, experts))


@given(cases())
def test_kernel_matches_reference(case):
    x, finished, k = case
    got = moe_onnx.OPS[OP](x, finished, k=k)
    for g, w in zip(got, gating_softmax_reference(x, finished, k)):
        assert_same(g, w)


@given(cases())
def test_session_matches_kernel(case):
    x, finished, k = case
    got = run_node(OP, {"x": x, "finished": finished}, {"k": k})
    for g, w in zip(got, moe_gating_top_k_softmax(x, finished, k=k)):
        assert_same_bits(g, w)


def test_doc_example_and_row_idx():
    """aclnnMoeGatingTopKSoftmax.md's example: x [3, 4] = 0.1 .. 11.1, k = 2; row_idx is
    arange(6).reshape(2, 3).T, the column-major slot."""
    x = (np.arange(12, dtype=np.float32) + 0.1).reshape(3, 4)
    y, expert_idx, row_idx = moe_gating_top_k_softmax(x, k=2)
    assert expert_idx.tolist() == [[3, 2]] * 3
    assert row_idx.tolist() == [[0, 3], [1, 4], [2, 5]]
    e = np.exp(np.arange(4.0) - 3)
    np.testing.assert_allclose(y[0], (e / e.sum())[[3, 2]], rtol=1e-6)


def test_ties_go_to_the_lower_expert():
    x = np.array([[1, 3, 3, 0, 3], [2, 2, 2, 2, 2]], np.float32)
    _, expert_idx, _ = moe_gating_top_k_softmax(x, k=4)
    assert expert_idx.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3]]


def test_finished_rows_get_the_sentinel_and_keep_y():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 6)).astype(ml_dtypes.bfloat16)
    finished = np.array([[True, False, False], [False, False, True]])
    y, expert_idx, row_idx = moe_gating_top_k_softmax(x, finished, k=2)
    plain_y, plain_idx, _ = moe_gating_top_k_softmax(x, k=2)
    assert (expert_idx[finished] == 6).all() and np.array_equal(expert_idx[~finished], plain_idx[~finished])
    assert_same_bits(y, plain_y)
    # 3-D: the rows flatten to n = B*S = 6, row r = b*S + s
    assert row_idx[1, 2].tolist() == [5, 11]


def test_non_finite_logits():
    """A NaN or an infinity makes the softmax row NaN (exp(x - max) with max = inf gives
    inf - inf): the NaN probabilities rank as -inf, so the first experts are chosen."""
    x = np.array([[0, np.nan, 1, 2], [np.inf, 0, 1, 2], [-np.inf] * 4, [-np.inf, 0, -np.inf, 1]], np.float32)
    y, expert_idx, _ = moe_gating_top_k_softmax(x, k=2)
    assert np.isnan(y[:3]).all() and expert_idx[:3].tolist() == [[0, 1]] * 3
    assert expert_idx[3].tolist() == [3, 1] and y[3, 1] == np.float32(1 / (1 + np.e))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_qwen3_shape_session_bit_identical(dtype):
    """Big enough to split over threads: the same bits as the reference."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2048, 128)).astype(dtype)
    got = run_node(OP, {"x": x, "finished": None}, {"k": 8})
    for g, w in zip(got, gating_softmax_reference(x, None, 8)):
        assert_same(g, w)


def test_zero_rows():
    y, expert_idx, row_idx = run_node(OP, {"x": np.zeros((0, 4), np.float16), "finished": None}, {"k": 3})
    assert y.shape == expert_idx.shape == row_idx.shape == (0, 3) and y.dtype == np.float16


# --- errors -------------------------------------------------------------------------------------


def run(x=None, finished=None, **attrs):
    x = np.ones((3, 4), np.float32) if x is None else x
    return run_node(OP, {"x": x, "finished": finished}, attrs)


def test_error_k_above_experts():
    assert_refused(lambda: run(k=5), 561002, "k must be <= E = 4 (the last dim of x), got 5", "node 'node'")


def test_error_k_below_one():
    assert_refused(lambda: run(k=0), 561002, "k must be >= 1, got 0")


def test_error_rank():
    assert_refused(lambda: run(np.ones(4, np.float32)), 561002, "'x' must have rank 2 or 3")
    assert_refused(lambda: run(np.ones((1, 2, 3, 4), np.float32)), 561002, "'x' must have rank 2 or 3")


def test_error_finished_shape():
    assert_refused(
        lambda: run(finished=np.zeros((3, 1), bool)),
        561002,
        "finished must have the shape of x without its last dim [3], got [3, 1]",
    )
    assert_refused(lambda: run(finished=np.zeros(2, bool)), 561002, "finished dim 0 must equal x dim 0 (got 2 and 3)")


def test_error_dtypes():
    assert_refused(lambda: run(finished=np.zeros(3, np.int8)), 161002, "'finished' has dtype int8")
    assert_refused(lambda: run(np.ones((3, 4), np.float64)), 161002, "'x' has dtype float64")


# --- shape inference, checker, targets ----------------------------------------------------------


def test_shape_inference_symbolic():
    node = helper.make_node(OP, ["x"], ["y", "i", "r"], domain=moe_onnx.DOMAIN, k=2)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["B", "S", 16])], []
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    out = inferred_types(model)
    assert out["y"] == (TensorProto.BFLOAT16, ["B", "S", 2])
    assert out["i"] == (TensorProto.INT32, ["B", "S", 2]) and out["r"] == (TensorProto.INT32, ["B", "S", 2])


def test_checker_accepts_model():
    model = node_model(OP, {"x": np.ones((4, 8), np.float16), "finished": np.zeros(4, bool)}, {"k": 2})
    onnx.checker.check_model(model, full_check=True)


def test_target_limits():
    info = moe_onnx.custom_ops.TensorInfo
    assert targets.check(OP, {"x": info("float32", (4096, 128))}, {"k": 8}, "ascend910b") == []
    assert targets.check(OP, {"x": info("float32", (8, 5120))}, {"k": 1025}, "ascend910b") == [
        "MoeGatingTopKSoftmax on ascend910b: k = 1025 exceeds 1024"
    ]
    assert targets.check(OP, {"x": info("float32", (8, 5120))}, {"k": 8}, "ascend910b") == []
    assert targets.check(OP, {"x": info("float32", (2, 8, 2049))}, {"k": 8}, "ascend950") == [
        "MoeGatingTopKSoftmax on ascend950: E = 2049 exceeds 2048 (the last dim of x)"
    ]


@pytest.mark.parametrize("experts, k, float16_ranking", [(16, 8, False), (6, 4, False), (12, 2, True), (16, 9, True)])
def test_float16_outside_the_fast_template_ranks_float16_probabilities(experts, k, float16_ranking):
    """SPEC-layer 1.13 (b) amended: two logits whose softmax values differ in float32 but are
    equal in float16 go to the lower expert outside the NPU's fast template (E <= 1024,
    E % 8 == 0 and k <= 8, or E < 8), and to the larger float32 value inside it."""
    x = np.full((1, experts), -8.0, np.float16)
    x[0, 0], x[0, 1] = np.float16(0.0), np.float16(2**-14)  # probabilities 3e-5 apart near 0.5
    probs32 = np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum()
    assert probs32[0, 1] > probs32[0, 0] and np.float16(probs32[0, 1]) == np.float16(probs32[0, 0])
    y, expert_idx, _ = moe_gating_top_k_softmax(x, k=k)
    assert expert_idx[0, :2].tolist() == ([0, 1] if float16_ranking else [1, 0])
    assert y[0, 0] == np.float16(probs32[0, 1])
    got = run_node("MoeGatingTopKSoftmax", {"x": x}, {"k": k})
    assert_same_bits(got[1], expert_idx)
