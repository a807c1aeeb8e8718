"""MoeFinalizeRoutingV2: combine each token's K expert outputs into one row (SPEC-layer 1.8).

Index direction: ``expanded_row_idx`` is **src->dst**, the scatter index the dispatch ops
(MoeInitRoutingV2 / V3, MoeInitRouting v1) emit: the entry at source slot p holds the row of
``expanded_x`` that slot's copy went to, so this op reads it as a gather index. The slot of
(token i, choice j) is column-arranged in modes 0/1 (``p = j*R + i``, MoeInitRouting v1's
layout) and row-arranged in modes 2/3 (``p = i*K + j``, V2/V3 with ``row_idx_type`` 0)::

    K = scales.shape[1] if scales else k;   X = expanded_x.reshape(-1, H)  # [E, C, H] -> row e*C + c
    acc = f32(x1 + x2)                                                  # absent terms are 0
    for i in range(R): for j in range(K):
        d = expanded_row_idx[p(i, j)]
        row = 0 if d == -1 else X[d]                                    # -1 only in modes 1/3
        acc[i] += (scales[i, j] if scales else 1) * (row + (bias[expert_idx[i, j]] if bias else 0))
    y = cast(acc)

``R = scales.shape[0]`` with scales, else ``len(expanded_row_idx) // k``. A dropped slot (-1)
still adds ``scale * bias[e]``, as the NPU kernel does (it zero-fills the row, then adds the
bias). Destinations may repeat: the op only gathers. Modes 0/2 are dropless (``expanded_x
[rows, H]``, every index in ``[0, rows)``: on -1 the NPU would add stale data), modes 1/3
drop/pad (``[E, C, H]``, indices in ``[-1, E*C)``). float32 arithmetic (float64 for float64
input to the bare kernel): the skips added first, then the K products in j order, each
rounded to float32 before it is added; one round-to-nearest-even cast at the end. The NPU's
float16 kernels accumulate in float16, so compare them with a tolerance.
"""

from __future__ import annotations

import math

import numpy as np

from . import fused
from .dtypes import FLOATS
from .errors import BAD_DTYPE, MoeOpError
from .moe_init_routing_v2 import product
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature
from .targets import Target, known_dim

MODES = (0, 1, 2, 3)


def is_padded(drop_pad_mode: int) -> bool:
    """Modes 1 and 3 take the drop/pad layout ``[E, C, H]``."""
    return drop_pad_mode in (1, 3)


def slots_by_token(expanded_row_idx: np.ndarray, n_tokens: int, top_k: int, column_arranged: bool) -> np.ndarray:
    """``[R, K]`` int64: entry [i, j] is the row of ``expanded_x`` that token i's j-th copy went to."""
    index = expanded_row_idx.astype(np.int64)
    if column_arranged:  # p = j*R + i
        return index.reshape(top_k, n_tokens).T.copy()
    return index.reshape(n_tokens, top_k)


def require_rows(index: np.ndarray, n_rows: int, padded: bool, name: str = "expanded_row_idx") -> None:
    """Dropless: every index names a row, ``[0, n_rows)``; drop/pad: ``[-1, n_rows)``."""
    low = -1 if padded else 0
    bad = np.flatnonzero((index < low) | (index >= n_rows))
    if len(bad):
        p = int(bad[0])
        allowed = f"[-1, {n_rows}) (-1 = dropped)" if padded else f"[0, {n_rows}) (dropless: no -1)"
        raise MoeOpError(f"{name} values must be in {allowed}, got {index.flat[p]} at position {p}")


def moe_finalize_routing_v2(
    expanded_x, expanded_row_idx, x1=None, x2=None, bias=None, scales=None, expert_idx=None, *, drop_pad_mode=0, k=1
):
    """Sum each token's K rows of ``expanded_x``, scaled, plus the skip terms.

    Args:
        expanded_x: ``[R*K, H]`` (modes 0/2) or ``[E, C, H]`` (modes 1/3);
            float32/float16/bfloat16 (float64 for the bare kernel).
        expanded_row_idx: ``[R*K]`` int32, src->dst: slot p -> row of expanded_x.
        x1, x2: optional ``[R, H]``, expanded_x's dtype (x2 only with x1).
        bias: optional ``[E, H]``, expanded_x's dtype, with expert_idx.
        scales: optional ``[R, K]``, expanded_x's dtype (or float32 with bfloat16).
        expert_idx: optional ``[R, K]`` int32, the expert of each copy (indexes bias).
        drop_pad_mode: 0/1 column-arranged slots, 2/3 row-arranged; 1/3 drop/pad.
        k: K when scales is absent.
    Returns:
        ``(y,)``: ``[R, H]`` in expanded_x's dtype.
    """
    hidden = expanded_x.shape[-1]
    rows = expanded_x.reshape(math.prod(expanded_x.shape[:-1]), hidden)  # (-1 fails for H = 0)
    top_k = scales.shape[1] if scales is not None else k
    n_tokens = scales.shape[0] if scales is not None else len(expanded_row_idx) // k
    padded = is_padded(drop_pad_mode)
    require_rows(expanded_row_idx, len(rows), padded)
    source = slots_by_token(expanded_row_idx, n_tokens, top_k, drop_pad_mode in (0, 1))
    if bias is not None:
        require_experts(expert_idx, len(bias))
    return (fused.finalize_rows(rows, source, scales, bias, expert_idx, x1, x2),)


def require_experts(expert_idx: np.ndarray, n_experts: int) -> None:
    """Every expert id indexes a bias row: ``[0, E)``, E = bias dim 0."""
    bad = np.argwhere((expert_idx < 0) | (expert_idx >= n_experts))
    if len(bad):
        i, j = bad[0]
        raise MoeOpError(
            f"expert_idx must be in [0, E) = [0, {n_experts}) (E = bias dim 0), got {expert_idx[i, j]} at [{i}, {j}]"
        )


def token_count(sig: Signature, index_len: Dim) -> tuple[Dim, Dim]:
    """``(R, K)`` from scales or from ``k``, with the rules that tie them to the index length."""
    k = sig.attr("k")
    sig.require(k > 0, f"k must be > 0, got {k}")
    if sig.has("scales"):
        tokens, top_k = sig.dim("scales", 0), sig.dim("scales", 1)
        if isinstance(top_k, int):
            sig.require(k == 1 or k == top_k, f"k = {k} must be 1 or equal K = scales dim 1 = {top_k}")
        elif k != 1:
            sig.defer("equal", (top_k, k), f"k = {k} must be 1 or equal K = scales dim 1")
        slots = product(tokens, top_k)
        if slots is not None:
            sig.same(index_len, slots, "len(expanded_row_idx) must equal R*K (R, K = scales' shape)")
        elif isinstance(top_k, int):  # R symbolic: the lowered body checks R*K itself
            sig.quotient(index_len, top_k, "len(expanded_row_idx) must be R*K (K = scales dim 1)")
        return tokens, top_k
    tokens = sig.quotient(index_len, k, f"len(expanded_row_idx) must be R*k (k = {k})")
    return (index_len if tokens is None and k == 1 else tokens), k


def require_token_rows(sig: Signature, name: str, tokens: Dim, hidden: Dim, like: str) -> None:
    """Input ``name`` (when given) is ``[R, H]`` with ``like``'s dtype."""
    if not sig.has(name):
        return
    sig.same(sig.dim(name, 0), tokens, f"{name} must be [R, H]: dim 0")
    sig.same(sig.dim(name, 1), hidden, f"{name} must be [R, H]: dim 1")
    a, b = sig.input(name).dtype, sig.input(like).dtype
    if a is not None and b is not None:
        sig.require(a == b, f"{name} must have {like}'s dtype ({b}), got {a}", BAD_DTYPE)


def require_scales_dtype(sig: Signature, like: str) -> None:
    """scales has ``like``'s dtype, or is float32 when ``like`` is bfloat16."""
    s, t = sig.input("scales").dtype, sig.input(like).dtype
    if s is not None and t is not None:
        sig.require(
            s == t or (t == "bfloat16" and s == "float32"),
            f"scales must have {like}'s dtype ({t}), or be float32 when it is bfloat16; got {s}",
            BAD_DTYPE,
        )


def _infer(sig: Signature) -> None:
    mode = sig.attr("drop_pad_mode")
    x = sig.input("expanded_x")
    if x.shape is not None:
        want = 3 if is_padded(mode) else 2
        sig.require(
            len(x.shape) == want,
            f"expanded_x must be {'[E, C, H]' if want == 3 else '[R*K, H]'} in drop_pad_mode {mode}, "
            f"got shape {list(x.shape)}",
        )
    hidden = x.shape[-1] if x.shape else None
    tokens, top_k = token_count(sig, sig.dim("expanded_row_idx", 0))
    sig.require(not sig.has("x2") or sig.has("x1"), "x2 is given without x1 (x2 requires x1)")
    for name in ("x1", "x2"):
        require_token_rows(sig, name, tokens, hidden, "expanded_x")
    if sig.has("bias"):
        sig.require(sig.has("expert_idx"), "bias is given without expert_idx (which expert's bias each copy adds)")
        sig.same(sig.dim("bias", 1), hidden, "bias must be [E, H]: H = expanded_x's last dim")
        a, b = sig.input("bias").dtype, x.dtype
        if a is not None and b is not None:
            sig.require(a == b, f"bias must have expanded_x's dtype ({b}), got {a}", BAD_DTYPE)
    if sig.has("expert_idx"):
        sig.same(sig.dim("expert_idx", 0), tokens, "expert_idx must be [R, K]: dim 0")
        sig.same(sig.dim("expert_idx", 1), top_k, "expert_idx must be [R, K]: dim 1")
    if sig.has("scales"):
        require_scales_dtype(sig, "expanded_x")
    sig.output("y", x.dtype, (tokens, hidden))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    """E >= K (op-plugin's doc), where E is known: bias dim 0, or expanded_x dim 0 in drop/pad."""
    top_k = known_dim(sig, "scales", 1) if sig.has("scales") else sig.attr("k")
    experts = known_dim(sig, "bias", 0) if sig.has("bias") else None
    if experts is None and is_padded(sig.attr("drop_pad_mode")):
        experts = known_dim(sig, "expanded_x", 0)
    if experts is not None and top_k is not None and experts < top_k:
        return [f"E = {experts} experts is below K = {top_k} (the NPU needs E >= K)"]
    return []


#: 6 expert rows combined into 3 tokens: x1 + the scaled rows of each token's 2 slots
_EXAMPLE = Example(
    inputs={
        "expanded_x": np.arange(12, dtype=np.float32).reshape(6, 2),
        "expanded_row_idx": np.array([0, 3, 1, 4, 2, 5], np.int32),
        "x1": np.array([[0.5, 1.0], [2.0, -1.0], [-0.5, 3.0]], np.float32),
        "scales": np.array([[0.75, 0.25], [0.5, 0.5], [0.625, 0.375]], np.float32),
    },
    attrs={"k": 2},
)


MOE_FINALIZE_ROUTING_V2 = OpDef(
    "MoeFinalizeRoutingV2",
    __doc__,
    inputs=[
        Input("expanded_x", FLOATS, "[R*K, H] (modes 0/2) or [E, C, H] (modes 1/3) expert outputs", (2, 3)),
        Input("expanded_row_idx", ("int32",), "[R*K] src->dst: slot p -> row of expanded_x", (1,)),
        Input("x1", FLOATS, "[R, H] skip term (e.g. the shared expert)", (2,), optional=True),
        Input("x2", FLOATS, "[R, H] second skip term (only with x1)", (2,), optional=True),
        Input("bias", FLOATS, "[E, H] per-expert bias (with expert_idx)", (2,), optional=True),
        Input("scales", FLOATS, "[R, K] weight of each copy", (2,), optional=True),
        Input("expert_idx", ("int32",), "[R, K] expert of each copy (indexes bias)", (2,), optional=True),
    ],
    outputs=[Output("y", FLOATS, "[R, H] combined rows, expanded_x's dtype")],
    attrs=[
        Attr("drop_pad_mode", "int", 0, "0/1 column-arranged slots, 2/3 row-arranged; 1/3 drop/pad [E, C, H]", MODES),
        Attr("k", "int", 1, "K when scales is absent (aclnnMoeFinalizeRoutingV4's k)"),
    ],
    infer=_infer,
    kernel=moe_finalize_routing_v2,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_FINALIZE_ROUTING_V2]
