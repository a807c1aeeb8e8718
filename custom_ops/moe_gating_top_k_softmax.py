"""MoeGatingTopKSoftmax: softmax over the experts, then the k best of each row (SPEC 1.13).

Shapes. ``x`` is ``[N, E]`` or ``[B, S, E]``; its leading dims flatten to ``n`` rows (row
``r = b*S + s`` for 3-D). Every output has the shape of ``x`` with the last dim ``k``.

    P = f32(softmax(x))                 in float64, rounded once (see .gating)
    expert_idx[r, j] = the j-th best expert of row r: descending P, equal P -> lower expert
    y[r, j] = P[r, expert_idx[r, j]] in the dtype of x
    expert_idx[r, :] = E where finished[r]   (a sentinel expert; y is still written)
    row_idx[r, j] = j*n + r

Index directions. ``expert_idx`` maps (row, slot) -> expert. ``row_idx`` is the column-major
slot ``q = j*n + r`` of (row r, slot j): the position of that pair in ``expert_idx`` read
slot-major, exactly the ``row_idx`` input of MoeInitRouting v1 (SPEC 1.15). For 3-D inputs
(unspecified by CANN) ``r`` is the flattened row.

The NPU's kernel computes in float32 and overwrites only the indices of finished rows; for
float16 logits outside its fast template (:func:`ranks_in_float32`) it computes the softmax and
the top-k in float16, so the golden ranks the float16 probabilities there (equal in float16:
the lower expert; SPEC-layer 1.13 (b) amended); y of
finished rows and row_idx of 3-D inputs are unspecified by CANN, written here as stated.
Callers renormalise y themselves (vllm-ascend, MindSpeed-LLM); that is not part of the op.
"""

from __future__ import annotations

import math

import numpy as np

from . import buffers, gating
from .dtypes import FLOATS
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .targets import Target, known_dim

INT32_MAX = 2**31 - 1
MAX_K = 1024


def ranks_in_float32(experts: int, k: int) -> bool:
    """Does the NPU rank float16 logits by float32 probabilities? Only its fast template does
    (``moe_gating_top_k_softmax_tiling_perf.cpp`` IsCapable: ``E <= 1024``, ``E % 8 == 0`` and
    ``k <= 8``, or ``E < 8``); its other templates compute the softmax and the top-k in float16."""
    return experts < 8 or (experts <= 1024 and experts % 8 == 0 and k <= 8)


def _ranked_in_float16(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``expert_idx [n, k]`` and ``probs [n, k]`` of float16 logits ``x [n, E]`` ranked by the
    float16 probabilities (SPEC-layer 1.13 (b) amended): equal in float16 -> the lower expert,
    NaN last. The probabilities are the float32 scores (module doc) rounded to float16."""
    scores = np.empty(x.shape, np.float32)
    gating.gate(x, gating.SOFTMAX, k, scores=scores)
    half = scores.astype(np.float16).astype(np.float32)  # exact: the float16 values as float32
    key = np.where(np.isnan(half), np.float32(-np.inf), half)
    expert_idx = buffers.empty((len(x), k), np.int32)
    expert_idx[...] = np.argsort(-key, axis=1, kind="stable")[:, :k]  # descending, ties: lower expert first
    return expert_idx, np.take_along_axis(half, expert_idx, axis=1)


def slot_rows(n: int, k: int) -> np.ndarray:
    """``row_idx [n, k]`` int32: the column-major slot ``j*n + r`` of row r's j-th choice
    (n*k fits int32: inference checks it)."""
    row_idx = buffers.empty((n, k), np.int32)
    row_idx[...] = np.arange(k * n, dtype=np.int32).reshape(k, n).T
    return row_idx


def moe_gating_top_k_softmax(x, finished=None, *, k=1):
    """The k most probable experts of each row of ``softmax(x)``.

    Args:
        x: ``[N, E]`` or ``[B, S, E]`` float32/float16/bfloat16 logits.
        finished: bool of shape ``x.shape[:-1]``, or None; a finished row gets expert E.
        k: experts per row, ``1 <= k <= E``.
    Returns:
        ``y`` (``x.shape[:-1] + (k,)``, dtype of x), ``expert_idx`` (int32, row/slot ->
        expert), ``row_idx`` (int32, the column-major slot ``j*n + r``).
    """
    lead, experts = x.shape[:-1], x.shape[-1]
    n = math.prod(lead)
    if x.dtype == np.float16 and not ranks_in_float32(experts, k):
        expert_idx, probs = _ranked_in_float16(x.reshape(n, experts), k)
    else:  # the probabilities of the chosen: weights w_j * 1.0, each the float32 score itself
        expert_idx, probs = gating.gate(x.reshape(n, experts), gating.SOFTMAX, k)
    if finished is not None:
        expert_idx[finished.reshape(n)] = experts
    y = buffers.empty((n, k), x.dtype)
    y[...] = probs  # round to nearest even
    row_idx = slot_rows(n, k)
    shape = lead + (k,)
    return y.reshape(shape), expert_idx.reshape(shape), row_idx.reshape(shape)


def _infer(sig: Signature) -> None:
    x, k = sig.input("x"), sig.attr("k")
    sig.require(k >= 1, f"k must be >= 1, got {k}")
    if x.shape is None:
        for name in ("y", "expert_idx", "row_idx"):
            sig.output(name, x.dtype if name == "y" else "int32", None)
        return
    lead, experts = x.shape[:-1], x.shape[-1]
    if isinstance(experts, int):
        sig.require(k <= experts, f"k must be <= E = {experts} (the last dim of x), got {k}")
    else:
        sig.defer("at_most", (k, experts), "k must be <= E, the last dim of x")
    if sig.has("finished"):
        finished = sig.input("finished").shape
        if finished is not None:
            sig.require(
                len(finished) == len(lead),
                f"finished must have the shape of x without its last dim {list(lead)}, got {list(finished)}",
            )
            for axis, (a, b) in enumerate(zip(finished, lead)):
                sig.same(a, b, f"finished dim {axis} must equal x dim {axis}")
    known = [d for d in lead if isinstance(d, int)]
    if len(known) == len(lead):
        rows = math.prod(known)
        sig.require(rows * k <= INT32_MAX, f"n*k = {rows * k} slots do not fit the int32 row_idx")
    shape = tuple(lead) + (k,)
    sig.output("y", x.dtype, shape)
    sig.output("expert_idx", "int32", shape)
    sig.output("row_idx", "int32", shape)


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    """aclnnMoeGatingTopKSoftmax.md: k <= 1024; Ascend 950: E in [1, 2048]."""
    found = []
    k = sig.attr("k")
    if k > MAX_K:
        found.append(f"k = {k} exceeds {MAX_K}")
    rank = sig.input("x").rank
    experts = None if rank is None else known_dim(sig, "x", rank - 1)
    if target.name == "ascend950" and experts is not None and experts > 2048:
        found.append(f"E = {experts} exceeds 2048 (the last dim of x)")
    return found


#: the 2 best of 4 experts for 3 tokens, by softmax of the router logits
_EXAMPLE = Example(
    inputs={
        "x": np.array([[0.1, 2.0, -1.0, 0.5], [1.5, 0.0, 0.3, 1.2], [0.0, 0.0, 3.0, 1.0]], np.float32),
    },
    attrs={"k": 2},
)


MOE_GATING_TOP_K_SOFTMAX = OpDef(
    "MoeGatingTopKSoftmax",
    __doc__,
    inputs=[
        Input("x", FLOATS, "[N, E] or [B, S, E] gating logits", (2, 3)),
        Input("finished", ("bool",), "x.shape[:-1]: rows whose experts become E", optional=True),
    ],
    outputs=[
        Output("y", FLOATS, "x.shape[:-1] + [k]: the k largest softmax probabilities, best first"),
        Output("expert_idx", ("int32",), "x.shape[:-1] + [k]: (row, slot) -> expert (E for finished rows)"),
        Output("row_idx", ("int32",), "x.shape[:-1] + [k]: the column-major slot j*n + r"),
    ],
    attrs=[Attr("k", "int", 1, "experts per row, 1 <= k <= E")],
    infer=_infer,
    kernel=moe_gating_top_k_softmax,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_GATING_TOP_K_SOFTMAX]
