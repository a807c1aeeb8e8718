"""The gating ops at DeepSeek-V3, Qwen3-235B and Mixtral shapes, T = 4096 tokens.

    python -m moe_onnx.benchmarks.bench_gating [deepseek-v3|qwen3-235b|mixtral ...]

Per preset: MoeGatingTopKSoftmax (the Qwen3 / gpt-oss gate), MoeGatingTopK (DeepSeek-V3's
``noaux_tc``: sigmoid, bias, 8 groups, the best 4 by their top-2 sum, k = 8; without groups
where E < 64) and MoeGatingTopKBackward of that gate. float32 logits, as the recipes' gates
compute them (``hidden_states.float()`` through a float32 linear). Each runs against the copy
floor of reading the logits and writing the outputs (:mod:`benchmarks.harness`) and, in
``moe-onnx bench``, against its torch baseline side by side (``benchmarks.torch_ops``).
"""

from __future__ import annotations

import sys

import numpy as np

from moe_onnx.custom_ops.moe_gating_top_k import moe_gating_top_k

from .harness import Case, copy_floor, interleaved_seconds, markdown_table, measure

#: T, E, K
PRESETS = {"deepseek-v3": (4096, 256, 8), "qwen3-235b": (4096, 128, 8), "mixtral": (4096, 8, 2)}
#: DeepSeek-V3's grouped selection, used where the experts allow it (E >= 64)
GROUPED = {"group_count": 8, "k_group": 4, "group_select_mode": 1}


def cases(preset: str) -> list[Case]:
    return cases_for(preset, *PRESETS[preset])


def gate_attrs(experts: int, top_k: int) -> dict:
    """MoeGatingTopK's attributes at this shape: DeepSeek-V3's noaux_tc gate."""
    grouped = GROUPED if experts >= 64 else {}
    return {"k": top_k, "norm_type": 1, "out_flag": 1, "routed_scaling_factor": 2.5, **grouped}


def cases_for(preset: str, tokens: int, experts: int, top_k: int) -> list[Case]:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((tokens, experts), np.float32)
    bias = (rng.standard_normal(experts, np.float32) * 0.01).astype(np.float32)
    attrs = gate_attrs(experts, top_k)
    _, expert_idx, scores = moe_gating_top_k(logits, bias, **attrs)
    grad_y = rng.standard_normal((tokens, top_k), np.float32)
    backward_attrs = {"norm_type": 1, "routed_scaling_factor": attrs["routed_scaling_factor"]}
    return [
        Case("MoeGatingTopKSoftmax", preset, {"x": logits, "finished": None}, {"k": top_k}),
        Case("MoeGatingTopK", preset, {"x": logits, "bias": bias, "input_ids": None, "tid2eid": None}, attrs),
        Case(
            "MoeGatingTopKBackward",
            preset,
            {"x_norm": scores, "grad_y": grad_y, "expert_idx": expert_idx},
            backward_attrs,
        ),
    ]


def exp_pass_ratios(case: Case, repeats: int = 9) -> dict[str, float]:
    """For scale: one ``np.exp`` over the logits (float32, and float64 as the scores use it),
    into preallocated memory, against the case's copy floor, run in turn. The gating forward
    does such a pass and a top-k per row besides, so its ratio cannot come near these."""
    read, written = case.io_bytes()
    logits = case.inputs["x"]
    assert logits is not None
    narrow, wide = np.empty_like(logits), logits.astype(np.float64)
    wide_out = np.empty_like(wide)
    paths = {
        "floor": copy_floor((read + written) // 2),
        "exp float32": lambda: np.exp(logits, out=narrow),
        "exp float64": lambda: np.exp(wide, out=wide_out),
    }
    return interleaved_seconds(paths, repeats)[1]


if __name__ == "__main__":
    for name in sys.argv[1:] or list(PRESETS):
        preset_cases = cases(name)
        print(markdown_table([measure(case, repeats=9) for case in preset_cases]), flush=True)
        ratios = exp_pass_ratios(preset_cases[1])
        print(f"- {name}: one exp pass over the logits: " + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items()))
