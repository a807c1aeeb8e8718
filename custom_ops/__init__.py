"""The operator library: definitions, numpy kernels and ONNX schemas of the ``cann.moe`` ops.

One module per operator family, each listing its :class:`OpDef` objects in ``DEFINITIONS``;
adding an op is a new module and an entry in :data:`OP_MODULES`. Importing this package
registers every schema with ``onnx.defs``. It knows nothing of onnxruntime, MPI or graph
rewriting.
"""

if __name__ != "moe_onnx.custom_ops":  # the repository root on sys.path would load a second copy
    raise ImportError(f"import the op library as 'moe_onnx.custom_ops' (pip install -e .), not as {__name__!r}")

import functools
import importlib

from . import schemas
from .errors import BAD_CONSTRAINT, BAD_DTYPE, MISSING_INPUT, MoeOpError
from .opdef import DOMAIN, OPSET_VERSION, OpDef, Signature, snake_case
from .tensor_info import TensorInfo

#: the modules that define operators, in the order the ops are listed
OP_MODULES = (
    "moe_re_routing_v2",
    "moe_init_routing_v2",
    "moe_init_routing_v2_grad",
    "moe_init_routing_v3",
    "moe_token_permute_with_routing_map",
    "moe_token_permute_with_routing_map_grad",
    "moe_token_unpermute_with_routing_map",
    "moe_token_unpermute_with_routing_map_grad",
    "all_to_all",
    "all_gather",
    "moe_token_permute",
    "moe_token_permute_grad",
    "moe_token_unpermute",
    "moe_token_unpermute_grad",
    "moe_init_routing",
    "moe_compute_expert_tokens",
    "moe_gating_top_k_softmax",
    "moe_gating_top_k",
    "moe_gating_top_k_backward",
    "moe_finalize_routing_v2",
    "moe_finalize_routing_v2_grad",
    "grouped_matmul",
    "swi_glu",
    "swi_glu_grad",
    "moe_distribute_dispatch",
    "moe_distribute_dispatch_v2",
    "moe_distribute_combine",
    "moe_distribute_combine_v2",
    "allto_allv_grouped_mat_mul",
    "grouped_mat_mul_allto_allv",
)

#: every operator this library implements, by (domain, op type)
ALL_OPS: dict[tuple[str, str], OpDef] = {
    (op.domain, op.name): op
    for module in OP_MODULES
    for op in importlib.import_module(f".{module}", __name__).DEFINITIONS
}
#: the operators of the ``cann.moe`` domain, by op type
OPS: dict[str, OpDef] = {name: op for (domain, name), op in ALL_OPS.items() if domain == DOMAIN}

# Only our own domain goes into onnx.defs: onnx.reference refuses two schemas of one name
# (AllToAll) in different domains, and com.microsoft's schemas belong to onnxruntime.
schemas.register(OPS.values())


def _kernel_function(op: OpDef):
    """``moe_onnx.custom_ops.<snake_case(op.name)>``: the op's numpy kernel behind its checks.

    Inputs positional (None for an absent optional one), attributes by keyword (defaults
    filled in), the context objects the op ``needs`` (a ``communicator``) by keyword too;
    returns one entry per declared output (None = absent). Bad input raises
    :class:`MoeOpError` naming the op and the rule, as a session would."""

    def call(*inputs, node_name: str = "", **attrs):
        context = {name: attrs.pop(name) for name in op.needs if name in attrs}
        return op(*inputs, node_name=node_name, context=context, **attrs)

    functools.update_wrapper(call, op.kernel)  # the kernel's name, docstring and signature
    call.__module__ = __name__
    return call


#: op type -> its kernel function's name in this package (``MoeReRoutingV2`` -> ``moe_re_routing_v2``)
KERNEL_FUNCTIONS: dict[str, str] = {name: snake_case(name) for name in OPS}
# After the loop above: each function shadows the module of the same name as an attribute
# of this package (``from moe_onnx.custom_ops.swi_glu import SWI_GLU`` still reads the module).
globals().update({function: _kernel_function(OPS[name]) for name, function in KERNEL_FUNCTIONS.items()})

__all__ = [
    "ALL_OPS",
    "BAD_CONSTRAINT",
    "BAD_DTYPE",
    "DOMAIN",
    "MISSING_INPUT",
    "OPSET_VERSION",
    "OPS",
    "OP_MODULES",
    "MoeOpError",
    "OpDef",
    "Signature",
    "TensorInfo",
    "KERNEL_FUNCTIONS",
    *KERNEL_FUNCTIONS.values(),
]
