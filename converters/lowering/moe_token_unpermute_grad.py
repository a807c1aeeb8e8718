"""MoeTokenUnpermuteGrad in standard ONNX ops (SPEC 1.12 (d)).

Slot p (token ``t = p // K``) read row ``d = sorted_indices[p]``; slots with ``d >= A`` are
unused and write a spare row A that is cut off.

    no probs (K = 1): each row is slot d's gradient row. When no row is named twice (``If``) a
              Gather by ``row_slot[d]`` (the slot naming row d, T for none: a zero row
              appended to the gradient) copies it bit-exact; otherwise ScatterND
              (reduction "add", in slot order, as the kernel) adds the slots' rows in float32.
    probs:    permuted_tokens_grad = ScatterND-add of ``probs[t, j] * g[t]`` (float32, rounded
              once); probs_grad[t, j] = sum_h g[t, h] * permuted_tokens[d, h] (Mul + ReduceSum,
              float32; 0 for an unused slot, which reads a zero row).
"""

from __future__ import annotations

from .builder import INT64, Body, Specialisation

LOWERS = ("MoeTokenUnpermuteGrad",)


def _rows(b: Body, node: Specialisation, slots: str) -> str:
    """``[1]`` int64 A: permuted_tokens' rows, else permuted_tokens_num, else len(sorted_indices)."""
    if node.has("permuted_tokens"):
        return b.dim("permuted_tokens", 0)
    given = node.attr("permuted_tokens_num")
    return b.ints([given]) if given >= 0 else slots


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("unpermuted_tokens_grad")
    tokens = b.dim("unpermuted_tokens_grad", 0)
    index = b.Cast("sorted_indices", to=INT64)
    index = b.check(index, b.none_true(b.Less(index, b.ints([0]))), "sorted_indices must be >= 0")
    slots = b.Shape(index)
    rows = _rows(b, node, slots)
    top_k = b.dim("probs", 1) if node.has("probs") else b.ints([1])
    rule = "len(sorted_indices) must equal T*K (T = unpermuted_tokens_grad dim 0, K = probs dim 1 or 1)"
    index = b.check(index, b.Equal(b.Mul(tokens, top_k), slots), rule)
    used = b.Less(index, rows)
    target = b.Where(used, index, rows)  # an unused slot writes (or reads) the spare row A
    if not node.has("probs"):
        ones = b.full(slots, 1, "int64")
        named = b.ScatterElements(b.full(b.Add(rows, b.ints([1])), 0, "int64"), target, ones, axis=0, reduction="add")
        once = b.none_true(b.Greater(b.Slice(named, b.ints([0]), rows), b.ints([1])))
        # row d <- slot row_slot[d] (T: none, the zero row); several slots per row are summed
        row_slot = b.ScatterElements(b.Expand(tokens, b.Add(rows, b.ints([1]))), target, b.arange(slots), axis=0)
        row_slot = b.Slice(row_slot, b.ints([0]), rows)
        copied = b.branch(
            lambda b: b.Gather(b.zero_row_below("unpermuted_tokens_grad", dtype), row_slot, axis=0), dtype, 2
        )
        summed = b.branch(lambda b: b.scatter_add_rows("unpermuted_tokens_grad", target, rows, dtype), dtype, 2)
        b.output("permuted_tokens_grad", b.If(once, then_branch=copied, else_branch=summed))
        return

    probs_dtype = node.dtype("probs")
    slot_token = b.Div(b.arange(slots), b.safe_divisor(top_k))
    slot_grad = b.Gather(b.widen("unpermuted_tokens_grad", dtype), slot_token, axis=0)  # [F, H] float32
    weights = b.flat(b.widen("probs", probs_dtype))
    scaled = b.Mul(slot_grad, b.Unsqueeze(weights, b.ints([1])))
    b.output("permuted_tokens_grad", b.narrow(b.scatter_add_rows(scaled, target, rows), dtype))
    if node.wants("probs_grad"):
        read = b.Gather(b.zero_row_below(b.widen("permuted_tokens", dtype), "float32"), target, axis=0)  # [F, H]
        dots = b.ReduceSum(b.Mul(slot_grad, read), b.ints([1]), keepdims=0)
        b.output("probs_grad", b.narrow(b.Reshape(dots, b.Shape("probs")), probs_dtype))
