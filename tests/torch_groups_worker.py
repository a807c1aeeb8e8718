"""One gloo rank of 4 for test_torch_groups: collectives on process groups smaller than the
world. DeepSpeed-style expert parallelism with ep_size 2 (EP groups [0, 1], [2, 3]), the
expert-tensor-parallel gather of megatron-core after the EP all-to-all (ETP groups [0, 2],
[1, 3]), and vLLM-Ascend's MC2 path with group_ep naming a registered EP group; eager values,
then each rank's export."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.distributed.nn.functional as dist_nn

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch import collectives
from tests.torch_mc2_worker import BS, E, dense_moe, mc2_moe, tokens, weights

EP_SIZE = 2


def new_groups(world: int, layout: list[list[int]]):
    """Every rank makes every group (torch.distributed.new_group is collective); this rank's."""
    made = [dist.new_group(ranks) for ranks in layout]
    return next(g for g, ranks in zip(made, layout) if dist.get_rank() in ranks)


class GroupAllToAll(torch.autograd.Function):
    """DeepSpeed's ``_AllToAll``: an equal-split ``dist.all_to_all_single`` on the EP group."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return None, GroupAllToAll.apply(ctx.group, grad)


class ExpertParallelExchange(torch.nn.Module):
    """Megatron-style ragged token exchange inside an EP group, then the ETP gather of what
    arrived; DeepSpeed-style equal-capacity exchange inside the same EP group."""

    def __init__(self, ep_group, etp_group):
        super().__init__()
        self.ep_group, self.etp_group = ep_group, etp_group

    def forward(self, x, counts):
        size = dist.get_world_size(self.ep_group)
        gathered = fc.all_gather_tensor(counts, 0, self.ep_group).view(size, size)  # [src, dst] in the group
        send = counts.tolist()
        recv = gathered[:, dist.get_rank(self.ep_group)].tolist()
        received = fc.all_to_all_single(x, recv, send, self.ep_group)
        shared = fc.all_gather_tensor(received * 1, 0, self.etp_group)
        capacity = GroupAllToAll.apply(self.ep_group, x[: 2 * size] * 2)
        return received + 0, shared, capacity


class Mc2Layer(torch.nn.Module):
    """vLLM-Ascend's MC2 path on this rank's EP group (global_bs = 0: T dynamic)."""

    def __init__(self, group_rank, name, w13, w2):
        super().__init__()
        self.group_rank, self.name = group_rank, name
        self.w13, self.w2 = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)

    def forward(self, x, topk_weights, ids):
        args = (x, topk_weights, ids, self.w13, self.w2, self.group_rank, EP_SIZE)
        return mc2_moe(*args, group=self.name, global_bs=0)


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    out = Path(out_dir)
    saved: dict = {}
    ep_layout = [list(range(s, s + EP_SIZE)) for s in range(0, world, EP_SIZE)]  # DeepSpeed: consecutive ranks
    etp_layout = [list(range(s, world, EP_SIZE)) for s in range(EP_SIZE)]
    ep_group, etp_group = new_groups(world, ep_layout), new_groups(world, etp_layout)
    ep_ranks, etp_ranks = collectives.ranks_of(ep_group), collectives.ranks_of(etp_group)
    g = torch.Generator().manual_seed(rank)

    # the cann.moe collectives on a group, eager, against torch.distributed's own
    counts = torch.tensor([1 + rank % 2, 2 + rank], dtype=torch.int64)
    data = torch.randn(int(counts.sum()), 3, generator=g)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=ep_group)
    want = torch.empty(int(recv_counts.sum()), 3)
    dist.all_to_all_single(want, data, recv_counts.tolist(), counts.tolist(), group=ep_group)
    got, got_counts = mt.all_to_all(data, counts, group_ranks=ep_ranks)
    saved["a2a_equal"] = bool(torch.equal(got, want) and torch.equal(got_counts, recv_counts))
    x = torch.randn(2, 3, generator=g)
    gathered = [torch.empty(2, 3) for _ in etp_ranks]
    dist.all_gather(gathered, x, group=etp_group)
    saved["gather_equal"] = bool(torch.equal(mt.all_gather(x, group_ranks=etp_ranks), torch.stack(gathered)))

    # gradients through the group collectives, against torch.distributed.nn's
    # (torch.distributed.nn's all_gather backward fails on a sub-group in torch 2.13: its
    # scatter names the group's rank as a global one; the gradient written out instead)
    ours = x.clone().requires_grad_()
    weight = torch.randn(len(etp_ranks), 2, 3, generator=torch.Generator().manual_seed(10 + rank))
    (mt.all_gather(ours, group_ranks=etp_ranks) * weight).sum().backward()
    weights_ = [torch.empty_like(weight) for _ in etp_ranks]
    dist.all_gather(weights_, weight, group=etp_group)  # x_r reached y[r] of every member m
    expected = sum(w[etp_ranks.index(rank)] for w in weights_)
    saved["gather_grad_error"] = float((ours.grad - expected).abs().max())
    rows, ref_rows = data.clone().requires_grad_(), data.clone().requires_grad_()
    received, _ = mt.all_to_all(rows, counts, group_ranks=ep_ranks)
    ref_received = dist_nn.all_to_all_single(
        torch.empty(want.shape), ref_rows, recv_counts.tolist(), counts.tolist(), group=ep_group
    )
    cotangent = torch.randn(received.shape, generator=g)
    (received * cotangent).sum().backward()
    (ref_received * cotangent).sum().backward()
    saved["a2a_grad_equal"] = bool(torch.equal(rows.grad, ref_rows.grad))

    # ranks no process group has, and a rank outside its group: refused by name
    for name, ranks in (
        ("unmade", [0, 3] if rank in (0, 3) else [1, 2]),
        ("outside", [r for r in range(world) if r != rank][:2]),
    ):
        try:
            mt.all_gather(x, group_ranks=ranks)
            saved[f"{name}_error"] = "no error"
        except moe_onnx.MoeOpError as err:
            saved[f"{name}_error"] = str(err)

    # torch.distributed's collectives on the groups, eager and exported (dynamic rows)
    module = ExpertParallelExchange(ep_group, etp_group)
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(30 + rank))
    counts = torch.tensor([2 + rank % 2, 4 - rank % 2], dtype=torch.int64)  # every rank receives 6 rows
    for name, value in zip(("received", "shared", "capacity"), module(x, counts)):
        saved[f"torch_{name}"] = value.numpy()
    saved["torch_x"], saved["torch_counts"] = x.numpy(), counts.numpy()
    mt.export(module, (x, counts), out / f"exchange{rank}.onnx", dynamic_shapes=({0: torch.export.Dim("S")}, None))

    # vLLM-Ascend's MC2 path on the EP group: group_ep names the registered group
    name = f"hccl_ep{ep_ranks[0]}"
    collectives.register_group(name, ep_group)
    group_rank = ep_ranks.index(rank)
    for dtype, label in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        w13, w2 = weights(dtype)
        x, topk_weights, ids = tokens(rank, dtype)
        saved[f"{label}_mc2"] = (
            mc2_moe(x, topk_weights, ids, w13, w2, group_rank, EP_SIZE, group=name, global_bs=BS * EP_SIZE)
            .float()
            .numpy()
        )
        saved[f"{label}_dense"] = dense_moe(x, topk_weights, ids, w13, w2).numpy()
    layer = Mc2Layer(group_rank, name, *weights(torch.float32))
    x, topk_weights, ids = tokens(rank, torch.float32)
    saved["export_x"], saved["export_w"], saved["export_ids"] = x.numpy(), topk_weights.numpy(), ids.numpy()
    saved["export_eager"] = layer(x, topk_weights, ids).numpy()
    tokens_dim = torch.export.Dim("T", min=2, max=64)
    mt.export(layer, (x, topk_weights, ids), out / f"mc2_{rank}.onnx", dynamic_shapes=({0: tokens_dim},) * 3)
    assert E % EP_SIZE == 0
    np.savez(out / f"rank{rank}.npz", **saved)
    dist.barrier()
    dist.destroy_process_group()
