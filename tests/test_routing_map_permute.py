"""MoeTokenPermuteWithRoutingMap and its grad: kernels vs loop references, session vs
kernels, gradient = vector-Jacobian product of the forward, shape inference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_onnx.custom_ops.moe_token_permute_with_routing_map import moe_token_permute_with_routing_map
from moe_onnx.custom_ops.moe_token_permute_with_routing_map_grad import moe_token_permute_with_routing_map_grad
from tests.references import (
    COMBINATIONS,
    assert_same,
    combination,
    ids,
    jacobian,
    make_probs,
    make_routing,
    permute_grad_reference,
    permute_reference,
    routing_cases,
)
from tests.support import inferred_types, node_model, run_node

PERMUTE, PERMUTE_GRAD = "MoeTokenPermuteWithRoutingMap", "MoeTokenPermuteWithRoutingMapGrad"


@given(routing_cases())
def test_permute_matches_reference(case):
    tokens, routing_map, probs, rows, padded = case
    got = moe_token_permute_with_routing_map(tokens, routing_map, probs, num_out_tokens=rows, drop_and_pad=padded)
    for g, w in zip(got, permute_reference(tokens, routing_map, probs, rows, padded)):
        assert_same(g, w)


@given(routing_cases(), st.integers(0, 2**31))
def test_permute_grad_matches_reference(case, seed):
    tokens, routing_map, probs, rows, padded = case
    rng = np.random.default_rng(seed)
    _, sorted_indices, _ = moe_token_permute_with_routing_map(
        tokens, routing_map, None, num_out_tokens=rows, drop_and_pad=padded
    )
    rows_grad = rng.standard_normal((rows, tokens.shape[1])).astype(tokens.dtype)
    probs_grad_in = None if probs is None else rng.standard_normal(rows).astype(probs.dtype)
    n_tokens, n_experts = routing_map.shape
    got = moe_token_permute_with_routing_map_grad(
        rows_grad, probs_grad_in, sorted_indices, routing_map, drop_and_pad=padded
    )
    want = permute_grad_reference(rows_grad, probs_grad_in, sorted_indices, routing_map, n_tokens, n_experts, padded)
    for g, w in zip(got, want):
        assert_same(g, w)


# --- every dtype combination through the session --------------------------------------------


@pytest.mark.parametrize("dtype, map_dtype, probs_kind, padded", COMBINATIONS, ids=ids)
def test_session_matches_kernels(dtype, map_dtype, probs_kind, padded):
    rng, tokens, routing_map, probs, rows = combination(dtype, map_dtype, probs_kind, padded)
    attrs = {"num_out_tokens": rows, "drop_and_pad": padded}
    outputs = None if probs is not None else ["permuted_tokens", "sorted_indices", ""]
    got = run_node(PERMUTE, {"tokens": tokens, "routing_map": routing_map, "probs": probs}, attrs, outputs)
    want = [w for w in moe_token_permute_with_routing_map(tokens, routing_map, probs, **attrs) if w is not None]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)

    rows_grad = rng.standard_normal((rows, tokens.shape[1])).astype(dtype)
    probs_grad_in = None if probs is None else rng.standard_normal(rows).astype(probs.dtype)
    grad_inputs = {
        "permuted_tokens_grad": rows_grad,
        "permuted_probs_grad": probs_grad_in,
        "sorted_indices": got[1],
        "routing_map": routing_map,
    }
    got = run_node(
        PERMUTE_GRAD, grad_inputs, {"drop_and_pad": padded}, None if probs is not None else ["tokens_grad", ""]
    )
    want = [
        w for w in moe_token_permute_with_routing_map_grad(*grad_inputs.values(), drop_and_pad=padded) if w is not None
    ]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)
    if probs is not None:
        assert got[1].dtype == probs.dtype  # mixed precision: probs_grad keeps the probs dtype


def test_grad_without_routing_map_takes_sizes_from_attributes():
    rng, tokens, routing_map, probs, rows = combination(np.float32, np.bool_, "same", 1, seed=3)
    _, sorted_indices, _ = moe_token_permute_with_routing_map(
        tokens, routing_map, probs, num_out_tokens=rows, drop_and_pad=1
    )
    rows_grad = rng.standard_normal((rows, tokens.shape[1])).astype(np.float32)
    probs_grad_in = rng.standard_normal(rows).astype(np.float32)
    inputs = {"permuted_tokens_grad": rows_grad, "permuted_probs_grad": probs_grad_in, "sorted_indices": sorted_indices}
    attrs = {"drop_and_pad": 1, "tokens_num": 6, "experts_num": 4}
    got = run_node(PERMUTE_GRAD, inputs, attrs)
    want = moe_token_permute_with_routing_map_grad(
        rows_grad, probs_grad_in, sorted_indices, routing_map, drop_and_pad=1
    )
    for g, w in zip(got, want):
        assert_same(g, w)


# --- the grad is the vector-Jacobian product of the forward ------------------------------


@pytest.mark.parametrize("padded", [0, 1])
@pytest.mark.parametrize("seed", range(4))
def test_permute_grad_is_vjp(padded, seed):
    """Float64 through the bare kernels (the ONNX schema takes no float64)."""
    rng = np.random.default_rng(seed)
    n_tokens, n_experts, hidden, top_k = 5, 4, 3, 2
    routing_map = make_routing(rng, n_tokens, n_experts, None if padded else top_k)
    rows = n_experts * 3 if padded else n_tokens * top_k
    tokens = rng.standard_normal((n_tokens, hidden))
    probs = rng.random((n_tokens, n_experts))

    def permute(tokens, probs):
        return moe_token_permute_with_routing_map(tokens, routing_map, probs, num_out_tokens=rows, drop_and_pad=padded)

    j_tokens = jacobian(lambda x: permute(x, probs)[0], tokens)
    j_probs = jacobian(lambda p: permute(tokens, p)[2], probs)
    sorted_indices = permute(tokens, probs)[1]
    rows_grad, probs_rows_grad = rng.standard_normal((rows, hidden)), rng.standard_normal(rows)
    tokens_grad, probs_grad = moe_token_permute_with_routing_map_grad(
        rows_grad, probs_rows_grad, sorted_indices, routing_map, drop_and_pad=padded
    )
    assert tokens_grad.dtype == probs_grad.dtype == np.float64
    np.testing.assert_allclose(tokens_grad.ravel(), j_tokens.T @ rows_grad.ravel(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(probs_grad.ravel(), j_probs.T @ probs_rows_grad, rtol=1e-12, atol=1e-12)
    if padded:  # the VJP reaches the unrouted tokens that filled empty slots, as it must
        assert np.abs(j_tokens).sum() == rows * hidden


# --- larger shapes: the chunked paths ---------------------------------------------------------


@pytest.mark.parametrize("padded", [0, 1])
def test_many_rows_bfloat16(padded):
    """More rows than one chunk, so the kernels' chunk boundaries are crossed."""
    rng = np.random.default_rng(11)
    n_tokens, n_experts, hidden, top_k = 300, 16, 1100, 8
    routing_map = make_routing(rng, n_tokens, n_experts, top_k)
    tokens = rng.standard_normal((n_tokens, hidden)).astype(ml_dtypes.bfloat16)
    probs = make_probs(rng, routing_map, np.float32)
    rows = n_tokens * top_k  # padded: capacity 150 of 300 tokens
    got = moe_token_permute_with_routing_map(tokens, routing_map, probs, num_out_tokens=rows, drop_and_pad=padded)
    want = permute_reference(tokens, routing_map, probs, rows, padded)
    for g, w in zip(got, want):
        assert_same(g, w)
    rows_grad = rng.standard_normal((rows, hidden)).astype(ml_dtypes.bfloat16)
    got = moe_token_permute_with_routing_map_grad(rows_grad, want[2], want[1], routing_map, drop_and_pad=padded)
    want = permute_grad_reference(rows_grad, want[2], want[1], routing_map, n_tokens, n_experts, padded)
    for g, w in zip(got, want):
        assert_same(g, w)


# --- shape inference ------------------------------------------------------------------------

BF16, F32, I32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.INT32


@pytest.mark.parametrize("padded", [0, 1])
def test_shape_inference_symbolic(padded):
    tokens = np.ones((6, 5), ml_dtypes.bfloat16)
    routing_map = np.zeros((6, 4), bool)
    probs = np.ones((6, 4), np.float32)
    model = node_model(
        PERMUTE,
        {"tokens": tokens, "routing_map": routing_map, "probs": probs},
        {"num_out_tokens": 12, "drop_and_pad": padded},
        symbolic=True,
    )
    del model.graph.output[:]
    out = inferred_types(model)
    assert out["permuted_tokens"] == (BF16, [12, "tokens_1"])
    assert out["sorted_indices"] == (I32, [12])
    assert out["permuted_probs"] == (F32, [12])

    grad = {
        "permuted_tokens_grad": np.ones((12, 5), ml_dtypes.bfloat16),
        "permuted_probs_grad": np.ones(12, np.float32),
        "sorted_indices": np.zeros(12, np.int32),
        "routing_map": routing_map,
    }
    model = node_model(PERMUTE_GRAD, grad, {"drop_and_pad": padded}, symbolic=True)
    del model.graph.output[:]
    out = inferred_types(model)
    assert out["tokens_grad"] == (BF16, ["routing_map_0", "permuted_tokens_grad_1"])
    assert out["probs_grad"] == (F32, ["routing_map_0", "routing_map_1"])


def test_shape_inference_grad_from_attributes_without_probs():
    grad = {
        "permuted_tokens_grad": np.ones((12, 5), np.float16),
        "permuted_probs_grad": None,
        "sorted_indices": np.zeros(12, np.int32),
    }
    model = node_model(PERMUTE_GRAD, grad, {"tokens_num": 6}, outputs=["tokens_grad", ""])
    assert inferred_types(model)["tokens_grad"] == (onnx.TensorProto.FLOAT16, [6, 5])


def test_shape_inference_rejects_rows_that_do_not_divide():
    model = node_model(
        PERMUTE,
        {"tokens": np.ones((6, 5), np.float32), "routing_map": np.zeros((6, 4), bool)},
        {"num_out_tokens": 12},
        outputs=["a", "b", ""],
    )
    model.graph.node[0].attribute[0].i = 13
    with pytest.raises(Exception, match="multiple of T"):
        onnx.shape_inference.infer_shapes(model, strict_mode=True)


def test_checker_accepts_models():
    model = node_model(
        PERMUTE,
        {
            "tokens": np.ones((6, 5), np.float32),
            "routing_map": np.zeros((6, 4), np.int8),
            "probs": np.ones((6, 4), np.float32),
        },
        {"num_out_tokens": 12},
    )
    onnx.checker.check_model(model, full_check=True)
