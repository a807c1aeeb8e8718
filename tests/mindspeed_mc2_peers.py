"""MindSpeed's mc2 expert path (``moe_feature/mc2moe``) run unchanged on gloo ranks
(tests/test_mindspeed_mc2_peers.py, ``-m peers``).

Copied at test time into a temporary folder, never into this repository, from a checkout
named by ``$MINDSPEED``, else from the bare git mirror ``$MINDSPEED_GIT`` (default
:data:`DEFAULT_MIRROR`) at ``HEAD`` (:data:`FILES`), and run as they are:

* ``mindspeed/core/transformer/moe/moe_feature/mc2moe/mc2_fuse_a2a.py``: ``AlltoallvPermuteGmm``
  (FC1: ``npu_alltoallv_gmm`` with ``permute_out_flag=True``; backward ``npu_gmm_alltoallv``
  with W rearranged ``n h f -> n f h`` and the lists swapped, dW by ``npu_grouped_matmul``
  ``group_type=2``) and ``GmmUnpermuteAlltoallv`` (FC2: ``npu_gmm_alltoallv``; backward
  ``npu_alltoallv_gmm``), the only MindSpeed code that calls the MC2 grouped matmuls;
* ``mindspeed/core/fusions/fused_bias_swiglu.py``: ``fused_swiglu`` (``npu_swiglu``), the
  activation ``GmmExpertsMC2Impl`` sets for a gated MLP;
* ``mindspeed/core/transformer/moe/comm_utils.py``: ``AsyncAllToAllWithBackward``, with which
  ``MoEAlltoAllMC2TokenDispatcher.token_permutation`` sends the permuted probabilities.

The rest of ``GmmExpertsMC2Impl.forward`` / ``MoEAlltoAllMC2TokenDispatcher`` is Megatron
core_v0.12.1's dispatcher (MindSpeed's HEAD targets that release; ``moe_feature/__init__``
imports names, e.g. ``grouped_gemm_util`` and ``GroupedMLP``, that the installed megatron-core
0.19 no longer has), so :func:`mc2_moe` follows those lines itself: the counts by
``routing_map.sum(0)`` and an ``all_to_all_single``, Megatron's own ``permute`` / ``unpermute``
(megatron-core's ``moe_utils``, imported unchanged), the probabilities exchanged and sorted by
local expert, the two Functions called with ``experts.py``'s exact arguments.

Stubbed (plumbing only, no arithmetic): ``torch.cuda.current_device()`` (where
``AsyncAllToAllWithBackward`` allocates: the CPU), ``torch.device("npu")`` (torch_npu renames the
privateuse1 backend, :func:`install` does the same) and ``ProcessGroup._get_backend(npu)``,
whose ``get_hccl_comm_name(rank)`` returns a name registered for the group with
:func:`moe_onnx.torch.collectives.register_group` (on the device: the HCCL communicator's).
``einops`` must be installed (MindSpeed's backward calls ``rearrange``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.cann_recipes import copy_sources

DEFAULT_MIRROR = "/work/.mirror/Ascend+MindSpeed/repo"
FILES = {
    path: path
    for path in (
        "mindspeed/core/transformer/moe/moe_feature/mc2moe/mc2_fuse_a2a.py",
        "mindspeed/core/fusions/fused_bias_swiglu.py",
        "mindspeed/core/transformer/moe/comm_utils.py",
    )
}


def copy_mindspeed_mc2(dest: Path) -> str:
    """Copy :data:`FILES` under ``dest``; returns where they came from."""
    return copy_sources(
        dest,
        FILES,
        checkout_env="MINDSPEED",
        mirror_env="MINDSPEED_GIT",
        default_mirror=DEFAULT_MIRROR,
        repository="Ascend/MindSpeed",
    )


def install(source_dir: Path) -> None:
    """torch_npu's stand-in, the ``npu`` device name, the HCCL name of a process group, and
    the copied files importable. Call before ``init_process_group``."""
    import moe_onnx.torch as mt
    from moe_onnx.torch.collectives import register_group

    mt.install_stand_ins()
    torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # the device is the CPU
    plain_get_backend = dist.ProcessGroup._get_backend
    registered: dict[str, object] = {}

    def get_backend(group, device):
        """On ``npu``: an object whose ``get_hccl_comm_name(rank)`` names ``group``."""
        if torch.device(device).type != "npu":
            return plain_get_backend(group, device)
        name = "hccl_" + "_".join(str(r) for r in dist.get_process_group_ranks(group))
        if name not in registered:
            register_group(name, group)
            registered[name] = group
        return SimpleNamespace(get_hccl_comm_name=lambda rank: name)

    dist.ProcessGroup._get_backend = get_backend  # type: ignore[method-assign]
    sys.path.insert(0, str(source_dir))


def expert_counts(routing_map: torch.Tensor, group) -> tuple[list[int], list[int]]:
    """MoEAlltoAllMC2TokenDispatcher.preprocess: send_counts[e] = rows this rank routes to
    global expert e (= dst * E_l + le); recv_counts[src * E_l + le] by an all_to_all_single of
    those (one count per expert each way)."""
    send = routing_map.sum(dim=0).long()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return send.tolist(), recv.tolist()


def exchange_probs(permuted_probs, send_counts, recv_counts, group):
    """MoEAlltoAllMC2TokenDispatcher.token_permutation for the probabilities: MindSpeed's
    ``AsyncAllToAllWithBackward`` by rank (output / input splits: the rows from / to each EP
    rank), then Megatron's chunks [src, le] re-sorted to [le, src]
    (``sort_input_by_local_experts``), as written there."""
    from mindspeed.core.transformer.moe.comm_utils import AsyncAllToAllWithBackward

    world = dist.get_world_size(group)
    send = torch.tensor(send_counts).reshape(world, -1)
    recv = torch.tensor(recv_counts).reshape(world, -1)
    output_splits, input_splits = recv.sum(1).tolist(), send.sum(1).tolist()
    _, global_probs, handle = AsyncAllToAllWithBackward.apply(permuted_probs, output_splits, input_splits, group)
    handle.wait()
    local = recv.shape[1]
    sort_input_by_local_experts = torch.arange(world * local).reshape(world, local).T.ravel()
    global_probs = torch.split(global_probs, recv.ravel().tolist(), dim=0)
    return torch.cat([global_probs[i] for i in sort_input_by_local_experts.tolist()], dim=0)


def mc2_moe(x, probs, routing_map, w1, w2, group):
    """One MoE layer on MindSpeed's mc2 path, as AlltoAllMC2MoeLayer runs it after the router:
    x [T, H], probs [T, E] (zero off the top-k), routing_map [T, E] bool, this rank's experts
    w1 [E_l, H, 2F] and w2 [E_l, F, H] -> [T, H]. ``group``: the expert-parallel group."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute
    from mindspeed.core.fusions.fused_bias_swiglu import fused_swiglu
    from mindspeed.core.transformer.moe.moe_feature.mc2moe.mc2_fuse_a2a import (
        AlltoallvPermuteGmm,
        GmmUnpermuteAlltoallv,
    )

    world = dist.get_world_size(group)
    send_counts, recv_counts = expert_counts(routing_map, group)
    tokens_per_expert = torch.tensor(recv_counts).reshape(world, -1).sum(0)
    permuted, permuted_probs, mapping, *_ = permute(x, routing_map, probs=probs, num_out_tokens=int(routing_map.sum()))
    global_probs = exchange_probs(permuted_probs, send_counts, recv_counts, group)
    # GmmExpertsMC2Impl.forward, its arguments as written there
    mm1_out, _ = AlltoallvPermuteGmm.apply(
        permuted, w1, group, tokens_per_expert, None, None, None, send_counts, recv_counts
    )
    intermediate = (fused_swiglu(mm1_out) * global_probs.unsqueeze(-1)).to(mm1_out.dtype)  # activation_func_with_probs
    up_out, _ = GmmUnpermuteAlltoallv.apply(
        intermediate, w2, group, tokens_per_expert, None, None, None, send_counts, recv_counts
    )
    return unpermute(up_out, mapping, restore_shape=x.shape, routing_map=routing_map)
