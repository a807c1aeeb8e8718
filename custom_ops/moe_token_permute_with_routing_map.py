"""MoeTokenPermuteWithRoutingMap: copy every token once per routed expert, expert-major.

SPEC 1.4, with ``routing_map [T, E]`` and N = ``num_out_tokens`` permuted rows.

Not padded (every token routed to exactly K = N / T experts)::

    row_token = nonzero(routing_map.T)[1]          # row d -> token, expert-major
    permuted_tokens[d] = tokens[row_token[d]]
    permuted_probs = probs.T[routing_map.T]        # probs[row_token[d], expert of row d]
    sorted_indices = argsort(row_token, stable)    # slot p = t*K + j -> row d

Padded (C = N / E rows per expert): expert e keeps its first C routed tokens in token order
and, when fewer were routed to it, fills its remaining rows with unrouted tokens in token
order (a stable descending argsort of ``routing_map.T``)::

    sorted_indices[e*C + c] = token in row c of expert e    # row d -> token
    permuted_tokens[d] = tokens[sorted_indices[d]]
    permuted_probs[d] = probs[sorted_indices[d], d // C]

``num_out_tokens = -K`` (negative; not padded only) means K rows per token, N = T*K: the
value for a token count T that is not known when the graph is made (an export with a dynamic
T), where N itself cannot be an attribute. ``-K`` and ``T*K`` give the same outputs.

Pure data movement: outputs are bit-exact copies.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .moe_init_routing_v2 import product
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .parallel import gather_rows
from .routing_map import (
    MAP_DTYPES,
    PADDING,
    TOKEN_DTYPES,
    optional_output,
    padded_row_tokens,
    require_probs_dtype,
    require_shape,
    require_topk_rows,
    routing_mask,
)
from .targets import Target, known_dim, ratio, top_k_rules


def moe_token_permute_with_routing_map(tokens, routing_map, probs=None, *, num_out_tokens, drop_and_pad=0):
    """Permute tokens (and their probs) into expert-major rows.

    Args:
        tokens: ``[T, H]`` float32/float16/bfloat16.
        routing_map: ``[T, E]`` bool, or int8 holding 0/1: ``[t, e]`` = token t goes to expert e.
        probs: optional ``[T, E]``, the dtype of tokens (or float32 with bfloat16 tokens).
        num_out_tokens: N, the number of permuted rows: ``T*K`` not padded, ``E*C`` padded;
            not padded, ``-K`` means ``N = T*K`` (K rows per token, for a dynamic T).
        drop_and_pad: 0 = every routed (token, expert) pair gets a row; 1 = C rows per expert.
    Returns:
        ``permuted_tokens [N, H]``, ``sorted_indices [N]`` int32 (not padded: slot ``t*K+j``
        -> row; padded: row -> token), ``permuted_probs [N]`` (probs' dtype) or None.
    """
    mask = routing_mask(routing_map)
    n_tokens, n_experts = mask.shape
    if num_out_tokens < 0:  # -K: K rows per token (infer: not padded)
        num_out_tokens = n_tokens * -num_out_tokens
    if drop_and_pad:
        capacity = num_out_tokens // n_experts if n_experts else 0
        row_token = padded_row_tokens(mask, capacity)
        sorted_indices = row_token
        permuted_probs = None if probs is None else probs[row_token, np.repeat(np.arange(n_experts), capacity)]
        permuted_tokens = gather_rows(tokens, row_token)
    else:
        top_k = num_out_tokens // n_tokens if n_tokens else 0
        require_topk_rows(mask, top_k)
        row_token = np.nonzero(mask.T)[1]
        sorted_indices = np.argsort(row_token, kind="stable")
        permuted_probs = None if probs is None else probs.T[mask.T]
        # sorted_indices is a permutation (slot t*K+j -> row): copy each token to its K rows
        permuted_tokens = fused.copy_rows_to(
            tokens, sorted_indices, fused.fanout_starts(n_tokens, top_k), len(row_token)
        )
    return permuted_tokens, sorted_indices.astype(np.int32), permuted_probs


def _infer(sig: Signature) -> None:
    tokens = sig.input("tokens")
    n_tokens, hidden = sig.dim("tokens", 0), sig.dim("tokens", 1)
    n_experts = sig.dim("routing_map", 1)
    rows = sig.attr("num_out_tokens")
    sig.same(sig.dim("routing_map", 0), n_tokens, "routing_map must be [T, E]: dim 0 must equal T = tokens dim 0")
    require_shape(sig, "probs", (n_tokens, n_experts), "[T, E] like routing_map")
    require_probs_dtype(sig, "probs", "tokens")
    per_token = -rows if rows < 0 else None  # num_out_tokens = -K: K rows per token, N = T*K
    if per_token is not None:
        sig.require(
            not sig.attr("drop_and_pad"),
            f"num_out_tokens = {rows} (-K: K rows per token) needs drop_and_pad 0; padded, N = E*C must be given",
        )
        rows = product(n_tokens, per_token)
    if sig.attr("drop_and_pad"):
        capacity = sig.quotient(
            rows,
            n_experts,
            "padded: num_out_tokens must be a multiple of E = routing_map dim 1 (C = num_out_tokens / E)",
        )
        if isinstance(capacity, int) and isinstance(n_tokens, int):
            sig.require(
                capacity <= n_tokens,
                f"padded: capacity C = {capacity} must not exceed T = {n_tokens}, the tokens an expert can take",
            )
        else:
            rule = "padded: capacity C = num_out_tokens / E must not exceed T, the tokens an expert can take"
            sig.defer("quotient_at_most", (rows, n_experts, n_tokens), rule)
    elif per_token is not None:
        if isinstance(n_experts, int):
            sig.require(per_token <= n_experts, f"not padded: K = {per_token} must not exceed E = {n_experts}")
        else:
            sig.defer("at_most", (per_token, n_experts), "not padded: K = -num_out_tokens must not exceed E")
    else:
        top_k = sig.quotient(
            rows,
            n_tokens,
            "not padded: num_out_tokens must be a multiple of T = tokens dim 0 (K = num_out_tokens / T)",
        )
        if isinstance(top_k, int) and isinstance(n_experts, int):
            sig.require(
                top_k <= n_experts, f"not padded: K = num_out_tokens / T = {top_k} must not exceed E = {n_experts}"
            )
        else:
            sig.defer(
                "quotient_at_most", (rows, n_tokens, n_experts), "not padded: K = num_out_tokens / T must not exceed E"
            )
    sig.output("permuted_tokens", tokens.dtype, (rows, hidden))
    sig.output("sorted_indices", "int32", (rows,))
    if optional_output(sig, "permuted_probs", "probs"):
        sig.output("permuted_probs", sig.input("probs").dtype, (rows,))


#: aclnnMoeTokenPermuteWithRoutingMap: tokens_num and experts_num must be below this
MAX_PERMUTE_DIM = 16777215


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    found = []
    n_tokens, n_experts = known_dim(sig, "routing_map", 0), known_dim(sig, "routing_map", 1)
    for letter, value in (("T", n_tokens), ("E", n_experts)):
        if value is not None and value >= MAX_PERMUTE_DIM:
            found.append(f"{letter} = {value} must be below {MAX_PERMUTE_DIM}")
    if not sig.attr("drop_and_pad"):
        rows = sig.attr("num_out_tokens")
        top_k = -rows if rows < 0 else ratio(rows, n_tokens)
        found += top_k_rules(top_k, None, "not padded")
    return found


#: 3 tokens routed by a [tokens, experts] map: 6 rows in expert order, with their probs
_EXAMPLE = Example(
    inputs={
        "tokens": np.array([[0.5, 1.0], [2.0, -1.0], [-0.5, 3.0]], np.float32),
        "routing_map": np.array([[1, 0, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]], bool),
        "probs": np.array([[0.75, 0, 0.25, 0], [0.5, 0.5, 0, 0], [0, 0, 0.625, 0.375]], np.float32),
    },
    attrs={"num_out_tokens": 6},
)


MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP = OpDef(
    "MoeTokenPermuteWithRoutingMap",
    __doc__,
    inputs=[
        Input("tokens", TOKEN_DTYPES, "[T, H] token rows", (2,)),
        Input("routing_map", MAP_DTYPES, "[T, E] bool, or int8 0/1: token t goes to expert e", (2,)),
        Input(
            "probs",
            TOKEN_DTYPES,
            "[T, E] routing probabilities (tokens' dtype, or float32 with bfloat16 tokens)",
            (2,),
            optional=True,
        ),
    ],
    outputs=[
        Output("permuted_tokens", TOKEN_DTYPES, "[N, H] rows, expert-major"),
        Output("sorted_indices", ("int32",), "[N] not padded: slot t*K+j -> row; padded: row -> token"),
        Output("permuted_probs", TOKEN_DTYPES, "[N] prob of each row (iff probs)", optional=True),
    ],
    attrs=[
        Attr(
            "num_out_tokens",
            "int",
            None,
            "N rows: T*K not padded (or -K: K rows per token, for a dynamic T), E*C padded",
            required=True,
        ),
        Attr("drop_and_pad", "int", 0, "0 = a row per routed pair, 1 = C rows per expert", PADDING),
    ],
    infer=_infer,
    kernel=moe_token_permute_with_routing_map,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP]
