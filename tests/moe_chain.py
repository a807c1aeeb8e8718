"""An Ascend expert-parallel MoE prefill ("double routing"), three ways, on the default
torch.distributed group (N ranks, E experts, L = E / N local experts, top-K):

    init routing -> counts all-to-all -> rows all-to-all -> re-routing (expert-major)
    -> grouped matmul [gate | up] -> SwiGLU -> grouped matmul down -> back to rank-major
    -> rows all-to-all back -> finalize routing (probs-weighted sum, + the shared expert)

* :func:`ascend_double_routing` is written the way cann-recipes-infer's Qwen3-MoE and
  DeepSeek-R1 ``moe_infer_double_routing`` are, with torch_npu's names (``import torch_npu``
  after ``install_stand_ins()``) and ``dist.all_to_all_single`` with host-side splits, the
  weights as cann-recipes' FusedMoEGMM holds them after ``process_weights_after_loading``
  (transposed views of ``[L, 2F, H]`` / ``[L, H, F]``): the call patterns CI covers;
* :class:`MoeOnnxDoubleRouting` is the same chain with moe_onnx.torch's functions and
  collectives, which ``mt.export`` turns into one ONNX model per rank;
* :func:`dense_reference` is a dense pure-torch MoE over all E experts, in float32.

:func:`worker` runs one rank: both chains against the reference at several token counts, in
float32 and bfloat16, saving the errors and the eager outputs of the exportable chain.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Config:
    ranks: int
    local_experts: int = 2
    hidden: int = 16
    ffn: int = 12  # per expert; the shared expert has the same width
    top_k: int = 3
    batches: tuple[int, ...] = (9, 4, 13)  # tokens per rank (plus the rank): the export's example first

    @property
    def experts(self) -> int:
        return self.ranks * self.local_experts


def global_weights(config: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint layout: w13 [E, 2F, H] (gate rows, then up rows), w2 [E, H, F], and the
    shared expert's gate_up [2F, H] and down [H, F]."""
    g = torch.Generator().manual_seed(seed)
    h, f, e = config.hidden, config.ffn, config.experts
    return {
        "w13": torch.randn(e, 2 * f, h, generator=g) / h**0.5,
        "w2": torch.randn(e, h, f, generator=g) / f**0.5,
        "shared_gate_up": torch.randn(2 * f, h, generator=g) / h**0.5,
        "shared_down": torch.randn(h, f, generator=g) / f**0.5,
    }


def rank_inputs(config: Config, rank: int, tokens: int, seed: int = 1):
    """x [T, H], topk_ids [T, K] int32 (K distinct experts), topk_weight [T, K] float32."""
    g = torch.Generator().manual_seed(seed * 1000 + rank * 17 + tokens)
    x = torch.randn(tokens, config.hidden, generator=g)
    topk_ids = torch.rand(tokens, config.experts, generator=g).argsort(1)[:, : config.top_k].to(torch.int32)
    weight = torch.rand(tokens, config.top_k, generator=g) + 0.1
    return x, topk_ids, weight / weight.sum(1, keepdim=True)


def local_slice(config: Config, rank: int) -> slice:
    return slice(rank * config.local_experts, (rank + 1) * config.local_experts)


# --- the reference ---------------------------------------------------------------------


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def shared_expert(x: torch.Tensor, weights: dict) -> torch.Tensor:
    return swiglu(x.float() @ weights["shared_gate_up"].T) @ weights["shared_down"].T


def dense_reference(x, topk_ids, topk_weight, weights: dict, with_shared: bool) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t]) (+ shared(x[t])), float32, every expert
    applied to every token (no routing, no collectives)."""
    x = x.float()
    every = torch.stack([swiglu(x @ w13.T) @ w2.T for w13, w2 in zip(weights["w13"], weights["w2"])])  # [E, T, H]
    picked = every[topk_ids.long(), torch.arange(len(x)).unsqueeze(1)]  # [T, K, H]
    y = (picked * topk_weight.unsqueeze(-1)).sum(1)
    return y + shared_expert(x, weights) if with_shared else y


# --- cann-recipes-infer's call patterns, with torch_npu's names ----------------------------


def fused_moe_weights(config: Config, rank: int, weights: dict, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's w13 / w2 as FusedMoEGMM holds them after process_weights_after_loading
    (is_nz=False): ``weight.data.transpose(1, 2)``, views of the checkpoint layout."""
    local = local_slice(config, rank)
    return weights["w13"][local].to(dtype).transpose(1, 2), weights["w2"][local].to(dtype).transpose(1, 2)


def ascend_double_routing(x, topk_ids, topk_weight, w13, w2, num_experts, ep_size, shared=None, group=None):
    """Expert-parallel prefill as cann-recipes-infer writes it (moe_infer_double_routing)."""
    import torch_npu  # the stand-in: install_stand_ins() first

    tokens, hidden = x.shape
    expanded_x, expanded_row_idx, tokens_per_expert, _ = torch_npu.npu_moe_init_routing_v2(
        x,
        expert_idx=topk_ids,
        active_num=topk_ids.shape[0] * topk_ids.shape[1],
        scale=None,
        expert_num=num_experts,
        expert_tokens_num_type=1,
        expert_tokens_num_flag=True,
        active_expert_range=[0, num_experts],
        quant_mode=-1,
    )
    tokens_per_expert_group = tokens_per_expert.new_empty(tokens_per_expert.shape[0])
    dist.all_to_all_single(tokens_per_expert_group, tokens_per_expert, group=group)
    splits = torch.stack([tokens_per_expert_group, tokens_per_expert], dim=0).view(2, ep_size, -1).sum(2)
    output_splits, input_splits = splits.tolist()
    gathered = expanded_x.new_empty(sum(output_splits), hidden)
    dist.all_to_all_single(gathered, expanded_x, output_splits, input_splits, group=group)
    rows, _, ids_unsort, tokens_per_local_expert = torch_npu.npu_moe_re_routing(
        gathered, tokens_per_expert_group.view(ep_size, -1)
    )
    h = torch_npu.npu_grouped_matmul(
        [rows], [w13], group_list=tokens_per_local_expert, group_type=0, group_list_type=1, split_item=3
    )[0]
    h = torch_npu.npu_swiglu(h)
    out = torch_npu.npu_grouped_matmul(
        [h], [w2], group_list=tokens_per_local_expert, group_type=0, group_list_type=1, split_item=3
    )[0]
    back = torch.index_select(out, 0, ids_unsort.float().argsort().int())
    returned = back.new_empty(*expanded_x.shape)
    dist.all_to_all_single(returned, back, input_splits, output_splits, group=group)
    return torch_npu.npu_moe_finalize_routing(
        returned,
        skip1=shared,
        skip2=None,
        bias=None,
        scales=topk_weight.to(returned.dtype),
        expanded_src_to_dst_row=expanded_row_idx,
        export_for_source_row=None,
        drop_pad_mode=2,
    ).view(tokens, hidden)


# --- the same chain with moe_onnx.torch (exportable) ----------------------------------------


class MoeOnnxDoubleRouting(torch.nn.Module):
    """``forward(x, topk_ids, topk_weight, shared) -> y`` for one rank, with moe_onnx.torch's
    ops; the local weights in the checkpoint layout ([L, 2F, H], [L, H, F]: transpose_weight)."""

    def __init__(self, config: Config, rank: int, weights: dict, dtype=torch.float32):
        super().__init__()
        self.config, self.rank = config, rank
        local = local_slice(config, rank)
        self.register_buffer("w13", weights["w13"][local].to(dtype).contiguous())
        self.register_buffer("w2", weights["w2"][local].to(dtype).contiguous())

    def forward(self, x, topk_ids, topk_weight, shared):
        import moe_onnx.torch as mt

        config, local = self.config, self.config.local_experts
        expanded_x, expanded_row_idx, per_expert, _ = mt.moe_init_routing_v2(
            x, topk_ids, expert_num=config.experts, expert_tokens_count_or_cumsum_flag=2
        )
        per_expert = per_expert.to(torch.int64)
        all_counts = mt.all_gather(per_expert)  # [N, E]
        counts_here = all_counts[:, self.rank * local : (self.rank + 1) * local]  # [N, L]: what arrives here
        received, recv_counts = mt.all_to_all(expanded_x, per_expert.view(config.ranks, local).sum(1))
        rows, _, to_expert_major, per_local, _ = mt.moe_re_routing_v2(received, counts_here, idx_type=1)
        group_list = per_local.to(torch.int64)
        h = mt.grouped_matmul(rows, self.w13, None, group_list, group_type=0, group_list_type=1, transpose_weight=1)
        out = mt.grouped_matmul(
            mt.swi_glu(h), self.w2, None, group_list, group_type=0, group_list_type=1, transpose_weight=1
        )
        back = out.index_select(0, to_expert_major.to(torch.int64))  # rank-major again
        returned, _ = mt.all_to_all(back, recv_counts)
        return mt.moe_finalize_routing_v2(
            returned, expanded_row_idx, shared, None, None, topk_weight.to(returned.dtype), drop_pad_mode=2
        )


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def worker(rank: int, world: int, init_file: str, config: Config, out_dir: str) -> None:
    """Both chains at every batch size, float32 and bfloat16, against the dense reference."""
    import moe_onnx.torch as mt

    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    mt.install_stand_ins()
    out = Path(out_dir)
    weights = global_weights(config)
    errors = {}
    for tokens in config.batches:
        x, topk_ids, topk_weight = rank_inputs(config, rank, tokens + rank)
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).split(".")[-1]
            xd = x.to(dtype)
            shared = shared_expert(xd, weights).to(dtype)
            want = dense_reference(xd, topk_ids, topk_weight, weights, with_shared=True)
            w13, w2 = fused_moe_weights(config, rank, weights, dtype)
            y = ascend_double_routing(xd, topk_ids, topk_weight, w13, w2, config.experts, world, shared)
            errors[f"ascend_{name}_{tokens}"] = relative_error(y, want)
            errors[f"ascend_{name}_{tokens}_dtype_ok"] = float(y.dtype == dtype and y.shape == x.shape)
            ours = MoeOnnxDoubleRouting(config, rank, weights, dtype)(xd, topk_ids, topk_weight, shared)
            errors[f"moe_onnx_{name}_{tokens}"] = relative_error(ours, want)
            if dtype == torch.float32:
                np.savez(
                    out / f"rank{rank}_T{tokens}.npz",
                    x=xd.numpy(),
                    topk_ids=topk_ids.numpy(),
                    topk_weight=topk_weight.numpy(),
                    shared=shared.numpy(),
                    y=ours.numpy(),
                )
    np.savez(out / f"errors{rank}.npz", **errors)
    dist.barrier()
    dist.destroy_process_group()


def export_ranks(config: Config, out_dir: str) -> None:
    """``rank{r}.onnx`` for every rank, exported at the first batch size with T dynamic."""
    import moe_onnx.torch as mt

    weights = global_weights(config)
    tokens = torch.export.Dim("T")
    for rank in range(config.ranks):
        example = rank_inputs(config, rank, config.batches[0] + rank)
        shared = shared_expert(example[0], weights)
        with torch.no_grad():
            mt.export(
                MoeOnnxDoubleRouting(config, rank, weights).eval(),
                (*example, shared),
                Path(out_dir) / f"rank{rank}.onnx",
                dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}, {0: tokens}),
            )
