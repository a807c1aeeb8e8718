"""Expert-parallel MoE chains in omni-infer's style (``omni/models/common/layers/moe/fused_moe/
fused_moe.py``), written with torch_npu's names (``import torch_npu`` after
``install_stand_ins()``), on the default torch.distributed group (N ranks, E experts,
L = E / N local experts, top-K):

* :func:`omni_alltoall_ep` follows ``fused_experts_alltoall_ep``: v1 init routing on each side
  of the all-to-all. Softmax top-k gating (``fused_topk``) -> v1 init routing by global expert
  -> expert-token counts -> counts all-to-all -> rows all-to-all with host-side splits -> v1
  init routing again by local expert (``row_idx = arange(n)[:, None]``, K = 1) -> expert-token
  cumsum -> grouped matmul -> SwiGLU -> grouped matmul -> finalize routing with the local
  expert ids and float32 ones (back to the received order) -> rows all-to-all back -> finalize
  routing with the top-k weights and expert ids.
* :func:`omni_allgather_ep` follows ``fused_experts_allgather_ep``: every rank routes all
  tokens, experts that are not local get the **sentinel id L** (``topk_ids * mask + ~mask *
  L``, after ``topk_ids -= rank * L`` in place), so they sort last and are counted for no
  expert; the rows past the groups are zeroed (``out *= expanded_expert_idx != L``, or
  ``out[expert_tokens[-1]:] = 0`` with the counts taken over L + 1 experts and the last one
  dropped, omni-infer's two branches by size); finalize routing gets the shifted ids (out of
  [0, L) for other ranks' experts: read only with a bias, and there is none); an all-reduce
  sums the ranks' partial outputs.

Where omni-infer's file cannot run as written on any device, the chains say so and do what its
live path (``moe_infer_fusion`` in layer.py) does: ``_MAX_NUM_TOKEN`` is undefined in the file
(``active_num`` = the token count here); the grouped matmuls there leave ``split_item`` 0, whose
output is a list, and pass it to ``npu_swiglu`` (here ``split_item=3`` and ``[0]``, as the live
path); ``torch.histc`` of int32 ids (here ``npu_moe_compute_expert_tokens`` differenced: the
same counts); the local expert of each received row is built with ``repeat_interleave`` instead
of omni-infer's Python loop over the counts.

:func:`dense_routing` and tests/moe_chain.py ``dense_reference`` are the pure-torch reference.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.moe_chain import Config, dense_reference, global_weights, local_slice, relative_error


def rank_inputs(config: Config, rank: int, tokens: int, seed: int = 2):
    """x [T, H] and router logits [T, E], float32."""
    g = torch.Generator().manual_seed(seed * 1000 + rank * 17 + tokens)
    return torch.randn(tokens, config.hidden, generator=g), torch.randn(tokens, config.experts, generator=g)


def local_weights(config: Config, rank: int, weights: dict, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's w13 [L, H, 2F] and w2 [L, F, H], as omni-infer's
    ``process_weights_after_loading`` holds them (``transpose(1, 2).contiguous()``)."""
    local = local_slice(config, rank)
    w13 = weights["w13"][local].transpose(1, 2).contiguous().to(dtype)
    return w13, weights["w2"][local].transpose(1, 2).contiguous().to(dtype)


def dense_routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k, renormalised, in float32: ``(ids [T, K], weights [T, K])``; a stable sort
    gives ties to the lower expert."""
    probs = torch.softmax(logits.float(), dim=-1)
    ids = torch.sort(-probs, dim=-1, stable=True).indices[:, :top_k]
    weight = probs.gather(1, ids)
    return ids, weight / weight.sum(-1, keepdim=True)


def fused_topk(logits: torch.Tensor, top_k: int):
    """omni-infer's ``fused_topk`` with renormalize=True."""
    import torch_npu

    topk_weights, topk_ids, row_idx = torch_npu.npu_moe_gating_top_k_softmax(logits, k=top_k)
    topk_weights /= topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids, row_idx


def _experts(tokens, w1, w2, group_list):
    """gmm [gate | up] -> SwiGLU -> gmm down over the expert-major rows (group_list: cumsum)."""
    import torch_npu

    gate_up_proj = torch_npu.npu_grouped_matmul(
        x=[tokens], weight=w1, group_list_type=0, group_type=0, group_list=group_list, split_item=3
    )[0]
    gate_up_proj = torch_npu.npu_swiglu(gate_up_proj)
    return torch_npu.npu_grouped_matmul(
        x=[gate_up_proj], weight=w2, group_list_type=0, group_type=0, group_list=group_list, split_item=3
    )[0]


def omni_alltoall_ep(hidden_states, logits, w1, w2, top_k, ep_size):
    """``fused_experts_alltoall_ep`` (see the module doc): v1 init routing on each side."""
    import torch_npu

    num_tokens, hidden_size = hidden_states.shape
    num_local_experts = w1.shape[0]
    num_global_experts = num_local_experts * ep_size
    topk_weights, topk_ids, row_idx = fused_topk(logits, top_k)

    sorted_local_tokens, expanded_src_to_dst_row, expanded_expert_idx = torch_npu.npu_moe_init_routing(
        hidden_states, row_idx=row_idx, expert_idx=topk_ids, active_num=num_tokens
    )
    ends = torch_npu.npu_moe_compute_expert_tokens(expanded_expert_idx, num_global_experts)
    tokens_per_expert = torch.diff(ends, prepend=ends.new_zeros(1))  # omni-infer: torch.histc(topk_ids, ...)
    tokens_per_ep_rank = tokens_per_expert.view(ep_size, -1).sum(dim=1)
    tokens_per_expert_group = tokens_per_expert.new_empty(tokens_per_expert.shape[0])
    dist.all_to_all_single(tokens_per_expert_group, tokens_per_expert)

    output_splits = tokens_per_expert_group.view(ep_size, -1).sum(1).tolist()
    input_split_sizes = tokens_per_ep_rank.tolist()
    global_local_tokens = sorted_local_tokens.new_empty(sum(output_splits), hidden_size)
    dist.all_to_all_single(
        global_local_tokens,
        sorted_local_tokens,
        output_split_sizes=output_splits,
        input_split_sizes=input_split_sizes,
    )
    # the local expert of each received row: rank-major, expert-major within a rank
    expert_of_block = torch.arange(num_global_experts, dtype=torch.int32) % num_local_experts
    global_local_indexs = torch.repeat_interleave(expert_of_block, tokens_per_expert_group.long()).unsqueeze(-1)
    permuted_row_idx = torch.arange(global_local_indexs.numel(), dtype=torch.int32).unsqueeze(-1)
    sorted_local_tokens1, expanded_src_to_dst_row1, expanded_expert_idx1 = torch_npu.npu_moe_init_routing(
        global_local_tokens,
        row_idx=permuted_row_idx,
        expert_idx=global_local_indexs,
        active_num=global_local_tokens.shape[0],
    )
    group_list = torch_npu.npu_moe_compute_expert_tokens(expanded_expert_idx1, num_local_experts).to(torch.int64)
    if len(sorted_local_tokens1) > 0:
        out = _experts(sorted_local_tokens1, w1, w2, group_list)
        topk_weights1 = torch.ones(global_local_indexs.shape, dtype=torch.float32)
        new_x = torch_npu.npu_moe_finalize_routing(
            out,
            skip1=None,
            skip2=None,
            bias=None,
            scales=topk_weights1,
            expanded_src_to_dst_row=expanded_src_to_dst_row1,
            export_for_source_row=global_local_indexs,
        )
    else:
        new_x = sorted_local_tokens1
    gathered_tokens = new_x.new_empty(*sorted_local_tokens.shape)
    dist.all_to_all_single(
        gathered_tokens, new_x, output_split_sizes=input_split_sizes, input_split_sizes=output_splits
    )
    return torch_npu.npu_moe_finalize_routing(
        gathered_tokens,
        skip1=None,
        skip2=None,
        bias=None,
        scales=topk_weights,
        expanded_src_to_dst_row=expanded_src_to_dst_row,
        export_for_source_row=topk_ids,
    )


def omni_allgather_ep(hidden_states, logits, w1, w2, top_k, rank, ep_size, small_rows):
    """``fused_experts_allgather_ep`` (see the module doc) on all ranks' tokens; returns this
    rank's tokens' rows. ``small_rows`` stands for omni-infer's size tests (8192 / 12288 rows):
    True takes the mask branch, False the L + 1 counts and the zeroed tail."""
    import torch_npu

    tokens = hidden_states.shape[0]
    hidden_states = _all_gather(hidden_states, ep_size)  # omni-infer gathers the DP ranks' tokens before
    topk_weights, topk_ids, row_idx = fused_topk(_all_gather(logits, ep_size), top_k)
    n_routed_experts = w1.shape[0]  # local experts
    local_expert_indices = [rank * n_routed_experts + i for i in range(n_routed_experts)]

    global_local_mask = (topk_ids >= local_expert_indices[0]) & (topk_ids <= local_expert_indices[-1])
    non_global_local_mask = (~global_local_mask).to(torch.int32)
    global_local_mask = global_local_mask.to(torch.int32)
    topk_ids -= rank * n_routed_experts
    local_topk_ids_mask_with_max = topk_ids * global_local_mask + non_global_local_mask * n_routed_experts

    sorted_tokens, expanded_src_to_dst_row, expanded_expert_idx = torch_npu.npu_moe_init_routing(
        hidden_states, row_idx=row_idx, expert_idx=local_topk_ids_mask_with_max, active_num=hidden_states.shape[0]
    )
    if not small_rows:
        expert_tokens = torch_npu.npu_moe_compute_expert_tokens(expanded_expert_idx, n_routed_experts + 1)
        expert_tokens = expert_tokens[:-1]
    else:
        expert_tokens = torch_npu.npu_moe_compute_expert_tokens(expanded_expert_idx, n_routed_experts)
    out = _experts(sorted_tokens, w1, w2, expert_tokens.to(torch.int64))
    if small_rows:
        sorted_tokens_mask = expanded_expert_idx != n_routed_experts
        out *= sorted_tokens_mask.unsqueeze(1)
    else:
        out[expert_tokens[-1] :] = 0
    output = torch_npu.npu_moe_finalize_routing(
        out,
        skip1=None,
        skip2=None,
        bias=None,
        scales=topk_weights,
        expanded_src_to_dst_row=expanded_src_to_dst_row,
        export_for_source_row=topk_ids,
    )
    dist.all_reduce(output)  # the ranks' experts' partial sums (omni-infer reduce-scatters after the call)
    return output[rank * tokens : (rank + 1) * tokens]


def _all_gather(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's rows, rank-major (all ranks have the same row count here)."""
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def worker(rank: int, world: int, init_file: str, config: Config, out_dir: str) -> None:
    """Both chains (the all-gather one in both of its branches) at every token count, float32
    and bfloat16, against the dense reference with its own routing."""
    import moe_onnx.torch as mt

    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    mt.install_stand_ins()
    weights = global_weights(config)
    errors = {}
    for tokens in config.batches:
        # the all-to-all chain: a different token count per rank; the all-gather one: equal
        x, logits = rank_inputs(config, rank, tokens + rank)
        x_same, logits_same = rank_inputs(config, rank, tokens)
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).split(".")[-1]
            w1, w2 = local_weights(config, rank, weights, dtype)
            xd, ld = x.to(dtype), logits.to(dtype)
            ids, weight = dense_routing(ld, config.top_k)
            y = omni_alltoall_ep(xd, ld, w1, w2, config.top_k, world)
            errors[f"alltoall_{name}_{tokens}"] = relative_error(y, dense_reference(xd, ids, weight, weights, False))
            errors[f"alltoall_{name}_{tokens}_dtype_ok"] = float(y.dtype == dtype and y.shape == x.shape)
            xd, ld = x_same.to(dtype), logits_same.to(dtype)
            ids, weight = dense_routing(ld, config.top_k)
            want = dense_reference(xd, ids, weight, weights, False)
            for small_rows in (True, False):
                y = omni_allgather_ep(xd, ld, w1, w2, config.top_k, rank, world, small_rows)
                branch = "mask" if small_rows else "tail"
                errors[f"allgather_{branch}_{name}_{tokens}"] = relative_error(y, want)
                errors[f"allgather_{branch}_{name}_{tokens}_dtype_ok"] = float(y.dtype == dtype and y.shape == xd.shape)
    np.savez(Path(out_dir) / f"errors{rank}.npz", **errors)
    dist.barrier()
    dist.destroy_process_group()
