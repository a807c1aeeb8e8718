"""Opt-in check of the NPU's tiling limits for a target chip (SPEC 1.7).

The numpy kernels run any shape the operator semantics allow; the NPU refuses some of them
for lack of on-chip memory or by fixed tiling limits. :func:`check` lists those refusals for
one node on one target, so a model can be vetted for a device without one. Nothing here runs
on the CPU path. The UB sizes and where they come from are in ``docs/targets.md``.

    violations = check("MoeTokenUnpermuteWithRoutingMapGrad", inputs, attrs, "ascend910b")
    # [] when the node fits, else one sentence per broken limit

Only limits the seeds and CANN's operator documentation state are encoded; an op without
any recorded limit returns ``[]``. A limit whose dims are unknown (None or symbolic) is
skipped, not reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import OPS
from .dtypes import numpy_dtype
from .opdef import TensorInfo

TARGETS = ("ascend910b", "ascend910_93", "ascend950")
#: bytes of Unified Buffer per AI Vector core, as the tiling code receives it (docs/targets.md)
UB_SIZE = {"ascend910b": 192 * 1024, "ascend910_93": 192 * 1024, "ascend950": 248 * 1024}
MAX_TOP_K = 512
#: aclnnMoeTokenPermuteWithRoutingMap: tokens_num and experts_num must be below this
MAX_PERMUTE_DIM = 16777215
RE_ROUTING_MAX_HIDDEN = 16384


def check(
    op_type: str,
    inputs: dict[str, TensorInfo | np.ndarray | None],
    attrs: dict[str, Any],
    target: str,
    ub_size: int | None = None,
) -> list[str]:
    """The NPU limits one node breaks on ``target``.

    Args:
        op_type: a ``cann.moe`` op type, e.g. ``"MoeTokenUnpermuteWithRoutingMapGrad"``.
        inputs: the node's inputs by ONNX name, as arrays or :class:`TensorInfo` (absent
            optional inputs may be left out or given as None).
        attrs: the node's attributes (defaults are filled in).
        target: ``"ascend910b"``, ``"ascend910_93"`` or ``"ascend950"``.
        ub_size: bytes of UB per vector core; default :data:`UB_SIZE` of the target.
    Returns:
        One message per violated limit; empty when the node fits.
    Raises:
        ValueError: unknown target or op type. MoeOpError: attributes the op refuses.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    if op_type not in OPS:
        raise ValueError(f"unknown op type {op_type!r}")
    node = _Node(
        {name: _info(value) for name, value in inputs.items()},
        OPS[op_type].bind_attrs(dict(attrs)),
        target,
        UB_SIZE[target] if ub_size is None else ub_size,
    )
    rules = _RULES.get(op_type)
    return [] if rules is None else [f"{op_type} on {target}: {v}" for v in rules(node)]


def _info(value) -> TensorInfo | None:
    if value is None or isinstance(value, TensorInfo):
        return value
    return TensorInfo.of(np.asarray(value))


class _Node:
    """Dims and element sizes of one node's inputs; None where unknown."""

    def __init__(self, inputs: dict[str, TensorInfo | None], attrs: dict, target: str, ub_size: int):
        self.inputs, self.attrs, self.target, self.ub_size = inputs, attrs, target, ub_size

    def has(self, name: str) -> bool:
        return self.inputs.get(name) is not None

    def dim(self, name: str, axis: int) -> int | None:
        info = self.inputs.get(name)
        if info is None or info.shape is None or axis >= len(info.shape):
            return None
        d = info.shape[axis]
        return d if isinstance(d, int) else None

    def itemsize(self, name: str) -> int | None:
        info = self.inputs.get(name)
        return None if info is None or info.dtype is None else numpy_dtype(info.dtype).itemsize


def _known(*values) -> bool:
    return all(isinstance(v, int) for v in values)


def _ratio(rows, by) -> int | None:
    return rows // by if _known(rows, by) and by > 0 else None


def _align32(n: int) -> int:
    return (n + 31) // 32 * 32


def _top_k_rules(top_k, n_experts, where: str) -> list[str]:
    found = []
    if _known(top_k) and top_k > MAX_TOP_K:
        found.append(f"K = {top_k} exceeds {MAX_TOP_K} ({where})")
    if _known(top_k, n_experts) and top_k > n_experts:
        found.append(f"K = {top_k} exceeds E = {n_experts} ({where})")
    return found


def _permute(node: _Node) -> list[str]:
    found = []
    n_tokens, n_experts = node.dim("routing_map", 0), node.dim("routing_map", 1)
    for letter, value in (("T", n_tokens), ("E", n_experts)):
        if _known(value) and value >= MAX_PERMUTE_DIM:
            found.append(f"{letter} = {value} must be below {MAX_PERMUTE_DIM}")
    if not node.attrs["drop_and_pad"]:
        found += _top_k_rules(_ratio(node.attrs["num_out_tokens"], n_tokens), None, "not padded")
    return found


def _permute_grad(node: _Node) -> list[str]:
    if node.attrs["drop_and_pad"]:
        return []
    n_tokens = node.attrs["tokens_num"]
    if n_tokens is None:
        n_tokens = node.dim("routing_map", 0)
    return _top_k_rules(_ratio(node.dim("sorted_indices", 0), n_tokens), None, "not padded")


def _unpermute(node: _Node) -> list[str]:
    rows, n_experts = node.dim("sorted_indices", 0), node.dim("routing_map", 1)
    restore = node.attrs["restore_shape"]
    n_tokens = restore[0] if restore else node.dim("routing_map", 0)
    if not node.attrs["padded_mode"]:
        return _top_k_rules(_ratio(rows, n_tokens), n_experts, "not padded")
    capacity = _ratio(rows, n_experts)
    if _known(capacity, n_tokens) and capacity > n_tokens:
        return [f"capacity C = {capacity} exceeds T = {n_tokens} (padded)"]
    return []


def _unpermute_grad(node: _Node) -> list[str]:
    """Seed 000's tiling limits; they apply only with probs."""
    if not node.has("probs"):
        return []
    n_tokens, hidden = node.dim("unpermuted_tokens_grad", 0), node.dim("unpermuted_tokens_grad", 1)
    rows, n_experts = node.dim("out_index", 0), node.dim("routing_map", 1)
    token_len, prob_len = node.itemsize("unpermuted_tokens_grad"), node.itemsize("probs")
    ub = node.ub_size
    found = []
    if node.attrs["drop_and_pad"]:
        capacity = _ratio(rows, n_experts)
        if _known(capacity, n_tokens) and capacity > n_tokens:
            found.append(f"capacity C = {capacity} exceeds T = {n_tokens} (probs, padded)")
        if _known(hidden, token_len):
            max_hidden = 256 * (ub - 2080) // (8 + token_len)
            if hidden > max_hidden:
                found.append(
                    f"H = {hidden} exceeds 256 * (ubSize - 2080) / (8 + tokenTypeLen) = "
                    f"{max_hidden} (ubSize {ub}, tokenTypeLen {token_len}; probs, padded)"
                )
        return found
    found += _top_k_rules(_ratio(rows, n_tokens), n_experts, "probs, not padded")
    if _known(n_experts, token_len, prob_len):
        free = ub - (prob_len + 1) * _align32(n_experts) - (token_len + 8) * 256
        if free // (6 * token_len + 12) < 1:
            found.append(
                f"E = {n_experts} leaves no room in UB: (ubSize - (probTypeLen + 1) * "
                f"align32(E) - (tokenTypeLen + 8) * 256) / (6 * tokenTypeLen + 12) = "
                f"{free // (6 * token_len + 12)} < 1 (ubSize {ub}, probTypeLen {prob_len}, "
                f"tokenTypeLen {token_len}; probs, not padded)"
            )
    return found


def _re_routing(node: _Node) -> list[str]:
    found = []
    if node.target != "ascend950":
        found.append("the NPU implements this op on ascend950 only")
    hidden = node.dim("tokens", 1)
    if _known(hidden) and not 0 < hidden < RE_ROUTING_MAX_HIDDEN:
        found.append(f"H = {hidden} must satisfy 0 < H < {RE_ROUTING_MAX_HIDDEN}")
    if node.attrs["expert_token_num_type"] != 1:
        found.append(f"expert_token_num_type = {node.attrs['expert_token_num_type']}: the NPU supports only 1 (count)")
    return found


_RULES: dict[str, Callable[[_Node], list[str]]] = {
    "MoeTokenPermuteWithRoutingMap": _permute,
    "MoeTokenPermuteWithRoutingMapGrad": _permute_grad,
    "MoeTokenUnpermuteWithRoutingMap": _unpermute,
    "MoeTokenUnpermuteWithRoutingMapGrad": _unpermute_grad,
    "MoeReRoutingV2": _re_routing,
    "MoeReRouting": _re_routing,
}
