"""The grouped-matmul autograd Functions of fine-tuning code, in the argument forms their files
use (the real files run in tests/test_mindspeed_peers.py and tests/test_llamafactory_peers.py,
``-m peers``), through torch_npu's name: forward, the input's gradient with the transposed
weight, and the weight's gradient as a K-split grouped matmul of the transposed input
(``[x.t()]``, ``group_type=2``, ``split_item=3``). Each is checked against torch's autograd of
the per-expert products written in the test.

* LLaMA-Factory's ``GmmFunction``: counts (``group_list_type=1``), ``split_item=2``;
* LLaMA-Factory's ``HybridGmmFunction``: lists of per-expert inputs and weights, ``group_list=None,
  split_item=0, group_type=-1``, the weight's gradient from one stacked K-split product;
* MindSpeed's ``BF16GMMFunction`` (A5 branch): cumulative group lists (``group_list_type=0``),
  ``bias=None``, ``split_item=3``.
"""

from __future__ import annotations

import pytest
import torch

from moe_onnx.torch import npu as torch_npu


class GmmFunction(torch.autograd.Function):
    """LLaMA-Factory's (v1 npu_fused_moe.py), its calls as written there."""

    @staticmethod
    def forward(ctx, x, weight, group_list):
        ctx.save_for_backward(x, weight)
        ctx.group_list = group_list
        return torch_npu.npu_grouped_matmul(
            [x], [weight], bias=None, group_list=group_list, split_item=2, group_type=0, group_list_type=1
        )[0]

    @staticmethod
    def backward(ctx, grad_output):
        input_tensor, weight = ctx.saved_tensors
        group_list = ctx.group_list
        weight = torch.transpose(weight, 1, 2)
        grad_input = torch_npu.npu_grouped_matmul(
            [grad_output], [weight], bias=None, group_list=group_list, split_item=2, group_type=0, group_list_type=1
        )[0]
        grad_weight = torch_npu.npu_grouped_matmul(
            [input_tensor.T],
            [grad_output],
            bias=None,
            group_list=group_list,
            split_item=3,
            group_type=2,
            group_list_type=1,
        )[0]
        return grad_input, grad_weight, None


class HybridGmmFunction(torch.autograd.Function):
    """LLaMA-Factory's list form (per-expert tensors in, per-expert tensors out)."""

    @staticmethod
    def forward(ctx, num_experts, *args):
        x_list, weight_list = list(args[:num_experts]), list(args[num_experts:])
        ctx.split_sizes = [x.shape[0] for x in x_list]
        ctx.num_experts = num_experts
        ctx.save_for_backward(*args)
        return tuple(
            torch_npu.npu_grouped_matmul(x_list, weight_list, bias=None, group_list=None, split_item=0, group_type=-1)
        )

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved, num_experts = ctx.saved_tensors, ctx.num_experts
        x_list, weight_list = list(saved[:num_experts]), list(saved[num_experts:])
        grads = [g.contiguous() for g in grad_outputs]
        grad_x_list = torch_npu.npu_grouped_matmul(
            grads, [w.t() for w in weight_list], bias=None, group_list=None, split_item=0, group_type=-1
        )
        x_concat, dy_concat = torch.cat(x_list, dim=0), torch.cat(grads, dim=0)
        group_list = torch.tensor(ctx.split_sizes, device=x_concat.device, dtype=torch.int64)
        grad_w_stack = torch_npu.npu_grouped_matmul(
            [x_concat.t()], [dy_concat], bias=None, group_list=group_list, split_item=3, group_type=2, group_list_type=1
        )[0]
        return (None, *grad_x_list, *torch.unbind(grad_w_stack, dim=0))


class BF16GMMFunction(torch.autograd.Function):
    """MindSpeed's (grouped_matmul_util.py, A5 branch): ``gmm_apply`` takes tokens per expert."""

    @classmethod
    def gmm_apply(cls, x, weight, tokens_per_expert):
        return cls.apply(x, weight, torch.cumsum(tokens_per_expert, dim=0))

    @staticmethod
    def forward(ctx, x, weight, group_list):
        ctx.save_for_backward(x, weight, group_list)
        return torch_npu.npu_grouped_matmul(
            [x], [weight], bias=None, group_list=group_list, split_item=3, group_type=0, group_list_type=0
        )[0]

    @staticmethod
    def backward(ctx, grad):
        x, weight, group_list = ctx.saved_tensors
        dx = torch_npu.npu_grouped_matmul(
            [grad],
            [weight.transpose(1, 2)],
            bias=None,
            group_list=group_list,
            split_item=3,
            group_type=0,
            group_list_type=0,
        )[0]
        dw = torch_npu.npu_grouped_matmul(
            [x.t()], [grad], bias=None, group_list=group_list, split_item=3, group_type=2, group_list_type=0
        )[0]
        return dx, dw, None


def _reference(x, weight, counts):
    """Rows of expert e (a block of ``counts[e]`` rows) times ``weight[e]``, under torch's autograd."""
    return torch.cat([block @ weight[e] for e, block in enumerate(torch.split(x, counts.tolist()))])


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _problem(dtype, counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, experts = int(sum(counts)), len(counts)
    x = torch.randn(rows, 8, generator=g).to(dtype)
    weight = (torch.randn(experts, 8, 5, generator=g) / 8**0.5).to(dtype)
    return x, weight, torch.tensor(counts, dtype=torch.int64), torch.randn(rows, 5, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 4, 0], [1, 1, 1, 1]])
@pytest.mark.parametrize("function", ["llamafactory", "mindspeed"])
def test_stacked_gmm_function_trains_like_torch(dtype, counts, function):
    x, weight, tokens, cotangent = _problem(dtype, counts)
    x_ref, w_ref = x.clone().requires_grad_(), weight.clone().requires_grad_()
    x, weight = x.requires_grad_(), weight.requires_grad_()
    if function == "llamafactory":
        y = GmmFunction.apply(x, weight, tokens)
    else:
        y = BF16GMMFunction.gmm_apply(x, weight, tokens)
    (y * cotangent).sum().backward()
    want = _reference(x_ref, w_ref, tokens)
    (want * cotangent).sum().backward()
    assert y.dtype == dtype and weight.grad.shape == weight.shape
    torch.testing.assert_close(y, want, **TOLERANCE[dtype])
    torch.testing.assert_close(x.grad, x_ref.grad, **TOLERANCE[dtype])
    torch.testing.assert_close(weight.grad, w_ref.grad, **TOLERANCE[dtype])  # experts without rows: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hybrid_list_gmm_function_trains_like_torch(dtype):
    """LLaMA-Factory's v4 sparse block: per-expert blocks split by the token counts (an empty
    block included), weights as ``linear.weight.t()`` views."""
    x, _, tokens, cotangent = _problem(dtype, [4, 0, 3])
    g = torch.Generator().manual_seed(1)
    linears = [(torch.randn(5, 8, generator=g) / 8**0.5).to(dtype).requires_grad_() for _ in range(3)]
    refs = [w.detach().clone().requires_grad_() for w in linears]
    x_ref = x.clone().requires_grad_()
    x = x.requires_grad_()
    blocks = list(torch.split(x, tokens.tolist(), dim=0))
    outs = HybridGmmFunction.apply(len(blocks), *blocks, *[w.t() for w in linears])
    y = torch.cat(outs, dim=0)
    (y * cotangent).sum().backward()
    want = torch.cat([b @ w.t() for b, w in zip(torch.split(x_ref, tokens.tolist()), refs)])
    (want * cotangent).sum().backward()
    torch.testing.assert_close(y, want, **TOLERANCE[dtype])
    torch.testing.assert_close(x.grad, x_ref.grad, **TOLERANCE[dtype])
    for w, r in zip(linears, refs):
        torch.testing.assert_close(w.grad, r.grad, **TOLERANCE[dtype])
