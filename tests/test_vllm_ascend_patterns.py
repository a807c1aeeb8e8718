"""vLLM-Ascend's unquantised fused-MoE call patterns (the argument forms of v0.11.0's
``TokenDispatcherWithAllGather`` + ``unquant_apply_mlp`` and v0.9.1's
``fused_experts_with_all2all``; the real files run in tests/test_vllm_ascend_peers.py, ``-m
peers``), written here with the ranks of expert parallelism played in one process: each
"rank" holds its slice of the experts and the all-to-all is the exchange of row blocks it
stands for. Reference: a dense pure-torch MoE (every expert on every token, weighted)."""

from __future__ import annotations

import pytest
import torch

from moe_onnx.torch import npu

RANKS, LOCAL, HIDDEN, FFN, TOP_K = 2, 3, 8, 6, 2
EXPERTS = RANKS * LOCAL


def _problem(tokens: int, dtype, seed: int = 0):
    """x [T, H], topk_ids [T, K] int32 (distinct, as npu_moe_gating_top_k_softmax gives them),
    topk_weights [T, K] renormalised, w13 [E, 2F, H] and w2 [E, H, F] (vLLM's checkpoint layout)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    scores = torch.softmax(torch.randn(tokens, EXPERTS, generator=g), -1)
    weights, ids = scores.topk(TOP_K, dim=-1)
    w13 = torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, FFN, generator=g) / FFN**0.5
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)  # apply(): topk_weights.to(x.dtype)
    return x.to(dtype), ids.to(torch.int32), weights, w13.to(dtype), w2.to(dtype)


def dense_moe(x, ids, weights, w13, w2) -> torch.Tensor:
    """sum_k weights[t, k] * down(silu(gate) * up)(x[t]) of expert ids[t, k], in float32."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    gate, up = (x @ w13.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, F] each
    every = (torch.nn.functional.silu(gate) * up) @ w2.transpose(1, 2)  # [E, T, H]
    picked = every[ids.long(), torch.arange(len(x)).unsqueeze(1)]  # [T, K, H]
    return (picked * weights.float().unsqueeze(-1)).sum(1)


def _relative(got, want) -> float:
    return float((got.float() - want).abs().max() / want.abs().max())


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 4e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 16])
def test_v0_11_all_gather_dispatcher_with_expert_ranges(dtype, tokens):
    """Each rank: ``npu_moe_init_routing_v2(x, ids, active_num=T*K, expert_num=E,
    expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[first, last),
    quant_mode=-1)``, ``unquant_apply_mlp`` (weights transposed and NZ-cast once, grouped
    matmuls with counts, SwiGLU), ``npu_moe_token_unpermute(permuted_tokens=,
    sorted_indices=torch.abs(expanded_row_idx), probs=masked weights)``; the finalize's
    reduce sums the ranks. The permuted rows are freed as the dispatcher frees them."""
    x, ids, weights, w13, w2 = _problem(tokens, dtype, seed=tokens)
    total = torch.zeros(tokens, HIDDEN)
    for rank in range(RANKS):
        first, last = rank * LOCAL, (rank + 1) * LOCAL
        expert_map = torch.full((EXPERTS,), -1, dtype=torch.int32)
        expert_map[first:last] = torch.arange(LOCAL, dtype=torch.int32)
        masked = weights * (expert_map[ids] != -1)
        rows, expanded_row_idx, expert_tokens, _ = npu.npu_moe_init_routing_v2(
            x,
            ids,
            active_num=tokens * TOP_K,
            expert_num=EXPERTS,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=True,
            active_expert_range=[first, last],
            quant_mode=-1,
        )
        group_list = expert_tokens.to(torch.int64)
        w1 = npu.npu_format_cast(w13[first:last].transpose(1, 2).contiguous(), 29)
        w2_local = npu.npu_format_cast(w2[first:last].transpose(1, 2).contiguous(), 29)
        gate_up = npu.npu_grouped_matmul(
            x=[rows], weight=[w1], split_item=2, group_list_type=1, group_type=0, group_list=group_list
        )[0]
        down = npu.npu_grouped_matmul(
            x=[npu.npu_swiglu(gate_up)],
            weight=[w2_local],
            split_item=2,
            group_list_type=1,
            group_type=0,
            group_list=group_list,
        )[0]
        rows.untyped_storage().resize_(0)
        y = npu.npu_moe_token_unpermute(permuted_tokens=down, sorted_indices=torch.abs(expanded_row_idx), probs=masked)
        assert y.dtype == dtype and y.shape == (tokens, HIDDEN)
        total += y.float()
    assert _relative(total, dense_moe(x, ids, weights, w13, w2)) <= TOLERANCE[dtype]


def _exchange(blocks: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The all-to-all: ``blocks[s][d]`` rows from rank s to rank d; rank d gets its blocks in
    the order of s."""
    return [torch.cat([blocks[s][d] for s in range(len(blocks))]) for d in range(len(blocks))]


def _split(rows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(rows, sizes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [(5, 9), (1, 12)])
def test_v0_9_all2all_with_init_routing_v1_and_finalize(dtype, tokens):
    """fused_experts_with_all2all with an expert map, rank r holding ``tokens[r]`` tokens:
    ``row_idx = arange(T*K).view(K, -1).permute(1, 0)``, ``npu_moe_init_routing(x, row_idx=,
    expert_idx=, active_num=T)``, ``bincount(expanded_expert_idx, minlength=E)`` per rank,
    the all-to-all of rows and of ``expanded_expert_idx % L``, ``torch.sort``,
    ``npu_moe_compute_expert_tokens(sorted, L)`` (cumulative counts, group_list_type=0),
    grouped matmuls whose list output is ``torch.cat``-ed, the rows back, and
    ``npu_moe_finalize_routing(rows, skip1=None, skip2=None, bias=None, scales=,
    expanded_src_to_dst_row=, export_for_source_row=topk_ids)``."""
    problems = [_problem(t, dtype, seed=10 + r) for r, t in enumerate(tokens)]
    w13, w2 = problems[0][3], problems[0][4]  # every rank holds the same checkpoint's slices
    routed, sends, local_ids = [], [], []
    for x, ids, _, _, _ in problems:
        row_idx = torch.arange(0, len(x) * TOP_K, dtype=torch.int32).view(TOP_K, -1).permute(1, 0).contiguous()
        rows, expanded_row_idx, expanded_expert_idx = npu.npu_moe_init_routing(
            x, row_idx=row_idx, expert_idx=ids, active_num=len(x)
        )
        counts = torch.bincount(expanded_expert_idx, minlength=EXPERTS)
        sizes = counts.view(RANKS, -1).sum(-1).tolist()
        routed.append((rows, expanded_row_idx, sizes))
        sends.append(_split(rows, sizes))
        local_ids.append(_split(expanded_expert_idx % LOCAL, sizes))
    received, received_ids = _exchange(sends), _exchange(local_ids)
    back_blocks = []
    for rank in range(RANKS):
        sorted_local, sorted_idx = torch.sort(received_ids[rank])
        expert_tokens = npu.npu_moe_compute_expert_tokens(sorted_local, LOCAL).to(torch.int64)
        hidden = received[rank][sorted_idx]
        local = slice(rank * LOCAL, (rank + 1) * LOCAL)
        gate_up = npu.npu_grouped_matmul(
            x=[hidden],
            weight=[w13[local].transpose(1, 2)],
            split_item=2,
            group_list_type=0,
            group_type=0,
            group_list=expert_tokens,
        )
        hidden = npu.npu_swiglu(torch.cat(gate_up, dim=0))
        down = npu.npu_grouped_matmul(
            x=[hidden],
            weight=[w2[local].transpose(1, 2)],
            split_item=2,
            group_list_type=0,
            group_type=0,
            group_list=expert_tokens,
        )
        hidden = torch.cat(down, dim=0)[torch.argsort(sorted_idx)]
        gathered = [len(received_ids_from) for received_ids_from in (local_ids[s][rank] for s in range(RANKS))]
        back_blocks.append(_split(hidden, gathered))
    returned = _exchange(back_blocks)
    for rank, (x, ids, weights, _, _) in enumerate(problems):
        y = npu.npu_moe_finalize_routing(
            returned[rank],
            skip1=None,
            skip2=None,
            bias=None,
            scales=weights,
            expanded_src_to_dst_row=routed[rank][1],
            export_for_source_row=ids,
        )
        assert y.dtype == dtype and y.shape == x.shape
        assert _relative(y, dense_moe(x, ids, weights, w13, w2)) <= TOLERANCE[dtype], rank
