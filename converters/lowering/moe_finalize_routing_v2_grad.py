"""MoeFinalizeRoutingV2Grad in standard ONNX ops (SPEC-layer 1.8), row-arranged.

``slot_of_row [rows]`` is a ScatterElements of the slots into the rows they name (each row
once: checked), -1 where none. ``grad_expanded_x`` gathers grad_y by the token of each row's
slot (a zero row where there is none), times its scale; ``grad_scales`` is the dot of that
token's gradient with the row (``Mul`` + ``ReduceSum``, float32), scattered back to the slots,
plus the dot with the slot's bias row.
"""

from __future__ import annotations

from .builder import INT64, Body, Specialisation
from .moe_finalize_routing_v2 import rows_of

LOWERS = ("MoeFinalizeRoutingV2Grad",)


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("grad_y")
    padded = node.attr("drop_pad_mode") == 1
    active_num = node.attr("active_num")
    tokens = b.dim("grad_y", 0)
    index = b.Cast("expanded_row_idx", to=INT64)
    slots = b.Shape(index)
    top_k = b.Div(slots, b.safe_divisor(tokens))
    by_slot = b.Concat(tokens, top_k, axis=0)
    shape_ok = {}
    for name in ("scales", "expert_idx"):  # [R, K]; with R = 0, K is not known (any K)
        if node.has(name):
            no_tokens = b.Equal(tokens, b.ints([0]))
            ok = b.Or(b.all_equal(b.Shape(name), by_slot), b.And(no_tokens, b.Equal(b.dim(name, 0), tokens)))
            shape_ok[name] = ok
            index = b.check(index, ok, f"{name} must be [R, K]")
    experts = None
    if node.has("bias"):  # checked with or without scales, as the kernel: the index waits for it
        experts = b.Cast("expert_idx", to=INT64)
        outside = b.Or(b.Less(experts, b.ints([0])), b.GreaterOrEqual(experts, b.dim("bias", 0)))
        in_range, rule = b.none_true(outside), "expert_idx must be in [0, E) (E = bias dim 0)"
        index = b.check(index, in_range, rule)
        experts = b.check(b.check(experts, in_range, rule), shape_ok["expert_idx"], "expert_idx must be [R, K]")
    if padded:
        n_rows = b.ints([node.attr("expert_num") * node.attr("expert_capacity")])
        index = b.check_range(index, -1, n_rows, "expanded_row_idx values must be in [-1, E*C) (drop/pad)")
    else:
        n_rows = b.Min(b.ints([active_num]), slots) if active_num > 0 else slots
        index = b.check_range(index, 0, slots, "expanded_row_idx values must be in [0, R*K)")
    named = b.And(b.GreaterOrEqual(index, b.ints([0])), b.Less(index, n_rows))  # a row of the forward
    target = b.Where(named, index, n_rows)  # a skipped slot writes the spare row
    ones = b.full(slots, 1, "int64")
    seen = b.ScatterElements(b.full(b.Add(n_rows, b.ints([1])), 0, "int64"), target, ones, axis=0, reduction="add")
    twice = b.Greater(b.Slice(seen, b.ints([0]), n_rows), b.ints([1]))
    target = b.check(target, b.none_true(twice), "expanded_row_idx must name each row once (duplicates other than -1)")
    spare = b.full(b.Add(n_rows, b.ints([1])), -1, "int64")
    slot_of_row = b.Slice(b.ScatterElements(spare, target, b.arange(slots), axis=0), b.ints([0]), n_rows)
    has_slot = b.GreaterOrEqual(slot_of_row, b.ints([0]))
    token_of_row = b.Where(has_slot, b.Div(slot_of_row, b.safe_divisor(top_k)), tokens)  # T: the zero row
    shape = (
        b.Concat(b.ints([node.attr("expert_num"), node.attr("expert_capacity")]), b.dim("grad_y", 1), axis=0)
        if padded
        else b.Concat(n_rows, b.dim("grad_y", 1), axis=0)
    )
    if not node.has("scales"):
        gathered = b.Gather(b.zero_row_below("grad_y", dtype), token_of_row, axis=0)
        b.output("grad_expanded_x", b.Reshape(gathered, shape))
        return
    scales_dtype = node.dtype("scales")
    g = b.Gather(b.zero_row_below(b.widen("grad_y", dtype), "float32"), token_of_row, axis=0)  # [rows, H]
    zero = b.scalar(0.0, "float32")
    flat_scales = b.Concat(b.flat(b.widen("scales", scales_dtype)), b.Unsqueeze(zero, b.ints([0])), axis=0)
    factor = b.Gather(flat_scales, b.Where(has_slot, slot_of_row, slots), axis=0)  # no slot: the 0 below
    b.output("grad_expanded_x", b.Reshape(b.narrow(b.Mul(g, b.Unsqueeze(factor, b.ints([1]))), dtype), shape))
    if not node.wants("grad_scales"):
        return
    forward_rows = b.widen(rows_of(b, "expanded_x", padded), dtype)
    row_dot = b.Where(has_slot, b.ReduceSum(b.Mul(g, forward_rows), b.ints([1]), keepdims=0), zero)
    at_slot = b.Where(has_slot, slot_of_row, slots)  # rows without a slot write the spare
    dots = b.ScatterElements(b.full(b.Add(slots, b.ints([1])), 0.0, "float32"), at_slot, row_dot, axis=0)
    dots = b.Slice(dots, b.ints([0]), slots)
    if experts is not None:
        bias_rows = b.Gather(b.widen("bias", dtype), experts, axis=0)  # [R, K, H]
        token_grad = b.Unsqueeze(b.widen("grad_y", dtype), b.ints([1]))
        dots = b.Add(dots, b.flat(b.ReduceSum(b.Mul(token_grad, bias_rows), b.ints([2]), keepdims=0)))
    b.output("grad_scales", b.narrow(b.Reshape(dots, b.Shape("scales")), scales_dtype))
