"""MoeTokenUnpermuteWithRoutingMap in standard ONNX ops (SPEC 1.5).

Not padded: ``sorted_indices [T*K]`` (slot -> row, a permutation) reshaped to ``[T, K]``
gathers each token's K rows; without probs ReduceSum over K adds them, with probs a batched
MatMul ``[T, 1, K] x [T, K, H]`` weights and adds them in one pass (float32; MatMul may fuse
multiply and add, a difference within float32 accumulation error). ``permute_probs`` is
``probs`` at the expert-major routed pairs.

Padded: ``sorted_indices [E*C]`` maps row -> token (negative: empty slot). The index pairs are
a stable sort by token (TopK on ``token*N + row``); the rows, scaled by
``probs[token, row // C]``, are added into their token by ScatterND (reduction "add", row
order, as the kernel adds them).
"""

from __future__ import annotations

from .builder import FLOAT, INT32, INT64, Body, Specialisation
from .moe_init_routing_v2 import stable_order
from .routing_map import (
    check_permutation,
    check_rows_multiple,
    check_token_or_empty,
    check_topk_rows,
    expert_major_pairs,
    routing_mask,
    spare_for_empty,
)

LOWERS = ("MoeTokenUnpermuteWithRoutingMap",)


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("permuted_tokens")
    restore = node.attr("restore_shape")
    tokens = b.ints([restore[0]]) if restore is not None else b.dim("routing_map", 0)
    rows = b.dim("permuted_tokens", 0)
    index = b.Cast("sorted_indices", to=INT64)
    with_probs = node.has("probs")
    mask = routing_mask(b, node) if with_probs else ""  # (read only with probs)
    if node.attr("padded_mode"):
        index = check_token_or_empty(b, index, tokens, "sorted_indices")
        order = stable_order(b, index, rows)
        b.output("out_index", b.Cast(order, to=INT32))
        b.output("permute_token_id", b.Cast(b.Gather(index, order, axis=0), to=INT32))
        token = spare_for_empty(b, index, tokens)
        terms = b.widen("permuted_tokens", dtype)
        if with_probs:
            experts = b.dim(mask, 1)
            mask, capacity = check_rows_multiple(b, mask, rows, experts, "padded: N must be a multiple of E", mask=True)
            expert = b.Div(b.arange(rows), b.safe_divisor(capacity))
            row_probs = b.GatherND(b.zero_row_below("probs", node.dtype("probs")), b.stack(token, expert))
            if node.wants("permute_probs"):
                b.output("permute_probs", row_probs)
            terms = b.Mul(terms, b.Unsqueeze(b.widen(row_probs, node.dtype("probs")), b.ints([1])))
        b.output("unpermuted_tokens", b.narrow(b.scatter_add_rows(terms, token, tokens), dtype))
    else:
        index, top_k = check_rows_multiple(b, index, rows, tokens, "not padded: N must be a multiple of T")
        index = check_permutation(b, index, rows, "sorted_indices (not padded)")
        b.output("out_index", "sorted_indices")
        slots = b.Div(b.arange(rows), b.safe_divisor(top_k))
        b.output("permute_token_id", b.Cast(slots, to=INT32))
        by_token = b.Reshape(index, b.Concat(tokens, top_k, axis=0))
        terms = b.Gather("permuted_tokens", by_token, axis=0)  # [T, K, H]
        if with_probs:
            mask = check_topk_rows(b, mask, rows, tokens)
            row_probs = b.GatherND("probs", expert_major_pairs(b, mask))
            if node.wants("permute_probs"):
                b.output("permute_probs", row_probs)
            weights = b.Gather(b.Cast(row_probs, to=FLOAT), b.Unsqueeze(by_token, b.ints([1])), axis=0)  # [T, 1, K]
            summed = b.MatMul(weights, b.widen(terms, dtype))  # [T, 1, H]
            b.output("unpermuted_tokens", b.narrow(b.Squeeze(summed, b.ints([1])), dtype))
        else:
            b.output("unpermuted_tokens", b.sum_axis(terms, 1, dtype))
