"""MoeTokenPermuteWithRoutingMapGrad in standard ONNX ops (SPEC 1.4).

Not padded: ``sorted_indices [T*K]`` maps slot t*K + j -> row, so reshaped to ``[T, K]`` one
Gather gives each token's K row gradients and ReduceSum over K adds them (float32, rounded
once); ``probs_grad`` is ``permuted_probs_grad`` scattered (ScatterND) to the routed pairs.
Padded: ``sorted_indices [E*C]`` maps row -> token (negative: empty slot), so rows are added
into their token (ScatterND with reduction "add", in row order like the kernel; empty slots
into a spare row that is cut off), and so are the probs' gradients at (token, d // C).
"""

from __future__ import annotations

from .builder import INT64, Body, Specialisation
from .routing_map import (
    TOPK_ROWS_RULE,
    check_rows_multiple,
    check_token_or_empty,
    check_topk_rows,
    check_unread_map,
    expert_major_pairs,
    routing_mask,
    spare_for_empty,
    topk_rows_ok,
)

LOWERS = ("MoeTokenPermuteWithRoutingMapGrad",)


def _size(b: Body, node: Specialisation, attr: str, axis: int) -> str:
    """``[1]`` int64 T or E: the attribute, else routing_map's dim."""
    value = node.attr(attr)
    return b.ints([value]) if value is not None else b.dim("routing_map", axis)


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("permuted_tokens_grad")
    rows = b.dim("permuted_tokens_grad", 0)
    tokens = _size(b, node, "tokens_num", 0)
    index = b.Cast("sorted_indices", to=INT64)
    # the kernel checks the map (rows of exactly K ones) whenever probs come, wanted or not
    checks_map = node.has("permuted_probs_grad") and not node.attr("drop_and_pad")
    with_probs = node.has("permuted_probs_grad") and node.wants("probs_grad")
    if not checks_map:
        index = check_unread_map(b, node, index)
    if node.attr("drop_and_pad"):
        experts = _size(b, node, "experts_num", 1)
        index, capacity = check_rows_multiple(b, index, rows, experts, "padded: N must be a multiple of E")
        index = check_token_or_empty(b, index, tokens, "sorted_indices")
        token = spare_for_empty(b, index, tokens)
        b.output("tokens_grad", b.scatter_add_rows("permuted_tokens_grad", token, tokens, dtype))
        if with_probs:
            probs_dtype = node.dtype("permuted_probs_grad")
            expert = b.Div(b.arange(rows), b.safe_divisor(capacity))
            at = b.stack(token, expert)
            zeros = b.full(b.Concat(b.Add(tokens, b.ints([1])), experts, axis=0), 0.0, "float32")
            summed = b.ScatterND(zeros, at, b.widen("permuted_probs_grad", probs_dtype), reduction="add")
            b.output("probs_grad", b.narrow(b.Slice(summed, b.ints([0]), tokens), probs_dtype))
    else:
        index, top_k = check_rows_multiple(b, index, rows, tokens, "not padded: N must be a multiple of T")
        index = b.check_range(index, 0, rows, "sorted_indices values must be in [0, N)")
        if checks_map and not with_probs:  # probs_grad not wanted: the map's check gates the rows
            index = b.check(index, topk_rows_ok(b, routing_mask(b, node), rows, tokens), TOPK_ROWS_RULE)
        terms = b.Gather("permuted_tokens_grad", b.Reshape(index, b.Concat(tokens, top_k, axis=0)), axis=0)
        b.output("tokens_grad", b.sum_axis(terms, 1, dtype))
        if with_probs:
            mask = check_topk_rows(b, routing_mask(b, node), rows, tokens)
            zeros = b.full(b.Shape(mask), 0, node.dtype("permuted_probs_grad"))
            b.output("probs_grad", b.ScatterND(zeros, expert_major_pairs(b, mask), "permuted_probs_grad"))
