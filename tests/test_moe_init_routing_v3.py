"""MoeInitRoutingV3 (SPEC-layer 1.17): the loop reference over random calls, the aclnn doc's
example, MoeInitRoutingV2 as its subset, byte storage, refusals (quantisation by number) and
shape inference; the torch op and its gradient (seed 001's auto-backward)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.custom_ops import targets
from moe_onnx.custom_ops.moe_init_routing_v3 import QUANT_MODES, moe_init_routing_v3
from tests.references import assert_same, init_routing_v3_reference
from tests.support import assert_refused, assert_same_bits, inferred_types, run_node

OP = moe_onnx.OPS["MoeInitRoutingV3"]
OUTPUTS = ["expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum", "expanded_scale"]
DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.uint8, ml_dtypes.float8_e4m3fn]


@st.composite
def calls(draw, dtypes=tuple(DTYPES)):
    """(inputs, attributes) of a valid call: any mode, range, index type and count type."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    padded = draw(st.booleans())
    tokens, top_k = draw(st.integers(int(padded), 6)), draw(st.integers(1, 4))
    experts, hidden = draw(st.integers(1, 7)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(dtypes))
    x = (
        rng.integers(0, 256, (tokens, hidden), dtype=np.uint8).view(np.dtype(dtype))
        if np.dtype(dtype).itemsize == 1
        else rng.standard_normal((tokens, hidden)).astype(dtype)
    )
    expert_idx = rng.integers(0 if padded else -2, experts, (tokens, top_k)).astype(np.int32)
    scale = rng.standard_normal(tokens).astype(np.float32) if draw(st.booleans()) else None
    attrs = {"expert_num": experts, "expert_tokens_num_flag": draw(st.sampled_from([0, 1]))}
    if padded:
        attrs.update(drop_pad_mode=1, expert_capacity=draw(st.integers(1, tokens)), expert_tokens_num_type=1)
    else:
        start = draw(st.integers(0, experts - 1))
        attrs.update(
            active_num=draw(st.integers(-1, tokens * top_k + 2)),
            row_idx_type=draw(st.sampled_from([0, 1])),
            expert_tokens_num_type=draw(st.sampled_from([0, 1, 2])),
            active_expert_range=draw(st.sampled_from([None, [start, draw(st.integers(start + 1, experts))]])),
        )
    return {"x": x, "expert_idx": expert_idx, "scale": scale}, attrs


def outputs_of(attrs) -> list[str]:
    return [o if o != OUTPUTS[2] or attrs.get("expert_tokens_num_flag") else "" for o in OUTPUTS]


@settings(max_examples=80)
@given(calls())
def test_kernel_matches_the_loop_reference(call):
    inputs, attrs = call
    got = OP(*inputs.values(), **attrs)
    want = init_routing_v3_reference(*inputs.values(), **attrs)
    for g, w in zip(got, want):
        if w is not None and w.dtype.itemsize == 1:
            assert_same_bits(g, w)  # bytes (float8 NaNs compare by bits)
        else:
            assert_same(g, w)


@settings(max_examples=15)
@given(calls())
def test_session_gives_the_kernel_bits(call):
    inputs, attrs = call
    got = run_node("MoeInitRoutingV3", inputs, attrs, outputs_of(attrs))
    want = [w for w in OP(*inputs.values(), **attrs) if w is not None]
    for g, w in zip(got, want):
        assert_same_bits(g, w)


def test_the_aclnn_doc_example():
    """aclnnMoeInitRoutingV3.md's call: x [3, 2], K = 4, expert_num 256, range [0, 4],
    row_idx_type 1 (dst -> src), counts (type 1), a scale; values worked out by hand."""
    x = np.array([[0.1, 0.1], [0.2, 0.2], [0.3, 0.3]], np.float32)
    expert_idx = np.array([[1, 2, 0, 3], [0, 2, 1, 3], [0, 1, 3, 2]], np.int32)
    scale = np.array([0.3423, 0.1652, 0.2652], np.float32)
    attrs = dict(active_num=12, expert_capacity=4, expert_num=256, expert_tokens_num_type=1, expert_tokens_num_flag=1)
    expanded_x, row_idx, counts, expanded_scale = OP(
        x, expert_idx, scale, active_expert_range=[0, 4], row_idx_type=1, **attrs
    )
    # expert 0 takes slots 2, 4, 8; expert 1: 0, 6, 9; expert 2: 1, 5, 11; expert 3: 3, 7, 10
    assert row_idx.tolist() == [2, 4, 8, 0, 6, 9, 1, 5, 11, 3, 7, 10]
    assert counts.dtype == np.int64 and counts.tolist() == [3, 3, 3, 3]
    tokens = [p // 4 for p in row_idx.tolist()]
    assert np.array_equal(expanded_x, x[tokens]) and np.array_equal(expanded_scale, scale[tokens])


def test_partial_range_marks_inactive_slots_and_zero_fills():
    """vllm-ascend's use: experts [2, 4) of 6 on this rank; slots of others get -1, rows past
    the in-range ones are zeros (the NPU leaves them unwritten)."""
    x = np.arange(1, 9, dtype=np.float32).reshape(4, 2)
    expert_idx = np.array([[2, 0], [5, 3], [3, 2], [1, 4]], np.int32)
    expanded_x, row_idx, counts, scale = OP(
        x, expert_idx, expert_num=6, active_expert_range=[2, 4], expert_tokens_num_flag=1, expert_tokens_num_type=2
    )
    assert row_idx.tolist() == [0, -1, -1, 2, 3, 1, -1, -1]  # expert 2: tokens 0, 2; expert 3: tokens 1, 2
    assert expanded_x.tolist() == [[1, 2], [5, 6], [3, 4], [5, 6]] + [[0, 0]] * 4
    assert counts.tolist() == [[2, 2], [3, 2]] + [[0, 0]] * 4
    assert not scale.any() and scale.shape == (8,)
    _, gather, _, _ = OP(x, expert_idx, expert_num=6, active_expert_range=[2, 4], row_idx_type=1)
    # in range first, then ids >= 4 (4, 5), then ids < 2 (slots 1, 6 in order)
    assert gather.tolist() == [0, 5, 3, 4, 7, 2, 1, 6]


def test_v2_is_the_subset_whole_range_row_idx_type_0():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, 5)).astype(ml_dtypes.bfloat16)
    expert_idx = rng.integers(0, 5, (7, 3)).astype(np.int32)
    for attrs in ({}, {"active_num": 9}, {"drop_pad_mode": 1, "expert_capacity": 3}):
        v2 = moe_onnx.OPS["MoeInitRoutingV2"](x, expert_idx, expert_num=5, **attrs)
        v3 = OP(x, expert_idx, expert_num=5, expert_tokens_num_type=1, expert_tokens_num_flag=1, **attrs)
        assert_same_bits(v3[0], v2[0])
        assert_same_bits(v3[1], v2[1])
        assert v3[2].tolist() == np.bincount(expert_idx.ravel(), minlength=5).tolist()


def test_scale_moves_with_the_rows_in_drop_pad_mode():
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    expert_idx = np.array([[0, 1], [0, 1], [0, 0]], np.int32)
    scale = np.array([10, 20, 30], np.float32)
    expanded_x, row_idx, _, expanded_scale = OP(x, expert_idx, scale, expert_num=2, drop_pad_mode=1, expert_capacity=2)
    assert expanded_x.shape == (2, 2, 2) and row_idx.tolist() == [0, 2, 1, 3, -1, -1]
    assert expanded_scale.tolist() == [10, 20, 10, 20]


def test_byte_storage_with_x_dtype_moves_bytes():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (5, 7), dtype=np.uint8)  # e.g. hifloat8 bytes
    expert_idx = rng.integers(0, 4, (5, 2)).astype(np.int32)
    for x_dtype in ("hifloat8", "float4_e2m1fn_x2", "float8e4m3fn"):
        got = run_node(
            "MoeInitRoutingV3",
            {"x": x, "expert_idx": expert_idx},
            {"expert_num": 4, "x_dtype": x_dtype},
            ["expanded_x", "expanded_row_idx", "", "expanded_scale"],
        )
        order = np.argsort(expert_idx.ravel(), kind="stable")
        assert np.array_equal(got[0], x[order // 2])


# --- refusals ----------------------------------------------------------------------------

X, IDX = np.ones((4, 2), np.float32), np.array([[0, 1], [2, 3], [1, 0], [3, 2]], np.int32)


@pytest.mark.parametrize("mode", sorted(QUANT_MODES))
def test_quantisation_is_refused_by_number(mode):
    assert_refused(
        lambda: OP(X, IDX, expert_num=4, quant_mode=mode), 161002, f"quant_mode={mode} ({QUANT_MODES[mode]})"
    )


@pytest.mark.parametrize(
    "inputs, attrs, code, fragment",
    [
        ((X, IDX), {"expert_num": 4, "quant_mode": 10}, 161002, "quant_mode=10 is not a quant_mode"),
        ((X, IDX, None, np.ones(1, np.float32)), {"expert_num": 4}, 161002, "input offset is only read by quant"),
        ((X, IDX), {"expert_num": 4, "x_dtype": "hifloat8"}, 161002, "describes uint8 storage, but x is float32"),
        ((X, IDX), {}, 561002, "expert_num must be > 0, got -1"),
        ((X, IDX), {"expert_num": 4, "active_expert_range": [1]}, 561002, "must be [] or [start, end], got [1]"),
        ((X, IDX), {"expert_num": 4, "active_expert_range": [2, 2]}, 561002, "0 <= start < end <= expert_num"),
        ((X, IDX), {"expert_num": 4, "active_expert_range": [-1, 2]}, 561002, "[-1, 2] must satisfy"),
        ((X, IDX), {"expert_num": 4, "active_expert_range": [0, 5]}, 561002, "[0, 5] must satisfy"),
        ((X, IDX), {"expert_num": 3}, 561002, "expert_idx must be below expert_num = 3, got 3 at [1, 1]"),
        (
            (X, IDX),
            {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 2, "active_expert_range": [0, 2]},
            561002,
            "drop/pad mode needs the whole expert range [0, 4], got [0, 2]",
        ),
        (
            (X, IDX),
            {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 2, "row_idx_type": 1},
            561002,
            "drop/pad mode needs row_idx_type 0",
        ),
        (
            (X, IDX),
            {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 2, "expert_tokens_num_flag": 1},
            561002,
            "expert_tokens_num_type must be 1, got 0",
        ),
        ((X, IDX), {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 5}, 561002, "must be <= T = 4"),
        ((X, IDX), {"expert_num": 4, "drop_pad_mode": 1}, 561002, "needs expert_capacity > 0, got -1"),
        (
            (X, np.where(IDX == 3, -1, IDX)),
            {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 2},
            561002,
            "expert_idx must be [0, expert_num) = [0, 4), got -1 at [1, 1]",
        ),
        ((X, IDX, np.ones(3, np.float32)), {"expert_num": 4}, 561002, "scale must be [T]"),
        ((X[:3], IDX), {"expert_num": 4}, 561002, "the same T"),
        ((X, IDX), {"expert_num": 4, "active_num": -2}, 561002, "active_num must be >= -1 in dropless mode, got -2"),
    ],
)
def test_rules(inputs, attrs, code, fragment):
    assert_refused(lambda: OP(*inputs, **attrs), code, fragment)
    named = dict(zip(["x", "expert_idx", "scale", "offset"], inputs))
    assert_refused(lambda: run_node("MoeInitRoutingV3", named, attrs, outputs_of(attrs)), code, fragment)


def test_negative_ids_are_out_of_range_when_dropless():
    expanded_x, row_idx, counts, _ = OP(
        X, np.array([[-1, 1]] * 4, np.int32), expert_num=4, expert_tokens_num_flag=1, expert_tokens_num_type=1
    )
    assert row_idx.tolist() == [-1, 0, -1, 1, -1, 2, -1, 3] and counts.tolist() == [0, 4, 0, 0]
    assert not expanded_x[4:].any()


def test_npu_limits():
    info = {"x": X, "expert_idx": IDX}
    assert targets.check("MoeInitRoutingV3", info, {"expert_num": 4}, "ascend910b") == []
    big = {"expert_num": 6000, "expert_tokens_num_type": 2}
    assert targets.check("MoeInitRoutingV3", info, big, "ascend910b") == [
        "MoeInitRoutingV3 on ascend910b: expert_num = 6000 exceeds 5120 (key/value counts)"
    ]
    assert targets.check("MoeInitRoutingV3", info, {"expert_num": 4, "active_num": 5}, "ascend950") == [
        "MoeInitRoutingV3 on ascend950: active_num = 5 must be -1, 0 or T*K = 8 on ascend950"
    ]


def test_shape_inference_symbolic_and_key_value():
    node = helper.make_node(
        "MoeInitRoutingV3",
        ["x", "expert_idx", "scale"],
        OUTPUTS,
        domain="cann.moe",
        expert_num=8,
        expert_tokens_num_flag=1,
        expert_tokens_num_type=2,
        active_expert_range=[2, 6],
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["T", 16]),
            helper.make_tensor_value_info("expert_idx", TensorProto.INT32, ["T", 1]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, ["T"]),
        ],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in OUTPUTS],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann.moe", 1)])
    types = inferred_types(model)
    assert types["expanded_x"] == (TensorProto.BFLOAT16, ["T", 16])
    assert types["expanded_row_idx"] == (TensorProto.INT32, ["T"])
    assert types["expert_tokens_count_or_cumsum"] == (TensorProto.INT64, [8, 2])
    assert types["expanded_scale"] == (TensorProto.FLOAT, ["T"])


# --- the torch op ------------------------------------------------------------------------


def test_torch_gradient_sums_each_tokens_kept_copies():
    """Seed 001's auto-backward through MoeInitRoutingV2Grad: d sum(w * expanded_x) / dx[t] sums
    w over the rows that copy t; inactive experts' copies and rows past active_num give none."""
    torch.manual_seed(0)
    x = torch.randn(5, 3, requires_grad=True)
    expert_idx = torch.randint(0, 6, (5, 2), dtype=torch.int32)
    for attrs in (
        {"active_expert_range": [1, 4]},
        {"active_expert_range": [1, 4], "active_num": 3},
        {"active_num": 4},
        {"drop_pad_mode": 1, "expert_capacity": 2},
    ):
        expanded_x, row_idx, _, _ = mt.moe_init_routing_v3(x, expert_idx, expert_num=6, **attrs)
        weights = torch.randn(expanded_x.shape)
        (grad,) = torch.autograd.grad((expanded_x * weights).sum(), x)
        rows = weights.reshape(-1, 3)
        want = torch.zeros(5, 3)
        for p, d in enumerate(row_idx.tolist()):
            if 0 <= d < len(rows):
                want[p // 2] += rows[d]
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "attrs, feature",
    [({"row_idx_type": 1}, "row_idx_type=1"), ({"scale": True}, "scale")],
)
def test_torch_backward_refuses_v4_features_by_name(attrs, feature):
    x = torch.randn(4, 3, requires_grad=True)
    scale = torch.ones(4) if attrs.pop("scale", False) else None
    expanded_x, *_ = mt.moe_init_routing_v3(x, torch.zeros(4, 2, dtype=torch.int32), scale, expert_num=2, **attrs)
    with pytest.raises(NotImplementedError, match=f"no automatic backward when the forward uses {feature}"):
        expanded_x.sum().backward()


def test_torch_function_equals_the_kernel():
    inputs, attrs = {"x": np.arange(8, dtype=np.float32).reshape(4, 2), "expert_idx": IDX, "scale": None}, {}
    attrs = {"expert_num": 4, "active_expert_range": [1, 3], "expert_tokens_num_flag": 1}
    got = mt.moe_init_routing_v3(*[None if v is None else torch.from_numpy(v) for v in inputs.values()], **attrs)
    for g, w in zip(got, moe_init_routing_v3(*inputs.values(), **attrs)):
        assert np.array_equal(g.numpy(), w)
