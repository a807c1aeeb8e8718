"""torch_npu's names of the routing operators (SPEC 1.1-1.6, SPEC-layer 1.17): re-routing,
init routing (V3), the routing-map permute / unpermute and the grad entry points training
code calls (MindSpeed's ``MoePermuteMaskMap`` / ``MoeUnpermuteMaskMap``).

Autograd is torch_npu's (op-plugin ``derivatives.yaml``): the permute and the unpermute (public
and private) differentiate through their grad ops; re-routing, init routing and the grad
entry points are not differentiated by torch_npu (here re-routing and init routing are: the
backward formulas of their ``cann_moe`` ops, SPEC 1.1 and seed 001).
"""

from __future__ import annotations

import torch

from ...custom_ops.moe_init_routing_v3 import KEY_VALUE, QUANT_MODES, STORED_X_DTYPES, expert_range
from ...custom_ops.moe_re_routing_v2 import PACKED_TOKEN_DTYPES
from ..ops import FUNCTIONS
from .common import follows as _follows
from .common import is_symbolic as _is_symbolic
from .common import refuse as _refuse
from .common import stored_dtype_name as _stored_dtype_name


def npu_moe_re_routing(
    tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_token_num_type=1, idx_type=0, tokens_dtype=None
):
    """torch_npu.npu_moe_re_routing(Tensor tokens, Tensor expert_token_num_per_rank, *,
    Tensor? per_token_scales=None, int expert_token_num_type=1, int idx_type=0, int? tokens_dtype=None)
    -> (permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml and
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_re_routing.md (also hiascend.com, PyTorch
    7.0.0 API list, ptaoplist_002370). Runs ``cann.moe::MoeReRouting``. ``tokens_dtype`` names
    the real type of uint8 tokens: ``torch_npu.hifloat8`` / ``float4_e2m1fn_x2`` /
    ``float4_e1m2fn_x2`` (the constants 290 / 296 / 297, as MoeReRoutingOpApi.cpp checks) or
    those names; the bytes are moved as they are. The NPU supports only
    ``expert_token_num_type=1`` and ``idx_type=0``; here the other values work too (cumsum,
    scatter index), as the ONNX op defines them.
    """
    name = _stored_dtype_name("MoeReRouting", "npu_moe_re_routing", "tokens_dtype", tokens_dtype, PACKED_TOKEN_DTYPES)
    return FUNCTIONS["MoeReRouting"](
        tokens,
        expert_token_num_per_rank,
        per_token_scales,
        expert_token_num_type=expert_token_num_type,
        idx_type=idx_type,
        tokens_dtype=name,
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
    x_dtype=None,
):
    """torch_npu.npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None,
    Tensor? offset=None, int active_num=-1, int expert_capacity=-1, int expert_num=-1,
    int drop_pad_mode=0, int expert_tokens_num_type=0, bool expert_tokens_num_flag=False,
    int quant_mode=-1, int[2] active_expert_range=[], int row_idx_type=0, int? x_dtype=None)
    -> (expanded_x, expanded_row_idx, expert_token_cumsum_or_count, expanded_scale)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml,
    op_plugin/ops/opapi/MoeInitRoutingV2KernelNpuOpApi.cpp and
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_init_routing_v2.md. Runs
    ``cann.moe::MoeInitRoutingV3`` (SPEC-layer 1.17), as the OpApi calls aclnnMoeInitRoutingV3
    (its legacy aclnnMoeInitRoutingV2 path, taken on old CANN for E = 128, H = 2048, gives the
    same rows and counts). Every mode but quantisation: partial ``active_expert_range``,
    ``row_idx_type`` 0 / 1, counts as cumsum / count / key-value (int64; always a tensor, as
    op-plugin allocates it: zeros unless ``expert_tokens_num_flag``, where the NPU leaves it
    unwritten), ``scale [T]`` moved with the rows into ``expanded_scale`` (float32 ``[rows]``,
    zeros without ``scale``). ``x_dtype`` names the real type of uint8
    storage (``torch_npu.hifloat8`` or a float4 / float8 name): the rows are moved as bytes.
    ``quant_mode`` other than -1 and ``offset`` (quantisation only) are refused by name.

    Under ``torch.export`` with a dynamic token count, an ``active_num`` that is every slot
    (``topk_ids.shape[0] * topk_ids.shape[1]`` in cann-recipes-infer, ``topk_ids.numel()`` in
    omni-infer: symbolically ``expert_idx.numel()``) exports as ``active_num = -1``, which
    means T*K rows (SPEC-layer 1.17: ``A = T*K if active_num <= 0``); the same rows at every T.
    Any other symbolic ``active_num`` is refused (an ONNX attribute is a constant).
    """
    name, op_type = "npu_moe_init_routing_v2", "MoeInitRoutingV3"
    if _follows(active_num, expert_idx.numel(), x.shape[0] * expert_idx.shape[-1]):
        active_num = -1
    if quant_mode != -1:
        what = QUANT_MODES.get(quant_mode, "not a quant_mode")
        _refuse(op_type, name, "quant_mode", quant_mode, f"{what}; the CPU golden does not quantise")
    if offset is not None:
        _refuse(op_type, name, "offset", "<tensor>", "an input of quantisation (quant_mode 0) only")
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
        active_expert_range=list(active_expert_range) or None,
        row_idx_type=row_idx_type,
        x_dtype=_stored_dtype_name(op_type, name, "x_dtype", x_dtype, STORED_X_DTYPES),
    )
    if counts is None:  # op-plugin allocates it whatever the flag (SPEC-layer 1.17 (a) amended)
        counts = _unwritten_counts(x, expert_num, expert_tokens_num_type, active_expert_range)
    return expanded_x, expanded_row_idx, counts, expanded_scale


def _unwritten_counts(x, expert_num: int, expert_tokens_num_type: int, active_expert_range) -> torch.Tensor:
    """The counts tensor MoeInitRoutingV2KernelNpuOpApi.cpp allocates without
    ``expert_tokens_num_flag`` (int64 ``[end - start]``, or ``[E, 2]`` key-value), as zeros: the NPU
    leaves it unwritten."""
    start, end = expert_range(list(active_expert_range), expert_num)
    shape = (expert_num, 2) if expert_tokens_num_type == KEY_VALUE else (end - start,)
    return torch.zeros(shape, dtype=torch.int64, device=x.device)


def _permute_rows(tokens, routing_map, num_out_tokens, drop_and_pad):
    """The ONNX op's ``num_out_tokens`` for torch_npu's: None means T rows, the rows are rounded
    down to a multiple of T (not padded) or E (padded), as the OpApi does; a size that follows
    a dynamic T (under export: ``T * K``) becomes ``-K``, K rows per token (SPEC 1.4)."""
    n_tokens, n_experts = tokens.shape[0], routing_map.shape[1]
    rows = n_tokens if num_out_tokens is None else num_out_tokens
    per = n_experts if drop_and_pad else n_tokens
    if not _is_symbolic([rows, per]):
        return rows // per * per if per else 0
    if drop_and_pad:
        return rows  # refused by the op's function: an attribute cannot follow a dynamic size
    top_k = rows // n_tokens
    static = top_k if isinstance(top_k, int) else top_k.node.maybe_as_int()
    if static is None:
        raise TypeError(
            f"npu_moe_token_permute_with_routing_map: num_out_tokens = {rows} is not a whole multiple of the "
            f"token count {n_tokens} that export can see: pass tokens.shape[0] * K for a constant K"
        )
    return -static


def npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False):
    """torch_npu.npu_moe_token_permute_with_routing_map(Tensor tokens, Tensor routing_map, *,
    Tensor? probs=None, int? num_out_tokens=None, bool drop_and_pad=False)
    -> (permuted_tokens, permuted_probs, sorted_indices)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml, derivatives.yaml and
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_token_permute_with_routing_map.md.
    Runs ``cann.moe::MoeTokenPermuteWithRoutingMap``, differentiable in tokens and probs (its
    grad op, as derivatives.yaml). As on the NPU, ``num_out_tokens=None`` means ``tokens_num``
    and the rows are rounded down to ``K * tokens_num`` (not padded) or ``capacity *
    experts_num`` (padded). Under ``torch.export`` with a dynamic token count, ``num_out_tokens
    = tokens.shape[0] * K`` exports as the attribute value ``-K`` (K rows per token).
    ``permuted_probs`` is None without ``probs``. Note torch_npu's return order: probs before
    indices (the ONNX op's is the other way).
    """
    rows = _permute_rows(tokens, routing_map, num_out_tokens, drop_and_pad)
    permuted_tokens, sorted_indices, permuted_probs = FUNCTIONS["MoeTokenPermuteWithRoutingMap"](
        tokens, routing_map, probs, num_out_tokens=rows, drop_and_pad=int(drop_and_pad)
    )
    return permuted_tokens, permuted_probs, sorted_indices


def _size_or_none(value, given):
    """An attribute the grad op can also read from ``routing_map``: left out when symbolic."""
    return None if _is_symbolic([value]) and given is not None else value


def npu_moe_token_permute_with_routing_map_grad(
    permuted_token_out_grad, probs_grad, sorted_indices, routing_map, experts_num, tokens_num, drop_and_pad
):
    """torch_npu.npu_moe_token_permute_with_routing_map_grad(Tensor permuted_token_out_grad,
    Tensor? probs_grad, Tensor sorted_indices, Tensor routing_map, SymInt experts_num,
    SymInt tokens_num, bool drop_and_pad) -> (tokens_grad, probs_grad)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml and
    op_plugin/ops/opapi/MoeTokenPermuteWithRoutingMapGradOpApi.cpp (MindSpeed's
    ``MoePermuteMaskMap.backward`` calls it so). Runs
    ``cann.moe::MoeTokenPermuteWithRoutingMapGrad``; ``probs_grad`` of the result is None
    without ``probs_grad``. Symbolic ``experts_num`` / ``tokens_num`` are read from
    ``routing_map``. Not differentiable (as in torch_npu).
    """
    tokens_grad, result_probs_grad = FUNCTIONS["MoeTokenPermuteWithRoutingMapGrad"](
        permuted_token_out_grad,
        probs_grad,
        sorted_indices,
        routing_map,
        experts_num=_size_or_none(experts_num, routing_map),
        tokens_num=_size_or_none(tokens_num, routing_map),
        drop_and_pad=int(drop_and_pad),
    )
    return tokens_grad, result_probs_grad


def _restore_or_none(restore_shape, routing_map) -> list | None:
    """``restore_shape`` as the ONNX attribute; None (T from routing_map) when it is symbolic."""
    restore: list | None = list(restore_shape)
    if _is_symbolic(restore or []) and routing_map is not None:
        restore = None
    return restore


def _npu_moe_token_unpermute_with_routing_map(
    permuted_tokens, sorted_indices, restore_shape, *, probs=None, routing_map=None, drop_and_pad=False
):
    """torch_npu._npu_moe_token_unpermute_with_routing_map(Tensor permuted_tokens,
    Tensor sorted_indices, int[] restore_shape, *, Tensor? probs=None, Tensor? routing_map=None,
    bool drop_and_pad=False) -> (unpermuted_tokens, out_index, permuted_token_id, permute_probs)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml, derivatives.yaml and
    op_plugin/ops/opapi/MoeTokenUnpermuteWithRoutingMapKernelOpApi.cpp (MindSpeed's
    ``MoeUnpermuteMaskMap.forward`` calls it). Runs ``cann.moe::MoeTokenUnpermuteWithRoutingMap``
    and returns its four outputs (``permute_probs`` None without ``probs``); differentiable in
    ``permuted_tokens`` and ``probs`` through the grad op, as derivatives.yaml (not padded it
    passes ``sorted_indices`` as both index inputs; the forward's ``out_index`` /
    ``permuted_token_id`` give the same gradient, SPEC 1.6). With ``probs``, ``routing_map`` is
    required. A symbolic ``restore_shape`` takes T from ``routing_map``.
    """
    return FUNCTIONS["MoeTokenUnpermuteWithRoutingMap"](
        permuted_tokens,
        sorted_indices,
        routing_map,
        probs,
        padded_mode=int(drop_and_pad),
        restore_shape=_restore_or_none(restore_shape, routing_map),
    )


def npu_moe_token_unpermute_with_routing_map(
    permuted_tokens, sorted_indices, restore_shape, *, probs=None, routing_map=None, drop_and_pad=False
):
    """torch_npu.npu_moe_token_unpermute_with_routing_map(Tensor permuted_tokens,
    Tensor sorted_indices, int[] restore_shape, *, Tensor? probs=None, Tensor? routing_map=None,
    bool drop_and_pad=False) -> Tensor

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml and
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_token_unpermute_with_routing_map.md.
    Runs ``cann.moe::MoeTokenUnpermuteWithRoutingMap`` and returns ``unpermuted_tokens`` (the
    first output of ``_npu_moe_token_unpermute_with_routing_map``, as the OpApi does),
    differentiable as that one. With ``probs``, ``routing_map`` is required (it says which prob
    belongs to which row). When ``restore_shape`` holds a symbolic size (a dynamic token count
    under export) and ``routing_map`` is given, T is taken from ``routing_map``.
    """
    unpermuted, *_ = _npu_moe_token_unpermute_with_routing_map(
        permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map, drop_and_pad=drop_and_pad
    )
    return unpermuted


def npu_moe_token_unpermute_with_routing_map_grad(
    unpermuted_tokens_grad,
    out_index,
    permuted_token_id,
    routing_map,
    permuted_tokens,
    probs,
    drop_and_pad,
    restore_shape,
):
    """torch_npu.npu_moe_token_unpermute_with_routing_map_grad(Tensor unpermuted_tokens_grad,
    Tensor out_index, Tensor permuted_token_id, Tensor? routing_map, Tensor? permuted_tokens,
    Tensor? probs, bool drop_and_pad, int[] restore_shape) -> (permuted_tokens_grad, probs_grad)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml and
    op_plugin/ops/opapi/MoeTokenUnpermuteWithRoutingMapGradKernelNpuOpApi.cpp (derivatives.yaml
    and MindSpeed's ``MoeUnpermuteMaskMap.backward`` call it). Runs
    ``cann.moe::MoeTokenUnpermuteWithRoutingMapGrad`` (SPEC 1.6 as amended: not padded, the
    token of slot i is i // K and ``permuted_token_id`` is not read, so ``sorted_indices`` may
    be passed for both). ``probs_grad`` is None without ``probs`` and has the dtype of
    ``probs`` (the OpApi allocates the grad's dtype; SPEC 1.6 keeps the probs'). Not
    differentiable (as in torch_npu).
    """
    return FUNCTIONS["MoeTokenUnpermuteWithRoutingMapGrad"](
        unpermuted_tokens_grad,
        out_index,
        permuted_token_id,
        routing_map,
        permuted_tokens,
        probs,
        drop_and_pad=int(drop_and_pad),
        restore_shape=_restore_or_none(restore_shape, routing_map),
    )


__all__ = [
    "_npu_moe_token_unpermute_with_routing_map",
    "npu_moe_init_routing_v2",
    "npu_moe_re_routing",
    "npu_moe_token_permute_with_routing_map",
    "npu_moe_token_permute_with_routing_map_grad",
    "npu_moe_token_unpermute_with_routing_map",
    "npu_moe_token_unpermute_with_routing_map_grad",
]
