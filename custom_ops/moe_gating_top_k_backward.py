"""MoeGatingTopKBackward: the gradient of MoeGatingTopK's ``y`` with respect to ``x``, sigmoid
scores only (SPEC 1.14 (d); aclnnMoeGatingTopKBackward.md).

Shapes. ``x_norm [T, E]`` float32 (the forward's ``out``: the sigmoid scores), ``grad_y [T, K]``
float32/float16/bfloat16 (the gradient of ``y``), ``expert_idx [T, K]`` int32 (token, slot ->
expert, the forward's). Output ``grad_x [T, E]`` in the dtype of ``grad_y``.

    gs = routed_scaling_factor * grad_y
    w' = x_norm[t, expert_idx[t, :]];  D = sum(w') + eps;  beta = sum(gs * w'/D)
    gn[t, expert_idx[t, j]] += (gs[t, j] - beta) / D      (an expert named twice gets both terms)
    grad_x = x_norm * (1 - x_norm) * gn

evaluated in float64 and rounded once to float32, then to the dtype of grad_y (the NPU works in
float32). The selection and the bias get no gradient. ``norm_type`` must be 1: the NPU has no
backward for the softmax or sqrt-softplus scores. ``renorm`` is accepted and has no effect (a
sigmoid result is always renormalised; aclnn reserves it).
"""

from __future__ import annotations

import numpy as np

from . import buffers, gating
from .dtypes import FLOATS
from .errors import MoeOpError
from .fused import carrier
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .parallel import for_row_ranges
from .targets import Target, known_dim


def moe_gating_top_k_backward(
    x_norm, grad_y, expert_idx, *, renorm=0, norm_type=1, routed_scaling_factor=1.0, eps=1e-20
):
    """``grad_x [T, E]`` (dtype of grad_y) from the sigmoid scores, the gradient of y and the
    chosen experts (the module docstring's formula)."""
    tokens, experts = x_norm.shape
    bad = np.flatnonzero(expert_idx.view(f"u{expert_idx.itemsize}") >= experts)  # negative: a huge unsigned
    if len(bad):
        t, j = divmod(int(bad[0]), expert_idx.shape[1])
        raise MoeOpError(f"expert_idx must be in [0, E) = [0, {experts}), got {expert_idx[t, j]} at [{t}, {j}]")
    grad, grad_kind = carrier(grad_y)
    # float32 gradients are the output itself; others are rounded from a float32 work array
    grad_x32 = (buffers.empty if grad_y.dtype == np.float32 else np.empty)((tokens, experts), np.float32)

    def work(first: int, stop: int) -> None:
        gating.loops().sigmoid_backward(
            x_norm[first:stop],
            grad[first:stop],
            grad_kind,
            expert_idx[first:stop],
            float(routed_scaling_factor),
            float(eps),
            grad_x32[first:stop],
        )

    for_row_ranges(work, tokens, experts * 16)
    if grad_y.dtype == np.float32:
        return (grad_x32,)
    grad_x = buffers.empty((tokens, experts), grad_y.dtype)
    grad_x[...] = grad_x32  # round to nearest even
    return (grad_x,)


def _infer(sig: Signature) -> None:
    tokens, experts = sig.dim("x_norm", 0), sig.dim("x_norm", 1)
    sig.same(sig.dim("grad_y", 0), tokens, "grad_y [T, K] and x_norm [T, E] must have the same T")
    for axis in (0, 1):
        sig.same(
            sig.dim("expert_idx", axis),
            sig.dim("grad_y", axis),
            f"expert_idx and grad_y must have the same shape [T, K] (dim {axis})",
        )
    sig.output("grad_x", sig.input("grad_y").dtype, (tokens, experts))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    """aclnnMoeGatingTopKBackward.md: N in [2, 2048], K in [1, N], no empty tensors."""
    found = []
    tokens, experts, top_k = known_dim(sig, "x_norm", 0), known_dim(sig, "x_norm", 1), known_dim(sig, "grad_y", 1)
    if tokens == 0:
        found.append("empty tensors (T = 0) are not supported")
    if experts is not None and not 2 <= experts <= 2048:
        found.append(f"E = {experts} is outside [2, 2048]")
    if top_k is not None and experts is not None and not 1 <= top_k <= experts:
        found.append(f"K = {top_k} is outside [1, E] = [1, {experts}]")
    return found


#: the gradient of the sigmoid gate's weights back onto its 4 logits
_EXAMPLE = Example(
    inputs={
        "x_norm": np.array([[0.5, 0.9, 0.25, 0.6], [0.8, 0.5, 0.6, 0.75], [0.5, 0.5, 0.95, 0.7]], np.float32),
        "grad_y": np.array([[1.0, 0.5], [1.0, -1.0], [0.25, 2.0]], np.float32),
        "expert_idx": np.array([[1, 3], [0, 3], [2, 3]], np.int32),
    },
    attrs={"norm_type": 1},
)


MOE_GATING_TOP_K_BACKWARD = OpDef(
    "MoeGatingTopKBackward",
    __doc__,
    inputs=[
        Input("x_norm", ("float32",), "[T, E] the forward's sigmoid scores (its out)", (2,)),
        Input("grad_y", FLOATS, "[T, K] gradient of the forward's y", (2,)),
        Input("expert_idx", ("int32",), "[T, K] the forward's (token, slot) -> expert", (2,)),
    ],
    outputs=[Output("grad_x", FLOATS, "[T, E] gradient of the forward's x (dtype of grad_y)")],
    attrs=[
        Attr("renorm", "int", 0, "the forward's renorm (no effect with sigmoid scores)", (0, 1)),
        Attr("norm_type", "int", 1, "the forward's norm_type: 1 (sigmoid), the only one with a backward", (1,)),
        Attr("routed_scaling_factor", "float", 1.0, "the forward's factor of y"),
        Attr("eps", "float", 1e-20, "the forward's eps"),
    ],
    infer=_infer,
    kernel=moe_gating_top_k_backward,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_GATING_TOP_K_BACKWARD]
