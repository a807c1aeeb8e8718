"""A Megatron-style expert-parallel MoE layer, twice: with moe_onnx.torch, and in pure torch.

Both run on the default torch.distributed group (N ranks, E experts, L = E / N local experts
on each rank, top-K routing):

    router -> softmax -> top-k -> permute rows by expert -> AllToAll (rank-major rows)
    -> regroup by local expert -> experts -> restore rank-major order -> AllToAll back
    -> unpermute (probs-weighted sum of each token's K rows)

* :class:`MoeOnnxLayer` uses MoeInitRoutingV2, AllGather (counts), AllToAll,
  MoeReRoutingV2 and MoeTokenUnpermuteWithRoutingMap from moe_onnx.torch;
* :class:`ReferenceLayer` uses Megatron-LM's moe_utils formulations (``permute``,
  ``sort_chunks_by_idxs``, ``unpermute``) and torch.distributed's differentiable
  ``all_to_all_single`` / ``all_gather``.

:func:`worker` runs one rank: eager outputs and one training step's gradients of both layers,
saved for the test, and the legacy TorchScript export of its layer (:func:`export_legacy`).
:func:`export_ranks` exports every rank's layer with the dynamo exporter and a dynamic token
count; it needs no process group (AllGather's rank count is then left symbolic).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn


@dataclass(frozen=True)
class Config:
    ranks: int
    local_experts: int = 2
    hidden: int = 8
    ffn: int = 12
    top_k: int = 2
    batches: tuple[int, ...] = (7, 3, 12)  # tokens per rank: the export's example, then two more

    @property
    def experts(self) -> int:
        return self.ranks * self.local_experts


def global_weights(config: Config, seed: int = 0):
    """Router [H, E] (replicated) and every expert's w_in [E, H, F], w_out [E, F, H]."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(config.hidden, config.experts, generator=g)
    w_in = torch.randn(config.experts, config.hidden, config.ffn, generator=g) / config.hidden**0.5
    w_out = torch.randn(config.experts, config.ffn, config.hidden, generator=g) / config.ffn**0.5
    return router, w_in, w_out


def rank_tokens(config: Config, rank: int, tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, config.hidden, generator=torch.Generator().manual_seed(seed * 1000 + rank * 10 + tokens))


class _Layer(torch.nn.Module):
    def __init__(self, config: Config, rank: int):
        super().__init__()
        self.config, self.rank = config, rank
        router, w_in, w_out = global_weights(config)
        local = slice(rank * config.local_experts, (rank + 1) * config.local_experts)
        self.router = torch.nn.Parameter(router.clone())
        self.w_in = torch.nn.Parameter(w_in[local].clone())
        self.w_out = torch.nn.Parameter(w_out[local].clone())

    def route(self, x):
        """probs [T, E] (zero off the top-k), routing_map [T, E] bool, top-k experts [T, K]."""
        scores = torch.softmax(x @ self.router, dim=-1)
        top_probs, top_experts = torch.topk(scores, self.config.top_k, dim=-1)
        # a tensor source: jit.trace (the legacy exporter) has no scatter of a bool scalar
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(
            1, top_experts, torch.ones_like(top_experts, dtype=torch.bool)
        )
        probs = torch.zeros_like(scores).scatter(1, top_experts, top_probs)
        return probs, routing_map, top_experts

    def expert(self, j: int, rows):
        return torch.nn.functional.silu(rows @ self.w_in[j]) @ self.w_out[j]


class MoeOnnxLayer(_Layer):
    def forward(self, x):
        import moe_onnx.torch as mt

        config = self.config
        probs, routing_map, top_experts = self.route(x)
        # rows grouped by expert; expanded_row_idx[t*K + j] = row of token t's j-th copy
        expanded_x, expanded_row_idx, per_expert, _ = mt.moe_init_routing_v2(
            x, top_experts.to(torch.int32), expert_num=config.experts, expert_tokens_count_or_cumsum_flag=2
        )
        returned = self.exchange(expanded_x, per_expert.to(torch.int64))
        y, *_ = mt.moe_token_unpermute_with_routing_map(returned, expanded_row_idx, routing_map, probs)
        return y

    def exchange(self, rows, per_expert):
        """The experts' outputs for ``rows`` [S, H] (grouped by expert, ``per_expert`` [E] int64
        rows each), in the order of ``rows``: AllGather of the counts, AllToAll to the experts'
        ranks, re-routing by local expert, the experts, the order restored, AllToAll back."""
        import moe_onnx.torch as mt

        config, local = self.config, self.config.local_experts
        send_counts = per_expert.view(config.ranks, local).sum(1)  # [N] rows to each rank
        all_counts = mt.all_gather(per_expert)  # [N, E]: [i, e] rows rank i holds for expert e
        counts = all_counts[:, self.rank * local : (self.rank + 1) * local]  # [N, L] what arrives here
        received, recv_counts = mt.all_to_all(rows, send_counts)  # rank-major rows
        grouped, _, to_expert_major, per_local, _ = mt.moe_re_routing_v2(received, counts, idx_type=1)
        # expert of each expert-major row: how many local experts' blocks end at or before it
        row = torch.arange(grouped.shape[0]).unsqueeze(1)
        expert_of_row = (row >= torch.cumsum(per_local, 0).unsqueeze(0)).sum(1)
        out = torch.zeros_like(grouped)
        for j in range(local):
            out = out + (expert_of_row == j).unsqueeze(1).to(grouped.dtype) * self.expert(j, grouped)
        # back to rank-major: row src of the received rows sits at to_expert_major[src]
        back = out.index_select(0, to_expert_major.to(torch.int64))
        returned, _ = mt.all_to_all(back, recv_counts)
        return returned


# --- pure torch, Megatron-LM moe_utils style -------------------------------------------


def permute(tokens, routing_map):
    """Megatron's permute: rows grouped by expert, each expert's tokens in token order.
    Returns ``(permuted [T*K, H], sorted_indices [T*K])`` with ``sorted_indices[d]`` = token of row d."""
    num_tokens, num_experts = routing_map.shape
    routing_map = routing_map.bool().T.contiguous()
    token_indices = torch.arange(num_tokens).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_indices.masked_select(routing_map)
    return tokens.index_select(0, sorted_indices), sorted_indices


def unpermute(permuted, sorted_indices, restore_shape, probs, routing_map):
    """Megatron's unpermute: scale each row by its prob, scatter-add it back to its token."""
    permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
    permuted = permuted * permuted_probs.unsqueeze(-1)
    output = torch.zeros(restore_shape, dtype=permuted.dtype)
    index = sorted_indices.unsqueeze(1).expand(-1, restore_shape[1])
    return output.scatter_add(0, index, permuted)


def sort_chunks_by_idxs(rows, split_sizes, sorted_idxs):
    """Megatron's chunk sort: split rows by ``split_sizes``, concatenate in ``sorted_idxs`` order."""
    chunks = torch.split(rows, split_sizes.tolist(), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs.tolist()], dim=0)


class ReferenceLayer(_Layer):
    def forward(self, x):
        config, ranks, local = self.config, self.config.ranks, self.config.local_experts
        probs, routing_map, _ = self.route(x)
        permuted, sorted_indices = permute(x, routing_map)
        per_expert = routing_map.sum(0)  # [E]
        send = per_expert.view(ranks, local).sum(1)
        gathered = torch.stack(dist_nn.all_gather(per_expert))  # [N, E]
        counts = gathered[:, self.rank * local : (self.rank + 1) * local]  # [N, L]
        recv = counts.sum(1)
        received = dist_nn.all_to_all_single(
            x.new_empty(int(recv.sum()), config.hidden), permuted, recv.tolist(), send.tolist()
        )
        # chunks (rank i, expert j) at i*L + j, rank-major -> expert-major
        by_expert = torch.arange(ranks * local).view(ranks, local).T.reshape(-1)
        rows = sort_chunks_by_idxs(received, counts.reshape(-1), by_expert)
        sizes = counts.sum(0).tolist()
        out = torch.cat([self.expert(j, chunk) for j, chunk in enumerate(torch.split(rows, sizes))])
        by_rank = torch.arange(ranks * local).view(local, ranks).T.reshape(-1)
        back = sort_chunks_by_idxs(out, counts.T.reshape(-1), by_rank)
        returned = dist_nn.all_to_all_single(permuted.new_empty(permuted.shape), back, send.tolist(), recv.tolist())
        return unpermute(returned, sorted_indices, x.shape, probs, routing_map)


# --- one rank ---------------------------------------------------------------------------


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def worker(rank: int, world: int, init_file: str, config: Config, out_dir: str) -> None:
    """Eager forward of both layers and one training step's gradients; outputs and errors saved."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )  # a hung rank fails the test instead of stalling the suite for gloo's 30 minutes
    out = Path(out_dir)
    ours, reference = MoeOnnxLayer(config, rank), ReferenceLayer(config, rank)
    errors = {}
    for tokens in config.batches:
        x = rank_tokens(config, rank, tokens)
        x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, y_ref = ours(x_ours), reference(x_ref)
        cotangent = torch.randn(y.shape, generator=torch.Generator().manual_seed(rank + tokens))
        (y * cotangent).sum().backward()
        (y_ref * cotangent).sum().backward()
        errors[f"y_{tokens}"] = relative_error(y, y_ref)
        errors[f"grad_x_{tokens}"] = relative_error(x_ours.grad, x_ref.grad)
        for name, p in ours.named_parameters():
            errors[f"grad_{name}_{tokens}"] = relative_error(p.grad, dict(reference.named_parameters())[name].grad)
        ours.zero_grad(), reference.zero_grad()
        np.savez(out / f"rank{rank}_T{tokens}.npz", x=x.numpy(), y=y.detach().numpy())
    np.savez(out / f"errors{rank}.npz", **errors)
    export_legacy(config, rank, out / "legacy")
    dist.barrier()
    dist.destroy_process_group()


def export_ranks(config: Config, out_dir: str) -> None:
    """``rank{r}.onnx`` for every rank, exported at the first batch size with T dynamic."""
    import moe_onnx.torch as mt

    for rank in range(config.ranks):
        example = rank_tokens(config, rank, config.batches[0])
        path = Path(out_dir) / f"rank{rank}.onnx"
        with torch.no_grad():
            mt.export(MoeOnnxLayer(config, rank).eval(), (example,), path, dynamic_shapes=({0: torch.export.Dim("T")},))


def export_legacy(config: Config, rank: int, out_dir: Path) -> None:
    """``rank{r}.onnx`` by the legacy TorchScript exporter, T dynamic. Its trace runs the layer,
    collectives included: every rank of the group calls it at once."""
    import warnings

    import moe_onnx.torch as mt

    mt.register_legacy_symbolics()
    out_dir.mkdir(exist_ok=True)
    example = rank_tokens(config, rank, config.batches[0])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter says it is legacy
        torch.onnx.export(
            MoeOnnxLayer(config, rank).eval(),
            (example,),
            out_dir / f"rank{rank}.onnx",
            dynamo=False,
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "T"}, "y": {0: "T"}},
            opset_version=17,
        )
