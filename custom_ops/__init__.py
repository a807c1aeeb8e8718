"""The operator library: definitions, numpy kernels and ONNX schemas of the ``cann.moe`` ops.

Importing this package registers every schema with ``onnx.defs``. It knows nothing of
onnxruntime, MPI or graph rewriting.
"""

from . import schemas
from .errors import BAD_CONSTRAINT, BAD_DTYPE, MISSING_INPUT, MoeOpError
from .moe_re_routing_v2 import MOE_RE_ROUTING, MOE_RE_ROUTING_V2, moe_re_routing, moe_re_routing_v2
from .opdef import DOMAIN, OPSET_VERSION, OpDef, TensorInfo

#: every operator of the ``cann.moe`` domain, by op type
OPS: dict[str, OpDef] = {op.name: op for op in (MOE_RE_ROUTING_V2, MOE_RE_ROUTING)}

schemas.register(OPS.values())

__all__ = [
    "BAD_CONSTRAINT", "BAD_DTYPE", "DOMAIN", "MISSING_INPUT", "MoeOpError", "OPSET_VERSION", "OPS",
    "OpDef", "TensorInfo", "moe_re_routing", "moe_re_routing_v2",
]
