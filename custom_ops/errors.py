"""The one exception every operator raises, with CANN's error codes."""

from __future__ import annotations

#: A required input is missing (ACLNN_ERR_PARAM_NULLPTR).
MISSING_INPUT = 161001
#: A dtype or format is not supported (ACLNN_ERR_PARAM_INVALID).
BAD_DTYPE = 161002
#: A shape, value or attribute constraint is violated (ACLNN_ERR_INNER_TILING_ERROR).
BAD_CONSTRAINT = 561002


#: the refusal of a collective run without ranks (a single InferenceSession has no peers)
NO_COMMUNICATOR = (
    "no communicator: a collective needs ranks to exchange with, and a single InferenceSession has none: "
    "run the model on N ranks "
    "with `moe-onnx run MODEL --ranks N` (threads, or --backend mpi) or, in Python, "
    "moe_onnx.ranks.run_threads([model] * N, feeds_per_rank) (docs/running.md)"
)

#: a longer rule is cut: a value quoted in it may be as large as the model's attributes
MAX_RULE = 2000


class MoeOpError(ValueError):
    """An operator refused its inputs.

    Kernels raise it with the rule alone; :class:`~moe_onnx.custom_ops.OpDef` stamps the
    operator and the node on it on the way out, so a kernel never names its own op.

    Attributes:
        op_type: the operator, e.g. ``"MoeReRoutingV2"`` ("" from a bare kernel call).
        node_name: the ONNX node's name ("" for a direct call).
        code: a CANN error code (161001, 161002 or 561002).
        rule: the rule that was broken, with the offending values.
    """

    def __init__(self, rule: str, code: int = BAD_CONSTRAINT, *, op_type: str = "", node_name: str = ""):
        self.op_type = op_type
        self.rule = rule if len(rule) <= MAX_RULE else f"{rule[:MAX_RULE]}... ({len(rule)} characters)"
        self.code = code
        self.node_name = node_name
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.op_type + (f" node '{self.node_name}'" if self.node_name else "")
        return f"{where}: {self.rule} [CANN {self.code}]" if where else f"{self.rule} [CANN {self.code}]"

    def at(self, op_type: str, node_name: str = "") -> MoeOpError:
        """This error attributed to ``op_type`` / ``node_name`` where it names none yet."""
        self.op_type = self.op_type or op_type
        self.node_name = self.node_name or node_name
        self.args = (self._message(),)
        return self

    def __reduce__(self):  # keep the fields across pickling (MPI, subprocesses)
        return (_rebuild, (self.rule, self.code, self.op_type, self.node_name))


class OpsetImportError(ValueError):
    """A model whose ``cann.moe`` nodes it does not import the domain for, or that imports a
    version of the domain this library does not implement. The message says the fix."""


class FeedError(MoeOpError, TypeError):
    """A fed input that does not match the model's declared graph input (name, element type,
    shape) or a required input that is missing: refused by the session before any op runs.
    A ``TypeError`` too, as onnxruntime's own check is."""

    def __reduce__(self):
        return (FeedError, (self.rule, self.code))


def _rebuild(rule: str, code: int, op_type: str, node_name: str) -> MoeOpError:
    return MoeOpError(rule, code, op_type=op_type, node_name=node_name)
