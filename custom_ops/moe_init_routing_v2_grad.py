"""MoeInitRoutingV2Grad: the gradient of MoeInitRoutingV2 with respect to x (SPEC 1.3, seed 001).

``expanded_row_idx[p]`` is the row of ``expanded_x`` (flattened to ``[rows, H]``) that source
position ``p = t*K + j`` was copied to, so the gradient of token t sums its K copies:

    grad_x[t] = sum_{j=0}^{K-1} grad_expanded_x.reshape(-1, H)[expanded_row_idx[t*K + j]]

Terms that name no row are skipped: index == -1 in drop/pad mode (a dropped copy), index >=
``active_num`` in active mode (a copy beyond the kept rows), index == -1 in dropless mode
(SPEC 1.3 as amended: a forward with a partial ``active_expert_range``, MoeInitRoutingV3,
marks the copies of inactive experts -1, and seed 001's own autograd example uses such a
range). Any other index that names no row of ``grad_expanded_x`` is an error.

Accumulation is in float32 (float64 for float64 input to the bare kernel), adding the K
terms in order j = 0..K-1, then one round-to-nearest-even cast back to the input dtype: the
same input gives the same bits on every run. A skipped term counts as +0.0.

Active mode: the forward produces ``min(active_num, T*K)`` rows, so ``grad_expanded_x``
must have that many rows (seed 001 says ``active_num``, which is the same number whenever
``active_num <= T*K``; the forward's own output must be accepted when it is not).
"""

from __future__ import annotations

import math

import numpy as np

from . import fused
from .dtypes import FLOATS
from .errors import MoeOpError
from .opdef import Attr, Example, Input, OpDef, Output, Signature


def sum_rows(rows: np.ndarray, source: np.ndarray) -> np.ndarray:
    """``out[t] = sum_j rows[source[t, j]]`` over j = 0..K-1 in order; -1 terms are skipped.

    Args:
        rows: ``[R, H]`` float32/float16/bfloat16 (or float64).
        source: ``[T, K]`` intp, each in ``[-1, R)`` (checked by the caller).
    Returns:
        ``[T, H]`` in the dtype of ``rows``, accumulated in float32 (float64 for float64).
    """
    tokens, top_k = source.shape
    segment_start = np.arange(tokens + 1) * top_k  # token t's terms: t*K .. t*K+K-1
    return fused.segment_sums(rows, source.reshape(-1), segment_start)


def _mode(drop_pad_mode: int, active_num: int) -> str:
    return "drop/pad" if drop_pad_mode == 1 else "active" if active_num > 0 else "dropless"


def moe_init_routing_v2_grad(grad_expanded_x, expanded_row_idx, *, top_k, drop_pad_mode=0, active_num=0):
    """Sum the K copies' gradients of every token.

    Args:
        grad_expanded_x: ``[A, H]`` (dropless/active) or ``[E, C, H]`` (drop/pad),
            float32/float16/bfloat16 (float64 also works for the bare kernel).
        expanded_row_idx: ``[T*K]`` int32 from the forward: source position t*K+j -> row.
        top_k: K > 0.
        drop_pad_mode: 0 dropless/active, 1 drop/pad.
        active_num: 0 dropless, > 0 active (dropless mode only).
        Skipped terms: -1 (drop/pad and dropless), >= active_num (active).
    Returns:
        ``(grad_x,)``: ``[T, H]`` in the dtype of ``grad_expanded_x``.
    """
    hidden = grad_expanded_x.shape[-1]
    rows = grad_expanded_x.reshape(math.prod(grad_expanded_x.shape[:-1]), hidden)  # (-1 fails for H = 0)
    n_tokens = len(expanded_row_idx) // top_k
    index = expanded_row_idx.astype(np.intp).reshape(n_tokens, top_k if n_tokens else 0)
    if drop_pad_mode == 1:
        skip = index == -1
    elif active_num > 0:
        skip = index >= active_num
    else:
        skip = index == -1
    bad = np.flatnonzero(~skip & ((index < 0) | (index >= len(rows))))
    if len(bad):
        p = int(bad[0])
        allowed = {
            "drop/pad": "-1 (dropped) or ",
            "active": f">= active_num = {active_num} (skipped) or ",
            "dropless": "-1 (an inactive expert's copy, skipped) or ",
        }
        raise MoeOpError(
            f"expanded_row_idx[{p}] = {expanded_row_idx[p]} names no row of grad_expanded_x "
            f"({_mode(drop_pad_mode, active_num)} mode): must be "
            f"{allowed.get(_mode(drop_pad_mode, active_num), '')}in [0, {len(rows)})",
        )
    return (sum_rows(rows, np.where(skip, -1, index)),)


def _infer(sig: Signature) -> None:
    grad, index_len = sig.input("grad_expanded_x"), sig.dim("expanded_row_idx", 0)
    top_k, drop_pad_mode, active_num = sig.attr("top_k"), sig.attr("drop_pad_mode"), sig.attr("active_num")
    mode = _mode(drop_pad_mode, active_num)
    sig.require(top_k > 0, f"top_k must be > 0, got {top_k}")
    sig.require(active_num >= 0, f"active_num must be >= 0, got {active_num}")
    want_rank = 3 if drop_pad_mode == 1 else 2
    if grad.shape is not None:
        sig.require(
            len(grad.shape) == want_rank,
            f"grad_expanded_x must be {'[E, C, H]' if want_rank == 3 else '[A, H]'} in "
            f"{mode} mode (drop_pad_mode={drop_pad_mode}), got shape {list(grad.shape)}",
        )
    if isinstance(index_len, int):
        sig.require(index_len % top_k == 0, f"len(expanded_row_idx) = {index_len} must be divisible by top_k = {top_k}")
    else:
        sig.defer("multiple", (index_len, top_k), "len(expanded_row_idx) must be divisible by top_k")
    grad_rows = sig.dim("grad_expanded_x", 0)
    if mode == "dropless":
        sig.same(grad_rows, index_len, "dropless mode: grad_expanded_x dim 0 must equal len(expanded_row_idx)")
    elif mode == "active" and isinstance(index_len, int):
        sig.same(
            grad_rows,
            min(active_num, index_len),
            f"active mode: grad_expanded_x dim 0 must equal min(active_num, len(expanded_row_idx)) "
            f"= min({active_num}, {index_len})",
        )
    elif mode == "active":
        rule = "active mode: grad_expanded_x dim 0 must equal min(active_num, len(expanded_row_idx))"
        sig.defer("equal_min", (grad_rows, active_num, index_len), rule)
    tokens = index_len // top_k if isinstance(index_len, int) else index_len if top_k == 1 else None
    hidden = grad.shape[-1] if grad.shape else None
    sig.output("grad_x", grad.dtype, (tokens, hidden))


#: the gradient of 6 expanded rows summed back onto their 3 tokens
_EXAMPLE = Example(
    inputs={
        "grad_expanded_x": np.arange(12, dtype=np.float32).reshape(6, 2),
        "expanded_row_idx": np.array([0, 3, 1, 4, 2, 5], np.int32),
    },
    attrs={"top_k": 2},
)


MOE_INIT_ROUTING_V2_GRAD = OpDef(
    "MoeInitRoutingV2Grad",
    __doc__,
    inputs=[
        Input("grad_expanded_x", FLOATS, "[A, H] (dropless/active) or [E, C, H] (drop/pad)", (2, 3)),
        Input("expanded_row_idx", ("int32",), "[T*K] forward index: source position t*K+j -> row", (1,)),
    ],
    outputs=[Output("grad_x", FLOATS, "[T, H] = [len(expanded_row_idx) / top_k, H]")],
    attrs=[
        Attr("top_k", "int", None, "K, copies per token (> 0)", required=True),
        Attr("drop_pad_mode", "int", 0, "0 = dropless/active, 1 = drop/pad", (0, 1)),
        Attr("active_num", "int", 0, "the forward's active_num (>= 0; dropless mode only)"),
    ],
    infer=_infer,
    kernel=moe_init_routing_v2_grad,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_INIT_ROUTING_V2_GRAD]
