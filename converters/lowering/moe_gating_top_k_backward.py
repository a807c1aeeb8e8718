"""MoeGatingTopKBackward in standard ONNX ops (SPEC 1.14 (d)), in double, cast once to float.

    gs = rsf * grad_y;  w' = GatherElements(x_norm, expert_idx);  D = ReduceSum(w') + eps
    beta = ReduceSum(gs * w' / D);  gn = ScatterElements(zeros [T, E], expert_idx, (gs - beta) / D, "add")
    grad_x = x_norm * (1 - x_norm) * gn

``ScatterElements`` with ``reduction="add"`` sums the terms of an expert named twice in a row.
"""

from __future__ import annotations

from .builder import FLOAT, INT64, Body, Specialisation
from .gating import DOUBLE, take_along_rows

LOWERS = ("MoeGatingTopKBackward",)


def body(b: Body, node: Specialisation) -> None:
    experts = b.dim("x_norm", 1)
    index = b.check_range(b.Cast("expert_idx", to=INT64), 0, experts, "expert_idx must be in [0, E)")
    x_norm = b.Cast("x_norm", to=DOUBLE)
    scaled = b.Mul(b.Cast("grad_y", to=DOUBLE), b.scalar(node.attr("routed_scaling_factor"), "float64"))
    chosen = take_along_rows(b, x_norm, index)
    total = b.Add(b.ReduceSum(chosen, b.ints([1]), keepdims=1), b.scalar(node.attr("eps"), "float64"))
    beta = b.ReduceSum(b.Mul(scaled, b.Div(chosen, total)), b.ints([1]), keepdims=1)
    zeros = b.full(b.Shape("x_norm"), 0.0, "float64")
    spread = b.ScatterElements(zeros, index, b.Div(b.Sub(scaled, beta), total), axis=1, reduction="add")
    one = b.scalar(1.0, "float64")
    grad = b.Mul(b.Mul(x_norm, b.Sub(one, x_norm)), spread)
    b.output("grad_x", b.narrow(b.Cast(grad, to=FLOAT), node.dtype("grad_y")))
