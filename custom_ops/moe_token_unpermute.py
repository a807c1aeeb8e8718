"""MoeTokenUnpermute: sum each token's K permuted rows back into one row (SPEC 1.12).

torch_npu's ``npu_moe_token_unpermute``. ``sorted_indices`` is src->dst, as MoeTokenPermute
(and MoeInitRoutingV2/V3 with ``row_idx_type 0``) emit it: the entry at token-major slot
``p = t*K + j`` is the row of ``permuted_tokens [A, H]`` that holds slot p's copy. K is
``probs.shape[1]`` with probs, else 1 (then every slot is its own output row)::

    unpermuted_tokens[t] = sum over j of probs[t, j] * permuted_tokens[sorted_indices[t*K + j]]

(the factor is 1 without probs). A slot adds nothing when its row is ``>= A`` (the permute's
``num_out_tokens`` cut it off) or, with probs, when its prob is 0: the NPU kernel
(ops-transformer ``moe_token_unpermute.h``, ``needCopyIn = idx < num_out_tokens && prob != 0``)
does not read that row at all, so a NaN or inf there does not leak into the sum (vllm-ascend
feeds rows of masked experts with prob 0). Repeated rows are legal, since the op only gathers:
vllm-ascend passes ``abs(expanded_row_idx)``, so every -1 slot reads row 1, with prob 0.

Tokens and probs may each be float32, float16 or bfloat16, in any combination. The terms are
added in j order in float32 (float64 for the bare kernel's float64) starting from +0.0 and
rounded once, to nearest even, to the tokens' dtype. ``restore_shape`` is read only in padded
mode, which the NPU (and so this op) refuses.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .dtypes import FLOATS
from .errors import MoeOpError
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature
from .targets import MAX_TOP_K, Target, known_dim


def require_rows(sorted_indices: np.ndarray) -> None:
    """Every entry names a row (>= 0): a negative index has no meaning for the NPU's gather."""
    negative = np.flatnonzero(sorted_indices < 0)
    if len(negative):
        p = int(negative[0])
        raise MoeOpError(
            f"sorted_indices must be >= 0 (src slot -> row of permuted_tokens), got {sorted_indices[p]} at slot {p}"
        )


def moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, *, padded_mode=0, restore_shape=None):
    """Weighted sum of each token's K rows.

    Args:
        permuted_tokens: ``[A, H]`` float32/float16/bfloat16.
        sorted_indices: ``[T*K]`` int32, src slot -> row (>= 0; >= A: cut off, skipped).
        probs: optional ``[T, K]`` float32/float16/bfloat16 (K = 1 without it).
        padded_mode: 0 (1 is refused by the static rules).
        restore_shape: not read (padded mode only).
    Returns:
        ``(unpermuted_tokens,)``: ``[T, H]`` in the dtype of ``permuted_tokens``.
    """
    require_rows(sorted_indices)
    top_k = 1 if probs is None else probs.shape[1]
    skipped = sorted_indices >= len(permuted_tokens)
    weights = None
    if probs is not None:
        weights = probs.reshape(-1)
        skipped |= weights == 0  # the NPU does not read a row whose prob is 0
    source = np.where(skipped, -1, sorted_indices)
    n_tokens = len(sorted_indices) // top_k
    segment_start = np.arange(n_tokens + 1) * top_k  # token t's terms: t*K .. t*K + K - 1
    return (fused.segment_sums(permuted_tokens, source, segment_start, weights),)


def _infer(sig: Signature) -> None:
    permuted = sig.input("permuted_tokens")
    slots = sig.dim("sorted_indices", 0)
    sig.require(
        sig.attr("padded_mode") == 0,
        "padded_mode=1 is not supported (the NPU rejects it: aclnnMoeTokenUnpermute 561002)",
    )
    tokens: Dim = slots  # K = 1 without probs
    if sig.has("probs"):
        top_k = sig.dim("probs", 1)
        if isinstance(top_k, int):
            sig.require(top_k > 0, f"probs [T, K] must have K > 0, got shape {list(sig.input('probs').shape or ())}")
        rule = "probs [T, K] must have T*K = len(sorted_indices)"
        quotient = sig.quotient(slots, top_k, f"{rule}: len(sorted_indices) must be a multiple of K")
        sig.same(sig.dim("probs", 0), quotient, rule)  # (symbolic dims: the lowering checks T*K = len)
        tokens = sig.dim("probs", 0)
    sig.output("unpermuted_tokens", permuted.dtype, (tokens, sig.dim("permuted_tokens", 1)))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    top_k = known_dim(sig, "probs", 1) if sig.has("probs") else 1
    if top_k is not None and top_k > MAX_TOP_K:
        return [f"K = {top_k} exceeds {MAX_TOP_K}"]
    return []


#: 6 expert rows combined back into 3 tokens, weighted by each token's 2 probs
_EXAMPLE = Example(
    inputs={
        "permuted_tokens": np.arange(12, dtype=np.float32).reshape(6, 2),
        "sorted_indices": np.array([0, 3, 2, 1, 4, 5], np.int32),
        "probs": np.array([[0.75, 0.25], [0.5, 0.5], [0.625, 0.375]], np.float32),
    },
)


MOE_TOKEN_UNPERMUTE = OpDef(
    "MoeTokenUnpermute",
    __doc__,
    inputs=[
        Input("permuted_tokens", FLOATS, "[A, H] the permuted (expert-major) rows", (2,)),
        Input("sorted_indices", ("int32",), "[T*K] src slot t*K + j -> row (>= A: skipped)", (1,)),
        Input("probs", FLOATS, "[T, K] weight of each slot (any float dtype)", (2,), optional=True),
    ],
    outputs=[Output("unpermuted_tokens", FLOATS, "[T, H] weighted sum of each token's K rows")],
    attrs=[
        Attr("padded_mode", "int", 0, "0 only (the NPU rejects 1)", (0, 1)),
        Attr("restore_shape", "ints", None, "read only in padded mode (refused): accepted, not read"),
    ],
    infer=_infer,
    kernel=moe_token_unpermute,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_TOKEN_UNPERMUTE]
