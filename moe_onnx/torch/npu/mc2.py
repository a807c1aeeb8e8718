"""torch_npu's names of the MC2 expert-parallel exchange (SPEC-mc2 1.19-1.25): the fused
dispatch and combine, V1 and V2, as vLLM-Ascend's ``TokenDispatcherWithMC2`` calls them, and
the all-to-all-v grouped matmuls of MindSpeed's mc2 dispatcher.

Each runs its ``cann.moe`` op on the communicator of its group: ``group_ep`` names a group
registered with :func:`moe_onnx.torch.collectives.register_group`, any other name (what
``get_hccl_comm_name`` returned on the device) the default process group. Index directions:
V1's ``expand_idx`` is on the sender, src slot -> offset of its row in its (expert, rank)
block; V2's ``assist_info_for_combine`` is on the receiver, dst row -> (src rank, token, slot)
at ``3d``. Gradients: none for dispatch / combine (torch_npu has none, SPEC-mc2 1.19 g); the
grouped matmuls differentiate as MindSpeed's autograd Function does (``autograd.py``). What
the golden does not compute is refused by name (SPEC-mc2 1.26 d). ``hcom`` (the grouped
matmuls' group name) follows the same registry as ``group_ep``.
"""

from __future__ import annotations

import torch

from ...custom_ops import OPS
from ..collectives import group_ranks_of
from ..ops import FUNCTIONS
from .common import refuse as _refuse

__all__ = [
    "npu_moe_distribute_dispatch",
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_distribute_combine",
    "npu_moe_distribute_combine_v2",
    "npu_alltoallv_gmm",
    "npu_gmm_alltoallv",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_QUANT_MODES = {1: "static quantisation", 3: "per-group quantisation", 4: "mx quantisation"}


def _refuse_dispatch(op_type: str, name: str, x, quant_mode: int, tp_world_size: int) -> None:
    if x.dtype not in _FLOATS:
        why = "the pass-through of pre-quantised tokens (int8 / fp8 / int4 in int32) is not computed"
        _refuse(op_type, name, "x", f"<{x.dtype} tensor>", why)
    if quant_mode not in (0, 2):
        why = f"{_QUANT_MODES.get(quant_mode, 'an unknown mode')}; 0 (none) and 2 (dynamic per-token int8) are"
        _refuse(op_type, name, "quant_mode", quant_mode, why)
    if tp_world_size == 2:
        _refuse(op_type, name, "tp_world_size", 2, "tensor parallelism inside the exchange (SPEC-mc2 1.19 h)")


def _attrs(op_type: str, arguments: dict) -> dict:
    """The op's attributes among a torch_npu call's arguments (same names), given ones only,
    and the ranks of the group ``group_ep`` names when it is a registered sub-group."""
    attrs = {a.name: arguments[a.name] for a in OPS[op_type].attrs if a.name in arguments}
    return attrs | _group_ranks(arguments["group_ep"])


def _group_ranks(name: str) -> dict:
    """``{"group_ranks": ranks}`` for a name registered for a group smaller than the world."""
    ranks = group_ranks_of(name)
    return {} if ranks is None else {"group_ranks": ranks}


def npu_moe_distribute_dispatch(
    x,
    expert_ids,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    scales=None,
    x_active_mask=None,
    expert_scales=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    quant_mode=0,
    global_bs=0,
    expert_token_nums_type=1,
):
    """torch_npu.npu_moe_distribute_dispatch(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size,
    int ep_rank_id, int moe_expert_num, *, Tensor? scales=None, Tensor? x_active_mask=None,
    Tensor? expert_scales=None, str group_tp="", int tp_world_size=0, int tp_rank_id=0,
    int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, int quant_mode=0,
    int global_bs=0, int expert_token_nums_type=1)
    -> (expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml and
    MoeDistributeDispatchKernelOpApi.cpp (with expert_scales, ep_recv_counts is allocated
    ``W*L' + 2*G*K*(W/8)`` long: the A2 layered reserve, here zeros). Runs
    ``cann.moe::MoeDistributeDispatch`` (SPEC-mc2 1.20). Refused by name: quant_mode 1, 3, 4;
    tp_world_size 2; a 2-D x_active_mask (V1 takes a 1-D prefix mask); pre-quantised x.
    """
    arguments = dict(locals())
    name, op_type = "npu_moe_distribute_dispatch", "MoeDistributeDispatch"
    _refuse_dispatch(op_type, name, x, quant_mode, tp_world_size)
    if x_active_mask is not None and x_active_mask.dim() != 1:
        _refuse(op_type, name, "x_active_mask", f"<{x_active_mask.dim()}-D mask>", "V1 takes a [BS] prefix mask")
    outs = list(
        FUNCTIONS[op_type](
            x,
            expert_ids,
            scales,
            x_active_mask,
            expert_scales,
            **_attrs(op_type, arguments),
        )
    )
    if expert_scales is not None:
        groups = global_bs or x.shape[0] * ep_world_size
        reserve = 2 * groups * expert_ids.shape[1] * (ep_world_size // 8)
        outs[4] = torch.cat([outs[4], outs[4].new_zeros(reserve)])
    return tuple(outs)


def npu_moe_distribute_dispatch_v2(
    x,
    expert_ids,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    scales=None,
    x_active_mask=None,
    expert_scales=None,
    elastic_info=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    quant_mode=0,
    global_bs=0,
    expert_token_nums_type=1,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
    y_dtype=None,
    x_dtype=None,
    scales_dtype=None,
):
    """torch_npu.npu_moe_distribute_dispatch_v2(Tensor x, Tensor expert_ids, str group_ep, int ep_world_size,
    int ep_rank_id, int moe_expert_num, *, Tensor? scales=None, Tensor? x_active_mask=None,
    Tensor? expert_scales=None, Tensor? elastic_info=None, Tensor? performance_info=None, str group_tp="",
    int tp_world_size=0, int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1,
    int shared_expert_rank_num=0, int quant_mode=0, int global_bs=0, int expert_token_nums_type=1,
    str comm_alg="", int zero_expert_num=0, int copy_expert_num=0, int const_expert_num=0,
    int? y_dtype=None, int? x_dtype=None, int? scales_dtype=None)
    -> (expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts,
    tp_recv_counts, expand_scales)

    Source: Ascend/op-plugin, op_plugin_functions.yaml and MoeDistributeDispatchV2KernelOpApi.cpp.
    Runs ``cann.moe::MoeDistributeDispatchV2`` (SPEC-mc2 1.21). Refused by name: elastic_info,
    performance_info, x_dtype, scales_dtype, y_dtype (unless the dtype produced anyway),
    quant_mode 1, 3, 4, tp_world_size 2, pre-quantised x.
    """
    arguments = dict(locals())
    name, op_type = "npu_moe_distribute_dispatch_v2", "MoeDistributeDispatchV2"
    _refuse_dispatch(op_type, name, x, quant_mode, tp_world_size)
    for argument, value, why in (
        ("elastic_info", elastic_info, "dynamic shrinking of the EP group"),
        ("performance_info", performance_info, "device timing"),
        ("x_dtype", x_dtype, "x is read as its own dtype"),
        ("scales_dtype", scales_dtype, "scales are float32"),
    ):
        if value is not None:
            _refuse(op_type, name, argument, value if not isinstance(value, torch.Tensor) else "<tensor>", why)
    produced = torch.int8 if quant_mode == 2 else x.dtype
    if y_dtype is not None and y_dtype != produced:
        _refuse(op_type, name, "y_dtype", y_dtype, f"expand_x is {produced} for this x and quant_mode")
    return FUNCTIONS[op_type](
        x,
        expert_ids,
        scales,
        x_active_mask,
        expert_scales,
        None,
        **_attrs(op_type, arguments),
    )


def _send_counts(ep_send_counts, ep_world_size, ep_rank_id, moe_expert_num, shared_expert_rank_num):
    """The dispatch's ``ep_recv_counts`` without V1's zero reserve: its first ``W*L'`` entries."""
    local = (
        1 if ep_rank_id < shared_expert_rank_num else moe_expert_num // max(ep_world_size - shared_expert_rank_num, 1)
    )
    return (
        ep_send_counts[: ep_world_size * local] if ep_send_counts.shape[0] > ep_world_size * local else ep_send_counts
    )


def _refuse_combine(op_type: str, name: str, expand_x, tp_world_size: int, comm_quant_mode: int) -> None:
    if expand_x.dtype not in _FLOATS:
        _refuse(op_type, name, "expand_x", f"<{expand_x.dtype} tensor>", "the A2 layered dequantisation path")
    if comm_quant_mode != 0:
        _refuse(op_type, name, "comm_quant_mode", comm_quant_mode, "int8 quantisation of the exchange")
    if tp_world_size == 2:
        _refuse(op_type, name, "tp_world_size", 2, "tensor parallelism inside the exchange (SPEC-mc2 1.19 h)")


def npu_moe_distribute_combine(
    expand_x,
    expert_ids,
    expand_idx,
    ep_send_counts,
    expert_scales,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    tp_send_counts=None,
    x_active_mask=None,
    activation_scale=None,
    weight_scale=None,
    group_list=None,
    expand_scales=None,
    shared_expert_x=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    global_bs=0,
    out_dtype=0,
    comm_quant_mode=0,
    group_list_type=0,
):
    """torch_npu.npu_moe_distribute_combine(Tensor expand_x, Tensor expert_ids, Tensor expand_idx,
    Tensor ep_send_counts, Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id,
    int moe_expert_num, *, Tensor? tp_send_counts=None, Tensor? x_active_mask=None,
    Tensor? activation_scale=None, Tensor? weight_scale=None, Tensor? group_list=None,
    Tensor? expand_scales=None, Tensor? shared_expert_x=None, str group_tp="", int tp_world_size=0,
    int tp_rank_id=0, int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0,
    int global_bs=0, int out_dtype=0, int comm_quant_mode=0, int group_list_type=0) -> Tensor

    Source: Ascend/op-plugin, op_plugin_functions.yaml and MoeDistributeCombineKernelOpApi.cpp.
    Runs ``cann.moe::MoeDistributeCombine`` (SPEC-mc2 1.22). Refused by name: activation_scale,
    weight_scale, group_list, out_dtype != 0, group_list_type != 0, comm_quant_mode != 0, int32
    expand_x, tp_world_size 2, and shared_expert_x (op-plugin accepts it but never passes it to
    aclnnMoeDistributeCombine: the NPU silently drops it). ``expand_scales`` and
    ``tp_send_counts`` are accepted and not read.
    """
    arguments = dict(locals())
    name, op_type = "npu_moe_distribute_combine", "MoeDistributeCombine"
    _refuse_combine(op_type, name, expand_x, tp_world_size, comm_quant_mode)
    for argument, value in (("activation_scale", activation_scale), ("weight_scale", weight_scale)):
        if value is not None:
            _refuse(op_type, name, argument, "<tensor>", "the A2 layered dequantisation path")
    if group_list is not None:
        _refuse(op_type, name, "group_list", "<tensor>", "the A2 layered dequantisation path")
    if out_dtype != 0:
        _refuse(op_type, name, "out_dtype", out_dtype, "x has expand_x's dtype")
    if group_list_type != 0:
        _refuse(op_type, name, "group_list_type", group_list_type, "the A2 layered dequantisation path")
    if shared_expert_x is not None:
        why = "op-plugin never passes it to aclnnMoeDistributeCombine, so the NPU drops it (use the V2 name)"
        _refuse(op_type, name, "shared_expert_x", "<tensor>", why)
    counts = _send_counts(ep_send_counts, ep_world_size, ep_rank_id, moe_expert_num, shared_expert_rank_num)
    return FUNCTIONS[op_type](
        expand_x,
        expert_ids,
        expand_idx,
        counts,
        expert_scales,
        tp_send_counts if tp_world_size > 0 else None,
        x_active_mask,
        None,
        None,
        None,
        expand_scales,
        **_attrs(op_type, arguments),
    )


def npu_moe_distribute_combine_v2(
    expand_x,
    expert_ids,
    assist_info_for_combine,
    ep_send_counts,
    expert_scales,
    group_ep,
    ep_world_size,
    ep_rank_id,
    moe_expert_num,
    *,
    tp_send_counts=None,
    x_active_mask=None,
    expand_scales=None,
    shared_expert_x=None,
    elastic_info=None,
    ori_x=None,
    const_expert_alpha_1=None,
    const_expert_alpha_2=None,
    const_expert_v=None,
    performance_info=None,
    group_tp="",
    tp_world_size=0,
    tp_rank_id=0,
    expert_shard_type=0,
    shared_expert_num=1,
    shared_expert_rank_num=0,
    global_bs=0,
    comm_quant_mode=0,
    comm_alg="",
    zero_expert_num=0,
    copy_expert_num=0,
    const_expert_num=0,
):
    """torch_npu.npu_moe_distribute_combine_v2(Tensor expand_x, Tensor expert_ids, Tensor assist_info_for_combine,
    Tensor ep_send_counts, Tensor expert_scales, str group_ep, int ep_world_size, int ep_rank_id,
    int moe_expert_num, *, Tensor? tp_send_counts=None, Tensor? x_active_mask=None,
    Tensor? expand_scales=None, Tensor? shared_expert_x=None, Tensor? elastic_info=None, Tensor? ori_x=None,
    Tensor? const_expert_alpha_1=None, Tensor? const_expert_alpha_2=None, Tensor? const_expert_v=None,
    Tensor? performance_info=None, str group_tp="", int tp_world_size=0, int tp_rank_id=0,
    int expert_shard_type=0, int shared_expert_num=1, int shared_expert_rank_num=0, int global_bs=0,
    int comm_quant_mode=0, str comm_alg="", int zero_expert_num=0, int copy_expert_num=0,
    int const_expert_num=0) -> Tensor

    Source: Ascend/op-plugin, op_plugin_functions.yaml and MoeDistributeCombineKernelV2OpApi.cpp.
    Runs ``cann.moe::MoeDistributeCombineV2`` (SPEC-mc2 1.23). Refused by name: elastic_info,
    performance_info, comm_quant_mode != 0, tp_world_size 2, int32 expand_x.
    """
    arguments = dict(locals())
    name, op_type = "npu_moe_distribute_combine_v2", "MoeDistributeCombineV2"
    _refuse_combine(op_type, name, expand_x, tp_world_size, comm_quant_mode)
    for argument, value, why in (
        ("elastic_info", elastic_info, "dynamic shrinking of the EP group"),
        ("performance_info", performance_info, "device timing"),
    ):
        if value is not None:
            _refuse(op_type, name, argument, "<tensor>", why)
    counts = _send_counts(ep_send_counts, ep_world_size, ep_rank_id, moe_expert_num, shared_expert_rank_num)
    return FUNCTIONS[op_type](
        expand_x,
        expert_ids,
        assist_info_for_combine,
        counts,
        expert_scales,
        tp_send_counts if tp_world_size > 0 else None,
        x_active_mask,
        None,
        None,
        None,
        expand_scales,
        shared_expert_x,
        None,
        ori_x,
        const_expert_alpha_1,
        const_expert_alpha_2,
        const_expert_v,
        **_attrs(op_type, arguments),
    )


def _counts(value) -> list[int]:
    """A count list given as a list, a tuple or a tensor (MindSpeed passes ``tensor.tolist()``)."""
    return [int(c) for c in (value.tolist() if isinstance(value, torch.Tensor) else value)]


def _refuse_count_tensors(op_type: str, name: str, send_counts_tensor, recv_counts_tensor) -> None:
    for argument, value in (("send_counts_tensor", send_counts_tensor), ("recv_counts_tensor", recv_counts_tensor)):
        if value is not None:
            _refuse(op_type, name, argument, "<tensor>", "counts as a tensor are not supported in this version")


def npu_alltoallv_gmm(
    gmm_x,
    gmm_weight,
    hcom,
    ep_world_size,
    send_counts,
    recv_counts,
    *,
    send_counts_tensor=None,
    recv_counts_tensor=None,
    mm_x=None,
    mm_weight=None,
    trans_gmm_weight=False,
    trans_mm_weight=False,
    permute_out_flag=False,
    comm_mode=None,
):
    """torch_npu.npu_alltoallv_gmm(Tensor gmm_x, Tensor gmm_weight, str hcom, int ep_world_size,
    int[] send_counts, int[] recv_counts, *, Tensor? send_counts_tensor=None, Tensor? recv_counts_tensor=None,
    Tensor? mm_x=None, Tensor? mm_weight=None, bool trans_gmm_weight=False, bool trans_mm_weight=False,
    bool permute_out_flag=False) -> (gmm_y, mm_y, permute_out)

    Source: Ascend/op-plugin, AllToAllvGmmNpuOpApi.cpp and torch_npu-npu_alltoallv_gmm.md. Runs
    ``cann.moe::AlltoAllvGroupedMatMul`` (SPEC-mc2 1.24); mm_y / permute_out are None when not
    asked for. Differentiable in gmm_x, gmm_weight, mm_x, mm_weight (MindSpeed's autograd
    Function: the inverse exchange with W transposed, dW over permute_out, which is therefore
    always computed). Refused by name: send_counts_tensor, recv_counts_tensor; ``comm_mode``
    (which engine moves the rows) is accepted and not read.
    """
    op_type = "AlltoAllvGroupedMatMul"
    _refuse_count_tensors(op_type, "npu_alltoallv_gmm", send_counts_tensor, recv_counts_tensor)
    gmm_y, mm_y, permute_out = FUNCTIONS[op_type](
        gmm_x,
        gmm_weight,
        None,
        None,
        mm_x,
        mm_weight,
        group=hcom,
        ep_world_size=ep_world_size,
        send_counts=_counts(send_counts),
        recv_counts=_counts(recv_counts),
        trans_gmm_weight=int(trans_gmm_weight),
        trans_mm_weight=int(trans_mm_weight),
        permute_out_flag=1,
        **_group_ranks(hcom),
    )
    return gmm_y, mm_y, permute_out if permute_out_flag else None


def npu_gmm_alltoallv(
    gmm_x,
    gmm_weight,
    hcom,
    ep_world_size,
    send_counts,
    recv_counts,
    *,
    send_counts_tensor=None,
    recv_counts_tensor=None,
    mm_x=None,
    mm_weight=None,
    trans_gmm_weight=False,
    trans_mm_weight=False,
    comm_mode=None,
):
    """torch_npu.npu_gmm_alltoallv(Tensor gmm_x, Tensor gmm_weight, str hcom, int ep_world_size,
    int[] send_counts, int[] recv_counts, *, Tensor? send_counts_tensor=None, Tensor? recv_counts_tensor=None,
    Tensor? mm_x=None, Tensor? mm_weight=None, bool trans_gmm_weight=False, bool trans_mm_weight=False)
    -> (y, mm_y)

    Source: Ascend/op-plugin, GmmAllToAllvNpuOpApi.cpp and torch_npu-npu_gmm_alltoallv.md. Runs
    ``cann.moe::GroupedMatMulAlltoAllv`` (SPEC-mc2 1.25); mm_y is None without mm_x.
    Differentiable as MindSpeed's Function (the inverse exchange through AlltoAllvGroupedMatMul).
    Refused by name: send_counts_tensor, recv_counts_tensor; ``comm_mode`` is not read.
    """
    op_type = "GroupedMatMulAlltoAllv"
    _refuse_count_tensors(op_type, "npu_gmm_alltoallv", send_counts_tensor, recv_counts_tensor)
    return FUNCTIONS[op_type](
        gmm_x,
        gmm_weight,
        None,
        None,
        mm_x,
        mm_weight,
        group=hcom,
        ep_world_size=ep_world_size,
        send_counts=_counts(send_counts),
        recv_counts=_counts(recv_counts),
        trans_gmm_weight=int(trans_gmm_weight),
        trans_mm_weight=int(trans_mm_weight),
        **_group_ranks(hcom),
    )
