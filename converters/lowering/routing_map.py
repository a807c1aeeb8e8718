"""Pieces shared by the routing-map family's bodies (SPEC 1.4-1.6; see custom_ops/routing_map.py).

Notation as there: T tokens, E experts, K = N / T (not padded), C = N / E (padded), N rows.
Permuted rows are expert-major; ``pairs[d] = (token, expert)`` of row d when not padded. The
unpermute and its grad take tokens routed to fewer than K experts (seed 000): R <= N routed
pairs, -1 in the unused slots of ``sorted_indices``, rows R .. N-1 no pair's.
"""

from __future__ import annotations

from .builder import BOOL, INT64, Body, Specialisation


def routing_mask(b: Body, node: Specialisation, name: str = "routing_map") -> str:
    """``[T, E]`` bool; an int8 map is checked to hold only 0 and 1."""
    if node.dtype(name) == "bool":
        return name
    return b.check_mask(b.Cast(name, to=BOOL), int8_map_ok(b, name), f"int8 {name} must hold only 0 and 1")


def check_unread_map(b: Body, node: Specialisation, x: str, name: str = "routing_map") -> str:
    """``x`` gated by the int8 map check, for a body that does not read the map otherwise:
    the kernel checks a map it is given, needed or not."""
    if not node.has(name) or node.dtype(name) == "bool":
        return x
    return b.check(x, int8_map_ok(b, name), f"int8 {name} must hold only 0 and 1")


def int8_map_ok(b: Body, name: str) -> str:
    """``[1]`` bool: the int8 map ``name`` holds only 0 and 1."""
    zero, one = b.scalar(0, "int8"), b.scalar(1, "int8")
    return b.none_true(b.Not(b.Or(b.Equal(name, zero), b.Equal(name, one))))


TOPK_ROWS_RULE = "not padded, every routing_map row must hold exactly K = N / T ones"


def check_topk_rows(b: Body, mask: str, rows: str, tokens: str) -> str:
    """``mask`` checked: not padded, every token is routed to exactly K = N / T experts."""
    return b.check_mask(mask, topk_rows_ok(b, mask, rows, tokens), TOPK_ROWS_RULE)


def topk_rows_ok(b: Body, mask: str, rows: str, tokens: str) -> str:
    """``[1]`` bool: not padded, every token is routed to exactly K = N / T experts."""
    per_token = b.ReduceSum(b.Cast(mask, to=INT64), b.ints([1]), keepdims=0)
    top_k = b.Div(rows, b.safe_divisor(tokens))
    every_row = b.none_true(b.Not(b.Equal(per_token, top_k)))
    return b.And(every_row, b.Equal(b.Mul(top_k, tokens), rows))


def check_at_most_k_rows(b: Body, mask: str, top_k: str) -> str:
    """``mask`` checked: not padded, a token is routed to at most K experts (the unpermute
    family: fewer leave unused slots, seed 000). ``top_k`` ``[1]`` int64."""
    per_token = b.ReduceSum(b.Cast(mask, to=INT64), b.ints([1]), keepdims=0)
    rule = "not padded, a routing_map row may hold at most K = N / T ones"
    return b.check_mask(mask, b.none_true(b.Greater(per_token, top_k)), rule)


def expert_major_pairs(b: Body, mask: str) -> str:
    """``[R, 2]`` int64: ``(token, expert)`` of each of the R routed pairs, expert-major (row d of
    the permuted tokens; R = N when every token has K experts), i.e. ``nonzero(routing_map.T)``
    with its two rows swapped."""
    expert_token = b.NonZero(b.Transpose(mask, perm=[1, 0]))  # [2, R]: expert, token
    return b.Transpose(b.Gather(expert_token, b.ints([1, 0]), axis=0), perm=[1, 0])


def slot_rows(b: Body, mask: str) -> str:
    """``[N]`` int64 ``sorted_indices`` not padded: slot ``t*K + j`` -> row of token t's j-th
    expert (ascending). The row of pair (t, e) is the rows of experts before e plus the tokens
    before t routed to e; listing pairs token-major gives the slots in order."""
    routed = b.Cast(mask, to=INT64)
    before_in_expert = b.CumSum(routed, b.int64(0), exclusive=1)  # [T, E]
    expert_first_row = b.CumSum(b.ReduceSum(routed, b.ints([0]), keepdims=1), b.int64(1), exclusive=1)  # [1, E]
    row_of_pair = b.Add(before_in_expert, expert_first_row)
    return b.Compress(b.flat(row_of_pair), b.flat(mask), axis=0)


def check_rows_multiple(b: Body, x: str, rows: str, by: str, rule: str, mask: bool = False) -> tuple[str, str]:
    """``(x checked, rows / by)``: ``rows`` ``[1]`` must be a whole multiple of ``by`` ``[1]``
    (``rows == 0`` when ``by == 0``). ``x`` is int64, or bool with ``mask``."""
    quotient = b.Div(rows, b.safe_divisor(by))
    whole = b.Equal(b.Mul(quotient, by), rows)
    return (b.check_mask if mask else b.check)(x, whole, rule), quotient


def check_token_or_empty(b: Body, index: str, tokens: str, name: str) -> str:
    """``index`` (int64) checked: a negative (empty slot) or in ``[0, T)``."""
    too_big = b.GreaterOrEqual(index, tokens)
    return b.check(index, b.none_true(too_big), f"{name} values must be a negative (empty slot) or in [0, T)")


def spare_for_empty(b: Body, index: str, tokens: str) -> str:
    """``index`` with every negative (empty slot) replaced by T, the spare / zero row."""
    return b.Where(b.Less(index, b.ints([0])), tokens, index)


def check_unique_rows(b: Body, row: str, rows: str, rule: str) -> str:
    """``row [M]`` (int64 in ``[0, N]``, N = ``rows``: the spare of unused entries) checked to
    name no row of ``[0, N)`` twice."""
    spare = b.Add(rows, b.ints([1]))
    ones = b.full(b.Shape(row), 1, "int64")
    seen = b.ScatterElements(b.full(spare, 0, "int64"), row, ones, axis=0, reduction="add")
    return b.check(row, b.none_true(b.Greater(b.Slice(seen, b.ints([0]), rows), b.ints([1]))), rule)


def check_used_rows_routed(b: Body, x: str, used_rows: str, routed: str) -> str:
    """``x`` checked: every row in ``used_rows`` (int64, negative = none) is below ``routed``
    ``[1]``, the number of routed pairs; a row past them has no prob (seed 000)."""
    beyond = b.GreaterOrEqual(used_rows, routed)
    rule = "not padded with probs, a used slot must name a routed row (< the number of routing_map ones)"
    return b.check(x, b.none_true(beyond), rule)


def routed_row_probs(b: Body, node: Specialisation, pairs: str, rows: str) -> str:
    """``[N]`` (probs' dtype): the prob of each routed pair, expert-major, then zeros for the
    rows no pair routes (R .. N-1), as the kernel's ``permute_probs``."""
    dtype = node.dtype("probs")
    picked = b.GatherND("probs", pairs)
    return b.Concat(picked, b.full(b.Sub(rows, b.Shape(picked)), 0, dtype), axis=0)
