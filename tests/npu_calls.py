"""One valid call of every torch_npu and cann_ops_transformer name the stand-ins serve, written
from op-plugin's signatures (small shapes: T = 6 tokens, H = 8, E = 4 experts, K = 2): the
resize test runs them and checks their outputs, the hostile-argument fuzz
(tests/npu_fuzz_worker.py) breaks one argument at a time."""

from __future__ import annotations

import torch

T, H, E, K = 6, 8, 4, 2


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    expert_idx = torch.randn(T, E, generator=g).topk(K).indices.to(torch.int32)
    probs = torch.rand(T, K, generator=g)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, expert_idx.long(), True)
    return g, x, logits, expert_idx, probs, routing_map


def calls() -> dict[str, tuple[tuple, dict]]:
    """name -> (args, kwargs) of one call that succeeds."""
    from moe_onnx.torch import npu

    g, x, logits, expert_idx, probs, routing_map = _inputs()
    rows = T * K
    permuted, sorted_indices = npu.npu_moe_token_permute(x, expert_idx)
    rm_rows, _, rm_sorted = npu.npu_moe_token_permute_with_routing_map(x, routing_map, num_out_tokens=rows)
    _, out_index, token_id, _ = npu._npu_moe_token_unpermute_with_routing_map(
        rm_rows, rm_sorted, [T, H], routing_map=routing_map
    )
    flat_sorted = expert_idx.flatten().sort(stable=True).values
    row_idx = torch.arange(rows, dtype=torch.int32).reshape(K, T).T.contiguous()
    _, v1_row_idx, _ = npu.npu_moe_init_routing(x, row_idx, expert_idx, T)
    counts = torch.full((2, 2), rows // 4, dtype=torch.int32)
    weight = torch.randn(E, H, 2 * H, generator=g)
    group_list = torch.bincount(expert_idx.flatten().long(), minlength=E)
    _, gate_idx, x_norm = npu.npu_moe_gating_top_k(logits, K, norm_type=1, out_flag=True)
    grad_rows = torch.randn(rows, H, generator=g)
    return {
        "npu_moe_re_routing": ((x.repeat(2, 1), counts), {}),
        "npu_moe_init_routing_v2": ((x, expert_idx), {"expert_num": E, "expert_tokens_num_flag": True}),
        "npu_moe_token_permute_with_routing_map": ((x, routing_map), {"num_out_tokens": rows, "probs": logits}),
        "npu_moe_token_permute_with_routing_map_grad": ((grad_rows, None, rm_sorted, routing_map, E, T, False), {}),
        "npu_moe_token_unpermute_with_routing_map": ((rm_rows, rm_sorted, [T, H]), {"routing_map": routing_map}),
        "_npu_moe_token_unpermute_with_routing_map": ((rm_rows, rm_sorted, [T, H]), {"routing_map": routing_map}),
        "npu_moe_token_unpermute_with_routing_map_grad": (
            (x, out_index, token_id, routing_map, None, None, False, [T, H]),
            {},
        ),
        "npu_moe_gating_top_k_softmax": ((logits,), {"k": K}),
        "npu_moe_gating_top_k": ((logits, K), {"norm_type": 1, "out_flag": True}),
        "npu_moe_gating_top_k_backward": ((x_norm, torch.randn(T, K, generator=g), gate_idx), {"norm_type": 1}),
        "npu_moe_token_permute": ((x, expert_idx), {}),
        "npu_moe_token_permute_grad": ((x, grad_rows, expert_idx, sorted_indices), {}),
        "npu_moe_token_permute_grad_v2": ((grad_rows, sorted_indices, T, torch.float32, K), {}),
        "npu_moe_token_unpermute": ((permuted, sorted_indices, probs), {}),
        "_npu_moe_token_unpermute": ((permuted, sorted_indices, probs), {}),
        "npu_moe_token_unpermute_grad": ((permuted, x, sorted_indices, probs), {}),
        "npu_moe_token_unpermute_grad_v2": (
            (x, sorted_indices, rows, torch.float32, probs),
            {"permuted_tokens": permuted},
        ),
        "npu_moe_init_routing": ((x, row_idx, expert_idx, T), {}),
        "npu_moe_compute_expert_tokens": ((flat_sorted, E), {}),
        "npu_moe_finalize_routing": ((grad_rows, x, None, None, probs, v1_row_idx, expert_idx), {}),
        "npu_grouped_matmul": (
            ([x.repeat(2, 1)], [weight]),
            {"group_list": group_list, "group_type": 0, "split_item": 3, "group_list_type": 1},
        ),
        "npu_swiglu": ((torch.randn(T, 2 * H, generator=g),), {}),
        "npu_swiglu_backward": ((x, torch.randn(T, 2 * H, generator=g)), {}),
        "npu_format_cast": ((weight, 29), {}),
        "npu_format_cast_": ((weight.clone(), 29), {}),
        "get_npu_format": ((weight,), {}),
        "moe_re_routing": ((x.repeat(2, 1), counts), {}),
        "moe_init_routing": ((x, expert_idx), {"expert_num": E, "expert_tokens_num_flag": True}),
        "moe_init_routing_grad": ((grad_rows, v1_row_idx.flatten(), K), {}),
    }


def tensors_of(result) -> list[torch.Tensor]:
    """The tensors a call returned (a tensor, a tuple or list of them, None for absent ones)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in tensors_of(item)]
    return []
