"""GroupedMatmul in standard ONNX ops (SPEC-layer 1.9).

``X`` is widened to float32 once (onnxruntime has no float16/bfloat16 MatMul here), ``W``
once (types 2 and -1) or per group (type 0, the weights of the groups hit only), and
transposed where the node says so. ``off = [0] + cumsum(cnt)`` comes from ``group_list``
(checked: counts non-negative, cumsum non-decreasing, ``off[E]`` within the grouped axis);
every product runs inside a ``Loop``, which reads the offsets, so nothing multiplies before
the checks::

    group_type 0:  part_e = X[off[e]:off[e+1]] @ W[e] (+ bias[e]) for the groups with rows
                   only (W[e] gathered and widened alone; stored [N, K]: Gemm with transB),
                   appended to a sequence; y = Concat(ConcatFromSequence(parts), zeros [M - off[E], N])
    group_type 2:  y[e] = X[:, off[e]:off[e+1]] @ W[off[e]:off[e+1]]   (a scan output: [E, M, N])
    group_type -1: y = X @ W (+ bias)

then y is rounded once. MatMul's order of additions is onnxruntime's: float32 results differ
from the kernel's BLAS within float32 accumulation error.

Inlined, a group_type 0 node whose float32 weight is a constant initializer has no ``Loop``:
each expert's matrix is an initializer of its own (converters/expert_weights.py) and its group
one ``Gemm`` against it, which onnxruntime packs once (:func:`split_rows_over_expert_weights`).
"""

from __future__ import annotations

from onnx import helper

from .builder import FLOAT, INT64, Body, Specialisation, expert_weight

LOWERS = ("GroupedMatmul",)


def offsets(b: Body, node: Specialisation, limit: str, what: str) -> str:
    """``off [E + 1]`` int64 from group_list, checked against the grouped axis' size ``limit``."""
    values = b.Cast("group_list", to=INT64)
    if node.attr("group_list_type") == 1:
        # each count within the axis (as the kernel): their CumSum cannot wrap around in int64
        outside = b.Or(b.Less(values, b.ints([0])), b.Greater(values, limit))
        values = b.check(values, b.none_true(outside), f"group_list (counts) must be in [0, the {what}]")
        ends = b.CumSum(values, b.int64(0))
    else:
        ends = values
    off = b.Concat(b.ints([0]), ends, axis=0)
    # compared, not differenced: a difference of two huge values wraps around in int64
    falls = b.Less(b.Slice(off, b.ints([1]), b.ints([2**62])), b.Slice(off, b.ints([0]), b.ints([-1])))
    rule = "group_list (cumsum) must not decrease or start below 0"
    off = b.check(off, b.none_true(falls), rule)
    total = b.Slice(off, b.ints([-1]), b.ints([2**62]))
    return b.check(off, b.LessOrEqual(total, limit), f"the groups must cover at most the {what}")


def group_sizes(b: Body, off: str) -> str:
    """``[E]`` int64 rows of each group, ``off[e + 1] - off[e]``: the offsets are checked
    (non-decreasing, within the rows), so their differences cannot wrap around."""
    return b.Sub(b.Slice(off, b.ints([1]), b.ints([2**62])), b.Slice(off, b.ints([0]), b.ints([-1])))


def at(b: Body, values: str, index: str) -> str:
    """``values[index]`` as a ``[1]`` int64 (``index`` a scalar int64)."""
    return b.Gather(values, b.Unsqueeze(index, b.ints([0])), axis=0)


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("x")
    group_type = node.attr("group_type")
    x = b.widen("x", dtype)
    if node.attr("transpose_x"):
        x = b.Transpose(x, perm=[1, 0])
    if group_type == 0 and node.expert_weights:
        split_rows_over_expert_weights(b, node, x)
        return
    if group_type == 0:
        split_rows(b, node, x, dtype)
        return
    w = b.widen("weight", dtype)
    if node.attr("transpose_weight"):
        w = b.Transpose(w, perm=[1, 0])
    bias = b.widen("bias", node.dtype("bias")) if node.has("bias") else None
    if group_type == -1:  # no group_list, no index input for the dim rules to gate: gate x itself
        y = b.MatMul(b.shape_gate()(x), w)
        b.output("y", b.narrow(y if bias is None else b.Add(y, bias), dtype))
        return
    n = b.Shape(w, start=-1)
    off = offsets(b, node, *_grouped_axis(b, x, group_type))
    trips = b.Squeeze(b.Sub(b.Shape(off), b.ints([1])), b.ints([0]))  # E
    rows = b.dim(x, 0)

    def product(b: Body, e: str, parts: str):  # [M, k_e] @ [k_e, N]
        first, stop = at(b, off, e), at(b, off, b.Add(e, b.int64(1)))
        part = b.MatMul(b.Slice(x, first, stop, b.ints([1])), b.Slice(w, first, stop, b.ints([0])))
        return [b.SequenceInsert(parts, part)]

    # the sequence starts with one part ahead of the groups (ConcatFromSequence needs one)
    seed = b.full(b.Concat(rows, n, axis=0), 0.0, "float32")
    (parts,) = b.loop(trips, [(b.SequenceConstruct(seed), PARTS)], product)
    stacked = b.ConcatFromSequence(parts, axis=0, new_axis=1)  # [1 + E, M, N]
    b.output("y", b.narrow(b.Slice(stacked, b.ints([1]), b.ints([2**62])), dtype))


#: the Loop's carried sequence of float32 [rows, N] products
PARTS = helper.make_sequence_type_proto(helper.make_tensor_type_proto(FLOAT, [None, None]))


def split_rows(b: Body, node: Specialisation, x: str, dtype: str) -> None:
    """group_type 0: one product per non-empty group, ``X[off[e]:off[e+1]] @ W[e]``. Only the
    weights of the groups that have rows are read (a decode step hits a few experts of many),
    each widened alone, and a transposed ``[N, K]`` weight is multiplied as it is stored
    (``Gemm`` with ``transB``) rather than transposed whole first."""
    transposed = node.attr("transpose_weight") == 1
    n = b.Shape("weight", start=-2, end=-1) if transposed else b.Shape("weight", start=-1)
    bias = b.widen("bias", node.dtype("bias")) if node.has("bias") else None
    off = offsets(b, node, *_grouped_axis(b, x, 0))
    counts = group_sizes(b, off)
    groups = b.Squeeze(b.NonZero(b.Greater(counts, b.ints([0]))), b.ints([0]))  # [groups with rows]
    trips = b.Squeeze(b.Shape(groups), b.ints([0]))

    def product(b: Body, i: str, parts: str):  # [n_e, K] @ [K, N]
        e = b.Gather(groups, i, axis=0)
        first, stop = at(b, off, e), at(b, off, b.Add(e, b.int64(1)))
        rows, weight = b.Slice(x, first, stop, b.ints([0])), b.widen(b.Gather("weight", e, axis=0), dtype)
        part = b.Gemm(rows, weight, transB=1) if transposed else b.MatMul(rows, weight)
        if bias is not None:
            part = b.Add(part, b.Gather(bias, e, axis=0))
        return [b.SequenceInsert(parts, part)]

    # the sequence starts with an empty part (ConcatFromSequence needs one)
    seed = b.full(b.Concat(b.ints([0]), n, axis=0), 0.0, "float32")
    (parts,) = b.loop(trips, [(b.SequenceConstruct(seed), PARTS)], product)
    covered = b.ConcatFromSequence(parts, axis=0)  # [off[E], N]
    rest = b.full(b.Concat(b.Sub(b.dim(x, 0), b.Shape(covered, start=0, end=1)), n, axis=0), 0.0, "float32")
    b.output("y", b.narrow(b.Concat(covered, rest, axis=0), dtype))


def split_rows_over_expert_weights(b: Body, node: Specialisation, x: str) -> None:
    """group_type 0 against a constant float32 weight read as one initializer per expert
    (inline lowering, converters/expert_weights.py): ``X`` is split into its E groups (and
    the rows past ``off[E]``), and group e is multiplied by expert e's initializer, every
    expert by a node of its own. onnxruntime packs a constant ``MatMul``/``Gemm`` weight once,
    when the session starts, and multiplies an empty group for next to nothing; nothing is
    gathered or copied from the weights at run time (the ``Loop`` form copies each hit
    expert's weight before its product)."""
    experts, rows_of_w, columns_of_w = node.expert_weights
    transposed = node.attr("transpose_weight") == 1
    n = columns_of_w if not transposed else rows_of_w
    bias = b.widen("bias", node.dtype("bias")) if node.has("bias") else None
    off = offsets(b, node, *_grouped_axis(b, x, 0))
    counts = group_sizes(b, off)
    past = b.Sub(b.dim(x, 0), b.Slice(off, b.ints([-1]), b.ints([2**62])))  # rows past off[E]: zeros
    groups = b.op("Split", x, b.Concat(counts, past, axis=0), axis=0, outputs=experts + 1)
    parts = []
    for e in range(experts):
        part = b.Gemm(groups[e], expert_weight(e), transB=int(transposed))
        parts.append(part if bias is None else b.Add(part, b.Gather(bias, b.int64(e), axis=0)))
    zeros = b.full(b.Concat(past, b.ints([n]), axis=0), 0.0, "float32")
    b.output("y", b.narrow(b.Concat(*parts, zeros, axis=0), node.dtype("x")))


def _grouped_axis(b: Body, x: str, group_type: int) -> tuple[str, str]:
    """The grouped axis' size and its name: X's rows (type 0) or columns (type 2)."""
    if group_type == 2:
        return b.dim(x, 1), "columns of x (split K)"
    return b.dim(x, 0), "rows of x (split M)"
