"""The opt-in NPU limit check (SPEC 1.7): the seeds' tiling limits per target, reported as
a list of violations and never enforced on the CPU path."""

from __future__ import annotations

import numpy as np
import pytest

from moe_onnx.custom_ops import TensorInfo, targets
from tests.support import run_node

UNPERMUTE_GRAD = "MoeTokenUnpermuteWithRoutingMapGrad"


def unpermute_grad_inputs(tokens, hidden, experts, rows, token_dtype="bfloat16", probs_dtype="float32", probs=True):
    inputs = {
        "unpermuted_tokens_grad": TensorInfo(token_dtype, (tokens, hidden)),
        "out_index": TensorInfo("int32", (rows,)),
        "permute_token_id": TensorInfo("int32", (rows,)),
        "routing_map": TensorInfo("bool", (tokens, experts)),
        "permuted_tokens": TensorInfo(token_dtype, (rows, hidden)),
    }
    if probs:
        inputs["probs"] = TensorInfo(probs_dtype, (tokens, experts))
    return inputs


def test_seed_example_fits_every_target():
    inputs = {
        "unpermuted_tokens_grad": np.ones((1, 2), np.float32),
        "out_index": np.array([0, 1], np.int32),
        "permute_token_id": np.array([0, 0], np.int32),
        "routing_map": np.array([[1, 1]], np.int8),
        "permuted_tokens": np.ones((2, 2), np.float32),
        "probs": np.ones((1, 2), np.float32),
    }
    for target in targets.TARGETS:
        assert targets.check(UNPERMUTE_GRAD, inputs, {"drop_and_pad": 0}, target) == []


def test_deepseek_shape_fits_every_target():
    for padded in (0, 1):
        inputs = unpermute_grad_inputs(4096, 7168, 256, 4096 * 8)
        for target in targets.TARGETS:
            assert targets.check(UNPERMUTE_GRAD, inputs, {"drop_and_pad": padded}, target) == []


def test_top_k_limits():
    at_limit = unpermute_grad_inputs(2, 8, 512, 2 * 512)
    assert targets.check(UNPERMUTE_GRAD, at_limit, {}, "ascend910b") == []
    over = unpermute_grad_inputs(2, 8, 600, 2 * 513)
    assert targets.check(UNPERMUTE_GRAD, over, {}, "ascend910b") == [
        "MoeTokenUnpermuteWithRoutingMapGrad on ascend910b: K = 513 exceeds 512 (probs, not padded)"
    ]
    above_experts = unpermute_grad_inputs(2, 8, 4, 2 * 5)
    assert targets.check(UNPERMUTE_GRAD, above_experts, {}, "ascend950") == [
        "MoeTokenUnpermuteWithRoutingMapGrad on ascend950: K = 5 exceeds E = 4 (probs, not padded)"
    ]
    # the limits hold only with probs
    assert targets.check(UNPERMUTE_GRAD, unpermute_grad_inputs(2, 8, 600, 2 * 513, probs=False), {}, "ascend910b") == []


def test_experts_limit_of_the_ub_formula():
    """(ub - (probLen + 1) * align32(E) - (tokenLen + 8) * 256) / (6 * tokenLen + 12) >= 1; with
    bfloat16 tokens and float32 probs on 192 KiB: align32(E) <= 38804, so E = 38784 fits."""
    fits = unpermute_grad_inputs(1, 8, 38784, 1)
    over = unpermute_grad_inputs(1, 8, 38785, 1)
    assert targets.check(UNPERMUTE_GRAD, fits, {}, "ascend910b") == []
    violations = targets.check(UNPERMUTE_GRAD, over, {}, "ascend910_93")
    assert len(violations) == 1 and "E = 38785 leaves no room in UB" in violations[0]
    assert "ubSize 196608, probTypeLen 4, tokenTypeLen 2" in violations[0]
    assert targets.check(UNPERMUTE_GRAD, over, {}, "ascend950") == []  # 248 KiB
    assert targets.check(UNPERMUTE_GRAD, fits, {}, "ascend910b", ub_size=150_000) != []


def test_hidden_limit_padded():
    """H <= 256 * (ub - 2080) / (8 + tokenLen): 4979916 for bfloat16 on 192 KiB."""
    padded = {"drop_and_pad": 1}
    assert targets.check(UNPERMUTE_GRAD, unpermute_grad_inputs(4, 4979916, 2, 8), padded, "ascend910b") == []
    violations = targets.check(UNPERMUTE_GRAD, unpermute_grad_inputs(4, 4979917, 2, 8), padded, "ascend910b")
    assert violations == [
        "MoeTokenUnpermuteWithRoutingMapGrad on ascend910b: H = 4979917 exceeds 256 * "
        "(ubSize - 2080) / (8 + tokenTypeLen) = 4979916 (ubSize 196608, tokenTypeLen 2; "
        "probs, padded)"
    ]
    assert targets.check(UNPERMUTE_GRAD, unpermute_grad_inputs(4, 4979917, 2, 8), padded, "ascend950") == []
    float32 = unpermute_grad_inputs(4, 4149931, 2, 8, "float32", "float32")
    assert len(targets.check(UNPERMUTE_GRAD, float32, padded, "ascend910b")) == 1


def test_capacity_limit_padded():
    over = unpermute_grad_inputs(4, 8, 2, 2 * 5)  # C = 5 > T = 4
    assert targets.check(UNPERMUTE_GRAD, over, {"drop_and_pad": 1}, "ascend910b") == [
        "MoeTokenUnpermuteWithRoutingMapGrad on ascend910b: capacity C = 5 exceeds T = 4 (probs, padded)"
    ]
    assert targets.check(
        "MoeTokenUnpermuteWithRoutingMap",
        {
            "permuted_tokens": TensorInfo("float32", (10, 8)),
            "sorted_indices": TensorInfo("int32", (10,)),
            "routing_map": TensorInfo("bool", (4, 2)),
        },
        {"padded_mode": 1},
        "ascend950",
    ) == ["MoeTokenUnpermuteWithRoutingMap on ascend950: capacity C = 5 exceeds T = 4 (padded)"]


def test_permute_limits():
    inputs = {"tokens": TensorInfo("bfloat16", (2, 8)), "routing_map": TensorInfo("bool", (2, 600))}
    assert targets.check("MoeTokenPermuteWithRoutingMap", inputs, {"num_out_tokens": 2 * 512}, "ascend910b") == []
    assert targets.check("MoeTokenPermuteWithRoutingMap", inputs, {"num_out_tokens": 2 * 513}, "ascend910b") == [
        "MoeTokenPermuteWithRoutingMap on ascend910b: K = 513 exceeds 512 (not padded)"
    ]
    huge = {"tokens": TensorInfo("bfloat16", (16777215, 8)), "routing_map": TensorInfo("bool", (16777215, 4))}
    assert targets.check(
        "MoeTokenPermuteWithRoutingMap", huge, {"num_out_tokens": 4, "drop_and_pad": 1}, "ascend950"
    ) == ["MoeTokenPermuteWithRoutingMap on ascend950: T = 16777215 must be below 16777215"]
    grad = {
        "permuted_tokens_grad": TensorInfo("float32", (2 * 513, 8)),
        "sorted_indices": TensorInfo("int32", (2 * 513,)),
    }
    assert targets.check("MoeTokenPermuteWithRoutingMapGrad", grad, {"tokens_num": 2}, "ascend910_93") == [
        "MoeTokenPermuteWithRoutingMapGrad on ascend910_93: K = 513 exceeds 512 (not padded)"
    ]


def test_re_routing_limits():
    inputs = {"tokens": TensorInfo("int8", (64, 7168)), "expert_token_num_per_rank": TensorInfo("int32", (4, 4))}
    assert targets.check("MoeReRoutingV2", inputs, {}, "ascend950") == []
    assert targets.check("MoeReRoutingV2", inputs, {}, "ascend910b") == [
        "MoeReRoutingV2 on ascend910b: the NPU implements this op on ascend950 only"
    ]
    wide = {"tokens": np.zeros((2, 16384), np.int8), "expert_token_num_per_rank": np.ones((1, 2), np.int32)}
    assert targets.check("MoeReRouting", wide, {"expert_token_num_type": 0}, "ascend950") == [
        "MoeReRouting on ascend950: H = 16384 must satisfy 0 < H < 16384",
        "MoeReRouting on ascend950: expert_token_num_type = 0: the NPU supports only 1 (count)",
    ]


def test_unknown_dims_are_skipped():
    symbolic = unpermute_grad_inputs("T", "H", "E", "N")
    assert targets.check(UNPERMUTE_GRAD, symbolic, {}, "ascend910b") == []
    assert targets.check(UNPERMUTE_GRAD, symbolic, {"drop_and_pad": 1}, "ascend910b") == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown target 'ascend310p'"):
        targets.check(UNPERMUTE_GRAD, {}, {}, "ascend310p")
    with pytest.raises(ValueError, match="unknown op type"):
        targets.check("NoSuchOp", {}, {}, "ascend950")


def test_never_enforced_on_cpu():
    """K = 513 breaks the NPU limit, yet the CPU session computes it."""
    top_k = 513
    inputs = {
        "unpermuted_tokens_grad": np.ones((1, 1), np.float32),
        "out_index": np.arange(top_k, dtype=np.int32),
        "permute_token_id": np.zeros(top_k, np.int32),
        "routing_map": np.ones((1, top_k), bool),
        "permuted_tokens": np.ones((top_k, 1), np.float32),
        "probs": np.full((1, top_k), 0.5, np.float32),
    }
    assert targets.check(UNPERMUTE_GRAD, inputs, {}, "ascend910b") != []
    rows_grad, probs_grad = run_node(UNPERMUTE_GRAD, inputs)
    assert np.array_equal(rows_grad, np.full((top_k, 1), 0.5, np.float32))
    assert np.array_equal(probs_grad, np.ones((1, top_k), np.float32))
