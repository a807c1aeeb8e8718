"""The same math in PyTorch eager, written the way Megatron-LM's ``moe_utils`` writes it.

Each builder takes a benchmark :class:`~benchmarks.harness.Case` and returns a zero-argument
callable over tensors prepared once (bfloat16 crosses as its bits), or None where Megatron has
no counterpart. torch is optional: ``pip install torch==2.13.0`` (the CPU build).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moe_onnx.custom_ops import OpDef
from moe_onnx.custom_ops.grouped_matmul import GROUPED_MATMUL
from moe_onnx.custom_ops.moe_compute_expert_tokens import MOE_COMPUTE_EXPERT_TOKENS
from moe_onnx.custom_ops.moe_finalize_routing_v2 import MOE_FINALIZE_ROUTING_V2
from moe_onnx.custom_ops.moe_gating_top_k import MOE_GATING_TOP_K
from moe_onnx.custom_ops.moe_gating_top_k_backward import MOE_GATING_TOP_K_BACKWARD
from moe_onnx.custom_ops.moe_gating_top_k_softmax import MOE_GATING_TOP_K_SOFTMAX
from moe_onnx.custom_ops.moe_init_routing import MOE_INIT_ROUTING
from moe_onnx.custom_ops.moe_init_routing_v2 import MOE_INIT_ROUTING_V2
from moe_onnx.custom_ops.moe_init_routing_v2_grad import MOE_INIT_ROUTING_V2_GRAD
from moe_onnx.custom_ops.moe_init_routing_v3 import MOE_INIT_ROUTING_V3, expert_range
from moe_onnx.custom_ops.moe_re_routing_v2 import MOE_RE_ROUTING_V2
from moe_onnx.custom_ops.moe_token_permute import MOE_TOKEN_PERMUTE
from moe_onnx.custom_ops.moe_token_permute_grad import MOE_TOKEN_PERMUTE_GRAD
from moe_onnx.custom_ops.moe_token_permute_with_routing_map import MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP
from moe_onnx.custom_ops.moe_token_permute_with_routing_map_grad import MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD
from moe_onnx.custom_ops.moe_token_unpermute import MOE_TOKEN_UNPERMUTE
from moe_onnx.custom_ops.moe_token_unpermute_grad import MOE_TOKEN_UNPERMUTE_GRAD
from moe_onnx.custom_ops.moe_token_unpermute_with_routing_map import MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP
from moe_onnx.custom_ops.moe_token_unpermute_with_routing_map_grad import MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD
from moe_onnx.custom_ops.swi_glu import SWI_GLU


def _tensor(array: np.ndarray):
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def re_routing(case) -> Callable:
    """``sort_chunks_by_idxs``: split by (rank, expert) counts, concatenate expert-major."""
    import torch

    tokens = _tensor(case.inputs["tokens"])
    counts = case.inputs["expert_token_num_per_rank"]
    ranks, experts = counts.shape
    split_sizes = counts.ravel().tolist()
    order = [r * experts + e for e in range(experts) for r in range(ranks)]

    def run():
        chunks = torch.split(tokens, split_sizes, dim=0)
        return torch.cat([chunks[i] for i in order], dim=0)

    return run


def init_routing(case) -> Callable | None:
    """Dropless permute by top-k indices: stable sort of the expert ids, index_select."""
    import torch

    if case.attrs.get("drop_pad_mode", 0):
        return None
    x, expert_idx = _tensor(case.inputs["x"]), _tensor(case.inputs["expert_idx"]).long()
    top_k = expert_idx.shape[1]

    def run():
        sorted_indices = torch.argsort(expert_idx.view(-1), stable=True)
        return x.index_select(0, sorted_indices // top_k)

    return run


def init_routing_grad(case) -> Callable | None:
    """Unpermute without probs: scatter_add of every copy's gradient into its token (float32)."""
    import torch

    if case.attrs.get("drop_pad_mode", 0):
        return None
    grad = _tensor(case.inputs["grad_expanded_x"])
    row_of_slot = _tensor(case.inputs["expanded_row_idx"]).long()
    top_k = case.attrs["top_k"]
    tokens, hidden = len(row_of_slot) // top_k, grad.shape[-1]
    token_of_slot = torch.arange(len(row_of_slot)) // top_k

    def run():
        out = torch.zeros(tokens, hidden, dtype=torch.float32)
        out.index_add_(0, token_of_slot, grad.index_select(0, row_of_slot).float())
        return out.to(grad.dtype)

    return run


def init_routing_v3(case) -> Callable | None:
    """Dropless permute of one rank's experts: a stable sort that puts the in-range ids first,
    index_select of those rows, zeros after them (as ``init_routing``, with the range mask)."""
    import torch

    if case.attrs.get("drop_pad_mode", 0):
        return None
    x, expert_idx = _tensor(case.inputs["x"]), _tensor(case.inputs["expert_idx"]).long()
    start, end = expert_range(case.attrs.get("active_expert_range"), case.attrs["expert_num"])
    top_k, flat = expert_idx.shape[1], expert_idx.view(-1)
    active_num = case.attrs.get("active_num", -1)
    rows = flat.numel() if active_num <= 0 else min(active_num, flat.numel())

    def run():
        in_range = (flat >= start) & (flat < end)
        order = torch.argsort(torch.where(flat < start, 2**31 - 1, flat), stable=True)
        filled = min(rows, int(in_range.sum()))
        out = torch.zeros((rows, x.shape[1]), dtype=x.dtype)
        out[:filled] = x.index_select(0, order[:filled] // top_k)
        return out

    return run


def permute(case) -> Callable | None:
    """Megatron ``permute(tokens, routing_map)`` (not padded)."""
    import torch

    if case.attrs.get("drop_and_pad", 0):
        return None
    tokens = _tensor(case.inputs["tokens"])
    routing_map = _tensor(case.inputs["routing_map"]).bool()
    probs = case.inputs.get("probs")
    probs = None if probs is None else _tensor(probs)

    def run():
        mask = routing_map.T.contiguous()
        token_indices = torch.arange(tokens.shape[0]).unsqueeze(0).expand(mask.shape[0], -1)
        sorted_indices = token_indices.masked_select(mask)
        permuted = tokens.index_select(0, sorted_indices)
        permuted_probs = None if probs is None else probs.T.contiguous().masked_select(mask)
        return permuted, sorted_indices, permuted_probs

    return run


def _slot_rows(case):
    """``sorted_indices`` here maps token-major slot p = t*K + j to its permuted row (the
    inverse of Megatron's row -> token list), so a token's K rows are one index_select."""
    return _tensor(case.inputs["sorted_indices"]).long()


def permute_grad(case) -> Callable | None:
    """The backward of ``permute``: each token sums its K rows' gradients (float32); the
    probs gradient is scattered back to the routed positions."""
    import torch

    if case.attrs.get("drop_and_pad", 0):
        return None
    grad = _tensor(case.inputs["permuted_tokens_grad"])
    slot_rows = _slot_rows(case)
    routing_map = _tensor(case.inputs["routing_map"]).bool()
    probs_grad = case.inputs.get("permuted_probs_grad")
    probs_grad = None if probs_grad is None else _tensor(probs_grad)
    tokens, hidden = routing_map.shape[0], grad.shape[1]

    def run():
        result = grad.index_select(0, slot_rows).view(tokens, -1, hidden).float().sum(1).to(grad.dtype)
        if probs_grad is None:
            return result
        full = torch.zeros(routing_map.T.shape, dtype=probs_grad.dtype)
        return result, full.masked_scatter_(routing_map.T.contiguous(), probs_grad).T

    return run


def unpermute(case) -> Callable | None:
    """Megatron ``unpermute`` (not padded): weight each token's K rows by their probs, sum."""
    if case.attrs.get("padded_mode", 0):
        return None
    permuted = _tensor(case.inputs["permuted_tokens"])
    slot_rows = _slot_rows(case)
    routing_map = _tensor(case.inputs["routing_map"]).bool()
    probs = case.inputs.get("probs")
    probs = None if probs is None else _tensor(probs)
    tokens, hidden = routing_map.shape[0], permuted.shape[1]

    def run():
        rows = permuted.index_select(0, slot_rows).view(tokens, -1, hidden).float()
        if probs is not None:  # token-major, experts ascending: the slot order
            rows = rows * probs.masked_select(routing_map).view(tokens, -1, 1).float()
        return rows.sum(1).to(permuted.dtype)

    return run


def unpermute_grad(case) -> Callable | None:
    """The backward of ``unpermute``: gather the token gradient to every row, times its prob;
    the probs gradient is the row-wise dot product with the forward's rows."""
    import torch

    if case.attrs.get("drop_and_pad", 0):
        return None
    grad = _tensor(case.inputs["unpermuted_tokens_grad"])
    out_index = _tensor(case.inputs["out_index"]).long()
    token_id = _tensor(case.inputs["permute_token_id"]).long()
    probs = case.inputs.get("probs")
    routing_map = case.inputs.get("routing_map")
    permuted = case.inputs.get("permuted_tokens")
    probs = None if probs is None else _tensor(probs)
    mask = None if routing_map is None else _tensor(routing_map).bool().T.contiguous()
    permuted = None if permuted is None else _tensor(permuted)

    def run():
        rows = torch.empty((len(out_index), grad.shape[1]), dtype=grad.dtype)
        rows[out_index] = grad.index_select(0, token_id)
        if probs is None:
            return rows
        assert permuted is not None and mask is not None  # the op requires both with probs
        rows32 = rows.float()
        row_probs_grad = (rows32 * permuted.float()).sum(-1)
        probs_grad = torch.zeros(mask.shape, dtype=probs.dtype).masked_scatter_(mask, row_probs_grad.to(probs.dtype)).T
        permuted_probs = probs.T.contiguous().masked_select(mask)
        return (rows32 * permuted_probs.unsqueeze(-1).float()).to(grad.dtype), probs_grad

    return run


# --- by expert indices (npu_moe_token_permute / unpermute, v1 init routing) -----------------
# Megatron-LM's permute/unpermute and the backward torch autograd runs for them. Megatron's
# sorted_indices (dst row -> src slot) is what the forward would have handed its backward, so it
# is computed once, outside the timed call.


def _megatron_index(sorted_indices):
    """Megatron's sorted_indices: the inverse of the fused op's src slot -> dst row."""
    import torch

    return torch.argsort(_tensor(sorted_indices).long(), stable=True)


def token_permute(case) -> Callable:
    """Megatron ``permute(tokens, indices)``: stable argsort of the ids, index_select."""
    import torch

    tokens, indices = _tensor(case.inputs["tokens"]), _tensor(case.inputs["indices"]).long()
    top_k = 1 if indices.dim() == 1 else indices.shape[1]

    def run():
        sorted_indices = torch.argsort(indices.view(-1), stable=True)
        return tokens.index_select(0, sorted_indices // top_k), sorted_indices

    return run


def gating_softmax(case) -> Callable:
    """What the recipes write without the fused op: ``torch.topk(softmax(x), k)`` (sorted)."""
    import torch

    x, k = _tensor(case.inputs["x"]), case.attrs["k"]

    def run():
        return torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)

    return run


def token_permute_grad(case) -> Callable:
    """Autograd of ``index_select``: index_add of the rows' gradients into their tokens (float32)."""
    import torch

    grad = _tensor(case.inputs["permuted_output_grad"])
    top_k = case.attrs["num_topk"]
    token_of_row = _megatron_index(case.inputs["sorted_indices"])[: grad.shape[0]] // top_k
    tokens = len(case.inputs["sorted_indices"]) // top_k

    def run():
        out = torch.zeros(tokens, grad.shape[1], dtype=torch.float32)
        return out.index_add_(0, token_of_row, grad.float()).to(grad.dtype)

    return run


def token_unpermute(case) -> Callable:
    """Megatron ``unpermute``: index_copy the rows to their slots, weight by probs, sum over K."""
    import torch

    permuted = _tensor(case.inputs["permuted_tokens"])
    probs = case.inputs.get("probs")
    probs = None if probs is None else _tensor(probs)
    megatron = _megatron_index(case.inputs["sorted_indices"])[: permuted.shape[0]]
    slots, top_k = len(case.inputs["sorted_indices"]), 1 if probs is None else probs.shape[1]

    def run():
        rows = torch.zeros(slots, permuted.shape[1], dtype=permuted.dtype).index_copy_(0, megatron, permuted)
        rows = rows.view(-1, top_k, permuted.shape[1])
        return (rows if probs is None else rows.float() * probs.unsqueeze(-1)).sum(1).to(permuted.dtype)

    return run


def token_unpermute_grad(case) -> Callable | None:
    """Autograd of ``unpermute``: the token gradient times each slot's prob, gathered back to the rows
    (index_copy's backward is index_select); probs' gradient the dot with the saved slot rows."""
    import torch

    probs = case.inputs.get("probs")
    if probs is None or case.inputs.get("permuted_tokens") is None:
        return None
    probs = _tensor(probs)
    grad = _tensor(case.inputs["unpermuted_tokens_grad"])
    permuted = _tensor(case.inputs["permuted_tokens"])
    megatron = _megatron_index(case.inputs["sorted_indices"])[: permuted.shape[0]]
    slots, top_k, hidden = len(case.inputs["sorted_indices"]), probs.shape[1], permuted.shape[1]
    saved = torch.zeros(slots, hidden, dtype=permuted.dtype).index_copy_(0, megatron, permuted).view(-1, top_k, hidden)

    def run():
        g = grad.float()
        slot_grad = (g.unsqueeze(1) * probs.unsqueeze(-1)).to(grad.dtype).view(slots, hidden)
        probs_grad = torch.bmm(saved.float(), g.unsqueeze(-1)).squeeze(-1).to(probs.dtype)
        return slot_grad.index_select(0, megatron), probs_grad

    return run


def finalize_routing(case) -> Callable | None:
    """Gather each token's K rows, weight them by scales, sum (float32), add the skip (mode 2)."""
    if case.attrs.get("drop_pad_mode", 0) != 2 or case.inputs.get("bias") is not None:
        return None
    rows = _tensor(case.inputs["expanded_x"])
    slot_rows = _tensor(case.inputs["expanded_row_idx"]).long()
    scales = _tensor(case.inputs["scales"])
    skip = case.inputs.get("x1")
    skip = None if skip is None else _tensor(skip)
    tokens, top_k = scales.shape

    def run():
        gathered = rows.index_select(0, slot_rows).view(tokens, top_k, -1).float()
        y = (gathered * scales.float().unsqueeze(-1)).sum(1)
        return (y if skip is None else y + skip.float()).to(rows.dtype)

    return run


def swiglu(case) -> Callable | None:
    """``silu(a) * b`` of the two halves (torch's bfloat16 kernels)."""
    import torch

    x = _tensor(case.inputs["x"])
    dim = case.attrs.get("dim", -1)

    def run():
        gate, up = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(gate) * up

    return run


def gating_top_k(case) -> Callable | None:
    """Hugging Face DeepSeek-V3's ``MoEGate.forward`` (noaux_tc), written from its published
    code: sigmoid scores, ``+ e_score_correction_bias`` for the choice, group scores the sum of
    each group's top 2, ``topk_group`` groups kept by a scatter mask, the others filled with
    0.0, top-k of the rest (``sorted=False``), weights gathered from the unbiased scores,
    renormalised and scaled. Without groups the same without the group step. The weights are
    put in the order of the biased scores at the end (not part of HF's code) so that they
    compare with the op's, best first."""
    import torch

    attrs = case.attrs
    if attrs.get("norm_type") != 1 or case.inputs.get("input_ids") is not None:
        return None
    x, bias = _tensor(case.inputs["x"]), _tensor(case.inputs["bias"])
    top_k, n_group, topk_group = attrs["k"], attrs.get("group_count", 1), attrs.get("k_group", 1)
    scale = attrs.get("routed_scaling_factor", 1.0)
    tokens, experts = x.shape

    def run():
        scores = x.float().sigmoid()
        scores_for_choice = scores + bias.unsqueeze(0)
        if n_group > 1:
            group_scores = scores_for_choice.view(tokens, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(tokens, n_group, experts // n_group).reshape(tokens, -1)
            scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), 0.0)
        _, topk_idx = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)
        topk_weight = scores.gather(1, topk_idx)
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20) * scale
        best_first = torch.argsort(scores_for_choice.gather(1, topk_idx), dim=-1, descending=True)
        return topk_weight.gather(1, best_first), topk_idx.gather(1, best_first)

    return run


def init_routing_v1(case) -> Callable:
    """v1 in torch: stable argsort of the ids, gather the row numbers, copy the tokens, scatter the index."""
    import torch

    x, row_idx = _tensor(case.inputs["x"]), _tensor(case.inputs["row_idx"]).long().view(-1)
    expert_idx = _tensor(case.inputs["expert_idx"]).view(-1)
    tokens, rows = x.shape[0], min(case.attrs["active_num"], x.shape[0]) * case.inputs["expert_idx"].shape[1]

    def run():
        sorted_ids, order = torch.sort(expert_idx, stable=True)
        q = row_idx[order]
        expanded_row_idx = torch.empty_like(q).scatter_(0, q, torch.arange(len(q)))
        return x.index_select(0, q[:rows] % tokens), expanded_row_idx.int(), sorted_ids

    return run


def gating_top_k_backward(case) -> Callable:
    """torch autograd of the sigmoid path (sigmoid, gather at the chosen experts, renormalise,
    scale), its forward graph built once: each call is the backward alone."""
    import torch

    scores = _tensor(case.inputs["x_norm"])
    logits = torch.log(scores / (1 - scores)).requires_grad_()  # the logits of these scores
    grad_y = _tensor(case.inputs["grad_y"])
    expert_idx = _tensor(case.inputs["expert_idx"]).long()
    scale, eps = case.attrs.get("routed_scaling_factor", 1.0), case.attrs.get("eps", 1e-20)
    chosen = torch.sigmoid(logits).gather(1, expert_idx)
    y = chosen / (chosen.sum(dim=-1, keepdim=True) + eps) * scale

    def run():
        return torch.autograd.grad(y, logits, grad_y, retain_graph=True)[0]

    return run


def compute_expert_tokens(case) -> Callable:
    """``torch.searchsorted(sorted, arange(E), right=True)``."""
    import torch

    ids = _tensor(case.inputs["sorted_experts"])
    experts = torch.arange(case.attrs["num_experts"], dtype=ids.dtype)
    return lambda: torch.searchsorted(ids, experts, right=True).int()


def grouped_matmul(case) -> Callable | None:
    """A per-group ``torch.mm`` loop in the inputs' dtype (split M, cumsum group_list)."""
    import torch

    if case.attrs.get("group_type") != 0 or case.attrs.get("group_list_type", 0) != 0:
        return None
    x, weight = _tensor(case.inputs["x"]), _tensor(case.inputs["weight"])
    sizes = np.diff(np.concatenate([[0], case.inputs["group_list"]])).tolist()

    def run():
        return torch.cat([torch.mm(part, weight[e]) for e, part in enumerate(torch.split(x, sizes))])

    return run


#: the torch counterpart of each op that has one, by its definition
BUILDERS: dict[OpDef, Callable[..., Callable | None]] = {
    MOE_RE_ROUTING_V2: re_routing,
    MOE_INIT_ROUTING_V2: init_routing,
    MOE_INIT_ROUTING_V2_GRAD: init_routing_grad,
    MOE_INIT_ROUTING_V3: init_routing_v3,
    MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP: permute,
    MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD: permute_grad,
    MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP: unpermute,
    MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD: unpermute_grad,
    MOE_TOKEN_PERMUTE: token_permute,
    MOE_TOKEN_PERMUTE_GRAD: token_permute_grad,
    MOE_TOKEN_UNPERMUTE: token_unpermute,
    MOE_TOKEN_UNPERMUTE_GRAD: token_unpermute_grad,
    MOE_INIT_ROUTING: init_routing_v1,
    MOE_COMPUTE_EXPERT_TOKENS: compute_expert_tokens,
    MOE_GATING_TOP_K_SOFTMAX: gating_softmax,
    MOE_GATING_TOP_K: gating_top_k,
    MOE_GATING_TOP_K_BACKWARD: gating_top_k_backward,
    MOE_FINALIZE_ROUTING_V2: finalize_routing,
    SWI_GLU: swiglu,
    GROUPED_MATMUL: grouped_matmul,
}


def torch_callable(case) -> Callable | None:
    """The PyTorch eager counterpart of ``case``, or None (no torch, or no counterpart)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    builder = BUILDERS.get(case.op)
    return None if builder is None else builder(case)
