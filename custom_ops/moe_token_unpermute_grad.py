"""MoeTokenUnpermuteGrad: the gradient of MoeTokenUnpermute (SPEC 1.12 (d)).

``sorted_indices [T*K]`` is the forward's src->dst index: slot ``p = t*K + j`` read row
``d = sorted_indices[p]`` of ``permuted_tokens [A, H]`` (K = probs dim 1, else 1). With
``g = unpermuted_tokens_grad [T, H]``::

    for every slot p with d < A:   (t = p // K)
        permuted_tokens_grad[d] += (probs[t, j] if probs else 1) * g[t]      rows no slot names: 0
        probs_grad[t, j] = sum_h g[t, h] * permuted_tokens[d, h]             (0 when d >= A)

Index direction: the gradient is scattered back along the forward's gather, row d receiving
from the slots that read it. A is the rows of ``permuted_tokens`` when given (it is required
with probs), else ``permuted_tokens_num`` (torch_npu's ``npu_moe_token_unpermute_grad_v2``
argument ``permuted_tokens_size_0``), else ``len(sorted_indices)`` (the NPU's InferShape).

Without probs each row is a copy of its slot's gradient row, bit-exact, as the NPU's prob-none
kernel copies it. A row named by several slots (vllm-ascend's ``abs(expanded_row_idx)``)
receives their sum here, added in slot order in float32 from +0.0: the NPU writes each named
row once, so the last write wins there; ``targets.check`` flags repeated rows. With probs the
products and the row dots (pairwise, a fixed order) are float32 and rounded once to nearest
even; ``probs_grad`` has the dtype of probs, ``permuted_tokens_grad`` that of the gradient.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .dtypes import FLOATS
from .errors import BAD_DTYPE
from .moe_token_unpermute import require_rows
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature
from .parallel import gather_rows
from .targets import MAX_TOP_K, Target, known_dim


def moe_token_unpermute_grad(
    permuted_tokens,
    unpermuted_tokens_grad,
    sorted_indices,
    probs=None,
    *,
    padded_mode=0,
    restore_shape=None,
    permuted_tokens_num=-1,
):
    """Gradients of the permuted rows (and of probs) from that of the unpermuted tokens.

    Args:
        permuted_tokens: ``[A, H]`` the forward's input, or None (required with probs).
        unpermuted_tokens_grad: ``[T, H]`` float32/float16/bfloat16.
        sorted_indices: ``[T*K]`` int32, the forward's src slot -> row (>= 0; >= A skipped).
        probs: optional ``[T, K]``, any float dtype.
        padded_mode: 0 (1 is refused by the static rules); restore_shape: not read.
        permuted_tokens_num: A when ``permuted_tokens`` is absent; -1 = ``len(sorted_indices)``.
    Returns:
        ``permuted_tokens_grad [A, H]`` (the gradient's dtype), ``probs_grad [T, K]`` (probs'
        dtype) or None.
    """
    require_rows(sorted_indices)
    grad = unpermuted_tokens_grad
    rows = _rows(permuted_tokens, permuted_tokens_num, len(sorted_indices))
    top_k = 1 if probs is None else probs.shape[1]
    slots = np.arange(len(sorted_indices), dtype=np.int64)
    used = sorted_indices < rows
    row_of_slot = np.where(used, sorted_indices, -1).astype(np.int64)
    weights = None if probs is None else probs.reshape(-1)
    named = sorted_indices[used]
    if named.size and int(np.bincount(named, minlength=rows).max()) > 1:
        # row d sums the slots naming it (increasing p), each a (weighted) row of the gradient
        order, start = fused.destinations_by_source(row_of_slot, rows)
        grad_rows = fused.segment_sums(grad, order // top_k, start, None if weights is None else weights[order])
        if probs is None:
            return grad_rows, None
        slot_rows = gather_rows(permuted_tokens, row_of_slot)  # [T*K, H]: the row each slot read, 0 if none
        slot_token = np.where(used, slots // top_k, -1)
        _, slot_dots = fused.scaled_rows_and_dots(grad, slot_token, np.ones(len(slots)), slot_rows)
        return grad_rows, _probs_grad(slot_dots, used, probs)

    # each row is named once at most: row_slot[d] = the slot that read row d (-1: none)
    row_slot = np.full(rows, -1, np.int64)
    row_slot[named] = slots[used]
    if probs is None:  # a copy of the slot's gradient row, source-major (each row read once)
        grad_rows = fused.copy_rows_to(grad, row_of_slot, fused.fanout_starts(len(grad), 1), rows)
        grad_rows[row_slot < 0] = 0
        return grad_rows, None
    assert weights is not None and permuted_tokens is not None  # infer requires permuted_tokens with probs
    row_weights = np.zeros(rows, weights.dtype)
    row_weights[named] = weights[used]
    row_token = np.where(row_slot >= 0, row_slot // top_k, -1)
    grad_rows, row_dots = fused.scaled_rows_and_dots(grad, row_token, row_weights, permuted_tokens)
    slot_dots = np.zeros(len(slots), row_dots.dtype)
    slot_dots[used] = row_dots[named]
    return grad_rows, _probs_grad(slot_dots, used, probs)


def _rows(permuted_tokens, permuted_tokens_num: int, slots: int) -> int:
    if permuted_tokens is not None:
        return len(permuted_tokens)
    return permuted_tokens_num if permuted_tokens_num >= 0 else slots


def _probs_grad(slot_dots: np.ndarray, used: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """``[T, K]`` in probs' dtype: each slot's dot, 0 for a slot whose row was cut off."""
    return np.where(used, slot_dots, 0).reshape(probs.shape).astype(probs.dtype)


def _infer(sig: Signature) -> None:
    grad = sig.input("unpermuted_tokens_grad")
    n_tokens, hidden = sig.dim("unpermuted_tokens_grad", 0), sig.dim("unpermuted_tokens_grad", 1)
    slots = sig.dim("sorted_indices", 0)
    given_rows = sig.attr("permuted_tokens_num")
    sig.require(
        sig.attr("padded_mode") == 0,
        "padded_mode=1 is not supported (the NPU rejects it: aclnnMoeTokenUnpermuteGrad 561002)",
    )
    sig.require(given_rows >= -1, f"permuted_tokens_num must be >= 0, or -1 for len(sorted_indices); got {given_rows}")
    top_k: Dim = 1
    if sig.has("probs"):
        why = "input permuted_tokens is required with probs (probs_grad is a dot with its rows)"
        sig.require(sig.has("permuted_tokens"), why)
        top_k = sig.dim("probs", 1)
        if isinstance(top_k, int):
            sig.require(top_k > 0, f"probs [T, K] must have K > 0, got shape {list(sig.input('probs').shape or ())}")
        sig.same(sig.dim("probs", 0), n_tokens, "probs [T, K] must have T = unpermuted_tokens_grad dim 0")
    rule = "len(sorted_indices) must equal T*K (T = unpermuted_tokens_grad dim 0, K = probs dim 1 or 1)"
    sig.same(sig.quotient(slots, top_k, rule), n_tokens, rule)
    rows: Dim = slots if given_rows < 0 else given_rows
    if sig.has("permuted_tokens"):
        permuted = sig.input("permuted_tokens")
        if permuted.dtype is not None and grad.dtype is not None:
            sig.require(
                permuted.dtype == grad.dtype,
                f"permuted_tokens must have the dtype of unpermuted_tokens_grad ({grad.dtype}), got {permuted.dtype}",
                BAD_DTYPE,
            )
        rule = "permuted_tokens [A, H] must have H = unpermuted_tokens_grad dim 1"
        sig.same(sig.dim("permuted_tokens", 1), hidden, rule)
        rows = sig.dim("permuted_tokens", 0)
        if given_rows >= 0:
            sig.same(rows, given_rows, "permuted_tokens_num must equal A = permuted_tokens dim 0 when both are given")
    sig.output("permuted_tokens_grad", grad.dtype, (rows, hidden))
    has_probs = sig.has("probs")
    wanted = sig.wants("probs_grad", has_probs)
    sig.require(has_probs or not wanted, "output probs_grad needs input probs, which is absent")
    if has_probs and wanted:
        sig.output("probs_grad", sig.input("probs").dtype, (n_tokens, top_k))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    found = []
    top_k = known_dim(sig, "probs", 1) if sig.has("probs") else 1
    if top_k is not None and top_k > MAX_TOP_K:
        found.append(f"K = {top_k} exceeds {MAX_TOP_K}")
    index = sig.value("sorted_indices")
    if index is not None:
        given = sig.attr("permuted_tokens_num")
        rows = given if given >= 0 else len(index)
        if sig.has("permuted_tokens"):
            rows = known_dim(sig, "permuted_tokens", 0) or 0
        named = index[(index >= 0) & (index < rows)]
        counts = np.bincount(named) if named.size else np.zeros(0, np.int64)
        repeated = np.flatnonzero(counts > 1)
        if len(repeated):
            found.append(
                f"sorted_indices names row {int(repeated[0])} {int(counts[repeated[0]])} times ({len(repeated)} rows "
                "named more than once): the NPU writes each row's gradient once (the last write wins), the CPU "
                "golden sums them"
            )
    return found


#: the gradients of the weighted combine: the 6 rows' and the probs'
_EXAMPLE = Example(
    inputs={
        "permuted_tokens": np.arange(12, dtype=np.float32).reshape(6, 2),
        "unpermuted_tokens_grad": np.array([[0.5, 1.0], [2.0, -1.0], [-0.5, 3.0]], np.float32),
        "sorted_indices": np.array([0, 3, 2, 1, 4, 5], np.int32),
        "probs": np.array([[0.75, 0.25], [0.5, 0.5], [0.625, 0.375]], np.float32),
    },
)


MOE_TOKEN_UNPERMUTE_GRAD = OpDef(
    "MoeTokenUnpermuteGrad",
    __doc__,
    inputs=[
        Input("permuted_tokens", FLOATS, "[A, H] the forward's input (required with probs)", (2,), optional=True),
        Input("unpermuted_tokens_grad", FLOATS, "[T, H] gradient of unpermuted_tokens", (2,)),
        Input("sorted_indices", ("int32",), "[T*K] the forward's src slot -> row", (1,)),
        Input("probs", FLOATS, "[T, K] the forward's probs", (2,), optional=True),
    ],
    outputs=[
        Output("permuted_tokens_grad", FLOATS, "[A, H] gradient of permuted_tokens (rows no slot reads: 0)"),
        Output("probs_grad", FLOATS, "[T, K] gradient of probs, probs' dtype (iff probs)", optional=True),
    ],
    attrs=[
        Attr("padded_mode", "int", 0, "0 only (the NPU rejects 1)", (0, 1)),
        Attr("restore_shape", "ints", None, "read only in padded mode (refused): accepted, not read"),
        Attr(
            "permuted_tokens_num",
            "int",
            -1,
            "A, the rows of permuted_tokens_grad when permuted_tokens is absent (torch_npu v2's "
            "permuted_tokens_size_0); -1 = len(sorted_indices)",
        ),
    ],
    infer=_infer,
    kernel=moe_token_unpermute_grad,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_TOKEN_UNPERMUTE_GRAD]
