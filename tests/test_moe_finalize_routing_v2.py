"""MoeFinalizeRoutingV2 and its grad (SPEC-layer 1.8): the kernels against loops of the SPEC
formulas (the forward bit for bit: same float32 operations in the same order), the grad
against the VJP of the forward kernel, sessions bit-identical with the kernels, errors and
shape inference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.custom_ops import TensorInfo, targets
from moe_onnx.custom_ops.moe_finalize_routing_v2 import moe_finalize_routing_v2
from moe_onnx.custom_ops.moe_finalize_routing_v2_grad import moe_finalize_routing_v2_grad
from tests.support import assert_refused, assert_same_bits, inferred_types, run_node

FLOAT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
BF16 = np.dtype(ml_dtypes.bfloat16)


def loop_reference(expanded_x, idx, x1=None, x2=None, bias=None, scales=None, expert_idx=None, drop_pad_mode=0, k=1):
    """SPEC-layer 1.8 (b) as loops: float32, each product rounded, terms added in j order."""
    f32 = np.float32
    hidden = expanded_x.shape[-1]
    rows = expanded_x.reshape(-1, hidden).astype(f32)
    top_k = scales.shape[1] if scales is not None else k
    n_tokens = scales.shape[0] if scales is not None else len(idx) // k
    y = np.empty((n_tokens, hidden), expanded_x.dtype)
    for i in range(n_tokens):
        acc = np.zeros(hidden, f32)
        if x1 is not None:
            acc = x1[i].astype(f32) + (x2[i].astype(f32) if x2 is not None else f32(0))
        for j in range(top_k):
            p = j * n_tokens + i if drop_pad_mode in (0, 1) else i * top_k + j
            d = int(idx[p])
            term = np.zeros(hidden, f32) if d == -1 else rows[d]
            if bias is not None:
                term = term + bias[expert_idx[i, j]].astype(f32)
            acc = acc + (term * f32(scales[i, j]) if scales is not None else term)
        y[i] = acc.astype(expanded_x.dtype)
    return y


@st.composite
def cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    tokens, top_k, hidden = draw(st.integers(0, 5)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    experts = draw(st.integers(top_k, 4))
    mode = draw(st.sampled_from([0, 1, 2, 3]))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    slots = tokens * top_k
    if mode in (1, 3):
        capacity = draw(st.integers(1, 3))
        shape = (experts, capacity, hidden)
        idx = rng.integers(-1, experts * capacity, slots)  # repeats allowed: the op gathers
    else:
        shape = (slots + draw(st.integers(0, 2)), hidden)
        idx = rng.integers(0, shape[0], slots) if shape[0] else np.zeros(0, np.int64)
    scales_dtype = np.float32 if dtype == BF16 and draw(st.booleans()) else dtype
    inputs = {
        "expanded_x": rng.standard_normal(shape).astype(dtype),
        "expanded_row_idx": idx.astype(np.int32),
        "x1": None,
        "x2": None,
        "bias": None,
        "scales": rng.random((tokens, top_k)).astype(scales_dtype) if draw(st.booleans()) else None,
        "expert_idx": None,
    }
    if draw(st.booleans()):
        inputs["x1"] = rng.standard_normal((tokens, hidden)).astype(dtype)
        if draw(st.booleans()):
            inputs["x2"] = rng.standard_normal((tokens, hidden)).astype(dtype)
    if draw(st.booleans()):
        inputs["bias"] = rng.standard_normal((experts, hidden)).astype(dtype)
        inputs["expert_idx"] = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
    return inputs, {"drop_pad_mode": mode, "k": top_k}


@given(cases())
def test_kernel_equals_the_loops_bit_for_bit(case):
    inputs, attrs = case
    (y,) = moe_finalize_routing_v2(*inputs.values(), **attrs)
    assert_same_bits(y, loop_reference(*inputs.values(), **attrs))


@settings(max_examples=25)  # two sessions per example
@given(cases())
def test_session_equals_the_kernel(case):
    inputs, attrs = case
    (y,) = run_node("MoeFinalizeRoutingV2", inputs, attrs)
    assert_same_bits(y, moe_finalize_routing_v2(*inputs.values(), **attrs)[0])


def test_doc_example_column_arrangement():
    """op-plugin's moe_finalize_routing_np: value = expanded_src_to_dst_row[k * num_rows + i]."""
    rng = np.random.default_rng(0)
    rows, top_k, hidden, experts = 5, 4, 5, 16
    x = rng.standard_normal((rows * top_k, hidden)).astype(np.float32)
    skip1, skip2 = rng.standard_normal((2, rows, hidden)).astype(np.float32)
    bias = rng.standard_normal((experts, hidden)).astype(np.float32)
    scales = rng.standard_normal((rows, top_k)).astype(np.float32)
    idx = rng.permutation(rows * top_k).astype(np.int32)
    expert = rng.integers(0, experts, (rows, top_k)).astype(np.int32)
    (y,) = run_node(
        "MoeFinalizeRoutingV2",
        {
            "expanded_x": x,
            "expanded_row_idx": idx,
            "x1": skip1,
            "x2": skip2,
            "bias": bias,
            "scales": scales,
            "expert_idx": expert,
        },
    )
    want = skip1.astype(np.float64) + skip2
    for i in range(rows):
        for j in range(top_k):
            want[i] += scales[i, j] * (x[idx[j * rows + i]] + bias[expert[i, j]].astype(np.float64))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_dropped_slot_adds_its_scaled_bias():
    x = np.arange(8, dtype=np.float32).reshape(2, 2, 2)  # [E, C, H]
    bias = np.array([[10, 10], [100, 100]], np.float32)
    (y,) = moe_finalize_routing_v2(
        x, np.array([3, -1], np.int32), None, None, bias, np.array([[1.0, 0.5]], np.float32),
        np.array([[0, 1]], np.int32), drop_pad_mode=3,
    )  # fmt: skip
    np.testing.assert_array_equal(y, [[6 + 10 + 0.5 * 100, 7 + 10 + 0.5 * 100]])


# --- the grad ----------------------------------------------------------------------------


def forward_jacobians(x, idx, scales, top_k, mode):
    """d y / d expanded_x and d y / d scales of the forward kernel (float64, linear in each)."""

    def in_x(unit):
        return moe_finalize_routing_v2(unit.reshape(x.shape), idx, scales=scales, drop_pad_mode=mode, k=top_k)[0]

    def in_scales(unit):
        return moe_finalize_routing_v2(x, idx, scales=unit.reshape(scales.shape), drop_pad_mode=mode)[0]

    jx = np.stack([in_x(np.eye(x.size)[k]).ravel() for k in range(x.size)], axis=1)
    js = np.stack([in_scales(np.eye(scales.size)[k]).ravel() for k in range(scales.size)], axis=1)
    return jx, js


@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grad_is_the_vjp_of_the_forward_float64(mode, seed):
    rng = np.random.default_rng(seed)
    tokens, top_k, hidden = 4, 2, 3
    if mode == 3:
        experts, capacity = 3, 2
        x = rng.standard_normal((experts, capacity, hidden))
        idx = rng.permutation(np.concatenate([np.arange(experts * capacity), [-1, -1]]))[: tokens * top_k]
        attrs = {"drop_pad_mode": 1, "expert_num": experts, "expert_capacity": capacity}
    else:
        x = rng.standard_normal((tokens * top_k, hidden))
        idx = rng.permutation(tokens * top_k)
        attrs = {}
    idx = idx.astype(np.int32)
    scales = rng.random((tokens, top_k))
    g = rng.standard_normal((tokens, hidden))
    grad_x, grad_scales = moe_finalize_routing_v2_grad(g, idx, x, scales, **attrs)
    jx, js = forward_jacobians(x, idx, scales, top_k, mode)
    np.testing.assert_allclose(grad_x, (jx.T @ g.ravel()).reshape(x.shape), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(grad_scales, (js.T @ g.ravel()).reshape(scales.shape), rtol=1e-13, atol=1e-13)


def test_grad_with_bias_and_active_rows():
    """grad_scales[i, j] = <grad_y[i], X[d] + bias[e]>; slots past active_num get no row."""
    rng = np.random.default_rng(5)
    g = rng.standard_normal((3, 2)).astype(np.float32)
    idx = np.array([4, 0, 5, 2, 1, 3], np.int32)
    x = rng.standard_normal((4, 2)).astype(np.float32)  # active_num = 4 of 6 rows
    scales = rng.random((3, 2)).astype(np.float32)
    bias = rng.standard_normal((2, 2)).astype(np.float32)
    expert = np.array([[0, 1], [1, 1], [0, 0]], np.int32)
    grad_x, grad_scales = run_node(
        "MoeFinalizeRoutingV2Grad",
        {"grad_y": g, "expanded_row_idx": idx, "expanded_x": x, "scales": scales, "expert_idx": expert, "bias": bias},
        {"active_num": 4},
    )
    want_x = np.zeros((4, 2), np.float32)
    want_s = np.zeros((3, 2))
    for p, d in enumerate(idx):
        i, j = divmod(p, 2)
        row = x[d] if d < 4 else np.zeros(2)
        if d < 4:
            want_x[d] = g[i] * scales[i, j]
        want_s[i, j] = g[i].astype(np.float64) @ (row + bias[expert[i, j]])
    assert_same_bits(grad_x, want_x)
    np.testing.assert_allclose(grad_scales, want_s, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_grad_session_equals_kernel_without_scales(dtype):
    g = np.random.default_rng(6).standard_normal((3, 4)).astype(dtype)
    idx = np.array([1, 4, -1, 0, 5, 2], np.int32)
    attrs = {"drop_pad_mode": 1, "expert_num": 3, "expert_capacity": 2}
    inputs = {"grad_y": g, "expanded_row_idx": idx}
    (grad_x,) = run_node("MoeFinalizeRoutingV2Grad", inputs, attrs, ["grad_expanded_x", ""])
    want = np.zeros((6, 4), dtype)
    for p, d in enumerate(idx.tolist()):
        if d >= 0:
            want[d] = g[p // 2]
    assert_same_bits(grad_x, want.reshape(3, 2, 4))


# --- errors ------------------------------------------------------------------------------

ROWS = np.ones((6, 2), np.float32)
IDX = np.arange(6, dtype=np.int32)


def forward(**changes):
    inputs = {
        "expanded_x": ROWS,
        "expanded_row_idx": IDX,
        "x1": None,
        "x2": None,
        "bias": None,
        "scales": None,
        "expert_idx": None,
    }
    attrs = {"drop_pad_mode": 2, "k": 2}
    for key, value in changes.items():
        (inputs if key in inputs else attrs)[key] = value
    return run_node("MoeFinalizeRoutingV2", inputs, attrs)


@pytest.mark.parametrize(
    "changes, code, fragment",
    [
        ({"drop_pad_mode": 4}, 561002, "'drop_pad_mode' must be one of [0, 1, 2, 3]"),
        ({"expanded_x": np.ones((2, 3, 2), np.float32)}, 561002, "expanded_x must be [R*K, H] in drop_pad_mode 2"),
        ({"drop_pad_mode": 3}, 561002, "expanded_x must be [E, C, H] in drop_pad_mode 3"),
        ({"expanded_row_idx": np.array([0, 1, 2, 3, 4, -1], np.int32)}, 561002, "[0, 6) (dropless: no -1), got -1"),
        ({"expanded_row_idx": np.arange(5, dtype=np.int32)}, 561002, "len(expanded_row_idx) must be R*k"),
        ({"x2": np.ones((3, 2), np.float32)}, 561002, "x2 is given without x1"),
        ({"x1": np.ones((2, 2), np.float32)}, 561002, "x1 must be [R, H]: dim 0 (got 2 and 3)"),
        ({"x1": np.ones((3, 2), np.float16)}, 161002, "x1 must have expanded_x's dtype (float32)"),
        ({"bias": np.ones((2, 2), np.float32)}, 561002, "bias is given without expert_idx"),
        ({"k": 0}, 561002, "k must be > 0"),
        ({"scales": np.ones((3, 2), np.float32), "k": 3}, 561002, "k = 3 must be 1 or equal K = scales dim 1 = 2"),
        ({"scales": np.ones((3, 2), np.float16)}, 161002, "scales must have expanded_x's dtype"),
        (
            {"bias": np.ones((2, 2), np.float32), "expert_idx": np.array([[0, 1], [2, 0], [1, 1]], np.int32)},
            561002,
            "expert_idx must be in [0, E) = [0, 2) (E = bias dim 0), got 2 at [1, 0]",
        ),
    ],
)
def test_forward_errors(changes, code, fragment):
    assert_refused(lambda: forward(**changes), code, fragment)


def test_padded_index_range():
    padded = np.ones((2, 2, 2), np.float32)
    idx = np.array([0, 1, 2, 3, -2, 0], np.int32)
    assert_refused(
        lambda: forward(expanded_x=padded, drop_pad_mode=3, expanded_row_idx=idx),
        561002,
        "[-1, 4) (-1 = dropped), got -2 at position 4",
    )


@pytest.mark.parametrize(
    "inputs, attrs, fragment",
    [
        ({"expanded_row_idx": np.array([0, 0, 1, 2, 3, 4], np.int32)}, {}, "names row 0 2 times"),
        ({"scales": np.ones((3, 2), np.float32)}, {}, "scales is given without expanded_x"),
        ({}, {"drop_pad_mode": 1}, "drop/pad mode (drop_pad_mode 1) needs expert_num > 0"),
        ({"expanded_row_idx": np.array([0, 1, 2, 3, 4, 6], np.int32)}, {}, "must be in [0, 6), got 6"),
        (
            {"expanded_x": np.ones((5, 2), np.float32), "scales": np.ones((3, 2), np.float32)},
            {},
            "expanded_x must have the forward's shape [6, 2]",
        ),
    ],
)
def test_grad_errors(inputs, attrs, fragment):
    given_inputs = {"grad_y": np.ones((3, 2), np.float32), "expanded_row_idx": IDX, "expanded_x": None, "scales": None}
    given_inputs.update(inputs)
    outputs = ["grad_expanded_x", "grad_scales" if given_inputs["scales"] is not None else ""]
    assert_refused(lambda: run_node("MoeFinalizeRoutingV2Grad", given_inputs, attrs, outputs), 561002, fragment)


def test_shape_inference():
    node = helper.make_node(
        "MoeFinalizeRoutingV2", ["x", "idx", "skip", "", "", "s"], ["y"], domain=moe_onnx.DOMAIN, drop_pad_mode=2
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["A", 7168]),
            helper.make_tensor_value_info("idx", TensorProto.INT32, ["A"]),
            helper.make_tensor_value_info("skip", TensorProto.BFLOAT16, ["T", 7168]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, ["T", 8]),
        ],
        [],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    assert inferred_types(model)["y"] == (TensorProto.BFLOAT16, ["T", 7168])


def test_npu_limit_experts_at_least_k():
    info = {
        "expanded_x": TensorInfo("float32", (2, 3, 4)),
        "expanded_row_idx": TensorInfo("int32", (9,)),
        "scales": TensorInfo("float32", (3, 3)),
    }
    assert targets.check("MoeFinalizeRoutingV2", info, {"drop_pad_mode": 3}, "ascend910b") == [
        "MoeFinalizeRoutingV2 on ascend910b: E = 2 experts is below K = 3 (the NPU needs E >= K)"
    ]
