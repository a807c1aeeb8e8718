"""MoeTokenUnpermuteGrad in standard ONNX ops (SPEC 1.12 (d)).

Slot p (token ``t = p // K``) read row ``d = sorted_indices[p]``; slots with ``d >= A`` are
unused and write a spare row A that is cut off.

    no probs (K = 1): each row is slot d's gradient row. When no row is named twice (``If``) a
              Gather by ``row_slot[d]`` (the slot naming row d, T for none: a zero row
              appended to the gradient) copies it bit-exact; otherwise ScatterND
              (reduction "add", in slot order, as the kernel) adds the slots' rows in float32.
    probs:    permuted_tokens_grad: the slot rows ``probs[t, j] * g[t]`` (float32, rounded once),
              gathered by ``row_slot`` when every row is named exactly once (``If``), else added
              (ScatterND "add"); probs_grad[t, j] = sum_h g[t, h] * permuted_tokens[d, h] (in
              float32: a batched MatMul ``[T, K, H] x [T, H, 1]``, which may fuse multiply and add;
              0 for an unused slot, which reads a zero row). The rows read are gathered in their
              own dtype and widened after: no float32 copy of the whole of permuted_tokens.
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
    hidden = b.dim("unpermuted_tokens_grad", 1)
    grad = b.Unsqueeze(b.widen("unpermuted_tokens_grad", dtype), b.ints([1]))  # [T, 1, H] float32
    if node.wants("probs_grad"):  # row dots as a batched MatMul [T, K, H] x [T, H, 1]: no [F, H] copy of g
        every_used = b.none_true(b.Not(used))
        read = b.gather_or_zero_rows("permuted_tokens", target, dtype, 2, every_used)  # [F, H], own dtype
        by_token = b.Reshape(b.widen(read, dtype), b.Concat(tokens, top_k, hidden, axis=0))
        dots = b.MatMul(by_token, b.Transpose(grad, perm=[0, 2, 1]))  # [T, K, 1]
        b.output("probs_grad", b.narrow(b.Reshape(dots, b.Shape("probs")), probs_dtype))
    factor = b.Unsqueeze(b.widen("probs", probs_dtype), b.ints([2]))  # [T, K, 1]
    flat_rows = b.Concat(slots, hidden, axis=0)
    # every row named by exactly one slot (a permutation, the usual case): a Gather of the scaled
    # slot rows by row_slot; otherwise the slots' rows are added (ScatterND "add" in float32)
    ones = b.full(slots, 1, "int64")
    named = b.ScatterElements(b.full(b.Add(rows, b.ints([1])), 0, "int64"), target, ones, axis=0, reduction="add")
    once = b.all_equal(b.Slice(named, b.ints([0]), rows), b.ints([1]))
    row_slot = b.ScatterElements(b.full(b.Add(rows, b.ints([1])), 0, "int64"), target, b.arange(slots), axis=0)
    row_slot = b.Slice(row_slot, b.ints([0]), rows)

    def gather_scaled(b: Body) -> str:  # each product rounded once, as the kernel
        return b.Gather(b.Reshape(b.narrow(b.Mul(grad, factor), dtype), flat_rows), row_slot, axis=0)

    def add_scaled(b: Body) -> str:
        return b.narrow(b.scatter_add_rows(b.Reshape(b.Mul(grad, factor), flat_rows), target, rows), dtype)

    grad_rows = b.If(once, then_branch=b.branch(gather_scaled, dtype, 2), else_branch=b.branch(add_scaled, dtype, 2))
    b.output("permuted_tokens_grad", grad_rows)
