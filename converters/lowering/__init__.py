"""Bodies of the ``cann.moe`` operators in standard ONNX ops, one module per operator.

Each module names the ops it lowers (``LOWERS``) and defines ``body(b, node)``, which builds
the op's body for one :class:`~.builder.Specialisation` (attributes, input dtypes, wanted
outputs) with a :class:`~.builder.Body`. Inputs, outputs and attributes come from the op's
``OpDef`` (``moe_onnx.custom_ops.OPS``); nothing here restates a signature.

The collectives (ops that need a communicator injected: AllToAll, AllGather and the MC2 ops
MoeDistributeDispatch(V2), MoeDistributeCombine(V2), AlltoAllvGroupedMatMul,
GroupedMatMulAlltoAllv) have no lowering: no standard ONNX op exchanges data between
processes, so they stay ``cann.moe`` nodes, run by the kernels on the session's communicator
(docs/lowering.md).
"""

from __future__ import annotations

from collections.abc import Callable

from moe_onnx.custom_ops import OPS

from . import (
    grouped_matmul,
    moe_compute_expert_tokens,
    moe_finalize_routing_v2,
    moe_finalize_routing_v2_grad,
    moe_gating_top_k,
    moe_gating_top_k_backward,
    moe_gating_top_k_softmax,
    moe_init_routing,
    moe_init_routing_v2,
    moe_init_routing_v2_grad,
    moe_init_routing_v3,
    moe_re_routing_v2,
    moe_token_permute,
    moe_token_permute_grad,
    moe_token_permute_with_routing_map,
    moe_token_permute_with_routing_map_grad,
    moe_token_unpermute,
    moe_token_unpermute_grad,
    moe_token_unpermute_with_routing_map,
    moe_token_unpermute_with_routing_map_grad,
    swi_glu,
    swi_glu_grad,
)
from .builder import MIN_OPSET, Body, LoweringError, Specialisation

_MODULES = (
    moe_re_routing_v2,
    moe_init_routing_v2,
    moe_init_routing_v2_grad,
    moe_init_routing_v3,
    moe_token_permute_with_routing_map,
    moe_token_permute_with_routing_map_grad,
    moe_token_unpermute_with_routing_map,
    moe_token_unpermute_with_routing_map_grad,
    moe_token_permute,
    moe_token_permute_grad,
    moe_token_unpermute,
    moe_token_unpermute_grad,
    moe_init_routing,
    moe_compute_expert_tokens,
    moe_gating_top_k_softmax,
    moe_gating_top_k,
    moe_gating_top_k_backward,
    moe_finalize_routing_v2,
    moe_finalize_routing_v2_grad,
    grouped_matmul,
    swi_glu,
    swi_glu_grad,
)

#: op name -> body builder, for every ``cann.moe`` op in ``OPS`` except the collectives
LOWERINGS: dict[str, Callable[[Body, Specialisation], None]] = {
    name: module.body for module in _MODULES for name in module.LOWERS
}
#: the ops left to a runtime that has a communicator
COLLECTIVES: tuple[str, ...] = tuple(name for name, op in OPS.items() if op.needs)

_unknown = set(LOWERINGS) - set(OPS)
_missing = set(OPS) - set(LOWERINGS) - set(COLLECTIVES)
if _unknown or _missing:
    raise ImportError(f"lowerings out of step with OPS: unknown {sorted(_unknown)}, missing {sorted(_missing)}")

__all__ = ["COLLECTIVES", "LOWERINGS", "MIN_OPSET", "Body", "LoweringError", "Specialisation"]
