"""MoeTokenPermuteGrad in standard ONNX ops (SPEC 1.11 (d)).

``input_grad[t] = sum_j rows[sorted_indices[t*K + j]]`` over the slots whose row is < M (the
gradient's rows). The index reshaped to ``[T, K]`` gathers the ``[T, K, H]`` terms from the
rows with a zero row appended (a cut-off slot reads row M, only when some slot asks for it:
the append copies the rows); ReduceSum over K adds them in float32, rounded once.
"""

from __future__ import annotations

from .builder import INT64, Body, Specialisation

LOWERS = ("MoeTokenPermuteGrad",)


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("permuted_output_grad")
    rows = b.dim("permuted_output_grad", 0)
    index = b.Cast("sorted_indices", to=INT64)
    index = b.check(index, b.none_true(b.Less(index, b.ints([0]))), "sorted_indices must be >= 0")
    cut = b.GreaterOrEqual(index, rows)
    source = b.Where(cut, rows, index)  # a cut-off slot reads row M, a zero row
    k = b.ints([node.attr("num_topk")])
    by_token = b.Reshape(source, b.Concat(b.Div(b.Shape(index), k), k, axis=0))
    terms = b.gather_or_zero_rows("permuted_output_grad", by_token, dtype, 3, b.none_true(cut))  # [T, K, H]
    b.output("input_grad", b.sum_axis(terms, 1, dtype))
