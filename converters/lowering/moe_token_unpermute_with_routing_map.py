"""MoeTokenUnpermuteWithRoutingMap in standard ONNX ops (SPEC 1.5).

Not padded: ``sorted_indices [T*K]`` maps slot -> row; a negative is an unused slot (a token
routed to fewer than K experts, seed 000), -1 in both index outputs and skipped in the sum.
Reshaped to ``[T, K]`` it gathers each token's K rows, an unused slot reading a zero row
appended below the rows (only when some slot is unused: the append copies them). Without
probs ReduceSum over K adds them; with probs a batched MatMul ``[T, 1, K] x [T, K, H]`` weights
and adds them in one pass (float32; MatMul may fuse multiply and add, a difference within
float32 accumulation error), an unused slot weighing 0. ``permute_probs`` is ``probs`` at the
expert-major routed pairs, then 0 for the rows past them.

Padded: ``sorted_indices [E*C]`` maps row -> token (negative: empty slot). The index pairs are
a stable sort by token (TopK on ``token*N + row``); the rows, scaled by
``probs[token, row // C]``, are added into their token by ScatterND (reduction "add", row
order, as the kernel adds them).
"""

from __future__ import annotations

from .builder import FLOAT, INT32, INT64, Body, Specialisation
from .moe_init_routing_v2 import stable_order
from .routing_map import (
    check_at_most_k_rows,
    check_rows_multiple,
    check_token_or_empty,
    check_unique_rows,
    check_unread_map,
    check_used_rows_routed,
    expert_major_pairs,
    routed_row_probs,
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
    if not with_probs:
        index = check_unread_map(b, node, index)
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
        return

    index, top_k = check_rows_multiple(b, index, rows, tokens, "not padded: N must be a multiple of T")
    index = b.check(
        index,
        b.none_true(b.GreaterOrEqual(index, rows)),
        "sorted_indices (not padded) values must be a negative (unused slot) or in [0, N)",
    )
    used = b.GreaterOrEqual(index, b.ints([0]))
    row = b.Where(used, index, rows)  # an unused slot reads row N, a zero row
    row = check_unique_rows(b, row, rows, "sorted_indices (not padded) must not repeat a row")
    if with_probs:
        mask = check_at_most_k_rows(b, mask, top_k)
        pairs = expert_major_pairs(b, mask)
        row = check_used_rows_routed(b, row, index, b.dim(pairs, 0))
        row_probs = routed_row_probs(b, node, pairs, rows)  # [N]
        if node.wants("permute_probs"):
            b.output("permute_probs", row_probs)
    unused = b.ints([-1])
    b.output("out_index", b.Cast(b.Where(used, row, unused), to=INT32))
    slots = b.Div(b.arange(rows), b.safe_divisor(top_k))
    b.output("permute_token_id", b.Cast(b.Where(used, slots, unused), to=INT32))
    by_token = b.Reshape(row, b.Concat(tokens, top_k, axis=0))
    every_slot_used = b.none_true(b.Not(used))
    terms = b.gather_or_zero_rows("permuted_tokens", by_token, dtype, 3, every_slot_used)  # [T, K, H]
    if with_probs:
        weights = b.Gather(b.zero_row_below(b.Cast(row_probs, to=FLOAT), "float32"), b.Unsqueeze(by_token, b.ints([1])))
        summed = b.MatMul(weights, b.widen(terms, dtype))  # [T, 1, K] x [T, K, H]
        b.output("unpermuted_tokens", b.narrow(b.Squeeze(summed, b.ints([1])), dtype))
    else:
        b.output("unpermuted_tokens", b.sum_axis(terms, 1, dtype))
