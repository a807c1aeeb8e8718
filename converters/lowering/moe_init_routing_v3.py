"""MoeInitRoutingV3 in standard ONNX ops (SPEC-layer 1.17; see custom_ops/moe_init_routing_v3.py).

Source position ``p = t*K + j``. Dropless, the sort key is the expert id for slots in range or
above it and INT32_MAX for ids below the range; ``TopK`` (ascending, sorted) of the unique int64
``key*(T*K) + p`` is the stable order, ``order[d] = p``, as in MoeInitRoutingV2's body::

    n_av = #{p : start <= id < end};  A = T*K or min(active_num, T*K);  n = min(A, n_av)
    row_token[d] = order[d] // K for d < n, T (the zero row) for n <= d < A
    expanded_x = Gather(x, row_token); expanded_scale = Gather(scale ++ [0], row_token)
    row_idx_type 0: expanded_row_idx[order[d]] = d if d < n_av else -1;  1: expanded_row_idx = order

Drop/pad (the whole range) is MoeInitRoutingV2's body, the scales gathered by the same slot
tokens. The counts are a histogram of the in-range ids (ScatterElements "add"); key/value is
``NonZero`` of it, with the absolute ids, padded with zero rows. float8 rows cross ``Gather`` as
float16 (Cast with saturate=0, opset 19), as in MoeReRoutingV2's body.
"""

from __future__ import annotations

from moe_onnx.custom_ops import dtypes
from moe_onnx.custom_ops.dtypes import FLOAT8
from moe_onnx.custom_ops.moe_init_routing_v2 import INT32_MAX
from moe_onnx.custom_ops.moe_init_routing_v3 import KEY_VALUE, expert_range

from .builder import INT32, INT64, Body, Specialisation
from .moe_init_routing_v2 import histogram, stable_order

LOWERS = ("MoeInitRoutingV3",)


def gathered_rows(b: Body, x: str, dtype: str, row_token: str, tokens: str) -> str:
    """``x[row_token]``, a row of zeros where ``row_token == T`` (bit-exact; float8 through float16)."""
    work, work_dtype = (b.cast(x, "float16"), "float16") if dtype in FLOAT8 else (x, dtype)
    every_row_filled = b.none_true(b.Equal(row_token, tokens))
    rows = b.gather_or_zero_rows(work, row_token, work_dtype, 2, every_row_filled)
    return b.Cast(rows, to=dtypes.onnx_type(dtype), saturate=0) if dtype in FLOAT8 else rows


def expert_tokens(b: Body, node: Specialisation, in_range_ids: str, start: int, end: int) -> str:
    """The counts output (int64): cumsum, count or key/value of the in-range ids."""
    counts = histogram(b, b.Sub(in_range_ids, b.ints([start])), end - start)
    kind = node.attr("expert_tokens_num_type")
    if kind == 0:
        return b.CumSum(counts, b.int64(0))
    if kind == 1:
        return counts
    assert kind == KEY_VALUE
    experts = node.attr("expert_num")
    nonzero = b.flat(b.NonZero(counts))  # ascending
    table = b.Concat(
        b.Unsqueeze(b.Add(nonzero, b.ints([start])), b.ints([1])),
        b.Unsqueeze(b.Gather(counts, nonzero, axis=0), b.ints([1])),
        axis=1,
    )
    zero_rows = b.full(b.Concat(b.Sub(b.ints([experts]), b.Shape(nonzero)), b.ints([2]), axis=0), 0, "int64")
    return b.Concat(table, zero_rows, axis=0)


def body(b: Body, node: Specialisation) -> None:
    x_dtype = node.dtype("x")
    if x_dtype in FLOAT8 and node.opset < 19:
        raise node.refuse(f"{x_dtype} x needs opset >= 19 (Cast with saturate=0); the model has {node.opset}")
    active_num, capacity, experts = node.attr("active_num"), node.attr("expert_capacity"), node.attr("expert_num")
    start, end = expert_range(node.attr("active_expert_range"), experts)
    tokens, top_k = b.dim("expert_idx", 0), b.dim("expert_idx", 1)
    ids = b.flat(b.Cast("expert_idx", to=INT64))  # [T*K], position p = t*K + j
    n = b.Shape(ids)
    positions = b.arange(n)

    if node.attr("drop_pad_mode") == 1:  # the whole range (infer)
        ids = b.check_range(ids, 0, experts, f"expert_idx must be in [0, expert_num) = [0, {experts})")
        order = stable_order(b, ids, n)
        source_token = b.Div(order, b.safe_divisor(top_k))
        counts = histogram(b, ids, experts)
        sorted_ids = b.Gather(ids, order, axis=0)
        rank = b.Sub(positions, b.Gather(b.CumSum(counts, b.int64(0), exclusive=1), sorted_ids, axis=0))
        kept = b.Less(rank, b.ints([capacity]))
        slot = b.Add(b.Mul(sorted_ids, b.ints([capacity])), rank)
        slots = experts * capacity
        # dropped entries write a spare slot; unfilled slots take token T, the zero row
        row_token = b.ScatterElements(
            b.Expand(tokens, b.ints([slots + 1])), b.Where(kept, slot, b.ints([slots])), source_token, axis=0
        )
        row_token = b.Slice(row_token, b.ints([0]), b.ints([slots]))
        rows = gathered_rows(b, "x", x_dtype, row_token, tokens)
        b.output("expanded_x", b.Reshape(rows, b.Concat(b.ints([experts, capacity]), b.dim("x", 1), axis=0)))
        destination = b.Where(kept, slot, b.ints([-1]))
        row_idx = b.ScatterElements(b.full(n, 0, "int32"), order, b.Cast(destination, to=INT32), axis=0)
        in_range_ids = ids
    else:
        too_big = b.GreaterOrEqual(ids, b.ints([experts]))
        ids = b.check(ids, b.none_true(too_big), f"expert_idx must be below expert_num = {experts}")
        below = b.Less(ids, b.ints([start]))
        in_range = b.And(b.Not(below), b.Less(ids, b.ints([end])))
        order = stable_order(b, b.Where(below, b.ints([INT32_MAX]), ids), n)
        available = b.ReduceSum(b.Cast(in_range, to=INT64), keepdims=1)  # [1]
        rows_out = n if active_num <= 0 else b.Min(n, b.ints([active_num]))
        filled = b.Min(rows_out, available)
        source_token = b.Div(b.Slice(order, b.ints([0]), rows_out), b.safe_divisor(top_k))
        row_token = b.Where(b.Less(b.arange(rows_out), filled), source_token, tokens)
        b.output("expanded_x", gathered_rows(b, "x", x_dtype, row_token, tokens))
        if node.attr("row_idx_type") == 0:
            position = b.ScatterElements(b.full(n, 0, "int64"), order, positions, axis=0)  # position[p] = d
            row_idx = b.Cast(b.Where(b.Less(position, available), position, b.ints([-1])), to=INT32)
        else:
            row_idx = b.Cast(order, to=INT32)
        in_range_ids = b.Compress(ids, in_range, axis=0)

    b.output("expanded_row_idx", row_idx)
    if node.attr("expert_tokens_num_flag"):
        b.output("expert_tokens_count_or_cumsum", expert_tokens(b, node, in_range_ids, start, end))
    if node.has("scale"):
        scale_or_zero = b.Concat("scale", b.full(b.ints([1]), 0.0, "float32"), axis=0)
        b.output("expanded_scale", b.Gather(scale_or_zero, row_token, axis=0))
    else:
        b.output("expanded_scale", b.full(b.Shape(row_token), 0.0, "float32"))
