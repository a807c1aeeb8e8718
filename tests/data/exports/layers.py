"""The peers' MoE layers, built as their users build them, with the few patches listed here.

Everything not listed is the peer's code, unchanged. The collectives they call are replaced by
``moe_onnx.torch``'s ``all_to_all`` / ``all_gather`` (P1, P2, F1, D1), which run gloo eagerly and
export as ``cann.moe::AllToAll`` / ``AllGather`` with both exporters; the other patches only let
CPU torch and the legacy exporter run the layer, and none changes what it computes (README.md).

megatron-core 0.19.2, ``MoELayer`` + ``MoEAlltoAllTokenDispatcher`` (``get_moe_module_spec(use_te=False)``):
  P1 ``token_dispatcher.all_to_all`` -> ``mt.all_to_all(x, input_split_sizes)[0]``
  P2 ``token_dispatcher.gather_from_sequence_parallel_region`` -> ``mt.all_gather(x).reshape(-1, ...)``
  P3 ``Router.gating`` without its first lines (they move CPU weights to ``torch.cuda.current_device()``)
  P4 ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` preset (its ``__init__`` creates a ``torch.cuda.Stream()``)
  P5 ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` -> identity (CUDA stream work only; on
     CPU ``maybe_move_tensor_to_cpu`` is a no-op, so the split sizes stay tensors as the peer leaves them);
     ``host_splits=True`` instead: its device-to-host copies as on a GPU (the split sizes become numpy
     arrays at ``cuda_dtoh_point``, ``as_numpy=True`` as the peer asks), without the CUDA stream
  P6 ``Column/RowParallelLinear.get_extra_state`` -> ``nn.Module``'s (their ``None`` breaks the legacy
     exporter's state-dict walk)
  P7 ``TopKRouter._apply_expert_bias`` -> its undecorated function (``torch.compile``d; jit.trace refuses it)
fairscale 0.4.13, ``MOELayer`` + ``Top2Gate``:
  F1 ``moe_layer._AllToAll`` -> a Function calling ``mt.all_to_all(x, [E/N]*N)``
  F2 ``top2gate.gumbel_rsample`` -> zeros (the 2nd expert is sampled with Gumbel noise)
DeepSpeed 0.19.8 (``DS_BUILD_OPS=0``), ``MOELayer`` + ``TopKGate(k)`` + ``Experts`` (sparse path):
  D1 ``sharded_moe._AllToAll`` -> the same Function as F1
  D2 (``drop_tokens=False`` only) ``dist.all_reduce(capacity, MAX)`` -> ``capacity.copy_(mt.all_gather(capacity).amax(0))``
  (no noise by configuration: ``top2_2nd_expert_sampling=False``, ``use_rts=False``; ``drop_tokens=True``:
  C = max(ceil(T*k/E), min_capacity); ``drop_tokens=False``: C = the largest expert count of any rank)
torchtitan 0.3.0, ``MoE`` + ``AllToAllTokenDispatcher`` (its functional ``all_to_all_single``, unchanged):
  T1 ``GroupedExperts.forward`` in float32: without its ``bfloat16()`` casts (onnxruntime's CPU
     kernels have no bfloat16 MatMul / Sigmoid, and ``torch._grouped_mm``'s meta kernel refuses float32)
  T2 ``GroupedExperts._grouped_mm`` (torchtitan's own override seam) -> each row times its expert's
     weight (``index_select`` of the weights by row, ``bmm``): the dynamo exporter has no
     translation of ``_grouped_mm`` with offsets
  T3 (``pad_multiple``: its ``TorchAOTokenDispatcher``) torchao's ``generate_permute_indices`` (a triton
     kernel; its CPU fallback loops over ``.item()``s) -> the same indices in torch ops
     (``padded_permute_indices``), checked equal to the fallback on every eager call
  and, for the export only, two translations (``torchtitan_translations``); the chunk sort
  (``_permute``: ``repeat_interleave`` + ``x[idx]``) and its restore (``index_put``) are torchtitan's

Sizes (the first corpus; the later exports vary L, K, T per rank, see ``make_exports.VARIANTS``):
hidden 16, ffn 32, 2 local experts per rank (E = 2N), top-2, float32; Megatron 12 tokens per rank
(``[12, 1, 16]``), fairscale / DeepSpeed 16 (``[16, 1, 16]``). Router / gate weights equal on every
rank (seed 1000); expert weights seeded by global expert id (2000 + id).
"""

from __future__ import annotations

import torch

import moe_onnx.torch as mt

HIDDEN, FFN, LOCAL_EXPERTS, TOPK = 16, 32, 2, 2
TOKENS = {"megatron": 12, "fairscale": 16, "deepspeed": 16}


def _seeded_(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _, p in sorted(params):
        p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class _EqualAllToAll(torch.autograd.Function):
    """F1 / D1: GShard's equal-split all-to-all of ``[E, C, M]`` as ``mt.all_to_all``."""

    @staticmethod
    def forward(ctx, group, input):
        world = torch.distributed.get_world_size()  # the EP group is the world here
        rows = input.shape[0]
        send_counts = torch.full((world,), rows // world, dtype=torch.int64)
        out = mt.all_to_all(input.contiguous(), send_counts)[0]
        if not torch.jit.is_tracing():  # torch.export: an equal split keeps the row count
            torch._check(out.shape[0] == rows)
        return out


class _MaxByAllGather:
    """D2: ``deepspeed.comm`` with ``all_reduce(t, MAX)`` done by ``mt.all_gather`` (an exportable collective)."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        assert op == self._comm.ReduceOp.MAX, op
        tensor.copy_(mt.all_gather(tensor).amax(0))


class Expert(torch.nn.Module):
    """fairscale / DeepSpeed expert: Linear - ReLU - Linear, no bias."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, FFN, bias=False)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


# ---------------------------------------------------------------- megatron-core
def megatron(
    rank: int,
    world: int,
    mode: str,
    local_experts: int = LOCAL_EXPERTS,
    topk: int = TOPK,
    host_splits: bool = False,
    extras: tuple[str, ...] = (),
) -> torch.nn.Module:
    """``hidden [T, 1, H] -> output [T, 1, H]``; mode ``dropless`` or ``droppad`` (capacity factor 1, padded).

    ``extras`` (issue 29): ``shared`` (a shared expert of FFN, ``moe_shared_expert_intermediate_size``),
    ``groups`` (group-limited routing: the experts in N groups, ``moe_router_num_groups`` = N, the
    top-K among the best ``moe_router_group_topk`` = 1 group), ``position`` (droppad's
    ``moe_token_drop_policy="position"``: the first tokens kept, not the most probable), ``two_layers``
    (two MoE layers one after the other, each its own router and experts)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import router as rt
    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron.core.transformer.transformer_config import TransformerConfig

    def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, use_nccl_stream=False):  # P1
        if input_split_sizes is None:  # an equal split
            input_split_sizes = torch.full((world,), input_.shape[0] // world, dtype=torch.int64)
        return mt.all_to_all(input_, torch.as_tensor(input_split_sizes, dtype=torch.int64))[0]

    def gather_from_sequence_parallel_region(  # P2
        input_, tensor_parallel_output_grad=True, group=None, output_split_sizes=None, use_global_buffer=False
    ):
        assert group is not None and group.size() == world and output_split_sizes is None
        return mt.all_gather(input_).reshape(-1, *input_.shape[1:])  # torch gathers along dim 0

    def gating(self, input):  # P3
        router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        return rt.router_gating_linear(input, self.weight, self.bias, router_dtype)

    td.all_to_all = all_to_all
    td.gather_from_sequence_parallel_region = gather_from_sequence_parallel_region
    rt.Router.gating = gating
    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no cuda stream on CPU"  # P4
    td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = lambda self, point, tpe=None: tpe  # P5
    if host_splits:

        def to_host(self, point, tokens_per_expert=None):  # P5, host_splits: as on a GPU, without the stream
            if not self.drop_and_pad and point == self.cuda_dtoh_point:
                for name in ("input_splits", "output_splits", "output_splits_tp"):
                    value = getattr(self, name)
                    if torch.is_tensor(value):
                        setattr(self, name, value.numpy())
            return tokens_per_expert

        td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = to_host
    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):  # P6
        cls.get_extra_state = torch.nn.Module.get_extra_state
    if hasattr(rt.TopKRouter._apply_expert_bias, "__wrapped__"):  # P7
        rt.TopKRouter._apply_expert_bias = rt.TopKRouter._apply_expert_bias.__wrapped__

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    experts = local_experts * world
    config = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN,
        num_attention_heads=4,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=world,
        use_cpu_initialization=True,
        add_bias_linear=False,
        moe_grouped_gemm=False,
        bf16=False,
        params_dtype=torch.float32,
    )
    if topk == 1:  # megatron-core refuses top-1 with the softmax after the top-k
        config.update(moe_router_pre_softmax=True)
    if mode == "droppad":
        config.update(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    if "shared" in extras:
        config.update(moe_shared_expert_intermediate_size=FFN)
    if "groups" in extras:
        config.update(moe_router_num_groups=world, moe_router_group_topk=1)
    if "position" in extras:
        config.update(moe_token_drop_policy="position")
    spec = get_moe_module_spec(use_te=False, num_experts=experts, moe_grouped_gemm=False)
    moe_layers = torch.nn.ModuleList()
    for index in range(2 if "two_layers" in extras else 1):
        layer = spec(config=TransformerConfig(**config), layer_number=index + 1)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1000 + 100 * index)
            layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=g))
            for i, expert in enumerate(layer.experts.local_experts):
                _seeded_(expert.named_parameters(), 2000 + 100 * index + rank * local_experts + i)
            if layer.shared_experts is not None:  # equal on every rank
                _seeded_(layer.shared_experts.named_parameters(), 3000 + 100 * index)
        moe_layers.append(layer)

    class Wrapper(torch.nn.Module):  # MoELayer returns (output, bias)
        def __init__(self):
            super().__init__()
            self.layers = moe_layers

        def forward(self, hidden):
            for layer in self.layers:
                hidden = layer(hidden)[0]
            return hidden

    return Wrapper().eval()


# ---------------------------------------------------------------- fairscale
def fairscale(rank: int, world: int, local_experts: int = LOCAL_EXPERTS) -> torch.nn.Module:
    """``input [S, 1, M] -> output [S, 1, M]``: ``MOELayer(Top2Gate(M, E), experts)``."""
    from fairscale.nn.moe import MOELayer, Top2Gate, moe_layer, top2gate

    moe_layer._AllToAll = _EqualAllToAll  # F1
    top2gate.gumbel_rsample = lambda shape, device: torch.zeros(shape, device=device)  # F2
    gate = Top2Gate(HIDDEN, local_experts * world)
    experts = torch.nn.ModuleList([Expert() for _ in range(local_experts)])
    with torch.no_grad():
        gate.wg.weight.copy_(torch.randn(gate.wg.weight.shape, generator=torch.Generator().manual_seed(1000)))
        for i, expert in enumerate(experts):
            _seeded_(expert.named_parameters(), 2000 + rank * local_experts + i)
    return MOELayer(gate, experts).eval()


# ---------------------------------------------------------------- DeepSpeed
def deepspeed(
    rank: int,
    world: int,
    local_experts: int = LOCAL_EXPERTS,
    k: int = TOPK,
    drop_tokens: bool = True,
    min_capacity: int = 1,
) -> torch.nn.Module:
    """``input [S, 1, M] -> output [S, 1, M]``: the layer ``deepspeed.moe.layer.MoE`` builds, EP group = world."""
    import deepspeed.comm
    import torch.distributed as dist
    from deepspeed.moe import sharded_moe
    from deepspeed.moe.experts import Experts
    from deepspeed.moe.sharded_moe import MOELayer, TopKGate

    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    sharded_moe._AllToAll = _EqualAllToAll  # D1
    if not drop_tokens:
        sharded_moe.dist = _MaxByAllGather(sharded_moe.dist)  # D2
    experts_total = local_experts * world
    gate = TopKGate(
        HIDDEN,
        experts_total,
        k=k,
        capacity_factor=1.0,
        eval_capacity_factor=1.0,
        min_capacity=min_capacity,
        drop_tokens=drop_tokens,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    experts = Experts(Expert(), local_experts, expert_group_name=f"ep_size_{world}")
    layer = MOELayer(gate, experts, f"ep_size_{world}", world, local_experts)
    layer._set_ep_group(dist.group.WORLD)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.randn(gate.wg.weight.shape, generator=torch.Generator().manual_seed(1000)))
        for i, expert in enumerate(experts.deepspeed_experts):
            _seeded_(expert.named_parameters(), 2000 + rank * local_experts + i)

    class Wrapper(torch.nn.Module):  # MOELayer.forward takes (input, used_token)
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x, None)

    return Wrapper().eval()


def deepspeed_public_moe(
    rank: int,
    world: int,
    local_experts: int = LOCAL_EXPERTS,
    k: int = TOPK,
    use_residual: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """``input [S, 1, M] -> output [S, 1, M]``: DeepSpeed's public ``deepspeed.moe.layer.MoE`` as its
    users build it (``drop_tokens=True``, ``use_rts=False``, ``top2_2nd_expert_sampling=False``),
    with its residual MLP and coefficient (``use_residual``), in ``dtype`` (the gate stays float32:
    ``TopKGate`` casts itself). EP group = world, set as ``MoE.set_deepspeed_parallelism`` would."""
    import deepspeed.comm
    import torch.distributed as dist
    from deepspeed.moe import sharded_moe
    from deepspeed.moe.layer import MoE

    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    sharded_moe._AllToAll = _EqualAllToAll  # D1
    layer = MoE(
        HIDDEN,
        Expert(),
        num_experts=local_experts * world,
        ep_size=world,
        k=k,
        min_capacity=1,
        use_residual=use_residual,
        drop_tokens=True,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    layer.deepspeed_moe._set_ep_group(dist.group.WORLD)
    with torch.no_grad():
        gate = layer.deepspeed_moe.gate
        gate.wg.weight.copy_(torch.randn(gate.wg.weight.shape, generator=torch.Generator().manual_seed(1000)))
        for i, expert in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
            _seeded_(expert.named_parameters(), 2000 + rank * local_experts + i)
        if use_residual:  # the dense MLP and its coefficient, equal on every rank
            _seeded_([(f"mlp.{n}", p) for n, p in layer.mlp.named_parameters()], 3000)
            _seeded_([(f"coefficient.{n}", p) for n, p in layer.coefficient.named_parameters()], 3001)
    layer = layer.to(dtype)
    layer.deepspeed_moe.gate.wg.float()  # as TopKGate.forward makes it on its first call

    class Wrapper(torch.nn.Module):  # MoE.forward returns (output, l_aux, exp_counts)
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x)[0]

    return Wrapper().eval()


# ---------------------------------------------------------------- torchtitan
def torchtitan(
    rank: int,
    world: int,
    local_experts: int = LOCAL_EXPERTS,
    topk: int = TOPK,
    score_func: str = "softmax",
    pad_multiple: int = 0,
) -> torch.nn.Module:
    """torchtitan's ``MoE`` (``torchtitan.models.common.moe``) with its ``AllToAllTokenDispatcher``:
    ``hidden [T, 1, H] -> output [T, 1, H]`` (torchtitan reads ``[B, S, H]``: here B = T, S = 1).

    Expert parallelism as ``RoutedExperts.parallelize`` sets it up, without a ``ParallelDims``:
    the rank's E/N experts' weights (plain tensors, not DTensor shards) and ``wire_meshes`` with a
    gloo ``DeviceMesh`` of the world; ``spmd_backend="partial_dtensor"`` (torchtitan's
    ``parallelism.spmd_backend``), so the dispatcher calls the functional ``all_to_all_single``
    (the one ``moe_onnx.torch.translation_table()`` translates). Patches T1, T2 (the module
    docstring); ``score_func`` ``"sigmoid"`` with ``route_norm`` (DeepSeek-V3's routing) or
    ``"softmax"``; no load-balancing bias, no shared experts. ``pad_multiple`` > 0: its
    ``TorchAOTokenDispatcher`` instead (torchao's ``permute_and_pad``: each local expert's rows
    padded to a multiple of ``pad_multiple``, the padding rows a zero row appended; patch T3)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed import utils as titan_utils
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher, TorchAOTokenDispatcher

    def experts_forward(self, x_RD, num_tokens_per_expert_E):  # T1: GroupedExperts.forward in float32
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=self.w1_EFD.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=self.w3_EFD.transpose(-2, -1), offs=offsets_E)
        return self._grouped_mm(A=h_RF, B_t=self.w2_EDF.transpose(-2, -1), offs=offsets_E).type_as(x_RD)

    def grouped_mm_by_rows(self, *, A, B_t, offs):  # T2: the _grouped_mm seam, each row by its expert's weight
        row = torch.arange(A.shape[0], device=A.device)
        expert = (row[:, None] >= offs[None, :].to(torch.int64)).sum(1).clamp(max=B_t.shape[0] - 1)
        return torch.bmm(A[:, None, :], torch.index_select(B_t, 0, expert)).squeeze(1)

    if pad_multiple:
        _torch_permute_indices()  # T3
    GroupedExperts.forward = experts_forward
    GroupedExperts._grouped_mm = grouped_mm_by_rows
    titan_utils.set_spmd_backend("partial_dtensor")
    experts = local_experts * world
    config = MoE.Config(
        num_experts=experts,
        load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=HIDDEN, hidden_dim=FFN, num_experts=local_experts),
            token_dispatcher=(
                TorchAOTokenDispatcher.Config(num_experts=experts, top_k=topk, pad_multiple=pad_multiple)
                if pad_multiple
                else AllToAllTokenDispatcher.Config(num_experts=experts, top_k=topk)
            ),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=experts,
            gate=Linear.Config(in_features=HIDDEN, out_features=experts),
            top_k=topk,
            score_func=score_func,  # type: ignore[arg-type]
            route_norm=score_func == "sigmoid",
        ),
    )
    layer = config.build()
    layer.routed_experts.token_dispatcher.wire_meshes(ep_mesh=init_device_mesh("cpu", (world,)))
    with torch.no_grad():
        gate = layer.router.gate.weight
        gate.copy_(torch.randn(gate.shape, generator=torch.Generator().manual_seed(1000)) * 0.3)
        grouped = layer.routed_experts.inner_experts
        for i in range(local_experts):  # expert i of this rank is global expert rank * L + i
            weights = [(name, getattr(grouped, name)[i]) for name in ("w1_EFD", "w2_EDF", "w3_EFD")]
            _seeded_(weights, 2000 + rank * local_experts + i)
    return layer.eval()


def padded_permute_indices(counts, experts_per_rank: int, ranks: int, max_len: int, alignment: int):
    """torchao's ``generate_permute_indices`` in torch ops (T3): ``counts [N*L]`` rank-major (rows
    received from rank r for local expert e at ``r * L + e``) -> ``(indices [max_len] int64 (torchao:
    int32, which the dynamo exporter writes into a GatherND, which takes int64 only),
    m_sizes [L] int32, m_offsets [L] int32)``: expert-major, each expert's rows (rank 0's first)
    then -1 up to a multiple of ``alignment`` (at least ``alignment``), -1 past the last expert."""
    counts_rl = counts.view(ranks, experts_per_rank)
    input_starts_lr = (counts.cumsum(0) - counts).view(ranks, experts_per_rank).t()
    total = counts_rl.sum(0)
    m_sizes = ((total.clamp_min(alignment) + alignment - 1) // alignment * alignment).to(torch.int32)
    m_offsets = m_sizes.cumsum(0)
    write_offsets = m_offsets - m_sizes
    position = torch.arange(max_len, device=counts.device)
    expert = (position[:, None] >= m_offsets[None, :]).sum(1)  # L past the last expert
    expert_c = expert.clamp(max=experts_per_rank - 1)
    within = position - write_offsets[expert_c]  # the row within its expert's group
    ends_lr = counts_rl.t().cumsum(1)  # [L, N]: where each rank's rows end within the expert
    rank = (within[:, None] >= ends_lr[expert_c]).sum(1)  # N: a padding row
    rank_c = rank.clamp(max=ranks - 1)
    begins = ends_lr[expert_c, rank_c] - counts_rl.t()[expert_c, rank_c]
    index = input_starts_lr[expert_c, rank_c] + within - begins
    index = torch.where((expert < experts_per_rank) & (rank < ranks), index, -1)
    return index, m_sizes, m_offsets.to(torch.int32)


def _torch_permute_indices() -> None:
    """T3: ``permute_and_pad``'s ``generate_permute_indices`` (a triton kernel; its CPU fallback
    loops over ``.item()``s, which torch.export cannot) -> :func:`padded_permute_indices`; run
    eagerly, checked equal to torchao's own CPU fallback on every call."""
    from torchao.prototype.moe_training.ep import kernels, permute

    def checked(counts, experts_per_rank, ranks, max_len, alignment):
        found = padded_permute_indices(counts, experts_per_rank, ranks, max_len, alignment)
        if not torch.compiler.is_compiling() and not torch.compiler.is_exporting():
            want = kernels.generate_permute_indices(counts, experts_per_rank, ranks, max_len, alignment, use_cpu=True)
            assert all(torch.equal(a.to(b.dtype), b) for a, b in zip(found, want)), (found, want)
        return found

    permute.generate_permute_indices = checked


def torchtitan_translations() -> dict:
    """What the dynamo exporter lacks for torchtitan's graph, on top of ``moe_onnx.torch.translation_table()``:
    ``aten.repeat_interleave.Tensor`` with ``output_size`` (onnxscript's translation refuses the
    keyword; the result is the same without it) and torchtitan's ``deterministic_scatter_add``
    custom op (``out.scatter_add(0, index, src)``) as ``ScatterElements(reduction="add")``."""
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.core import aten_repeat_interleave_Tensor

    import torchtitan.ops.scatter_add  # noqa: F401 (registers torch.ops.torchtitan)

    def repeat_interleave(repeats, output_size=None):
        return aten_repeat_interleave_Tensor(repeats)

    def deterministic_scatter_add(out, index, src):
        return op.ScatterElements(out, index, src, axis=0, reduction="add")

    return {
        torch.ops.aten.repeat_interleave.Tensor: repeat_interleave,
        torch.ops.torchtitan.deterministic_scatter_add.default: deterministic_scatter_add,
    }
