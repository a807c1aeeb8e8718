"""One gloo rank of tests/test_torch_mc2_mindspeed.py: MindSpeed's mc2 call pattern written
here (no MindSpeed source): two autograd Functions that call ``npu_alltoallv_gmm`` /
``npu_gmm_alltoallv`` with keyword arguments only, the backward with the weight rearranged
``n h f -> n f h`` (a non-contiguous view), the lists swapped, and dW by ``npu_grouped_matmul``
over ``[rows.T]`` with ``split_item=3, group_type=2, group_list_type=1`` and a tensor
group list, as ``mc2_fuse_a2a.py``'s AlltoallvPermuteGmm / GmmUnpermuteAlltoallv do."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import moe_onnx.torch as mt
from moe_onnx.torch.collectives import register_group

LOCAL, HIDDEN, FFN = 2, 8, 5


def _exchange_kwargs(hcom, world, send_counts, recv_counts) -> dict:
    return dict(
        hcom=hcom,
        ep_world_size=world,
        send_counts=send_counts,
        recv_counts=recv_counts,
        send_counts_tensor=None,
        recv_counts_tensor=None,
        mm_x=None,
        mm_weight=None,
        trans_gmm_weight=False,
        trans_mm_weight=False,
    )


class PermuteGmm(torch.autograd.Function):
    """FC1: rows [N_send, H] (destination-rank, then local-expert order) -> [N_recv, N]."""

    @staticmethod
    def forward(ctx, rows, weight, hcom, world, group_list, send_counts, recv_counts):
        out, shared_out, permuted = mt.npu_alltoallv_gmm(
            gmm_x=rows,
            gmm_weight=weight,
            **_exchange_kwargs(hcom, world, send_counts, recv_counts),
            permute_out_flag=True,
        )
        assert shared_out is None
        ctx.save_for_backward(weight, permuted)
        ctx.args = hcom, world, group_list, send_counts, recv_counts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, permuted = ctx.saved_tensors
        hcom, world, group_list, send_counts, recv_counts = ctx.args
        weight_t = weight.permute(0, 2, 1)  # einops.rearrange(w, 'n h f -> n f h'): a view
        grad_rows, _ = mt.npu_gmm_alltoallv(
            gmm_x=grad_out, gmm_weight=weight_t, **_exchange_kwargs(hcom, world, recv_counts, send_counts)
        )
        grad_weight = mt.npu_grouped_matmul(
            [permuted.T], [grad_out], bias=None, group_list=group_list, split_item=3, group_type=2, group_list_type=1
        )[0]
        return grad_rows, grad_weight, None, None, None, None, None


class GmmUnpermute(torch.autograd.Function):
    """FC2: [N_recv, F] (local-expert, then source order) -> rows [N_send, H] back in send order."""

    @staticmethod
    def forward(ctx, hidden, weight, hcom, world, group_list, send_counts, recv_counts):
        out, shared_out = mt.npu_gmm_alltoallv(
            gmm_x=hidden, gmm_weight=weight, **_exchange_kwargs(hcom, world, recv_counts, send_counts)
        )
        assert shared_out is None
        ctx.save_for_backward(hidden, weight)
        ctx.args = hcom, world, group_list, send_counts, recv_counts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight = ctx.saved_tensors
        hcom, world, group_list, send_counts, recv_counts = ctx.args
        grad_hidden, _, grad_products = mt.npu_alltoallv_gmm(
            gmm_x=grad_out,
            gmm_weight=weight.permute(0, 2, 1),
            **_exchange_kwargs(hcom, world, send_counts, recv_counts),
            permute_out_flag=True,
        )
        grad_weight = mt.npu_grouped_matmul(
            [hidden.T], [grad_products], bias=None, group_list=group_list, split_item=3, group_type=2, group_list_type=1
        )[0]
        return grad_hidden, grad_weight, None, None, None, None, None


def counts(world: int) -> torch.Tensor:
    """C[src, dst, le]: rows rank src sends to local expert le of rank dst (the same on every
    rank; rank 0 sends nothing to rank 1)."""
    grid = torch.randint(0, 4, (world, world, LOCAL), generator=torch.Generator().manual_seed(11))
    grid[0, 1] = 0
    return grid


def mindspeed_style(rows, w1, w2, grid, rank, world, hcom):
    """FC1, SwiGLU (npu_swiglu), FC2 through the two Functions. rows [N_send, H]."""
    send, recv = grid[rank].reshape(-1).tolist(), grid[:, rank].reshape(-1).tolist()
    group_list = grid[:, rank].sum(0)  # tokens per local expert, a tensor (Megatron's)
    h = PermuteGmm.apply(rows, w1, hcom, world, group_list, send, recv)
    return GmmUnpermute.apply(mt.npu_swiglu(h, dim=-1), w2, hcom, world, group_list, send, recv)


def reference(rows, w1, w2, grid, rank, world):
    """Megatron-style pure torch: all_to_all_single, one (src, le) block at a time
    x @ w1[le] -> silu(gate) * up -> @ w2[le], all_to_all_single back."""
    import torch.distributed.nn.functional as dist_nn

    send, recv = grid[rank], grid[:, rank]
    to_me, from_me = recv.sum(1).tolist(), send.sum(1).tolist()
    received = dist_nn.all_to_all_single(rows.new_empty(sum(to_me), rows.shape[1]), rows, to_me, from_me)
    outs = []
    for block, (_src, le) in zip(received.split(recv.reshape(-1).tolist()), np.ndindex(world, LOCAL)):
        gate, up = (block @ w1[le]).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up) @ w2[le])
    return dist_nn.all_to_all_single(rows.new_empty(sum(from_me), rows.shape[1]), torch.cat(outs), from_me, to_me)


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    register_group("hcom_mindspeed_ep", None)
    grid = counts(world)
    saved = {}
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        g = torch.Generator().manual_seed(30 + rank)
        rows = torch.randn(int(grid[rank].sum()), HIDDEN, generator=g).to(dtype)
        gw = torch.Generator().manual_seed(40 + rank)
        w1 = (torch.randn(LOCAL, HIDDEN, 2 * FFN, generator=gw) / HIDDEN**0.5).to(dtype)
        w2 = (torch.randn(LOCAL, FFN, HIDDEN, generator=gw) / FFN**0.5).to(dtype)
        cotangent = torch.randn(rows.shape, generator=g)
        ours = [t.clone().requires_grad_() for t in (rows, w1, w2)]
        y = mindspeed_style(*ours, grid, rank, world, "hcom_mindspeed_ep")
        (y.float() * cotangent).sum().backward()
        ref = [t.float().clone().requires_grad_() for t in (rows, w1, w2)]
        want = reference(*ref, grid, rank, world)
        (want * cotangent).sum().backward()
        saved[f"{name}_dtypes_ok"] = y.dtype == dtype and all(t.grad.dtype == dtype for t in ours)
        for key, a, b in zip(("y", "dx", "dw1", "dw2"), [y] + [t.grad for t in ours], [want] + [t.grad for t in ref]):
            a, b = a.detach().float(), b.detach().float()
            saved[f"{name}_{key}"] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    np.savez(Path(out_dir) / f"rank{rank}.npz", **saved)
    dist.destroy_process_group()
