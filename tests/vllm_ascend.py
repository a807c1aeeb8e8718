"""vLLM-Ascend's unquantised fused-MoE path run unchanged on CPU gloo ranks
(tests/test_vllm_ascend_peers.py, ``-m peers``).

Their files are copied at test time into a temporary folder, never into this repository: from
a checkout named by ``$VLLM_ASCEND_<TAG>`` (``VLLM_ASCEND_V0_11_0``), else at the release tag of
the bare git mirror ``$VLLM_ASCEND_GIT`` (default :data:`DEFAULT_MIRROR`). Copied and run as they
are (:data:`RELEASES`):

* v0.11.0: ``vllm_ascend/ops/moe/``'s ``experts_selector.py`` (``select_experts``: softmax
  top-k through ``npu_moe_gating_top_k_softmax``), ``moe_comm_method.py`` (``AllGatherCommImpl``
  / ``AlltoAllCommImpl.fused_experts``: what ``AscendUnquantizedFusedMoEMethod.apply`` calls),
  ``token_dispatcher.py`` (``TokenDispatcherWithAllGather``: ``npu_moe_init_routing_v2`` with
  an active expert range, ``npu_moe_token_unpermute``; ``TokenDispatcherWithAll2AllV``:
  ``npu_moe_token_permute``, ``all_to_all_single`` with host-side splits, the permuted
  buffers freed by ``untyped_storage().resize_(0)``), ``comm_utils.py`` and ``moe_mlp.py``
  (``unquant_apply_mlp``: ``npu_grouped_matmul`` and ``npu_swiglu``);
* v0.9.1: ``vllm_ascend/ops/fused_moe.py``'s ``select_experts`` and the three unquantised
  paths ``AscendUnquantizedFusedMoEMethod.apply`` takes without MC2: ``fused_experts``
  (AllGather with an expert map: plain torch sorting, ``npu_grouped_matmul`` and ``npu_swiglu``),
  ``fused_experts_with_all2all`` (``npu_moe_init_routing``, ``npu_moe_compute_expert_tokens``,
  the group's ``all_to_all`` with host-side sizes, ``npu_moe_finalize_routing``) and
  ``fused_experts_with_all2allv`` with ``moe_dispatcher/token_dispatcher.py``'s
  ``MoEAlltoAllSeqOverLapDispatcher`` (``npu_moe_token_permute`` / ``npu_moe_token_unpermute``,
  its ``comm_utils.async_all_to_all`` and ``distributed/tensor_parallel.py``'s gather).

Their other imports are vLLM's engine (configuration, forward context, parallel state), not MoE
code, and are stubbed (:func:`install`): the expert-parallel group is torch's default gloo
group; ``torch.npu`` gives the CPU as its device. torch's CPU ``histc`` has no integer kernel
(the NPU's has), so an integer ``histc`` is counted in float32 and returned in the input's dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from tests.cann_recipes import Anything, _module, copy_sources
from tests.moe_chain import Config, dense_reference, global_weights, local_slice, rank_inputs, relative_error

DEFAULT_MIRROR = "/work/.mirror/vllm-project+vllm-ascend/repo"
#: release tag -> the files copied (repository path -> path under the copy's folder)
RELEASES = {
    "v0.11.0": [
        f"vllm_ascend/ops/moe/{name}.py"
        for name in (
            "experts_selector",
            "moe_comm_method",
            "token_dispatcher",
            "comm_utils",
            "moe_mlp",
            "fused_moe_prepare_and_finalize",
        )
    ]
    + ["vllm_ascend/ops/common_fused_moe.py"],
    "v0.13.0": [
        f"vllm_ascend/ops/fused_moe/{name}.py"
        for name in ("moe_comm_method", "token_dispatcher", "prepare_finalize", "moe_mlp", "comm_utils")
    ],
    "v0.9.1": [
        "vllm_ascend/ops/fused_moe.py",
        "vllm_ascend/ops/moe_dispatcher/token_dispatcher.py",
        "vllm_ascend/ops/comm_utils.py",
        "vllm_ascend/distributed/tensor_parallel.py",
    ],
}
#: the comm methods (v0.11.0) / fused_moe_state paths (v0.9.1) run, each against the dense MoE
CASES = {"v0.11.0": ("all_gather", "all_to_all_v"), "v0.9.1": ("all_gather", "all_to_all", "all_to_all_seq")}


def copy_release(dest: Path, tag: str) -> str:
    """Copy ``tag``'s files into ``dest`` (a folder put on ``sys.path`` by :func:`install`)."""
    env = "VLLM_ASCEND_" + tag.upper().replace(".", "_")
    return copy_sources(
        dest,
        {path: path for path in RELEASES[tag]},
        checkout_env=env,
        mirror_env="VLLM_ASCEND_GIT",
        default_mirror=DEFAULT_MIRROR,
        revision=tag,
        repository="vllm-project/vllm-ascend",
    )


# --- vLLM's engine, stubbed -----------------------------------------------------------------


#: the expert-parallel process group (None: torch's default group); the MC2 worker may set a
#: sub-group (expert parallelism over part of the world, each part a data-parallel replica)
EP_PROCESS_GROUP = None


class EpGroup:
    """vLLM's GroupCoordinator for the expert-parallel group (:data:`EP_PROCESS_GROUP`); its
    ``all_to_all`` is vLLM-Ascend's NPUCommunicator's (split ``scatter_sizes`` rows to each rank,
    concatenate what arrives) on dim 0, the only dim fused_moe.py exchanges."""

    def all_to_all(self, input_, scatter_dim=0, gather_dim=-1, scatter_sizes=None, gather_sizes=None):
        assert scatter_dim == 0 and gather_dim == 0 and scatter_sizes is not None, "only rows by sizes here"
        out = input_.new_empty((sum(gather_sizes), *input_.shape[1:]))
        dist.all_to_all_single(
            out, input_.contiguous(), list(gather_sizes), list(scatter_sizes), group=EP_PROCESS_GROUP
        )
        return out

    @property
    def device_group(self):
        return dist.group.WORLD if EP_PROCESS_GROUP is None else EP_PROCESS_GROUP

    @property
    def rank_in_group(self) -> int:
        return dist.get_rank(EP_PROCESS_GROUP)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(EP_PROCESS_GROUP)


#: what ``get_forward_context()`` returns; the harness sets ``moe_comm_method`` (and, for MC2,
#: ``mc2_mask`` / ``padded_num_tokens`` as set_ascend_forward_context does)
FORWARD_CONTEXT = SimpleNamespace(
    moe_comm_method=None,
    weight_prefetch_method=None,
    fused_moe_state=None,
    mc2_mask=None,
    padded_num_tokens=None,
    max_tokens_across_dp=None,
    sp_enabled=False,
    in_profile_run=False,
)


class AscendSocVersion(enum.Enum):
    """vllm_ascend.utils.AscendSocVersion: which chip the platform reports."""

    A2 = 0
    A3 = 1
    UNDEFINED = 2


class AscendDeviceType(enum.Enum):
    """vllm_ascend.utils.AscendDeviceType (v0.13.0's name for the SoC)."""

    A2 = 0
    A3 = 1
    _310P = 2


class FusedMoEState(enum.Enum):
    """vllm_ascend.ascend_forward_context.FusedMoEState (v0.9.1): the forward context's MoE path."""

    AllGather = 0
    All2All = 1
    MC2 = 2
    MC2_PREFILL = 3
    All2AllSeq = 4


#: what ``get_ascend_config()`` returns (the MC2 runs set the torchair graph mode)
ASCEND_CONFIG = SimpleNamespace(
    init_redundancy_expert=0,
    dynamic_eplb=False,
    multistream_overlap_gate=False,
    torchair_graph_config=SimpleNamespace(enabled=False),
)
#: the scheduler's ``max_num_seqs``: v0.13.0's dispatcher sizes ``global_bs`` from it (eager,
#: no speculative tokens: ``min(max_num_seqs, 512) * W``)
MAX_NUM_SEQS = 32

#: the platform vllm_ascend.utils reports: the SoC and HCCL's hierarchical communication
#: (``HCCL_INTRA_PCIE_ENABLE=1``, ``HCCL_INTRA_ROCE_ENABLE=0``); the MC2 runs set both
PLATFORM = SimpleNamespace(soc=AscendSocVersion.A2, hierarchical=False)


class HcclBackend:
    """torch_npu's ProcessGroupHCCL as vLLM-Ascend reads it (``group._get_backend(npu)``):
    ``get_hccl_comm_name(rank)`` is the name the MC2 ops take as ``group_ep``. Here the gloo
    group is registered under that name with :func:`moe_onnx.torch.collectives.register_group`."""

    def __init__(self, group) -> None:
        self.group = group

    def get_hccl_comm_name(self, rank: int) -> str:
        from moe_onnx.torch.collectives import register_group

        name = "hccl_" + "_".join(str(r) for r in dist.get_process_group_ranks(self.group))
        register_group(name, self.group)
        return name


def _npu_device() -> None:
    """What importing torch_npu does to torch, as far as vLLM-Ascend reads it: the ``npu``
    device name (torch's privateuse1 backend renamed) and an HCCL backend on each process
    group for that device (:class:`HcclBackend`). Only the MC2 worker installs it: torch then
    takes the renamed privateuse1 backend for its accelerator, which has no hooks on a CPU, so
    ``dist.barrier()`` raises there (that worker's barrier is an all-reduce)."""
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    get_backend = dist.ProcessGroup._get_backend
    if getattr(get_backend, "hccl_stand_in", False):
        return

    def _get_backend(group, device):
        return HcclBackend(group) if torch.device(device).type == "npu" else get_backend(group, device)

    _get_backend.hccl_stand_in = True  # type: ignore[attr-defined]
    dist.ProcessGroup._get_backend = _get_backend  # type: ignore[method-assign]


class QuantizeMethodBase:
    """vLLM's QuantizeMethodBase: ``process_weights_after_loading`` does nothing."""

    def process_weights_after_loading(self, layer) -> None:
        return None


class UnquantizedFusedMoEMethod(QuantizeMethodBase):
    """vLLM's UnquantizedFusedMoEMethod as far as the Ascend subclass reaches it: holds the
    MoE config; ``_maybe_pad_weight`` pads only under ROCm's ``VLLM_ROCM_MOE_PADDING``."""

    def __init__(self, moe=None) -> None:
        self.moe = moe

    def _maybe_pad_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return weight


def _integer_histc(histc):
    def run(input, bins=100, min=0, max=0, *, out=None):  # noqa: A002 - torch's argument names
        if input.dtype.is_floating_point or out is not None:
            return histc(input, bins=bins, min=min, max=max, out=out)
        return histc(input.float(), bins=bins, min=min, max=max).to(input.dtype)

    return run


def install(source_dir: Path) -> None:
    """The stubs in ``sys.modules``, the copied files importable, torch_npu's stand-in."""
    import moe_onnx.torch as mt

    mt.install_stand_ins()
    ep = EpGroup()
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3_moe"), max_model_len=4096),
        parallel_config=SimpleNamespace(enable_expert_parallel=True, tensor_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=8192),
        compilation_config=SimpleNamespace(cudagraph_capture_sizes=[]),
        speculative_config=None,
    )
    fused_moe = type("FusedMoE", (torch.nn.Module,), {})  # base classes of classes the tests do not build
    tp = {"get_tensor_model_parallel_world_size": lambda: 1, "get_tensor_model_parallel_rank": lambda: 0}
    modules = {
        "vllm": {},
        "vllm.distributed": {"get_ep_group": lambda: ep, "tensor_model_parallel_all_reduce": lambda t: t, **tp},
        "vllm.triton_utils": {"HAS_TRITON": False},
        "vllm_ascend.distributed.utils": {},
        "vllm.distributed.parallel_state": {
            "get_ep_group": lambda: ep,
            "get_dp_group": lambda: ep,
            "get_tp_group": lambda: SimpleNamespace(world_size=1, rank_in_group=0),
            **tp,
        },
        "vllm.forward_context": {"get_forward_context": lambda: FORWARD_CONTEXT},
        "vllm.config": {"get_current_vllm_config": lambda: config},
        "vllm.logger": {},
        "vllm.model_executor": {},
        "vllm.model_executor.layers": {},
        "vllm.model_executor.layers.fused_moe": {},
        "vllm.model_executor.layers.fused_moe.config": {},
        "vllm.model_executor.layers.fused_moe.layer": {
            "FusedMoE": fused_moe,
            "UnquantizedFusedMoEMethod": UnquantizedFusedMoEMethod,
        },
        "vllm.model_executor.layers.shared_fused_moe": {
            "SharedFusedMoE": type("SharedFusedMoE", (fused_moe,), {}),
        },
        "vllm.model_executor.layers.linear": {},
        "vllm.model_executor.layers.quantization": {},
        "vllm.model_executor.layers.quantization.base_config": {},
        "vllm.attention": {},
        "transformers": {},
        "vllm_ascend.envs": {"VLLM_ASCEND_MOE_ALL2ALL_BUFFER": False, "VLLM_ASCEND_ENABLE_DBO": False},
        "vllm_ascend.ascend_config": {"get_ascend_config": lambda: ASCEND_CONFIG},
        "vllm_ascend.ascend_forward_context": {"FusedMoEState": FusedMoEState},
        "vllm_ascend.distributed": {},
        "vllm_ascend.distributed.parallel_state": {"get_mc2_group": lambda: ep},
        "vllm_ascend.eplb": {},
        "vllm_ascend.eplb.core": {},
        "vllm_ascend.eplb.core.eplb_utils": {},
        "vllm_ascend.quantization": {},
        "vllm_ascend.quantization.w8a8_dynamic": {},
        "vllm_ascend.ops.expert_load_balancer": {},
        "vllm_ascend.ops.sequence_parallel": {},
        "vllm_ascend.utils": {
            "AscendSocVersion": AscendSocVersion,
            "ACL_FORMAT_FRACTAL_NZ": 29,
            "is_310p": lambda: False,
            "is_enable_nz": lambda *args, **kwargs: True,
            "enable_sp": lambda *args, **kwargs: False,
            "is_hierarchical_communication_enabled": lambda: PLATFORM.hierarchical,
            "get_ascend_soc_version": lambda: PLATFORM.soc,
            "AscendDeviceType": AscendDeviceType,
            "get_ascend_device_type": lambda: AscendDeviceType[PLATFORM.soc.name],
            "get_weight_prefetch_method": lambda: None,
            "prefill_context_parallel_enable": lambda: False,
            "dispose_tensor": lambda t: t.set_(),
            "npu_stream_switch": lambda *args, **kwargs: _null(),
            "npu_wait_tensor": lambda t, *args, **kwargs: t,
            "get_fused_moe_state": lambda *args, **kwargs: None,
        },
    }
    for name, names in modules.items():
        path = source_dir / name.replace(".", "/")
        if not (path.is_dir() or path.with_suffix(".py").is_file()):  # a copied module stays itself
            sys.modules[name] = _module(name, **names)
    torch.npu = SimpleNamespace(  # type: ignore[attr-defined]  # the device, its streams and events
        current_device=lambda: "cpu",
        synchronize=lambda: None,
        Stream=lambda *args, **kwargs: Anything(),
        current_stream=lambda *args, **kwargs: Anything(),
        stream=lambda *args, **kwargs: _null(),
        Event=lambda *args, **kwargs: Anything(),
    )
    torch.Tensor.npu = lambda self, *args, **kwargs: self  # type: ignore[attr-defined]
    torch.histc = _integer_histc(torch.histc)
    sys.path.insert(0, str(source_dir))


def _null():
    import contextlib

    return contextlib.nullcontext()


# --- the runs ---------------------------------------------------------------------------------


def gate_weight(config: Config, seed: int = 5) -> torch.Tensor:
    return torch.randn(config.experts, config.hidden, generator=torch.Generator().manual_seed(seed))


def softmax_routing(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference routing: softmax, the top k (ties to the lower expert), renormalised."""
    scores = torch.softmax(logits.float(), -1)
    ids = torch.sort(-scores, dim=-1, stable=True).indices[:, :top_k]
    weight = scores.gather(1, ids)
    return ids, weight / weight.sum(-1, keepdim=True)


def local_weights(config: Config, rank: int, weights: dict, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's w13 [L, H, 2F], w2 [L, F, H] as process_weights_after_loading leaves them
    (transposed, contiguous, cast to FRACTAL_NZ)."""
    import torch_npu

    local = local_slice(config, rank)
    w13 = weights["w13"][local].to(dtype).transpose(1, 2).contiguous()
    w2 = weights["w2"][local].to(dtype).transpose(1, 2).contiguous()
    return torch_npu.npu_format_cast(w13, 29), torch_npu.npu_format_cast(w2, 29)


def expert_map(config: Config, rank: int) -> torch.Tensor:
    """vLLM's expert_map: global expert -> local index on this rank, -1 elsewhere."""
    out = torch.full((config.experts,), -1, dtype=torch.int32)
    out[local_slice(config, rank)] = torch.arange(config.local_experts, dtype=torch.int32)
    return out


#: the seed of the tokens (the MC2 worker gives each expert-parallel group its own)
INPUT_SEED = 1


def all_tokens(config: Config, tokens: int) -> list[torch.Tensor]:
    """Every (expert-parallel) rank's tokens at this batch (rank r has ``tokens + r``)."""
    return [rank_inputs(config, r, tokens + r, seed=INPUT_SEED)[0] for r in range(config.ranks)]


def run_v011(case: str, config: Config, rank: int, tokens: int, dtype, weights: dict, gate) -> torch.Tensor:
    """``select_experts`` then ``<Comm>.fused_experts`` as AscendUnquantizedFusedMoEMethod.apply
    calls them; returns (y, want) in float32. AllGather: the comm method's prepare gathers every
    rank's tokens and its finalize sums the ranks' partial outputs; the harness does both with
    torch's collectives (they are not MoE code)."""
    from vllm_ascend.ops.moe.experts_selector import select_experts
    from vllm_ascend.ops.moe.moe_comm_method import AllGatherCommImpl, AlltoAllCommImpl

    moe = SimpleNamespace(experts_per_token=config.top_k, num_experts=config.experts)
    moe.num_local_experts = config.local_experts
    comm = (AllGatherCommImpl if case == "all_gather" else AlltoAllCommImpl)(moe)
    FORWARD_CONTEXT.moe_comm_method = comm
    xs = all_tokens(config, tokens)
    x = torch.cat(xs) if case == "all_gather" else xs[rank]
    x = x.to(dtype)
    logits = x.float() @ gate.T
    topk_weights, topk_ids = select_experts(
        hidden_states=x,
        router_logits=logits,
        top_k=config.top_k,
        use_grouped_topk=False,
        renormalize=True,
        global_num_experts=config.experts,
    )
    topk_weights = topk_weights.to(x.dtype)
    w13, w2 = local_weights(config, rank, weights, dtype)
    y = comm.fused_experts(
        hidden_states=x,
        w1=w13,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        global_num_experts=config.experts,
        expert_map=expert_map(config, rank),
        shared_experts=None,
        apply_router_weight_on_input=False,
        dynamic_eplb=False,
    )
    return _against_dense(case, y, x, logits, config, weights)


def run_v091(case: str, config: Config, rank: int, tokens: int, dtype, weights: dict, gate) -> torch.Tensor:
    """``select_experts`` then the path ``AscendUnquantizedFusedMoEMethod.apply`` takes for
    the case's fused_moe_state, with its arguments; returns (y, want) in float32. The weights
    stay as loaded ([L, 2F, H], [L, H, F]: v0.9.1 transposes them in each call). AllGather:
    the harness gathers the tokens and sums the ranks' outputs (the layer's own collectives)."""
    from vllm_ascend.ops.fused_moe import (
        fused_experts,
        fused_experts_with_all2all,
        fused_experts_with_all2allv,
        select_experts,
    )
    from vllm_ascend.ops.moe_dispatcher.token_dispatcher import MoEAlltoAllSeqOverLapDispatcher, MoEDispatcherConfig

    xs = all_tokens(config, tokens)
    x = (torch.cat(xs) if case == "all_gather" else xs[rank]).to(dtype)
    logits = x.float() @ gate.T
    topk_weights, topk_ids = select_experts(
        hidden_states=x, router_logits=logits, top_k=config.top_k, use_grouped_topk=False, renormalize=True
    )
    topk_weights = topk_weights.to(x.dtype)
    local = local_slice(config, rank)
    w13, w2 = weights["w13"][local].to(dtype), weights["w2"][local].to(dtype)
    experts = expert_map(config, rank)
    if case == "all_gather":
        y, *_ = fused_experts(x, w13, w2, topk_weights, topk_ids, config.top_k, expert_map=experts)
    elif case == "all_to_all":
        y, *_ = fused_experts_with_all2all(
            x, w13, w2, topk_weights, topk_ids, config.top_k, expert_map=experts, ep_group=EpGroup()
        )
    else:
        settings = MoEDispatcherConfig().set_num_moe_experts(config.experts).set_num_local_experts(config.local_experts)
        settings = settings.set_moe_router_topk(config.top_k).set_group_topk(None).set_num_groups(None)
        dispatcher = MoEAlltoAllSeqOverLapDispatcher(settings.set_expert_bias(None).set_scaling_factor(1.0).build())
        y, *_ = fused_experts_with_all2allv(dispatcher, topk_weights, topk_ids, x, w13, w2)
    return _against_dense(case, y, x, logits, config, weights)


def _against_dense(case: str, y, x, logits, config: Config, weights: dict):
    """(y, want) in float32: y checked to keep x's dtype and shape; AllGather's partial outputs
    summed over the ranks (the comm method's finalize); want the dense MoE on the reference
    routing of the same logits."""
    assert y.dtype == x.dtype and y.shape == x.shape, (y.dtype, y.shape, x.shape)
    y = y.float()
    if case == "all_gather":
        dist.all_reduce(y)
    ids, weight = softmax_routing(logits, config.top_k)
    return y, dense_reference(x, ids, weight, weights, with_shared=False)


RUNS = {"v0.11.0": run_v011, "v0.9.1": run_v091}


# --- the MC2 paths (v0.11.0: TokenDispatcherWithMC2; v0.9.1: fused_experts_with_mc2) -----------


@dataclasses.dataclass(frozen=True)
class Mc2Case:
    """The platform an MC2 run reports: the SoC, whether torch_npu has the V2 names (the
    dispatcher checks hasattr), HCCL's hierarchical communication (v0.11.0) and the torchair
    graph mode (v0.9.1). What the dispatcher then passes (checked by the test from the calls
    recorded): A3, or torchair on v0.9.1, adds ``group_tp`` / ``tp_world_size=1`` /
    ``tp_rank_id=0`` (and the combine's ``tp_send_counts``); A3 with V2 adds ``x_active_mask``
    (the forward context's ``mc2_mask``: the padded tokens masked); hierarchical communication
    adds the dispatch's ``expert_scales``."""

    soc: AscendSocVersion
    v2: bool
    hierarchical: bool = False
    torchair: bool = False


A2, A3 = AscendSocVersion.A2, AscendSocVersion.A3
#: release tag -> the MC2 runs: name -> case
MC2_CASES = {
    "v0.11.0": {
        "a2_v2": Mc2Case(A2, True),
        "a2_v1_expert_scales": Mc2Case(A2, False, hierarchical=True),
        "a3_v2_masked": Mc2Case(A3, True),
        "a3_v1": Mc2Case(A3, False),
        "a3_v2_masked_expert_scales": Mc2Case(A3, True, hierarchical=True),
    },
    "v0.13.0": {
        "a2_v2": Mc2Case(A2, True),
        "a2_v1_expert_scales": Mc2Case(A2, False, hierarchical=True),
        "a3_v2": Mc2Case(A3, True),
        "a3_v1": Mc2Case(A3, False),
        "a3_v2_expert_scales": Mc2Case(A3, True, hierarchical=True),
    },
    "v0.9.1": {
        "a2_v2": Mc2Case(A2, True),
        "a2_v1": Mc2Case(A2, False),
        "a2_v2_torchair": Mc2Case(A2, True, torchair=True),
        "a3_v2_masked": Mc2Case(A3, True),
        "a3_v1": Mc2Case(A3, False),
    },
}


class SharedExpert(torch.nn.Module):
    """The model's shared expert as vLLM builds it (DeepseekV2MLP / Qwen2MoeMLP): the
    dispatcher calls ``gate_up_proj`` and ``down_proj`` (vLLM's parallel linears, tp 1:
    ``(x @ W.T, None)``) and ``act_fn`` (SiluAndMul: silu of the first half times the second)."""

    def __init__(self, weights: dict, dtype) -> None:
        super().__init__()
        self.gate_up = weights["shared_gate_up"].to(dtype)  # [2F, H]
        self.down = weights["shared_down"].to(dtype)  # [H, F]

    def gate_up_proj(self, x: torch.Tensor):
        return x @ self.gate_up.T, None

    def act_fn(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def down_proj(self, h: torch.Tensor):
        return h @ self.down.T, None


class _Layer(torch.nn.Module):
    """The FusedMoE layer's weights as ``create_weights`` makes them for this rank's experts:
    w13_weight [L, 2F, H], w2_weight [L, H, F]."""

    def __init__(self, config: Config, rank: int, weights: dict, dtype) -> None:
        super().__init__()
        local = local_slice(config, rank)
        self.w13_weight = torch.nn.Parameter(weights["w13"][local].to(dtype).clone(), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(weights["w2"][local].to(dtype).clone(), requires_grad=False)


@contextlib.contextmanager
def _platform(case: Mc2Case):
    """The case's platform while the block runs; torch_npu without the V2 names for a V1 case
    (an older torch_npu)."""
    import torch_npu

    PLATFORM.soc, PLATFORM.hierarchical = case.soc, case.hierarchical
    ASCEND_CONFIG.torchair_graph_config.enabled = case.torchair
    hidden = {} if case.v2 else {n: torch_npu.__dict__.pop(n) for n in ("npu_moe_distribute_dispatch_v2",)}
    try:
        yield
    finally:
        torch_npu.__dict__.update(hidden)


#: the MC2 calls of the current run: (torch_npu name, its keyword names, whether an
#: ``x_active_mask`` it got masks a token, its ``global_bs``, its ``group_ep``), recorded by
#: :func:`_record_mc2_calls`
MC2_CALLS: list[tuple[str, list[str], bool, int, str]] = []
MC2_NAMES = (
    "npu_moe_distribute_dispatch",
    "npu_moe_distribute_dispatch_v2",
    "npu_moe_distribute_combine",
    "npu_moe_distribute_combine_v2",
)


def _record_mc2_calls() -> None:
    """Wrap torch_npu's MC2 names so that each call's name and keywords are recorded in
    :data:`MC2_CALLS` (the test checks the dispatcher's call pattern); the call goes on as is."""
    import torch_npu

    def recorded(name, function):
        def call(*args, **kwargs):
            mask = kwargs.get("x_active_mask")
            masks = mask is not None and not bool(mask.all())
            MC2_CALLS.append((name, sorted(kwargs), masks, int(kwargs.get("global_bs", -1)), kwargs.get("group_ep")))
            return function(*args, **kwargs)

        return call

    for name in MC2_NAMES:
        setattr(torch_npu, name, recorded(name, getattr(torch_npu, name)))


def _pad_forward_context(config: Config, rank: int, tokens: int, dtype):
    """This rank's tokens x [T, H] and the forward context as set_ascend_forward_context sets
    it for MC2 (tp 1): every rank padded to the largest batch (``padded_num_tokens``,
    ``max_tokens_across_dp``), ``mc2_mask`` true on the real tokens."""
    xs = all_tokens(config, tokens)
    x = xs[rank].to(dtype)
    padded = max(len(t) for t in xs)
    FORWARD_CONTEXT.padded_num_tokens = FORWARD_CONTEXT.max_tokens_across_dp = padded
    FORWARD_CONTEXT.mc2_mask = torch.arange(padded) < len(x)
    return x


def run_mc2_v011(case: str, shared: bool, config: Config, rank: int, tokens: int, dtype, weights: dict, gate):
    """One MoE layer forward on MC2 as AscendFusedMoE.forward_impl runs it: MC2CommImpl built
    as setup_moe_comm_method builds it, its ``prepare`` (pads to ``padded_num_tokens``, returns
    the ``mc2_mask``), ``AscendUnquantizedFusedMoEMethod.apply`` (after its
    ``process_weights_after_loading``), the ``finalize`` (unpads). With ``shared``, the shared
    expert goes in as ``shared_experts`` and the dispatcher returns (routed, shared), added as
    vLLM-Ascend's callers add them. Returns (y, want) in float32, want the dense MoE."""
    from vllm_ascend.ops.common_fused_moe import AscendUnquantizedFusedMoEMethod
    from vllm_ascend.ops.moe.moe_comm_method import MC2CommImpl

    moe = SimpleNamespace(experts_per_token=config.top_k, num_experts=config.experts)
    moe.num_local_experts = config.local_experts
    with _platform(MC2_CASES["v0.11.0"][case]):
        comm = MC2CommImpl(moe)
        method = AscendUnquantizedFusedMoEMethod(moe)
        layer = _Layer(config, rank, weights, dtype)
        method.process_weights_after_loading(layer)
        x = _pad_forward_context(config, rank, tokens, dtype)
        FORWARD_CONTEXT.moe_comm_method = comm
        logits = x.float() @ gate.T
        hidden_states, router_logits = comm.prepare(hidden_states=x, router_logits=logits)
        out = method.apply(
            layer=layer,
            x=hidden_states,
            use_grouped_topk=False,
            top_k=config.top_k,
            router_logits=router_logits,
            renormalize=True,
            global_num_experts=config.experts,
            expert_map=expert_map(config, rank),
            shared_experts=SharedExpert(weights, dtype) if shared else None,
        )
    if shared:
        routed, shared_out = out
        out = routed + shared_out
    y = comm.finalize(hidden_states=out, reduce_results=True)
    assert y.dtype == x.dtype and y.shape == x.shape, (y.dtype, y.shape, x.shape)
    ids, weight = softmax_routing(logits, config.top_k)
    return y.float(), dense_reference(x, ids, weight, weights, with_shared=shared)


def run_mc2_v091(case: str, shared: bool, config: Config, rank: int, tokens: int, dtype, weights: dict, gate):
    """One MoE layer forward on MC2 as AscendFusedMoE.forward runs it: x and the logits padded
    to ``padded_num_tokens``, ``AscendUnquantizedFusedMoEMethod.apply`` with the forward
    context's ``fused_moe_state`` MC2 and its ``mc2_mask`` (-> fused_experts_with_mc2, global_bs
    = max_tokens_across_dp x W), its tuple unpacked, the padding cut. With ``shared`` (the
    torchair multistream form) the shared expert goes in as ``shared_experts`` with
    ``hidden_states_for_share`` and its output is added. The weights stay as loaded.
    Returns (y, want) in float32."""
    from vllm_ascend.ops.fused_moe import AscendUnquantizedFusedMoEMethod

    with _platform(MC2_CASES["v0.9.1"][case]):
        method = AscendUnquantizedFusedMoEMethod(None)
        layer = _Layer(config, rank, weights, dtype)
        method.process_weights_after_loading(layer)
        x = _pad_forward_context(config, rank, tokens, dtype)
        FORWARD_CONTEXT.fused_moe_state = FusedMoEState.MC2
        logits = x.float() @ gate.T
        padded = FORWARD_CONTEXT.padded_num_tokens - len(x)
        hidden_states = torch.nn.functional.pad(x, (0, 0, 0, padded))
        out = method.apply(
            layer=layer,
            x=hidden_states,
            router_logits=torch.nn.functional.pad(logits, (0, 0, 0, padded)),
            top_k=config.top_k,
            renormalize=True,
            global_num_experts=config.experts,
            expert_map=expert_map(config, rank),
            shared_experts=SharedExpert(weights, dtype) if shared else None,
            hidden_states_for_share=hidden_states,
            mc2_mask=FORWARD_CONTEXT.mc2_mask,
        )
    if shared:
        routed, shared_out, _, _ = out
        y = routed + shared_out
    else:
        y, _, _ = out
    y = y[: len(x)]
    assert y.dtype == x.dtype and y.shape == x.shape, (y.dtype, y.shape, x.shape)
    ids, weight = softmax_routing(logits, config.top_k)
    return y.float(), dense_reference(x, ids, weight, weights, with_shared=shared)


def run_mc2_v013(case: str, shared: bool, config: Config, rank: int, tokens: int, dtype, weights: dict, gate):
    """MC2CommImpl (v0.13.0) as the layer runs it: ``prepare`` (pads to ``padded_num_tokens``),
    ``fused_experts`` (TokenDispatcherWithMC2 with ``global_bs`` sized from the scheduler, their
    unquantised MLP, the combine) with the weights as process_weights_after_loading leaves
    them, ``finalize``. The routing is the test's softmax top-k: v0.13.0's select_experts
    calls vLLM-Ascend's own kernel (``torch.ops._C_ascend.moe_gating_top_k``), which no
    stand-in provides; the shared experts moved out of the dispatcher into the layer, so
    ``shared`` is not run here. Returns (y, want) in float32."""
    from vllm_ascend.ops.fused_moe.moe_comm_method import MC2CommImpl

    assert not shared, "v0.13.0's dispatcher takes no shared experts"
    moe = SimpleNamespace(experts_per_token=config.top_k, num_experts=config.experts, global_redundant_expert_num=0)
    moe.num_local_experts = config.local_experts
    with _platform(MC2_CASES["v0.13.0"][case]):
        comm = MC2CommImpl(moe)
        x = _pad_forward_context(config, rank, tokens, dtype)
        FORWARD_CONTEXT.moe_comm_method = comm
        logits = x.float() @ gate.T
        hidden_states, router_logits, mc2_mask, context = comm.prepare(hidden_states=x, router_logits=logits)
        ids, weight = softmax_routing(router_logits, config.top_k)
        w13, w2 = local_weights(config, rank, weights, dtype)
        result = comm.fused_experts(
            hidden_states=hidden_states,
            w1=w13,
            w2=w2,
            topk_weights=weight.to(dtype),
            topk_ids=ids.to(torch.int32),
            expert_map=expert_map(config, rank),
            mc2_mask=mc2_mask,
        )
    y = comm.finalize(hidden_states=result.routed_out, reduce_results=True, context_metadata=context)
    assert y.dtype == x.dtype and y.shape == x.shape, (y.dtype, y.shape, x.shape)
    ids, weight = softmax_routing(logits, config.top_k)
    return y.float(), dense_reference(x, ids, weight, weights, with_shared=False)


MC2_RUNS = {"v0.11.0": run_mc2_v011, "v0.13.0": run_mc2_v013, "v0.9.1": run_mc2_v091}


def mc2_worker(
    rank: int,
    world: int,
    init_file: str,
    config: Config,
    source_dir: str,
    tag: str,
    out_dir: str,
    cases: list,
    ep_groups: list[list[int]] | None = None,
) -> None:
    """Each (case, shared) of ``cases`` at every batch, float32 and bfloat16; the relative
    errors vs the dense MoE (keys ``{case}_{shared|routed}_{dtype}_{tokens}``; the seconds the
    whole took as ``seconds``), the MC2 calls each made (``calls{rank}.json``, same keys), or
    the first error a case raised, saved. ``ep_groups`` (the world's ranks split into
    expert-parallel groups of ``config.ranks`` each) runs each group as its own replica, with
    its own tokens; default: the world is the one group."""
    import time

    global EP_PROCESS_GROUP, INPUT_SEED
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    for index, members in enumerate(ep_groups or []):
        group = dist.new_group(members)  # every rank makes every group, in the same order
        if rank in members:
            EP_PROCESS_GROUP, INPUT_SEED = group, 2 + index
    ep_rank = dist.get_rank(EP_PROCESS_GROUP)
    assert dist.get_world_size(EP_PROCESS_GROUP) == config.ranks, (ep_groups, config.ranks)
    install(Path(source_dir))
    _npu_device()
    _record_mc2_calls()
    weights, gate = global_weights(config), gate_weight(config)
    errors, failures, calls = {}, {}, {}
    start = time.perf_counter()
    for case, shared in cases:
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{case}_{'shared' if shared else 'routed'}_{str(dtype).split('.')[-1]}"
            for tokens in config.batches:
                try:
                    MC2_CALLS.clear()
                    y, want = MC2_RUNS[tag](case, shared, config, ep_rank, tokens, dtype, weights, gate)
                    errors[f"{name}_{tokens}"] = relative_error(y, want)
                    calls[f"{name}_{tokens}"] = list(MC2_CALLS)
                except Exception as err:  # noqa: BLE001 - what trips is the finding, reported by the test
                    failures[f"{name}_{tokens}"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"
                    break
    errors["seconds"] = time.perf_counter() - start
    (Path(out_dir) / f"calls{rank}.json").write_text(json.dumps(calls))
    np.savez(Path(out_dir) / f"errors{rank}.npz", **errors)
    (Path(out_dir) / f"failures{rank}.txt").write_text("\n\n".join(f"{k}: {v}" for k, v in failures.items()))
    dist.all_reduce(torch.zeros(1))  # a barrier: dist.barrier asks torch for the accelerator
    dist.destroy_process_group()


def worker(rank: int, world: int, init_file: str, config: Config, source_dir: str, tag: str, out_dir: str) -> None:
    """Every case of ``tag`` at every batch, float32 and bfloat16; the relative errors vs the
    dense MoE, or the first error a case raised, saved."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    install(Path(source_dir))
    weights, gate = global_weights(config), gate_weight(config)
    errors, failures = {}, {}
    for case in CASES[tag]:
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).split(".")[-1]
            for tokens in config.batches:
                key = f"{case}_{name}_{tokens}"
                try:
                    y, want = RUNS[tag](case, config, rank, tokens, dtype, weights, gate)
                    errors[key] = relative_error(y, want)
                except Exception as err:  # noqa: BLE001 - what trips is the finding, reported by the test
                    failures[key] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"
                    break
    np.savez(Path(out_dir) / f"errors{rank}.npz", **errors)
    (Path(out_dir) / f"failures{rank}.txt").write_text("\n\n".join(f"{k}: {v}" for k, v in failures.items()))
    dist.barrier()
    dist.destroy_process_group()
