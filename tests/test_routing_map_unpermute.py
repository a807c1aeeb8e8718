"""MoeTokenUnpermuteWithRoutingMap and its grad: kernels vs loop references, session vs
kernels, gradient = vector-Jacobian product of the forward, round trips, the seed example."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import helper

import moe_onnx
from moe_onnx.custom_ops.moe_token_permute_with_routing_map import moe_token_permute_with_routing_map
from moe_onnx.custom_ops.moe_token_unpermute_with_routing_map import moe_token_unpermute_with_routing_map
from moe_onnx.custom_ops.moe_token_unpermute_with_routing_map_grad import moe_token_unpermute_with_routing_map_grad
from tests.references import (
    COMBINATIONS,
    assert_same,
    combination,
    f32,
    ids,
    jacobian,
    make_probs,
    make_routing,
    routing_cases,
    routing_with_unused_slots,
    unpermute_grad_reference,
    unpermute_reference,
)
from tests.support import inferred_types, run_node

UNPERMUTE, UNPERMUTE_GRAD = "MoeTokenUnpermuteWithRoutingMap", "MoeTokenUnpermuteWithRoutingMapGrad"


def permuted_case(case):
    """The permute's outputs for a random case: what the unpermute is fed."""
    tokens, routing_map, probs, rows, padded = case
    permuted, sorted_indices, _ = moe_token_permute_with_routing_map(
        tokens, routing_map, None, num_out_tokens=rows, drop_and_pad=padded
    )
    return permuted, sorted_indices


@given(routing_cases())
def test_unpermute_matches_reference(case):
    tokens, routing_map, probs, rows, padded = case
    permuted, sorted_indices = permuted_case(case)
    n_tokens = tokens.shape[0]
    got = moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, routing_map, probs, padded_mode=padded, restore_shape=list(tokens.shape)
    )
    want = unpermute_reference(permuted, sorted_indices, routing_map, probs, padded, n_tokens)
    for g, w in zip(got, want):
        assert_same(g, w)


@given(routing_cases(), st.integers(0, 2**31))
def test_unpermute_grad_matches_reference(case, seed):
    tokens, routing_map, probs, rows, padded = case
    permuted, sorted_indices = permuted_case(case)
    _, out_index, token_id, _ = moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, routing_map, probs, padded_mode=padded, restore_shape=list(tokens.shape)
    )
    grad = np.random.default_rng(seed).standard_normal(tokens.shape).astype(tokens.dtype)
    with_probs = probs is not None
    got = moe_token_unpermute_with_routing_map_grad(
        grad, out_index, token_id, routing_map, permuted if with_probs else None, probs, drop_and_pad=padded
    )
    want = unpermute_grad_reference(grad, out_index, token_id, routing_map, permuted, probs, padded)
    assert_same(got[0], want[0])
    if with_probs:  # the float32 dot may add in another order than the float64 reference
        assert got[1].dtype == want[1].dtype == probs.dtype and got[1].shape == want[1].shape
        tolerance = {np.dtype(np.float32): 1e-5}.get(probs.dtype, 1e-2)
        np.testing.assert_allclose(f32(got[1]), f32(want[1]), rtol=tolerance, atol=tolerance)
    else:
        assert got[1] is None


def test_empty_slots_are_skipped():
    """Negative token ids (empty slots) contribute nothing and receive zero gradient."""
    permuted = np.arange(12, dtype=np.float32).reshape(6, 2)
    sorted_indices = np.array([1, -1, 0, 1, -1, -1], np.int32)  # padded, E = 2, C = 3
    routing_map = np.array([[1, 1], [1, 0]], np.int8)
    probs = np.array([[0.5, 2], [4, 8]], np.float32)
    unpermuted, out_index, token_id, row_probs = moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, routing_map, probs, padded_mode=1
    )
    assert token_id.tolist() == [-1, -1, -1, 0, 1, 1] and out_index.tolist() == [1, 4, 5, 2, 0, 3]
    assert row_probs.tolist() == [4, 0, 0.5, 8, 0, 0]
    assert unpermuted.tolist() == [[0.5 * 4, 0.5 * 5], [4 * 0 + 8 * 6, 4 * 1 + 8 * 7]]
    grad = np.array([[1, 1], [1, 2]], np.float32)
    rows_grad, probs_grad = moe_token_unpermute_with_routing_map_grad(
        grad, out_index, token_id, routing_map, permuted, probs, drop_and_pad=1
    )
    assert rows_grad.tolist() == [[4, 8], [0, 0], [0.5, 0.5], [8, 16], [0, 0], [0, 0]]
    assert probs_grad.tolist() == [[4 + 5, 0], [0 + 2, 6 + 14]]


def test_grad_not_padded_takes_the_token_from_the_slot_and_skips_negative_out_index():
    """SPEC 1.6 amended: not padded, slot i's token is i // K, ``permute_token_id`` is not read
    (torch_npu and MindSpeed pass ``sorted_indices`` there), a negative out_index is skipped."""
    grad = np.array([[1, 2], [3, 4]], np.float32)
    permuted = np.arange(8, dtype=np.float32).reshape(4, 2)
    routing_map = np.array([[1, 1], [1, 1]], bool)  # rows: (t0, e0), (t1, e0), (t0, e1), (t1, e1)
    probs = np.array([[2, 3], [5, 7]], np.float32)
    out_index = np.array([0, -1, 1, 3], np.int32)  # slot 1 (token 0's second) unused: row 2 gets nothing
    for token_id in (np.array([0, -1, 1, 1], np.int32), out_index, np.array([9, 9, -5, 9], np.int32)):
        rows_grad, probs_grad = moe_token_unpermute_with_routing_map_grad(
            grad, out_index, token_id, routing_map, permuted, probs
        )
        assert rows_grad.tolist() == [[2, 4], [15, 20], [0, 0], [21, 28]]
        assert probs_grad.tolist() == [[0 * 1 + 1 * 2, 0], [3 * 2 + 4 * 3, 3 * 6 + 4 * 7]]
        (plain, none) = moe_token_unpermute_with_routing_map_grad(grad, out_index, token_id)
        assert plain.tolist() == [[1, 2], [3, 4], [0, 0], [3, 4]] and none is None


def test_grad_k1_with_sorted_indices_as_token_ids_is_the_true_gradient():
    """The regression the issue measured (off by up to 4.8 at T=6, E=4, H=3): torch_npu's own
    backward passes sorted_indices as both index inputs when not padded; with K = 1 the old
    kernel read them as token ids and accepted them. The gradient of each permuted row is the
    gradient of the token it came from, written here from the permute's definition."""
    rng = np.random.default_rng(7)
    routing_map = np.zeros((6, 4), bool)
    routing_map[np.arange(6), rng.integers(0, 4, 6)] = True  # K = 1
    tokens = rng.standard_normal((6, 3)).astype(np.float32)
    permuted, sorted_indices, _ = moe_onnx.OPS["MoeTokenPermuteWithRoutingMap"](tokens, routing_map, num_out_tokens=6)
    assert not np.array_equal(sorted_indices, np.arange(6))  # else the bug would not show
    grad = rng.standard_normal((6, 3)).astype(np.float32)
    rows_grad, _ = moe_token_unpermute_with_routing_map_grad(grad, sorted_indices, sorted_indices, routing_map)
    row_token = [t for e in range(4) for t in range(6) if routing_map[t, e]]  # row d -> token, expert-major
    assert rows_grad.tolist() == grad[row_token].tolist()


def test_grad_without_tokens_gives_zero_rows_when_padded():
    """Padded, no token at all: every slot is empty and its gradient row is zero."""
    rows_grad, probs_grad = moe_token_unpermute_with_routing_map_grad(
        np.zeros((0, 8), np.float32), np.arange(4, dtype=np.int32), np.full(4, -1, np.int32), drop_and_pad=1
    )
    assert rows_grad.shape == (4, 8) and not rows_grad.any() and probs_grad is None


# --- every dtype combination through the session --------------------------------------------


@pytest.mark.parametrize("dtype, map_dtype, probs_kind, padded", COMBINATIONS, ids=ids)
def test_session_matches_kernels(dtype, map_dtype, probs_kind, padded):
    rng, tokens, routing_map, probs, rows = combination(dtype, map_dtype, probs_kind, padded)
    permuted, sorted_indices = permuted_case((tokens, routing_map, probs, rows, padded))
    attrs = {"padded_mode": padded, "restore_shape": list(tokens.shape)}
    inputs = {"permuted_tokens": permuted, "sorted_indices": sorted_indices, "routing_map": routing_map, "probs": probs}
    outputs = None if probs is not None else ["unpermuted_tokens", "out_index", "permute_token_id", ""]
    got = run_node(UNPERMUTE, inputs, attrs, outputs)
    want = [w for w in moe_token_unpermute_with_routing_map(*inputs.values(), **attrs) if w is not None]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)

    grad_inputs = {
        "unpermuted_tokens_grad": rng.standard_normal(tokens.shape).astype(dtype),
        "out_index": got[1],
        "permute_token_id": got[2],
        "routing_map": routing_map if probs is not None else None,
        "permuted_tokens": permuted if probs is not None else None,
        "probs": probs,
    }
    attrs = {"drop_and_pad": padded}
    got = run_node(UNPERMUTE_GRAD, grad_inputs, attrs, None if probs is not None else ["permuted_tokens_grad", ""])
    want = [w for w in moe_token_unpermute_with_routing_map_grad(*grad_inputs.values(), **attrs) if w is not None]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)
    if probs is not None:
        assert got[1].dtype == probs.dtype  # mixed precision: probs_grad keeps the probs dtype


# --- the seed's C++ example, through an ONNX graph ----------------------------------------


@pytest.mark.parametrize("map_dtype", [np.int8, np.bool_])
def test_seed_example(map_dtype):
    """Seed 000: dropAndPad false, 1 token, H 2, 2 experts, topK 2, all ones."""
    inputs = {
        "unpermuted_tokens_grad": np.ones((1, 2), np.float32),
        "out_index": np.array([0, 1], np.int32),
        "permute_token_id": np.array([0, 0], np.int32),
        "routing_map": np.array([[1, 1]], map_dtype),
        "permuted_tokens": np.ones((2, 2), np.float32),
        "probs": np.ones((1, 2), np.float32),
    }
    rows_grad, probs_grad = run_node(UNPERMUTE_GRAD, inputs, {"drop_and_pad": 0})
    assert rows_grad.tolist() == [[1, 1], [1, 1]]
    assert probs_grad.tolist() == [[2, 2]]  # sum over hidden of 1 * 1


# --- the forward's index outputs are what the grad consumes: a two-node graph -------------------


@pytest.mark.parametrize("padded", [0, 1])
def test_forward_indices_feed_the_grad_in_one_graph(padded):
    rng = np.random.default_rng(5)
    n_tokens, n_experts, hidden, top_k = 7, 5, 4, 2
    routing_map = make_routing(rng, n_tokens, n_experts, None if padded else top_k)
    tokens = rng.standard_normal((n_tokens, hidden)).astype(ml_dtypes.bfloat16)
    probs = make_probs(rng, routing_map, np.float32)
    rows = n_experts * 3 if padded else n_tokens * top_k
    permuted, sorted_indices = permuted_case((tokens, routing_map, probs, rows, padded))
    grad = rng.standard_normal(tokens.shape).astype(ml_dtypes.bfloat16)

    feeds = {
        "permuted_tokens": permuted,
        "sorted_indices": sorted_indices,
        "routing_map": routing_map,
        "probs": probs,
        "grad": grad,
    }
    graph_inputs = [
        helper.make_tensor_value_info(
            name, moe_onnx.custom_ops.dtypes.onnx_type(moe_onnx.custom_ops.dtypes.name_of(value)), list(value.shape)
        )
        for name, value in feeds.items()
    ]
    nodes = [
        helper.make_node(
            UNPERMUTE,
            ["permuted_tokens", "sorted_indices", "routing_map", "probs"],
            ["unpermuted", "out_index", "permute_token_id", "permute_probs"],
            domain=moe_onnx.DOMAIN,
            name="forward",
            padded_mode=padded,
        ),
        helper.make_node(
            UNPERMUTE_GRAD,
            ["grad", "out_index", "permute_token_id", "routing_map", "permuted_tokens", "probs"],
            ["rows_grad", "probs_grad"],
            domain=moe_onnx.DOMAIN,
            name="backward",
            drop_and_pad=padded,
        ),
    ]
    graph = helper.make_graph(nodes, "unpermute_and_grad", graph_inputs, [])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    types = inferred_types(model)
    model.graph.output.extend(
        helper.make_tensor_value_info(name, *types[name]) for name in ["unpermuted", "rows_grad", "probs_grad"]
    )
    unpermuted, rows_grad, probs_grad = moe_onnx.InferenceSession(model).run(None, feeds)

    forward = moe_token_unpermute_with_routing_map(permuted, sorted_indices, routing_map, probs, padded_mode=padded)
    backward = moe_token_unpermute_with_routing_map_grad(
        grad, forward[1], forward[2], routing_map, permuted, probs, drop_and_pad=padded
    )
    assert_same(unpermuted, forward[0])
    assert_same(rows_grad, backward[0])
    assert_same(probs_grad, backward[1])
    assert types["probs_grad"][1] == [n_tokens, n_experts]


# --- the grad is the vector-Jacobian product of the forward ------------------------------


@pytest.mark.parametrize("padded", [0, 1])
@pytest.mark.parametrize("seed", range(4))
def test_unpermute_grad_is_vjp(padded, seed):
    """Float64 through the bare kernels (the ONNX schema takes no float64). The forward is
    linear in permuted_tokens and in probs, so unit vectors give the Jacobian exactly."""
    rng = np.random.default_rng(seed)
    n_tokens, n_experts, hidden, top_k = 5, 4, 3, 2
    routing_map = make_routing(rng, n_tokens, n_experts, None if padded else top_k, np.int8)
    rows = n_experts * 3 if padded else n_tokens * top_k
    _, sorted_indices, _ = moe_token_permute_with_routing_map(
        np.zeros((n_tokens, 1)), routing_map, None, num_out_tokens=rows, drop_and_pad=padded
    )
    if padded:  # an empty slot too
        sorted_indices[rng.integers(rows)] = -1
    permuted = rng.standard_normal((rows, hidden))
    probs = rng.random((n_tokens, n_experts))

    def unpermute(permuted, probs):
        return moe_token_unpermute_with_routing_map(
            permuted, sorted_indices, routing_map, probs, padded_mode=padded, restore_shape=[n_tokens, hidden]
        )

    j_rows = jacobian(lambda x: unpermute(x, probs)[0], permuted)
    j_probs = jacobian(lambda p: unpermute(permuted, p)[0], probs)
    _, out_index, token_id, _ = unpermute(permuted, probs)
    grad = rng.standard_normal((n_tokens, hidden))
    rows_grad, probs_grad = moe_token_unpermute_with_routing_map_grad(
        grad, out_index, token_id, routing_map, permuted, probs, drop_and_pad=padded
    )
    assert rows_grad.dtype == probs_grad.dtype == np.float64
    np.testing.assert_allclose(rows_grad.ravel(), j_rows.T @ grad.ravel(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(probs_grad.ravel(), j_probs.T @ grad.ravel(), rtol=1e-12, atol=1e-12)
    # without probs the forward is a plain sum and the grad a plain copy
    plain = jacobian(lambda x: unpermute(x, None)[0], permuted)
    rows_grad, none = moe_token_unpermute_with_routing_map_grad(grad, out_index, token_id, drop_and_pad=padded)
    assert none is None
    np.testing.assert_allclose(rows_grad.ravel(), plain.T @ grad.ravel(), rtol=1e-12, atol=1e-12)


# --- round trips -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=ids)
def test_round_trip_not_padded(dtype):
    """Probs summing to 1 over each token's experts: unpermute(permute(x)) == x."""
    rng = np.random.default_rng(8)
    n_tokens, n_experts, hidden, top_k = 40, 8, 16, 3
    routing_map = make_routing(rng, n_tokens, n_experts, top_k)
    probs = make_probs(rng, routing_map, np.float32, normalized=True)
    tokens = rng.standard_normal((n_tokens, hidden)).astype(dtype)
    permuted, sorted_indices, _ = moe_token_permute_with_routing_map(
        tokens, routing_map, probs, num_out_tokens=n_tokens * top_k
    )
    back = moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, routing_map, probs, restore_shape=[n_tokens, hidden]
    )[0]
    tolerance = 1e-6 if dtype == np.float32 else 1e-2  # bfloat16: one rounding of the sum
    np.testing.assert_allclose(f32(back), f32(tokens), rtol=tolerance, atol=tolerance)
    # without probs every token comes back K times
    summed = moe_token_unpermute_with_routing_map(permuted, sorted_indices, restore_shape=[n_tokens, hidden])[0]
    np.testing.assert_allclose(f32(summed), top_k * f32(tokens), rtol=tolerance, atol=tolerance)


def test_round_trip_padded_drops_tokens():
    """Capacity below demand: a token comes back scaled by the probs of the experts that kept
    it; a token that every one of its experts dropped comes back as zeros."""
    rng = np.random.default_rng(9)
    n_tokens, n_experts, hidden, top_k, capacity = 40, 4, 8, 2, 12
    routing_map = make_routing(rng, n_tokens, n_experts, top_k)
    probs = make_probs(rng, routing_map, np.float32, normalized=True)
    tokens = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    rows = n_experts * capacity
    permuted, sorted_indices, _ = moe_token_permute_with_routing_map(
        tokens, routing_map, probs, num_out_tokens=rows, drop_and_pad=1
    )
    back = run_node(
        UNPERMUTE,
        {"permuted_tokens": permuted, "sorted_indices": sorted_indices, "routing_map": routing_map, "probs": probs},
        {"padded_mode": 1},
    )[0]
    kept = np.zeros((n_tokens, n_experts), bool)
    for d, t in enumerate(sorted_indices):
        kept[t, d // capacity] |= routing_map[t, d // capacity]
    dropped = ~kept.any(axis=1)
    assert dropped.any() and (~dropped).any()  # the case exercises both
    assert np.array_equal(back[dropped], np.zeros((dropped.sum(), hidden), np.float32))
    share = (probs * kept).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(back, share * tokens, rtol=1e-5, atol=1e-6)
    whole = kept.sum(axis=1) == top_k
    np.testing.assert_allclose(back[whole], tokens[whole], rtol=1e-5, atol=1e-6)


def test_round_trip_through_one_graph():
    """permute -> unpermute as two nodes of one model in moe_onnx.InferenceSession."""
    rng = np.random.default_rng(10)
    n_tokens, n_experts, hidden, top_k = 12, 6, 8, 2
    routing_map = make_routing(rng, n_tokens, n_experts, top_k, np.int8)
    probs = make_probs(rng, routing_map, np.float32, normalized=True)
    tokens = rng.standard_normal((n_tokens, hidden)).astype(ml_dtypes.bfloat16)
    feeds = {"tokens": tokens, "routing_map": routing_map, "probs": probs}
    graph = helper.make_graph(
        [
            helper.make_node(
                "MoeTokenPermuteWithRoutingMap",
                ["tokens", "routing_map", "probs"],
                ["permuted", "sorted_indices", ""],
                domain=moe_onnx.DOMAIN,
                name="permute",
                num_out_tokens=n_tokens * top_k,
            ),
            helper.make_node(
                UNPERMUTE,
                ["permuted", "sorted_indices", "routing_map", "probs"],
                ["back", "", "", ""],
                domain=moe_onnx.DOMAIN,
                name="unpermute",
            ),
        ],
        "round_trip",
        [
            helper.make_tensor_value_info("tokens", onnx.TensorProto.BFLOAT16, list(tokens.shape)),
            helper.make_tensor_value_info("routing_map", onnx.TensorProto.INT8, list(routing_map.shape)),
            helper.make_tensor_value_info("probs", onnx.TensorProto.FLOAT, list(probs.shape)),
        ],
        [helper.make_tensor_value_info("back", onnx.TensorProto.BFLOAT16, [n_tokens, hidden])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    back = moe_onnx.InferenceSession(model).run(None, feeds)[0]
    assert back.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(f32(back), f32(tokens), rtol=1e-2, atol=1e-2)


# --- larger shapes: the chunked paths ---------------------------------------------------------


@pytest.mark.parametrize("padded", [0, 1])
def test_many_rows_bfloat16(padded):
    rng = np.random.default_rng(12)
    n_tokens, n_experts, hidden, top_k = 300, 16, 1100, 8
    routing_map = make_routing(rng, n_tokens, n_experts, top_k)
    tokens = rng.standard_normal((n_tokens, hidden)).astype(ml_dtypes.bfloat16)
    probs = make_probs(rng, routing_map, np.float32)
    rows = n_tokens * top_k
    permuted, sorted_indices = permuted_case((tokens, routing_map, probs, rows, padded))
    got = moe_token_unpermute_with_routing_map(permuted, sorted_indices, routing_map, probs, padded_mode=padded)
    want = unpermute_reference(permuted, sorted_indices, routing_map, probs, padded, n_tokens)
    for g, w in zip(got, want):
        assert_same(g, w)
    grad = rng.standard_normal(tokens.shape).astype(ml_dtypes.bfloat16)
    got = moe_token_unpermute_with_routing_map_grad(
        grad, want[1], want[2], routing_map, permuted, probs, drop_and_pad=padded
    )
    want = unpermute_grad_reference(grad, want[1], want[2], routing_map, permuted, probs, padded)
    assert_same(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-4)


# --- shape inference ------------------------------------------------------------------------


@pytest.mark.parametrize("padded", [0, 1])
def test_shape_inference_symbolic(padded):
    from tests.support import node_model

    inputs = {
        "permuted_tokens": np.ones((12, 5), ml_dtypes.bfloat16),
        "sorted_indices": np.zeros(12, np.int32),
        "routing_map": np.zeros((6, 4), bool),
        "probs": np.ones((6, 4), np.float32),
    }
    model = node_model(UNPERMUTE, inputs, {"padded_mode": padded}, symbolic=True)
    del model.graph.output[:]
    out = inferred_types(model)
    bf16, f32_, i32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.INT32
    assert out["unpermuted_tokens"] == (bf16, ["routing_map_0", "permuted_tokens_1"])
    assert out["out_index"] == out["permute_token_id"] == (i32, ["permuted_tokens_0"])
    assert out["permute_probs"] == (f32_, ["permuted_tokens_0"])

    grad = {
        "unpermuted_tokens_grad": np.ones((6, 5), ml_dtypes.bfloat16),
        "out_index": np.zeros(12, np.int32),
        "permute_token_id": np.zeros(12, np.int32),
        "routing_map": np.zeros((6, 4), bool),
        "permuted_tokens": np.ones((12, 5), ml_dtypes.bfloat16),
        "probs": np.ones((6, 4), np.float32),
    }
    model = node_model(UNPERMUTE_GRAD, grad, {"drop_and_pad": padded}, symbolic=True)
    del model.graph.output[:]
    out = inferred_types(model)
    assert out["permuted_tokens_grad"] == (bf16, ["out_index_0", "unpermuted_tokens_grad_1"])
    assert out["probs_grad"] == (f32_, ["unpermuted_tokens_grad_0", "routing_map_1"])


def test_shape_inference_restore_shape_gives_t():
    from tests.support import node_model

    inputs = {"permuted_tokens": np.ones((12, 5), np.float16), "sorted_indices": np.zeros(12, np.int32)}
    model = node_model(
        UNPERMUTE, inputs, {"restore_shape": [4, 5]}, outputs=["unpermuted_tokens", "out_index", "permute_token_id", ""]
    )
    assert inferred_types(model)["unpermuted_tokens"] == (onnx.TensorProto.FLOAT16, [4, 5])


@pytest.mark.parametrize("n_tokens, hidden", [(0, 3), (2, 0), (0, 0)])
@pytest.mark.parametrize("padded", [0, 1])
def test_empty_shapes_chain(n_tokens, hidden, padded):
    """No tokens or no hidden: every op still returns the inferred (empty) shapes."""
    routing_map = np.ones((n_tokens, 2), bool)
    tokens, probs = np.ones((n_tokens, hidden), np.float32), np.ones((n_tokens, 2), np.float32)
    ops = moe_onnx.OPS
    permuted, sorted_indices, permuted_probs = ops["MoeTokenPermuteWithRoutingMap"](
        tokens, routing_map, probs, num_out_tokens=2 * n_tokens, drop_and_pad=padded
    )
    unpermuted, out_index, token_id, _ = ops[UNPERMUTE](
        permuted, sorted_indices, routing_map, probs, padded_mode=padded
    )
    rows_grad, probs_grad = ops[UNPERMUTE_GRAD](
        tokens, out_index, token_id, routing_map, permuted, probs, drop_and_pad=padded
    )
    tokens_grad, probs_grad_2 = ops["MoeTokenPermuteWithRoutingMapGrad"](
        permuted, permuted_probs, sorted_indices, routing_map, drop_and_pad=padded
    )
    assert unpermuted.shape == tokens_grad.shape == (n_tokens, hidden)
    assert rows_grad.shape == permuted.shape == (2 * n_tokens, hidden)
    assert probs_grad.shape == probs_grad_2.shape == (n_tokens, 2)
    got = run_node(
        UNPERMUTE,
        {"permuted_tokens": permuted, "sorted_indices": sorted_indices, "routing_map": routing_map, "probs": probs},
        {"padded_mode": padded},
    )
    assert [g.shape for g in got] == [(n_tokens, hidden), (2 * n_tokens,), (2 * n_tokens,), (2 * n_tokens,)]


# --- unused slots (seed 000): a token routed to fewer than K experts -------------------------


def test_unused_slots_by_hand():
    """T = 3, E = 3, K = 2; token 1 is routed to one expert only, so its slot 3 is -1. Rows
    (expert-major routed pairs): d0 (t0, e0), d1 (t2, e0), d2 (t1, e1), d3 (t2, e1),
    d4 (t0, e2); row 5 is no pair's."""
    routing_map = np.array([[1, 0, 1], [0, 1, 0], [1, 1, 0]], bool)
    sorted_indices = np.array([0, 4, 2, -1, 1, 3], np.int32)
    permuted = np.arange(12, dtype=np.float32).reshape(6, 2)  # row d = [2d, 2d + 1]
    probs = np.array([[0.5, 0, 2], [0, 3, 0], [4, 0.25, 0]], np.float32)
    unpermuted, out_index, token_id, row_probs = moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, routing_map, probs, restore_shape=[3, 2]
    )
    assert out_index.tolist() == [0, 4, 2, -1, 1, 3] and token_id.tolist() == [0, 0, 1, -1, 2, 2]
    assert row_probs.tolist() == [0.5, 4, 3, 0.25, 2, 0]
    assert unpermuted.tolist() == [
        [0.5 * 0 + 2 * 8, 0.5 * 1 + 2 * 9],
        [3 * 4, 3 * 5],
        [4 * 2 + 0.25 * 6, 4 * 3 + 0.25 * 7],
    ]

    grad = np.array([[1, 2], [3, 4], [5, 6]], np.float32)
    rows_grad, probs_grad = moe_token_unpermute_with_routing_map_grad(
        grad, out_index, token_id, routing_map, permuted, probs
    )
    # g_perm[out_index[i]] = grad[token_id[i]] (skipping -1), times the row's prob; row 5 stays 0
    assert rows_grad.tolist() == [[0.5, 1], [20, 24], [9, 12], [1.25, 1.5], [2, 4], [0, 0]]
    # probs_grad[t, e] = <g_perm[d], permuted[d]> for the routed pairs, 0 elsewhere
    assert probs_grad.tolist() == [
        [0 * 1 + 1 * 2, 0, 8 * 1 + 9 * 2],
        [0, 4 * 3 + 5 * 4, 0],
        [2 * 5 + 3 * 6, 6 * 5 + 7 * 6, 0],
    ]


@pytest.mark.parametrize("seed", range(6))
def test_unused_slots_match_the_seed_formulas(seed):
    """Random tokens routed to 0..K experts: kernels, both executors and the loop references
    (which skip -1 slots as seed 000 says) agree, forward and backward."""
    rng = np.random.default_rng(seed)
    n_tokens, n_experts, top_k, hidden = 5, 4, 3, 4
    routing_map, sorted_indices = routing_with_unused_slots(rng, n_tokens, n_experts, top_k)
    permuted = rng.standard_normal((n_tokens * top_k, hidden)).astype(np.float32)
    probs = make_probs(rng, routing_map, np.float32)
    inputs = {"permuted_tokens": permuted, "sorted_indices": sorted_indices, "routing_map": routing_map, "probs": probs}
    got = run_node(UNPERMUTE, inputs, {"restore_shape": [n_tokens, hidden]})
    want = unpermute_reference(permuted, sorted_indices, routing_map, probs, 0, n_tokens)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
    _, out_index, token_id, _ = got
    grad = rng.standard_normal((n_tokens, hidden)).astype(np.float32)
    grad_inputs = {
        "unpermuted_tokens_grad": grad,
        "out_index": out_index,
        "permute_token_id": token_id,
        "routing_map": routing_map,
        "permuted_tokens": permuted,
        "probs": probs,
    }
    got = run_node(UNPERMUTE_GRAD, grad_inputs, {})
    want = unpermute_grad_reference(grad, out_index, token_id, routing_map, permuted, probs, 0)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    unused = np.setdiff1d(np.arange(len(permuted)), sorted_indices[sorted_indices >= 0])
    assert not got[0][unused].any()  # rows no slot uses get no gradient


def test_a_used_slot_must_name_a_routed_row():
    routing_map = np.array([[1, 0], [0, 1]], bool)  # 2 routed pairs, K = 2: rows 0, 1
    with pytest.raises(moe_onnx.MoeOpError, match="names row 3, but routing_map routes only 2"):
        moe_onnx.OPS[UNPERMUTE](
            np.ones((4, 2), np.float32), np.array([0, -1, 3, -1], np.int32), routing_map, np.ones((2, 2), np.float32)
        )
