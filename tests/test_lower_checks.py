"""A lowered model fed what the kernel refuses fails at run time instead of returning garbage:
onnxruntime raises naming the check (its node name states the rule), onnx.reference raises
from the same check's Reshape. Runs in the stock-runtime worker (no moe_onnx there)."""

from __future__ import annotations

import numpy as np
import pytest

import moe_onnx
from moe_onnx.custom_ops import OPS

from .lower_support import LoweredRunner
from .support import node_model


@pytest.fixture(scope="module")
def runner():
    worker = LoweredRunner()
    yield worker
    worker.close()


f32 = np.float32
i32 = np.int32
ROUTING_MAP = np.array([[1, 0, 1], [0, 1, 1]], np.int8)  # 2 tokens, 3 experts, K = 2

# (op, inputs, attrs, outputs, rule fragment in the check's name)
CASES = {
    "counts sum above A": (
        "MoeReRoutingV2",
        {"tokens": np.ones((4, 2), f32), "expert_token_num_per_rank": np.array([[2, 3]], i32)},
        {},
        ["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""],
        "sum(expert_token_num_per_rank) must equal A",
    ),
    "counts sum below A": (
        "MoeReRoutingV2",
        {"tokens": np.ones((4, 2), f32), "expert_token_num_per_rank": np.array([[1, 2]], i32)},
        {},
        ["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""],
        "sum(expert_token_num_per_rank) must equal A",
    ),
    "negative count": (
        "MoeReRouting",
        {"tokens": np.ones((2, 2), f32), "expert_token_num_per_rank": np.array([[3, -1]], np.int64)},
        {},
        None,
        "expert_token_num_per_rank must be >= 0",
    ),
    "expert id = expert_num": (
        "MoeInitRoutingV2",
        {"x": np.ones((2, 2), f32), "expert_idx": np.array([[0, 4], [1, 2]], i32)},
        {"expert_num": 4},
        ["expanded_x", "expanded_row_idx"],
        "expert_idx must be in [0, expert_num)",
    ),
    "negative expert id": (
        "MoeInitRoutingV2",
        {"x": np.ones((2, 2), f32), "expert_idx": np.array([[0, -1], [1, 2]], i32)},
        {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 2},
        ["expanded_x", "expanded_row_idx"],
        "expert_idx must be in [0, expert_num)",
    ),
    "grad index past the rows": (
        "MoeInitRoutingV2Grad",
        {"grad_expanded_x": np.ones((4, 2), f32), "expanded_row_idx": np.array([0, 1, 2, 4], i32)},
        {"top_k": 2},
        None,
        "expanded_row_idx values must be -1 (an inactive expert's copy, skipped) or in [0, rows",
    ),
    "grad index -2 in dropless mode": (  # -1 is an inactive expert's copy, skipped (SPEC 1.3)
        "MoeInitRoutingV2Grad",
        {"grad_expanded_x": np.ones((4, 2), f32), "expanded_row_idx": np.array([0, -2, 2, 3], i32)},
        {"top_k": 2},
        None,
        "expanded_row_idx values must be -1 (an inactive expert's copy, skipped) or in [0, rows",
    ),
    "grad index -2 in drop/pad mode": (
        "MoeInitRoutingV2Grad",
        {"grad_expanded_x": np.ones((2, 2, 2), f32), "expanded_row_idx": np.array([0, -2, 2, -1], i32)},
        {"top_k": 2, "drop_pad_mode": 1},
        None,
        "expanded_row_idx values must be -1 (dropped)",
    ),
    "grad index = E*C in drop/pad mode": (  # not the zero row a dropped term reads (found by review)
        "MoeInitRoutingV2Grad",
        {"grad_expanded_x": np.ones((2, 2, 1), f32), "expanded_row_idx": np.array([0, 4], i32)},
        {"top_k": 1, "drop_pad_mode": 1},
        None,
        "expanded_row_idx values must be -1 (dropped)",
    ),
    "grad index = rows in active mode": (
        "MoeInitRoutingV2Grad",
        {"grad_expanded_x": np.ones((2, 1), f32), "expanded_row_idx": np.array([0, 2], i32)},
        {"top_k": 1, "active_num": 5},
        None,
        "expanded_row_idx values must be >= active_num",
    ),
    "int8 routing map holding 2": (
        "MoeTokenPermuteWithRoutingMap",
        {"tokens": np.ones((2, 2), f32), "routing_map": np.array([[1, 0, 2], [0, 1, 1]], np.int8)},
        {"num_out_tokens": 4},
        ["permuted_tokens", "sorted_indices"],
        "int8 routing_map must hold only 0 and 1",
    ),
    "token with K + 1 experts": (
        "MoeTokenPermuteWithRoutingMap",
        {"tokens": np.ones((2, 2), f32), "routing_map": np.array([[1, 1, 1], [0, 1, 0]], bool)},
        {"num_out_tokens": 4},
        ["permuted_tokens", "sorted_indices"],
        "not padded, every routing_map row must hold exactly K",
    ),
    "permute grad index past N": (
        "MoeTokenPermuteWithRoutingMapGrad",
        {
            "permuted_tokens_grad": np.ones((4, 2), f32),
            "permuted_probs_grad": None,
            "sorted_indices": np.array([0, 1, 2, 4], i32),
        },
        {"tokens_num": 2},
        ["tokens_grad"],
        "sorted_indices values must be in [0, N)",
    ),
    "padded permute grad token past T": (
        "MoeTokenPermuteWithRoutingMapGrad",
        {
            "permuted_tokens_grad": np.ones((4, 2), f32),
            "permuted_probs_grad": None,
            "sorted_indices": np.array([0, -1, 2, 1], i32),
        },
        {"tokens_num": 2, "experts_num": 2, "drop_and_pad": 1},
        ["tokens_grad"],
        "sorted_indices values must be a negative (empty slot) or in [0, T)",
    ),
    "unpermute repeated row": (
        "MoeTokenUnpermuteWithRoutingMap",
        {"permuted_tokens": np.ones((4, 2), f32), "sorted_indices": np.array([0, 1, 1, 3], i32)},
        {"restore_shape": [2, 2]},
        ["unpermuted_tokens", "out_index", "permute_token_id"],
        "sorted_indices (not padded) must not repeat a row",
    ),
    "unpermute probs with a token of K + 1 experts": (
        "MoeTokenUnpermuteWithRoutingMap",
        {
            "permuted_tokens": np.ones((4, 2), f32),
            "sorted_indices": np.array([0, 1, 2, 3], i32),
            "routing_map": np.array([[1, 1, 1], [0, 0, 1]], np.int8),
            "probs": np.ones((2, 3), f32),
        },
        {},
        None,
        "not padded, a routing_map row may hold at most K",
    ),
    "unpermute index past N among unused slots": (
        "MoeTokenUnpermuteWithRoutingMap",
        {"permuted_tokens": np.ones((4, 2), f32), "sorted_indices": np.array([0, -1, 4, -1], i32)},
        {"restore_shape": [2, 2]},
        ["unpermuted_tokens", "out_index", "permute_token_id"],
        "sorted_indices (not padded) values must be a negative (unused slot) or in [0, N)",
    ),
    "unpermute repeated row among unused slots": (
        "MoeTokenUnpermuteWithRoutingMap",
        {"permuted_tokens": np.ones((4, 2), f32), "sorted_indices": np.array([2, -1, 2, -1], i32)},
        {"restore_shape": [2, 2]},
        ["unpermuted_tokens", "out_index", "permute_token_id"],
        "sorted_indices (not padded) must not repeat a row",
    ),
    "unpermute used slot naming an unrouted row": (  # 2 routed pairs (rows 0, 1), K = 2
        "MoeTokenUnpermuteWithRoutingMap",
        {
            "permuted_tokens": np.ones((4, 2), f32),
            "sorted_indices": np.array([0, -1, 3, -1], i32),
            "routing_map": np.array([[1, 0], [0, 1]], bool),
            "probs": np.ones((2, 2), f32),
        },
        {},
        None,
        "not padded with probs, a used slot must name a routed row",
    ),
    "unpermute grad used slot naming an unrouted row": (
        "MoeTokenUnpermuteWithRoutingMapGrad",
        {
            "unpermuted_tokens_grad": np.ones((2, 2), f32),
            "out_index": np.array([0, -1, 3, -1], i32),
            "permute_token_id": np.array([0, -1, 1, -1], i32),
            "routing_map": np.array([[1, 0], [0, 1]], np.int8),
            "permuted_tokens": np.ones((4, 2), f32),
            "probs": np.ones((2, 2), f32),
        },
        {},
        None,
        "not padded with probs, a used slot must name a routed row",
    ),
    "unpermute grad probs with a token of K + 1 experts": (
        "MoeTokenUnpermuteWithRoutingMapGrad",
        {
            "unpermuted_tokens_grad": np.ones((2, 2), f32),
            "out_index": np.array([0, 1, 2, 3], i32),
            "permute_token_id": np.array([0, 0, 1, 1], i32),
            "routing_map": np.array([[1, 1, 1], [0, 0, 1]], np.int8),
            "permuted_tokens": np.ones((4, 2), f32),
            "probs": np.ones((2, 3), f32),
        },
        {},
        None,
        "not padded, a routing_map row may hold at most K",
    ),
    "unpermute grad without probs, int8 map holding 127": (  # found by fuzzing: the body did not read the map
        "MoeTokenUnpermuteWithRoutingMapGrad",
        {
            "unpermuted_tokens_grad": np.ones((2, 2), f32),
            "out_index": np.array([0, 1, 2, 3], i32),
            "permute_token_id": np.array([0, 0, 1, 1], i32),
            "routing_map": np.array([[1, 127], [1, 1]], np.int8),
        },
        {},
        ["permuted_tokens_grad"],
        "int8 routing_map must hold only 0 and 1",
    ),
    "unpermute without probs, int8 map holding -1": (
        "MoeTokenUnpermuteWithRoutingMap",
        {
            "permuted_tokens": np.ones((4, 2), f32),
            "sorted_indices": np.array([0, 1, 2, 3], i32),
            "routing_map": np.array([[1, -1], [1, 1]], np.int8),
        },
        {},
        ["unpermuted_tokens"],
        "int8 routing_map must hold only 0 and 1",
    ),
    "unpermute padded with probs, int8 map holding 2": (
        "MoeTokenUnpermuteWithRoutingMap",
        {
            "permuted_tokens": np.ones((4, 2), f32),
            "sorted_indices": np.array([0, 1, 0, 1], i32),
            "routing_map": np.array([[1, 2], [1, 1]], np.int8),
            "probs": np.ones((2, 2), f32),
        },
        {"padded_mode": 1},
        ["unpermuted_tokens"],
        "int8 routing_map must hold only 0 and 1",
    ),
    "permute grad without probs, int8 map holding -1": (
        "MoeTokenPermuteWithRoutingMapGrad",
        {
            "permuted_tokens_grad": np.ones((4, 2), f32),
            "sorted_indices": np.array([0, 1, 2, 3], i32),
            "routing_map": np.array([[1, -1], [1, 1]], np.int8),
        },
        {},
        ["tokens_grad"],
        "int8 routing_map must hold only 0 and 1",
    ),
    "permute grad padded with probs, int8 map holding 2": (
        "MoeTokenPermuteWithRoutingMapGrad",
        {
            "permuted_tokens_grad": np.ones((4, 2), f32),
            "permuted_probs_grad": np.ones((4,), f32),
            "sorted_indices": np.array([0, 1, 0, 1], i32),
            "routing_map": np.array([[1, 2], [1, 1]], np.int8),
        },
        {"drop_and_pad": 1},
        None,
        "int8 routing_map must hold only 0 and 1",
    ),
    "permute grad, probs given but probs_grad not asked for, a row of K - 1 ones": (  # the kernel checks it
        "MoeTokenPermuteWithRoutingMapGrad",
        {
            "permuted_tokens_grad": np.ones((4, 2), f32),
            "permuted_probs_grad": np.ones((4,), f32),
            "sorted_indices": np.array([0, 1, 2, 3], i32),
            "routing_map": np.array([[1, 1, 0], [0, 1, 0]], bool),
        },
        {},
        ["tokens_grad"],
        "not padded, every routing_map row must hold exactly K = N / T ones",
    ),
    "unpermute with probs, symbolic dims, K = N / T above E": (  # a shape rule met at run time
        "MoeTokenUnpermuteWithRoutingMap",
        {
            "permuted_tokens": np.ones((6, 2), f32),
            "sorted_indices": np.array([0, 1, 2, 3, -1, -1], i32),
            "routing_map": np.array([[1, 1], [1, 1]], bool),
            "probs": np.ones((2, 2), f32),
        },
        {"symbolic": True},
        ["unpermuted_tokens"],
        "not padded: K = N / T must not exceed E",
    ),
    "unpermute grad repeated out_index": (
        "MoeTokenUnpermuteWithRoutingMapGrad",
        {
            "unpermuted_tokens_grad": np.ones((2, 2), f32),
            "out_index": np.array([0, 2, 2, 3], i32),
            "permute_token_id": np.array([0, 0, 1, 1], i32),
        },
        {},
        ["permuted_tokens_grad"],
        "out_index must not repeat a row",
    ),
    "unpermute grad token past T": (  # padded: not padded, the token is the slot's (SPEC 1.6)
        "MoeTokenUnpermuteWithRoutingMapGrad",
        {
            "unpermuted_tokens_grad": np.ones((2, 2), f32),
            "out_index": np.array([0, 1, 2, 3], i32),
            "permute_token_id": np.array([0, 0, 1, 2], i32),
        },
        {"drop_and_pad": 1},
        ["permuted_tokens_grad"],
        "permute_token_id values must be a negative (empty slot) or in [0, T)",
    ),
    "unpermute grad out_index past N": (
        "MoeTokenUnpermuteWithRoutingMapGrad",
        {
            "unpermuted_tokens_grad": np.ones((2, 2), f32),
            "out_index": np.array([0, 1, 2, 7], i32),
            "permute_token_id": np.array([0, 0, 1, 1], i32),
            "routing_map": ROUTING_MAP,
            "permuted_tokens": np.ones((4, 2), f32),
            "probs": np.ones((2, 3), f32),
        },
        {},
        None,
        "out_index values of filled pairs must be in [0, N)",
    ),
    "token permute negative id": (
        "MoeTokenPermute",
        {"tokens": np.ones((2, 2), f32), "indices": np.array([[0, -1], [1, 2]], i32)},
        {},
        None,
        "indices must be >= 0",
    ),
    "token permute keeps no rows": (
        "MoeTokenPermute",
        {"tokens": np.ones((2, 2), f32), "indices": np.array([[0, 1], [1, 2]], np.int64)},
        {"num_out_tokens": -4, "symbolic": True},
        ["permuted_tokens", "sorted_indices"],
        "num_out_tokens = -4 < 0 must keep F + n > 0 rows",
    ),
    "token permute grad negative row": (
        "MoeTokenPermuteGrad",
        {"permuted_output_grad": np.ones((4, 2), f32), "sorted_indices": np.array([0, 1, -2, 3], i32)},
        {"num_topk": 2},
        None,
        "sorted_indices must be >= 0",
    ),
    "token unpermute negative row": (
        "MoeTokenUnpermute",
        {"permuted_tokens": np.ones((4, 2), f32), "sorted_indices": np.array([0, -1, 2, 3], i32)},
        {},
        None,
        "sorted_indices must be >= 0",
    ),
    "token unpermute probs not T*K": (
        "MoeTokenUnpermute",
        {
            "permuted_tokens": np.ones((4, 2), f32),
            "sorted_indices": np.array([0, 1, 2, 3], i32),
            "probs": np.ones((3, 2), f32),
        },
        {"symbolic": True},
        ["unpermuted_tokens"],
        "probs [T, K] must have T*K = len(sorted_indices)",
    ),
    "token unpermute grad negative row": (
        "MoeTokenUnpermuteGrad",
        {
            "permuted_tokens": np.ones((4, 2), f32),
            "unpermuted_tokens_grad": np.ones((4, 2), f32),
            "sorted_indices": np.array([0, 1, 2, -3], i32),
        },
        {},
        None,
        "sorted_indices must be >= 0",
    ),
    "token unpermute grad index not T*K": (
        "MoeTokenUnpermuteGrad",
        {
            "permuted_tokens": np.ones((4, 2), f32),
            "unpermuted_tokens_grad": np.ones((3, 2), f32),
            "sorted_indices": np.array([0, 1, 2, 3], i32),
        },
        {"symbolic": True},
        ["permuted_tokens_grad"],
        "len(sorted_indices) must equal T*K",
    ),
    "v1 row_idx out of range": (
        "MoeInitRouting",
        {
            "x": np.ones((2, 2), f32),
            "row_idx": np.array([[0, 2], [1, 4]], i32),
            "expert_idx": np.array([[0, 1], [1, 0]], i32),
        },
        {"active_num": 2},
        None,
        "row_idx must be a permutation of [0, T*K)",
    ),
    "v1 row_idx repeated": (
        "MoeInitRouting",
        {
            "x": np.ones((2, 2), f32),
            "row_idx": np.array([[0, 2], [1, 2]], i32),
            "expert_idx": np.array([[0, 1], [1, 0]], i32),
        },
        {"active_num": 2},
        None,
        "row_idx must be a permutation of [0, T*K)",
    ),
    "expert tokens decreasing": (
        "MoeComputeExpertTokens",
        {"sorted_experts": np.array([0, 2, 1], i32)},
        {"num_experts": 3},
        None,
        "sorted_experts must be non-decreasing",
    ),
    "grouped matmul cumsum falling by more than 2^63": (  # its difference wraps around in int64
        "GroupedMatmul",
        {"x": np.ones((4, 2), f32), "weight": np.ones((2, 2, 3), f32), "group_list": np.array([2**62, -(2**63)])},
        {"group_type": 0},
        None,
        "group_list (cumsum) must not decrease or start below 0",
    ),
    "grouped matmul counts summing past 2^63": (  # their CumSum wraps around to 0
        "GroupedMatmul",
        {"x": np.ones((4, 2), f32), "weight": np.ones((4, 2, 3), f32), "group_list": np.full(4, 2**62)},
        {"group_type": 0, "group_list_type": 1},
        None,
        "group_list (counts) must be in [0, the rows of x (split M)]",
    ),
    "grouped matmul groups past the rows": (
        "GroupedMatmul",
        {"x": np.ones((4, 2), f32), "weight": np.ones((2, 2, 3), f32), "group_list": np.array([3, 5])},
        {"group_type": 0},
        None,
        "the groups must cover at most the rows of x",
    ),
    "grouped matmul without groups, symbolic dims, bias not [N]": (  # no index input to gate (found by fuzzing)
        "GroupedMatmul",
        {"x": np.ones((4, 3), f32), "weight": np.ones((3, 7), f32), "bias": np.ones(2, f32)},
        {"group_type": -1, "symbolic": True},
        ["y"],
        "bias must be [N]: dim 0",
    ),
    "v3 expert id = expert_num": (
        "MoeInitRoutingV3",
        {"x": np.ones((2, 2), f32), "expert_idx": np.array([[0, 4], [1, 2]], i32)},
        {"expert_num": 4},
        ["expanded_x", "expanded_row_idx", "", "expanded_scale"],
        "expert_idx must be below expert_num = 4",
    ),
    "v3 drop/pad negative expert id": (
        "MoeInitRoutingV3",
        {"x": np.ones((2, 2), f32), "expert_idx": np.array([[0, -1], [1, 2]], i32)},
        {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 2},
        ["expanded_x", "expanded_row_idx", "", "expanded_scale"],
        "expert_idx must be in [0, expert_num) = [0, 4)",
    ),
    "finalize dropless index -1": (
        "MoeFinalizeRoutingV2",
        {"expanded_x": np.ones((4, 2), f32), "expanded_row_idx": np.array([0, 1, -1, 3], i32)},
        {"drop_pad_mode": 2, "k": 2},
        None,
        "expanded_row_idx values must be in [0, rows of expanded_x)",
    ),
    "finalize drop/pad index E*C": (
        "MoeFinalizeRoutingV2",
        {"expanded_x": np.ones((2, 2, 2), f32), "expanded_row_idx": np.array([0, -1, 4, 3], i32)},
        {"drop_pad_mode": 3, "k": 2},
        None,
        "expanded_row_idx values must be in [-1, E*C) (drop/pad)",
    ),
    "finalize bias expert past E": (
        "MoeFinalizeRoutingV2",
        {
            "expanded_x": np.ones((4, 2), f32),
            "expanded_row_idx": np.array([0, 1, 2, 3], i32),
            "x1": None,
            "x2": None,
            "bias": np.ones((2, 2), f32),
            "scales": None,
            "expert_idx": np.array([[0, 2], [1, 0]], i32),
        },
        {"drop_pad_mode": 2, "k": 2},
        None,
        "expert_idx must be in [0, E) (E = bias dim 0)",
    ),
    "finalize grad repeated row": (
        "MoeFinalizeRoutingV2Grad",
        {"grad_y": np.ones((2, 2), f32), "expanded_row_idx": np.array([0, 1, 1, 3], i32)},
        {},
        ["grad_expanded_x"],
        "expanded_row_idx must name each row once",
    ),
    "finalize grad index past R*K": (
        "MoeFinalizeRoutingV2Grad",
        {"grad_y": np.ones((2, 2), f32), "expanded_row_idx": np.array([0, 1, 4, 3], i32)},
        {},
        ["grad_expanded_x"],
        "expanded_row_idx values must be in [0, R*K)",
    ),
    "finalize grad drop/pad index -2": (
        "MoeFinalizeRoutingV2Grad",
        {"grad_y": np.ones((2, 2), f32), "expanded_row_idx": np.array([0, -1, -2, 3], i32)},
        {"drop_pad_mode": 1, "expert_num": 2, "expert_capacity": 2},
        ["grad_expanded_x"],
        "expanded_row_idx values must be in [-1, E*C) (drop/pad)",
    ),
    "finalize grad without scales, bias expert past E": (  # the body skipped it (found by fuzzing)
        "MoeFinalizeRoutingV2Grad",
        {
            "grad_y": np.ones((2, 1), f32),
            "expanded_row_idx": np.array([0, 1, 2, 3], i32),
            "expanded_x": None,
            "scales": None,
            "expert_idx": np.array([[0, 1], [1, 0]], i32),
            "bias": np.ones((1, 1), f32),
        },
        {},
        ["grad_expanded_x"],
        "expert_idx must be in [0, E) (E = bias dim 0)",
    ),
    "gating backward expert past E": (
        "MoeGatingTopKBackward",
        {
            "x_norm": np.full((2, 3), 0.5, f32),
            "grad_y": np.ones((2, 2), f32),
            "expert_idx": np.array([[0, 3], [1, 2]], i32),
        },
        {},
        None,
        "expert_idx must be in [0, E)",
    ),
    "expert tokens negative": (
        "MoeComputeExpertTokens",
        {"sorted_experts": np.array([-1, 0, 1], i32)},
        {"num_experts": 3},
        None,
        "sorted_experts must be >= 0",
    ),
}


@pytest.mark.parametrize("inline", [False, True], ids=["functions", "inlined"])
@pytest.mark.parametrize("case", sorted(CASES), ids=lambda case: case.replace(" ", "-"))
def test_refused_input_fails_in_every_runtime(runner, case, inline):
    op_type, inputs, attrs, outputs, rule = CASES[case]
    attrs = dict(attrs)
    symbolic = attrs.pop("symbolic", False)  # (not an attribute: the model's dims are symbols)
    with pytest.raises(moe_onnx.MoeOpError):  # the kernel refuses it ...
        OPS[op_type](*inputs.values(), **attrs)
    model = moe_onnx.lower(node_model(op_type, inputs, attrs, outputs, symbolic=symbolic), inline=inline)
    reply = runner.run(model, inputs, check=False)
    ort_error = reply["onnxruntime"]
    assert isinstance(ort_error, str), f"onnxruntime returned {ort_error} for a refused input"
    assert f"{op_type} check: {rule}" in ort_error, ort_error  # ... and so does the lowered model
    if inline:  # inlined, the failing node's name starts with the calling node's
        assert "Name:'node/" in ort_error, ort_error
    assert isinstance(reply["reference"], str), f"onnx.reference returned {reply['reference']}"
