"""The operator library: definitions, numpy kernels and ONNX schemas of the ``cann.moe`` ops.

One module per operator family; each lists its :class:`OpDef` objects in ``DEFINITIONS``.
Importing this package registers every schema with ``onnx.defs``. It knows nothing of
onnxruntime, MPI or graph rewriting.
"""

from . import (
    all_gather,
    all_to_all,
    moe_init_routing_v2,
    moe_init_routing_v2_grad,
    moe_re_routing_v2,
    moe_token_permute_with_routing_map,
    moe_token_permute_with_routing_map_grad,
    moe_token_unpermute_with_routing_map,
    moe_token_unpermute_with_routing_map_grad,
    schemas,
)
from .errors import BAD_CONSTRAINT, BAD_DTYPE, MISSING_INPUT, MoeOpError
from .opdef import DOMAIN, OPSET_VERSION, OpDef, TensorInfo

_MODULES = (
    moe_re_routing_v2,
    moe_init_routing_v2,
    moe_init_routing_v2_grad,
    moe_token_permute_with_routing_map,
    moe_token_permute_with_routing_map_grad,
    moe_token_unpermute_with_routing_map,
    moe_token_unpermute_with_routing_map_grad,
    all_to_all,
    all_gather,
)

#: every operator this library implements, by (domain, op type)
ALL_OPS: dict[tuple[str, str], OpDef] = {(op.domain, op.name): op for module in _MODULES for op in module.DEFINITIONS}
#: the operators of the ``cann.moe`` domain, by op type
OPS: dict[str, OpDef] = {name: op for (domain, name), op in ALL_OPS.items() if domain == DOMAIN}

# Only our own domain goes into onnx.defs: onnx.reference refuses two schemas of one name
# (AllToAll) in different domains, and com.microsoft's schemas belong to onnxruntime.
schemas.register(OPS.values())

# the kernels, by function name (imported last: these names shadow their modules)
from .moe_re_routing_v2 import moe_re_routing, moe_re_routing_v2  # noqa: E402

__all__ = [
    "ALL_OPS",
    "BAD_CONSTRAINT",
    "BAD_DTYPE",
    "DOMAIN",
    "MISSING_INPUT",
    "MoeOpError",
    "OPSET_VERSION",
    "OPS",
    "OpDef",
    "TensorInfo",
    "moe_re_routing",
    "moe_re_routing_v2",
]
