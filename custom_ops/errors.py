"""The one exception every operator raises, with CANN's error codes."""

from __future__ import annotations

#: A required input is missing (ACLNN_ERR_PARAM_NULLPTR).
MISSING_INPUT = 161001
#: A dtype or format is not supported (ACLNN_ERR_PARAM_INVALID).
BAD_DTYPE = 161002
#: A shape, value or attribute constraint is violated (ACLNN_ERR_INNER_TILING_ERROR).
BAD_CONSTRAINT = 561002


class MoeOpError(ValueError):
    """An operator refused its inputs.

    Attributes:
        op_type: the operator, e.g. ``"MoeReRoutingV2"``.
        node_name: the ONNX node's name ("" for a direct kernel call).
        code: a CANN error code (161001, 161002 or 561002).
        rule: the rule that was broken, with the offending values.
    """

    def __init__(self, op_type: str, rule: str, code: int = BAD_CONSTRAINT, node_name: str = ""):
        self.op_type = op_type
        self.rule = rule
        self.code = code
        self.node_name = node_name
        super().__init__(self._message())

    def _message(self) -> str:
        where = f"{self.op_type} node '{self.node_name}'" if self.node_name else self.op_type
        return f"{where}: {self.rule} [CANN {self.code}]"

    def at_node(self, node_name: str) -> MoeOpError:
        """Return this error attributed to ``node_name``."""
        if node_name and not self.node_name:
            self.node_name = node_name
            self.args = (self._message(),)
        return self

    def __reduce__(self):  # keep the fields across pickling (MPI, subprocesses)
        return (MoeOpError, (self.op_type, self.rule, self.code, self.node_name))
