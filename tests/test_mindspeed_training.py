"""A training step through torch_npu's routing-map permute / unpermute, written the way MindSpeed
writes its autograd Functions (``mindspeed/te/pytorch/permutation.py``: ``MoePermuteMaskMap``,
``MoeUnpermuteMaskMap``, calling the torch_npu names), against Megatron-LM's pure-torch
``permute`` / ``unpermute`` (``megatron/core/transformer/moe/moe_utils.py``) under torch's own
autograd: the same loss and the same gradients, K = 1 and 2 and drop-and-pad, float32 and
bfloat16.

The torch_npu names are taken from ``moe_onnx.torch.npu``, the module ``install_stand_ins()``
registers as ``torch_npu`` (not installed here: it would stay in this process's sys.modules).
Not padded, MindSpeed's backward passes ``sorted_indices`` as both index inputs of the unpermute
grad (SPEC 1.6): with K = 1 the old kernel accepted that and returned another gradient.
"""

from __future__ import annotations

import pytest
import torch

from moe_onnx.torch import npu as torch_npu

# --- MindSpeed's Functions (their structure and calls; comments mark what is left out) ---------


class MoePermuteMaskMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):
        permuted_input, permuted_probs, sorted_indices = torch_npu.npu_moe_token_permute_with_routing_map(
            tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad
        )
        ctx.num_tokens, ctx.num_experts = tokens.shape[0], routing_map.shape[1]
        ctx.drop_and_pad, ctx.sorted_indices, ctx.routing_map = drop_and_pad, sorted_indices, routing_map
        return permuted_input, permuted_probs, sorted_indices

    @staticmethod
    def backward(ctx, permuted_act_grad, permuted_probs_grad, _):
        act_grad = probs_grad = None
        if ctx.needs_input_grad[0]:
            act_grad, probs_grad = torch_npu.npu_moe_token_permute_with_routing_map_grad(
                permuted_act_grad,
                permuted_probs_grad,
                ctx.sorted_indices,
                ctx.routing_map,
                ctx.num_experts,
                ctx.num_tokens,
                ctx.drop_and_pad,
            )
        if not ctx.needs_input_grad[2]:
            probs_grad = None
        return act_grad, None, probs_grad, None, None


class MoeUnpermuteMaskMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, drop_and_pad=False):
        unpermuted_output, out_index, permuted_token_id, _ = torch_npu._npu_moe_token_unpermute_with_routing_map(
            permuted_tokens,
            sorted_indices,
            restore_shape,
            probs=probs,
            routing_map=routing_map,
            drop_and_pad=drop_and_pad,
        )
        ctx.with_probs = probs is not None
        if ctx.with_probs:
            ctx.save_for_backward(permuted_tokens, probs)
        ctx.restore_shape, ctx.drop_and_pad = restore_shape, drop_and_pad
        ctx.sorted_indices, ctx.routing_map = sorted_indices, routing_map
        ctx.out_index, ctx.permuted_token_id = out_index, permuted_token_id
        return unpermuted_output

    @staticmethod
    def backward(ctx, unpermuted_tokens_grad):
        act_grad = probs_grad = None
        if ctx.needs_input_grad[0]:
            permuted_tokens, probs = ctx.saved_tensors if ctx.with_probs else (None, None)
            if ctx.drop_and_pad:
                act_grad, probs_grad = torch_npu.npu_moe_token_unpermute_with_routing_map_grad(
                    unpermuted_tokens_grad,
                    ctx.out_index,
                    permuted_token_id=ctx.permuted_token_id,
                    routing_map=ctx.routing_map,
                    permuted_tokens=permuted_tokens,
                    probs=probs,
                    drop_and_pad=ctx.drop_and_pad,
                    restore_shape=ctx.restore_shape,
                )
            else:
                act_grad, probs_grad = torch_npu.npu_moe_token_unpermute_with_routing_map_grad(
                    unpermuted_tokens_grad,
                    ctx.sorted_indices,
                    ctx.sorted_indices,
                    routing_map=ctx.routing_map,
                    permuted_tokens=permuted_tokens,
                    probs=probs,
                    drop_and_pad=ctx.drop_and_pad,
                    restore_shape=ctx.restore_shape,
                )
        if not ctx.needs_input_grad[3]:
            probs_grad = None
        return act_grad, None, None, probs_grad, None, None


# --- Megatron's pure-torch permute / unpermute (sorted_indices: row -> token) -----------------


def megatron_permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):
    num_tokens, num_experts = routing_map.shape
    permuted_probs = None
    if drop_and_pad:
        capacity = num_out_tokens // num_experts
        sorted_indices = routing_map.to(torch.int8).T.contiguous().argsort(dim=-1, descending=True, stable=True)
        sorted_indices = sorted_indices[:, :capacity].contiguous().view(-1)
        if probs is not None:
            flat = torch.arange(num_experts).unsqueeze(-1) * num_tokens + sorted_indices.view(num_experts, capacity)
            permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat.view(-1))
    else:
        mask = routing_map.bool().T.contiguous()
        sorted_indices = torch.arange(num_tokens).unsqueeze(0).expand(num_experts, -1).masked_select(mask)
        if probs is not None:
            permuted_probs = probs.T.contiguous().masked_select(mask)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def megatron_unpermute(
    permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, drop_and_pad=False
):
    if probs is not None:
        if drop_and_pad:
            num_experts = routing_map.shape[1]
            capacity = permuted_tokens.shape[0] // num_experts
            flat = torch.arange(num_experts).unsqueeze(-1) * routing_map.shape[0] + sorted_indices.view(num_experts, -1)
            permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat.view(-1)[: num_experts * capacity])
        else:
            permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    output = torch.zeros(restore_shape, dtype=permuted_tokens.dtype)
    index = sorted_indices.unsqueeze(1).expand(-1, restore_shape[1])
    return output.scatter_add(0, index, permuted_tokens)


# --- one training step -------------------------------------------------------------------------


def step(permute, unpermute, tokens, logits, weight, top_k, drop_and_pad, probs_where):
    """Router probs from ``logits`` (top-k, masked), permute, one shared expert matmul, unpermute,
    a loss; returns the loss and the gradients of tokens, logits and weight."""
    tokens, logits, weight = (t.detach().clone().requires_grad_() for t in (tokens, logits, weight))
    num_tokens, num_experts = logits.shape
    experts = torch.topk(logits.detach().float(), top_k).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
    probs = torch.softmax(logits.float(), -1).to(logits.dtype) * routing_map
    rows = num_experts * (num_tokens * top_k // num_experts + 1) if drop_and_pad else num_tokens * top_k
    in_permute = probs if probs_where == "permute" else None
    permuted, permuted_probs, sorted_indices = permute(tokens, routing_map, in_permute, rows, drop_and_pad)
    hidden = permuted @ weight
    if permuted_probs is not None:
        hidden = hidden * permuted_probs.unsqueeze(-1)
    in_unpermute = probs if probs_where == "unpermute" else None
    out = unpermute(hidden, sorted_indices, tokens.shape, in_unpermute, routing_map, drop_and_pad)
    loss = (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()
    loss.backward()
    return loss.detach(), tokens.grad, logits.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("probs_where", ["unpermute", "permute"])
@pytest.mark.parametrize("top_k, drop_and_pad", [(1, False), (2, False), (2, True)], ids=["k1", "k2", "padded"])
def test_mindspeed_step_equals_megatron_pure_torch(dtype, probs_where, top_k, drop_and_pad):
    torch.manual_seed(top_k + 10 * drop_and_pad)
    tokens, logits, weight = torch.randn(12, 6).to(dtype), torch.randn(12, 4).to(dtype), torch.randn(6, 6).to(dtype)
    args = (tokens, logits, weight, top_k, drop_and_pad, probs_where)
    got = step(MoePermuteMaskMap.apply, MoeUnpermuteMaskMap.apply, *args)
    want = step(megatron_permute, megatron_unpermute, *args)
    # float32: the same sums in the same order up to torch's matmul; bfloat16: Megatron rounds
    # each product and sum to bfloat16, the kernels sum in float32 and round once
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for name, g, w in zip(["loss", "tokens grad", "logits grad", "weight grad"], got, want):
        assert g.dtype == w.dtype, name
        torch.testing.assert_close(g.float(), w.float(), rtol=tolerance, atol=tolerance, msg=name)
