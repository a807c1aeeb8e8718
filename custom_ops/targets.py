"""Opt-in check of the NPU's tiling limits for a target chip (SPEC 1.7).

The numpy kernels run any shape the operator semantics allow; the NPU refuses some of them
for lack of on-chip memory or by fixed tiling limits. :func:`check` lists those refusals for
one node on one target, so a model can be vetted for a device without one. Nothing here runs
on the CPU path. The UB sizes and where they come from are in ``docs/targets.md``.

    violations = check("MoeTokenUnpermuteWithRoutingMapGrad", inputs, attrs, "ascend910b")
    # [] when the node fits, else one sentence per broken limit

Each op states its own limits beside its definition (``OpDef.npu_limits``), with the
helpers below; only limits the seeds and CANN's operator documentation state are encoded,
and an op without any recorded limit returns ``[]``. A limit whose dims are unknown (None
or symbolic) is skipped, not reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .chips import TARGETS, UB_SIZE
from .dtypes import numpy_dtype
from .opdef import Signature
from .tensor_info import TensorInfo

MAX_TOP_K = 512


@dataclass(frozen=True)
class Target:
    """One chip: its name and the bytes of UB its tiling code works with."""

    name: str
    ub_size: int


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
            optional inputs may be left out or given as None). Limits on values (a sentinel
            expert id, a repeated index) are checked only for inputs given as arrays.
        attrs: the node's attributes (defaults are filled in).
        target: ``"ascend910b"``, ``"ascend910_93"`` or ``"ascend950"``.
        ub_size: bytes of UB per vector core; default :data:`UB_SIZE` of the target.
    Returns:
        One message per violated limit; empty when the node fits.
    Raises:
        ValueError: unknown target or op type. MoeOpError: attributes the op refuses.
    """
    from . import OPS  # the op modules import this one for its helpers

    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    if op_type not in OPS:
        raise ValueError(f"unknown op type {op_type!r}")
    op = OPS[op_type]
    if op.npu_limits is None:
        return []
    given = {name: _info(value) for name, value in inputs.items()}
    arrays = {name: value for name, value in inputs.items() if isinstance(value, np.ndarray)}
    sig = Signature(
        op, {decl.name: given.get(decl.name) for decl in op.inputs}, op.bind_attrs(dict(attrs)), None, values=arrays
    )
    chip = Target(target, UB_SIZE[target] if ub_size is None else ub_size)
    return [f"{op_type} on {target}: {violation}" for violation in op.npu_limits(sig, chip)]


def _info(value) -> TensorInfo | None:
    if value is None or isinstance(value, TensorInfo):
        return value
    return TensorInfo.of(np.asarray(value))


# --- helpers for the ops' limit functions ---------------------------------------------------


def known_dim(sig: Signature, name: str, axis: int) -> int | None:
    """Dim ``axis`` of input ``name`` when it is a known int, else None."""
    dim = sig.dim(name, axis)
    return dim if isinstance(dim, int) else None


def itemsize(sig: Signature, name: str) -> int | None:
    """Bytes per element of input ``name`` (None when absent or untyped)."""
    dtype = sig.input(name).dtype
    return None if dtype is None else numpy_dtype(dtype).itemsize


def ratio(rows: int | None, by: int | None) -> int | None:
    return rows // by if rows is not None and by is not None and by > 0 else None


def align32(n: int) -> int:
    return (n + 31) // 32 * 32


def top_k_rules(top_k: int | None, n_experts: int | None, where: str) -> list[str]:
    found = []
    if top_k is not None and top_k > MAX_TOP_K:
        found.append(f"K = {top_k} exceeds {MAX_TOP_K} ({where})")
    if top_k is not None and n_experts is not None and top_k > n_experts:
        found.append(f"K = {top_k} exceeds E = {n_experts} ({where})")
    return found
