"""MoeInitRoutingV2 and its grad, and MoeInitRoutingV3, at DeepSeek-V3 and Mixtral shapes, bfloat16.

    python -m moe_onnx.benchmarks.bench_init_routing [deepseek-v3|mixtral ...]

Each preset times the forward (dropless, and drop/pad at capacity factor 1.25) and the grad
(both modes, fed by the forward's own index), and MoeInitRoutingV3 dropless as real code calls
it: one rank's range of E/8 experts (vllm-ascend: the rest of the T*K rows are zeros) and the
whole range with the row -> source index (omni-infer's row_idx_type 1). Besides the harness's copy floor (a copy into a
preallocated buffer), it prints a second floor: a copy into a fresh array of the op's output
size, which every op returning new arrays pays for page faults.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from moe_onnx.custom_ops.moe_init_routing_v2 import moe_init_routing_v2

from .harness import Case, markdown_table, measure, median_seconds

#: medians over more runs than the harness default: the machine is shared and noisy
REPEATS = 9
PRESETS = {  # T, H, E, K
    "deepseek-v3": (4096, 7168, 256, 8),
    "mixtral": (4096, 4096, 8, 2),
}


def routing(rng, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """``[T, K]`` int32: K distinct experts per token, uniformly at random."""
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)


def cases(preset: str) -> list[Case]:
    return cases_for(preset, *PRESETS[preset])


def cases_for(preset: str, tokens: int, hidden: int, experts: int, top_k: int) -> list[Case]:
    """Forward and grad, dropless and drop/pad (capacity factor 1.25), bfloat16."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, hidden), np.float32).astype(ml_dtypes.bfloat16)
    expert_idx = routing(rng, tokens, experts, top_k)
    capacity = min(tokens, int(1.25 * tokens * top_k / experts))
    forward = {
        "dropless": {"expert_num": experts, "expert_tokens_count_or_cumsum_flag": 2},
        "drop/pad": {"expert_num": experts, "drop_pad_mode": 1, "expert_capacity": capacity},
    }
    outputs = {
        "dropless": ["expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum", ""],
        "drop/pad": ["expanded_x", "expanded_row_idx", "", ""],
    }
    result = []
    for mode, attrs in forward.items():
        result.append(
            Case("MoeInitRoutingV2", f"{preset} {mode}", {"x": x, "expert_idx": expert_idx}, attrs, outputs[mode])
        )
    v3_outputs = ["expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum", "expanded_scale"]
    v3: dict[str, dict] = {
        "dropless range 1/8": {"active_expert_range": [0, max(1, experts // 8)]},
        "dropless row->source": {"row_idx_type": 1},
    }
    for mode, v3_attrs in v3.items():
        v3_attrs.update(expert_num=experts, expert_tokens_num_flag=1, expert_tokens_num_type=1)
        result.append(
            Case("MoeInitRoutingV3", f"{preset} {mode}", {"x": x, "expert_idx": expert_idx}, v3_attrs, v3_outputs)
        )
    for mode, attrs in forward.items():
        expanded_x, expanded_row_idx, _, _ = moe_init_routing_v2(x, expert_idx, **attrs)
        grad = rng.standard_normal(expanded_x.shape, np.float32).astype(ml_dtypes.bfloat16)
        del expanded_x
        result.append(
            Case(
                "MoeInitRoutingV2Grad",
                f"{preset} {mode}",
                {"grad_expanded_x": grad, "expanded_row_idx": expanded_row_idx},
                {"top_k": top_k, "drop_pad_mode": attrs.get("drop_pad_mode", 0)},
            )
        )
    return result


def fresh_output_floor(case: Case) -> float:
    """Seconds to copy the op's output bytes into a freshly allocated array."""
    written = sum(y.nbytes for y in case.call_kernel() if y is not None)
    source = np.ones(written, np.uint8)
    return median_seconds(source.copy)


if __name__ == "__main__":
    for preset in sys.argv[1:] or list(PRESETS):
        rows, fresh = [], []
        for case in cases(preset):
            rows.append(measure(case, repeats=REPEATS))
            fresh.append(
                f"- {case.op_type} {case.preset}: fresh-output copy floor {fresh_output_floor(case) * 1e3:.1f} ms"
            )
        print(markdown_table(rows))
        print("\n".join(fresh), flush=True)
