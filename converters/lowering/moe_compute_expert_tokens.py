"""MoeComputeExpertTokens in standard ONNX ops (SPEC 1.16).

``out[e] = count(sorted_experts <= e)``: for a sorted, non-negative list that is the inclusive
CumSum of the per-expert histogram (ScatterElements "add"; ids >= E go to a spare bin that is
cut off, as the kernel counts them for no expert).
"""

from __future__ import annotations

from .builder import INT32, INT64, Body, Specialisation

LOWERS = ("MoeComputeExpertTokens",)


def body(b: Body, node: Specialisation) -> None:
    experts = node.attr("num_experts")
    ids = b.Cast("sorted_experts", to=INT64)
    ids = b.check(ids, b.none_true(b.Less(ids, b.ints([0]))), "sorted_experts must be >= 0")
    later, earlier = b.Slice(ids, b.ints([1]), b.ints([2**62])), b.Slice(ids, b.ints([0]), b.ints([-1]))
    rule = "sorted_experts must be non-decreasing"
    ids = b.check(ids, b.none_true(b.Less(later, earlier)), rule)
    bins = b.Where(b.Less(ids, b.ints([experts])), ids, b.ints([experts]))
    ones = b.full(b.Shape(ids), 1, "int64")
    counts = b.ScatterElements(b.full(b.ints([experts + 1]), 0, "int64"), bins, ones, axis=0, reduction="add")
    ends = b.CumSum(b.Slice(counts, b.ints([0]), b.ints([experts])), b.int64(0))
    b.output("total_rows_before_expert", b.Cast(ends, to=INT32))
