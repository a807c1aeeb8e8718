"""MoeTokenPermuteWithRoutingMapGrad: the backward of MoeTokenPermuteWithRoutingMap.

SPEC 1.4. Every permuted row is a copy of one token (and one prob), so the gradient of a
token is the sum of the gradients of the rows that copied it, and the gradient of a prob is
the gradient of the one permuted prob that copied it. With N rows, ``sorted_indices`` as the
forward returned it, and ``(out_index, permute_token_id)`` the pairs of SPEC 1.5::

    tokens_grad[t] = sum of permuted_tokens_grad[out_index[i]] over i with permute_token_id[i] == t
        not padded: the K rows sorted_indices[t*K .. t*K+K-1]
        padded:     every row d with sorted_indices[d] == t (negative: empty slot, skipped)
    probs_grad = zeros [T, E], then
        not padded: probs_grad.T[routing_map.T] = permuted_probs_grad      (masked scatter)
        padded:     probs_grad[sorted_indices[d], d // C] = permuted_probs_grad[d]

Inputs and attributes follow aclnnMoeTokenPermuteWithRoutingMapGrad: T and E come from
``tokens_num`` / ``experts_num`` or, when those are absent, from ``routing_map``'s shape.
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
    require_input,
    require_probs_dtype,
    require_range,
    require_shape,
    require_topk_rows,
    routing_mask,
    scatter_token_expert,
    slots_per_token,
    sum_rows_by_token,
)
from .targets import Target, known_dim, ratio, top_k_rules


def moe_token_permute_with_routing_map_grad(
    permuted_tokens_grad,
    permuted_probs_grad,
    sorted_indices,
    routing_map=None,
    *,
    experts_num=None,
    tokens_num=None,
    drop_and_pad=0,
):
    """Gradients of tokens and probs from those of the permuted rows.

    Args:
        permuted_tokens_grad: ``[N, H]`` float32/float16/bfloat16.
        permuted_probs_grad: optional ``[N]``, the dtype above or float32 with bfloat16.
        sorted_indices: ``[N]`` int32 from the forward (not padded: slot -> row; padded:
            row -> token, negative = empty slot).
        routing_map: optional ``[T, E]`` bool / int8 0-1; needed for probs not padded.
        experts_num, tokens_num: E and T (default: routing_map's shape).
        drop_and_pad: 0 / 1 as in the forward.
    Returns:
        ``tokens_grad [T, H]`` (dtype of permuted_tokens_grad, float32 sums rounded to
        nearest even), ``probs_grad [T, E]`` (dtype of permuted_probs_grad) or None.
    """
    n_rows = len(sorted_indices)
    n_tokens = tokens_num if tokens_num is not None else routing_map.shape[0]
    n_experts = experts_num if experts_num is not None else (None if routing_map is None else routing_map.shape[1])
    mask = None if routing_map is None else routing_mask(routing_map)
    if drop_and_pad:
        require_range("sorted_indices", sorted_indices, n_tokens, negative_is_empty=True)
        top_k = 0
    else:
        require_range("sorted_indices", sorted_indices, n_rows)
        top_k = n_rows // n_tokens if n_tokens else 0
    out_index, token_id = index_pairs(sorted_indices, drop_and_pad, top_k)
    tokens_grad = sum_rows_by_token(permuted_tokens_grad, out_index, token_id, n_tokens)
    if permuted_probs_grad is None:
        return tokens_grad, None
    assert n_experts is not None  # infer requires E (experts_num or routing_map) with probs
    if drop_and_pad:
        capacity = n_rows // n_experts if n_experts else 0
        expert = np.arange(n_rows) // max(capacity, 1)
        probs_grad = scatter_token_expert(
            permuted_probs_grad, sorted_indices, expert, n_tokens, n_experts, permuted_probs_grad.dtype
        )
    else:
        assert mask is not None  # infer requires routing_map with probs when not padded
        require_topk_rows(mask, top_k)
        probs_grad = np.zeros((n_tokens, n_experts), permuted_probs_grad.dtype)
        probs_grad.T[mask.T] = permuted_probs_grad
    return tokens_grad, probs_grad


def _size(sig: Signature, attr: str, axis: int, letter: str, needed: bool):
    """T or E from its attribute, else from routing_map; both must agree."""
    value, from_map = sig.attr(attr), sig.dim("routing_map", axis)
    if value is not None:
        sig.require(value >= 0, f"{attr} must be >= 0, got {value}")
        sig.same(from_map, value, f"routing_map dim {axis} must equal {attr}")
        return value
    if sig.has("routing_map"):
        return from_map
    sig.require(not needed, f"attribute {attr} or input routing_map is required to know {letter}", MISSING_INPUT)
    return None


def _infer(sig: Signature) -> None:
    grad = sig.input("permuted_tokens_grad")
    rows, hidden = sig.dim("permuted_tokens_grad", 0), sig.dim("permuted_tokens_grad", 1)
    padded = sig.attr("drop_and_pad")
    has_probs = sig.has("permuted_probs_grad")
    sig.same(sig.dim("sorted_indices", 0), rows, "sorted_indices must be [N]: N = permuted_tokens_grad dim 0")
    require_shape(sig, "permuted_probs_grad", (rows,), "[N] like permuted_tokens_grad's rows")
    require_probs_dtype(sig, "permuted_probs_grad", "permuted_tokens_grad")
    n_tokens = _size(sig, "tokens_num", 0, "T", needed=True)
    n_experts = _size(sig, "experts_num", 1, "E", needed=padded or has_probs)
    if padded:
        experts_capacity(sig, rows, n_experts, "permuted_tokens_grad dim 0")
    else:
        slots_per_token(sig, rows, n_tokens, n_experts, "permuted_tokens_grad dim 0")
        if has_probs:
            require_input(sig, "routing_map", "to scatter permuted_probs_grad back when not padded")
    sig.output("tokens_grad", grad.dtype, (n_tokens, hidden))
    if optional_output(sig, "probs_grad", "permuted_probs_grad"):
        sig.output("probs_grad", sig.input("permuted_probs_grad").dtype, (n_tokens, n_experts))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    if sig.attr("drop_and_pad"):
        return []
    n_tokens = sig.attr("tokens_num")
    if n_tokens is None:
        n_tokens = known_dim(sig, "routing_map", 0)
    return top_k_rules(ratio(known_dim(sig, "sorted_indices", 0), n_tokens), None, "not padded")


#: the gradient of 6 permuted rows summed back onto their 3 tokens
_EXAMPLE = Example(
    inputs={
        "permuted_tokens_grad": np.arange(12, dtype=np.float32).reshape(6, 2),
        "sorted_indices": np.array([0, 3, 1, 2, 4, 5], np.int32),
        "routing_map": np.array([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]], bool),
    },
    attrs={"experts_num": 4, "tokens_num": 3},
)


MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD = OpDef(
    "MoeTokenPermuteWithRoutingMapGrad",
    __doc__,
    inputs=[
        Input("permuted_tokens_grad", TOKEN_DTYPES, "[N, H] gradient of permuted_tokens", (2,)),
        Input("permuted_probs_grad", TOKEN_DTYPES, "[N] gradient of permuted_probs", (1,), optional=True),
        Input("sorted_indices", INDEX_DTYPES, "[N] the forward's sorted_indices", (1,)),
        Input("routing_map", MAP_DTYPES, "[T, E] the forward's routing_map", (2,), optional=True),
    ],
    outputs=[
        Output("tokens_grad", TOKEN_DTYPES, "[T, H] gradient of tokens"),
        Output("probs_grad", TOKEN_DTYPES, "[T, E] gradient of probs (iff permuted_probs_grad)", optional=True),
    ],
    attrs=[
        Attr("experts_num", "int", None, "E (default: routing_map dim 1)"),
        Attr("tokens_num", "int", None, "T (default: routing_map dim 0)"),
        Attr("drop_and_pad", "int", 0, "0 / 1 as in the forward", PADDING),
    ],
    infer=_infer,
    kernel=moe_token_permute_with_routing_map_grad,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD]
