"""Backward of moe_onnx.torch ops (= the matching cann.moe grad ops) against torch autograd of
pure-torch references in Megatron-LM's moe_utils style, float32 and bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_onnx.torch as mt
from tests.torch_ep_layer import permute, relative_error, sort_chunks_by_idxs, unpermute

#: max |ours - reference| / max |reference|, for outputs and gradients
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def routing(tokens, experts, top_k, seed=0):
    """Top-k routing: routing_map [T, E] bool, expert ids [T, K] int32 (ascending), probs [T, E]."""
    g = torch.Generator().manual_seed(seed)
    experts_of = torch.rand(tokens, experts, generator=g).argsort(1)[:, :top_k].sort(1).values
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, experts_of, True)
    probs = torch.rand(tokens, experts, generator=g) * routing_map
    return routing_map, experts_of.to(torch.int32), probs


def leaves(*tensors, dtype):
    return [t.to(dtype).detach().clone().requires_grad_() for t in tensors]


def check(ours_out, ref_out, ours_in, ref_in, dtype, seed=1):
    """Same outputs; after the same cotangent, the same input gradients."""
    assert relative_error(ours_out.float(), ref_out.float()) <= TOLERANCE[dtype]
    cotangent = torch.randn(ours_out.shape, generator=torch.Generator().manual_seed(seed)).to(ours_out.dtype)
    (ours_out * cotangent).sum().backward()
    (ref_out * cotangent).sum().backward()
    errors = [relative_error(a.grad.float(), b.grad.float()) for a, b in zip(ours_in, ref_in)]
    assert max(errors) <= TOLERANCE[dtype], errors
    return errors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["dropless", "active", "drop_pad"])
def test_init_routing_backward_is_init_routing_grad(dtype, mode):
    routing_map, expert_idx, _ = routing(9, 4, 2)
    x = torch.randn(9, 6)
    attrs = {"dropless": {}, "active": {"active_num": 11}, "drop_pad": {"drop_pad_mode": 1, "expert_capacity": 3}}[mode]
    (x_ours,), (x_ref,) = leaves(x, dtype=dtype), leaves(x, dtype=dtype)
    expanded, _, _, _ = mt.moe_init_routing_v2(x_ours, expert_idx, expert_num=4, **attrs)
    # reference: a stable sort by expert, then copies of each token (Megatron's permute order)
    source = torch.argsort(expert_idx.reshape(-1).long(), stable=True)  # row -> source position t*K + j
    if mode == "drop_pad":
        experts = expert_idx.reshape(-1).long()[source]
        rank_in_expert = torch.arange(len(source)) - torch.searchsorted(experts, experts)
        kept = rank_in_expert < 3
        slots = torch.zeros(4 * 3, 6, dtype=dtype).index_put(
            (experts[kept] * 3 + rank_in_expert[kept],), x_ref[source[kept] // 2]
        )
        reference = slots.view(4, 3, 6)
    else:
        reference = x_ref.index_select(0, source // 2)[: attrs.get("active_num", len(source))]
    check(expanded, reference, [x_ours], [x_ref], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_permute_backward_is_permute_grad(dtype, with_probs):
    routing_map, _, probs = routing(10, 5, 2)
    tokens = torch.randn(10, 4)
    tokens_ours, probs_ours = leaves(tokens, probs, dtype=dtype)
    tokens_ref, probs_ref = leaves(tokens, probs, dtype=dtype)
    permuted, _, permuted_probs = mt.moe_token_permute_with_routing_map(
        tokens_ours, routing_map, probs_ours if with_probs else None, num_out_tokens=20
    )
    reference, _ = permute(tokens_ref, routing_map)
    if with_probs:  # both outputs, one scalar loss
        reference_probs = probs_ref.T.contiguous().masked_select(routing_map.T.contiguous())
        permuted = permuted * permuted_probs.unsqueeze(1)
        reference = reference * reference_probs.unsqueeze(1)
    check(
        permuted, reference, [tokens_ours] + [probs_ours] * with_probs, [tokens_ref] + [probs_ref] * with_probs, dtype
    )


def megatron_padded_permute(tokens, routing_map, probs, capacity):
    """Megatron's permute with drop_and_pad: each expert's first ``capacity`` routed tokens,
    padded with unrouted ones; probs gathered at (token, expert)."""
    num_tokens, num_experts = routing_map.shape
    sorted_indices = routing_map.T.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[:, :capacity]
    flat = (torch.arange(num_experts).unsqueeze(1) * num_tokens + sorted_indices).reshape(-1)
    permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat)
    return tokens.index_select(0, sorted_indices.reshape(-1)), permuted_probs, sorted_indices.reshape(-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_permute_backward(dtype):
    routing_map, _, probs = routing(8, 4, 2, seed=3)
    tokens = torch.randn(8, 5)
    tokens_ours, probs_ours = leaves(tokens, probs, dtype=dtype)
    tokens_ref, probs_ref = leaves(tokens, probs, dtype=dtype)
    permuted, _, permuted_probs = mt.moe_token_permute_with_routing_map(
        tokens_ours, routing_map, probs_ours, num_out_tokens=12, drop_and_pad=1
    )
    reference, reference_probs, _ = megatron_padded_permute(tokens_ref, routing_map, probs_ref, 3)
    check(
        permuted * permuted_probs.unsqueeze(1),
        reference * reference_probs.unsqueeze(1),
        [tokens_ours, probs_ours],
        [tokens_ref, probs_ref],
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
def test_unpermute_backward_is_unpermute_grad(dtype, with_probs):
    routing_map, _, probs = routing(10, 5, 2, seed=4)
    if not with_probs:
        probs = routing_map.float()  # Megatron's unpermute always weighs; ones = no weights
    rows = torch.randn(20, 4)
    _, sorted_indices, _ = mt.moe_token_permute_with_routing_map(rows[:10], routing_map, num_out_tokens=20)
    _, token_of_row = permute(rows[:10], routing_map)
    rows_ours, probs_ours = leaves(rows, probs, dtype=dtype)
    rows_ref, probs_ref = leaves(rows, probs, dtype=dtype)
    unpermuted, *_ = mt.moe_token_unpermute_with_routing_map(
        rows_ours, sorted_indices, routing_map, probs_ours if with_probs else None
    )
    reference = unpermute(rows_ref, token_of_row, (10, 4), probs_ref, routing_map)
    inputs = ([rows_ours, probs_ours], [rows_ref, probs_ref]) if with_probs else ([rows_ours], [rows_ref])
    check(unpermuted, reference, *inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_unpermute_backward(dtype):
    routing_map, _, probs = routing(8, 4, 2, seed=5)
    tokens = torch.randn(8, 5)
    _, sorted_indices, _ = mt.moe_token_permute_with_routing_map(tokens, routing_map, num_out_tokens=12, drop_and_pad=1)
    rows = torch.randn(12, 5)
    rows_ours, probs_ours = leaves(rows, probs, dtype=dtype)
    rows_ref, probs_ref = leaves(rows, probs, dtype=dtype)
    unpermuted, *_ = mt.moe_token_unpermute_with_routing_map(
        rows_ours, sorted_indices, routing_map, probs_ours, padded_mode=1
    )
    # Megatron's padded unpermute: probs at (token of row, expert of row), scatter-add by token
    capacity, token_of_row = 3, sorted_indices.long()
    flat = torch.arange(4).repeat_interleave(capacity) * 8 + token_of_row
    weighted = rows_ref * probs_ref.T.contiguous().view(-1).index_select(0, flat).unsqueeze(1)
    reference = torch.zeros(8, 5, dtype=dtype).scatter_add(0, token_of_row.unsqueeze(1).expand(-1, 5), weighted)
    check(unpermuted, reference, [rows_ours, probs_ours], [rows_ref, probs_ref], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rerouting_backward_is_the_inverse_reorder(dtype):
    counts = torch.tensor([[2, 0, 3], [1, 4, 0], [0, 2, 1]], dtype=torch.int32)  # [N, E]
    rows, weight = torch.randn(13, 6), torch.rand(13, 1)
    (rows_ours,), (rows_ref,) = leaves(rows, dtype=dtype), leaves(rows, dtype=dtype)
    (weight_ours,), (weight_ref,) = leaves(weight, dtype=torch.float32), leaves(weight, dtype=torch.float32)
    permuted, _, _, _, permuted_weight = mt.moe_re_routing_v2(rows_ours, counts, expert_topk_weight=weight_ours)
    by_expert = torch.arange(9).view(3, 3).T.reshape(-1)  # chunk (rank i, expert j) is i*E + j
    reference = sort_chunks_by_idxs(rows_ref, counts.reshape(-1), by_expert)
    reference_weight = sort_chunks_by_idxs(weight_ref, counts.reshape(-1), by_expert)
    out, ref = permuted * permuted_weight.to(dtype), reference * reference_weight.to(dtype)
    check(out, ref, [rows_ours, weight_ours], [rows_ref, weight_ref], dtype)


def test_gradients_are_deterministic():
    routing_map, _, probs = routing(16, 6, 3, seed=7)
    rows = torch.randn(48, 8)
    _, sorted_indices, _ = mt.moe_token_permute_with_routing_map(rows[:16], routing_map, num_out_tokens=48)
    grads = []
    for _ in range(2):
        rows_in, probs_in = leaves(rows, probs, dtype=torch.bfloat16)
        mt.moe_token_unpermute_with_routing_map(rows_in, sorted_indices, routing_map, probs_in)[
            0
        ].float().sum().backward()
        grads.append((rows_in.grad.view(torch.int16).numpy(), probs_in.grad.view(torch.int16).numpy()))
    assert all(np.array_equal(a, b) for a, b in zip(*grads))
