"""cann-recipes-infer's gpt-oss MoE MLP (``GptOssMLP.forward`` in
``models/gpt_oss/models/modeling_gpt_oss.py``), its weights, and a dense pure-torch reference.

The recipe's chain, with torch_npu's names::

    npu_moe_gating_top_k_softmax(router_logits, None, k)   -> topk_weight, topk_idx, row_idx
    topk_weight / (sum + 1e-20)                             (renormalised by hand)
    npu_moe_init_routing(x, row_idx, topk_idx, active_num=T) (v1)
    npu_moe_compute_expert_tokens(expanded_expert_idx, E)  -> the cumsum group list, as int64
    npu_grouped_matmul([x], [gate_up [E, H, 2F]], bias=[gate_up_bias [E, 2F] float32],
                       group_list, split_item=3, group_type=0)   (group_list_type 0: cumsum)
    gpt-oss's clamped SwiGLU in torch, gate / up interleaved (``h[..., ::2]``, ``h[..., 1::2]``)
    npu_grouped_matmul(... [down [E, F, H]], bias=[down_bias [E, H] float32] ...)
    npu_moe_finalize_routing(rows, None, None, None, topk_weight, expanded_row_idx, topk_idx)

* :class:`GptOssMlpPattern` is that chain as CI runs it (the same calls as the recipe, written
  here); tests/test_cann_recipes_gpt_oss_peers.py runs the recipe's own file (``-m peers``).
* :func:`dense_reference` applies every expert to every token in float32 and picks the top-k
  by a stable sort of the softmax (ties to the lower expert), from the weights the model holds.

The recipe builds the model under ``torch.set_default_dtype(torch.bfloat16)``
(executor/model_loader/default_loader.py) while the biases are declared ``dtype=torch.float``:
bfloat16 x and weights with float32 biases are the real bfloat16 call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALPHA, LIMIT = 1.702, 7.0  # GptOssExperts.alpha / .limit


@dataclass(frozen=True)
class MlpConfig:
    experts: int = 8
    top_k: int = 4  # gpt-oss's num_experts_per_tok
    hidden: int = 16
    ffn: int = 12  # intermediate_size per expert
    batches: tuple[int, ...] = (7, 1, 33)  # token counts; an export's example first


def mlp_weights(config: MlpConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 checkpoint tensors in the recipe's layout: router [E, H] + [E], gate_up_proj
    [E, H, 2F] (gate / up columns interleaved) + bias [E, 2F], down_proj [E, F, H] + bias [E, H]."""
    g = torch.Generator().manual_seed(seed)
    e, h, f = config.experts, config.hidden, config.ffn
    return {
        "router.weight": torch.randn(e, h, generator=g) / h**0.5,
        "router.bias": torch.randn(e, generator=g) / 4,
        "experts.gate_up_proj": torch.randn(e, h, 2 * f, generator=g) * (4 / h**0.5),  # some reach the clamp
        "experts.gate_up_proj_bias": torch.randn(e, 2 * f, generator=g) / 4,
        "experts.down_proj": torch.randn(e, f, h, generator=g) / f**0.5,
        "experts.down_proj_bias": torch.randn(e, h, generator=g) / 4,
    }


CHECKPOINT_NAMES = (
    "router.weight",
    "router.bias",
    "experts.gate_up_proj",
    "experts.gate_up_proj_bias",
    "experts.down_proj",
    "experts.down_proj_bias",
)


def tokens(config: MlpConfig, count: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, config.hidden, generator=torch.Generator().manual_seed(seed * 1000 + count))


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The router (a ColumnParallelLinear with bias: not MoE code, plain torch here and in the
    stub), in x's dtype as the recipe computes it; the reference starts from the same logits."""
    return x @ weight.T.to(x.dtype) + bias.to(x.dtype)


def clamped_swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h[..., ::2].clamp(max=LIMIT), h[..., 1::2].clamp(-LIMIT, LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


def dense_reference(x: torch.Tensor, logits: torch.Tensor, held: dict, top_k: int) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t]) in float32, every expert applied to every
    token; ``held`` are the tensors the model holds (bfloat16-rounded in the bfloat16 run)."""
    x = x.float()
    probs = torch.softmax(logits.float(), dim=-1)
    picked = torch.sort(-probs, dim=-1, stable=True).indices[:, :top_k]  # ties: the lower expert
    weight = probs.gather(1, picked)
    weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
    gate_up, gate_up_bias = held["experts.gate_up_proj"].float(), held["experts.gate_up_proj_bias"].float()
    down, down_bias = held["experts.down_proj"].float(), held["experts.down_proj_bias"].float()
    every = torch.stack(
        [clamped_swiglu(x @ gate_up[e] + gate_up_bias[e]) @ down[e] + down_bias[e] for e in range(len(gate_up))]
    )  # [E, T, H]
    chosen = every[picked, torch.arange(len(x)).unsqueeze(1)]  # [T, K, H]
    return (chosen * weight.unsqueeze(-1)).sum(1)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


class GptOssMlpPattern(torch.nn.Module):
    """``forward(hidden_states [T, H]) -> [T, H]``: GptOssMLP.forward's calls, written here with
    torch_npu's names (``import torch_npu`` after ``install_stand_ins()``); the weights in the
    recipe's dtypes (x's dtype, the biases float32)."""

    def __init__(self, config: MlpConfig, weights: dict, dtype=torch.float32):
        super().__init__()
        self.num_experts, self.top_k, self.hidden_dim = config.experts, config.top_k, config.hidden
        for name, tensor in weights.items():
            kept = torch.float32 if name.endswith("_bias") else dtype
            self.register_buffer(name.replace(".", "_"), tensor.to(kept).clone())

    def held(self) -> dict:
        """The tensors as held, by their checkpoint names (what :func:`dense_reference` takes)."""
        return {name: getattr(self, name.replace(".", "_")) for name in CHECKPOINT_NAMES}

    def forward(self, hidden_states):
        import torch_npu  # the stand-in

        hidden_states = hidden_states.view(-1, self.hidden_dim)
        router_logits_ = router_logits(hidden_states, self.router_weight, self.router_bias)
        topk_weight, topk_idx, row_idx = torch_npu.npu_moe_gating_top_k_softmax(router_logits_, None, k=self.top_k)
        topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        token_count = hidden_states.shape[0]
        routing_weights = topk_weight.to(hidden_states.dtype)
        expert_idx = topk_idx.int()
        expanded_x, expanded_row_idx, expanded_expert_idx = torch_npu.npu_moe_init_routing(
            hidden_states, row_idx=row_idx, expert_idx=expert_idx, active_num=token_count
        )
        expert_tokens = torch_npu.npu_moe_compute_expert_tokens(expanded_expert_idx, self.num_experts).to(torch.int64)
        mm1_mm3 = torch_npu.npu_grouped_matmul(
            [expanded_x],
            [self.experts_gate_up_proj],
            group_list=expert_tokens,
            split_item=3,
            group_type=0,
            bias=[self.experts_gate_up_proj_bias],
        )[0]
        next_states = torch_npu.npu_grouped_matmul(
            [clamped_swiglu(mm1_mm3)],
            [self.experts_down_proj],
            group_list=expert_tokens,
            group_type=0,
            split_item=3,
            bias=[self.experts_down_proj_bias],
        )[0]
        y = torch_npu.npu_moe_finalize_routing(
            next_states,
            skip1=None,
            skip2=None,
            bias=None,
            scales=routing_weights,
            expanded_src_to_dst_row=expanded_row_idx,
            export_for_source_row=expert_idx,
        )
        return y.view(-1, self.hidden_dim)
