"""The dispatch ops routed by expert indices (SPEC 1.11, 1.12, 1.15, 1.16) at MoE shapes.

    python -m moe_onnx.benchmarks.bench_dispatch [deepseek-v3|qwen3-235b|mixtral ...]

bfloat16 tokens, int32 top-K expert ids (K distinct experts per token, uniformly at random),
float32 probs, as vLLM-Ascend's all-to-all-v dispatcher and cann-recipes-infer's gpt-oss MLP feed
them: MoeTokenPermute and its grad, MoeTokenUnpermute with probs and its grad, MoeInitRouting v1
with the canonical column-major row_idx, and MoeComputeExpertTokens on its sorted ids.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from moe_onnx.custom_ops.moe_init_routing import moe_init_routing
from moe_onnx.custom_ops.moe_token_permute import moe_token_permute

from .harness import Case, markdown_table, measure

PRESETS = {  # T, H, E, K
    "deepseek-v3": (4096, 7168, 256, 8),
    "qwen3-235b": (4096, 4096, 128, 8),
    "mixtral": (4096, 4096, 8, 2),
}


def top_k_ids(rng, tokens: int, experts: int, top_k: int) -> np.ndarray:
    """``[T, K]`` int32: K distinct experts per token."""
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)


def cases_for(preset: str, tokens: int, hidden: int, experts: int, top_k: int) -> list[Case]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, hidden), np.float32).astype(ml_dtypes.bfloat16)
    ids = top_k_ids(rng, tokens, experts, top_k)
    probs = rng.random((tokens, top_k)).astype(np.float32)
    permuted, sorted_indices = moe_token_permute(x, ids)
    # the gradients' values do not matter to the timing: the permuted rows and x stand in for
    # them (of their shapes and dtype), which keeps a DeepSeek-V3 run ~0.5 GB smaller
    grad_rows, grad_tokens = permuted, x
    row_idx = np.arange(tokens * top_k, dtype=np.int32).reshape(top_k, tokens).T.copy()
    _, _, sorted_ids = moe_init_routing(x, row_idx, ids, active_num=tokens)
    return [
        Case("MoeTokenPermute", preset, {"tokens": x, "indices": ids}),
        Case(
            "MoeTokenPermuteGrad",
            preset,
            {"permuted_output_grad": grad_rows, "sorted_indices": sorted_indices},
            {"num_topk": top_k},
        ),
        Case(
            "MoeTokenUnpermute", preset, {"permuted_tokens": permuted, "sorted_indices": sorted_indices, "probs": probs}
        ),
        Case(
            "MoeTokenUnpermuteGrad",
            preset,
            {
                "permuted_tokens": permuted,
                "unpermuted_tokens_grad": grad_tokens,
                "sorted_indices": sorted_indices,
                "probs": probs,
            },
        ),
        Case("MoeInitRouting", preset, {"x": x, "row_idx": row_idx, "expert_idx": ids}, {"active_num": tokens}),
        Case("MoeComputeExpertTokens", preset, {"sorted_experts": sorted_ids}, {"num_experts": experts}),
    ]


if __name__ == "__main__":
    for name in sys.argv[1:] or list(PRESETS):
        print(markdown_table([measure(case) for case in cases_for(name, *PRESETS[name])]), flush=True)
