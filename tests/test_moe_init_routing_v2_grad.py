"""MoeInitRoutingV2Grad: seed example, loop reference, the VJP of the forward op, composition
with the forward op in one graph, rounding, determinism, errors and shape inference."""

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
from moe_onnx.custom_ops.moe_init_routing_v2_grad import moe_init_routing_v2_grad
from tests.support import assert_refused, assert_same_bits, inferred_types, run_node

FLOAT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
bf16 = ml_dtypes.bfloat16


def loop_reference(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=0, active_num=0):
    """seed 001's formula as loops: float32 terms added in order j = 0..K-1, skipped terms 0."""
    H = grad_expanded_x.shape[-1]
    rows = grad_expanded_x.reshape(-1, H)
    T = len(expanded_row_idx) // top_k
    grad_x = np.empty((T, H), grad_expanded_x.dtype)
    for t in range(T):
        total = None
        for j in range(top_k):
            r = int(expanded_row_idx[t * top_k + j])
            skipped = r >= active_num if drop_pad_mode == 0 and active_num > 0 else r == -1
            term = np.zeros(H, np.float32) if skipped else rows[r].astype(np.float32)
            total = term if total is None else np.float32(total + term)
        grad_x[t] = total.astype(grad_expanded_x.dtype)
    return grad_x


@st.composite
def routings(draw):
    """A forward call (float64 x, any mode) whose outputs feed the grad op."""
    T, K, E, H = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    expert_idx = rng.integers(0, E, (T, K)).astype(np.int32)
    mode = draw(st.sampled_from(["dropless", "active", "drop/pad"]))
    forward = {"expert_num": E, "drop_pad_mode": int(mode == "drop/pad")}
    if mode == "active":
        forward["active_num"] = draw(st.integers(1, T * K + 2))
    if mode == "drop/pad":
        forward["expert_capacity"] = draw(st.integers(1, T))
    backward = {"top_k": K, "drop_pad_mode": forward["drop_pad_mode"], "active_num": forward.get("active_num", 0)}
    return rng, expert_idx, H, forward, backward


def forward_jacobian(expert_idx, H, forward):
    """d expanded_x / d x of the forward kernel, [out_size, T*H], one unit vector per column."""
    T = expert_idx.shape[0]
    columns = []
    for k in range(T * H):
        unit = np.zeros(T * H)
        unit[k] = 1.0
        columns.append(moe_init_routing_v2(unit.reshape(T, H), expert_idx, **forward)[0].ravel())
    return np.stack(columns, axis=1)


@given(routings())
def test_grad_is_the_vjp_of_the_forward_float64(routing):
    """J^T g with J built from the forward kernel itself; bare kernels, float64 end to end."""
    rng, expert_idx, H, forward, backward = routing
    T = expert_idx.shape[0]
    expanded_x, expanded_row_idx, _, _ = moe_init_routing_v2(np.zeros((T, H)), expert_idx, **forward)
    g = rng.standard_normal(expanded_x.shape)
    (grad_x,) = moe_init_routing_v2_grad(g, expanded_row_idx, **backward)
    vjp = (forward_jacobian(expert_idx, H, forward).T @ g.ravel()).reshape(T, H)
    assert grad_x.dtype == np.float64
    np.testing.assert_allclose(grad_x, vjp, rtol=1e-13, atol=1e-13)


@given(routings(), st.sampled_from(FLOAT_DTYPES))
def test_session_grad_matches_vjp_and_loop_reference(routing, dtype):
    """Through the session in float32/float16/bfloat16: bit-exact with the loop reference,
    and within rounding of the float64 VJP of the forward op."""
    rng, expert_idx, H, forward, backward = routing
    T = expert_idx.shape[0]
    expanded_x, expanded_row_idx, _, _ = moe_init_routing_v2(np.zeros((T, H), np.float32), expert_idx, **forward)
    g = rng.standard_normal(expanded_x.shape).astype(dtype)
    (grad_x,) = run_node("MoeInitRoutingV2Grad", {"grad_expanded_x": g, "expanded_row_idx": expanded_row_idx}, backward)
    assert_same_bits(grad_x, loop_reference(g, expanded_row_idx, **backward))
    vjp = (forward_jacobian(expert_idx, H, forward).T @ g.astype(np.float64).ravel()).reshape(T, H)
    eps = float(ml_dtypes.finfo(dtype).eps)
    np.testing.assert_allclose(grad_x.astype(np.float64), vjp, rtol=eps, atol=eps * np.abs(g.astype(np.float64)).sum())


def test_seed_worked_example():
    """Seed 001: expanded_x [6, 4], expanded_row_idx 4 1 5 3 0 2, K = 2."""
    g = np.arange(24, dtype=np.float32).reshape(6, 4) ** 2
    (grad_x,) = run_node(
        "MoeInitRoutingV2Grad",
        {"grad_expanded_x": g, "expanded_row_idx": np.array([4, 1, 5, 3, 0, 2], np.int32)},
        {"top_k": 2},
    )
    assert np.array_equal(grad_x, np.stack([g[4] + g[1], g[5] + g[3], g[0] + g[2]]))


def test_skip_rules():
    g = np.arange(1, 5, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)  # rows 1, 2, 3, 4
    index = np.array([0, 3, -1, 1, 2, -1], np.int32)
    (dropped,) = moe_init_routing_v2_grad(g.reshape(2, 2, 2), index, top_k=2, drop_pad_mode=1)
    assert np.array_equal(dropped[:, 0], [1 + 4, 2, 3])
    active = np.array([0, 3, 5, 1, 2, 4], np.int32)  # active_num = 3: rows 3, 4, 5 were not kept
    (kept,) = moe_init_routing_v2_grad(g[:3], active, top_k=2, active_num=3)
    assert np.array_equal(kept[:, 0], [1, 2, 3])


def test_no_rows_all_dropped():
    (grad_x,) = run_node(
        "MoeInitRoutingV2Grad",
        {"grad_expanded_x": np.zeros((0, 2, 3), bf16), "expanded_row_idx": np.full(4, -1, np.int32)},
        {"top_k": 2, "drop_pad_mode": 1},
    )
    assert grad_x.shape == (2, 3) and grad_x.dtype == bf16 and not grad_x.astype(np.float32).any()


def test_float32_accumulation_and_round_to_nearest_even():
    # bfloat16: 1 + 2^-8 + 2^-8 is 1 + 2^-7 in float32, but 1.0 if summed in bfloat16
    # float16 / bfloat16: (1 + ulp) + ulp/2 is a tie; nearest even is 1 + 2 ulp (truncation: 1 + ulp)
    for dtype, ulp in ((bf16, 2.0**-7), (np.float16, 2.0**-10)):
        g = np.array([[1.0], [ulp / 2], [ulp / 2], [1.0 + ulp], [ulp / 2], [0.0]]).astype(dtype)
        (grad_x,) = moe_init_routing_v2_grad(g, np.arange(6, dtype=np.int32), top_k=3)
        assert grad_x.dtype == dtype
        assert grad_x[0, 0] == dtype(1.0 + ulp) and grad_x[1, 0] == dtype(1.0 + 2 * ulp)


def test_deterministic_bits():
    rng = np.random.default_rng(4)
    T, K, H = 300, 8, 256
    g = (rng.standard_normal((T * K, H)) * 10.0 ** rng.integers(-3, 4, (T * K, 1))).astype(bf16)
    index = rng.permutation(T * K).astype(np.int32)
    node = {"grad_expanded_x": g, "expanded_row_idx": index}
    first = run_node("MoeInitRoutingV2Grad", node, {"top_k": K})[0]
    assert_same_bits(first, loop_reference(g, index, K))
    for _ in range(3):
        assert_same_bits(run_node("MoeInitRoutingV2Grad", node, {"top_k": K})[0], first)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_large_threaded_matches_loop_reference(dtype):
    """Big enough (> 16 MiB read) that the kernel splits tokens across threads."""
    rng = np.random.default_rng(9)
    E, C, H, K = 16, 200, 1024, 4
    g = rng.standard_normal((E, C, H)).astype(dtype)
    index = rng.permutation(E * C).astype(np.int32)
    index[rng.random(E * C) < 0.2] = -1
    (grad_x,) = moe_init_routing_v2_grad(g, index, top_k=K, drop_pad_mode=1)
    assert_same_bits(grad_x, loop_reference(g, index, K, drop_pad_mode=1))


# --- forward -> grad in one graph -----------------------------------------------------


def forward_backward_model(dtype, T, K, H, forward, scale_by_upstream, expanded_shape):
    """x -> MoeInitRoutingV2 -> (Mul by an upstream gradient) -> MoeInitRoutingV2Grad."""
    elem = {np.float32: TensorProto.FLOAT, bf16: TensorProto.BFLOAT16, np.float16: TensorProto.FLOAT16}[dtype]
    backward = {"top_k": K, "drop_pad_mode": forward["drop_pad_mode"], "active_num": forward.get("active_num", 0)}
    nodes = [
        helper.make_node(
            "MoeInitRoutingV2",
            ["x", "expert_idx"],
            ["expanded_x", "expanded_row_idx"],
            domain=moe_onnx.DOMAIN,
            name="forward",
            **forward,
        )
    ]
    inputs = [
        helper.make_tensor_value_info("x", elem, [T, H]),
        helper.make_tensor_value_info("expert_idx", TensorProto.INT32, [T, K]),
    ]
    grad_input = "expanded_x"
    if scale_by_upstream:
        nodes.append(helper.make_node("Mul", ["expanded_x", "upstream"], ["grad_expanded_x"], name="mul"))
        inputs.append(helper.make_tensor_value_info("upstream", elem, expanded_shape))
        grad_input = "grad_expanded_x"
    nodes.append(
        helper.make_node(
            "MoeInitRoutingV2Grad",
            [grad_input, "expanded_row_idx"],
            ["grad_x"],
            domain=moe_onnx.DOMAIN,
            name="backward",
            **backward,
        )
    )
    graph = helper.make_graph(
        nodes,
        "forward_backward",
        inputs,
        [
            helper.make_tensor_value_info("grad_x", elem, [T, H]),
            helper.make_tensor_value_info("expanded_x", elem, expanded_shape),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(model, strict_mode=True), full_check=True)
    return model


FORWARD_MODES = {
    "dropless": {"expert_num": 4, "drop_pad_mode": 0},
    "active": {"expert_num": 4, "drop_pad_mode": 0, "active_num": 9},
    "active_beyond": {"expert_num": 4, "drop_pad_mode": 0, "active_num": 100},
    "drop_pad": {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 3},
}


@pytest.mark.parametrize("mode", FORWARD_MODES)
@pytest.mark.parametrize(
    "dtype,scale", [(np.float32, True), (bf16, False), (np.float16, False)], ids=["float32-mul", "bfloat16", "float16"]
)
def test_forward_then_grad_in_one_session(mode, dtype, scale):
    forward = FORWARD_MODES[mode]
    T, K, H = 6, 3, 5
    rng = np.random.default_rng(8)
    x = rng.standard_normal((T, H)).astype(dtype)
    expert_idx = rng.integers(0, 4, (T, K)).astype(np.int32)
    expanded_x, row_idx, _, _ = moe_init_routing_v2(x, expert_idx, **forward)
    feeds = {"x": x, "expert_idx": expert_idx}
    upstream = rng.standard_normal(expanded_x.shape).astype(np.float32)
    if scale:
        feeds["upstream"] = upstream
    session = moe_onnx.InferenceSession(forward_backward_model(dtype, T, K, H, forward, scale, expanded_x.shape))
    grad_x, got_expanded = session.run(None, feeds)
    assert_same_bits(got_expanded, expanded_x)
    # numpy: each kept copy of token t carries x[t] (times its upstream gradient)
    g = (expanded_x * upstream) if scale else expanded_x
    flat = g.reshape(-1, H).astype(np.float64)
    want = np.zeros((T, H))
    kept_rows = len(flat) if forward["drop_pad_mode"] == 1 else min(forward.get("active_num") or T * K, T * K)
    for p, r in enumerate(row_idx):
        if 0 <= r < kept_rows:
            want[p // K] += flat[r]
    assert grad_x.dtype == dtype and grad_x.shape == (T, H)
    np.testing.assert_allclose(grad_x.astype(np.float64), want, rtol=4 * float(ml_dtypes.finfo(dtype).eps), atol=1e-6)
    if not scale:  # every kept copy is x[t] itself: grad_x = x * (number of kept copies)
        copies = np.bincount(np.arange(T * K)[(row_idx >= 0) & (row_idx < kept_rows)] // K, minlength=T)
        # (+ 0.0: a token with no kept copy gets +0.0, the sum of no terms, even where x < 0)
        assert_same_bits(grad_x, (x.astype(np.float32) * copies[:, None] + np.float32(0)).astype(dtype))


# --- errors: refused by the bare call and both executors -------------------------------

g2 = np.ones((6, 4), np.float32)
g3 = np.ones((3, 2, 4), np.float32)
index = np.array([4, 1, 5, 3, 0, 2], np.int32)


def run(g=g2, index=index, **attrs):
    attrs.setdefault("top_k", 2)
    if attrs["top_k"] is None:
        del attrs["top_k"]
    return run_node("MoeInitRoutingV2Grad", {"grad_expanded_x": g, "expanded_row_idx": index}, attrs)


def test_error_rank_3_in_dropless_mode():
    assert_refused(
        lambda: run(g=g3),
        561002,
        "grad_expanded_x must be [A, H] in dropless mode",
        "got shape [3, 2, 4]",
        "MoeInitRoutingV2Grad node",
    )


def test_error_rank_2_in_drop_pad_mode():
    assert_refused(
        lambda: run(drop_pad_mode=1), 561002, "grad_expanded_x must be [E, C, H] in drop/pad mode (drop_pad_mode=1)"
    )


def test_error_rank_1_grad():
    assert_refused(lambda: run(g=np.ones(6, np.float32)), 561002, "'grad_expanded_x' must have rank 2 or 3")


def test_error_index_not_1d():
    assert_refused(lambda: run(index=index.reshape(3, 2)), 561002, "'expanded_row_idx' must have rank 1")


def test_error_index_length_not_divisible():
    assert_refused(lambda: run(top_k=4), 561002, "len(expanded_row_idx) = 6 must be divisible by top_k = 4")


def test_error_top_k_not_positive():
    assert_refused(lambda: run(top_k=0), 561002, "top_k must be > 0, got 0")


def test_error_top_k_missing():
    assert_refused(lambda: run(top_k=None), 161001, "attribute 'top_k' is required")


def test_error_drop_pad_mode_value():
    assert_refused(lambda: run(drop_pad_mode=2), 561002, "'drop_pad_mode' must be one of [0, 1], got 2")


def test_error_negative_active_num():
    assert_refused(lambda: run(active_num=-1), 561002, "active_num must be >= 0, got -1")


def test_error_dropless_rows_mismatch():
    assert_refused(
        lambda: run(g=np.ones((5, 4), np.float32)),
        561002,
        "dropless mode: grad_expanded_x dim 0 must equal len(expanded_row_idx) (got 5 and 6)",
    )


def test_error_active_rows_mismatch():
    assert_refused(
        lambda: run(active_num=4),
        561002,
        "active mode: grad_expanded_x dim 0 must equal min(active_num, len(expanded_row_idx))",
        "(got 6 and 4)",
    )


def test_error_dropless_index_out_of_range():
    assert_refused(
        lambda: run(index=np.array([4, 1, 6, 3, 0, 2], np.int32)),
        561002,
        "expanded_row_idx[2] = 6 names no row of grad_expanded_x (dropless mode): "
        "must be -1 (an inactive expert's copy, skipped) or in [0, 6)",
    )


def test_dropless_skips_minus_one():
    """SPEC 1.3 amended: a partial active_expert_range (MoeInitRoutingV3) marks the copies of
    inactive experts -1; dropless mode skips them as drop/pad mode skips dropped copies."""
    g = np.arange(24, dtype=np.float32).reshape(6, 4) ** 2
    minus_one = np.array([4, 1, 5, 3, -1, 2], np.int32)  # token 2's first copy: an inactive expert
    (grad_x,) = run_node("MoeInitRoutingV2Grad", {"grad_expanded_x": g, "expanded_row_idx": minus_one}, {"top_k": 2})
    assert np.array_equal(grad_x, np.stack([g[4] + g[1], g[5] + g[3], g[2]]))
    assert_same_bits(grad_x, loop_reference(g, minus_one, top_k=2))


def test_error_dropless_index_below_minus_one():
    assert_refused(
        lambda: run(index=np.array([4, 1, 5, 3, -2, 2], np.int32)),
        561002,
        "expanded_row_idx[4] = -2 names no row of grad_expanded_x (dropless mode): "
        "must be -1 (an inactive expert's copy, skipped) or in [0, 6)",
    )


def test_error_active_negative_index():
    assert_refused(
        lambda: run(g=g2[:4], index=np.array([4, 1, 5, 3, -2, 2], np.int32), active_num=4),
        561002,
        "expanded_row_idx[4] = -2 names no row of grad_expanded_x (active mode): "
        "must be >= active_num = 4 (skipped) or in [0, 4)",
    )


def test_error_drop_pad_index_out_of_range():
    assert_refused(
        lambda: run(g=g3, index=np.array([4, 1, 6, 3, 0, -1], np.int32), drop_pad_mode=1),
        561002,
        "expanded_row_idx[2] = 6",
        "must be -1 (dropped) or in [0, 6)",
    )


def test_error_drop_pad_index_below_minus_one():
    assert_refused(
        lambda: run(g=g3, index=np.array([4, 1, -2, 3, 0, -1], np.int32), drop_pad_mode=1),
        561002,
        "expanded_row_idx[2] = -2",
    )


def test_error_grad_dtype():
    assert_refused(lambda: run(g=np.ones((6, 4), np.float64)), 161002, "'grad_expanded_x' has dtype float64")


def test_error_index_dtype():
    assert_refused(lambda: run(index=index.astype(np.int64)), 161002, "'expanded_row_idx' has dtype int64")


def test_bare_op_call_raises():
    with pytest.raises(moe_onnx.MoeOpError) as info:
        moe_onnx.OPS["MoeInitRoutingV2Grad"](np.ones((6, 4), np.float32), np.arange(-2, 4, dtype=np.int32), top_k=3)
    assert info.value.code == 561002 and info.value.op_type == "MoeInitRoutingV2Grad"


# --- shape inference ------------------------------------------------------------------


def inferred(grad_shape, index_shape, attrs, elem=TensorProto.BFLOAT16):
    node = helper.make_node(
        "MoeInitRoutingV2Grad",
        ["grad_expanded_x", "expanded_row_idx"],
        ["grad_x"],
        domain=moe_onnx.DOMAIN,
        name="node",
        **attrs,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("grad_expanded_x", elem, grad_shape),
            helper.make_tensor_value_info("expanded_row_idx", TensorProto.INT32, index_shape),
        ],
        [],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    return inferred_types(model)["grad_x"]


def test_shape_inference():
    assert inferred([12, "H"], [12], {"top_k": 3}) == (TensorProto.BFLOAT16, [4, "H"])
    assert inferred(["A", "H"], ["A"], {"top_k": 1}, TensorProto.FLOAT16) == (TensorProto.FLOAT16, ["A", "H"])
    assert inferred(["A", "H"], ["A"], {"top_k": 2}) == (TensorProto.BFLOAT16, [None, "H"])
    assert inferred([5, 7], [12], {"top_k": 2, "active_num": 5}) == (TensorProto.BFLOAT16, [6, 7])
    assert inferred(["E", "C", "H"], [16], {"top_k": 8, "drop_pad_mode": 1}) == (TensorProto.BFLOAT16, [2, "H"])
    assert inferred([4, 3, 9], ["L"], {"top_k": 2, "drop_pad_mode": 1}, TensorProto.FLOAT) == (
        TensorProto.FLOAT,
        [None, 9],
    )


def test_shape_inference_rejects_bad_rows():
    with pytest.raises(Exception, match="dropless mode: grad_expanded_x dim 0 must equal"):
        inferred([10, "H"], [12], {"top_k": 3})
