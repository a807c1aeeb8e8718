"""SwiGlu in standard ONNX ops (SPEC-layer 1.10).

``x`` (widened to float32) is split in two along ``dim`` (``Split`` with sizes ``[F, F]``, F
half the size there, checked even: the sizes pass through the check, so nothing splits an odd
size); ``a`` is the gate: ``y = a * Sigmoid(a) * b``, rounded once.

onnxruntime's Sigmoid and the kernel's exp polynomial may differ in the last float32 place.
"""

from __future__ import annotations

from .builder import Body, Specialisation

LOWERS = ("SwiGlu",)


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
    a, other, _ = halves(b, "x", axis, dtype)
    b.output("y", b.narrow(b.Mul(b.Mul(a, b.Sigmoid(a)), other), dtype))
