"""torch_npu's names of the routing operators (SPEC 1.1-1.6): re-routing, V2 init routing and
the routing-map permute / unpermute."""

from __future__ import annotations

import torch

from ..ops import FUNCTIONS
from .common import is_symbolic as _is_symbolic
from .common import refuse as _refuse


def npu_moe_re_routing(
    tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1, idx_type=0
):
    """torch_npu.npu_moe_re_routing(Tensor tokens, Tensor expert_token_num_per_rank, *,
    Tensor? per_token_scales=None, int expert_token_num_type=1, int idx_type=0)
    -> (permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num)

    Source: Ascend/op-plugin, docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_re_routing.md
    (also hiascend.com, PyTorch 7.0.0 API list, ptaoplist_002370). Runs ``cann.moe::MoeReRouting``.
    The NPU supports only ``expert_token_num_type=1`` and ``idx_type=0``; here the other
    values work too (cumsum, scatter index), as the ONNX op defines them.
    """
    return FUNCTIONS["MoeReRouting"](
        tokens,
        expert_token_num_per_rank,
        per_token_scales,
        expert_token_num_type=expert_token_num_type,
        idx_type=idx_type,
    )


def npu_moe_init_routing_v2(
    x,
    expert_idx,
    *,
    scale=None,
    offset=None,
    active_num=-1,
    expert_capacity=-1,
    expert_num=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=False,
    quant_mode=-1,
    active_expert_range=(),
    row_idx_type=0,
):
    """torch_npu.npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
    expert_capacity=-1, expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
    expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=[], row_idx_type=0)
    -> (expanded_x, expanded_row_idx, expert_token_cumsum_or_count, expanded_scale)

    Source: Ascend/op-plugin, docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_init_routing_v2.md.
    Runs ``cann.moe::MoeInitRoutingV2``. Supported: no quantisation (``quant_mode=-1``, no
    ``scale``/``offset``), ``row_idx_type=0`` (``expanded_row_idx[source position] = row``),
    the whole expert range, ``expert_tokens_num_type`` 0 (cumsum) or 1 (count). ``active_num``,
    ``expert_capacity``, ``expert_num`` <= 0 mean "not set". ``expert_token_cumsum_or_count``
    is int64 as on the NPU (None unless ``expert_tokens_num_flag``); ``expanded_scale`` is
    None (without ``scale`` the NPU's is meaningless).
    """
    name = "npu_moe_init_routing_v2"
    op_type = "MoeInitRoutingV2"
    if scale is not None or offset is not None:
        _refuse(op_type, name, "scale" if scale is not None else "offset", "<tensor>", "no quantisation or scales")
    if quant_mode != -1:
        _refuse(op_type, name, "quant_mode", quant_mode, "no quantisation")
    if row_idx_type != 0:
        _refuse(op_type, name, "row_idx_type", row_idx_type, "only the row_idx_type=0 index is produced")
    if list(active_expert_range) not in ([], [0, expert_num]):
        _refuse(op_type, name, "active_expert_range", list(active_expert_range), "every expert is active")
    if expert_tokens_num_flag and expert_tokens_num_type not in (0, 1):
        _refuse(op_type, name, "expert_tokens_num_type", expert_tokens_num_type, "cumsum (0) or count (1) only")
    if expert_tokens_num_flag and drop_pad_mode == 1 and expert_tokens_num_type != 1:
        _refuse(op_type, name, "expert_tokens_num_type", 0, "the NPU counts (type 1) in drop/pad mode")
    flag = (1 if expert_tokens_num_type == 0 else 2) if expert_tokens_num_flag else 0
    expanded_x, expanded_row_idx, counts, _ = FUNCTIONS[op_type](
        x,
        expert_idx,
        active_num=max(active_num, 0),
        expert_capacity=max(expert_capacity, 0),
        expert_num=max(expert_num, 0),
        drop_pad_mode=drop_pad_mode,
        expert_tokens_count_or_cumsum_flag=flag,
    )
    return expanded_x, expanded_row_idx, None if counts is None else counts.to(torch.int64), None


def npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False):
    """torch_npu.npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None,
    num_out_tokens=None, drop_and_pad=False) -> (permuted_tokens, permuted_probs, sorted_indices)

    Source: Ascend/op-plugin,
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_token_permute_with_routing_map.md.
    Runs ``cann.moe::MoeTokenPermuteWithRoutingMap``. As on the NPU, ``num_out_tokens=None``
    means ``tokens_num`` and the rows are rounded down to ``K * tokens_num`` (not padded) or
    ``capacity * experts_num`` (padded). ``permuted_probs`` is None without ``probs``.
    Note torch_npu's return order: probs before indices (the ONNX op's is the other way).
    """
    n_tokens, n_experts = routing_map.shape
    rows = n_tokens if num_out_tokens is None else num_out_tokens
    per = n_experts if drop_and_pad else n_tokens
    if not _is_symbolic([rows, per]):
        rows = rows // per * per if per else 0
    permuted_tokens, sorted_indices, permuted_probs = FUNCTIONS["MoeTokenPermuteWithRoutingMap"](
        tokens, routing_map, probs, num_out_tokens=rows, drop_and_pad=int(drop_and_pad)
    )
    return permuted_tokens, permuted_probs, sorted_indices


def npu_moe_token_unpermute_with_routing_map(
    permuted_tokens, sorted_indices, restore_shape, *, probs=None, routing_map=None, drop_and_pad=False
):
    """torch_npu.npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices,
    restore_shape, *, probs=None, routing_map=None, drop_and_pad=False) -> Tensor

    Source: Ascend/op-plugin,
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_token_unpermute_with_routing_map.md.
    Runs ``cann.moe::MoeTokenUnpermuteWithRoutingMap`` and returns ``unpermuted_tokens``.
    With ``probs``, ``routing_map`` is required (it says which prob belongs to which row).
    When ``restore_shape`` holds a symbolic size (a dynamic token count under export) and
    ``routing_map`` is given, T is taken from ``routing_map`` instead of the attribute.
    """
    restore: list | None = list(restore_shape)
    if _is_symbolic(restore or []) and routing_map is not None:
        restore = None
    unpermuted, *_ = FUNCTIONS["MoeTokenUnpermuteWithRoutingMap"](
        permuted_tokens, sorted_indices, routing_map, probs, padded_mode=int(drop_and_pad), restore_shape=restore
    )
    return unpermuted


__all__ = [
    "npu_moe_init_routing_v2",
    "npu_moe_re_routing",
    "npu_moe_token_permute_with_routing_map",
    "npu_moe_token_unpermute_with_routing_map",
]
