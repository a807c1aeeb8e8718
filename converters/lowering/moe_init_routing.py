"""MoeInitRouting (v1) in standard ONNX ops (SPEC 1.15).

Positions ``p = t*K + j`` of the flattened expert ids (F = T*K). The stable sort is ``TopK``
(ascending) on the unique int64 key ``(id + 2^31) * F + p`` (ids are any int32, sentinels
included), giving ``order[d] = p`` with ties by position, as in the kernel. Then

    expanded_expert_idx = Gather(ids, order);  q = Gather(row_idx, order)
    expanded_row_idx[q] = d                               (ScatterElements)
    expanded_x[d] = x[q[d] % T]                           for d < min(active_num, T) * K

``row_idx`` is checked to be a permutation of ``[0, F)`` (a histogram, ScatterElements "add").
"""

from __future__ import annotations

from .builder import INT32, INT64, Body, Specialisation
from .moe_init_routing_v2 import stable_order

LOWERS = ("MoeInitRouting",)


def body(b: Body, node: Specialisation) -> None:
    tokens, top_k = b.dim("x", 0), b.dim("expert_idx", 1)
    ids = b.flat(b.Cast("expert_idx", to=INT64))
    slots = b.Shape(ids)
    numbers = b.flat(b.Cast("row_idx", to=INT64))
    rule = "row_idx must be a permutation of [0, T*K)"
    numbers = b.check_range(numbers, b.ints([0]), slots, rule)
    seen = b.ScatterElements(b.full(slots, 0, "int64"), numbers, b.full(slots, 1, "int64"), axis=0, reduction="add")
    numbers = b.check(numbers, b.none_true(b.Greater(seen, b.ints([1]))), rule)  # F numbers, none twice: all once
    order = stable_order(b, b.Add(ids, b.ints([2**31])), slots)  # dst d -> position p
    b.output("expanded_expert_idx", b.Gather(b.flat("expert_idx"), order, axis=0))
    q = b.Gather(numbers, order, axis=0)
    row_idx = b.ScatterElements(b.full(slots, 0, "int64"), q, b.arange(slots), axis=0)  # q -> d
    b.output("expanded_row_idx", b.Cast(row_idx, to=INT32))
    kept = b.Slice(q, b.ints([0]), b.Mul(b.Min(tokens, b.ints([node.attr("active_num")])), top_k))
    b.output("expanded_x", b.Gather("x", b.Mod(kept, b.safe_divisor(tokens)), axis=0))
