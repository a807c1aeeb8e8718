"""MoeInitRouting (v1, SPEC 1.15) and MoeComputeExpertTokens (SPEC 1.16): kernels against loop
references written from the SPEC, the doc's example, the relations to MoeInitRoutingV2 the SPEC
states, omni-infer's sentinel expert and second-routing forms, sessions, errors, target flags."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moe_onnx
from moe_onnx.custom_ops import targets
from tests.references import (
    FLOAT_DTYPES,
    canonical_row_idx,
    compute_expert_tokens_reference,
    init_routing_v1_reference,
)
from tests.support import assert_refused, assert_same_bits, run_node

V1 = moe_onnx.OPS["MoeInitRouting"]
EXPERT_TOKENS = moe_onnx.OPS["MoeComputeExpertTokens"]


@st.composite
def v1_cases(draw):
    """(x, row_idx, expert_idx, active_num): canonical or any permutation row_idx, sentinels."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    n_tokens, top_k, hidden = draw(st.integers(0, 7)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
    experts = draw(st.integers(1, 6))
    expert_idx = rng.integers(0, experts + 1, (n_tokens, top_k)).astype(np.int32)  # E: the sentinel
    if draw(st.booleans()):
        row_idx = canonical_row_idx(n_tokens, top_k)
    else:
        row_idx = rng.permutation(n_tokens * top_k).reshape(n_tokens, top_k).astype(np.int32)
    x = rng.standard_normal((n_tokens, hidden)).astype(draw(st.sampled_from(FLOAT_DTYPES)))
    return x, row_idx, expert_idx, draw(st.integers(0, n_tokens + 2))


@given(v1_cases())
def test_v1_matches_reference(case):
    x, row_idx, expert_idx, active_num = case
    got = V1(x, row_idx, expert_idx, active_num=active_num)
    for g, w in zip(got, init_routing_v1_reference(x, row_idx, expert_idx, active_num)):
        assert_same_bits(g, w)


def test_doc_example():
    """torch_npu-npu_moe_init_routing.md's single-op example, worked by hand."""
    x = np.array([[0.1] * 4, [0.2] * 4, [0.3] * 4], np.float32)
    row_idx = np.array([[0, 3], [1, 4], [2, 5]], np.int32)
    expert_idx = np.array([[1, 2], [0, 1], [0, 2]], np.int32)
    expanded_x, expanded_row_idx, expanded_expert_idx = V1(x, row_idx, expert_idx, active_num=3)
    # sorted positions: p2 (t1, e0), p4 (t2, e0), p0 (t0, e1), p3 (t1, e1), p1 (t0, e2), p5 (t2, e2)
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    assert np.allclose(expanded_x[:, 0], [0.2, 0.3, 0.1, 0.2, 0.1, 0.3])
    # q of those positions: 1, 2, 0, 4, 3, 5 -> expanded_row_idx[q] = d
    assert expanded_row_idx.tolist() == [2, 0, 1, 4, 3, 5]


@pytest.mark.parametrize("seed", range(5))
def test_relations_to_v2(seed):
    """SPEC 1.15: with the canonical row_idx, expanded_x is V2's dropless one, v1's index is V2's
    reshaped (T, K) -> (K, T), and the expert tokens of v1's sorted ids are V2's cumsum."""
    rng = np.random.default_rng(seed)
    n_tokens, top_k, experts = 9, 3, 5
    x = rng.standard_normal((n_tokens, 4)).astype(ml_dtypes.bfloat16)
    expert_idx = rng.integers(0, experts, (n_tokens, top_k)).astype(np.int32)
    active = int(rng.integers(0, n_tokens + 1))
    expanded_x, row_v1, sorted_ids = V1(x, canonical_row_idx(n_tokens, top_k), expert_idx, active_num=active)
    v2 = moe_onnx.OPS["MoeInitRoutingV2"]
    x2, row_v2, cumsum, _ = v2(x, expert_idx, expert_num=experts, expert_tokens_count_or_cumsum_flag=1)
    assert_same_bits(expanded_x, x2[: active * top_k])
    assert np.array_equal(row_v1, row_v2.reshape(n_tokens, top_k).T.reshape(-1))
    assert np.array_equal(np.bincount(sorted_ids, minlength=experts), np.diff(cumsum, prepend=0))
    assert np.array_equal(EXPERT_TOKENS(sorted_ids, num_experts=experts)[0], cumsum)


def test_omni_infer_sentinel_expert():
    """omni-infer's all-gather EP path: experts not on this rank become E, which sorts last and is
    counted by no expert (or by expert E, with E + 1 experts, then cut off)."""
    rng = np.random.default_rng(2)
    n_tokens, top_k, local = 8, 2, 4
    global_ids = rng.integers(0, 2 * local, (n_tokens, top_k)).astype(np.int32)
    mask = global_ids < local
    local_ids = np.where(mask, global_ids, local).astype(np.int32)
    x = rng.standard_normal((n_tokens, 3)).astype(np.float32)
    expanded_x, expanded_row_idx, sorted_ids = V1(x, canonical_row_idx(n_tokens, top_k), local_ids, active_num=99)
    routed = int(mask.sum())
    assert (sorted_ids[:routed] < local).all() and (sorted_ids[routed:] == local).all()
    (ends,) = EXPERT_TOKENS(sorted_ids, num_experts=local)
    assert ends[-1] == routed and np.array_equal(
        np.diff(ends, prepend=0), np.bincount(local_ids[mask], minlength=local)
    )
    (with_sentinel,) = EXPERT_TOKENS(sorted_ids, num_experts=local + 1)
    assert np.array_equal(with_sentinel[:-1], ends) and with_sentinel[-1] == n_tokens * top_k
    flagged = targets.check(
        "MoeComputeExpertTokens", {"sorted_experts": sorted_ids}, {"num_experts": local}, "ascend910b"
    )
    assert len(flagged) == int((~mask).sum() > 0) and "ids >= num_experts = 4" in "".join(flagged)


def test_omni_infer_second_routing_by_received_rows():
    """After the all-to-all, omni-infer routes the A received rows again with row_idx = arange(A)
    as [A, 1] and K = 1: a plain stable sort of the rows by local expert."""
    rng = np.random.default_rng(3)
    received = rng.standard_normal((11, 4)).astype(np.float16)
    local_expert = rng.integers(0, 3, (11, 1)).astype(np.int32)
    row_idx = np.arange(11, dtype=np.int32)[:, None]
    sorted_rows, src_to_dst, sorted_ids = V1(received, row_idx, local_expert, active_num=11)
    order = np.argsort(local_expert[:, 0], kind="stable")
    assert_same_bits(sorted_rows, received[order])
    assert_same_bits(sorted_rows[src_to_dst], received)  # src -> dst: row r of the input sits at src_to_dst[r]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_sessions_match_kernels(dtype):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 6)).astype(dtype)
    expert_idx = rng.integers(0, 4, (7, 2)).astype(np.int32)
    row_idx = rng.permutation(14).reshape(7, 2).astype(np.int32)
    for active in (0, 3, 7, 50):
        inputs = {"x": x, "row_idx": row_idx, "expert_idx": expert_idx}
        got = run_node("MoeInitRouting", inputs, {"active_num": active})
        for g, w in zip(got, V1(x, row_idx, expert_idx, active_num=active)):
            assert_same_bits(g, w)
    (ends,) = run_node("MoeComputeExpertTokens", {"sorted_experts": got[2]}, {"num_experts": 6})
    assert_same_bits(ends, EXPERT_TOKENS(got[2], num_experts=6)[0])


@given(st.integers(0, 2**31), st.integers(0, 40), st.integers(1, 9))
def test_expert_tokens_match_reference(seed, length, experts):
    ids = np.sort(np.random.default_rng(seed).integers(0, experts + 3, length)).astype(np.int32)
    assert_same_bits(EXPERT_TOKENS(ids, num_experts=experts)[0], compute_expert_tokens_reference(ids, experts))


def test_large_v1_is_bit_identical_across_threads():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2048, 2048)).astype(ml_dtypes.bfloat16)
    expert_idx = rng.integers(0, 64, (2048, 4)).astype(np.int32)
    expanded_x, _, _ = V1(x, canonical_row_idx(2048, 4), expert_idx, active_num=2048)
    assert_same_bits(expanded_x, x[np.argsort(expert_idx.reshape(-1), kind="stable") // 4])


# --- errors ------------------------------------------------------------------------------------


x = np.ones((3, 2), np.float32)
expert_idx = np.array([[0, 1], [1, 2], [2, 0]], np.int32)


def run_v1(x=x, row_idx=None, expert_idx=expert_idx, **attrs):
    row_idx = canonical_row_idx(3, 2) if row_idx is None else row_idx
    attrs.setdefault("active_num", 3)
    return run_node("MoeInitRouting", {"x": x, "row_idx": row_idx, "expert_idx": expert_idx}, attrs)


def test_v1_errors():
    assert_refused(
        lambda: run_v1(row_idx=np.array([[0, 1], [1, 2], [3, 4]], np.int32)),
        561002,
        "row_idx must be a permutation of [0, T*K) = [0, 6)",
        "1 appears 2 times",
    )
    assert_refused(lambda: run_v1(row_idx=canonical_row_idx(3, 2) + 1), 561002, "got 6 at [2, 1]")
    assert_refused(lambda: run_v1(active_num=-1), 561002, "active_num must be >= 0, got -1")
    assert_refused(
        lambda: run_node("MoeInitRouting", {"x": x, "row_idx": canonical_row_idx(3, 2), "expert_idx": expert_idx}),
        161001,
        "'active_num' is required",
    )
    assert_refused(lambda: run_v1(x=np.ones((4, 2), np.float32)), 561002, "must have the same T (got 4 and 3)")
    assert_refused(lambda: run_v1(row_idx=canonical_row_idx(2, 3)), 561002, "row_idx must have expert_idx's shape")
    assert_refused(lambda: run_v1(expert_idx=expert_idx.astype(np.int64)), 161002, "'expert_idx' has dtype int64")
    assert_refused(lambda: run_v1(x=x.astype(np.float64)), 161002, "'x' has dtype float64")


def test_expert_tokens_errors():
    def run(ids, **attrs):
        attrs.setdefault("num_experts", 4)
        return run_node("MoeComputeExpertTokens", {"sorted_experts": np.asarray(ids, np.int32)}, attrs)

    assert_refused(lambda: run([0, 2, 1, 3]), 561002, "must be non-decreasing", "got 2 at position 1 then 1")
    assert_refused(lambda: run([-1, 0, 1]), 561002, "sorted_experts must be >= 0", "got -1")
    assert_refused(lambda: run([0, 1], num_experts=0), 561002, "num_experts must be > 0, got 0")
    assert_refused(lambda: run([[0, 1]]), 561002, "'sorted_experts' must have rank 1")
    assert_refused(
        lambda: run_node("MoeComputeExpertTokens", {"sorted_experts": np.zeros(3, np.int64)}, {"num_experts": 2}),
        161002,
        "has dtype int64",
    )
    assert run([], num_experts=3)[0].tolist() == [0, 0, 0]


def test_target_limits():
    big = {"x": moe_onnx.custom_ops.TensorInfo("float32", (4096, 4096)), "row_idx": None, "expert_idx": None}
    assert targets.check("MoeInitRouting", big, {"active_num": 1}, "ascend910b") == [
        "MoeInitRouting on ascend910b: x has 16777216 elements, the NPU takes fewer than 2^24 = 16777216"
    ]
    small = {"x": np.ones((2, 2), np.float32), "expert_idx": np.array([[0, -1], [1, 2]], np.int32)}
    messages = targets.check("MoeInitRouting", small, {"active_num": 1}, "ascend910_93")
    assert len(messages) == 2 and "Atlas A2 (ascend910b) only" in messages[0] and "expert id -1 < 0" in messages[1]
    many = {"sorted_experts": moe_onnx.custom_ops.TensorInfo("int32", (2**24 + 1,))}
    assert len(targets.check("MoeComputeExpertTokens", many, {"num_experts": 4096}, "ascend910b")) == 2
