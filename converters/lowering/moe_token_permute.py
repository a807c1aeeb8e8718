"""MoeTokenPermute in standard ONNX ops (SPEC 1.11).

Slots ``p = t*K + j`` of the flattened ids (F = T*K). ONNX has no stable sort, so ``TopK``
(ascending, sorted) runs on the unique int64 key ``id * F + p``, whose order is the stable
argsort ``first[d] = p`` (ties by slot, as in the kernel). int64 ids are first replaced by
their rank among the distinct ids (``Unique``'s inverse indices), so the key cannot overflow.

    sorted_indices[first[d]] = d                        (ScatterElements: src slot -> dst row)
    permuted_tokens[d] = tokens[first[d] // K]          for d < M (Slice of first, then Gather)
"""

from __future__ import annotations

from .builder import INT32, INT64, Body, Specialisation
from .moe_init_routing_v2 import stable_order

LOWERS = ("MoeTokenPermute",)


def input_rank(node: Specialisation, name: str) -> int | None:
    return node.input_ranks[node.op.input_names.index(name)]


def body(b: Body, node: Specialisation) -> None:
    n = node.attr("num_out_tokens")
    ids = b.flat(b.Cast("indices", to=INT64))  # [F]
    ids = b.check(ids, b.none_true(b.Less(ids, b.ints([0]))), "indices must be >= 0 (expert ids)")
    slots = b.Shape(ids)
    top_k = b.ints([1]) if input_rank(node, "indices") == 1 else b.dim("indices", 1)
    if node.dtype("indices") == "int64":  # id * F could overflow: sort the ids' ranks instead
        _, _, ids, _ = b.op("Unique", ids, outputs=4, sorted=1)
    first = stable_order(b, ids, slots)  # dst d -> src p
    if n < 0:
        rule = f"num_out_tokens = {n} < 0 must keep F + n > 0 rows of the F = T*K slots"
        first = b.check(first, b.Greater(b.Add(slots, b.ints([n])), b.ints([0])), rule)
    positions = b.arange(slots)
    sorted_indices = b.ScatterElements(b.full(slots, 0, "int64"), first, positions, axis=0)
    b.output("sorted_indices", b.Cast(sorted_indices, to=INT32))
    kept = first if n == 0 else b.Slice(first, b.ints([0]), b.ints([n]))  # n < 0: up to F + n
    b.output("permuted_tokens", b.Gather("tokens", b.Div(kept, b.safe_divisor(top_k)), axis=0))
