"""SwiGlu: the SwiGLU activation of an expert's fused gate/up projection (SPEC-layer 1.10).

``x`` is split in two halves along ``dim``: the first half ``a`` is the gate (the one that is
activated), the second ``b`` the other half::

    a, b = split(f32(x), 2, axis=dim)
    y = cast(a * sigmoid(a) * b)            # y.shape = x.shape with shape[dim] halved

torch_npu's ``npu_swiglu`` has no ``activate_left`` flag: the left half is always the gate
(vllm-ascend, omni-infer, MindSpeed and cann-recipes-infer all call it with ``dim=-1`` on
``[gate | up]``). Arithmetic is float32 (float64 for float64 input to the bare kernel), the
products rounded in that order, the result rounded once to nearest even; sigmoid is
``1 / (1 + exp(-a))`` with a vectorised float32 exp (``fused_loops._sigmoid32``: within 2.5
float32 ulps of the exact sigmoid, tests/test_swi_glu.py);
as in float32 arithmetic, exp(-a) overflows to inf (sigmoid 0) for ``a < -88.7228``.
"""

from __future__ import annotations

import math

import numpy as np

from . import fused
from .dtypes import FLOATS
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .targets import Target

MAX_RANK = 8


def split_axis(shape: tuple, dim: int) -> tuple[int, int, int]:
    """``(outer, 2, inner)``: the shape as three axes around the two halves of ``dim``, so that
    ``x.reshape(outer, 2, inner)[:, 0]`` is the first half (C order)."""
    axis = dim % len(shape)
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1 :]) * (shape[axis] // 2)
    return outer, 2, inner


def swi_glu(x, *, dim=-1):
    """``a * sigmoid(a) * b`` of the two halves of ``x`` along ``dim``.

    Args:
        x: rank 1-8, float32/float16/bfloat16 (float64 for the bare kernel), even along ``dim``.
        dim: the axis split in halves, in ``[-rank, rank)``.
    Returns:
        ``(y,)``: ``x``'s shape with ``shape[dim]`` halved, ``x``'s dtype.
    """
    shape = list(x.shape)
    axis = dim % len(shape)
    shape[axis] //= 2
    y = fused.swiglu(x.reshape(split_axis(x.shape, dim)))
    return (y.reshape(shape),)


def check_dim(sig: Signature, name: str) -> int | None:
    """The rank rules and ``dim``'s range on input ``name``; the normalised axis (None when the
    rank is unknown). An odd size along it is refused where the size is known."""
    shape = sig.input(name).shape
    dim = sig.attr("dim")
    if shape is None:
        return None
    rank = len(shape)
    sig.require(1 <= rank <= MAX_RANK, f"{name} must have rank 1 to {MAX_RANK}, got shape {list(shape)}")
    sig.require(-rank <= dim < rank, f"dim must be in [-{rank}, {rank}) for {name} of shape {list(shape)}, got {dim}")
    axis = dim % rank
    size = shape[axis]
    if isinstance(size, int):
        sig.require(size % 2 == 0, f"{name} must have an even size along dim {dim}, got shape {list(shape)}")
    else:
        sig.defer("multiple", (size, 2), f"{name} must have an even size along dim")
    return axis


def halved(size):
    """``size / 2`` of a dim; None when symbolic (ONNX has no expression dims)."""
    return size // 2 if isinstance(size, int) else None


def _infer(sig: Signature) -> None:
    x = sig.input("x")
    axis = check_dim(sig, "x")
    if axis is None or x.shape is None:
        sig.output("y", x.dtype, None)
        return
    shape = list(x.shape)
    shape[axis] = halved(shape[axis])
    sig.output("y", x.dtype, tuple(shape))


def no_empty_tensor(sig: Signature, name: str) -> list[str]:
    """The NPU refuses empty tensors (op-plugin's npu_swiglu doc)."""
    shape = sig.input(name).shape
    if shape is not None and any(d == 0 for d in shape):
        return [f"{name} of shape {list(shape)} is empty (the NPU refuses empty tensors)"]
    return []


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    return no_empty_tensor(sig, "x")


#: a * sigmoid(a) * b of the halves a (the gate) and b of each row
_EXAMPLE = Example(
    inputs={
        "x": np.array([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, 2.0, -1.0]], np.float32),
    },
)


SWI_GLU = OpDef(
    "SwiGlu",
    __doc__,
    inputs=[Input("x", FLOATS, "[..., 2F, ...] the gate half, then the other half, along dim")],
    outputs=[Output("y", FLOATS, "x's shape with shape[dim] halved")],
    attrs=[Attr("dim", "int", -1, "the axis split in halves (the first half is the gate)")],
    infer=_infer,
    kernel=swi_glu,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [SWI_GLU]
