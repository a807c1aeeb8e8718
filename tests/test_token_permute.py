"""MoeTokenPermute and MoeTokenPermuteGrad (SPEC 1.11): kernel against loop references written
from the SPEC, sessions (both executors) against the kernel, the index direction op-plugin's
test asserts, truncation, errors and shape inference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

import moe_onnx
from tests.references import (
    FLOAT_DTYPES,
    assert_same,
    token_permute_grad_reference,
    token_permute_reference,
)
from tests.support import assert_refused, assert_same_bits, inferred_types, run_node

PERMUTE = moe_onnx.OPS["MoeTokenPermute"]
PERMUTE_GRAD = moe_onnx.OPS["MoeTokenPermuteGrad"]


@st.composite
def permute_cases(draw):
    """(tokens, indices, num_out_tokens): few experts used often (ties), 1-D or 2-D, int32/int64."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    n_tokens, top_k, hidden = draw(st.integers(0, 7)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    one_d = draw(st.booleans())
    shape = (n_tokens,) if one_d else (n_tokens, top_k)
    top_k = 1 if one_d else top_k
    ids = rng.integers(0, draw(st.integers(1, 6)), shape) * draw(st.sampled_from([1, 1000003]))  # big ids too
    indices = ids.astype(draw(st.sampled_from([np.int32, np.int64])))
    tokens = rng.standard_normal((n_tokens, hidden)).astype(draw(st.sampled_from(FLOAT_DTYPES)))
    slots = n_tokens * top_k
    n = draw(st.sampled_from([0, 0, 1, -1, 2])) * draw(st.integers(0, slots + 2))
    return tokens, indices, n if n >= 0 else max(n, 1 - slots) if slots > 1 else 0


@given(permute_cases())
def test_permute_matches_reference(case):
    tokens, indices, n = case
    got = PERMUTE(tokens, indices, num_out_tokens=n)
    for g, w in zip(got, token_permute_reference(tokens, indices, n)):
        assert_same_bits(g, w)


@given(permute_cases())
def test_permute_grad_matches_reference(case):
    tokens, indices, n = case
    permuted, sorted_indices = PERMUTE(tokens, indices, num_out_tokens=n)
    top_k = 1 if indices.ndim == 1 else indices.shape[1]
    grad = np.random.default_rng(1).standard_normal(permuted.shape).astype(tokens.dtype)
    (got,) = PERMUTE_GRAD(grad, sorted_indices, num_topk=top_k)
    assert_same_bits(got, token_permute_grad_reference(grad, sorted_indices, top_k))


def test_sorted_indices_is_the_inverse_of_megatrons():
    """op-plugin's test: ``fused sorted_indices == argsort(Megatron sorted_indices)``, Megatron's
    being the stable argsort of the flattened ids (dst row -> src slot)."""
    rng = np.random.default_rng(3)
    tokens = rng.standard_normal((64, 8)).astype(ml_dtypes.bfloat16)
    indices = rng.integers(0, 5, (64, 4)).astype(np.int64)
    permuted, sorted_indices = PERMUTE(tokens, indices)
    megatron = np.argsort(indices.reshape(-1), kind="stable")
    assert np.array_equal(sorted_indices, np.argsort(megatron, kind="stable"))
    assert_same_bits(permuted, tokens[megatron // 4])
    assert_same_bits(permuted[sorted_indices], np.repeat(tokens, 4, axis=0))  # slot p's copy sits at its row


def test_truncation_keeps_full_index():
    tokens = np.arange(4, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    indices = np.array([[2, 0], [1, 0], [0, 2], [1, 1]], np.int32)
    permuted, sorted_indices = PERMUTE(tokens, indices, num_out_tokens=5)
    # rows by expert: 0 <- slots 1, 3, 4; 1 <- slots 2, 6, 7; 2 <- slots 0, 5
    assert np.array_equal(sorted_indices, [6, 0, 3, 1, 2, 7, 4, 5])
    assert np.array_equal(permuted[:, 0], [0, 1, 2, 1, 3])
    short, _ = PERMUTE(tokens, indices, num_out_tokens=-3)
    assert_same_bits(short, permuted)
    assert PERMUTE(tokens, indices, num_out_tokens=100)[0].shape == (8, 2)
    (grad,) = PERMUTE_GRAD(np.ones((5, 2), np.float32), sorted_indices, num_topk=2)
    assert np.array_equal(grad[:, 0], [1, 2, 1, 1])  # slots 0 (row 6), 5 (7) and 7 (5) were cut off


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_sessions_match_kernel(dtype, index_dtype):
    rng = np.random.default_rng(5)
    tokens = rng.standard_normal((9, 6)).astype(dtype)
    indices = rng.integers(0, 4, (9, 3)).astype(index_dtype)
    for n in (0, 20, -4):
        got = run_node("MoeTokenPermute", {"tokens": tokens, "indices": indices}, {"num_out_tokens": n})
        for g, w in zip(got, PERMUTE(tokens, indices, num_out_tokens=n)):
            assert_same_bits(g, w)
        grad = rng.standard_normal(got[0].shape).astype(dtype)
        inputs = {"permuted_output_grad": grad, "sorted_indices": got[1]}
        (got_grad,) = run_node("MoeTokenPermuteGrad", inputs, {"num_topk": 3})
        assert_same_bits(got_grad, PERMUTE_GRAD(grad, got[1], num_topk=3)[0])


def test_large_call_is_split_over_threads_and_stays_bit_identical():
    """> 16 MiB moved: the copy and the sum run on several threads."""
    rng = np.random.default_rng(7)
    tokens = rng.standard_normal((1024, 2048)).astype(ml_dtypes.bfloat16)
    indices = rng.integers(0, 16, (1024, 4)).astype(np.int32)
    permuted, sorted_indices = PERMUTE(tokens, indices)
    assert_same_bits(permuted, tokens[np.argsort(indices.reshape(-1), kind="stable") // 4])
    (grad,) = PERMUTE_GRAD(permuted, sorted_indices, num_topk=4)
    assert_same(grad, (tokens.astype(np.float32) * 4).astype(ml_dtypes.bfloat16))


# --- errors ------------------------------------------------------------------------------------


tokens = np.ones((4, 3), np.float32)
indices = np.array([[0, 1], [2, 1], [1, 1], [0, 2]], np.int32)


def permute(tokens=tokens, indices=indices, **attrs):
    return run_node("MoeTokenPermute", {"tokens": tokens, "indices": indices}, attrs)


def test_error_negative_id():
    bad = indices.copy()
    bad[2, 1] = -1
    assert_refused(lambda: permute(indices=bad), 561002, "indices must be >= 0", "got -1 at slot 5 (token 2)")


def test_error_padded_mode():
    assert_refused(lambda: permute(padded_mode=1), 561002, "padded_mode=1 is not supported")


def test_error_negative_rows():
    assert_refused(lambda: permute(num_out_tokens=-9), 561002, "num_out_tokens = -9 < 0", "F = T*K = 8")
    # 0 rows is refused too: the NPU's tiling turns 0 into T*K and fails on the 0-row output
    assert_refused(lambda: permute(num_out_tokens=-8), 561002, "must keep F + n > 0 rows", "F = T*K = 8")
    assert permute(num_out_tokens=-7)[0].shape == (1, 3)


def test_error_shapes_and_dtypes():
    assert_refused(lambda: permute(indices=indices[:3]), 561002, "must have T = tokens dim 0 (got 3 and 4)")
    assert_refused(lambda: permute(indices=indices[None]), 561002, "'indices' must have rank 1 or 2")
    assert_refused(lambda: permute(tokens=tokens[0]), 561002, "'tokens' must have rank 2")
    assert_refused(lambda: permute(indices=indices.astype(np.int16)), 161002, "'indices' has dtype int16")
    assert_refused(lambda: permute(tokens=tokens.astype(np.float64)), 161002, "'tokens' has dtype float64")


def test_grad_errors():
    grad, sorted_indices = np.ones((8, 3), np.float32), np.arange(8, dtype=np.int32)

    def run(index=sorted_indices, **attrs):
        return run_node("MoeTokenPermuteGrad", {"permuted_output_grad": grad, "sorted_indices": index}, attrs)

    assert_refused(lambda: run(num_topk=3), 561002, "must be a multiple of num_topk", "got 8 rows for 3")
    assert_refused(lambda: run(num_topk=0), 561002, "num_topk must be > 0")
    assert_refused(lambda: run(), 161001, "attribute 'num_topk' is required")
    assert_refused(lambda: run(num_topk=2, padded_mode=1), 561002, "padded_mode=1 is not supported")
    assert_refused(lambda: run(index=sorted_indices - 1, num_topk=2), 561002, "sorted_indices must be >= 0")


# --- shape inference -------------------------------------------------------------------------


def inferred(op, inputs, outputs, attrs):
    node = helper.make_node(op, list(inputs), outputs, domain=moe_onnx.DOMAIN, name="node", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()], [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann.moe", 1)])
    return inferred_types(model)


def test_shape_inference():
    bf16, i64 = TensorProto.BFLOAT16, TensorProto.INT64
    out = inferred(
        "MoeTokenPermute", {"tokens": (bf16, [6, "H"]), "indices": (i64, [6, 2])}, ["p", "s"], {"num_out_tokens": -2}
    )
    assert out["p"] == (bf16, [10, "H"]) and out["s"] == (TensorProto.INT32, [12])
    out = inferred("MoeTokenPermute", {"tokens": (bf16, ["T", 4]), "indices": (i64, ["T"])}, ["p", "s"], {})
    assert out["p"] == (bf16, ["T", 4]) and out["s"][1] == ["T"]
    out = inferred("MoeTokenPermute", {"tokens": (bf16, ["T", 4]), "indices": (i64, ["T", 8])}, ["p", "s"], {})
    assert out["p"] == (bf16, [None, 4])
    out = inferred(
        "MoeTokenPermuteGrad",
        {"permuted_output_grad": (bf16, ["M", 4]), "sorted_indices": (TensorProto.INT32, [12])},
        ["g"],
        {"num_topk": 3},
    )
    assert out["g"] == (bf16, [4, 4])


def test_target_limits():
    from moe_onnx.custom_ops import TensorInfo, targets

    assert targets.check("MoeTokenPermute", {"tokens": tokens, "indices": indices}, {}, "ascend910b") == []
    big_id = {"tokens": tokens, "indices": np.full((4, 2), 16777215, np.int64)}
    assert targets.check("MoeTokenPermute", big_id, {}, "ascend910b") == [
        "MoeTokenPermute on ascend910b: expert id 16777215 must be below 16777215"
    ]
    wide = {"tokens": TensorInfo("bfloat16", (40000, 8)), "indices": TensorInfo("int32", (40000, 513))}
    assert targets.check("MoeTokenPermute", wide, {}, "ascend950") == [
        "MoeTokenPermute on ascend950: K = 513 exceeds 512",
        "MoeTokenPermute on ascend950: numel(indices) = 20520000 must be below 16777215",
    ]
