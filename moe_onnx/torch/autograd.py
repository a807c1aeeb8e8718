"""Backward formulas: each forward op's gradient is its matching ``cann.moe`` op.

=================================  =================================================
forward                            backward
=================================  =================================================
MoeInitRoutingV2                   MoeInitRoutingV2Grad
MoeInitRoutingV3                   MoeInitRoutingV2Grad (seed 001's moe_init_routing autograd)
MoeTokenPermuteWithRoutingMap      MoeTokenPermuteWithRoutingMapGrad
MoeTokenUnpermuteWithRoutingMap    MoeTokenUnpermuteWithRoutingMapGrad
MoeReRoutingV2 / MoeReRouting      MoeReRoutingV2 with the counts transposed (the inverse reorder)
MoeTokenPermute                    MoeTokenPermuteGrad (tokens; torch_npu: npu_moe_token_permute_grad_v2)
MoeTokenUnpermute                  MoeTokenUnpermuteGrad (permuted_tokens, probs; npu_moe_token_unpermute_grad_v2)
MoeFinalizeRoutingV2               MoeFinalizeRoutingV2Grad (rows, scales); x1, x2 get grad_y
GroupedMatmul                      GroupedMatmul twice (dx: split M, W transposed; dW: split K)
SwiGlu                             SwiGluGrad
AllToAll                           AllToAll back (send what was received)
AllGather                          AllToAll of the gathered gradient, summed (a reduce-scatter)
MoeGatingTopK                      MoeGatingTopKBackward (sigmoid scores, out_flag=1; y only)
AlltoAllvGroupedMatMul             GroupedMatMulAlltoAllv (the inverse exchange, W transposed); dW by
                                   GroupedMatmul split K over permute_out (MindSpeed's Function)
GroupedMatMulAlltoAllv             AlltoAllvGroupedMatMul (the inverse exchange, W transposed); dW
                                   the same way over the exchanged gradient
=================================  =================================================

Index and count inputs get no gradient. The backward ops are custom ops too, so a compiled
or exported backward graph holds ``cann_moe`` nodes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..custom_ops import MoeOpError
from .ops import OVERLOADS

_ops = torch.ops.cann_moe


def _meta(tensor: torch.Tensor) -> tuple:
    """What a zero gradient for ``tensor`` needs: its shape and dtype (not its memory)."""
    return tuple(tensor.shape), tensor.dtype


def _or_zeros(grad: torch.Tensor | None, meta: tuple) -> torch.Tensor:
    shape, dtype = meta
    return torch.zeros(shape, dtype=dtype) if grad is None else grad


# --- MoeReRoutingV2 / MoeReRouting ---------------------------------------------------------


def _rerouting_setup(ctx, inputs, keyword_only_inputs, output):
    tokens, counts, scales = inputs[:3]
    weight = inputs[3] if len(inputs) > 3 else None
    ctx.save_for_backward(counts)
    ctx.has_scales = scales is not None and scales.dtype.is_floating_point and scales.dtype.itemsize == 4
    ctx.has_weight = weight is not None
    ctx.like = [_meta(o) for o in output]


def _rerouting_backward(ctx, grad_tokens, grad_scales, _idx, _count, *maybe_grad_weight):
    """Rows went rank-major (r, e) -> expert-major (e, r); the gradient goes back by the same
    op with the roles of ranks and experts swapped: counts [N, E] -> counts.T [E, N]."""
    (counts,) = ctx.saved_tensors
    scales = _or_zeros(grad_scales, ctx.like[1]) if ctx.has_scales else None
    weight = _or_zeros(maybe_grad_weight[0], ctx.like[4]) if ctx.has_weight else None
    back = _ops.moe_re_routing_v2(_or_zeros(grad_tokens, ctx.like[0]), counts.T.contiguous(), scales, weight)
    grads = [back[0], None, back[1] if ctx.has_scales else None]
    if len(ctx.needs_input_grad) > 3:
        grads.append(back[4] if ctx.has_weight else None)
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad))


# --- MoeInitRoutingV2 ------------------------------------------------------------------


def _init_routing_setup(ctx, inputs, keyword_only_inputs, output):
    x, expert_idx = inputs
    ctx.save_for_backward(output[1])
    ctx.top_k = expert_idx.shape[1]
    ctx.drop_pad_mode = keyword_only_inputs["drop_pad_mode"]
    ctx.active_num = keyword_only_inputs["active_num"]
    ctx.like = _meta(output[0])


def _init_routing_backward(ctx, grad_expanded_x, *_):
    (expanded_row_idx,) = ctx.saved_tensors
    grad_x = _ops.moe_init_routing_v2_grad(
        _or_zeros(grad_expanded_x, ctx.like),
        expanded_row_idx,
        top_k=ctx.top_k,
        drop_pad_mode=ctx.drop_pad_mode,
        active_num=ctx.active_num,
    )
    return grad_x, None


# --- MoeInitRoutingV3 ------------------------------------------------------------------


def v4_only_features(scale, x_dtype, row_idx_type) -> list[str]:
    """What seed 001 (section 9) names as aclnnMoeInitRoutingV4-only features of a forward call:
    its automatic backward is only the V2 grad's. (offset, topk_weight and quantisation are
    also such features; the forward refuses or handles them before this op.)"""
    found = ["scale"] if scale is not None else []
    if x_dtype is not None:
        found.append(f"x_dtype={x_dtype!r}")
    if row_idx_type != 0:
        found.append(f"row_idx_type={row_idx_type}")
    return found


def _init_routing_v3_setup(ctx, inputs, keyword_only_inputs, output):
    x, expert_idx, scale, _offset = inputs
    attrs = keyword_only_inputs
    ctx.save_for_backward(output[1])
    ctx.top_k = expert_idx.shape[1]
    ctx.drop_pad_mode = attrs["drop_pad_mode"]
    ctx.active_num = attrs["active_num"]
    ctx.v4_only = v4_only_features(scale, attrs.get("x_dtype"), attrs["row_idx_type"])
    ctx.like = _meta(output[0])


def _init_routing_v3_backward(ctx, grad_expanded_x, *_):
    """MoeInitRoutingV2Grad with the forward's top_k, drop_pad_mode, active_num (seed 001): rows
    of inactive experts are -1, which dropless mode skips (SPEC 1.3); active mode skips indices
    >= active_num, so there they are given that value."""
    if ctx.v4_only:
        raise NotImplementedError(
            f"moe_init_routing: no automatic backward when the forward uses {', '.join(ctx.v4_only)} "
            "(aclnnMoeInitRoutingV4 features; seed 001 section 9): the backward is MoeInitRoutingV2Grad's"
        )
    (expanded_row_idx,) = ctx.saved_tensors
    grad = _or_zeros(grad_expanded_x, ctx.like)
    slots, active_num = expanded_row_idx.shape[0], ctx.active_num
    if ctx.drop_pad_mode == 0 and 0 < active_num < slots:
        expanded_row_idx = torch.where(expanded_row_idx < 0, active_num, expanded_row_idx).to(torch.int32)
    else:
        active_num = 0  # all T*K rows were kept: dropless
    grad_x = _ops.moe_init_routing_v2_grad(
        grad, expanded_row_idx, top_k=ctx.top_k, drop_pad_mode=ctx.drop_pad_mode, active_num=active_num
    )
    return grad_x, None, None, None


# --- routing-map permute / unpermute ---------------------------------------------------


def _permute_setup(ctx, inputs, keyword_only_inputs, output):
    tokens, routing_map, probs = inputs
    ctx.save_for_backward(output[1], routing_map)
    ctx.has_probs = probs is not None
    ctx.drop_and_pad = keyword_only_inputs["drop_and_pad"]
    ctx.like = (_meta(output[0]), _meta(output[2]))


def _permute_backward(ctx, grad_tokens, _sorted, grad_probs):
    sorted_indices, routing_map = ctx.saved_tensors
    probs_grad_in = _or_zeros(grad_probs, ctx.like[1]) if ctx.has_probs else None
    tokens_grad, probs_grad = _ops.moe_token_permute_with_routing_map_grad(
        _or_zeros(grad_tokens, ctx.like[0]), probs_grad_in, sorted_indices, routing_map, drop_and_pad=ctx.drop_and_pad
    )
    return tokens_grad, None, probs_grad if ctx.has_probs else None


def _unpermute_setup(ctx, inputs, keyword_only_inputs, output):
    permuted_tokens, _sorted, routing_map, probs = inputs
    ctx.has_probs = probs is not None
    ctx.save_for_backward(output[1], output[2], routing_map, permuted_tokens if ctx.has_probs else None, probs)
    restore_shape = keyword_only_inputs["restore_shape"]
    ctx.attrs = dict(drop_and_pad=keyword_only_inputs["padded_mode"], restore_shape=restore_shape)
    ctx.like = _meta(output[0])


def _unpermute_backward(ctx, grad_unpermuted, *_):
    out_index, permute_token_id, routing_map, permuted_tokens, probs = ctx.saved_tensors
    attrs = {k: v for k, v in ctx.attrs.items() if v is not None}
    tokens_grad, probs_grad = _ops.moe_token_unpermute_with_routing_map_grad(
        _or_zeros(grad_unpermuted, ctx.like), out_index, permute_token_id, routing_map, permuted_tokens, probs, **attrs
    )
    return tokens_grad, None, None, probs_grad if ctx.has_probs else None


# --- token permute / unpermute (indices, not a routing map) -------------------------------


def _token_permute_setup(ctx, inputs, keyword_only_inputs, output):
    tokens, indices = inputs
    ctx.save_for_backward(output[1])
    ctx.top_k = 1 if indices.dim() == 1 else indices.shape[1]
    ctx.like = _meta(output[0])


def _token_permute_backward(ctx, grad_permuted, _sorted):
    """op-plugin derivatives.yaml: tokens <- npu_moe_token_permute_grad_v2(grad, sorted_indices, ...)."""
    (sorted_indices,) = ctx.saved_tensors
    grad = _ops.moe_token_permute_grad(_or_zeros(grad_permuted, ctx.like), sorted_indices, num_topk=ctx.top_k)
    return grad, None


def _token_unpermute_setup(ctx, inputs, keyword_only_inputs, output):
    permuted_tokens, sorted_indices, probs = inputs
    ctx.has_probs = probs is not None
    # as torch_npu: the permuted rows are kept for the backward only with probs (their dot)
    ctx.save_for_backward(permuted_tokens if ctx.has_probs else None, sorted_indices, probs)
    ctx.rows = permuted_tokens.shape[0]
    ctx.like = _meta(output)


def _token_unpermute_backward(ctx, grad):
    """derivatives.yaml: permuted_tokens, probs <- npu_moe_token_unpermute_grad_v2(grad, sorted_indices, ...)."""
    permuted_tokens, sorted_indices, probs = ctx.saved_tensors
    rows = {} if ctx.has_probs else {"permuted_tokens_num": ctx.rows}
    tokens_grad, probs_grad = _ops.moe_token_unpermute_grad(
        permuted_tokens, _or_zeros(grad, ctx.like), sorted_indices, probs, **rows
    )
    return tokens_grad, None, probs_grad if ctx.has_probs else None


# --- gating --------------------------------------------------------------------------------


def _gating_setup(ctx, inputs, keyword_only_inputs, output):
    _y, expert_idx, out = output
    ctx.mark_non_differentiable(expert_idx, out)  # derivatives.yaml: output_differentiability [true, false, false]
    ctx.save_for_backward(out, expert_idx)
    ctx.attrs = {a: keyword_only_inputs[a] for a in ("renorm", "norm_type", "routed_scaling_factor", "eps")}
    ctx.out_flag = keyword_only_inputs["out_flag"]
    ctx.like = _meta(_y)


def _gating_backward(ctx, grad_y, _grad_idx, _grad_out):
    """y's gradient through MoeGatingTopKBackward (torch_npu's derivatives.yaml); the selection,
    the bias and ``out`` (not differentiable, as in torch_npu) get none. Refused, naming why,
    where the NPU has no correct gradient: norm_type 0/2 (its backward is sigmoid-only) and
    out_flag=0 (the backward reads out, which the NPU writes only with the flag)."""
    norm_type = ctx.attrs["norm_type"]
    if norm_type != 1:
        raise MoeOpError(
            f"backward: only the sigmoid scores (norm_type=1) have a gradient (MoeGatingTopKBackward), "
            f"got norm_type={norm_type}",
            op_type="MoeGatingTopK",
        )
    if not ctx.out_flag:
        raise MoeOpError(
            "backward: pass out_flag=1 (True) to train; the gradient reads out, which the NPU writes only "
            "with out_flag",
            op_type="MoeGatingTopK",
        )
    out, expert_idx = ctx.saved_tensors
    grad_x = _ops.moe_gating_top_k_backward(out, _or_zeros(grad_y, ctx.like), expert_idx, **ctx.attrs)
    return grad_x, None, None, None


# --- finalize routing, grouped matmul, SwiGLU (SPEC-layer 1.8-1.10) -------------------


def _finalize_setup(ctx, inputs, keyword_only_inputs, output):
    expanded_x, expanded_row_idx, x1, x2, bias, scales, expert_idx = inputs
    ctx.mode = keyword_only_inputs["drop_pad_mode"]
    ctx.has = (x1 is not None, x2 is not None, bias is not None, scales is not None)
    ctx.save_for_backward(
        expanded_row_idx,
        expanded_x if scales is not None else None,
        scales,
        expert_idx if bias is not None else None,
        bias,
    )
    ctx.x_shape = tuple(expanded_x.shape)
    ctx.like = _meta(output)


def _finalize_backward(ctx, grad_y):
    """Rows and scales through MoeFinalizeRoutingV2Grad (row-arranged: the forward's column-
    arranged modes 0/1 convert the index first); x1 and x2 get grad_y itself. CANN computes no
    bias gradient: asking for one raises."""
    expanded_row_idx, expanded_x, scales, expert_idx, bias = ctx.saved_tensors
    has_x1, has_x2, has_bias, has_scales = ctx.has
    if has_bias and ctx.needs_input_grad[4]:
        raise NotImplementedError("cann_moe::moe_finalize_routing_v2: no gradient for bias (CANN computes none)")
    grad_y = _or_zeros(grad_y, ctx.like)
    tokens, slots = grad_y.shape[0], expanded_row_idx.shape[0]
    if ctx.mode in (0, 1):  # slot j*R + i -> i*K + j
        expanded_row_idx = expanded_row_idx.view(-1, tokens).T.contiguous().view(-1)
    padded = ctx.mode in (1, 3)
    attrs = {"drop_pad_mode": int(padded)}
    if padded:
        attrs.update(expert_num=ctx.x_shape[0], expert_capacity=ctx.x_shape[1])
    elif ctx.x_shape[0] > slots:
        raise NotImplementedError(
            f"cann_moe::moe_finalize_routing_v2: no gradient for expanded_x of {ctx.x_shape[0]} rows, more than the "
            f"R*K = {slots} slots (MoeFinalizeRoutingV2Grad gives [R*K, H] in dropless mode)"
        )
    elif ctx.x_shape[0] < slots:
        attrs["active_num"] = ctx.x_shape[0]
    grad_rows, grad_scales = _ops.moe_finalize_routing_v2_grad(
        grad_y, expanded_row_idx, expanded_x, scales, expert_idx, bias, **attrs
    )
    return (
        grad_rows,
        None,
        grad_y if has_x1 else None,
        grad_y if has_x2 else None,
        None,
        grad_scales if has_scales else None,
        None,
    )


def _grouped_matmul_setup(ctx, inputs, keyword_only_inputs, output):
    x, weight, bias, group_list = inputs
    ctx.save_for_backward(x, weight, group_list)
    ctx.attrs = {
        k: keyword_only_inputs[k] for k in ("group_type", "group_list_type", "transpose_weight", "transpose_x")
    }
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.like = _meta(output)


def _grouped_matmul_backward(ctx, grad_y):
    """MindSpeed's formulation: dx by another split-M product with the weights transposed, dW by
    a split-K product of x and dy over the same groups ([E, K, N]), dbias the per-group sum of
    dy (float32, in row order). group_type 2 (the split-K product itself) has no formula here."""
    x, weight, group_list = ctx.saved_tensors
    group_type, list_type = ctx.attrs["group_type"], ctx.attrs["group_list_type"]
    trans_w, trans_x = ctx.attrs["transpose_weight"], ctx.attrs["transpose_x"]
    if group_type == 2:
        raise NotImplementedError("cann_moe::grouped_matmul: no gradient for group_type 2 (split K)")
    dy = _or_zeros(grad_y, ctx.like)
    grouped = {} if group_type == -1 else {"group_list_type": list_type}
    split_k = -1 if group_type == -1 else 2
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x = grad_w = grad_b = None
    if need_x:  # dy @ W^T, then stored as x is
        grad_x = _ops.grouped_matmul(
            dy, weight, None, group_list, group_type=group_type, transpose_weight=1 - trans_w, **grouped
        )
        grad_x = grad_x.T.contiguous() if trans_x else grad_x
    if need_w:  # X^T dy per group ([K, N]), or dy^T X for a weight stored [N, K]
        if trans_w:
            grad_w = _ops.grouped_matmul(
                dy, x, None, group_list, group_type=split_k, transpose_x=1, transpose_weight=trans_x, **grouped
            )
        else:
            grad_w = _ops.grouped_matmul(
                x, dy, None, group_list, group_type=split_k, transpose_x=1 - trans_x, **grouped
            )
    if need_b and ctx.bias_dtype is not None:
        wide = dy.float()
        if group_type == -1:
            grad_b = wide.sum(0)
        else:
            # the group of each row from the groups' end rows: sizes that do not depend on the
            # counts' values, so torch.compile / torch.export trace this backward (repeat_interleave
            # by the counts does not); rows past the last group fall in the spare group E, dropped
            ends = group_list.cumsum(0) if list_type == 1 else group_list
            groups = len(ends)
            group_of_row = torch.searchsorted(ends, torch.arange(dy.shape[0], dtype=ends.dtype), right=True)
            grad_b = wide.new_zeros(groups + 1, wide.shape[1]).index_add_(0, group_of_row, wide)[:groups]
        grad_b = grad_b.to(ctx.bias_dtype)
    return grad_x, grad_w, grad_b, None


def _swi_glu_setup(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.dim = keyword_only_inputs["dim"]
    ctx.like = _meta(output)


def _swi_glu_backward(ctx, grad_y):
    (x,) = ctx.saved_tensors
    return _ops.swi_glu_grad(_or_zeros(grad_y, ctx.like), x, dim=ctx.dim)


# --- collectives -----------------------------------------------------------------------


def _all_to_all_setup(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(output[1])
    ctx.like = _meta(output[0])
    ctx.group_ranks = keyword_only_inputs["group_ranks"]


def _all_to_all_backward(ctx, grad_recv, _counts):
    """The rows received from rank s go back to rank s: an AllToAll with the received counts
    (on the same group)."""
    (recv_counts,) = ctx.saved_tensors
    grad_data, _ = _ops.all_to_all(_or_zeros(grad_recv, ctx.like), recv_counts, group_ranks=ctx.group_ranks)
    return grad_data, None


def _all_gather_setup(ctx, inputs, keyword_only_inputs, output):
    ctx.shape = inputs[0].shape
    ctx.like = _meta(output)
    ctx.group_ranks = keyword_only_inputs["group_ranks"]


def _all_gather_backward(ctx, grad_y):
    """Rank r's x reached y[r] on every rank of the group: its gradient is the sum over the
    group's ranks of grad_y[r]."""
    grad_y = _or_zeros(grad_y, ctx.like)
    size = grad_y.shape[0]
    ones = torch.ones(size, dtype=torch.int64)
    rows, _ = _ops.all_to_all(grad_y.reshape(size, -1), ones, group_ranks=ctx.group_ranks)
    return rows.sum(0).reshape(ctx.shape)


# --- the all-to-all-v grouped matmuls (SPEC-mc2 1.24 d) ---------------------------------------


def _gmm_setup(ctx, inputs, keyword_only_inputs, output):
    gmm_x, gmm_weight, _, _, mm_x, mm_weight = inputs
    ctx.attrs = dict(keyword_only_inputs)
    ctx.permuted = len(output) == 3 and bool(keyword_only_inputs.get("permute_out_flag", 0))
    rows = output[2] if ctx.permuted else None
    ctx.save_for_backward(gmm_x, gmm_weight, mm_x, mm_weight, rows)
    ctx.like = [_meta(o) for o in output]


def _weight_grad(rows, grad_rows, counts, trans: int):
    """Per local expert ``rows_e^T @ grad_e`` ([E_l, H, N]; ``grad_e^T @ rows_e`` stored
    transposed): GroupedMatmul split K over the same groups."""
    if trans:
        return _ops.grouped_matmul(grad_rows, rows, None, counts, group_type=2, transpose_x=1, group_list_type=1)
    return _ops.grouped_matmul(rows, grad_rows, None, counts, group_type=2, transpose_x=1, group_list_type=1)


def _mm_grads(ctx, mm_x, mm_weight, grad_mm_y):
    """The independent product ``mm_y = mm_x @ W`` (``W.T`` when stored transposed)."""
    if mm_x is None:
        return None, None
    dy = _or_zeros(grad_mm_y, ctx.like[1])
    trans = ctx.attrs.get("trans_mm_weight", 0)
    grad_x = _ops.grouped_matmul(dy, mm_weight, group_type=-1, transpose_weight=1 - trans)
    first, second = (dy, mm_x) if trans else (mm_x, dy)
    grad_w = _ops.grouped_matmul(first, second, group_type=-1, transpose_x=1)
    return grad_x, grad_w


def _exchange_attrs(ctx) -> dict:
    """The backward's lists: the forward's swapped (what came in goes back)."""
    return dict(
        group=ctx.attrs["group"],
        group_ranks=ctx.attrs.get("group_ranks"),
        ep_world_size=ctx.attrs["ep_world_size"],
        send_counts=ctx.attrs["recv_counts"],
        recv_counts=ctx.attrs["send_counts"],
        trans_gmm_weight=1 - ctx.attrs.get("trans_gmm_weight", 0),
    )


def _groups(counts: list, world: int) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).reshape(world, -1).sum(0)


def _alltoallv_gmm_backward(ctx, grad_gmm_y, grad_mm_y, _grad_permute_out=None):
    """MindSpeed's AllToAllGroupedMatmul backward: d gmm_x by GroupedMatMulAlltoAllv of the
    gradient with the lists swapped and W transposed; dW over permute_out by the groups this
    rank received."""
    gmm_x, gmm_weight, mm_x, mm_weight, rows = ctx.saved_tensors
    dy = _or_zeros(grad_gmm_y, ctx.like[0])
    grad_x, _ = _ops.grouped_mat_mul_allto_allv(dy, gmm_weight, None, None, None, None, **_exchange_attrs(ctx))
    grad_w = None
    if ctx.needs_input_grad[1]:
        if rows is None:
            raise RuntimeError(
                "cann_moe::allto_allv_grouped_mat_mul: gmm_weight's gradient needs permute_out_flag=1 "
                "(the rows each expert multiplied); torch_npu.npu_alltoallv_gmm sets it"
            )
        counts = _groups(ctx.attrs["recv_counts"], ctx.attrs["ep_world_size"])
        grad_w = _weight_grad(rows, dy, counts, ctx.attrs.get("trans_gmm_weight", 0))
    grad_mm_x, grad_mm_w = _mm_grads(ctx, mm_x, mm_weight, grad_mm_y)
    return grad_x, grad_w, None, None, grad_mm_x, grad_mm_w


def _gmm_alltoallv_backward(ctx, grad_y, grad_mm_y):
    """The inverse: AlltoAllvGroupedMatMul of the gradient (lists swapped, W transposed) gives
    d gmm_x and, as its permute_out, the products' gradient for dW by the groups this rank sent."""
    gmm_x, gmm_weight, mm_x, mm_weight, _ = ctx.saved_tensors
    dy = _or_zeros(grad_y, ctx.like[0])
    grad_x, _, grad_rows = _ops.allto_allv_grouped_mat_mul(
        dy, gmm_weight, None, None, None, None, permute_out_flag=1, **_exchange_attrs(ctx)
    )
    grad_w = None
    if ctx.needs_input_grad[1]:
        counts = _groups(ctx.attrs["send_counts"], ctx.attrs["ep_world_size"])
        grad_w = _weight_grad(gmm_x, grad_rows, counts, ctx.attrs.get("trans_gmm_weight", 0))
    grad_mm_x, grad_mm_w = _mm_grads(ctx, mm_x, mm_weight, grad_mm_y)
    return grad_x, grad_w, None, None, grad_mm_x, grad_mm_w


_FORMULAS: dict[str, tuple[Callable, Callable]] = {
    "MoeReRoutingV2": (_rerouting_backward, _rerouting_setup),
    "MoeReRouting": (_rerouting_backward, _rerouting_setup),
    "MoeInitRoutingV2": (_init_routing_backward, _init_routing_setup),
    "MoeInitRoutingV3": (_init_routing_v3_backward, _init_routing_v3_setup),
    "MoeTokenPermuteWithRoutingMap": (_permute_backward, _permute_setup),
    "MoeTokenUnpermuteWithRoutingMap": (_unpermute_backward, _unpermute_setup),
    "AllToAll": (_all_to_all_backward, _all_to_all_setup),
    "AllGather": (_all_gather_backward, _all_gather_setup),
    "MoeTokenPermute": (_token_permute_backward, _token_permute_setup),
    "MoeTokenUnpermute": (_token_unpermute_backward, _token_unpermute_setup),
    "MoeGatingTopK": (_gating_backward, _gating_setup),
    "MoeFinalizeRoutingV2": (_finalize_backward, _finalize_setup),
    "GroupedMatmul": (_grouped_matmul_backward, _grouped_matmul_setup),
    "SwiGlu": (_swi_glu_backward, _swi_glu_setup),
    "AlltoAllvGroupedMatMul": (_alltoallv_gmm_backward, _gmm_setup),
    "GroupedMatMulAlltoAllv": (_gmm_alltoallv_backward, _gmm_setup),
}

#: forward ops that torch_npu does not differentiate (no op-plugin ``derivatives.yaml`` entry):
#: op type -> why. A backward through one raises, naming the op, instead of a silent zero.
NOT_DIFFERENTIABLE: dict[str, str] = {
    "MoeInitRouting": "torch_npu.npu_moe_init_routing has no derivatives.yaml entry (inference only)",
    "MoeComputeExpertTokens": "its output is integer row counts (torch_npu has no derivative either)",
    "MoeGatingTopKSoftmax": "torch_npu has no derivative of npu_moe_gating_top_k_softmax (inference only)",
    **{
        name: f"torch_npu has no derivative of the MC2 {name} (inference only, SPEC-mc2 1.19 g)"
        for name in (
            "MoeDistributeDispatch",
            "MoeDistributeDispatchV2",
            "MoeDistributeCombine",
            "MoeDistributeCombineV2",
        )
    },
}


def _refusing_backward(name: str, why: str) -> Callable:
    def backward(ctx, *grads):
        raise RuntimeError(f"cann_moe::{name} is not differentiable: {why}")

    return backward


def _no_setup(ctx, inputs, output, keyword_only_inputs=None):
    """(torch passes ``keyword_only_inputs`` to ops with keyword-only attributes)"""


for _name, (_backward, _setup) in _FORMULAS.items():
    torch.library.register_autograd(OVERLOADS[_name], _backward, setup_context=_setup)
for _name, _why in NOT_DIFFERENTIABLE.items():
    torch.library.register_autograd(OVERLOADS[_name], _refusing_backward(_name, _why), setup_context=_no_setup)
