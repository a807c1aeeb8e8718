"""Expert compute and combine (SPEC-layer 1.8-1.10) at DeepSeek-V3, Qwen3-235B and Mixtral MoE
shapes, bfloat16 rows as real prefill runs them:

    python -m moe_onnx.benchmarks.bench_layer [deepseek-v3|qwen3-235b|mixtral|tiny ...]

* MoeFinalizeRoutingV2: ``[T*K, H]`` expert outputs, the shared expert as x1, scales, mode 2
  (cann-recipes-infer's call), against the copy floor and torch's gather + weighted sum;
* SwiGlu: the ``[T*K, 2F]`` gate/up product of one rank, against the floor and ``silu(a) * b``;

  (both for a prefill chunk of at most T tokens, ``CHUNK_BYTES`` of expert rows)
* GroupedMatmul: one token chunk (``M = 1024`` rows over E = 8 local experts) times
  ``[E, H, 2F]``, float32 and bfloat16, side by side with a torch per-group ``mm`` loop (in the
  dtype: bfloat16 on torch's own kernels), the same loop widened to float32, and numpy
  casting to float32 and calling BLAS (the bfloat16 target).
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

from moe_onnx.custom_ops import buffers
from moe_onnx.custom_ops.grouped_matmul import grouped_matmul

from .harness import Case, interleaved_seconds

BF16 = np.dtype(ml_dtypes.bfloat16)
#: (T tokens, H hidden, E experts, K top-k, F expert width); Mixtral's F per 8-way tensor split
PRESETS = {
    "deepseek-v3": (4096, 7168, 256, 8, 2048),
    "qwen3-235b": (4096, 4096, 128, 8, 1536),
    "mixtral": (4096, 4096, 8, 2, 1792),
    "tiny": (64, 32, 8, 2, 16),
}
GMM_ROWS, GMM_EXPERTS = 1024, 8
#: bytes of expert rows in the finalize / SwiGlu cases: a prefill chunk of up to T tokens whose
#: rows stay well above the 32 MB L3 (a smaller floor copy runs in cache) and keep a bench
#: process below 3 GB with every path of the suite
CHUNK_BYTES = 256 << 20


def cases_for(preset: str, tokens: int, hidden: int, experts: int, top_k: int, ffn: int) -> list[Case]:
    rng = np.random.default_rng(0)
    tokens = max(1, min(tokens, CHUNK_BYTES // (top_k * hidden * BF16.itemsize)))
    slots = tokens * top_k
    rows = rng.standard_normal((slots, hidden), np.float32).astype(BF16)
    shared = rng.standard_normal((tokens, hidden), np.float32).astype(BF16)
    scales = rng.random((tokens, top_k), np.float32).astype(BF16)
    index = rng.permutation(slots).astype(np.int32)
    finalize = Case(
        "MoeFinalizeRoutingV2",
        preset,
        {"expanded_x": rows, "expanded_row_idx": index, "x1": shared, "x2": None, "bias": None, "scales": scales},
        {"drop_pad_mode": 2},
    )
    del rows
    gate_up = rng.standard_normal((slots, 2 * ffn), np.float32).astype(BF16)
    result = [finalize, Case("SwiGlu", preset, {"x": gate_up})]
    m = min(GMM_ROWS, slots)
    counts = rng.multinomial(m, np.ones(GMM_EXPERTS) / GMM_EXPERTS)
    group_list = np.cumsum(counts).astype(np.int64)
    for dtype in (np.float32, BF16):
        x = rng.standard_normal((m, hidden), np.float32).astype(dtype)
        weight = (rng.standard_normal((GMM_EXPERTS, hidden, 2 * ffn), np.float32) / hidden**0.5).astype(dtype)
        result.append(
            Case(
                "GroupedMatmul",
                f"{preset} {np.dtype(dtype).name}",
                {"x": x, "weight": weight, "bias": None, "group_list": group_list},
                {"group_type": 0},
            )
        )
    return result


def cases(preset: str) -> list[Case]:
    return cases_for(preset, *PRESETS[preset])


def matmul_baselines(case: Case) -> dict:
    """The kernel and what a user would pick instead, for one GroupedMatmul case."""
    import torch

    x, weight, group_list = case.inputs["x"], case.inputs["weight"], case.inputs["group_list"]
    assert x is not None and weight is not None and group_list is not None  # the cases give all three
    sizes = np.diff(np.concatenate([[0], group_list])).tolist()
    as_torch = (
        (lambda a: torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)) if x.dtype == BF16 else torch.from_numpy
    )
    tx, tw = as_torch(x), as_torch(weight)

    def torch_loop():
        return torch.cat([torch.mm(part, tw[e]) for e, part in enumerate(torch.split(tx, sizes))])

    def torch_float32_loop():
        return torch.cat([torch.mm(part.float(), tw[e].float()) for e, part in enumerate(torch.split(tx, sizes))])

    def numpy_cast_blas():
        out, start = np.empty((len(x), weight.shape[-1]), x.dtype), 0
        for e, n in enumerate(sizes):
            out[start : start + n] = x[start : start + n].astype(np.float32) @ weight[e].astype(np.float32)
            start += n
        return out

    def kernel():
        with buffers.recycled_outputs():
            return grouped_matmul(x, weight, None, group_list, group_type=0)

    paths = {"kernel": kernel, "torch mm loop": torch_loop, "torch float32 loop": torch_float32_loop}
    paths["numpy cast + BLAS"] = numpy_cast_blas
    return paths


if __name__ == "__main__":
    from .suite import measure_case

    for preset in sys.argv[1:] or ["deepseek-v3", "qwen3-235b"]:
        for case in cases(preset):
            if case.op_type == "GroupedMatmul":
                seconds, ratios = interleaved_seconds(matmul_baselines(case), repeats=5)
                print(
                    f"GroupedMatmul {case.preset}: "
                    + ", ".join(f"{name} {seconds[name] * 1e3:.0f} ms" for name in seconds)
                    + " | kernel / each: "
                    + ", ".join(f"{name} {1 / ratios[name]:.2f}x" for name in ratios if name != "kernel"),
                    flush=True,
                )
            else:
                row = measure_case(case, stock=False)
                print(
                    f"{case.op_type} {case.preset}: kernel {row['kernel_x_floor']:.2f}x floor, session "
                    f"{row['session_x_floor']:.2f}x, torch {row.get('torch_x_floor', float('nan')):.2f}x "
                    f"(kernel / torch {row['kernel_s'] / row['torch_s']:.2f})",
                    flush=True,
                )
