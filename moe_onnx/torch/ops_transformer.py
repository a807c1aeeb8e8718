"""The seeds' PyTorch API: ops-transformer's torch extension ``cann_ops_transformer`` (SPEC-layer 1.18).

After :func:`moe_onnx.torch.install_stand_ins`, ``import cann_ops_transformer`` and
``from cann_ops_transformer.ops import moe_init_routing, moe_init_routing_grad`` give these
functions (:data:`NAMES`, in both modules), so seed 001's and seed 003's examples run on a CPU
with only the device removed. Each calls our torch ops (one definition per op):

* :func:`moe_re_routing` (seed 003) -> ``cann.moe::MoeReRoutingV2`` / ``MoeReRouting``;
* :func:`moe_init_routing` (seed 001's forward, aclnnMoeInitRoutingV4's torch API) ->
  ``cann.moe::MoeInitRoutingV3``, with ``topk_weight`` moved like the rows;
* :func:`moe_init_routing_grad` (seed 001) -> ``cann.moe::MoeInitRoutingV2Grad``.

They trace under ``torch.compile`` (the CPU analogue of TorchAir's graph mode) to the eager bits.
"""

from __future__ import annotations

import torch

from ..custom_ops import MoeOpError
from ..custom_ops.errors import BAD_DTYPE
from ..custom_ops.moe_init_routing_v3 import QUANT_MODES, STORED_X_DTYPES, expert_range
from ..custom_ops.moe_re_routing_v2 import PACKED_TOKEN_DTYPES
from .npu.common import checked, follows, refuse, stored_dtype_name
from .ops import FUNCTIONS


def _empty(dtype: torch.dtype) -> torch.Tensor:
    """An output the call does not compute: an empty tensor of shape (0,), as seed 003 states."""
    return torch.empty(0, dtype=dtype)


def moe_re_routing(
    tokens,
    expert_token_num_per_rank,
    *,
    per_token_scales=None,
    expert_topk_weight=None,
    expert_token_num_type=1,
    idx_type=0,
    tokens_dtype=None,
):
    """cann_ops_transformer.moe_re_routing(Tensor tokens, Tensor expert_token_num_per_rank, *,
    Tensor? per_token_scales=None, Tensor? expert_topk_weight=None, int expert_token_num_type=1,
    int idx_type=0, Any tokens_dtype=None) -> (permute_tokens, permute_per_token_scales,
    permute_token_idx, expert_token_num, permute_topk_weight)

    Source: seed 003 (ops-transformer moe_re_routing_v2, torchapi_moe_re_routing.md). SPEC 1.1.
    Without ``expert_topk_weight`` the fifth output is an empty float32 tensor of shape (0,).
    ``tokens_dtype``: the real type of uint8 tokens (``torch_npu.hifloat8`` / float4 constants
    or names), moved as bytes. The Meta function's rules (both inputs 2-D, the two int
    attributes 0 or 1) are the op's, raised as ``MoeOpError``. Differentiable in tokens,
    scales and weight (the inverse reorder, SPEC 1.1's torch op).
    """
    name = stored_dtype_name(
        "MoeReRoutingV2", "cann_ops_transformer.moe_re_routing", "tokens_dtype", tokens_dtype, PACKED_TOKEN_DTYPES
    )
    outputs = FUNCTIONS["MoeReRoutingV2"](
        tokens,
        expert_token_num_per_rank,
        per_token_scales,
        expert_topk_weight,
        expert_token_num_type=expert_token_num_type,
        idx_type=idx_type,
        tokens_dtype=name,
    )
    weight = outputs[4] if outputs[4] is not None else _empty(torch.float32)
    return (*outputs[:4], weight)


class _NoBackward(torch.autograd.Function):
    """Identity whose backward raises NotImplementedError naming a forward feature (seed 001
    section 9: the automatic backward is only MoeInitRoutingV2Grad's)."""

    @staticmethod
    def forward(ctx, x, feature: str):
        ctx.feature = feature
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(
            f"moe_init_routing: no automatic backward when the forward uses {ctx.feature} "
            "(an aclnnMoeInitRoutingV4 feature; seed 001 section 9): the backward is MoeInitRoutingV2Grad's"
        )


def _moved_topk_weight(topk_weight, expert_idx, expanded_row_idx, rows, start, end, row_idx_type):
    """``expanded_topk_weight [rows, 1]``: the weight of the slot each row copies, 0 for rows no
    slot fills (SPEC-layer 1.18: ``topk_weight.flat[order[d]]``), in torch ops that trace."""
    weights = topk_weight.detach().reshape(-1)  # seed 001: only x has a gradient
    if row_idx_type == 0:  # src -> dst: slot p went to row expanded_row_idx[p] (-1: none)
        index = expanded_row_idx.long()
        target = torch.where((index >= 0) & (index < rows), index, rows)  # the spare row rows
        moved = torch.zeros(rows + 1, dtype=weights.dtype).scatter(0, target, weights)[:rows]
    else:  # dst -> src: row d copies slot expanded_row_idx[d] when d < min(rows, in-range slots)
        flat = expert_idx.reshape(-1)
        in_range = ((flat >= start) & (flat < end)).sum()
        source = expanded_row_idx[:rows].long()
        moved = torch.where(torch.arange(rows) < in_range, weights[source], 0.0)
    return moved.reshape(rows, 1)


def moe_init_routing(
    x,
    expert_idx,
    *,
    scale=None,
    offset=None,
    topk_weight=None,
    active_num=-1,
    expert_capacity=-1,
    expert_num=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=False,
    quant_mode=-1,
    active_expert_range=(),
    row_idx_type=0,
    x_dtype=None,
):
    """cann_ops_transformer.ops.moe_init_routing(Tensor x, Tensor expert_idx, *, Tensor? scale=None,
    Tensor? offset=None, Tensor? topk_weight=None, int active_num=-1, int expert_capacity=-1,
    int expert_num=-1, int drop_pad_mode=0, int expert_tokens_num_type=0,
    bool expert_tokens_num_flag=False, int quant_mode=-1, int[2] active_expert_range=[],
    int row_idx_type=0, Any x_dtype=None) -> (expanded_x, expanded_row_idx,
    expert_tokens_count_or_cumsum, expanded_scale, expanded_topk_weight)

    Source: seed 001 (ops-transformer moe_init_routing_v4's torch API, torchapi_moe_init_routing.md).
    MoeInitRoutingV3 semantics (SPEC-layer 1.17): partial ``active_expert_range``,
    ``row_idx_type`` 0 / 1, counts (int64) as cumsum / count / key-value, ``scale [T]`` moved
    into ``expanded_scale``. ``topk_weight [T, K]`` float32 is moved like the rows into
    ``expanded_topk_weight [rows, 1]`` (zeros where no slot fills a row); without it, and for
    the counts without ``expert_tokens_num_flag``, the output is an empty tensor of shape (0,).
    Quantisation (``quant_mode`` != -1, ``offset``) is refused by name.

    Differentiable in x (seed 001's automatic backward): MoeInitRoutingV2Grad with the forward's
    ``top_k``, ``drop_pad_mode``, ``active_num``; the -1 rows of a partial range are skipped. A
    backward through a forward that used ``scale``, ``topk_weight``, ``x_dtype`` or
    ``row_idx_type=1`` raises ``NotImplementedError`` naming it (seed 001 section 9).

    Under ``torch.export`` with a dynamic token count, ``active_num`` equal to
    ``expert_idx.numel()`` (every slot) exports as -1 (T*K rows), as ``npu_moe_init_routing_v2``.
    """
    op_type, api = "MoeInitRoutingV3", "cann_ops_transformer.ops.moe_init_routing"
    if follows(active_num, expert_idx.numel(), x.shape[0] * expert_idx.shape[-1]):
        active_num = -1
    if quant_mode != -1:
        refuse(op_type, api, "quant_mode", quant_mode, f"{QUANT_MODES.get(quant_mode, 'not a quant_mode')}")
    if offset is not None:
        refuse(op_type, api, "offset", "<tensor>", "an input of quantisation (quant_mode 0) only")
    if topk_weight is not None:
        if topk_weight.dtype != torch.float32:
            raise MoeOpError(f"{api}: topk_weight must be float32, got {topk_weight.dtype}", BAD_DTYPE, op_type=op_type)
        if tuple(topk_weight.shape) != tuple(expert_idx.shape):
            raise MoeOpError(
                f"{api}: topk_weight must be [T, K] like expert_idx {list(expert_idx.shape)}, "
                f"got {list(topk_weight.shape)}",
                op_type=op_type,
            )
        if x.requires_grad:
            x = _NoBackward.apply(x, "topk_weight")
    ranged = list(active_expert_range or [])
    expanded_x, expanded_row_idx, counts, expanded_scale = FUNCTIONS[op_type](
        x,
        expert_idx,
        scale,
        active_num=active_num,
        expert_capacity=expert_capacity,
        expert_num=expert_num,
        drop_pad_mode=drop_pad_mode,
        expert_tokens_num_type=expert_tokens_num_type,
        expert_tokens_num_flag=expert_tokens_num_flag,
        active_expert_range=ranged or None,
        row_idx_type=row_idx_type,
        x_dtype=stored_dtype_name(op_type, api, "x_dtype", x_dtype, STORED_X_DTYPES),
    )
    if topk_weight is None:
        moved = _empty(torch.float32)
    else:
        start, end = expert_range(ranged, expert_num)
        rows = expanded_scale.shape[0]
        moved = _moved_topk_weight(topk_weight, expert_idx, expanded_row_idx, rows, start, end, row_idx_type)
    counts = counts if counts is not None else _empty(torch.int64)
    return expanded_x, expanded_row_idx, counts, expanded_scale, moved


def moe_init_routing_grad(grad_expanded_x, expanded_row_idx, top_k, drop_pad_mode=0, active_num=0):
    """cann_ops_transformer.moe_init_routing_grad(Tensor grad_expanded_x, Tensor expanded_row_idx,
    int top_k, int drop_pad_mode=0, int active_num=0) -> Tensor

    Source: seed 001 (ops-transformer moe_init_routing_grad.py, torchapi_moe_init_routing_grad.md).
    Runs ``cann.moe::MoeInitRoutingV2Grad`` (SPEC 1.3): ``grad_x [len(expanded_row_idx) / top_k,
    H]``. Seed 001 section 7's argument rules (2-D / 3-D by mode, float16/bfloat16/float32,
    a 1-D int32 index divisible by top_k, top_k > 0, drop_pad_mode 0 or 1, active_num >= 0,
    the rows by mode) are the op's, raised as ``MoeOpError``.
    """
    return FUNCTIONS["MoeInitRoutingV2Grad"](
        grad_expanded_x, expanded_row_idx, top_k=top_k, drop_pad_mode=drop_pad_mode, active_num=active_num
    )


#: the names of ``cann_ops_transformer`` and of ``cann_ops_transformer.ops`` (the same functions)
NAMES = {
    f.__name__: checked(f.__name__, f, "cann_ops_transformer")
    for f in (moe_re_routing, moe_init_routing, moe_init_routing_grad)
}
globals().update(NAMES)  # the module's names are the checked ones too

__all__ = ["NAMES", "moe_init_routing", "moe_init_routing_grad", "moe_re_routing"]
