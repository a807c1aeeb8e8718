"""The gating ops from PyTorch under torch_npu's names (after install_stand_ins), as real Ascend
code calls them: DeepSeek-V3 grouped selection against an independent torch implementation on
1000 routings built with ties, its backward against torch autograd of the sigmoid path, the
softmax gate of Qwen3-MoE / gpt-oss / omni-infer, vllm-ascend's router, the hash mode of
DeepSeek-V4, refusals, and export to ONNX."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt

E, GROUPS, TOPK_GROUP, TOP_K, SCALE = 256, 8, 4, 8, 2.5  # DeepSeek-V3


@pytest.fixture
def torch_npu(monkeypatch):
    """``import torch_npu`` as Ascend code does, removed again after the test."""
    modules = mt.install_stand_ins()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    import torch_npu as module

    return module


# --- DeepSeek-V3 noaux_tc -------------------------------------------------------------------------


def deepseek_routings(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` rows of logits [n, 256] and a bias [256], with ties built in, a quarter of the rows
    each: coarse-grid logits (ties inside and across groups), one group copied onto another
    (tied group scores: the bias repeats from group to group, with repeated values inside a
    group too), several experts equal to the k-th best one, and plain random rows."""
    g = torch.Generator().manual_seed(seed)
    per = E // GROUPS
    logits = torch.randn(n, E, generator=g)
    bias = (torch.randint(-4, 5, (per,), generator=g) / 256.0).repeat(GROUPS)
    kind = torch.arange(n) % 4
    grid = torch.randint(-6, 7, (n, E), generator=g) / 4.0
    logits[kind == 0] = grid[kind == 0]
    for t in torch.nonzero(kind == 1).flatten().tolist():  # the k_group-th group copied onto the next
        scores = (torch.sigmoid(logits[t]) + bias).view(GROUPS, per).topk(2).values.sum(-1)
        src, dst = torch.argsort(scores, descending=True)[TOPK_GROUP - 1 : TOPK_GROUP + 1].tolist()
        logits[t, dst * per : (dst + 1) * per] = logits[t, src * per : (src + 1) * per].clone()
    for t in torch.nonzero(kind == 2).flatten().tolist():
        order = torch.argsort(logits[t] + bias, descending=True)
        logits[t, order[TOP_K - 3 : TOP_K + 3]] = logits[t, order[TOP_K - 1]].item()  # ties at the k-th place
    return logits, bias


def torch_noaux_tc(logits: torch.Tensor, bias: torch.Tensor):
    """DeepSeek-V3's noaux_tc gate (Hugging Face modeling_deepseek, written from its formula),
    with SPEC 1.14's two corrections: dropped groups hold -inf (HF: 0.0), and every ranking is
    a stable descending sort (equal scores: the lower index). The scores are the float32
    nearest the exact sigmoid (float64, rounded once), as SPEC's golden defines them."""
    scores = torch.sigmoid(logits.double()).float()
    choice = scores + bias.float()
    grouped = choice.view(-1, GROUPS, E // GROUPS)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    group_idx = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :TOPK_GROUP]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    masked = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(-1, E)
    topk_idx = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :TOP_K]
    weights = scores.gather(1, topk_idx).double()
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * SCALE
    return weights.float(), topk_idx, scores, group_scores


def deepseek_gate(torch_npu, logits, bias):
    """cann-recipes-infer models/deepseek_r1 ``_forward_gate``'s fused branch, as written there."""
    topk_weight, topk_idx, _ = torch_npu.npu_moe_gating_top_k(
        logits,
        k=TOP_K,
        bias=bias.float(),
        k_group=TOPK_GROUP,
        group_count=GROUPS,
        group_select_mode=1,  # 0: the max in a group; 1: topk2.sum
        renorm=0,  # 0: softmax->topk; 1: topk->softmax
        norm_type=1,  # 0: softmax; 1: sigmoid
        routed_scaling_factor=SCALE,
        eps=1e-20,
    )
    return topk_idx, topk_weight, None


def test_deepseek_v3_gating_equals_torch_on_1000_routings_with_ties(torch_npu):
    logits, bias = deepseek_routings(1000)
    topk_idx, topk_weight, _ = deepseek_gate(torch_npu, logits, bias)
    weights, idx, _, group_scores = torch_noaux_tc(logits, bias)
    assert topk_idx.dtype == torch.int32
    assert torch.equal(topk_idx.long(), idx)  # the same experts in the same order, every row
    torch.testing.assert_close(topk_weight, weights, rtol=1.2e-7, atol=0)
    # the ties the rows were built for did decide something
    ranked = torch.sort(group_scores, dim=-1, descending=True).values
    assert int((ranked[:, TOPK_GROUP - 1] == ranked[:, TOPK_GROUP]).sum()) >= 100  # groups tied at the cut
    choice = (torch.sigmoid(logits.double()).float() + bias).gather(1, idx)
    assert int((choice[:, 1:] == choice[:, :-1]).any(dim=1).sum()) >= 250  # tied experts chosen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_backward_matches_torch_autograd_of_the_sigmoid_path(torch_npu, dtype):
    logits, bias = deepseek_routings(256, seed=1)
    x = logits.to(dtype).requires_grad_()
    y, idx, out = torch_npu.npu_moe_gating_top_k(
        x,
        TOP_K,
        bias=bias.to(dtype),
        k_group=TOPK_GROUP,
        group_count=GROUPS,
        group_select_mode=1,
        norm_type=1,
        out_flag=True,
        routed_scaling_factor=SCALE,
    )
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    y.backward(grad_y)
    # torch autograd in float64 through sigmoid -> gather -> renormalise -> scale, the selection fixed
    reference = x.detach().double().requires_grad_()
    w = torch.sigmoid(reference).gather(1, idx.long())
    (w / (w.sum(-1, keepdim=True) + 1e-20) * SCALE).backward(grad_y.double())
    assert x.grad.dtype == dtype
    tolerance = {"rtol": 1e-6, "atol": 1e-9} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
    torch.testing.assert_close(x.grad.double(), reference.grad, **tolerance)
    # the grad op under its own name gives the same bits
    again = torch_npu.npu_moe_gating_top_k_backward(
        out, grad_y, idx, renorm=0, norm_type=1, routed_scaling_factor=SCALE, eps=1e-20
    )
    assert torch.equal(again, x.grad)


def test_backward_refusals(torch_npu):
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(moe_onnx.MoeOpError, match="pass out_flag=1 .* to train"):
        torch_npu.npu_moe_gating_top_k(x, 2, norm_type=1)[0].sum().backward()
    for norm_type in (0, 2):
        y, _, _ = torch_npu.npu_moe_gating_top_k(x, 2, norm_type=norm_type, out_flag=True)
        with pytest.raises(moe_onnx.MoeOpError, match=f"only the sigmoid scores .* got norm_type={norm_type}"):
            y.sum().backward()
    # out is not differentiable (derivatives.yaml), as in torch_npu: only y's path counts
    y, _, out = torch_npu.npu_moe_gating_top_k(x, 2, norm_type=1, out_flag=True)
    assert not out.requires_grad
    ((y * torch.arange(2.0)).sum() + out.sum()).backward()
    only_y = x.detach().clone().requires_grad_()
    (torch_npu.npu_moe_gating_top_k(only_y, 2, norm_type=1, out_flag=True)[0] * torch.arange(2.0)).sum().backward()
    assert torch.equal(x.grad, only_y.grad)
    y, _, _ = torch_npu.npu_moe_gating_top_k_softmax(x, k=2)
    with pytest.raises(RuntimeError, match="MoeGatingTopKSoftmax is not differentiable: torch_npu has no derivative"):
        y.sum().backward()
    with pytest.raises(moe_onnx.MoeOpError, match=r"torch_npu.npu_moe_gating_top_k_backward: norm_type=0 is not"):
        torch_npu.npu_moe_gating_top_k_backward(
            torch.rand(4, 16), torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int32)
        )


# --- the softmax gate ----------------------------------------------------------------------------


def test_gpt_oss_router_and_the_row_idx_others_build(torch_npu):
    """cann-recipes-infer gpt_oss ``_forward_router``: top-k softmax, renormalised by hand; its
    row_idx is the ``arange(T*K).view(K, T).T`` that omni-infer and vllm-ascend build when
    they use other gates."""
    g = torch.Generator().manual_seed(3)
    router_logits = torch.randn(40, 32, generator=g).bfloat16()
    topk_weight, topk_idx, row_idx = torch_npu.npu_moe_gating_top_k_softmax(router_logits, None, k=4)
    denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
    topk_weight = topk_weight / denominator
    probs = torch.softmax(router_logits.double(), dim=-1)
    values, indices = torch.sort(probs.float(), dim=-1, descending=True, stable=True)
    assert torch.equal(topk_idx.long(), indices[:, :4])
    want = values[:, :4].bfloat16()
    torch.testing.assert_close(topk_weight, want / (want.sum(-1, keepdim=True) + 1e-20))
    built = torch.arange(topk_idx.numel(), dtype=torch.int32).view(-1, 40).transpose(0, 1)
    assert torch.equal(row_idx, built)


def test_vllm_ascend_310p_router_float16_and_finished(torch_npu):
    """vllm-ascend _310p grouped_topk_router: float16 logits, k by keyword, no finished; and
    the finished rows of the op-plugin's test (expert E, y kept)."""
    router_logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(4)).half()
    topk_weights, topk_ids, _ = torch_npu.npu_moe_gating_top_k_softmax(router_logits, k=6)
    assert topk_weights.dtype == torch.float16 and topk_ids.shape == (16, 6)
    finished = torch.arange(16) % 3 == 0
    y, ids, _ = torch_npu.npu_moe_gating_top_k_softmax(router_logits, finished, k=6)
    assert (ids[finished] == 64).all() and torch.equal(ids[~finished], topk_ids[~finished])
    assert torch.equal(y, topk_weights)


def test_vllm_ascend_renormalised_softmax_equals_renorm_1(torch_npu):
    """vllm-ascend's DeviceOperator.moe_gating_top_k calls renorm=0 and divides by the sum
    itself; aclnn's renorm=1 (adopted here) is that division in the op."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    topk_weights, topk_ids, _ = torch_npu.npu_moe_gating_top_k(
        x, k=6, bias=None, k_group=1, group_count=1, group_select_mode=1, renorm=0, norm_type=0, eps=1e-20
    )
    topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    renormalised, ids, _ = torch_npu.npu_moe_gating_top_k(x, k=6, group_select_mode=1, renorm=True, norm_type=0)
    assert torch.equal(ids, topk_ids)
    torch.testing.assert_close(renormalised, topk_weights, rtol=2e-7, atol=0)


def test_sigmoid_gates_without_groups(torch_npu):
    """hy3 (bias, sigmoid, default groups), longcat-flash (softmax with bias, renorm=0) and
    sglang's int routed_scaling_factor: the selection by the biased score, weights unbiased."""
    g = torch.Generator().manual_seed(6)
    router_logits, bias = torch.randn(24, 192, generator=g), torch.randn(192, generator=g) * 0.05
    top_k_weights, top_k_index, _ = torch_npu.npu_moe_gating_top_k(
        router_logits, k=8, bias=bias.float(), norm_type=1, routed_scaling_factor=2.826, eps=1e-20
    )
    scores = torch.sigmoid(router_logits.double()).float()
    idx = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :8]
    assert torch.equal(top_k_index.long(), idx)
    w = scores.gather(1, idx).double()
    torch.testing.assert_close(top_k_weights.double(), w / w.sum(-1, keepdim=True) * 2.826, rtol=1e-7, atol=0)
    topk_weights, topk_indices, _ = torch_npu.npu_moe_gating_top_k(
        router_logits, k=12, bias=bias.float(), renorm=0, norm_type=0, routed_scaling_factor=1, eps=1e-20
    )
    probs = torch.softmax(router_logits.double(), -1).float()
    assert torch.equal(
        topk_indices.long(), torch.sort(probs + bias, dim=-1, descending=True, stable=True).indices[:, :12]
    )
    torch.testing.assert_close(topk_weights, probs.gather(1, topk_indices.long()), rtol=0, atol=0)


def test_deepseek_v4_hash_routing(torch_npu):
    """vllm-ascend's sqrtsoftplus hash path: input_ids int64, tid2eid int32, no groups,
    group_select_mode=1, renorm=0 (norm_type 2 renormalises anyway)."""
    g = torch.Generator().manual_seed(7)
    router_logits = torch.randn(10, 64, generator=g)
    tid2eid = torch.randint(0, 64, (100, 6), generator=g, dtype=torch.int32)
    input_ids = torch.randint(0, 100, (10,), generator=g)
    topk_weights, topk_ids, _ = torch_npu.npu_moe_gating_top_k(
        router_logits,
        k=6,
        bias=torch.randn(64, generator=g),
        input_ids=input_ids.to(torch.int64),
        tid2eid=tid2eid,
        k_group=1,
        group_count=1,
        routed_scaling_factor=1.5,
        eps=1e-20,
        group_select_mode=1,
        renorm=0,
        norm_type=2,
        out_flag=False,
    )
    assert torch.equal(topk_ids, tid2eid[input_ids])
    s = torch.sqrt(torch.nn.functional.softplus(router_logits.double())).float().gather(1, topk_ids.long()).double()
    torch.testing.assert_close(topk_weights.double(), s / s.sum(-1, keepdim=True) * 1.5, rtol=1e-7, atol=0)
    with pytest.raises(moe_onnx.MoeOpError, match=r"input_ids must be in \[0, V\) = \[0, 100\)"):
        torch_npu.npu_moe_gating_top_k(router_logits, k=6, input_ids=input_ids - 1 - input_ids.max(), tid2eid=tid2eid)


def test_keyword_x_and_k_as_superkernel_calls_them(torch_npu):
    logits = torch.randn(4, 256)
    y, idx, out = torch_npu.npu_moe_gating_top_k(
        x=logits, bias=torch.zeros(256), k=8, k_group=4, group_count=8, group_select_mode=1, norm_type=1
    )
    assert y.shape == idx.shape == (4, 8) and out.shape == (4, 256)


# --- graph capture and export -----------------------------------------------------------------------


class Gates(torch.nn.Module):
    def forward(self, logits, bias):
        from moe_onnx.torch import npu

        weights, idx, _ = npu.npu_moe_gating_top_k(
            logits, TOP_K, bias=bias, k_group=TOPK_GROUP, group_count=GROUPS, group_select_mode=1, norm_type=1
        )
        probs, experts, row_idx = npu.npu_moe_gating_top_k_softmax(logits.view(2, -1, E), None, k=4)
        return weights, idx, probs, experts, row_idx


def test_export_to_onnx_runs_like_eager_at_other_batch_sizes(tmp_path):
    path = tmp_path / "gates.onnx"
    tokens = torch.export.Dim("T")
    bias = torch.randn(E) * 0.01
    mt.export(Gates(), (torch.randn(6, E), bias), path, dynamic_shapes=({0: 2 * tokens}, None))
    for n in (6, 10):
        logits = deepseek_routings(n, seed=n)[0]
        got = moe_onnx.InferenceSession(str(path)).run(None, {"logits": logits.numpy(), "bias": bias.numpy()})
        for a, b in zip(got, Gates()(logits, bias)):
            np.testing.assert_array_equal(a, b.numpy())


def test_compile_gives_the_eager_bits():
    logits, bias = deepseek_routings(64, seed=8)
    compiled = torch.compile(Gates(), fullgraph=True)
    for a, b in zip(compiled(logits, bias), Gates()(logits, bias)):
        assert torch.equal(a, b)


def test_compiled_training_step_gives_the_eager_gradient():
    from moe_onnx.torch import npu

    def step(x, bias, grad_y):
        y, _, _ = npu.npu_moe_gating_top_k(
            x, TOP_K, bias=bias, k_group=TOPK_GROUP, group_count=GROUPS, group_select_mode=1, norm_type=1, out_flag=True
        )
        return (y * grad_y).sum()

    logits, bias = deepseek_routings(64, seed=9)
    grad_y = torch.randn(64, TOP_K, generator=torch.Generator().manual_seed(9))
    x = logits.clone().requires_grad_()
    torch.compile(step, fullgraph=True)(x, bias, grad_y).backward()
    eager = logits.clone().requires_grad_()
    step(eager, bias, grad_y).backward()
    assert torch.equal(x.grad, eager.grad)
