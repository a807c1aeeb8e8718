"""MoeFinalizeRoutingV2 in standard ONNX ops (SPEC-layer 1.8).

Forward: ``X = expanded_x`` as ``[rows, H]``; the src->dst index as ``[R, K]`` (modes 2/3:
a Reshape of slot ``i*K + j``; modes 0/1: slot ``j*R + i``, a Reshape to ``[K, R]`` and a
Transpose), a dropped slot (-1, modes 1/3) reading a zero row appended below X. One Gather
gives the ``[R, K, H]`` terms (float32), plus the gathered bias rows; with scales a batched
``MatMul [R, 1, K] x [R, K, H]`` weights and adds them (as the unpermute's body), without a
ReduceSum over K; then the skips are added and the sum rounded once. The kernel adds the skips
first: the float32 sums may differ within accumulation error.
"""

from __future__ import annotations

from .builder import INT64, Body, Specialisation

LOWERS = ("MoeFinalizeRoutingV2",)


def rows_of(b: Body, x: str, padded: bool) -> str:
    """``[rows, H]``: the rows of ``x`` (``[E, C, H]`` flattened in drop/pad)."""
    return b.rows_of_slots(x) if padded else x


def check_experts(b: Body, node: Specialisation, experts: str) -> str:
    """``expert_idx`` as int64, checked to lie in ``[0, E)`` (E = bias dim 0)."""
    index = b.Cast("expert_idx", to=INT64)
    return b.check_range(index, b.ints([0]), experts, "expert_idx must be in [0, E) (E = bias dim 0)")


def check_shapes(b: Body, node: Specialisation, index: str, shapes: dict[str, str]) -> str:
    """``index`` gated by the rule that each present input ``name`` has shape ``shapes[name]``
    (a 1-D int64 value): the ``[R, H]`` / ``[R, K]`` rules symbolic dims leave to run time."""
    for name, want in shapes.items():
        if node.has(name):
            index = b.check(index, b.all_equal(b.Shape(name), want), f"{name} must be {_SHAPES[name]}")
    return index


_SHAPES = {"x1": "[R, H]", "x2": "[R, H]", "expert_idx": "[R, K]", "scales": "[R, K]"}


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("expanded_x")
    mode = node.attr("drop_pad_mode")
    padded = mode in (1, 3)
    rows = rows_of(b, "expanded_x", padded)
    n_rows, hidden = b.dim(rows, 0), b.dim(rows, 1)
    index = b.Cast("expanded_row_idx", to=INT64)
    slots = b.Shape(index)
    if padded:
        index = b.check_range(index, -1, n_rows, "expanded_row_idx values must be in [-1, E*C) (drop/pad)")
        index = b.Where(b.Equal(index, b.ints([-1])), n_rows, index)  # a dropped slot reads the zero row
        rows = b.zero_row_below(rows, dtype)
    else:
        index = b.check_range(index, 0, n_rows, "expanded_row_idx values must be in [0, rows of expanded_x)")
    if node.has("scales"):
        tokens, top_k = b.dim("scales", 0), b.dim("scales", 1)
        index = b.check(index, b.Equal(b.Mul(tokens, top_k), slots), "len(expanded_row_idx) must equal R*K")
    else:
        top_k = b.ints([node.attr("k")])
        tokens = b.Div(slots, top_k)
    token_rows = b.Concat(tokens, b.dim(rows, 1), axis=0)
    shapes = {"x1": token_rows, "x2": token_rows, "expert_idx": b.Concat(tokens, top_k, axis=0)}
    index = check_shapes(b, node, index, shapes)
    by_slot = (
        b.Reshape(index, b.Concat(tokens, top_k, axis=0))
        if mode in (2, 3)
        else b.Transpose(b.Reshape(index, b.Concat(top_k, tokens, axis=0)), perm=[1, 0])
    )  # [R, K]: the row of token i's j-th copy
    terms = b.widen(b.Gather(rows, by_slot, axis=0), dtype)  # [R, K, H]
    if node.has("bias"):
        experts = check_shapes(b, node, check_experts(b, node, b.dim("bias", 0)), {"expert_idx": shapes["expert_idx"]})
        terms = b.Add(terms, b.Gather(b.widen("bias", dtype), experts, axis=0))
    if node.has("scales"):
        weights = b.Unsqueeze(b.widen("scales", node.dtype("scales")), b.ints([1]))  # [R, 1, K]
        total = b.Squeeze(b.MatMul(weights, terms), b.ints([1]))
    else:
        total = b.ReduceSum(terms, b.ints([1]), keepdims=0)
    for skip in ("x1", "x2"):
        if node.has(skip):
            total = b.Add(total, b.widen(skip, dtype))
    del hidden
    b.output("y", b.narrow(total, dtype))
