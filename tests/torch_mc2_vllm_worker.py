"""One gloo rank for test_torch_mc2_vllm: torch_npu's MC2 names called with exactly the
arguments vLLM-Ascend's MC2 dispatchers pass on each platform (v0.11.0 ``TokenDispatcherWithMC2``,
v0.13.0's, v0.9.1 ``fused_experts_with_mc2``; written here from what they pass, not copied),
inside the unquantised fused MoE they serve, against a dense torch MoE.

The call pattern (v0.11.0 ``get_dispatch_mc2_kwargs`` / ``get_combine_mc_kwargs``): ``global_bs=0``
(every rank padded to the same batch by the forward context), ``expert_shard_type=0``,
``shared_expert_rank_num=0``, ``expert_token_nums_type=0`` (cumulative counts, fed to the
grouped matmuls as ``group_list_type=0``), ``scales=None``, ``quant_mode=0``; A3 adds
``group_tp`` (the same name as ``group_ep``), ``tp_world_size=1``, ``tp_rank_id=0`` and the
combine's ``tp_send_counts`` (the dispatch's ``tp_recv_counts``); A3 with the V2 names adds
``x_active_mask`` (the padded tail masked); HCCL's hierarchical communication adds the
dispatch's ``expert_scales`` (the routing weights as float32). The combine gets the routing
weights as float32 ``expert_scales``, the dispatch's ``ep_recv_counts`` as ``ep_send_counts``
(V1: with its zero reserve when ``expert_scales`` was given) and ``expand_scales``; V1 its
``expand_idx``, V2 its ``assist_info_for_combine``. A shared expert (when there is one) runs
on the unpadded tokens beside the exchange and is added to the combine's output. v0.13.0
passes ``global_bs`` = the scheduler's capacity x W (here :data:`CAPACITY`) and no mask; v0.9.1
passes ``global_bs`` = the padded batch x W, no ``expert_token_nums_type`` (the default 1:
counts, fed as ``group_list_type=1``) and no ``expand_scales``. One case beyond vLLM: the
capacity ``global_bs`` with every rank's own batch, unpadded (``BS_r`` differing).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import moe_onnx.torch as mt
from moe_onnx.torch import collectives

E_PER_RANK, K, H, F = 2, 3, 16, 12
#: tokens of rank 0; rank r has ``BATCH + r`` real tokens, padded to the largest
BATCH = 5
#: v0.13.0's global_bs per rank (the scheduler's max_num_seqs, at most 512)
CAPACITY = 32


@dataclasses.dataclass(frozen=True)
class Case:
    """A dispatcher's call pattern: the platform (A3, the V2 names, hierarchical communication:
    expert_scales on the dispatch) and the release's form (``global_bs``, counts, mask)."""

    a3: bool
    v2: bool
    hierarchical: bool = False
    release: str = "v0.11.0"
    padded: bool = True

    @property
    def masked(self) -> bool:
        """Whether the dispatcher passes x_active_mask (v0.9.1 / v0.11.0 on A3 with V2)."""
        return self.a3 and self.v2 and self.release != "v0.13.0"


CASES = {
    "a2_v2": Case(False, True),
    "a2_v1_expert_scales": Case(False, False, True),
    "a3_v2_masked": Case(True, True),
    "a3_v1": Case(True, False),
    "a3_v2_masked_expert_scales": Case(True, True, True),
    "v013_a3_v2_capacity": Case(True, True, True, release="v0.13.0"),
    "v013_a2_v1_capacity": Case(False, False, release="v0.13.0"),
    "v091_a3_v2_masked": Case(True, True, release="v0.9.1"),
    "v091_a2_v1": Case(False, False, release="v0.9.1"),
    "capacity_unpadded_v2": Case(True, True, release="v0.13.0", padded=False),
    "capacity_unpadded_v1": Case(False, False, release="v0.13.0", padded=False),
}
GROUP = "hccl_world"


def weights(experts: int):
    """w13 [E, H, 2F] and w2 [E, F, H] (the layout after process_weights_after_loading), the
    shared expert's gate_up [H, 2F] and down [F, H]; float32, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return {
        "w13": torch.randn(experts, H, 2 * F, generator=g) / H**0.5,
        "w2": torch.randn(experts, F, H, generator=g) / F**0.5,
        "shared_gate_up": torch.randn(H, 2 * F, generator=g) / H**0.5,
        "shared_down": torch.randn(F, H, generator=g) / F**0.5,
    }


def tokens(rank: int, experts: int):
    """This rank's real tokens x [T, H] float32, routing weights [T, K] (softmax top-k,
    renormalised) and ids [T, K] int32; ``T = BATCH + rank``."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(BATCH + rank, H, generator=g)
    weight, ids = torch.topk(torch.softmax(torch.randn(BATCH + rank, experts, generator=g), -1), K)
    return x, weight / weight.sum(-1, keepdim=True), ids.to(torch.int32)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def dense_moe(x, weight, ids, w: dict, shared: bool) -> torch.Tensor:
    """y[t] = sum_j weight[t, j] * expert_{ids[t, j]}(x[t]) (+ the shared expert), float32."""
    x = x.float()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            y[t] += weight[t, j].float() * (swiglu(x[t] @ w["w13"][e]) @ w["w2"][e])
    return y + swiglu(x @ w["shared_gate_up"]) @ w["shared_down"] if shared else y


def mc2_layer(name: str, x, weight, ids, w: dict, rank: int, world: int, padded: int, shared: bool):
    """The fused MoE on MC2 with the dispatcher's arguments for ``case``; x [T, H] in its dtype
    is padded to ``padded`` tokens with rows of ones routed to the first K experts at weight
    1/K (vLLM pads with zero rows; ones tell a masked row, which must come back 0, from a row
    the experts computed). Returns (y [T, H], the padded rows' output [padded - T, H])."""
    case = CASES[name]
    a3, v2 = case.a3, case.v2
    dtype, experts, real = x.dtype, len(w["w13"]), x.shape[0]
    padded = padded if case.padded else real
    pad_ids = torch.arange(K, dtype=torch.int32).expand(padded - real, K)
    ids = torch.cat([ids, pad_ids])
    weight = torch.cat([weight, torch.full((padded - real, K), 1.0 / K)]).to(dtype)  # select_experts' dtype
    xp = torch.cat([x, x.new_ones(padded - real, H)])
    mask = torch.arange(padded) < real
    common = {"group_ep": GROUP, "ep_world_size": world, "ep_rank_id": rank}
    global_bs = {"v0.11.0": 0, "v0.9.1": padded * world, "v0.13.0": CAPACITY * world}[case.release]
    common |= {"expert_shard_type": 0, "shared_expert_rank_num": 0, "moe_expert_num": experts, "global_bs": global_bs}
    tp = {"group_tp": GROUP, "tp_world_size": 1, "tp_rank_id": 0} if a3 else {}
    masked = {"x_active_mask": mask} if case.masked else {}
    scales = {"expert_scales": weight.to(torch.float32)} if case.hierarchical else {}
    counts = {} if case.release == "v0.9.1" else {"expert_token_nums_type": 0}
    dispatch = mt.npu_moe_distribute_dispatch_v2 if v2 else mt.npu_moe_distribute_dispatch
    outs = dispatch(x=xp, expert_ids=ids, scales=None, quant_mode=0, **counts, **common, **tp, **masked, **scales)
    expand_x, _, assist, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = outs[:7]
    mine = slice(rank * E_PER_RANK, (rank + 1) * E_PER_RANK)
    w13, w2 = w["w13"][mine].to(dtype), w["w2"][mine].to(dtype)
    group_list_type = 1 if case.release == "v0.9.1" else 0  # the dispatch's expert_token_nums_type
    gmm = {"split_item": 2, "group_list_type": group_list_type, "group_type": 0, "group_list": expert_token_nums}
    (h,) = mt.npu_grouped_matmul(x=[expand_x], weight=[w13], **gmm)
    (h,) = mt.npu_grouped_matmul(x=[mt.npu_swiglu(h)], weight=[w2], **gmm)
    index = {"assist_info_for_combine": assist} if v2 else {"expand_idx": assist}
    tp_counts = {"tp_send_counts": tp_recv_counts} if a3 else {}
    combine = mt.npu_moe_distribute_combine_v2 if v2 else mt.npu_moe_distribute_combine
    expand = {} if case.release == "v0.9.1" else {"expand_scales": expand_scales}
    y = combine(
        expand_x=h,
        expert_ids=ids,
        expert_scales=weight.to(torch.float32),
        ep_send_counts=ep_recv_counts,
        **expand,
        **common,
        **index,
        **tp,
        **tp_counts,
        **masked,
    )
    assert y.dtype == dtype and y.shape == (padded, H), (y.dtype, y.shape)
    if shared:  # the shared expert beside the exchange, on the real tokens
        return y[:real] + swiglu(x @ w["shared_gate_up"].to(dtype)) @ w["shared_down"].to(dtype), y[real:]
    return y[:real], y[real:]


def worker(rank: int, world: int, init_file: str, out_dir: str, cases: list) -> None:
    """Each case with and without the shared expert, float32 and bfloat16; saves y, the dense
    MoE, the padded rows' output and their dense MoE under
    ``{case}_{shared|routed}_{dtype}_{y|dense|pad|pad_dense}``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    collectives.register_group(GROUP, dist.group.WORLD)
    experts = E_PER_RANK * world
    w = weights(experts)
    x, weight, ids = tokens(rank, experts)
    padded = BATCH + world - 1
    saved = {}
    for case in cases:
        for shared in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                key = f"{case}_{'shared' if shared else 'routed'}_{str(dtype).split('.')[-1]}"
                y, pad = mc2_layer(case, x.to(dtype), weight, ids, w, rank, world, padded, shared)
                saved[f"{key}_y"], saved[f"{key}_pad"] = y.float().numpy(), pad.float().numpy()
                saved[f"{key}_dense"] = dense_moe(x.to(dtype), weight, ids, w, shared).numpy()
                rows = len(pad)
                pad_ids = torch.arange(K, dtype=torch.int32).expand(rows, K)
                pad_weight = torch.full((rows, K), 1.0 / K)
                saved[f"{key}_pad_dense"] = dense_moe(torch.ones(rows, H), pad_weight, pad_ids, w, False).numpy()
    np.savez(Path(out_dir) / f"rank{rank}.npz", **saved)
    dist.barrier()
    dist.destroy_process_group()
