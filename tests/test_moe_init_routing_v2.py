"""MoeInitRoutingV2: kernel vs a loop reference, session vs kernel, errors, shape inference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.custom_ops.moe_init_routing_v2 import moe_init_routing_v2
from tests.support import assert_refused, inferred_types, node_model, run_node

FLOAT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
OUTPUTS = ["expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum", "expert_tokens_before_capacity"]


def loop_reference(
    x,
    expert_idx,
    active_num=0,
    expert_capacity=0,
    expert_num=0,
    drop_pad_mode=0,
    expert_tokens_count_or_cumsum_flag=0,
    expert_tokens_before_capacity_flag=0,
):
    """SPEC 1.2 written as loops, independently of the kernel: walk experts in ascending
    order and, within one expert, source positions t*K+j in token-major order."""
    T, K = expert_idx.shape
    H = x.shape[1]
    walk = [
        (t, j)
        for e in sorted(set(expert_idx.ravel().tolist()))
        for t in range(T)
        for j in range(K)
        if expert_idx[t, j] == e
    ]
    row_idx = np.full(T * K, -7, np.int32)
    if drop_pad_mode == 0:
        rows = T * K if active_num == 0 else min(active_num, T * K)
        expanded = np.zeros((rows, H), x.dtype)
        for d, (t, j) in enumerate(walk):
            row_idx[t * K + j] = d
            if d < rows:
                expanded[d] = x[t]
    else:
        C, E = expert_capacity, expert_num
        expanded = np.zeros((E, C, H), x.dtype)
        filled = [0] * E
        for t, j in walk:
            e = int(expert_idx[t, j])
            r = filled[e]
            filled[e] += 1
            row_idx[t * K + j] = e * C + r if r < C else -1
            if r < C:
                expanded[e, r] = x[t]
    counts = np.array([np.count_nonzero(expert_idx == e) for e in range(expert_num)], np.int32)
    count_or_cumsum = {0: None, 1: np.cumsum(counts).astype(np.int32), 2: counts}[expert_tokens_count_or_cumsum_flag]
    return expanded, row_idx, count_or_cumsum, counts if expert_tokens_before_capacity_flag else None


def random_bits(rng, shape, dtype):
    """Arbitrary bit patterns (NaN payloads included): data movement must keep them."""
    size = np.dtype(dtype).itemsize
    raw = rng.integers(0, 2 ** (8 * size), size=shape, dtype=np.uint64)
    return raw.astype({2: np.uint16, 4: np.uint32}[size]).view(dtype)


def assert_same(got, want):
    if want is None:
        assert got is None
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (got, want)


def wanted_outputs(attrs):
    return [
        "expanded_x",
        "expanded_row_idx",
        "expert_tokens_count_or_cumsum" if attrs.get("expert_tokens_count_or_cumsum_flag") else "",
        "expert_tokens_before_capacity" if attrs.get("expert_tokens_before_capacity_flag") else "",
    ]


@st.composite
def cases(draw, mode=None):
    T, K, E, H = draw(st.integers(1, 7)), draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    # few experts used often: many ties, empty experts, full and overflowing capacities
    expert_idx = rng.integers(0, draw(st.integers(1, E)), (T, K)).astype(np.int32)
    x = random_bits(rng, (T, H), draw(st.sampled_from(FLOAT_DTYPES)))
    mode = mode or draw(st.sampled_from(["dropless", "active", "drop/pad"]))
    attrs = {
        "expert_num": E,
        "drop_pad_mode": int(mode == "drop/pad"),
        "expert_tokens_count_or_cumsum_flag": draw(st.sampled_from([0, 1, 2])),
        "expert_tokens_before_capacity_flag": draw(st.sampled_from([0, 1])),
    }
    if mode == "active":
        attrs["active_num"] = draw(st.integers(1, T * K + 3))
    if mode == "drop/pad":
        attrs["expert_capacity"] = draw(st.integers(1, T))
    return x, expert_idx, attrs


@given(cases())
def test_kernel_matches_loop_reference(case):
    x, expert_idx, attrs = case
    got = moe_onnx.OPS["MoeInitRoutingV2"](x, expert_idx, **attrs)
    want = loop_reference(x, expert_idx, **attrs)
    for g, w in zip(got, want):
        assert_same(g, w)


@given(cases())
def test_session_matches_kernel(case):
    x, expert_idx, attrs = case
    got = run_node("MoeInitRoutingV2", {"x": x, "expert_idx": expert_idx}, attrs, wanted_outputs(attrs))
    want = [w for w in moe_init_routing_v2(x, expert_idx, **attrs) if w is not None]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_same(g, w)


def test_stable_sort_keeps_token_major_order():
    """Every token picks expert 1 then expert 0: copies of one expert keep token order."""
    x = np.arange(4, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    expert_idx = np.array([[1, 0]] * 4, np.int32)
    expanded_x, row_idx, counts, _ = moe_init_routing_v2(
        x, expert_idx, expert_num=2, expert_tokens_count_or_cumsum_flag=2
    )
    assert np.array_equal(expanded_x[:, 0], [0, 1, 2, 3, 0, 1, 2, 3])
    # source p = t*2 + j: slot 1 (expert 0) of token t lands at row t, slot 0 at row 4 + t
    assert np.array_equal(row_idx, [4, 0, 5, 1, 6, 2, 7, 3])
    assert np.array_equal(counts, [4, 4])


def test_drop_pad_worked_example():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    expert_idx = np.array([[1, 0], [2, 1], [0, 1]], np.int32)
    expanded_x, row_idx, cumsum, before = moe_init_routing_v2(
        x,
        expert_idx,
        expert_capacity=2,
        expert_num=3,
        drop_pad_mode=1,
        expert_tokens_count_or_cumsum_flag=1,
        expert_tokens_before_capacity_flag=1,
    )
    # expert 1 gets tokens 0, 1, 2 but holds 2: token 2's copy (p = 5) is dropped
    assert np.array_equal(row_idx, [2, 0, 4, 3, 1, -1])
    assert np.array_equal(expanded_x[:, :, 0], [[0, 8], [0, 4], [4, 0]])
    assert np.array_equal(expanded_x[2, 1], np.zeros(4))
    assert np.array_equal(before, [2, 3, 1]) and np.array_equal(cumsum, [2, 5, 6])


def test_active_keeps_full_index():
    x = np.arange(3, dtype=np.float32)[:, None]
    expert_idx = np.array([[2, 0], [1, 2], [0, 1]], np.int32)
    expanded_x, row_idx, _, _ = moe_init_routing_v2(x, expert_idx, active_num=4)
    assert expanded_x.shape == (4, 1) and row_idx.shape == (6,)
    assert np.array_equal(row_idx, [4, 0, 2, 5, 1, 3])
    assert np.array_equal(expanded_x[:, 0], [0, 2, 1, 2])


def test_active_num_is_ignored_in_drop_pad_mode():
    """As on the NPU, active_num only applies to dropless mode (forward and grad alike)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    expert_idx = rng.integers(0, 3, (5, 2)).astype(np.int32)
    attrs = {"expert_num": 3, "drop_pad_mode": 1, "expert_capacity": 2}
    plain = moe_onnx.OPS["MoeInitRoutingV2"](x, expert_idx, **attrs)
    active = moe_onnx.OPS["MoeInitRoutingV2"](x, expert_idx, active_num=3, **attrs)
    for a, b in zip(plain[:2], active[:2]):
        assert_same(a, b)
    grad = moe_onnx.OPS["MoeInitRoutingV2Grad"]
    assert_same(
        grad(plain[0], plain[1], top_k=2, drop_pad_mode=1, active_num=1)[0],
        grad(plain[0], plain[1], top_k=2, drop_pad_mode=1)[0],
    )


def test_expert_num_zero_allows_any_ids_without_counts():
    x = np.ones((2, 3), np.float32)
    expert_idx = np.array([[7, -3], [100, 7]], np.int32)
    _, row_idx, _, _ = moe_onnx.OPS["MoeInitRoutingV2"](x, expert_idx)
    assert np.array_equal(row_idx, [1, 0, 3, 2])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_larger_shape_session_bit_identical(dtype):
    """Big enough (> 16 MiB moved) that the kernel splits its copy across threads."""
    rng = np.random.default_rng(11)
    T, K, E, H = 512, 4, 16, 2048
    x = random_bits(rng, (T, H), dtype)
    expert_idx = rng.integers(0, E, (T, K)).astype(np.int32)
    for attrs in [
        {"expert_num": E, "expert_tokens_count_or_cumsum_flag": 2},
        {"expert_num": E, "drop_pad_mode": 1, "expert_capacity": 100},
    ]:
        got = run_node("MoeInitRoutingV2", {"x": x, "expert_idx": expert_idx}, attrs, wanted_outputs(attrs))
        want = loop_reference(x, expert_idx, **attrs)
        for g, w in zip(got, [w for w in want if w is not None]):
            assert_same(g, w)


def test_zero_tokens():
    got = run_node(
        "MoeInitRoutingV2",
        {"x": np.zeros((0, 4), ml_dtypes.bfloat16), "expert_idx": np.zeros((0, 2), np.int32)},
        {"expert_num": 3, "expert_tokens_count_or_cumsum_flag": 2},
        wanted_outputs({"expert_tokens_count_or_cumsum_flag": 2}),
    )
    assert [g.shape for g in got] == [(0, 4), (0,), (3,)]
    assert got[0].dtype == ml_dtypes.bfloat16 and np.array_equal(got[2], [0, 0, 0])


# --- errors: refused by the bare call and both executors -------------------------------

x = np.ones((4, 3), np.float32)
expert_idx = np.array([[0, 1], [2, 1], [1, 1], [0, 2]], np.int32)


def run(x=x, expert_idx=expert_idx, outputs=None, **attrs):
    if outputs is None:
        outputs = [
            "expanded_x",
            "expanded_row_idx",
            "expert_tokens_count_or_cumsum" if attrs.get("expert_tokens_count_or_cumsum_flag") else "",
            "expert_tokens_before_capacity" if attrs.get("expert_tokens_before_capacity_flag") else "",
        ]
    return run_node("MoeInitRoutingV2", {"x": x, "expert_idx": expert_idx}, attrs, outputs)


def test_error_expert_id_too_large():
    assert_refused(
        lambda: run(expert_num=2),
        561002,
        "expert_idx must be in [0, expert_num) = [0, 2)",
        "got 2 at [1, 0]",
        "node 'node'",
    )


def test_error_expert_id_negative():
    assert_refused(
        lambda: run(expert_idx=-expert_idx, expert_num=3, drop_pad_mode=1, expert_capacity=2),
        561002,
        "got -1 at [0, 1]",
    )


def test_error_capacity_above_tokens():
    assert_refused(
        lambda: run(expert_num=3, drop_pad_mode=1, expert_capacity=5), 561002, "expert_capacity must be <= T = 4, got 5"
    )


def test_error_capacity_not_positive():
    assert_refused(
        lambda: run(expert_num=3, drop_pad_mode=1, expert_capacity=0),
        561002,
        "drop/pad mode needs expert_capacity > 0, got 0",
    )


def test_error_drop_pad_without_experts():
    assert_refused(lambda: run(drop_pad_mode=1, expert_capacity=2), 561002, "drop/pad mode needs expert_num > 0, got 0")


def test_error_counts_without_experts():
    assert_refused(
        lambda: run(expert_tokens_count_or_cumsum_flag=1),
        561002,
        "expert_tokens_count_or_cumsum_flag=1 needs expert_num > 0",
    )


def test_error_count_output_without_flag():
    assert_refused(
        lambda: run(expert_num=3, outputs=["a", "b", "c", ""]),
        561002,
        "expert_tokens_count_or_cumsum must be named if and only if",
        "flag 0, output present",
    )


def test_error_flag_without_count_output():
    assert_refused(
        lambda: run(expert_num=3, expert_tokens_before_capacity_flag=1, outputs=["a", "b", "", ""]),
        561002,
        "expert_tokens_before_capacity must be named",
        "flag 1, output absent",
    )


def test_error_bad_flag_value():
    assert_refused(
        lambda: run(expert_num=3, expert_tokens_count_or_cumsum_flag=3, outputs=["a", "b", "c", ""]),
        561002,
        "'expert_tokens_count_or_cumsum_flag' must be one of [0, 1, 2]",
    )


def test_error_bad_drop_pad_mode():
    assert_refused(lambda: run(drop_pad_mode=2), 561002, "'drop_pad_mode' must be one of [0, 1]")


def test_error_negative_active_num():
    assert_refused(lambda: run(active_num=-1), 561002, "active_num must be >= 0, got -1")


def test_error_negative_expert_num():
    assert_refused(lambda: run(expert_num=-2), 561002, "expert_num must be >= 0, got -2")


def test_error_token_count_mismatch():
    assert_refused(lambda: run(x=np.ones((3, 3), np.float32)), 561002, "same T (got 3 and 4)")


def test_error_rank_of_x():
    assert_refused(lambda: run(x=np.ones(4, np.float32)), 561002, "'x' must have rank 2")


def test_error_rank_of_expert_idx():
    assert_refused(lambda: run(expert_idx=expert_idx.reshape(8)), 561002, "'expert_idx' must have rank 2")


def test_error_zero_top_k():
    assert_refused(lambda: run(expert_idx=np.zeros((4, 0), np.int32)), 561002, "must have K > 0")


def test_error_x_dtype():
    assert_refused(lambda: run(x=np.ones((4, 3), np.float64)), 161002, "'x' has dtype float64")


def test_error_expert_idx_dtype():
    assert_refused(lambda: run(expert_idx=expert_idx.astype(np.int64)), 161002, "'expert_idx' has dtype int64")


# --- shape inference ------------------------------------------------------------------


def inferred(x_shape, idx_shape, attrs, outputs=None, x_type=TensorProto.BFLOAT16):
    node = helper.make_node(
        "MoeInitRoutingV2", ["x", "expert_idx"], outputs or OUTPUTS[:2], domain=moe_onnx.DOMAIN, name="node", **attrs
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", x_type, x_shape),
            helper.make_tensor_value_info("expert_idx", TensorProto.INT32, idx_shape),
        ],
        [],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    return inferred_types(model)


def test_shape_inference_dropless_symbolic():
    out = inferred(["T", "H"], ["T", 1], {})
    assert out["expanded_x"] == (TensorProto.BFLOAT16, ["T", "H"])
    assert out["expanded_row_idx"] == (TensorProto.INT32, ["T"])
    out = inferred(["T", "H"], ["T", 2], {})
    assert out["expanded_x"] == (TensorProto.BFLOAT16, [None, "H"])  # T*2 is no named dim
    assert out["expanded_row_idx"] == (TensorProto.INT32, [None])


def test_shape_inference_dropless_and_active_concrete():
    assert inferred([6, "H"], [6, 2], {})["expanded_x"][1] == [12, "H"]
    assert inferred([6, "H"], [6, 2], {"active_num": 5})["expanded_x"][1] == [5, "H"]
    assert inferred([6, "H"], [6, 2], {"active_num": 50})["expanded_x"][1] == [12, "H"]
    assert inferred(["T", "H"], ["T", 2], {"active_num": 5})["expanded_x"][1] == [None, "H"]
    assert inferred([6, "H"], [6, 2], {"active_num": 5})["expanded_row_idx"][1] == [12]


def test_shape_inference_drop_pad_and_counts():
    out = inferred(
        ["T", "H"],
        ["T", 8],
        {
            "drop_pad_mode": 1,
            "expert_num": 4,
            "expert_capacity": 3,
            "expert_tokens_count_or_cumsum_flag": 2,
            "expert_tokens_before_capacity_flag": 1,
        },
        OUTPUTS,
        x_type=TensorProto.FLOAT16,
    )
    assert out["expanded_x"] == (TensorProto.FLOAT16, [4, 3, "H"])
    assert out["expert_tokens_count_or_cumsum"] == (TensorProto.INT32, [4])
    assert out["expert_tokens_before_capacity"] == (TensorProto.INT32, [4])
    out = inferred(
        [5, 7], [5, 2], {"expert_num": 4, "expert_tokens_before_capacity_flag": 1}, OUTPUTS[:2] + ["", OUTPUTS[3]]
    )
    assert out["expanded_x"][1] == [10, 7] and out["expert_tokens_before_capacity"][1] == [4]
    assert "expert_tokens_count_or_cumsum" not in out


def test_shape_inference_rejects_capacity_above_known_tokens():
    with pytest.raises(Exception, match="expert_capacity must be <= T = 2"):
        inferred([2, 4], [2, 2], {"drop_pad_mode": 1, "expert_num": 4, "expert_capacity": 3})


def test_checker_accepts_model():
    model = node_model(
        "MoeInitRoutingV2",
        {"x": np.ones((4, 3), ml_dtypes.bfloat16), "expert_idx": np.zeros((4, 2), np.int32)},
        {"expert_num": 2, "expert_tokens_count_or_cumsum_flag": 1},
        OUTPUTS[:3] + [""],
    )
    onnx.checker.check_model(model, full_check=True)
