"""MoeTokenPermute: copy each token once per chosen expert, rows grouped by expert (SPEC 1.11).

torch_npu's ``npu_moe_token_permute``. ``indices`` is ``[T]`` (K = 1) or ``[T, K]``: the
expert of slot j of token t, at the token-major slot ``p = t*K + j`` (F = T*K slots).
Sorting the flattened ids stably gives the destination order::

    first = argsort(indices.reshape(-1), stable)     # dst row d -> src slot p (Megatron's sorted_indices)
    sorted_indices = argsort(first)                  # src slot p -> dst row d (this op's output)
    permuted_tokens[d] = tokens[first[d] // K]       for d < M

Index direction: ``sorted_indices`` is the **inverse** of Megatron-LM's ``sorted_indices``
(op-plugin's test asserts ``fused == argsort(megatron)``); it is what MoeTokenUnpermute
gathers with. It always has all F entries; with ``num_out_tokens`` n the op keeps
``M = F`` (n = 0), ``min(n, F)`` (n > 0) or ``F + n`` (n < 0) rows, and an entry >= M marks a
slot whose copy was cut. Ties keep slot order. Ids are any non-negative int32/int64 values
(the NPU's range, below 2^24 - 1, is a target limit). Pure data movement: bit-exact copies.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .dtypes import FLOATS, INDEX
from .errors import MoeOpError
from .moe_init_routing_v2 import INT32_MAX, product
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature
from .targets import MAX_TOP_K, Target, known_dim

#: aclnnMoeTokenPermute: numel(indices) and every id must be below this; K at most MAX_TOP_K
MAX_PERMUTE_IDS = 16777215


def kept_rows(slots: Dim, num_out_tokens: int) -> Dim:
    """M, the rows kept of F slots: F (n = 0), min(n, F) (n > 0), F + n (n < 0); None if F is
    unknown (op-plugin's ``npu_moe_token_permute_out_size``)."""
    if num_out_tokens == 0:
        return slots
    if not isinstance(slots, int):
        return None
    return min(num_out_tokens, slots) if num_out_tokens > 0 else slots + num_out_tokens


def moe_token_permute(tokens, indices, *, num_out_tokens=0, padded_mode=0):
    """Copy token t to the rows of its K slots, expert-major.

    Args:
        tokens: ``[T, H]`` float32/float16/bfloat16.
        indices: ``[T]`` or ``[T, K]`` int32/int64, expert of slot ``t*K + j`` (>= 0).
        num_out_tokens: 0 = all F rows; n > 0 keeps min(n, F); n < 0 keeps F + n (> 0).
        padded_mode: 0 (1 is refused by the static rules, as on the NPU).
    Returns:
        ``permuted_tokens [M, H]`` (tokens' dtype), ``sorted_indices [F]`` int32 (src slot ->
        dst row; entries >= M: rows cut off).
    """
    top_k = 1 if indices.ndim == 1 else indices.shape[1]
    flat = indices.reshape(-1)
    negative = np.flatnonzero(flat < 0)
    if len(negative):
        p = int(negative[0])
        raise MoeOpError(f"indices must be >= 0 (expert ids), got {flat[p]} at slot {p} (token {p // max(top_k, 1)})")
    first = np.argsort(flat, kind="stable")  # dst d -> src p
    sorted_indices = np.empty(flat.size, np.int64)  # src p -> dst d: a permutation
    sorted_indices[first] = np.arange(flat.size)
    rows = kept_rows(flat.size, num_out_tokens)
    assert isinstance(rows, int)
    # source-major: token t is read once and written to the rows of its K slots (rows >= M skipped)
    permuted = fused.copy_rows_to(tokens, sorted_indices, fused.fanout_starts(len(tokens), top_k), rows)
    return permuted, sorted_indices.astype(np.int32)


def _infer(sig: Signature) -> None:
    tokens = sig.input("tokens")
    n_tokens, hidden = sig.dim("tokens", 0), sig.dim("tokens", 1)
    shape = sig.input("indices").shape
    top_k: Dim = None if shape is None else 1 if len(shape) == 1 else shape[1]
    n = sig.attr("num_out_tokens")
    sig.require(
        sig.attr("padded_mode") == 0, "padded_mode=1 is not supported (the NPU rejects it: aclnnMoeTokenPermute 561002)"
    )
    sig.same(sig.dim("indices", 0), n_tokens, "indices [T] or [T, K] must have T = tokens dim 0")
    slots = product(sig.dim("indices", 0), top_k)
    if isinstance(slots, int):
        sig.require(slots <= INT32_MAX, f"T*K = {slots} slots do not fit the int32 sorted_indices")
        sig.require(  # F + n = 0 too: the NPU's tiling fails on a 0-row output (SPEC-layer 1.11 (c) amended)
            n >= 0 or slots + n > 0,
            f"num_out_tokens = {n} < 0 must keep F + n > 0 rows of the F = T*K = {slots} slots",
        )
    elif n < 0:
        sig.defer("at_most", (1 - n, slots), f"num_out_tokens = {n} < 0 must keep F + n > 0 rows of the F = T*K slots")
    sig.output("permuted_tokens", tokens.dtype, (kept_rows(slots, n), hidden))
    sig.output("sorted_indices", "int32", (slots,))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    found = []
    shape = sig.input("indices").shape
    top_k = known_dim(sig, "indices", 1) if shape is not None and len(shape) == 2 else 1
    n_tokens = known_dim(sig, "indices", 0)
    if top_k is not None and top_k > MAX_TOP_K:
        found.append(f"K = {top_k} exceeds {MAX_TOP_K}")
    if n_tokens is not None and top_k is not None and n_tokens * top_k >= MAX_PERMUTE_IDS:
        found.append(f"numel(indices) = {n_tokens * top_k} must be below {MAX_PERMUTE_IDS}")
    ids = sig.value("indices")
    if ids is not None and ids.size and int(ids.max()) >= MAX_PERMUTE_IDS:
        found.append(f"expert id {int(ids.max())} must be below {MAX_PERMUTE_IDS}")
    return found


#: 3 tokens, each to 2 of 4 experts: 6 rows in expert order
_EXAMPLE = Example(
    inputs={
        "tokens": np.array([[0.5, 1.0], [2.0, -1.0], [-0.5, 3.0]], np.float32),
        "indices": np.array([[0, 2], [1, 0], [2, 3]], np.int32),
    },
)


MOE_TOKEN_PERMUTE = OpDef(
    "MoeTokenPermute",
    __doc__,
    inputs=[
        Input("tokens", FLOATS, "[T, H] token rows", (2,)),
        Input("indices", INDEX, "[T] or [T, K] expert of slot t*K + j (>= 0)", (1, 2)),
    ],
    outputs=[
        Output("permuted_tokens", FLOATS, "[M, H] rows grouped by expert (M from num_out_tokens)"),
        Output("sorted_indices", ("int32",), "[T*K] src slot t*K + j -> dst row (>= M: cut off)"),
    ],
    attrs=[
        Attr("num_out_tokens", "int", 0, "rows kept: 0 = T*K, n > 0: min(n, T*K), n < 0: T*K + n"),
        Attr("padded_mode", "int", 0, "0 only (the NPU rejects 1)", (0, 1)),
    ],
    infer=_infer,
    kernel=moe_token_permute,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_TOKEN_PERMUTE]
