"""The same math in PyTorch eager, written the way Megatron-LM's ``moe_utils`` writes it.

Each builder takes a benchmark :class:`~benchmarks.harness.Case` and returns a zero-argument
callable over tensors prepared once (bfloat16 crosses as its bits), or None where Megatron has
no counterpart. torch is optional: ``pip install torch==2.13.0`` (the CPU build).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from moe_onnx.custom_ops import OpDef
from moe_onnx.custom_ops.moe_compute_expert_tokens import MOE_COMPUTE_EXPERT_TOKENS
from moe_onnx.custom_ops.moe_init_routing import MOE_INIT_ROUTING
from moe_onnx.custom_ops.moe_init_routing_v2 import MOE_INIT_ROUTING_V2
from moe_onnx.custom_ops.moe_init_routing_v2_grad import MOE_INIT_ROUTING_V2_GRAD
from moe_onnx.custom_ops.moe_re_routing_v2 import MOE_RE_ROUTING_V2
from moe_onnx.custom_ops.moe_token_permute import MOE_TOKEN_PERMUTE
from moe_onnx.custom_ops.moe_token_permute_grad import MOE_TOKEN_PERMUTE_GRAD
from moe_onnx.custom_ops.moe_token_permute_with_routing_map import MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP
from moe_onnx.custom_ops.moe_token_permute_with_routing_map_grad import MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD
from moe_onnx.custom_ops.moe_token_unpermute import MOE_TOKEN_UNPERMUTE
from moe_onnx.custom_ops.moe_token_unpermute_grad import MOE_TOKEN_UNPERMUTE_GRAD
from moe_onnx.custom_ops.moe_token_unpermute_with_routing_map import MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP
from moe_onnx.custom_ops.moe_token_unpermute_with_routing_map_grad import MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD


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


def compute_expert_tokens(case) -> Callable:
    """``torch.searchsorted(sorted, arange(E), right=True)``."""
    import torch

    ids = _tensor(case.inputs["sorted_experts"])
    experts = torch.arange(case.attrs["num_experts"], dtype=ids.dtype)
    return lambda: torch.searchsorted(ids, experts, right=True).int()


#: the torch counterpart of each op that has one, by its definition
BUILDERS: dict[OpDef, Callable[..., Callable | None]] = {
    MOE_RE_ROUTING_V2: re_routing,
    MOE_INIT_ROUTING_V2: init_routing,
    MOE_INIT_ROUTING_V2_GRAD: init_routing_grad,
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
}


def torch_callable(case) -> Callable | None:
    """The PyTorch eager counterpart of ``case``, or None (no torch, or no counterpart)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    builder = BUILDERS.get(case.op)
    return None if builder is None else builder(case)
