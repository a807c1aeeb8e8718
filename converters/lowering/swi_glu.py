"""SwiGlu and SwiGluGrad in standard ONNX ops (SPEC-layer 1.10).

``x`` (widened to float32) is split in two along ``dim`` (``Split`` with sizes ``[F, F]``, F
half the size there, checked even: the sizes pass through the check, so nothing splits an odd
size); ``a`` is the gate::

    SwiGlu:      y = a * Sigmoid(a) * b                                   (rounded once)
    SwiGluGrad:  s = Sigmoid(a); x_grad = Concat(g*b*s*(1 + a*(1 - s)), g*a*s, dim)

onnxruntime's Sigmoid and the kernel's exp polynomial may differ in the last float32 place.
"""

from __future__ import annotations

from .builder import Body, Specialisation

LOWERS = ("SwiGlu", "SwiGluGrad")


def rank_of(node: Specialisation, name: str) -> int:
    rank = node.input_ranks[node.op.input_names.index(name)]
    assert rank is not None  # lower() refuses inputs of unknown rank
    return rank


def halves(b: Body, x: str, axis: int, dtype: str) -> tuple[str, str, str]:
    """``(a, b, [F, F])``: the two float32 halves of ``x`` along ``axis``, and their sizes."""
    size = b.dim(x, axis)
    half = b.Div(size, b.ints([2]))
    even = b.Equal(b.Mul(half, b.ints([2])), size)
    sizes = b.check(b.Concat(half, half, axis=0), even, "x must have an even size along dim")
    first, second = b.Split(b.widen(x, dtype), sizes, axis=axis, outputs=2)
    return first, second, sizes


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("x")
    axis = node.attr("dim") % rank_of(node, "x")
    if node.op.name == "SwiGlu":
        a, other, _ = halves(b, "x", axis, dtype)
        b.output("y", b.narrow(b.Mul(b.Mul(a, b.Sigmoid(a)), other), dtype))
        return
    a, other, sizes = halves(b, "x", axis, dtype)
    half = b.Slice(sizes, b.ints([0]), b.ints([1]))
    want = b.Concat(b.Shape("x", end=axis), half, b.Shape("x", start=axis + 1), axis=0)
    same = b.all_equal(b.Shape("y_grad"), want)  # (the ranks agree: lower() checked them)
    rule = "y_grad must be x's shape with dim halved"
    g = b.widen(b.Reshape("y_grad", b.check(want, same, rule)), dtype)  # (the check runs before any use of y_grad)
    s = b.Sigmoid(a)
    one = b.scalar(1.0, "float32")
    da = b.Mul(b.Mul(b.Mul(g, other), s), b.Add(one, b.Mul(a, b.Sub(one, s))))
    db = b.Mul(b.Mul(g, a), s)
    b.output("x_grad", b.narrow(b.Concat(da, db, axis=axis), dtype))
