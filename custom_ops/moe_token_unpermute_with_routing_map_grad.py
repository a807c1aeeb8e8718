"""MoeTokenUnpermuteWithRoutingMapGrad: the backward of MoeTokenUnpermuteWithRoutingMap.

SPEC 1.6 (seeds 000, 002), as amended to what the NPU kernel and torch_npu do. Row
``out_index[i]`` takes the gradient of the token of pair i (zero rows elsewhere)::

    padded:     token = permute_token_id[i]   (negative: empty slot, skipped)
    not padded: token = i // K                (out_index[i] < 0: unused slot, skipped)
    g_perm[out_index[i]] = unpermuted_tokens_grad[token]
    no probs:  permuted_tokens_grad = g_perm

Not padded, ``permute_token_id`` is not read (only its shape is checked): torch_npu's own
backward of the unpermute (op-plugin ``derivatives.yaml``) and MindSpeed's
``MoeUnpermuteMaskMap`` pass ``sorted_indices`` there, and the kernel
(``moe_token_unpermute_with_routing_map_grad_prob_none_drop_pad_false.h``: ``tokenId = i / topK``)
reads only ``out_index``. The forward's own pairs give the same result: its
``permute_token_id[i]`` is ``i // K`` (-1 where ``out_index`` is -1).

    probs:     row_dot[d] = sum_h g_perm[d, h] * permuted_tokens[d, h]       (float32)
               permuted_tokens_grad[d] = permute_probs[d] * g_perm[d]
      not padded: permute_probs = probs.T[routing_map.T]
                  probs_grad = zeros [T, E]; probs_grad.T[routing_map.T] = row_dot
      padded:     permute_probs[d] = probs[token of d, d // C], C = N / E
                  probs_grad[token of d, d // C] = row_dot[d]

K = N / T (not padded) and C = N / E (padded). bfloat16 tokens may come with float32 probs;
probs_grad has the dtype of probs. Computed in float32, rounded to nearest even.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .routing_map import (
    INDEX_DTYPES,
    MAP_DTYPES,
    PADDING,
    TOKEN_DTYPES,
    experts_capacity,
    optional_output,
    padded_row_probs,
    require_input,
    require_probs_dtype,
    require_range,
    require_same_dtype,
    require_shape,
    require_unique,
    routed_row_probs,
    routing_mask,
    scaled_gather,
    scatter_token_expert,
    slots_per_token,
)
from .targets import Target, align32, itemsize, known_dim, ratio, top_k_rules


def moe_token_unpermute_with_routing_map_grad(
    unpermuted_tokens_grad,
    out_index,
    permute_token_id,
    routing_map=None,
    permuted_tokens=None,
    probs=None,
    *,
    drop_and_pad=0,
    restore_shape=None,
):
    """Gradients of the permuted rows and of probs from that of the unpermuted tokens.

    Args:
        unpermuted_tokens_grad: ``[T, H]`` float32/float16/bfloat16.
        out_index: ``[N]`` int32, pair i's permuted row (``N = T*K`` not padded, ``E*C``
            padded); not padded, negative = an unused slot.
        permute_token_id: ``[N]`` int32, pair i's token when padded (negative: empty slot);
            not read when not padded (the token is i // K).
        routing_map: ``[T, E]`` bool / int8 0-1, required with probs.
        permuted_tokens: ``[N, H]`` the forward's input, required with probs.
        probs: optional ``[T, E]``, the grad's dtype or float32 with a bfloat16 grad.
        drop_and_pad: 0 / 1 as the forward's padded_mode.
        restore_shape: optional ``[T, H]``, checked against the grad's shape.
    Returns:
        ``permuted_tokens_grad [N, H]`` (the grad's dtype), ``probs_grad [T, E]`` (probs'
        dtype) or None.
    """
    n_tokens = unpermuted_tokens_grad.shape[0]
    n_rows = len(out_index)
    if drop_and_pad:
        require_range("permute_token_id", permute_token_id, n_tokens, negative_is_empty=True)
        filled = permute_token_id >= 0
        pair_token = permute_token_id
    else:
        top_k = n_rows // n_tokens if n_tokens else 1  # infer: N is a whole multiple of T
        filled = out_index >= 0
        pair_token = np.arange(n_rows) // top_k
    rows = out_index[filled]
    require_range("out_index", rows, n_rows)
    require_unique("out_index", rows, n_rows)
    row_token = np.full(n_rows, -1, np.intp)  # token whose gradient row d receives
    row_token[rows] = pair_token[filled]
    mask = None if routing_map is None else routing_mask(routing_map)
    if probs is None:
        # source-major: each token's gradient row is read once for its K rows
        grad = fused.copy_rows_to(unpermuted_tokens_grad, *fused.destinations_by_source(row_token, n_tokens), n_rows)
        grad[row_token < 0] = 0  # slots no token filled
        return grad, None

    assert mask is not None  # infer requires routing_map with probs
    n_experts = mask.shape[1]
    if drop_and_pad:
        capacity = n_rows // n_experts if n_experts else 0
        row_probs = padded_row_probs(probs, row_token, capacity)
    else:
        row_probs = routed_row_probs(probs, mask, n_rows // n_tokens if n_tokens else 0, rows, n_rows)
    permuted_tokens_grad, row_dot = scaled_gather(unpermuted_tokens_grad, row_token, row_probs, permuted_tokens)
    if drop_and_pad:
        expert = np.arange(n_rows) // max(capacity, 1)
        probs_grad = scatter_token_expert(row_dot, row_token, expert, n_tokens, n_experts, probs.dtype)
    else:
        probs_grad = np.zeros((n_tokens, n_experts), probs.dtype)
        probs_grad.T[mask.T] = row_dot[: np.count_nonzero(mask)]  # the routed rows; rounds to nearest even
    return permuted_tokens_grad, probs_grad


def _infer(sig: Signature) -> None:
    grad = sig.input("unpermuted_tokens_grad")
    n_tokens, hidden = sig.dim("unpermuted_tokens_grad", 0), sig.dim("unpermuted_tokens_grad", 1)
    rows = sig.dim("out_index", 0)
    n_experts = sig.dim("routing_map", 1)
    sig.same(sig.dim("permute_token_id", 0), rows, "permute_token_id must have out_index's shape [N]")
    if sig.has("probs"):
        require_input(sig, "routing_map", "with probs (it says which prob goes with which row)")
        require_input(sig, "permuted_tokens", "with probs (probs_grad is a dot with its rows)")
    require_shape(sig, "routing_map", (n_tokens,), "[T, E]: T = unpermuted_tokens_grad dim 0")
    require_shape(sig, "probs", (n_tokens, n_experts), "[T, E] like routing_map")
    require_shape(
        sig, "permuted_tokens", (rows, hidden), "[N, H]: N = len(out_index), H = unpermuted_tokens_grad dim 1"
    )
    require_same_dtype(sig, "permuted_tokens", "unpermuted_tokens_grad")
    require_probs_dtype(sig, "probs", "unpermuted_tokens_grad")
    restore = sig.attr("restore_shape")
    if restore is not None:
        sig.require(len(restore) == 2, f"restore_shape must be [T, H], got {list(restore)}")
        sig.same(restore[0], n_tokens, "restore_shape[0] must equal T = unpermuted_tokens_grad dim 0")
        sig.same(restore[1], hidden, "restore_shape[1] must equal H = unpermuted_tokens_grad dim 1")
    if sig.attr("drop_and_pad"):
        if sig.has("probs"):
            experts_capacity(sig, rows, n_experts, "len(out_index)", "E = routing_map dim 1")
    else:
        slots_per_token(
            sig,
            rows,
            n_tokens,
            n_experts,
            "len(out_index)",
            "T = unpermuted_tokens_grad dim 0",
            limit_by_experts=sig.has("probs"),
        )
    sig.output("permuted_tokens_grad", grad.dtype, (rows, hidden))
    if optional_output(sig, "probs_grad", "probs"):
        sig.output("probs_grad", sig.input("probs").dtype, (n_tokens, n_experts))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    """Seed 000's tiling limits; they apply only with probs."""
    if not sig.has("probs"):
        return []
    n_tokens, hidden = known_dim(sig, "unpermuted_tokens_grad", 0), known_dim(sig, "unpermuted_tokens_grad", 1)
    rows, n_experts = known_dim(sig, "out_index", 0), known_dim(sig, "routing_map", 1)
    token_len, prob_len = itemsize(sig, "unpermuted_tokens_grad"), itemsize(sig, "probs")
    ub = target.ub_size
    found = []
    if sig.attr("drop_and_pad"):
        capacity = ratio(rows, n_experts)
        if capacity is not None and n_tokens is not None and capacity > n_tokens:
            found.append(f"capacity C = {capacity} exceeds T = {n_tokens} (probs, padded)")
        if hidden is not None and token_len is not None:
            max_hidden = 256 * (ub - 2080) // (8 + token_len)
            if hidden > max_hidden:
                found.append(
                    f"H = {hidden} exceeds 256 * (ubSize - 2080) / (8 + tokenTypeLen) = "
                    f"{max_hidden} (ubSize {ub}, tokenTypeLen {token_len}; probs, padded)"
                )
        return found
    found += top_k_rules(ratio(rows, n_tokens), n_experts, "probs, not padded")
    if n_experts is not None and token_len is not None and prob_len is not None:
        free = ub - (prob_len + 1) * align32(n_experts) - (token_len + 8) * 256
        if free // (6 * token_len + 12) < 1:
            found.append(
                f"E = {n_experts} leaves no room in UB: (ubSize - (probTypeLen + 1) * "
                f"align32(E) - (tokenTypeLen + 8) * 256) / (6 * tokenTypeLen + 12) = "
                f"{free // (6 * token_len + 12)} < 1 (ubSize {ub}, probTypeLen {prob_len}, "
                f"tokenTypeLen {token_len}; probs, not padded)"
            )
    return found


#: the gradients of the weighted combine: the 6 rows' and the probs'
_EXAMPLE = Example(
    inputs={
        "unpermuted_tokens_grad": np.array([[0.5, 1.0], [2.0, -1.0], [-0.5, 3.0]], np.float32),
        "out_index": np.array([0, 3, 1, 2, 4, 5], np.int32),
        "permute_token_id": np.array([0, 0, 1, 1, 2, 2], np.int32),
        "routing_map": np.array([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]], bool),
        "permuted_tokens": np.arange(12, dtype=np.float32).reshape(6, 2),
        "probs": np.array([[0.75, 0, 0.25, 0], [0.5, 0.5, 0, 0], [0, 0, 0.625, 0.375]], np.float32),
    },
    attrs={"restore_shape": [3, 2]},
)


MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD = OpDef(
    "MoeTokenUnpermuteWithRoutingMapGrad",
    __doc__,
    inputs=[
        Input("unpermuted_tokens_grad", TOKEN_DTYPES, "[T, H] gradient of unpermuted_tokens", (2,)),
        Input("out_index", INDEX_DTYPES, "[N] the forward's out_index", (1,)),
        Input(
            "permute_token_id",
            INDEX_DTYPES,
            "[N] the forward's permute_token_id: pair i's token (padded); shape-checked, not read, when not padded",
            (1,),
        ),
        Input("routing_map", MAP_DTYPES, "[T, E] (required with probs)", (2,), optional=True),
        Input("permuted_tokens", TOKEN_DTYPES, "[N, H] the forward's input (required with probs)", (2,), optional=True),
        Input("probs", TOKEN_DTYPES, "[T, E] the forward's probs", (2,), optional=True),
    ],
    outputs=[
        Output("permuted_tokens_grad", TOKEN_DTYPES, "[N, H] gradient of permuted_tokens"),
        Output("probs_grad", TOKEN_DTYPES, "[T, E] gradient of probs (iff probs)", optional=True),
    ],
    attrs=[
        Attr("drop_and_pad", "int", 0, "0 / 1 as the forward's padded_mode", PADDING),
        Attr("restore_shape", "ints", None, "[T, H]: checked against unpermuted_tokens_grad"),
    ],
    infer=_infer,
    kernel=moe_token_unpermute_with_routing_map_grad,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD]
