"""MoeInitRouting (v1): expand tokens by expert, with a caller-given row index (SPEC 1.15).

torch_npu's ``npu_moe_init_routing(x, row_idx, expert_idx, active_num)``. ``expert_idx [T, K]``
holds the experts of each token; ``row_idx [T, K]`` names each (token, slot) by a number q
that must be a permutation of ``[0, T*K)``. The canonical ``row_idx`` (MoeGatingTopKSoftmax's,
or ``arange(T*K).view(K, T).T``) is **column-major**: ``row_idx[t, j] = q = j*T + t``, and the
copied token is always ``q % T``::

    order = argsort(expert_idx.reshape(-1), stable)   # dst row d -> token-major position p = t*K + j
    expanded_expert_idx = expert_idx.flat[order]       # [T*K] the experts, sorted
    q = row_idx.flat[order]                            # dst row d -> its row_idx number q
    expanded_row_idx[q] = d                            # src q -> dst d: a scatter index, column-arranged
    expanded_x[d] = x[q[d] % T]                        for d < min(active_num, T) * K

Index direction: ``expanded_row_idx`` is indexed by q (column-major with the canonical
row_idx) and holds the destination row: what MoeFinalizeRoutingV2 modes 0/1 gather with.
Ties (equal expert ids) keep the token-major position order, not the order of row_idx values
(the doc's reference, which "keyValueSort" does not specify otherwise). ``active_num`` counts
tokens: ``expanded_x`` keeps ``min(active_num, T) * K`` rows, while both index outputs keep all
``T*K``. Expert ids are not range-checked: omni-infer routes non-local experts to the sentinel
E, which sorts last. Pure data movement: rows are bit-exact copies.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .dtypes import FLOATS
from .errors import MoeOpError
from .moe_init_routing_v2 import INT32_MAX, product
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature
from .targets import Target, known_dim

#: torch_npu-npu_moe_init_routing.md: x must have fewer elements than this
MAX_X_ELEMENTS = 2**24


def require_permutation(row_idx: np.ndarray) -> None:
    """``row_idx`` holds every number of ``[0, T*K)`` exactly once."""
    flat = row_idx.reshape(-1)
    outside = np.flatnonzero((flat < 0) | (flat >= flat.size))
    if len(outside):
        t, j = divmod(int(outside[0]), row_idx.shape[1])
        raise MoeOpError(
            f"row_idx must be a permutation of [0, T*K) = [0, {flat.size}), got {flat[outside[0]]} at [{t}, {j}]"
        )
    counts = np.bincount(flat, minlength=flat.size)
    twice = np.flatnonzero(counts > 1)
    if len(twice):
        raise MoeOpError(
            f"row_idx must be a permutation of [0, T*K) = [0, {flat.size}): {twice[0]} appears {counts[twice[0]]} "
            f"times (and {np.count_nonzero(counts == 0)} numbers never)"
        )


def moe_init_routing(x, row_idx, expert_idx, *, active_num):
    """Expand ``x`` to one row per (token, expert), rows sorted by expert.

    Args:
        x: ``[T, H]`` float32/float16/bfloat16.
        row_idx: ``[T, K]`` int32, a permutation of ``[0, T*K)`` (canonically ``j*T + t``).
        expert_idx: ``[T, K]`` int32, any values (sentinels sort like any id).
        active_num: >= 0, tokens whose K copies are kept.
    Returns:
        ``expanded_x [min(active_num, T)*K, H]`` (x's dtype), ``expanded_row_idx [T*K]`` int32
        (q -> dst row), ``expanded_expert_idx [T*K]`` int32 (sorted ids).
    """
    n_tokens, top_k = expert_idx.shape
    require_permutation(row_idx)
    flat = expert_idx.reshape(-1)
    order = np.argsort(flat, kind="stable")  # dst d -> position p
    q = row_idx.reshape(-1)[order]  # dst d -> q
    expanded_row_idx = np.empty(flat.size, np.int32)
    expanded_row_idx[q] = np.arange(flat.size, dtype=np.int32)
    rows = min(active_num, n_tokens) * top_k
    # row d copies token q[d] % T; source-major: each token is read once for all its rows
    copied = row_idx.reshape(-1) % max(n_tokens, 1)  # position p -> the token its row copies
    if np.array_equal(copied, np.arange(flat.size) // max(top_k, 1)):  # the canonical row_idx, any layout of q
        destination = np.empty(flat.size, np.int64)  # position p -> dst d; token t feeds p = t*K .. t*K + K - 1
        destination[order] = np.arange(flat.size)
        starts = fused.fanout_starts(n_tokens, top_k)
    else:  # group the kept rows d by the token they copy
        token_of_row = np.where(np.arange(flat.size) < rows, q % max(n_tokens, 1), -1)
        destination, starts = fused.destinations_by_source(token_of_row, n_tokens)
    expanded_x = fused.copy_rows_to(x, destination, starts, rows)
    return expanded_x, expanded_row_idx, flat[order].astype(np.int32)


def _infer(sig: Signature) -> None:
    n_tokens, top_k = sig.dim("expert_idx", 0), sig.dim("expert_idx", 1)
    active_num = sig.attr("active_num")
    sig.require(active_num >= 0, f"active_num must be >= 0, got {active_num}")
    sig.same(sig.dim("x", 0), n_tokens, "x [T, H] and expert_idx [T, K] must have the same T")
    for axis in (0, 1):
        rule = f"row_idx must have expert_idx's shape [T, K]: dim {axis}"
        sig.same(sig.dim("row_idx", axis), sig.dim("expert_idx", axis), rule)
    if isinstance(top_k, int):
        shape = list(sig.input("expert_idx").shape or ())
        sig.require(top_k > 0, f"expert_idx [T, K] must have K > 0, got shape {shape}")
    slots = product(n_tokens, top_k)
    if isinstance(slots, int):
        sig.require(slots <= INT32_MAX, f"T*K = {slots} slots do not fit the int32 indices")
    kept: Dim = None
    if isinstance(n_tokens, int) and isinstance(top_k, int):
        kept = min(active_num, n_tokens) * top_k
    sig.output("expanded_x", sig.input("x").dtype, (kept, sig.dim("x", 1)))
    sig.output("expanded_row_idx", "int32", (slots,))
    sig.output("expanded_expert_idx", "int32", (slots,))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    found = []
    n_tokens, hidden = known_dim(sig, "x", 0), known_dim(sig, "x", 1)
    if n_tokens is not None and hidden is not None and n_tokens * hidden >= MAX_X_ELEMENTS:
        found.append(f"x has {n_tokens * hidden} elements, the NPU takes fewer than 2^24 = {MAX_X_ELEMENTS}")
    if target.name != "ascend910b":
        found.append("torch_npu lists MoeInitRouting for Atlas A2 (ascend910b) only, and deprecates it")
    ids = sig.value("expert_idx")
    if ids is not None and ids.size and int(ids.min()) < 0:
        found.append(f"expert id {int(ids.min())} < 0: the NPU's experts come from a top-k gating ([0, E))")
    return found


#: v1: 3 tokens to 2 of 4 experts, row_idx the column-major slot j*T + t
_EXAMPLE = Example(
    inputs={
        "x": np.array([[0.5, 1.0], [2.0, -1.0], [-0.5, 3.0]], np.float32),
        "row_idx": np.array([[0, 3], [1, 4], [2, 5]], np.int32),
        "expert_idx": np.array([[0, 2], [1, 0], [2, 3]], np.int32),
    },
    attrs={"active_num": 3},
)


MOE_INIT_ROUTING = OpDef(
    "MoeInitRouting",
    __doc__,
    inputs=[
        Input("x", FLOATS, "[T, H] token features", (2,)),
        Input("row_idx", ("int32",), "[T, K] a permutation of [0, T*K), canonically j*T + t", (2,)),
        Input("expert_idx", ("int32",), "[T, K] expert of slot j of token t (not range-checked)", (2,)),
    ],
    outputs=[
        Output("expanded_x", FLOATS, "[min(active_num, T)*K, H] rows sorted by expert"),
        Output("expanded_row_idx", ("int32",), "[T*K] src q = row_idx[t, j] -> dst row (column-arranged)"),
        Output("expanded_expert_idx", ("int32",), "[T*K] the expert ids, sorted"),
    ],
    attrs=[Attr("active_num", "int", None, "tokens whose copies expanded_x keeps (>= 0)", required=True)],
    infer=_infer,
    kernel=moe_init_routing,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_INIT_ROUTING]
