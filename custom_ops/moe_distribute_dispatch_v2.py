"""MoeDistributeDispatchV2: the dispatch of SPEC-mc2 1.21 (torch_npu ``npu_moe_distribute_dispatch_v2``).

The same exchange and receive layout as V1 (:mod:`.moe_distribute_dispatch`: local expert,
then source rank, then the source's slot order), with these differences:

* the index output is ``assist_info_for_combine [A*128]``, written **on the receiver, dst row
  -> (src rank, token, slot)** at ``3d, 3d+1, 3d+2`` (slot ``j < K`` for a MoE row, ``K + i``
  for shared expert i); entries past ``3n`` are 0;
* up to 4 shared experts, each on ``R = S / shared_expert_num`` ranks: every rank sends all its
  active tokens to replica ``rank % R`` of each; a shared rank's rows are by source rank,
  then token;
* ``x_active_mask`` may be ``[BS, K]`` (per slot; a token goes to the shared experts if any
  slot is true);
* ids in ``[E, E+Z+C+N)`` name zero / copy / constant experts: not sent, computed by the combine.
"""

from __future__ import annotations

from . import mc2
from .moe_distribute_dispatch import dispatch, dispatch_attrs, dispatch_inputs, dispatch_limits, dispatch_outputs
from .moe_distribute_dispatch import infer_dispatch as _infer_dispatch
from .opdef import Example, OpDef, Signature
from .targets import Target


def moe_distribute_dispatch_v2(
    x,
    expert_ids,
    scales=None,
    x_active_mask=None,
    expert_scales=None,
    elastic_info=None,
    *,
    communicator=None,
    **attrs,
):
    """MoeDistributeDispatchV2 on this rank's communicator.

    Args:
        x: ``[BS, H]``; expert_ids: ``[BS, K]`` int32; scales: ``[shared experts + E, H]``
        float32 (quant_mode 2); x_active_mask: ``[BS]`` (prefix) or ``[BS, K]`` bool;
        expert_scales: ``[BS, K]`` float32; elastic_info: refused by inference.
    Returns:
        ``expand_x [A, H]``, ``dynamic_scales [A]``, ``assist_info_for_combine [A*128]``
        (dst row -> src rank, token, slot), ``expert_token_nums [L']``, ``ep_recv_count
        [W*L']``, ``tp_recv_count [tp_world_size]``, ``expand_scales [A]``.
    """
    return dispatch(x, expert_ids, scales, x_active_mask, expert_scales, attrs, communicator, v2=True)


def _infer(sig: Signature) -> None:
    _infer_dispatch(sig, v2=True)


def _limits(sig: Signature, target: Target) -> list[str]:
    return dispatch_limits(sig, target, v2=True)


_EXAMPLE = Example(attrs=mc2.EXAMPLE_GROUP, ranks=mc2.EXAMPLE_TOKENS, rank_attrs=mc2.EXAMPLE_RANK_ATTRS)

MOE_DISTRIBUTE_DISPATCH_V2 = OpDef(
    "MoeDistributeDispatchV2",
    __doc__,
    inputs=dispatch_inputs(v2=True),
    outputs=dispatch_outputs(v2=True),
    attrs=dispatch_attrs(v2=True),
    infer=_infer,
    kernel=moe_distribute_dispatch_v2,
    needs=("communicator",),
    example=_EXAMPLE,
    npu_limits=_limits,
)

DEFINITIONS = [MOE_DISTRIBUTE_DISPATCH_V2]
