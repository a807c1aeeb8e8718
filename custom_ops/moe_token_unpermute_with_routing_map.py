"""MoeTokenUnpermuteWithRoutingMap: sum the permuted rows of each token back into one row.

SPEC 1.5, with N permuted rows, T tokens (``restore_shape[0]``, else routing_map dim 0).
The pairs ``(out_index, permute_token_id)`` say "row out_index[i] belongs to token
permute_token_id[i]", sorted by token; they are outputs because the grad consumes them::

    not padded: out_index = sorted_indices (slot t*K + j -> row); permute_token_id[p] = p // K
    padded:     permute_token_id, out_index = sort(sorted_indices)   (values, positions; stable)
                sorted_indices[d] = token of row d; negative = empty slot, skipped
    permute_probs[d] = prob of row d:
        not padded: probs.T[routing_map.T]        (expert-major, like the permuted rows)
        padded:     probs[sorted_indices[d], d // C], C = N / E (0 for an empty slot)
    unpermuted_tokens[permute_token_id[i]] += permute_probs[out_index[i]] * permuted_tokens[out_index[i]]

The factor is 1 without probs. Sums run in float32 and are rounded to nearest even.
"""

from __future__ import annotations

import numpy as np

from .errors import MISSING_INPUT
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .routing_map import (
    INDEX_DTYPES,
    MAP_DTYPES,
    PADDING,
    TOKEN_DTYPES,
    experts_capacity,
    index_pairs,
    optional_output,
    padded_row_probs,
    require_input,
    require_probs_dtype,
    require_range,
    require_shape,
    require_unique,
    routed_row_probs,
    routing_mask,
    slots_per_token,
    sum_rows_by_token,
)
from .targets import Target, known_dim, ratio, top_k_rules


def moe_token_unpermute_with_routing_map(
    permuted_tokens, sorted_indices, routing_map=None, probs=None, *, padded_mode=0, restore_shape=None
):
    """Sum each token's permuted rows, weighted by their probs, into ``[T, H]``.

    Args:
        permuted_tokens: ``[N, H]`` float32/float16/bfloat16.
        sorted_indices: ``[N]`` int32 from the permute (not padded: slot ``t*K + j`` -> row,
            negative = unused slot of a token routed to fewer than K experts, the used ones
            distinct in ``[0, N)``; padded: row -> token, negative = empty slot).
        routing_map: optional ``[T, E]`` bool / int8 0-1; required with probs.
        probs: optional ``[T, E]``, tokens' dtype or float32 with bfloat16 tokens.
        padded_mode: 0 / 1 as the permute's drop_and_pad.
        restore_shape: optional ``[T, H]``.
    Returns:
        ``unpermuted_tokens [T, H]`` (permuted_tokens' dtype), ``out_index [N]`` int32,
        ``permute_token_id [N]`` int32, ``permute_probs [N]`` (probs' dtype) or None.
    """
    n_rows = len(sorted_indices)
    n_tokens = restore_shape[0] if restore_shape else routing_map.shape[0]
    mask = None if routing_map is None else routing_mask(routing_map)
    row_probs = None
    if padded_mode:
        require_range("sorted_indices", sorted_indices, n_tokens, negative_is_empty=True)
        out_index, token_id = index_pairs(sorted_indices, True, 0)
        if probs is not None:
            assert mask is not None  # infer requires routing_map with probs
            capacity = n_rows // mask.shape[1] if mask.shape[1] else 0
            row_probs = padded_row_probs(probs, sorted_indices, capacity)
    else:
        top_k = n_rows // n_tokens if n_tokens else 0
        require_range("sorted_indices", sorted_indices, n_rows, negative_is_empty=True)  # < 0: unused slot
        used_rows = sorted_indices[sorted_indices >= 0]
        require_unique("sorted_indices (not padded)", used_rows, n_rows)
        out_index, token_id = index_pairs(sorted_indices, False, top_k)
        if probs is not None:
            assert mask is not None  # infer requires routing_map with probs
            row_probs = routed_row_probs(probs, mask, top_k, used_rows, n_rows)
    unpermuted = sum_rows_by_token(permuted_tokens, out_index, token_id, n_tokens, weights=row_probs)
    return unpermuted, out_index, token_id, row_probs


def _infer(sig: Signature) -> None:
    permuted = sig.input("permuted_tokens")
    rows, hidden = sig.dim("permuted_tokens", 0), sig.dim("permuted_tokens", 1)
    n_tokens, n_experts = sig.dim("routing_map", 0), sig.dim("routing_map", 1)
    sig.same(sig.dim("sorted_indices", 0), rows, "sorted_indices must be [N]: N = permuted_tokens dim 0")
    if sig.has("probs"):
        require_input(sig, "routing_map", "with probs (it says which prob goes with which row)")
    require_shape(sig, "probs", (n_tokens, n_experts), "[T, E] like routing_map")
    require_probs_dtype(sig, "probs", "permuted_tokens")
    restore = sig.attr("restore_shape")
    if restore is not None:
        sig.require(
            len(restore) == 2 and min(restore) >= 0, f"restore_shape must be [T, H] with T, H >= 0, got {list(restore)}"
        )
        sig.same(restore[1], hidden, "restore_shape[1] must equal H = permuted_tokens dim 1")
        sig.same(n_tokens, restore[0], "routing_map dim 0 must equal T = restore_shape[0]")
        n_tokens = restore[0]
    else:
        sig.require(
            sig.has("routing_map"), "attribute restore_shape or input routing_map is required to know T", MISSING_INPUT
        )
    if sig.attr("padded_mode"):
        experts_capacity(sig, rows, n_experts, "permuted_tokens dim 0", "E = routing_map dim 1")
    else:
        slots_per_token(sig, rows, n_tokens, n_experts, "permuted_tokens dim 0")
    sig.output("unpermuted_tokens", permuted.dtype, (n_tokens, hidden))
    sig.output("out_index", "int32", (rows,))
    sig.output("permute_token_id", "int32", (rows,))
    if optional_output(sig, "permute_probs", "probs"):
        sig.output("permute_probs", sig.input("probs").dtype, (rows,))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    rows, n_experts = known_dim(sig, "sorted_indices", 0), known_dim(sig, "routing_map", 1)
    restore = sig.attr("restore_shape")
    n_tokens = restore[0] if restore else known_dim(sig, "routing_map", 0)
    if not sig.attr("padded_mode"):
        return top_k_rules(ratio(rows, n_tokens), n_experts, "not padded")
    capacity = ratio(rows, n_experts)
    if capacity is not None and n_tokens is not None and capacity > n_tokens:
        return [f"capacity C = {capacity} exceeds T = {n_tokens} (padded)"]
    return []


#: 6 expert rows combined back into 3 tokens, weighted by probs
_EXAMPLE = Example(
    inputs={
        "permuted_tokens": np.arange(12, dtype=np.float32).reshape(6, 2),
        "sorted_indices": np.array([0, 3, 1, 2, 4, 5], np.int32),
        "routing_map": np.array([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]], bool),
        "probs": np.array([[0.75, 0, 0.25, 0], [0.5, 0.5, 0, 0], [0, 0, 0.625, 0.375]], np.float32),
    },
    attrs={"restore_shape": [3, 2]},
)


MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP = OpDef(
    "MoeTokenUnpermuteWithRoutingMap",
    __doc__,
    inputs=[
        Input("permuted_tokens", TOKEN_DTYPES, "[N, H] permuted rows", (2,)),
        Input("sorted_indices", INDEX_DTYPES, "[N] the permute's sorted_indices", (1,)),
        Input("routing_map", MAP_DTYPES, "[T, E] the permute's routing_map (required with probs)", (2,), optional=True),
        Input("probs", TOKEN_DTYPES, "[T, E] weight of each (token, expert)", (2,), optional=True),
    ],
    outputs=[
        Output("unpermuted_tokens", TOKEN_DTYPES, "[T, H] weighted sum of each token's rows"),
        Output("out_index", ("int32",), "[N] row of pair i (pairs sorted by token)"),
        Output("permute_token_id", ("int32",), "[N] token of pair i (negative: empty slot)"),
        Output("permute_probs", TOKEN_DTYPES, "[N] prob of each permuted row (iff probs)", optional=True),
    ],
    attrs=[
        Attr("padded_mode", "int", 0, "0 / 1 as the permute's drop_and_pad", PADDING),
        Attr("restore_shape", "ints", None, "[T, H] of unpermuted_tokens (default: T from routing_map)"),
    ],
    infer=_infer,
    kernel=moe_token_unpermute_with_routing_map,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP]
