"""cann-recipes-infer's Qwen3-MoE and DeepSeek-R1 MoE blocks exported by ``moe_onnx.torch.export``
with a dynamic token count on each gloo rank (tests/test_cann_recipes_export_peers.py,
``-m peers``), their files copied and their non-MoE imports stubbed as in tests/cann_recipes.py.

Four entry points of the recipes' own code, float32:

* ``qwen3_routing``: ``Qwen3MoeSparseMoeBlock.moe_infer_double_routing(x, topk_ids, topk_weight)``;
* ``qwen3_block``: ``Qwen3MoeSparseMoeBlock.forward(x)``: its gate (a plain linear, then
  ``npu_moe_gating_top_k_softmax`` and the renormalisation) and the same routing;
* ``deepseek_routing``: ``DeepseekV3MoE.forward_shared_expert`` + ``moe_infer_double_routing``;
* ``deepseek_block``: ``DeepseekV3MoE.forward(x, is_prefill=True)``: its torch ``noaux_tc``
  sigmoid gate (the fused ``npu_moe_gating_top_k`` is taken only for 256 or 384 experts), the
  shared expert and the routing;
* ``deepseek_fused_gate``: the same forward with 256 experts, DeepSeek-V3's own gate
  configuration (8 groups, the top 4 kept, top-8, routed_scaling_factor 2.5), which takes the
  fused ``npu_moe_gating_top_k(..., group_select_mode=1, norm_type=1)``.

:func:`worker` runs each eagerly at every token count (against the dense pure-torch MoE of
tests/moe_chain.py with the gate's routing recomputed in torch), then exports it; the model,
or the first error of the export, is saved per case.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.cann_recipes import deepseek_block, install, qwen3_block
from tests.moe_chain import Config, dense_reference, global_weights, rank_inputs, relative_error

CASES = ("qwen3_routing", "qwen3_block", "deepseek_routing", "deepseek_block")
#: case -> (model, kind): which block, and whether the gate is part of the trace
PARTS = {
    "qwen3_routing": ("qwen3", "routing"),
    "qwen3_block": ("qwen3", "block"),
    "deepseek_routing": ("deepseek", "routing"),
    "deepseek_block": ("deepseek", "block"),
    "deepseek_fused_gate": ("deepseek_fused", "block"),
}
#: DeepSeek-V3's gate (config.json of deepseek-ai/DeepSeek-V3): the fused gating path needs E = 256
FUSED_GATE = {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}
FUSED_CONFIG_TOP_K = 8
INPUTS = {"routing": ("x", "topk_ids", "topk_weight"), "block": ("x",)}


def gate_weights(config: Config, seed: int = 5) -> dict[str, torch.Tensor]:
    """The gates' weights (the recipes' loaders would fill them): [E, H] and DeepSeek's
    e_score_correction_bias [E]."""
    g = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(config.experts, config.hidden, generator=g),
        "correction": torch.randn(config.experts, generator=g) / 4,
    }


def gate_routing(model: str, x: torch.Tensor, gates: dict, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks' routing in plain torch, from SPEC-layer 1.13 / 1.14 (b): Qwen3 softmax
    top-k renormalised; DeepSeek sigmoid scores s, the top-k of the key s + correction bias
    (grouped for ``deepseek_fused_gate``: each group scored by the sum of its top-2 keys, the
    other groups' keys -inf), weights the unbiased s renormalised and scaled. Stable sorts:
    ties to the lower expert (or group)."""
    logits = x.float() @ gates["gate"].T
    if model == "qwen3":
        scores = choice = torch.softmax(logits, -1)
        scale = 1.0
    else:
        scores = logits.sigmoid()
        choice = scores + gates["correction"]
        scale = 1.0
    if model == "deepseek_fused":
        groups, kept, scale = FUSED_GATE["n_group"], FUSED_GATE["topk_group"], FUSED_GATE["routed_scaling_factor"]
        grouped = choice.view(len(x), groups, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.sort(-group_score, dim=-1, stable=True).indices[:, :kept]
        mask = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(len(x), -1)
    ids = torch.sort(-choice, dim=-1, stable=True).indices[:, :top_k]
    weight = scores.gather(1, ids)
    return ids, weight / (weight.sum(-1, keepdim=True) + 1e-20) * scale


def _no_stream(*args, **kwargs):
    return contextlib.nullcontext()


def stub_block_helpers() -> None:
    """What DeepseekV3MoE.forward calls besides the MoE: ``.modules``' one_hot (as torch's
    ``one_hot(...).float()``) and executor/utils/stream_utils' multi-stream helpers, which with
    multi-streams off (their switch_flag False) do nothing or are a null context."""
    modules = sys.modules["cann_recipes_deepseek.modules"]
    modules.one_hot = lambda t, n: torch.nn.functional.one_hot(t.long(), n).float()  # type: ignore[attr-defined]
    streams = sys.modules["executor.utils.stream_utils"]
    streams.npu_stream_switch = streams.npu_stream_switch_gegraph = _no_stream  # type: ignore[attr-defined]
    for name in ("record_event", "wait_event", "record_stream"):
        setattr(streams, name, lambda *args, **kwargs: None)


class Entry(torch.nn.Module):
    """One case as a module (what torch.export traces)."""

    def __init__(self, case: str, block):
        super().__init__()
        self.case, self.block = case, block

    def forward(self, x, topk_ids=None, topk_weight=None):
        if self.case == "qwen3_routing":
            return self.block.moe_infer_double_routing(x, topk_ids, topk_weight)
        if self.case == "qwen3_block":
            return self.block(x)
        if self.case == "deepseek_routing":
            shared = self.block.forward_shared_expert(x, is_prefill=True)
            return self.block.moe_infer_double_routing(x, topk_ids, topk_weight, shared)
        return self.block(x, is_prefill=True)  # deepseek_block, deepseek_fused_gate


def fused_gate_block(config: Config, rank: int, world: int, weights: dict):
    """DeepseekV3MoE as tests/cann_recipes.py ``deepseek_block`` builds it, with DeepSeek-V3's
    gate settings (:data:`FUSED_GATE`); config must have 256 (or 384) experts."""
    from cann_recipes_deepseek.modeling_deepseek import DeepseekV3MoE

    from tests.cann_recipes import CommManager, infer_config, load_experts, model_config

    settings = model_config(config)
    settings.__dict__.update(FUSED_GATE)
    block = DeepseekV3MoE(settings, infer_config(world), CommManager(rank), 0, prefix="layers.3.mlp")
    load_experts(block.experts, config, rank, weights, torch.float32)
    block.shared_experts.gate_up_proj.weight.data = weights["shared_gate_up"]
    block.shared_experts.down_proj.weight.data = weights["shared_down"]
    return block


def build_block(model: str, config: Config, rank: int, world: int, weights: dict, gates: dict):
    if model == "qwen3":
        block = qwen3_block(config, rank, world, weights, torch.float32)
    elif model == "deepseek":
        block = deepseek_block(config, rank, world, weights, torch.float32)
    else:
        block = fused_gate_block(config, rank, world, weights)
    block.gate.weight.data = gates["gate"].clone()
    if model != "qwen3":
        block.gate.e_score_correction_bias.data = gates["correction"].clone()
    return block


def worker(rank: int, world: int, init_file: str, config: Config, source_dir: str, out_dir: str, cases=CASES) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    install(Path(source_dir))
    stub_block_helpers()
    import moe_onnx.torch as mt

    weights, gates = global_weights(config), gate_weights(config)
    out, errors = Path(out_dir), {}
    for case in cases:
        model, kind = PARTS[case]
        entry = Entry(case, build_block(model, config, rank, world, weights, gates)).eval()
        (out / case).mkdir(exist_ok=True)
        examples = {}
        for tokens in config.batches:
            x, topk_ids, topk_weight = rank_inputs(config, rank, tokens + rank)
            if kind == "block":
                topk_ids, topk_weight = gate_routing(model, x, gates, config.top_k)
            examples[tokens] = (x, topk_ids, topk_weight) if kind == "routing" else (x,)
            with torch.no_grad():
                y = entry(*examples[tokens])
            want = dense_reference(x, topk_ids, topk_weight, weights, with_shared=model != "qwen3")
            errors[f"{case}_{tokens}"] = relative_error(y, want)
            feeds = dict(zip(INPUTS[kind], (t.numpy() for t in examples[tokens])))
            np.savez(out / case / f"in{rank}_T{tokens}.npz", **feeds)
            np.save(out / case / f"eager{rank}_T{tokens}.npy", y.numpy())
        dim = torch.export.Dim("T")
        try:
            with torch.no_grad():
                mt.export(
                    entry,
                    examples[config.batches[0]],
                    out / case / f"rank{rank}.onnx",
                    dynamic_shapes=tuple({0: dim} for _ in examples[config.batches[0]]),
                )
            result = "exported"
        except Exception as err:  # noqa: BLE001 - what breaks is the finding, reported by the test
            summary = str(err).split("## Exception summary")[-1].strip()
            result = f"{type(err).__name__}: {summary[:2000]}\n{traceback.format_exc()[-3000:]}"
        (out / case / f"export{rank}.txt").write_text(result)
    np.savez(out / f"errors{rank}_{'_'.join(cases)}.npz", **errors)
    dist.barrier()
    dist.destroy_process_group()
