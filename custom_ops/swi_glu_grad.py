"""SwiGluGrad: the gradient of SwiGlu with respect to its input (SPEC-layer 1.10).

With ``a, b`` the two halves of ``x`` along ``dim`` (the gate first) and ``g = y_grad``::

    s = sigmoid(a)
    da = g * b * s * (1 + a * (1 - s))      # d(a * s * b)/da, the exact derivative
    db = g * a * s
    x_grad = cast(concat([da, db], dim))    # x's shape and dtype

The printed aclnnSwiGluGrad formula, ``sigmoid(A) + sigmoid(A) * (1 - sigmoid(A) * A)``, has a
misplaced parenthesis (SPEC-layer 1.10, contradiction 1); this is the derivative, so the op
agrees with autograd of SwiGlu. float32 arithmetic (float64 for float64 input to the bare
kernel), products rounded left to right, each half rounded once to nearest even. ``y_grad``
has ``x``'s dtype (aclnnSwiGluGrad: the same dtype).
"""

from __future__ import annotations

import numpy as np

from . import fused
from .dtypes import FLOATS
from .errors import BAD_DTYPE
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .swi_glu import check_dim, halved, no_empty_tensor, split_axis
from .targets import Target


def swi_glu_grad(y_grad, x, *, dim=-1):
    """The gradient of ``swi_glu(x, dim=dim)`` for the cotangent ``y_grad``.

    Args:
        y_grad: ``x``'s shape with ``shape[dim]`` halved, ``x``'s dtype.
        x: the forward's input (rank 1-8, even along ``dim``).
        dim: the forward's ``dim``.
    Returns:
        ``(x_grad,)``: ``x``'s shape and dtype.
    """
    outer, _, inner = split_axis(x.shape, dim)
    x_grad = fused.swiglu_grad(y_grad.reshape(outer, inner), x.reshape(outer, 2, inner))
    return (x_grad.reshape(x.shape),)


def _infer(sig: Signature) -> None:
    x, grad = sig.input("x"), sig.input("y_grad")
    axis = check_dim(sig, "x")
    if x.dtype is not None and grad.dtype is not None:
        sig.require(grad.dtype == x.dtype, f"y_grad must have x's dtype ({x.dtype}), got {grad.dtype}", BAD_DTYPE)
    if axis is not None and x.shape is not None and grad.shape is not None:
        want = list(x.shape)
        want[axis] = halved(want[axis])
        sig.require(
            len(grad.shape) == len(want),
            f"y_grad must have x's rank {len(want)} (x's shape with dim {sig.attr('dim')} halved), "
            f"got shape {list(grad.shape)}",
        )
        for i, (got, expected) in enumerate(zip(grad.shape, want)):
            if i == axis and expected is None:  # half of a symbolic size: the lowering checks it
                continue
            sig.same(got, expected, f"y_grad must be x's shape with dim {sig.attr('dim')} halved: dim {i}")
    sig.output("x_grad", x.dtype, x.shape)


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    return no_empty_tensor(sig, "x")


#: the gradient of SwiGlu with respect to its input
_EXAMPLE = Example(
    inputs={
        "y_grad": np.array([[1.0, 1.0], [0.5, -1.0]], np.float32),
        "x": np.array([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, 2.0, -1.0]], np.float32),
    },
)


SWI_GLU_GRAD = OpDef(
    "SwiGluGrad",
    __doc__,
    inputs=[
        Input("y_grad", FLOATS, "gradient of SwiGlu's y: x's shape with shape[dim] halved"),
        Input("x", FLOATS, "SwiGlu's input"),
    ],
    outputs=[Output("x_grad", FLOATS, "gradient of x: x's shape and dtype")],
    attrs=[Attr("dim", "int", -1, "SwiGlu's dim")],
    infer=_infer,
    kernel=swi_glu_grad,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [SWI_GLU_GRAD]
