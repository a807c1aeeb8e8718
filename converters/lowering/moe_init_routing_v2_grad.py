"""MoeInitRoutingV2Grad in standard ONNX ops (SPEC 1.3).

``grad_x[t] = sum_j rows[expanded_row_idx[t*K + j]]`` with ``rows = grad_expanded_x`` as
``[R, H]``. The index is reshaped to ``[T, K]``, one Gather gives the ``[T, K, H]`` terms and
a ReduceSum over K adds them in float32 (float16/bfloat16 are widened by Cast first and the
sum rounded once). A skipped term (drop/pad and dropless: index -1; active: index >=
active_num) reads a zero row appended below ``rows``.
"""

from __future__ import annotations

from .builder import INT64, Body, Specialisation

LOWERS = ("MoeInitRoutingV2Grad",)


def body(b: Body, node: Specialisation) -> None:
    top_k, active_num = node.attr("top_k"), node.attr("active_num")
    drop_pad = node.attr("drop_pad_mode") == 1
    dtype = node.dtype("grad_expanded_x")
    rows = b.rows_of_slots("grad_expanded_x") if drop_pad else "grad_expanded_x"  # [R, H]
    n_rows = b.dim(rows, 0)
    index = b.Cast("expanded_row_idx", to=INT64)
    length = b.Shape(index)  # (its relation to top_k and the grad's rows: the dim rules)
    k = b.ints([top_k])
    if drop_pad:
        skip = b.Equal(index, b.ints([-1]))
        allowed = "-1 (dropped) or in [0, E*C)"
    elif active_num > 0:
        skip = b.GreaterOrEqual(index, b.ints([active_num]))
        allowed = f">= active_num = {active_num} (skipped) or in [0, rows)"
    else:
        skip = b.Equal(index, b.ints([-1]))
        allowed = "-1 (an inactive expert's copy, skipped) or in [0, rows of grad_expanded_x)"
    outside = b.Or(b.Less(index, b.ints([0])), b.GreaterOrEqual(index, n_rows))
    index = b.check(index, b.none_true(b.And(outside, b.Not(skip))), f"expanded_row_idx values must be {allowed}")
    source = b.Where(skip, n_rows, index)  # a skipped term reads the zero row below the rows
    source = b.Reshape(source, b.Concat(b.Div(length, k), k, axis=0))  # [T, K]
    if drop_pad or active_num > 0:
        terms = b.Gather(b.zero_row_below(rows, dtype), source, axis=0)  # [T, K, H]
    else:  # dropless: the zero row (a copy of the rows) only when some copy is skipped
        terms = b.gather_or_zero_rows(rows, source, dtype, 3, b.none_true(skip))
    b.output("grad_x", b.sum_axis(terms, 1, dtype))
