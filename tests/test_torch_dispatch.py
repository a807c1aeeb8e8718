"""The dispatch ops through torch_npu's names, as real Ascend code calls them: vLLM-Ascend's
all-to-all-v and all-gather dispatchers, MindSpeed's fused/eager permute, cann-recipes-infer's
gpt-oss MLP routing and omni-infer's sentinel experts (call patterns written here, code not
vendored). References are pure torch, written in the test: dense weighted sums and Megatron-LM's
permute/unpermute, whose autograd the gradients are compared with."""

from __future__ import annotations

import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch import npu


def distinct_experts(g: torch.Generator, tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """``[T, K]`` int32, K distinct experts per token (a top-k's output)."""
    return torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)[:, :top_k].to(torch.int32)


def expert_scale(experts: torch.Tensor) -> torch.Tensor:
    """What "expert e" does to a row in these tests: multiply it by 1 + e/4 (so a row that went to
    the wrong expert shows)."""
    return (1 + experts.to(torch.float32) / 4).unsqueeze(-1)


def megatron_permute(tokens, indices, num_out_tokens=None):
    """Megatron-LM's (and op-plugin's test's) ``permute``: sorted_indices is dst row -> src slot."""
    top_k = 1 if indices.dim() == 1 else indices.shape[1]
    sorted_indices = torch.argsort(indices.reshape(-1), stable=True)
    if num_out_tokens is not None:
        sorted_indices = sorted_indices[:num_out_tokens]
    return tokens.index_select(0, sorted_indices // top_k), sorted_indices


def megatron_unpermute(permuted, sorted_indices, probs, slots):
    """Megatron-LM's ``unpermute``: rows back to their slots (index_copy), weighted, summed per token."""
    rows = torch.zeros(slots, permuted.shape[-1], dtype=permuted.dtype).index_copy(0, sorted_indices, permuted)
    top_k = 1 if probs is None else probs.shape[1]
    rows = rows.reshape(-1, top_k, permuted.shape[-1])
    return (rows if probs is None else rows * probs.unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("cut", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_all_to_all_round_trip_is_the_dense_weighted_sum(top_k, cut, dtype):
    """TokenDispatcherWithAll2AllV without ranks: ``npu_moe_token_permute(tokens=, indices=,
    num_out_tokens=)``, the experts, ``npu_moe_token_unpermute(permuted_tokens=, sorted_indices=
    .to(int32), probs=, restore_shape=)``; ``cut`` rows dropped by num_out_tokens = T*K - cut."""
    g = torch.Generator().manual_seed(top_k)
    tokens_num, experts, hidden = 24, 16, 8
    hidden_states = torch.randn(tokens_num, hidden, generator=g).to(dtype)
    topk_ids = distinct_experts(g, tokens_num, experts, top_k)
    topk_weights = torch.softmax(torch.randn(tokens_num, top_k, generator=g), -1)  # float32, as vllm's router
    num_out_tokens = topk_ids.numel() - (cut or 0)
    permuted, reversed_mapping = npu.npu_moe_token_permute(
        tokens=hidden_states, indices=topk_ids, num_out_tokens=num_out_tokens
    )
    assert permuted.shape == (num_out_tokens, hidden) and reversed_mapping.dtype == torch.int32
    row_expert = torch.sort(topk_ids.reshape(-1), stable=True).values[:num_out_tokens]
    expert_out = (permuted.float() * expert_scale(row_expert)).to(dtype)
    out = npu.npu_moe_token_unpermute(
        permuted_tokens=expert_out,
        sorted_indices=reversed_mapping.to(torch.int32),
        probs=topk_weights,
        restore_shape=hidden_states.shape,
    )
    # dense: every (token, slot) whose copy survived the cut, weighted
    kept = torch.zeros(topk_ids.numel(), dtype=torch.bool)
    kept[torch.argsort(topk_ids.reshape(-1), stable=True)[:num_out_tokens]] = True
    factor = (topk_weights * kept.view(tokens_num, top_k)).unsqueeze(-1) * expert_scale(topk_ids)
    dense = (hidden_states.float().unsqueeze(1) * factor).sum(1)
    assert out.dtype == dtype and out.shape == hidden_states.shape
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), dense, **tolerance)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("cut", [None, 7])
def test_gradients_through_permute_and_unpermute_match_megatron_autograd(top_k, cut):
    g = torch.Generator().manual_seed(10 + top_k)
    tokens_num, experts, hidden = 20, 12, 6
    indices = distinct_experts(g, tokens_num, experts, top_k)
    num_out = None if cut is None else indices.numel() - cut
    weight = torch.randn(experts, hidden, generator=g)  # a per-expert row scale, differentiable too
    upstream = torch.randn(tokens_num, hidden, generator=g)

    def run(fused: bool):
        tokens = torch.randn(tokens_num, hidden, generator=torch.Generator().manual_seed(1)).requires_grad_()
        probs = torch.rand(tokens_num, top_k, generator=torch.Generator().manual_seed(2)).requires_grad_()
        w = weight.clone().requires_grad_()
        if fused:
            permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices, num_out)
        else:
            permuted, sorted_indices = megatron_permute(tokens, indices, num_out)
        row_expert = torch.sort(indices.reshape(-1).long(), stable=True).values[: permuted.shape[0]]
        expert_out = permuted * w[row_expert]
        if fused:
            out = npu.npu_moe_token_unpermute(expert_out, sorted_indices, probs if top_k > 1 else probs)
        else:
            out = megatron_unpermute(expert_out, sorted_indices, probs, indices.numel())
        (out * upstream).sum().backward()
        return out.detach(), tokens.grad, probs.grad, w.grad

    for got, want, name in zip(run(True), run(False), ["out", "tokens.grad", "probs.grad", "weight.grad"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_vllm_all_to_all_local_reorder_and_its_inverse():
    """After the all-to-all, vllm-ascend sorts the received rows by local expert with 1-D indices
    (``npu_moe_token_permute(global_input_tokens, indices_1d)``) and undoes it with
    ``npu_moe_token_unpermute(hidden_states, rev_global)`` (no probs: K = 1)."""
    g = torch.Generator().manual_seed(3)
    received = torch.randn(13, 4, generator=g).to(torch.bfloat16)
    local_expert = torch.randint(0, 3, (13,), generator=g, dtype=torch.int32)
    sorted_rows, rev_global = npu.npu_moe_token_permute(received, local_expert)
    assert torch.equal(sorted_rows, received[torch.argsort(local_expert, stable=True)])
    back = npu.npu_moe_token_unpermute(sorted_rows * 2, rev_global)
    assert torch.equal(back, received * 2)


def test_vllm_all_gather_combine_with_abs_index_and_masked_weights():
    """TokenDispatcherWithAllGather: experts outside this rank's range get -1 in expanded_row_idx
    and weight 0; the combine passes ``torch.abs(sorted_indices)``. Those slots read row 1 and add
    nothing, and the gradient does not leak into row 1 through them."""
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(6, 3, generator=g).requires_grad_()
    expanded_row_idx = torch.tensor([0, -1, 2, 3, -1, 5, 4, -1], dtype=torch.int32)
    weights = torch.rand(4, 2, generator=g)
    masked = (weights * (expanded_row_idx.view(4, 2) >= 0)).requires_grad_()
    out = npu.npu_moe_token_unpermute(permuted_tokens=rows, sorted_indices=torch.abs(expanded_row_idx), probs=masked)
    valid = expanded_row_idx.view(4, 2).clamp(min=0).long()
    dense = (rows.detach()[valid] * masked.detach().unsqueeze(-1) * (expanded_row_idx.view(4, 2, 1) >= 0)).sum(1)
    torch.testing.assert_close(out.detach(), dense)
    out.sum().backward()
    assert torch.equal(rows.grad[1], torch.zeros(3))  # named by three slots, all of weight 0
    assert torch.allclose(masked.grad[0, 1], rows.detach()[1].sum())  # d out / d weight: row 1 all the same


def test_mindspeed_fused_and_eager_paths_agree():
    """MindSpeed's expert_parallel utils: ``eager_permute`` returns Megatron's sorted_indices
    (dst -> src), ``fused_permute`` torch_npu's (src -> dst); each unpermute takes its own."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randn(10, 4, generator=g)
    indices = distinct_experts(g, 10, 6, 3)
    probs = torch.rand(10, 3, generator=g)
    eager_rows, eager_index = megatron_permute(tokens, indices)
    fused_rows, fused_index = npu.npu_moe_token_permute(tokens, indices)
    assert torch.equal(eager_rows, fused_rows)
    assert torch.equal(fused_index.long(), torch.argsort(eager_index, stable=True))
    eager = megatron_unpermute(eager_rows, eager_index, probs, indices.numel())
    fused = npu.npu_moe_token_unpermute(fused_rows.to(probs.dtype), fused_index, probs)  # fused_unpermute's cast
    torch.testing.assert_close(fused, eager, rtol=1e-6, atol=1e-6)


def test_grad_entry_points_equal_autograd():
    g = torch.Generator().manual_seed(6)
    tokens = torch.randn(8, 5, generator=g).requires_grad_()
    indices = distinct_experts(g, 8, 6, 2)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices, 12)
    grad_permuted = torch.randn(permuted.shape, generator=g)
    permuted.backward(grad_permuted)
    v1 = npu.npu_moe_token_permute_grad(tokens, grad_permuted, indices, sorted_indices)
    v2 = npu.npu_moe_token_permute_grad_v2(grad_permuted, sorted_indices, 8, torch.float32, 2)
    assert torch.equal(v1, tokens.grad) and torch.equal(v2, tokens.grad)

    rows = torch.randn(12, 5, generator=g).requires_grad_()
    probs = torch.rand(8, 2, generator=g).requires_grad_()
    out, saved = npu._npu_moe_token_unpermute(rows, sorted_indices, probs)
    assert saved is rows
    upstream = torch.randn(out.shape, generator=g)
    out.backward(upstream)
    grad_rows, grad_probs = npu.npu_moe_token_unpermute_grad(rows, upstream, sorted_indices, probs)
    assert torch.equal(grad_rows, rows.grad) and torch.equal(grad_probs, probs.grad)
    v2_rows, v2_probs = npu.npu_moe_token_unpermute_grad_v2(
        upstream, sorted_indices, 12, torch.float32, probs, permuted_tokens=rows
    )
    assert torch.equal(v2_rows, rows.grad) and torch.equal(v2_probs, probs.grad)
    # without probs: the rows are not kept for the backward, grad_probs is a 0-dim tensor (op-plugin's
    # npu_moe_token_unpermute_grad_probs_out_size is {}), zero here
    plain, none = npu._npu_moe_token_unpermute(rows[:, :], sorted_indices[:8])
    assert none is None and plain.shape == (8, 5)
    rows_only, empty = npu.npu_moe_token_unpermute_grad_v2(upstream, sorted_indices[:8], 12, torch.float32)
    assert rows_only.shape == (12, 5) and empty.shape == () and empty.item() == 0


def test_mixed_precision_grads_keep_their_dtypes():
    """op-plugin's test_unpermute_grad_mixed_dtype: bfloat16 rows, float32 probs."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(16, 8, generator=g).to(torch.bfloat16).requires_grad_()
    sorted_indices = torch.randperm(16, generator=g).to(torch.int32)
    probs = torch.full((4, 4), 0.25).requires_grad_()
    out = npu.npu_moe_token_unpermute(rows, sorted_indices, probs=probs)
    out.backward(torch.ones_like(out))
    assert out.dtype == rows.grad.dtype == torch.bfloat16 and probs.grad.dtype == torch.float32


def test_gpt_oss_v1_routing_and_expert_tokens():
    """cann-recipes-infer's GptOssMLP.moe_infer_fusion: row_idx = arange(T*K).view(K, -1).permute(1, 0),
    ``npu_moe_init_routing(x, row_idx=, expert_idx=, active_num=T)``, ``npu_moe_compute_expert_tokens
    (expanded_expert_idx, E).to(int64)`` as the group list (cumsum); the experts here run per group
    range, and the combine is SPEC 1.8 mode 0 written out: out[t] = sum_j w[t, j] * y[idx[j*T + t]]."""
    g = torch.Generator().manual_seed(8)
    token_count, hidden, experts, top_k = 10, 6, 5, 2
    hidden_states = torch.randn(token_count, hidden, generator=g)
    scores, topk_ids = torch.topk(torch.softmax(torch.randn(token_count, experts, generator=g), -1), top_k)
    routing_weights = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    expert_idx = topk_ids.int()
    row_idx = torch.arange(0, token_count * top_k, dtype=torch.int32).view(top_k, -1).permute(1, 0).contiguous()
    expanded_x, expanded_row_idx, expanded_expert_idx = npu.npu_moe_init_routing(
        hidden_states, row_idx=row_idx, expert_idx=expert_idx, active_num=token_count
    )
    expert_tokens = npu.npu_moe_compute_expert_tokens(expanded_expert_idx, experts).to(torch.int64)
    assert expert_tokens[-1] == token_count * top_k
    y = torch.empty_like(expanded_x)
    start = 0
    for e, end in enumerate(expert_tokens.tolist()):
        y[start:end] = expanded_x[start:end] * (1 + e / 4)
        start = end
    combined = torch.zeros(token_count, hidden)
    for t in range(token_count):
        for j in range(top_k):
            combined[t] += routing_weights[t, j] * y[expanded_row_idx[j * token_count + t]]
    dense = (hidden_states.unsqueeze(1) * routing_weights.unsqueeze(-1) * expert_scale(topk_ids)).sum(1)
    torch.testing.assert_close(combined, dense, rtol=1e-6, atol=1e-6)


def test_omni_infer_sentinel_rows_are_zeroed_after_the_last_group():
    """omni-infer's fused_experts_allgather_ep: non-local experts -> E, v1 routing with a large
    active_num (clamped to T), expert tokens over E (or E + 1 then ``[:-1]``), and the rows after
    ``expert_tokens[-1]`` are the sentinel's."""
    g = torch.Generator().manual_seed(9)
    local, top_k, tokens_num = 4, 2, 9
    topk_ids = distinct_experts(g, tokens_num, 2 * local, top_k)
    mask = (topk_ids < local).to(torch.int32)
    local_ids = topk_ids * mask + (1 - mask) * local
    row_idx = torch.arange(topk_ids.numel(), dtype=torch.int32).reshape(top_k, tokens_num).transpose(1, 0).contiguous()
    sorted_tokens, _, expanded_expert_idx = npu.npu_moe_init_routing(
        torch.randn(tokens_num, 3, generator=g), row_idx, local_ids, 16384
    )
    assert sorted_tokens.shape == (tokens_num * top_k, 3)
    ends = npu.npu_moe_compute_expert_tokens(expanded_expert_idx, local)
    assert torch.equal(ends, npu.npu_moe_compute_expert_tokens(expanded_expert_idx, local + 1)[:-1])
    assert (expanded_expert_idx[ends[-1] :] == local).all() and int(ends[-1]) == int(mask.sum())


def test_init_routing_v1_is_not_differentiable_and_says_so():
    x = torch.randn(3, 2, requires_grad=True)
    row_idx = torch.arange(6, dtype=torch.int32).view(2, 3).T.contiguous()
    expanded, _, _ = npu.npu_moe_init_routing(x, row_idx, torch.zeros(3, 2, dtype=torch.int32), 3)
    with pytest.raises(RuntimeError, match="cann_moe::MoeInitRouting is not differentiable"):
        expanded.sum().backward()


def test_alias_refusals():
    grad, sorted_indices = torch.randn(4, 2), torch.arange(4, dtype=torch.int32)
    with pytest.raises(moe_onnx.MoeOpError, match="tokens_dtype=torch.bfloat16 is not supported"):
        npu.npu_moe_token_permute_grad_v2(grad, sorted_indices, 2, torch.bfloat16, 2)
    with pytest.raises(moe_onnx.MoeOpError, match=r"len\(sorted_indices\) = 4 must be tokens \(3\) \* K \(2\)"):
        npu.npu_moe_token_permute_grad_v2(grad, sorted_indices, 3, torch.float32, 2)
    with pytest.raises(moe_onnx.MoeOpError, match="padded_mode=1 is not supported"):
        npu.npu_moe_token_permute(grad, torch.zeros(4, dtype=torch.int32), padded_mode=True)
    with pytest.raises(moe_onnx.MoeOpError, match="permuted_tokens_dtype=torch.float16 is not supported"):
        npu.npu_moe_token_unpermute_grad_v2(grad, sorted_indices, 4, torch.float16)


def test_export_follows_a_dynamic_token_count():
    """SIZE_RULES: permute rows T*K (and T*K + n), v1 rows min(active_num, T)*K, unpermute T."""

    class Dispatch(torch.nn.Module):
        def forward(self, x, ids, probs):
            permuted, index = mt.moe_token_permute(x, ids, num_out_tokens=-2)
            out = mt.moe_token_unpermute(permuted * 2, index, probs)
            row_idx = torch.arange(ids.numel(), dtype=torch.int32).view(ids.shape[1], -1).T.contiguous()
            expanded, _, sorted_ids = mt.moe_init_routing(x, row_idx, ids, active_num=4)
            return permuted, out, expanded, mt.moe_compute_expert_tokens(sorted_ids, num_experts=5)

    tokens = torch.export.Dim("T", min=2)
    example = (torch.randn(6, 3), torch.randint(0, 5, (6, 2), dtype=torch.int32), torch.rand(6, 2))
    exported = torch.export.export(Dispatch(), example, dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}))
    permuted, out, expanded, ends = (n.meta["val"] for n in exported.graph.find_nodes(op="output")[0].args[0])
    t = out.shape[0]
    assert str(t) != "6" and permuted.shape[0] == 2 * t - 2 and ends.shape == (5,)
    assert "Min" in str(expanded.shape[0]) or "min" in str(expanded.shape[0])


def test_onnx_export_runs_like_eager_at_other_token_counts(tmp_path):
    """moe_onnx.torch.export: cann.moe nodes for the dispatch ops, a dynamic token count."""

    class Layer(torch.nn.Module):
        def forward(self, x, ids, probs):
            permuted, index = npu.npu_moe_token_permute(x, ids)
            out = npu.npu_moe_token_unpermute(permuted * 3, index, probs)
            row_idx = torch.arange(ids.numel(), dtype=torch.int32).view(ids.shape[1], -1).T.contiguous()
            expanded, src_to_dst, sorted_ids = npu.npu_moe_init_routing(x, row_idx, ids, 64)
            return out, expanded, src_to_dst, npu.npu_moe_compute_expert_tokens(sorted_ids, 5)

    tokens = torch.export.Dim("T", min=2)
    example = (torch.randn(6, 3), torch.randint(0, 5, (6, 2), dtype=torch.int32), torch.rand(6, 2))
    path = tmp_path / "dispatch.onnx"
    mt.export(Layer().eval(), example, path, dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}))
    session = moe_onnx.InferenceSession(str(path))
    for count in (6, 3, 9):
        g = torch.Generator().manual_seed(count)
        inputs = (torch.randn(count, 3, generator=g), torch.randint(0, 5, (count, 2), generator=g, dtype=torch.int32))
        inputs += (torch.rand(count, 2, generator=g),)
        got = session.run(None, {"x": inputs[0].numpy(), "ids": inputs[1].numpy(), "probs": inputs[2].numpy()})
        for a, b in zip(got, Layer()(*inputs)):
            assert a.shape == tuple(b.shape)
            assert a.tobytes() == b.numpy().tobytes()
