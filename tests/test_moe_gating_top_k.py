"""MoeGatingTopK (+ the V2 hash mode): kernel vs the loop reference, session vs kernel, grouped
selection with ties, the -inf (not 0.0) fill, renorm, errors, shape inference, target limits."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.custom_ops import TensorInfo, targets
from moe_onnx.custom_ops.moe_gating_top_k import moe_gating_top_k
from tests.references import FLOAT_DTYPES, assert_same, gating_scores_reference, gating_top_k_reference
from tests.support import assert_refused, assert_same_bits, inferred_types, node_model, run_node

OP = "MoeGatingTopK"
INPUTS = ("x", "bias", "input_ids", "tid2eid")


def grid(rng, shape, dtype, step=0.25, span=6):
    """Values on a coarse grid: exact ties inside groups, across groups and at the k-th place."""
    return (rng.integers(-span, span + 1, shape) * step).astype(np.float32).astype(dtype)


@st.composite
def cases(draw, hash_mode=False):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    mode = draw(st.sampled_from([0, 1]))
    groups = draw(st.integers(1, 4))
    per = draw(st.integers(max(1, mode + 1), 5))
    experts = groups * per
    k_group = draw(st.integers(1, groups))
    k = draw(st.integers(1, k_group * per))
    tokens = draw(st.integers(0, 6))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    tied = draw(st.booleans())
    x = grid(rng, (tokens, experts), dtype) if tied else rng.standard_normal((tokens, experts)).astype(dtype)
    bias = None
    if draw(st.booleans()):
        bias = grid(rng, experts, dtype, 0.125, 2) if tied else (rng.standard_normal(experts) * 0.3).astype(dtype)
    inputs = {"x": x, "bias": bias, "input_ids": None, "tid2eid": None}
    if hash_mode:
        rows = draw(st.integers(1, 5))
        index_dtypes = draw(st.sampled_from([(np.int32, np.int32), (np.int64, np.int32), (np.int32, np.int64)]))
        inputs["input_ids"] = rng.integers(0, rows, tokens).astype(index_dtypes[0])
        inputs["tid2eid"] = rng.integers(0, experts, (rows, k)).astype(index_dtypes[1])  # repeats allowed
    attrs = {
        "k": k,
        "k_group": k_group,
        "group_count": groups,
        "group_select_mode": mode,
        "renorm": draw(st.sampled_from([0, 1])),
        "norm_type": draw(st.sampled_from([0, 1, 2])),
        "out_flag": draw(st.sampled_from([0, 1])),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5, 0.0])),
        "eps": draw(st.sampled_from([1e-20, 0.1])),
    }
    return inputs, attrs


def check_against_reference(inputs, attrs):
    got = moe_onnx.OPS[OP](*inputs.values(), **attrs)
    want = gating_top_k_reference(*inputs.values(), **attrs)
    for g, w in zip(got, want):
        assert_same(g, w)


@given(cases())
def test_kernel_matches_reference(case):
    check_against_reference(*case)


@given(cases(hash_mode=True))
def test_hash_mode_matches_reference(case):
    check_against_reference(*case)


@given(st.one_of(cases(), cases(hash_mode=True)))
def test_session_matches_kernel(case):
    inputs, attrs = case
    got = run_node(OP, inputs, attrs)
    for g, w in zip(got, moe_gating_top_k(*inputs.values(), **attrs)):
        assert_same_bits(g, w)


def deepseek_attrs(**extra):
    return {"k": 8, "k_group": 4, "group_count": 8, "group_select_mode": 1, "norm_type": 1, **extra}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_deepseek_v3_shape_session_matches_reference(dtype):
    """T = 1024, E = 256 in 8 groups, top-4 groups, k = 8, bias, routed_scaling_factor 2.5:
    split over threads, the reference's bits; ties from the grid included."""
    rng = np.random.default_rng(7)
    x = grid(rng, (1024, 256), dtype, 0.0625, 40)
    bias = (rng.standard_normal(256) * 0.01).astype(dtype)
    inputs = {"x": x, "bias": bias, "input_ids": None, "tid2eid": None}
    attrs = deepseek_attrs(routed_scaling_factor=2.5)
    got = run_node(OP, inputs, attrs)
    for g, w in zip(got, gating_top_k_reference(*inputs.values(), **attrs)):
        assert_same(g, w)


@pytest.mark.parametrize("norm_type", [0, 1, 2])
def test_bits_do_not_depend_on_row_blocks_threads_or_layout(monkeypatch, norm_type):
    """Rows are computed one by one, so blocks of 7 rows (the last one short) on two threads,
    or a Fortran-ordered x, give the bits of the default call, for both gating ops."""
    from moe_onnx.custom_ops import gating, parallel
    from moe_onnx.custom_ops.moe_gating_top_k_softmax import moe_gating_top_k_softmax

    rng = np.random.default_rng(21)
    x = grid(rng, (300, 256), np.float32, 0.0625, 40)
    x[::17, 3] = np.nan
    bias = (rng.standard_normal(256) * 0.01).astype(np.float32)
    attrs = deepseek_attrs(norm_type=norm_type, routed_scaling_factor=2.5)
    whole = moe_gating_top_k(x, bias, **attrs) + moe_gating_top_k_softmax(x, None, k=8)
    monkeypatch.setattr(gating, "_BLOCK_ELEMENTS", 7 * 256)
    monkeypatch.setattr(parallel, "_PARALLEL_MIN_BYTES", 1)  # every call on every worker
    for logits in (x, np.asfortranarray(x)):
        split = moe_gating_top_k(logits, bias, **attrs) + moe_gating_top_k_softmax(logits, None, k=8)
        for a, b in zip(whole, split):
            assert_same_bits(a, b)


def test_equal_groups_go_to_the_lower_group():
    """Groups 1 and 3 score the same (same values): k_group = 1 keeps group 1."""
    x = np.array([[0.0, 0.1, 2.0, 1.0, 0.5, 0.2, 2.0, 1.0]], np.float32)
    _, expert_idx, _ = moe_gating_top_k(x, k=2, k_group=1, group_count=4, group_select_mode=1, norm_type=1)
    assert expert_idx.tolist() == [[2, 3]]
    # by the max of the group (mode 0) groups 1 and 3 still tie; k_group = 2 keeps both
    _, expert_idx, _ = moe_gating_top_k(x, k=4, k_group=2, group_count=4, norm_type=1)
    assert expert_idx.tolist() == [[2, 6, 3, 7]]


def test_top_two_sum_counts_a_repeated_value_twice():
    """Mode 1 scores [5, 5, 1] as 10, above [6, 1, 1] (7); mode 0 prefers the 6."""
    x = np.array([[5, 5, 1, 6, 1, 1]], np.float32)
    bias = np.zeros(6, np.float32)
    for mode, want in [(1, [0, 1]), (0, [3, 4])]:
        _, expert_idx, _ = moe_gating_top_k(x, bias, k=2, k_group=1, group_count=2, group_select_mode=mode, norm_type=2)
        assert expert_idx.tolist() == [want]


def test_dropped_groups_are_never_chosen():
    """Biased scores all negative: HF's DeepSeek-V3 gate fills dropped groups with 0.0 and so
    picks them; the -inf rule keeps to the chosen group."""
    x = np.zeros((1, 4), np.float32)  # sigmoid 0.5 everywhere
    bias = np.array([-1.0, -1.2, -3.0, -4.0], np.float32)
    y, expert_idx, out = moe_gating_top_k(x, bias, k=2, k_group=1, group_count=2, group_select_mode=1, norm_type=1)
    assert expert_idx.tolist() == [[0, 1]]
    assert y.tolist() == [[0.5, 0.5]] and (out == 0.5).all()
    # and a kept group of -inf values still beats a dropped group
    bias = np.array([-np.inf, -np.inf, -np.inf, -np.inf], np.float32)
    _, expert_idx, _ = moe_gating_top_k(x, bias, k=2, k_group=1, group_count=2, norm_type=1)
    assert expert_idx.tolist() == [[0, 1]]
    nan_bias = np.array([0.0, np.nan, 1.0, 1.0], np.float32)  # NaN ranks as -inf
    _, expert_idx, _ = moe_gating_top_k(x, nan_bias, k=2, k_group=1, group_count=2, group_select_mode=0, norm_type=1)
    assert expert_idx.tolist() == [[2, 3]]


def test_y_is_normalised_and_scaled():
    x = np.array([[0.0, 1.0, -1.0, 2.0]], np.float32)
    s = 1 / (1 + np.exp(-x[0].astype(np.float64)))
    y, expert_idx, out = moe_gating_top_k(x, k=2, norm_type=1, routed_scaling_factor=2.5)
    assert expert_idx.tolist() == [[3, 1]]
    np.testing.assert_allclose(y[0], 2.5 * s[[3, 1]] / s[[3, 1]].sum(), rtol=1e-7)
    np.testing.assert_array_equal(out[0], s.astype(np.float32))
    # softmax: not renormalised unless renorm = 1
    p = np.exp(x[0] - 2.0) / np.exp(x[0] - 2.0).sum()
    y, _, _ = moe_gating_top_k(x, k=2)
    np.testing.assert_allclose(y[0], p[[3, 1]], rtol=1e-6)
    y, _, _ = moe_gating_top_k(x, k=2, renorm=1)
    np.testing.assert_allclose(y[0], p[[3, 1]] / p[[3, 1]].sum(), rtol=1e-6)


def test_out_flag_changes_nothing_here():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 16)).astype(ml_dtypes.bfloat16)
    plain = moe_gating_top_k(x, k=3, norm_type=1)
    flagged = moe_gating_top_k(x, k=3, norm_type=1, out_flag=1)
    for a, b in zip(plain, flagged):
        assert_same_bits(a, b)


def test_hash_mode_takes_the_table_rows():
    """DeepSeek-V4 style: sqrt-softplus scores, experts from tid2eid[input_ids] (an expert may
    repeat), bias ignored, weights renormalised."""
    x = np.array([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
    tid2eid = np.array([[3, 0], [1, 1], [2, 0]], np.int32)
    input_ids = np.array([2, 1], np.int64)
    bias = np.array([9.0, 0, 0, 0], np.float32)
    y, expert_idx, out = moe_gating_top_k(
        x, bias, input_ids, tid2eid, k=2, group_select_mode=1, norm_type=2, routed_scaling_factor=1.5
    )
    assert expert_idx.tolist() == [[2, 0], [1, 1]]
    np.testing.assert_allclose(y[1], [0.75, 0.75], rtol=1e-7)
    s = out[0, [2, 0]].astype(np.float64)
    np.testing.assert_allclose(y[0], 1.5 * s / s.sum(), rtol=1e-7)


def test_zero_tokens():
    got = run_node(OP, {"x": np.zeros((0, 8), np.float16), "bias": np.zeros(8, np.float16)}, {"k": 2})
    assert [g.shape for g in got] == [(0, 2), (0, 2), (0, 8)]


# --- errors -------------------------------------------------------------------------------------

X = np.zeros((3, 8), np.float32)


def run(x=X, bias=None, input_ids=None, tid2eid=None, **attrs):
    return run_node(OP, {"x": x, "bias": bias, "input_ids": input_ids, "tid2eid": tid2eid}, attrs)


def test_error_k_too_large():
    assert_refused(
        lambda: run(k=5, k_group=2, group_count=4),
        561002,
        "k must be in [1, k_group*E/group_count] = [1, 4], got 5",
        "node 'node'",
    )


def test_error_k_missing_or_zero():
    assert_refused(lambda: run(), 161001, "attribute 'k' is required")
    assert_refused(lambda: run(k=0), 561002, "k must be >= 1, got 0")


def test_error_groups_do_not_divide_experts():
    assert_refused(
        lambda: run(k=1, group_count=3), 561002, "E (x dim 1) must be a multiple of group_count: got 8 rows for 3"
    )


def test_error_k_group_range():
    assert_refused(
        lambda: run(k=1, k_group=3, group_count=2), 561002, "k_group must be in [1, group_count] = [1, 2], got 3"
    )
    assert_refused(lambda: run(k=1, k_group=0), 561002, "k_group must be in [1, group_count] = [1, 1], got 0")
    assert_refused(lambda: run(k=1, group_count=0), 561002, "group_count must be >= 1, got 0")


def test_error_top_two_of_single_expert_groups():
    assert_refused(
        lambda: run(k=1, group_count=8, group_select_mode=1),
        561002,
        "E/group_count = 1 experts per group must exceed group_select_mode = 1",
    )


def test_error_modes():
    assert_refused(lambda: run(k=1, norm_type=3), 561002, "'norm_type' must be one of [0, 1, 2], got 3")
    assert_refused(lambda: run(k=1, group_select_mode=2), 561002, "'group_select_mode' must be one of [0, 1]")
    assert_refused(lambda: run(k=1, renorm=2), 561002, "'renorm' must be one of [0, 1]")


def test_error_bias():
    assert_refused(lambda: run(bias=np.zeros(8, np.float16), k=1), 161002, "bias must have the dtype of x (float32)")
    assert_refused(lambda: run(bias=np.zeros(7, np.float32), k=1), 561002, "bias [E] must match x [T, E] (got 7 and 8)")


def test_error_hash_inputs():
    ids, table = np.array([0, 1, 0], np.int32), np.zeros((2, 2), np.int32)
    assert_refused(lambda: run(input_ids=ids, k=2), 561002, "give both or neither")
    assert_refused(lambda: run(tid2eid=table, k=2), 561002, "give both or neither")
    assert_refused(
        lambda: run(input_ids=ids, tid2eid=table, k=3), 561002, "tid2eid [V, k] must have k = 3 columns, got 2"
    )
    assert_refused(
        lambda: run(input_ids=ids[:2], tid2eid=table, k=2), 561002, "input_ids [T] must match x [T, E] (got 2 and 3)"
    )
    assert_refused(
        lambda: run(input_ids=np.array([0, 2, 1], np.int64), tid2eid=table, k=2),
        561002,
        "input_ids must be in [0, V) = [0, 2) (rows of tid2eid), got 2 at [1]",
    )
    bad_table = np.array([[0, 1], [8, 0]], np.int64)
    assert_refused(
        lambda: run(input_ids=ids, tid2eid=bad_table, k=2),
        561002,
        "tid2eid entries must be experts in [0, E) = [0, 8), got 8 at tid2eid[1, 0] (input_ids[1])",
    )


def test_error_ranks_and_dtypes():
    assert_refused(lambda: run(x=np.zeros((2, 3, 8), np.float32), k=1), 561002, "'x' must have rank 2")
    assert_refused(lambda: run(x=np.zeros((3, 8), np.float64), k=1), 161002, "'x' has dtype float64")
    assert_refused(
        lambda: run(input_ids=np.zeros(3, np.int16), tid2eid=np.zeros((1, 1), np.int32), k=1),
        161002,
        "'input_ids' has dtype int16",
    )


# --- shape inference, checker, targets ----------------------------------------------------------


def test_shape_inference_symbolic():
    node = helper.make_node(OP, ["x", "bias"], ["y", "i", "o"], domain=moe_onnx.DOMAIN, k=8, group_count=8, k_group=4)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 256]),
            helper.make_tensor_value_info("bias", TensorProto.FLOAT, [256]),
        ],
        [],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    out = inferred_types(helper.make_model(graph, opset_imports=opsets))
    assert out["y"] == (TensorProto.FLOAT, ["T", 8]) and out["i"] == (TensorProto.INT32, ["T", 8])
    assert out["o"] == (TensorProto.FLOAT, ["T", 256])


def test_symbolic_experts_defer_the_group_rules():
    sig = moe_onnx.OPS[OP].signature([TensorInfo("float32", ("T", "E"))], {"k": 8, "group_count": 8, "k_group": 4})
    assert [(r.kind, r.dims) for r in sig.deferred] == [
        ("multiple", ("E", 8)),
        ("at_most", (8, "E")),
        ("at_most", (16, "E")),
    ]


def test_checker_accepts_model():
    model = node_model(OP, {"x": np.ones((4, 8), np.float32), "bias": np.zeros(8, np.float32)}, {"k": 2})
    onnx.checker.check_model(model, full_check=True)


def test_target_limits():
    def check(shape, target="ascend910b", hash_mode=False, **attrs):
        inputs = {"x": TensorInfo("float32", shape)}
        if hash_mode:
            inputs.update(input_ids=TensorInfo("int32", shape[:1]), tid2eid=TensorInfo("int32", (10, attrs["k"])))
        return [v.split(": ", 1)[1] for v in targets.check(OP, inputs, attrs, target)]

    assert check((4096, 256), **deepseek_attrs()) == []
    assert check((4096, 384), k=8, k_group=4, group_count=8, group_select_mode=1) == []
    assert check((4096, 2560), k=8) == ["E = 2560 exceeds 2048"]
    assert check((16, 2048), k=8, group_count=16) == []
    assert check((16, 1320), k=8, group_count=40) == ["align32(E/group_count) * group_count = 2560 exceeds 2048"]
    assert check((16, 16), k=2, group_count=8) == [
        "E/group_count = 2 experts per group: the torch doc requires more than 2"
    ]
    assert check((16, 64), k=2, renorm=1) == [
        "renorm = 1: the torch doc supports renorm = 0 only (aclnn: renormalised softmax)"
    ]
    assert check((0, 64), k=2) == ["empty x (T = 0) is not supported"]
    assert check((16, 64), k=2, norm_type=2) == []
    assert check((16, 64), k=2, group_count=2, norm_type=2) == [
        "norm_type = 2 (sqrt_softplus) needs group_count = 1 and renorm = 0 on A2/A3, got group_count 2, renorm 0"
    ]
    assert check((16, 64), "ascend950", k=2, group_count=2, norm_type=2) == []
    assert check((16, 64), hash_mode=True, k=6, group_select_mode=1) == []
    assert check((16, 128), hash_mode=True, k=65) == ["hash mode: k = 65 exceeds 64"]
    assert check((16, 64), hash_mode=True, k=4, k_group=2, group_count=4) == [
        "hash mode needs k_group == group_count or group_count == E, got k_group 2, group_count 4, E 64"
    ]


def test_an_int_attribute_where_a_float_is_declared_is_refused_alike():
    """eps given as an INT attribute: both executors and lower() refuse it (a Python int is a
    number to the bare call)."""
    model = node_model(OP, {"x": X}, {"k": 2, "eps": 1})
    assert_refused(
        lambda: moe_onnx.InferenceSession(model).run(None, {"x": X}),
        561002,
        "attribute 'eps' must be of type FLOAT, got INT",
    )
    assert_refused(lambda: moe_onnx.InferenceSession(model, executor="pyop"), 561002, "must be of type FLOAT, got INT")
    assert_refused(lambda: moe_onnx.lower(model), 561002, "attribute 'eps' must be of type FLOAT, got INT")
    assert moe_gating_top_k(X, k=2, eps=1)[0].shape == (3, 2)


def test_sqrt_softplus_overflows_to_inf_as_the_npu_computes_it():
    """SPEC-layer 1.14 (b) amended: Sqrt(Ln(Exp(x) + 1)) in float32 is inf once Exp(x) overflows
    (above 88.72283, the largest float32 with a finite float32 exp); the kernel and the lowered
    body (tests/test_lower_gating.py) give that inf, and below it the exact value."""
    limit = np.float32(88.72283)
    x = np.array([[limit, np.nextafter(limit, np.float32(100)), 1.0, 200.0]], np.float32)
    y, expert_idx, out = moe_gating_top_k(x, k=4, norm_type=2, out_flag=1)
    assert np.isfinite(out[0, 0]) and out[0, 0] == np.float32(np.sqrt(np.float64(limit)))
    assert np.isposinf(out[0, 1]) and np.isposinf(out[0, 3])
    assert expert_idx[0, :2].tolist() == [1, 3]  # two infs: the lower expert first
    got = run_node("MoeGatingTopK", {"x": x}, {"k": 4, "norm_type": 2, "out_flag": 1}, ["y", "expert_idx", "out"])
    assert_same_bits(got[2], out)
    assert_same_bits(gating_scores_reference(x, 2), out)
