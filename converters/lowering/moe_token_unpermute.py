"""MoeTokenUnpermute in standard ONNX ops (SPEC 1.12).

``sorted_indices [T*K]`` (src slot -> row) reshaped to ``[T, K]`` gathers each token's K rows
(``[T, K, H]``). A slot adds nothing when its row is ``>= A`` or its prob is 0 (the NPU does
not read such a row): it reads a zero row appended below the rows (only when some slot asks
for it, an ``If``: the append copies them) with weight 0. With probs a batched MatMul
``[T, 1, K] x [T, K, H]`` weights and adds the K rows in float32 (MatMul may fuse multiply and
add: a difference within float32 accumulation error); without probs K = 1 and ReduceSum over
K rounds the single term.
"""

from __future__ import annotations

from .builder import INT64, Body, Specialisation

LOWERS = ("MoeTokenUnpermute",)


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("permuted_tokens")
    rows = b.dim("permuted_tokens", 0)
    index = b.Cast("sorted_indices", to=INT64)
    index = b.check(index, b.none_true(b.Less(index, b.ints([0]))), "sorted_indices must be >= 0")
    slots = b.Shape(index)
    if node.has("probs"):
        tokens, top_k = b.dim("probs", 0), b.dim("probs", 1)
        rule = "probs [T, K] must have T*K = len(sorted_indices)"
        index = b.check(index, b.Equal(b.Mul(tokens, top_k), slots), rule)
        weights = b.flat(b.widen("probs", node.dtype("probs")))  # [T*K] float32
        skip = b.Or(b.GreaterOrEqual(index, rows), b.Equal(weights, b.scalar(0.0, "float32")))
    else:
        tokens, top_k = slots, b.ints([1])
        skip = b.GreaterOrEqual(index, rows)
    source = b.Where(skip, rows, index)  # a skipped slot reads row A, a zero row
    by_token = b.Reshape(source, b.Concat(tokens, top_k, axis=0))
    terms = b.gather_or_zero_rows("permuted_tokens", by_token, dtype, 3, b.none_true(skip))  # [T, K, H]
    if not node.has("probs"):
        b.output("unpermuted_tokens", b.sum_axis(terms, 1, dtype))
        return
    factor = b.Where(skip, b.scalar(0.0, "float32"), weights)
    by_slot = b.Reshape(factor, b.Concat(tokens, b.ints([1]), top_k, axis=0))  # [T, 1, K]
    summed = b.MatMul(by_slot, b.widen(terms, dtype))  # [T, 1, H]
    b.output("unpermuted_tokens", b.narrow(b.Squeeze(summed, b.ints([1])), dtype))
