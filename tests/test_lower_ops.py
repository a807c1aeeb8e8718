"""Every lowered op, in a process that never imports moe_onnx (onnxruntime and onnx.reference),
against its kernel, over derandomized random cases (see tests/lower_support.py for the
tolerances)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_onnx.converters.lowering import LoweringError
from moe_onnx.custom_ops.moe_init_routing_v2 import moe_init_routing_v2
from moe_onnx.custom_ops.moe_token_permute_with_routing_map import moe_token_permute_with_routing_map
from moe_onnx.custom_ops.moe_token_unpermute_with_routing_map import moe_token_unpermute_with_routing_map

from .lower_support import LoweredRunner, check_lowered

#: the lowest opset a body is written for, the project's default and a recent one
OPSETS = (18, 21, 24)
DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "int8": np.int8,
    "uint8": np.uint8,
    "float8e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8e5m2": ml_dtypes.float8_e5m2,
}


@pytest.fixture(scope="module")
def runner():
    worker = LoweredRunner()
    yield worker
    worker.close()


def random_rows(rng, shape, dtype: str) -> np.ndarray:
    """Random values of ``dtype``; 8-bit types as random bytes: every pattern but the
    float8e5m2 NaNs, whose payloads no runtime keeps (test_float8e5m2_nan_stays_nan)."""
    if dtype in ("int8", "uint8", "float8e4m3fn", "float8e5m2"):
        bits = rng.integers(0, 256, shape, dtype=np.uint8)
        if dtype == "float8e5m2":
            nan = (bits & 0x7F) > 0x7C
            bits[nan] &= 0xFC  # -> +-inf
        return bits.view(DTYPES[dtype])
    return rng.standard_normal(shape).astype(np.float32).astype(DTYPES[dtype])


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**32 - 1),
    ranks=st.integers(1, 3),
    experts=st.integers(1, 4),
    hidden=st.integers(1, 4),
    dtype=st.sampled_from(sorted(DTYPES)),
    counts_dtype=st.sampled_from(["int32", "int64"]),
    scales=st.sampled_from([None, 1, 2, "uint8x3"]),
    weight=st.booleans(),
    idx_type=st.sampled_from([0, 1]),
    count_type=st.sampled_from([0, 1]),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_re_routing(
    runner, seed, ranks, experts, hidden, dtype, counts_dtype, scales, weight, idx_type, count_type, inline, opset
):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, (ranks, experts)).astype(counts_dtype)
    rows = int(counts.sum())
    inputs = {"tokens": random_rows(rng, (rows, hidden), dtype), "expert_token_num_per_rank": counts}
    if scales == "uint8x3":
        inputs["per_token_scales"] = rng.integers(0, 256, (rows, 2, 2), dtype=np.uint8)
    elif scales is not None:
        inputs["per_token_scales"] = rng.standard_normal((rows, 3) if scales == 2 else rows).astype(np.float32)
    else:
        inputs["per_token_scales"] = None
    inputs["expert_topk_weight"] = rng.standard_normal((rows, 1)).astype(np.float32) if weight else None
    attrs = {"idx_type": idx_type, "expert_token_num_type": count_type}
    outputs = (
        None if weight else ["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""]
    )
    if dtype.startswith("float8") and opset < 19:  # Cast with saturate=0 is opset 19
        with pytest.raises(LoweringError, match="opset >= 19"):
            check_lowered(runner, "MoeReRoutingV2", inputs, attrs, outputs, inline=inline, opset=opset)
        return
    check_lowered(runner, "MoeReRoutingV2", inputs, attrs, outputs, inline=inline, opset=opset)


FLOATS = ("float32", "float16", "bfloat16")


def floats(rng, shape, dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(DTYPES[dtype])


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 5),
    top_k=st.integers(1, 3),
    experts=st.integers(1, 5),
    hidden=st.integers(1, 4),
    dtype=st.sampled_from(FLOATS),
    mode=st.sampled_from(["dropless", "active", "drop/pad", "unknown E"]),
    active_extra=st.integers(-4, 2),
    capacity=st.integers(1, 5),
    count_flag=st.sampled_from([0, 1, 2]),
    before_flag=st.sampled_from([0, 1]),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_init_routing(
    runner,
    seed,
    tokens,
    top_k,
    experts,
    hidden,
    dtype,
    mode,
    active_extra,
    capacity,
    count_flag,
    before_flag,
    inline,
    opset,
):
    rng = np.random.default_rng(seed)
    low = -3 if mode == "unknown E" else 0  # expert_num = 0: ids are not checked, any order works
    inputs = {
        "x": floats(rng, (tokens, hidden), dtype),
        "expert_idx": rng.integers(low, experts, (tokens, top_k)).astype(np.int32),
    }
    attrs = {"expert_num": 0 if mode == "unknown E" else experts}
    if mode == "unknown E":
        count_flag = before_flag = 0
    if mode == "active":
        attrs["active_num"] = max(1, tokens * top_k + active_extra)
    if mode == "drop/pad":
        attrs.update(drop_pad_mode=1, expert_capacity=min(capacity, tokens))
    attrs.update(expert_tokens_count_or_cumsum_flag=count_flag, expert_tokens_before_capacity_flag=before_flag)
    outputs = [
        "expanded_x",
        "expanded_row_idx",
        "expert_tokens_count_or_cumsum" if count_flag else "",
        "expert_tokens_before_capacity" if before_flag else "",
    ]
    check_lowered(runner, "MoeInitRoutingV2", inputs, attrs, outputs, inline=inline, opset=opset)


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(0, 5),
    top_k=st.integers(1, 3),
    experts=st.integers(1, 6),
    hidden=st.integers(1, 4),
    dtype=st.sampled_from(sorted(DTYPES)),
    padded=st.booleans(),
    active_num=st.integers(-1, 12),
    range_cut=st.tuples(st.integers(0, 5), st.integers(1, 6)),
    row_idx_type=st.sampled_from([0, 1]),
    count=st.sampled_from([None, 0, 1, 2]),
    with_scale=st.booleans(),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_init_routing_v3(
    runner,
    seed,
    tokens,
    top_k,
    experts,
    hidden,
    dtype,
    padded,
    active_num,
    range_cut,
    row_idx_type,
    count,
    with_scale,
    inline,
    opset,
):
    rng = np.random.default_rng(seed)
    tokens = max(tokens, int(padded))  # drop/pad needs 0 < C <= T
    inputs = {
        "x": random_rows(rng, (tokens, hidden), dtype),
        "expert_idx": rng.integers(0 if padded else -2, experts, (tokens, top_k)).astype(np.int32),
        "scale": rng.standard_normal(tokens).astype(np.float32) if with_scale else None,
    }
    attrs = {"expert_num": experts, "expert_tokens_num_flag": int(count is not None)}
    attrs["expert_tokens_num_type"] = 1 if count is None or padded else count
    if padded:
        attrs.update(drop_pad_mode=1, expert_capacity=int(rng.integers(1, tokens + 1)))
    else:
        start = min(range_cut[0], experts - 1)
        attrs.update(
            active_num=active_num,
            row_idx_type=row_idx_type,
            active_expert_range=[start, max(start + 1, min(range_cut[1], experts))],
        )
    outputs = ["expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum" if count is not None else ""]
    outputs.append("expanded_scale")
    if dtype.startswith("float8") and opset < 19:
        with pytest.raises(LoweringError, match="opset >= 19"):
            check_lowered(runner, "MoeInitRoutingV3", inputs, attrs, outputs, inline=inline, opset=opset)
        return
    check_lowered(runner, "MoeInitRoutingV3", inputs, attrs, outputs, inline=inline, opset=opset)


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 5),
    top_k=st.integers(1, 3),
    experts=st.integers(1, 4),
    hidden=st.integers(1, 4),
    dtype=st.sampled_from(FLOATS),
    mode=st.sampled_from(["dropless", "active", "drop/pad", "partial range"]),
    active_extra=st.integers(-4, 2),
    capacity=st.integers(1, 5),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_init_routing_grad(
    runner, seed, tokens, top_k, experts, hidden, dtype, mode, active_extra, capacity, inline, opset
):
    rng = np.random.default_rng(seed)
    expert_idx = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
    forward = {"expert_num": experts}
    grad_attrs = {"top_k": top_k}
    if mode == "active":
        forward["active_num"] = grad_attrs["active_num"] = max(1, tokens * top_k + active_extra)
    if mode == "drop/pad":
        forward.update(drop_pad_mode=1, expert_capacity=min(capacity, tokens))
        grad_attrs["drop_pad_mode"] = 1
    expanded_x, expanded_row_idx, _, _ = moe_init_routing_v2(
        floats(rng, (tokens, hidden), dtype), expert_idx, **forward
    )
    if mode == "partial range":  # the copies of inactive experts are -1 (SPEC 1.3, amended)
        expanded_row_idx = np.where(rng.random(expanded_row_idx.shape) < 0.4, -1, expanded_row_idx).astype(np.int32)
    inputs = {"grad_expanded_x": floats(rng, expanded_x.shape, dtype), "expanded_row_idx": expanded_row_idx}
    sums = {"grad_x": ("grad_expanded_x",)}
    check_lowered(runner, "MoeInitRoutingV2Grad", inputs, grad_attrs, sums=sums, inline=inline, opset=opset)


def routing(rng, tokens: int, experts: int, top_k: int | None, map_dtype: str) -> np.ndarray:
    """``[T, E]``: exactly K experts per token, or (K None) any subset."""
    if top_k is None:
        chosen = rng.random((tokens, experts)) < 0.5
    else:
        chosen = np.zeros((tokens, experts), bool)
        np.put_along_axis(chosen, np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k], True, axis=1)
    return chosen if map_dtype == "bool" else chosen.astype(np.int8)


def probs_dtype_for(dtype: str, mixed: bool) -> str:
    return "float32" if mixed and dtype == "bfloat16" else dtype


routing_cases = dict(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 5),
    experts=st.integers(1, 5),
    top_k=st.integers(1, 5),
    capacity=st.integers(1, 5),
    hidden=st.integers(1, 4),
    dtype=st.sampled_from(FLOATS),
    mixed=st.booleans(),
    map_dtype=st.sampled_from(["bool", "int8"]),
    padded=st.booleans(),
    with_probs=st.booleans(),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)


def permute_inputs(rng, tokens, experts, top_k, capacity, hidden, dtype, mixed, map_dtype, padded, with_probs):
    top_k, capacity = min(top_k, experts), min(capacity, tokens)
    routing_map = routing(rng, tokens, experts, None if padded else top_k, map_dtype)
    probs = floats(rng, (tokens, experts), probs_dtype_for(dtype, mixed)) if with_probs else None
    inputs = {"tokens": floats(rng, (tokens, hidden), dtype), "routing_map": routing_map, "probs": probs}
    attrs = {"num_out_tokens": experts * capacity if padded else tokens * top_k, "drop_and_pad": int(padded)}
    return inputs, attrs


@settings(max_examples=30)
@given(**routing_cases)
def test_permute(
    runner, seed, tokens, experts, top_k, capacity, hidden, dtype, mixed, map_dtype, padded, with_probs, inline, opset
):
    rng = np.random.default_rng(seed)
    inputs, attrs = permute_inputs(
        rng, tokens, experts, top_k, capacity, hidden, dtype, mixed, map_dtype, padded, with_probs
    )
    if not padded and tokens and seed % 2:  # -K: K rows per token, what a dynamic T exports as
        attrs = {**attrs, "num_out_tokens": -(attrs["num_out_tokens"] // tokens)}
    outputs = None if with_probs else ["permuted_tokens", "sorted_indices"]
    check_lowered(runner, "MoeTokenPermuteWithRoutingMap", inputs, attrs, outputs, inline=inline, opset=opset)


@settings(max_examples=30)
@given(**routing_cases, give_map=st.booleans())
def test_permute_grad(
    runner,
    seed,
    tokens,
    experts,
    top_k,
    capacity,
    hidden,
    dtype,
    mixed,
    map_dtype,
    padded,
    with_probs,
    inline,
    opset,
    give_map,
):
    rng = np.random.default_rng(seed)
    forward, attrs = permute_inputs(
        rng, tokens, experts, top_k, capacity, hidden, dtype, mixed, map_dtype, padded, with_probs
    )
    _, sorted_indices, _ = moe_token_permute_with_routing_map(*forward.values(), **attrs)
    rows = len(sorted_indices)
    probs_dtype = probs_dtype_for(dtype, mixed)
    inputs = {
        "permuted_tokens_grad": floats(rng, (rows, hidden), dtype),
        "permuted_probs_grad": floats(rng, rows, probs_dtype) if with_probs else None,
        "sorted_indices": sorted_indices,
        "routing_map": forward["routing_map"] if give_map or (with_probs and not padded) else None,
    }
    grad_attrs = {"drop_and_pad": int(padded)}
    if inputs["routing_map"] is None:
        grad_attrs.update(tokens_num=tokens, experts_num=experts)
    outputs = None if with_probs else ["tokens_grad"]
    sums = {"tokens_grad": ("permuted_tokens_grad",)}
    check_lowered(
        runner, "MoeTokenPermuteWithRoutingMapGrad", inputs, grad_attrs, outputs, sums=sums, inline=inline, opset=opset
    )


@settings(max_examples=30)
@given(**routing_cases, restore=st.booleans(), empty_slots=st.booleans())
def test_unpermute(
    runner,
    seed,
    tokens,
    experts,
    top_k,
    capacity,
    hidden,
    dtype,
    mixed,
    map_dtype,
    padded,
    with_probs,
    inline,
    opset,
    restore,
    empty_slots,
):
    rng = np.random.default_rng(seed)
    forward, attrs = permute_inputs(
        rng, tokens, experts, top_k, capacity, hidden, dtype, mixed, map_dtype, padded, with_probs
    )
    _, sorted_indices, _ = moe_token_permute_with_routing_map(*forward.values(), **attrs)
    rows = len(sorted_indices)
    if padded and empty_slots:  # the kernel takes negative tokens as empty slots
        sorted_indices = np.where(rng.random(rows) < 0.3, -1, sorted_indices).astype(np.int32)
    inputs = {
        "permuted_tokens": floats(rng, (rows, hidden), dtype),
        "sorted_indices": sorted_indices,
        "routing_map": forward["routing_map"] if with_probs or not restore else None,
        "probs": forward["probs"],
    }
    unpermute_attrs = {"padded_mode": int(padded)}
    if restore:
        unpermute_attrs["restore_shape"] = [tokens, hidden]
    sums = {"unpermuted_tokens": ("permuted_tokens", "probs")}
    outputs = None if with_probs else ["unpermuted_tokens", "out_index", "permute_token_id"]
    check_lowered(
        runner,
        "MoeTokenUnpermuteWithRoutingMap",
        inputs,
        unpermute_attrs,
        outputs,
        sums=sums,
        inline=inline,
        opset=opset,
    )


@settings(max_examples=30)
@given(**routing_cases, unfilled=st.booleans())
def test_unpermute_grad(
    runner,
    seed,
    tokens,
    experts,
    top_k,
    capacity,
    hidden,
    dtype,
    mixed,
    map_dtype,
    padded,
    with_probs,
    inline,
    opset,
    unfilled,
):
    rng = np.random.default_rng(seed)
    forward, attrs = permute_inputs(
        rng, tokens, experts, top_k, capacity, hidden, dtype, mixed, map_dtype, padded, with_probs
    )
    permuted, sorted_indices, _ = moe_token_permute_with_routing_map(*forward.values(), **attrs)
    _, out_index, token_id, _ = moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, forward["routing_map"], None, padded_mode=int(padded), restore_shape=[tokens, hidden]
    )
    if unfilled:  # a token with fewer than K experts in the backward path (seed 000)
        empty = rng.random(len(token_id)) < 0.3
        token_id = np.where(empty, -1, token_id).astype(np.int32)
        if not padded:  # not padded, an unused slot is a negative out_index (SPEC 1.6)
            out_index = np.where(empty, -1, out_index).astype(np.int32)
    elif not padded and seed % 2:  # torch_npu's backward passes sorted_indices twice: not read
        token_id = out_index
    inputs = {
        "unpermuted_tokens_grad": floats(rng, (tokens, hidden), dtype),
        "out_index": out_index,
        "permute_token_id": token_id,
        "routing_map": forward["routing_map"] if with_probs else None,
        "permuted_tokens": permuted if with_probs else None,
        "probs": forward["probs"],
    }
    grad_attrs = {"drop_and_pad": int(padded), "restore_shape": [tokens, hidden]}
    sums = {"probs_grad": ("unpermuted_tokens_grad", "permuted_tokens")}
    outputs = None if with_probs else ["permuted_tokens_grad"]
    check_lowered(
        runner,
        "MoeTokenUnpermuteWithRoutingMapGrad",
        inputs,
        grad_attrs,
        outputs,
        sums=sums,
        inline=inline,
        opset=opset,
    )


def _empty_cases():
    f32, i32 = np.float32, np.int32
    no_tokens = np.zeros((0, 3), f32)
    return {
        "rerouting, A = 0": (
            "MoeReRoutingV2",
            {"tokens": no_tokens, "expert_token_num_per_rank": np.zeros((2, 2), i32)},
            {"idx_type": 1},
            ["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""],
        ),
        "init routing, T = 0": (
            "MoeInitRoutingV2",
            {"x": no_tokens, "expert_idx": np.zeros((0, 2), i32)},
            {"expert_num": 4, "expert_tokens_count_or_cumsum_flag": 1, "expert_tokens_before_capacity_flag": 1},
            None,
        ),
        "init routing grad, T = 0": (
            "MoeInitRoutingV2Grad",
            {"grad_expanded_x": no_tokens, "expanded_row_idx": np.zeros(0, i32)},
            {"top_k": 2},
            None,
        ),
        "permute, T = 0": (
            "MoeTokenPermuteWithRoutingMap",
            {"tokens": no_tokens, "routing_map": np.zeros((0, 4), bool), "probs": np.zeros((0, 4), f32)},
            {"num_out_tokens": 0},
            None,
        ),
        "padded permute, C = 0": (
            "MoeTokenPermuteWithRoutingMap",
            {"tokens": np.ones((2, 3), f32), "routing_map": np.ones((2, 4), bool), "probs": np.ones((2, 4), f32)},
            {"num_out_tokens": 0, "drop_and_pad": 1},
            None,
        ),
        "permute grad, T = 0": (
            "MoeTokenPermuteWithRoutingMapGrad",
            {
                "permuted_tokens_grad": no_tokens,
                "permuted_probs_grad": np.zeros(0, f32),
                "sorted_indices": np.zeros(0, i32),
                "routing_map": np.zeros((0, 4), np.int8),
            },
            {},
            None,
        ),
        "unpermute, T = 0": (
            "MoeTokenUnpermuteWithRoutingMap",
            {
                "permuted_tokens": no_tokens,
                "sorted_indices": np.zeros(0, i32),
                "routing_map": np.zeros((0, 4), bool),
                "probs": np.zeros((0, 4), f32),
            },
            {},
            None,
        ),
        "drop/pad finalize routing, C = 0": (  # onnx.reference's Flatten failed on the empty rows
            "MoeFinalizeRoutingV2",
            {
                "expanded_x": np.zeros((2, 0, 3), f32),
                "expanded_row_idx": np.full(4, -1, i32),
                "x1": np.ones((2, 3), f32),
            },
            {"drop_pad_mode": 1, "k": 2},
            None,
        ),
        "drop/pad init routing grad, C = 0": (
            "MoeInitRoutingV2Grad",
            {"grad_expanded_x": np.zeros((2, 0, 3), f32), "expanded_row_idx": np.full(4, -1, i32)},
            {"top_k": 2, "drop_pad_mode": 1},
            None,
        ),
        "padded unpermute grad, every slot empty": (
            "MoeTokenUnpermuteWithRoutingMapGrad",
            {
                "unpermuted_tokens_grad": np.ones((2, 3), f32),
                "out_index": np.arange(4, dtype=i32),
                "permute_token_id": np.full(4, -1, i32),
                "routing_map": np.ones((2, 2), bool),
                "permuted_tokens": np.ones((4, 3), f32),
                "probs": np.ones((2, 2), f32),
            },
            {"drop_and_pad": 1},
            None,
        ),
    }


EMPTY_CASES = _empty_cases()


@pytest.mark.parametrize("case", sorted(EMPTY_CASES), ids=lambda case: case.replace(" ", "-"))
def test_empty_sizes(runner, case):
    op_type, inputs, attrs, outputs = EMPTY_CASES[case]
    for inline in (False, True):
        check_lowered(runner, op_type, inputs, attrs, outputs, inline=inline)


# --- expert compute and combine (SPEC-layer 1.8-1.10) -------------------------------------


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    dim=st.integers(-3, 2),
    dtype=st.sampled_from(FLOATS),
    grad=st.booleans(),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_swi_glu(runner, seed, shape, dim, dtype, grad, inline, opset):
    rng = np.random.default_rng(seed)
    dim = dim % len(shape)
    shape[dim] *= 2
    x = (rng.standard_normal(shape) * 3).astype(DTYPES[dtype])
    if not grad:
        check_lowered(runner, "SwiGlu", {"x": x}, {"dim": dim}, sums={"y": ("x",)}, inline=inline, opset=opset)
        return
    shape[dim] //= 2
    inputs = {"y_grad": floats(rng, shape, dtype), "x": x}
    sums = {"x_grad": ("y_grad", "x")}
    check_lowered(runner, "SwiGluGrad", inputs, {"dim": dim}, sums=sums, inline=inline, opset=opset)


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    group_type=st.sampled_from([0, 2, -1]),
    experts=st.integers(1, 4),
    rows=st.integers(0, 6),
    inner=st.integers(1, 4),
    columns=st.integers(1, 4),
    dtype=st.sampled_from(FLOATS),
    list_type=st.sampled_from([0, 1]),
    with_bias=st.booleans(),
    transpose_weight=st.sampled_from([0, 1]),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_grouped_matmul(
    runner,
    seed,
    group_type,
    experts,
    rows,
    inner,
    columns,
    dtype,
    list_type,
    with_bias,
    transpose_weight,
    inline,
    opset,
):
    rng = np.random.default_rng(seed)
    grouped = rows if group_type == 0 else inner * experts
    counts = rng.multinomial(int(rng.integers(0, grouped + 1)), np.ones(experts) / experts)
    group_list = (counts if list_type else np.cumsum(counts)).astype(np.int64)
    bias_dtype = "float16" if dtype == "float16" else "float32"
    attrs = {"group_type": group_type, "group_list_type": list_type, "transpose_weight": transpose_weight}
    if group_type == 0:
        x, w = floats(rng, (rows, inner), dtype), floats(rng, (experts, inner, columns), dtype)
        bias = floats(rng, (experts, columns), bias_dtype) if with_bias else None
    elif group_type == 2:
        x, w, bias = floats(rng, (grouped, rows), dtype), floats(rng, (grouped, columns), dtype), None
        attrs["transpose_x"] = 1
    else:
        x, w = floats(rng, (rows, inner), dtype), floats(rng, (inner, columns), dtype)
        bias, group_list = (floats(rng, (columns,), bias_dtype) if with_bias else None), None
        del attrs["group_list_type"]
    if transpose_weight:
        w = np.ascontiguousarray(np.swapaxes(w, -1, -2))
    inputs = {"x": x, "weight": w, "bias": bias, "group_list": group_list}
    sums = {"y": ("x", "weight", "bias")}
    check_lowered(runner, "GroupedMatmul", inputs, attrs, sums=sums, inline=inline, opset=opset)


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(0, 4),
    top_k=st.integers(1, 3),
    hidden=st.integers(1, 4),
    mode=st.sampled_from([0, 1, 2, 3]),
    dtype=st.sampled_from(FLOATS),
    mixed=st.booleans(),
    parts=st.sets(st.sampled_from(["x1", "x2", "bias", "scales"])),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_finalize_routing(runner, seed, tokens, top_k, hidden, mode, dtype, mixed, parts, inline, opset):
    rng = np.random.default_rng(seed)
    experts, capacity, slots = top_k + 1, 2, tokens * top_k
    if mode in (1, 3):
        rows = floats(rng, (experts, capacity, hidden), dtype)
        index = rng.integers(-1, experts * capacity, slots)
    else:
        rows = floats(rng, (slots + 1, hidden), dtype)
        index = rng.integers(0, slots + 1, slots)
    scales_dtype = probs_dtype_for(dtype, mixed)
    inputs = {
        "expanded_x": rows,
        "expanded_row_idx": index.astype(np.int32),
        "x1": floats(rng, (tokens, hidden), dtype) if "x1" in parts else None,
        "x2": floats(rng, (tokens, hidden), dtype) if {"x1", "x2"} <= parts else None,
        "bias": floats(rng, (experts, hidden), dtype) if "bias" in parts else None,
        "scales": rng.random((tokens, top_k)).astype(DTYPES[scales_dtype]) if "scales" in parts else None,
        "expert_idx": rng.integers(0, experts, (tokens, top_k)).astype(np.int32) if "bias" in parts else None,
    }
    sums = {"y": ("expanded_x", "x1", "x2", "bias", "scales")}
    attrs = {"drop_pad_mode": mode, "k": top_k}
    check_lowered(runner, "MoeFinalizeRoutingV2", inputs, attrs, sums=sums, inline=inline, opset=opset)


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(0, 4),
    top_k=st.integers(1, 3),
    hidden=st.integers(1, 4),
    padded=st.booleans(),
    active=st.booleans(),
    dtype=st.sampled_from(FLOATS),
    mixed=st.booleans(),
    with_scales=st.booleans(),
    with_bias=st.booleans(),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_finalize_routing_grad(
    runner, seed, tokens, top_k, hidden, padded, active, dtype, mixed, with_scales, with_bias, inline, opset
):
    rng = np.random.default_rng(seed)
    experts, capacity, slots = top_k + 1, 2, tokens * top_k
    if padded:
        shape = (experts, capacity, hidden)
        index = rng.permutation(np.concatenate([np.arange(experts * capacity), np.full(slots, -1)]))[:slots]
        attrs = {"drop_pad_mode": 1, "expert_num": experts, "expert_capacity": capacity}
    else:
        active_num = max(1, slots - 1) if active and slots > 1 else 0
        shape = (active_num or slots, hidden)
        index = rng.permutation(slots)
        attrs = {"active_num": active_num}
    with_bias = with_bias and with_scales
    inputs = {
        "grad_y": floats(rng, (tokens, hidden), dtype),
        "expanded_row_idx": index.astype(np.int32),
        "expanded_x": floats(rng, shape, dtype) if with_scales else None,
        "scales": rng.random((tokens, top_k)).astype(DTYPES[probs_dtype_for(dtype, mixed)]) if with_scales else None,
        "expert_idx": rng.integers(0, experts, (tokens, top_k)).astype(np.int32) if with_bias else None,
        "bias": floats(rng, (experts, hidden), dtype) if with_bias else None,
    }
    outputs = ["grad_expanded_x", "grad_scales" if with_scales else ""]
    sums = {"grad_expanded_x": ("grad_y", "scales"), "grad_scales": ("grad_y", "expanded_x", "bias")}
    check_lowered(runner, "MoeFinalizeRoutingV2Grad", inputs, attrs, outputs, sums=sums, inline=inline, opset=opset)
