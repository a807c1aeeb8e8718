"""MoeFinalizeRoutingV2Grad: the gradients of MoeFinalizeRoutingV2 for its rows and scales
(SPEC-layer 1.8 (d); CANN's aclnnMoeFinalizeRoutingV2Grad).

Row-arranged slots only: slot ``p = i*K + j`` of token i's j-th copy, and ``expanded_row_idx``
is src->dst (slot -> row of ``expanded_x``), as the forward reads it in its modes 2/3 (this
op's ``drop_pad_mode`` 0 / 1). For the forward's column-arranged modes 0/1, convert the index
first: ``idx.reshape(K, R).T.reshape(-1)``. With ``X = expanded_x.reshape(-1, H)``::

    for p: i, j = divmod(p, K); d = idx[p]; ok = 0 <= d < rows(X)
        if ok: grad_expanded_x[d] = grad_y[i] * (scales[i, j] if scales else 1)   # other rows 0
        if scales: grad_scales[i, j] = sum_h grad_y[i, h] * ((X[d, h] if ok else 0)
                                                             + (bias[expert_idx[i, j], h] if bias else 0))

``grad_expanded_x`` is ``[rows, H]`` in mode 0, ``rows = active_num`` when ``0 < active_num <
R*K`` (the forward kept the first rows only; slots past them are skipped), else ``R*K``; and
``[expert_num, expert_capacity, H]`` in mode 1 (-1 slots, the dropped copies, are skipped).
A row may receive one slot only (duplicates other than -1 are refused). The gradient of x1
and x2 is grad_y itself; CANN computes none for bias. float32 arithmetic (float64 for the
bare kernel): products rounded once; the dots summed pairwise in a fixed order, the bias
dot added after the row's; ``grad_scales`` has the dtype of ``scales``.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .dtypes import FLOATS
from .errors import BAD_DTYPE, MoeOpError
from .moe_finalize_routing_v2 import require_experts, require_scales_dtype
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature
from .parallel import gather_rows
from .routing_map import optional_output


def moe_finalize_routing_v2_grad(
    grad_y,
    expanded_row_idx,
    expanded_x=None,
    scales=None,
    expert_idx=None,
    bias=None,
    *,
    drop_pad_mode=0,
    active_num=0,
    expert_num=0,
    expert_capacity=0,
):
    """Gradients of the forward's ``expanded_x`` and ``scales`` from that of its ``y``.

    Args:
        grad_y: ``[R, H]`` float32/float16/bfloat16 (float64 for the bare kernel).
        expanded_row_idx: ``[R*K]`` int32, src->dst, row-arranged (slot i*K + j -> row).
        expanded_x: the forward's rows (required with scales), grad_y's dtype.
        scales: optional ``[R, K]``, grad_y's dtype or float32 with bfloat16.
        expert_idx: ``[R, K]`` int32 (with bias); bias: optional ``[E, H]``, grad_y's dtype.
        drop_pad_mode: 0 dropless / active, 1 drop/pad.
        active_num, expert_num, expert_capacity: the forward's layout (see the module doc).
    Returns:
        ``grad_expanded_x`` (the forward's expanded_x shape, grad_y's dtype) and
        ``grad_scales [R, K]`` (scales' dtype) or None.
    """
    n_tokens, hidden = grad_y.shape
    slots = len(expanded_row_idx)
    top_k = slots // n_tokens if n_tokens else (scales.shape[1] if scales is not None else 0)
    shape = grad_shape(drop_pad_mode, active_num, expert_num, expert_capacity, slots, hidden)
    n_rows = int(np.prod(shape[:-1]))
    index = expanded_row_idx.astype(np.int64)
    padded = drop_pad_mode == 1
    low, high = (-1, n_rows) if padded else (0, slots)
    bad = np.flatnonzero((index < low) | (index >= high))
    if len(bad):
        p = int(bad[0])
        allowed = f"[-1, {high}) (-1 = dropped)" if padded else f"[0, {high})"
        raise MoeOpError(f"expanded_row_idx values must be in {allowed}, got {index[p]} at position {p}")
    ok = (index >= 0) & (index < n_rows)
    counts = np.bincount(index[ok], minlength=n_rows)
    twice = np.flatnonzero(counts > 1)
    if len(twice):
        raise MoeOpError(
            f"expanded_row_idx names row {twice[0]} {counts[twice[0]]} times: each row takes one slot's gradient "
            "(duplicates other than -1 are refused)"
        )
    if bias is not None:
        require_experts(expert_idx, len(bias))
    slot_of_row = np.full(n_rows, -1, np.int64)  # the slot whose gradient row d receives
    slot_of_row[index[ok]] = np.flatnonzero(ok)
    token_of_row = np.where(slot_of_row >= 0, slot_of_row // max(top_k, 1), -1)
    if scales is None:
        return gather_rows(grad_y, token_of_row).reshape(shape), None
    rows = expanded_x.reshape(n_rows, hidden)
    padded_scales = np.concatenate([scales.reshape(-1), np.zeros(1, scales.dtype)])  # slot -1 reads 0
    row_scale = padded_scales[slot_of_row]
    grad_rows, dots = fused.scaled_rows_and_dots(grad_y, token_of_row, row_scale, rows)
    compute = dots.dtype
    grad_scales = np.zeros(slots, compute)
    grad_scales[slot_of_row[slot_of_row >= 0]] = dots[slot_of_row >= 0]
    if bias is not None:
        token_grad = grad_y.astype(compute)[:, None, :]
        grad_scales += (token_grad * bias.astype(compute)[expert_idx]).sum(-1).reshape(-1)
    return grad_rows.reshape(shape), grad_scales.reshape(n_tokens, top_k).astype(scales.dtype)


def grad_shape(drop_pad_mode: int, active_num: int, expert_num: Dim, expert_capacity: Dim, slots: Dim, hidden: Dim):
    """The forward's ``expanded_x`` shape: ``[rows, H]`` dropless/active, ``[E, C, H]`` drop/pad."""
    if drop_pad_mode == 1:
        return (expert_num, expert_capacity, hidden)
    if active_num > 0 and isinstance(slots, int):
        return (min(active_num, slots), hidden)
    return (slots if active_num == 0 else None, hidden)


def _infer(sig: Signature) -> None:
    grad = sig.input("grad_y")
    tokens, hidden = sig.dim("grad_y", 0), sig.dim("grad_y", 1)
    slots = sig.dim("expanded_row_idx", 0)
    mode, active_num = sig.attr("drop_pad_mode"), sig.attr("active_num")
    experts, capacity = sig.attr("expert_num"), sig.attr("expert_capacity")
    sig.require(active_num >= 0, f"active_num must be >= 0, got {active_num}")
    if mode == 1:
        sig.require(experts > 0, f"drop/pad mode (drop_pad_mode 1) needs expert_num > 0, got {experts}")
        sig.require(capacity > 0, f"drop/pad mode (drop_pad_mode 1) needs expert_capacity > 0, got {capacity}")
        sig.allocates(experts * capacity * 8, f"the slots of expert_num * expert_capacity = {experts} * {capacity}")
    top_k = sig.quotient(slots, tokens, "len(expanded_row_idx) must be R*K (R = grad_y dim 0)")
    if sig.has("scales"):
        sig.require(sig.has("expanded_x"), "scales is given without expanded_x (grad_scales is a dot with its rows)")
        sig.same(sig.dim("scales", 0), tokens, "scales must be [R, K]: R = grad_y dim 0")
        if top_k is not None and tokens != 0:  # (R = 0 tells no K)
            sig.same(sig.dim("scales", 1), top_k, "scales must be [R, K]: K = len(expanded_row_idx) / R")
        require_scales_dtype(sig, "grad_y")
    shape = grad_shape(mode, active_num, experts, capacity, slots, hidden)
    if sig.has("expanded_x"):
        x = sig.input("expanded_x")
        if x.dtype is not None and grad.dtype is not None:
            rule = f"expanded_x must have grad_y's dtype ({grad.dtype}), got {x.dtype}"
            sig.require(x.dtype == grad.dtype, rule, BAD_DTYPE)
        if x.shape is not None:
            sig.require(
                len(x.shape) == len(shape),
                f"expanded_x must be {'[E, C, H]' if mode == 1 else '[rows, H]'} in drop_pad_mode {mode}, "
                f"got shape {list(x.shape)}",
            )
            for axis, want in enumerate(shape):
                if want is None:
                    continue
                sig.same(x.shape[axis], want, f"expanded_x must have the forward's shape {_text(shape)}: dim {axis}")
            shape = tuple(x.shape) if any(d is None for d in shape) else shape
    if sig.has("bias"):
        sig.require(sig.has("expert_idx"), "bias is given without expert_idx (which expert's bias each copy added)")
        sig.same(sig.dim("bias", 1), hidden, "bias must be [E, H]: H = grad_y dim 1")
        if mode == 1:
            sig.same(sig.dim("bias", 0), experts, "bias must be [E, H] with E = expert_num")
        a, b = sig.input("bias").dtype, grad.dtype
        if a is not None and b is not None:
            sig.require(a == b, f"bias must have grad_y's dtype ({b}), got {a}", BAD_DTYPE)
    if sig.has("expert_idx"):
        sig.same(sig.dim("expert_idx", 0), tokens, "expert_idx must be [R, K]: dim 0")
        if top_k is not None and tokens != 0:
            sig.same(sig.dim("expert_idx", 1), top_k, "expert_idx must be [R, K]: dim 1")
    sig.output("grad_expanded_x", grad.dtype, shape)
    if optional_output(sig, "grad_scales", "scales"):
        sig.output("grad_scales", sig.input("scales").dtype, (tokens, sig.dim("scales", 1)))


def _text(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


#: the gradients of the combine: the 6 rows' and the scales'
_EXAMPLE = Example(
    inputs={
        "grad_y": np.array([[0.5, 1.0], [2.0, -1.0], [-0.5, 3.0]], np.float32),
        "expanded_row_idx": np.array([0, 3, 1, 4, 2, 5], np.int32),
        "expanded_x": np.arange(12, dtype=np.float32).reshape(6, 2),
        "scales": np.array([[0.75, 0.25], [0.5, 0.5], [0.625, 0.375]], np.float32),
    },
)


MOE_FINALIZE_ROUTING_V2_GRAD = OpDef(
    "MoeFinalizeRoutingV2Grad",
    __doc__,
    inputs=[
        Input("grad_y", FLOATS, "[R, H] gradient of the forward's y", (2,)),
        Input("expanded_row_idx", ("int32",), "[R*K] src->dst, row-arranged: slot i*K + j -> row", (1,)),
        Input("expanded_x", FLOATS, "the forward's expanded_x (required with scales)", (2, 3), optional=True),
        Input("scales", FLOATS, "[R, K] the forward's scales", (2,), optional=True),
        Input("expert_idx", ("int32",), "[R, K] the forward's expert_idx (with bias)", (2,), optional=True),
        Input("bias", FLOATS, "[E, H] the forward's bias", (2,), optional=True),
    ],
    outputs=[
        Output("grad_expanded_x", FLOATS, "the forward's expanded_x shape: [rows, H] or [E, C, H]"),
        Output("grad_scales", FLOATS, "[R, K] (iff scales)", optional=True),
    ],
    attrs=[
        Attr("drop_pad_mode", "int", 0, "0 dropless/active (forward mode 2), 1 drop/pad (forward mode 3)", (0, 1)),
        Attr("active_num", "int", 0, "rows the forward kept (0 < active_num < R*K), else 0"),
        Attr("expert_num", "int", 0, "E (drop/pad)"),
        Attr("expert_capacity", "int", 0, "C (drop/pad)"),
    ],
    infer=_infer,
    kernel=moe_finalize_routing_v2_grad,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_FINALIZE_ROUTING_V2_GRAD]
