"""MoeTokenUnpermuteWithRoutingMapGrad in standard ONNX ops (SPEC 1.6).

The pairs ``(out_index[i], token of pair i)`` are turned into ``row_token [N]``, the token whose
gradient row d receives (ScatterElements; T, the zero row, where no pair fills d). The token of
pair i is ``permute_token_id[i]`` padded (negative: empty), ``i // K`` not padded (SPEC 1.6 as
amended: ``permute_token_id`` is not read, a negative ``out_index`` is an unused slot). Then

    no probs: permuted_tokens_grad = Gather(grad, row_token); with a zero row appended to the grad
              (a copy of it) only if some row is not filled (If)
    probs:    g = that gather in float32; permuted_tokens_grad = g * prob of row d (rounded once)
              row_dot[d] = sum_h g[d, h] * permuted_tokens[d, h]   (Mul + ReduceSum, float32)
              not padded: probs_grad = row_dot scattered to the expert-major routed pairs; a token
                          may have fewer than K (seed 000), rows past the R pairs must stay unfilled
              padded:     probs_grad[row_token[d], d // C] += row_dot[d]   (ScatterND "add")
"""

from __future__ import annotations

from .builder import INT64, Body, Specialisation
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
)

LOWERS = ("MoeTokenUnpermuteWithRoutingMapGrad",)


def row_tokens(b: Body, out_index: str, token_id: str, rows: str, tokens: str, padded: bool) -> str:
    """``[N]`` int64: ``row_token[out_index[i]] = token of pair i`` for filled pairs, T elsewhere.
    Padded, the token is ``token_id[i]`` (checked here; filled: >= 0); not padded it is
    ``i // K`` with ``K = N / T`` and a pair is filled when ``out_index[i] >= 0`` (``token_id``
    unused). Inputs int64."""
    if padded:
        token_id = check_token_or_empty(b, token_id, tokens, "permute_token_id")
        filled = b.GreaterOrEqual(token_id, b.ints([0]))
    else:
        token_id = b.Div(b.arange(rows), b.safe_divisor(b.Div(rows, b.safe_divisor(tokens))))
        filled = b.GreaterOrEqual(out_index, b.ints([0]))
    outside = b.And(filled, b.Or(b.Less(out_index, b.ints([0])), b.GreaterOrEqual(out_index, rows)))
    out_index = b.check(out_index, b.none_true(outside), "out_index values of filled pairs must be in [0, N)")
    row = b.Where(filled, out_index, rows)  # unfilled pairs write a spare slot N
    row = check_unique_rows(b, row, rows, "out_index must not repeat a row")
    row_token = b.ScatterElements(b.Expand(tokens, b.Add(rows, b.ints([1]))), row, token_id, axis=0)
    return b.Slice(row_token, b.ints([0]), rows)


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("unpermuted_tokens_grad")
    tokens = b.dim("unpermuted_tokens_grad", 0)
    rows = b.dim("out_index", 0)
    padded = node.attr("drop_and_pad") == 1
    out_index = b.Cast("out_index", to=INT64)
    token_id = b.Cast("permute_token_id", to=INT64) if padded else ""
    row_token = row_tokens(b, out_index, token_id, rows, tokens, padded)
    if not node.has("probs"):
        row_token = check_unread_map(b, node, row_token)
        every_row_filled = b.none_true(b.Equal(row_token, tokens))
        grad = b.gather_or_zero_rows("unpermuted_tokens_grad", row_token, dtype, 2, every_row_filled)
        b.output("permuted_tokens_grad", grad)
        return

    probs_dtype = node.dtype("probs")
    mask = routing_mask(b, node)
    if node.attr("drop_and_pad"):
        experts = b.dim(mask, 1)
        mask, capacity = check_rows_multiple(b, mask, rows, experts, "padded: N must be a multiple of E", mask=True)
        expert = b.Div(b.arange(rows), b.safe_divisor(capacity))
        at = b.stack(row_token, expert)  # (T, e) for empty rows: the zero row of probs
        row_probs = b.GatherND(b.zero_row_below("probs", probs_dtype), at)
    else:
        mask, top_k = check_rows_multiple(b, mask, rows, tokens, "not padded: N must be a multiple of T", mask=True)
        pairs = expert_major_pairs(b, check_at_most_k_rows(b, mask, top_k))
        routed = b.dim(pairs, 0)
        filled_rows = b.Where(b.Equal(row_token, tokens), b.ints([-1]), b.arange(rows))
        row_token = check_used_rows_routed(b, row_token, filled_rows, routed)
        row_probs = routed_row_probs(b, node, pairs, rows)  # [N]: 0 past the R routed pairs
    # rows no pair fills are +0.0 and so is their dot, as in the kernel (not -0.0, nor inf * 0)
    empty = b.Equal(row_token, tokens)
    zero = b.scalar(0.0, "float32")
    factor = b.Where(empty, zero, b.widen(row_probs, probs_dtype))
    grad = b.zero_row_below(b.widen("unpermuted_tokens_grad", dtype), "float32")
    g = b.Gather(grad, row_token, axis=0)  # [N, H] float32
    b.output("permuted_tokens_grad", b.narrow(b.Mul(g, b.Unsqueeze(factor, b.ints([1]))), dtype))
    if not node.wants("probs_grad"):
        return
    row_dot = b.ReduceSum(b.Mul(g, b.widen("permuted_tokens", dtype)), b.ints([1]), keepdims=0)
    row_dot = b.Where(empty, zero, row_dot)
    if node.attr("drop_and_pad"):
        zeros = b.full(b.Concat(b.Add(tokens, b.ints([1])), experts, axis=0), 0.0, "float32")
        summed = b.ScatterND(zeros, at, row_dot, reduction="add")
        b.output("probs_grad", b.narrow(b.Slice(summed, b.ints([0]), tokens), probs_dtype))
    else:
        zeros = b.full(b.Shape(mask), 0, probs_dtype)
        routed_dot = b.Slice(row_dot, b.ints([0]), routed)  # rows past the pairs are unfilled: 0
        b.output("probs_grad", b.ScatterND(zeros, pairs, b.narrow(routed_dot, probs_dtype)))
