"""One gloo rank for test_torch_mc2: the torch_npu MC2 names with vLLM-Ascend's call pattern
(TokenDispatcherWithMC2 + an unquantised fused MoE: dispatch, grouped matmul by
expert_token_nums, SwiGLU, grouped matmul, combine) against a dense torch MoE; V1 with a
shared expert rank; a named group; a bad input on one rank."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch import collectives
from moe_onnx.torch.arrays import to_numpy

E, K, H, F, BS = 8, 2, 16, 12, 5

#: the MC2 names, each output checked to be an ordinary torch allocation (resizable storage, as
#: vLLM-Ascend frees its buffers with ``untyped_storage().resize_(0)``): name -> all resizable
MC2_NAMES = (
    "npu_moe_distribute_dispatch",
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_distribute_combine",
    "npu_moe_distribute_combine_v2",
    "npu_alltoallv_gmm",
    "npu_gmm_alltoallv",
)
RESIZABLE: dict[str, bool] = {}


def _checking_storage(name, function):
    def call(*args, **kwargs):
        result = function(*args, **kwargs)
        tensors = [t for t in (result if isinstance(result, (tuple, list)) else [result]) if torch.is_tensor(t)]
        RESIZABLE[name] = RESIZABLE.get(name, True) and all(t.untyped_storage().resizable() for t in tensors)
        return result

    return call


def weights(dtype):
    """The experts' weights, the same on every rank (each rank keeps its own experts' slice)."""
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, H, 2 * F, generator=g) / 4).to(dtype)
    w2 = (torch.randn(E, F, H, generator=g) / 4).to(dtype)
    return w13, w2


def tokens(rank, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BS, H, generator=g).to(dtype)
    logits = torch.randn(BS, E, generator=g)
    weights_, ids = torch.topk(torch.softmax(logits, -1), K)
    return x, weights_.float(), ids.to(torch.int32)


def dense_moe(x, topk_weights, ids, w13, w2):
    """The plain torch MoE every expert-parallel path must equal (float32 math)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            h = x[t].float() @ w13[e].float()
            gate, up = h[:F], h[F:]
            out[t] += topk_weights[t, j] * ((torch.nn.functional.silu(gate) * up) @ w2[e].float())
    return out


def mc2_moe(x, topk_weights, ids, w13, w2, rank, world, mask=None, group="hccl_ep", global_bs=None):
    """vLLM-Ascend's MC2 path as released: dispatch_v2, GMM by expert_token_nums (counts,
    group_list_type 1), SwiGLU, GMM, combine_v2 with the routing weights."""
    local = E // world
    expand_x, _, assist, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = (
        mt.npu_moe_distribute_dispatch_v2(
            x,
            ids,
            group_ep=group,
            ep_world_size=world,
            ep_rank_id=rank,
            moe_expert_num=E,
            x_active_mask=mask,
            group_tp=group,
            tp_world_size=1,
            tp_rank_id=0,
            global_bs=BS * world if global_bs is None else global_bs,
            expert_token_nums_type=1,
            expert_scales=topk_weights,
        )
    )
    mine = slice(rank * local, (rank + 1) * local)
    (h,) = mt.npu_grouped_matmul(
        [expand_x], [w13[mine]], group_list=expert_token_nums, split_item=2, group_type=0, group_list_type=1
    )
    h = mt.npu_swiglu(h)
    (y,) = mt.npu_grouped_matmul(
        [h], [w2[mine]], group_list=expert_token_nums, split_item=2, group_type=0, group_list_type=1
    )
    return mt.npu_moe_distribute_combine_v2(
        expand_x=y,
        expert_ids=ids,
        assist_info_for_combine=assist,
        ep_send_counts=ep_recv_counts,
        expert_scales=topk_weights,
        group_ep=group,
        ep_world_size=world,
        ep_rank_id=rank,
        moe_expert_num=E,
        tp_send_counts=tp_recv_counts,
        x_active_mask=mask,
        group_tp=group,
        tp_world_size=1,
        tp_rank_id=0,
        global_bs=BS * world if global_bs is None else global_bs,
        expand_scales=expand_scales,
    )


def gmm_counts(world: int, experts: int):
    """C[src, dst, le]: rows rank src sends to local expert le of rank dst (seeded, the same
    on every rank; rank 0 sends nothing to rank 1)."""
    grid = torch.randint(0, 4, (world, world, experts), generator=torch.Generator().manual_seed(7))
    grid[0, 1] = 0
    return grid


def reference_fc(x, w1, w2, grid, rank, world):
    """Megatron-style pure torch: all_to_all_single, an expert-major permute by index, one
    matmul per expert, GELU, the second matmul, the inverse permute, all_to_all back."""
    import torch.distributed.nn.functional as dist_nn

    experts = w1.shape[0]
    send, recv = grid[rank], grid[:, rank]  # [dst, le], [src, le]
    received = dist_nn.all_to_all_single(
        torch.empty(int(recv.sum()), x.shape[1]), x, recv.sum(1).tolist(), send.sum(1).tolist()
    )
    starts = (recv.reshape(-1).cumsum(0) - recv.reshape(-1)).reshape(recv.shape)
    order = torch.cat(
        [torch.arange(int(starts[i, e]), int(starts[i, e] + recv[i, e])) for e in range(experts) for i in range(world)]
        + [torch.zeros(0, dtype=torch.int64)]
    )
    rows = received[order]
    sizes = recv.sum(0).tolist()
    h = torch.cat([torch.nn.functional.gelu(part @ w1[e]) @ w2[e] for e, part in enumerate(rows.split(sizes))])
    back = torch.empty_like(h).index_copy(0, order, h)
    return dist_nn.all_to_all_single(
        torch.empty(x.shape[0], h.shape[1]), back, send.sum(1).tolist(), recv.sum(1).tolist()
    )


def mindspeed_fc(x, w1, w2, grid, rank, world):
    """MindSpeed's mc2 dispatcher: npu_alltoallv_gmm (FC1), GELU, npu_gmm_alltoallv (FC2)."""
    send, recv = grid[rank].reshape(-1).tolist(), grid[:, rank].reshape(-1).tolist()
    h, _, _ = mt.npu_alltoallv_gmm(x, w1, "hcom_ep", world, send, recv, permute_out_flag=True)
    y, _ = mt.npu_gmm_alltoallv(torch.nn.functional.gelu(h), w2, "hcom_ep", world, recv, send)
    return y


def gmm_step(rank: int, world: int, saved: dict) -> None:
    """One training step of FC1 / FC2 both ways: values and gradients."""
    experts, hidden, ffn = 2, 8, 6
    grid = gmm_counts(world, experts)
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(int(grid[rank].sum()), hidden, generator=g)
    gw = torch.Generator().manual_seed(60)
    w1, w2 = torch.randn(experts, hidden, ffn, generator=gw), torch.randn(experts, ffn, hidden, generator=gw)
    cotangent = torch.randn(x.shape, generator=g)
    results = []
    for fc in (mindspeed_fc, reference_fc):
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        y = fc(*leaves, grid, rank, world)
        (y * cotangent).sum().backward()
        results.append([y.detach()] + [t.grad for t in leaves])
    for name, ours, ref in zip(("y", "dx", "dw1", "dw2"), *results):
        saved[f"gmm_{name}_error"] = float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class Mc2Layer(torch.nn.Module):
    """vLLM-Ascend's MC2 path as a module, for the per-rank export (global_bs = 0: T is dynamic)."""

    def __init__(self, rank, world, w13, w2):
        super().__init__()
        self.rank, self.world = rank, world
        self.w13, self.w2 = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)

    def forward(self, x, topk_weights, ids):
        args = (x, topk_weights, ids, self.w13, self.w2, self.rank, self.world)
        return mc2_moe(*args, global_bs=0)


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    for name in MC2_NAMES:  # in this rank's process only
        setattr(mt, name, _checking_storage(name, getattr(mt, name)))
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    out = Path(out_dir)
    saved: dict = {}
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        w13, w2 = weights(dtype)
        x, topk_weights, ids = tokens(rank, dtype)
        saved[f"{name}_mc2"] = mc2_moe(x, topk_weights, ids, w13, w2, rank, world).float().numpy()
        saved[f"{name}_dense"] = dense_moe(x, topk_weights, ids, w13, w2).numpy()
    # a masked token (vLLM's mc2_mask: the padded tail), float32
    w13, w2 = weights(torch.float32)
    x, topk_weights, ids = tokens(rank, torch.float32)
    mask = torch.arange(BS) < BS - 1 - rank
    saved["masked_mc2"] = mc2_moe(x, topk_weights, ids, w13, w2, rank, world, mask=mask).numpy()
    saved["masked_dense"] = dense_moe(x, topk_weights, ids, w13, w2).numpy() * mask[:, None].numpy()
    # a group registered by name: the same values
    collectives.register_group("named_ep", dist.new_group(list(range(world))))
    saved["named_mc2"] = mc2_moe(x, topk_weights, ids, w13, w2, rank, world, group="named_ep").numpy()

    gmm_step(rank, world, saved)

    # the layer exported per rank with a dynamic token count
    layer = Mc2Layer(rank, world, *weights(torch.float32))
    saved["export_x"], saved["export_w"], saved["export_ids"] = x.numpy(), topk_weights.numpy(), ids.numpy()
    saved["export_eager"] = layer(x, topk_weights, ids).numpy()
    tokens_dim = torch.export.Dim("T", min=2, max=64)
    mt.export(layer, (x, topk_weights, ids), out / f"layer{rank}.onnx", dynamic_shapes=({0: tokens_dim},) * 3)

    # V1 with a shared expert on rank 0 (S = 1): identity experts, so x comes back as
    # sum_k w_k * x (+ x once for the shared expert; the MoE slots only on ranks >= 1)
    experts_v1 = E // (world - 1) * (world - 1)
    ids_v1 = torch.topk(torch.randn(BS, experts_v1, generator=torch.Generator().manual_seed(rank)), K)[1].to(
        torch.int32
    )
    outs = mt.npu_moe_distribute_dispatch(
        x, ids_v1, "ep", world, rank, experts_v1, shared_expert_rank_num=1, expert_scales=topk_weights
    )
    expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = outs
    for i, value in enumerate(outs):
        saved[f"v1_out{i}"] = to_numpy(value)
    saved["v1_x"], saved["v1_ids"], saved["v1_weights"] = x.numpy(), ids_v1.numpy(), topk_weights.numpy()
    back = mt.npu_moe_distribute_combine(
        expand_x,
        ids_v1,
        expand_idx,
        ep_recv_counts,
        topk_weights,
        "ep",
        world,
        rank,
        experts_v1,
        shared_expert_rank_num=1,
        tp_send_counts=tp_recv_counts,
    )
    saved["v1_back"] = back.numpy()

    # a bad expert id on rank 1 only: every rank raises the same MoeOpError
    bad = ids.clone()
    if rank == 1:
        bad[0, 0] = E
    try:
        mt.npu_moe_distribute_dispatch_v2(x, bad, "ep", world, rank, E)
        saved["bad_input_error"] = "no error"
    except moe_onnx.MoeOpError as err:
        saved["bad_input_error"] = str(err)
    # a refusal by name, before any collective
    try:
        mt.npu_moe_distribute_combine(
            x, ids, ids.view(-1), ep_recv_counts, topk_weights, "ep", world, rank, E, shared_expert_x=x
        )
        saved["refusal"] = "no error"
    except moe_onnx.MoeOpError as err:
        saved["refusal"] = str(err)
    saved["resizable"] = np.array([RESIZABLE.get(name, False) for name in MC2_NAMES])
    np.savez(out / f"rank{rank}.npz", **saved)
    dist.barrier()
    dist.destroy_process_group()
