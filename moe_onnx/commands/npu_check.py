"""``moe-onnx check MODEL [--target T ...]``: which ``cann.moe`` nodes the NPU would refuse.

The CPU kernels run every shape the operators allow; the Ascend NPU refuses some for lack of
on-chip memory or by fixed tiling limits (SPEC 1.7, docs/targets.md). This runs
:func:`moe_onnx.custom_ops.targets.check` on every ``cann.moe`` node of a model file (or of
each rank's file), with the node's attributes and the input types ONNX shape inference
gives, and says per node and target: fits, or each limit it breaks. A limit over a dim that
inference leaves symbolic (a token count ``T``) cannot be decided and is skipped; the report
names those dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from ..custom_ops import DOMAIN, OPS, targets
from ..custom_ops.model_types import value_types
from ..custom_ops.schemas import attribute_value
from ..custom_ops.tensor_info import TensorInfo


@dataclass
class NodeVerdict:
    """One node on one target: the limits it breaks ([] = fits), the symbolic dims of its
    inputs (limits over them skipped), and whether the op records NPU limits at all."""

    node: str
    op_type: str
    target: str
    violations: list[str] = field(default_factory=list)
    unknown_dims: list[str] = field(default_factory=list)
    has_limits: bool = True

    def line(self) -> str:
        where = f"node '{self.node}' ({self.op_type}) on {self.target}"
        if not self.has_limits:
            return f"{where}: no NPU limit recorded for this op"
        if self.violations:
            broken = "; ".join(v.split(": ", 1)[-1] for v in self.violations)
            return f"{where}: breaks {len(self.violations)} limit(s): {broken}"
        skipped = f" (limits over {', '.join(self.unknown_dims)} skipped: unknown dims)" if self.unknown_dims else ""
        return f"{where}: fits{skipped}"


def _unknown_dims(infos: list[TensorInfo | None]) -> list[str]:
    found: dict[str, None] = {}
    for info in infos:
        for dim in (info.shape or ()) if info is not None else ():
            if not isinstance(dim, int):  # (onnx names the dims it cannot relate unk__N)
                found["?" if not dim or str(dim).startswith("unk__") else str(dim)] = None
    return list(found)


def check_model(model: onnx.ModelProto, chips: list[str]) -> list[NodeVerdict]:
    """A verdict per ``cann.moe`` node of ``model``'s main graph and per target in ``chips``."""
    types = value_types(model)
    verdicts = []
    for index, node in enumerate(model.graph.node):
        op = OPS.get(node.op_type) if node.domain == DOMAIN else None
        if op is None:
            continue
        inputs: dict[str, TensorInfo | np.ndarray | None] = {
            decl.name: types.get(name) if name else None for decl, name in zip(op.inputs, node.input)
        }
        attrs = {a.name: attribute_value(a) for a in node.attribute}
        name = node.name or f"#{index}"
        for chip in chips:
            verdict = NodeVerdict(name, node.op_type, chip, has_limits=op.npu_limits is not None)
            if verdict.has_limits:
                verdict.violations = targets.check(node.op_type, inputs, attrs, chip)
                verdict.unknown_dims = _unknown_dims([i for i in inputs.values() if isinstance(i, TensorInfo)])
            verdicts.append(verdict)
    return verdicts
