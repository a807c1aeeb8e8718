"""SwiGluGrad in standard ONNX ops (SPEC-layer 1.10).

With ``a, b`` the float32 halves of ``x`` along ``dim`` (as the forward's body) and
``s = Sigmoid(a)``: ``x_grad = Concat(g*b*s*(1 + a*(1 - s)), g*a*s, dim)``, rounded once;
``y_grad`` is checked to be x's shape with ``dim`` halved before any use.
"""

from __future__ import annotations

from .builder import Body, Specialisation
from .swi_glu import halves, rank_of

LOWERS = ("SwiGluGrad",)


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("x")
    axis = node.attr("dim") % rank_of(node, "x")
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
