"""The routing-map family at DeepSeek-V3 and Qwen3-235B MoE shapes.

    python -m moe_onnx.benchmarks.bench_routing_map [--preset deepseek-v3|qwen3-235b] [--mode ...]

Per op: the bare kernel and a ``moe_onnx.InferenceSession`` run against the copy floor of
:mod:`benchmarks.harness`. bfloat16 tokens, float32 probs, a random top-K routing.
Modes: ``probs`` (not padded, with probs), ``plain`` (not padded, no probs), ``padded``
(drop-and-pad with probs, capacity factor 1: C = T*K/E).

The floor copies into a preallocated buffer; every kernel must return fresh arrays, whose
pages the OS zeroes on first touch. The ``first touch`` column times exactly that for the
bytes an op writes (``np.empty(...).fill(0)``), a cost no kernel that returns new outputs
can avoid; the last column compares the kernel with floor + first touch.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from moe_onnx.custom_ops.moe_token_permute_with_routing_map import moe_token_permute_with_routing_map

from .harness import Case, markdown_table, measure, median_seconds

PRESETS = {  # T tokens, H hidden, E experts, K top-k
    "deepseek-v3": dict(tokens=4096, hidden=7168, experts=256, top_k=8),
    "qwen3-235b": dict(tokens=4096, hidden=4096, experts=128, top_k=8),
}
MODES = ("probs", "plain", "padded")


def routing(rng, tokens: int, experts: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """A bool routing map with K experts per token and probs summing to 1 over them."""
    scores = rng.random((tokens, experts))
    chosen = np.argpartition(scores, -top_k, axis=1)[:, -top_k:]
    routing_map = np.zeros((tokens, experts), bool)
    np.put_along_axis(routing_map, chosen, True, axis=1)
    probs = np.where(routing_map, scores, 0).astype(np.float32)
    probs /= probs.sum(axis=1, keepdims=True)
    return routing_map, probs


def cases(preset: str, mode: str) -> list[Case]:
    return cases_for(preset, mode, **PRESETS[preset])


def cases_for(preset: str, mode: str, tokens: int, hidden: int, experts: int, top_k: int) -> list[Case]:
    """The four ops in one mode at one shape; bfloat16 tokens, float32 probs."""
    p = dict(tokens=tokens, hidden=hidden, experts=experts, top_k=top_k)
    rng = np.random.default_rng(0)
    token_data = rng.standard_normal((p["tokens"], p["hidden"]), np.float32).astype(ml_dtypes.bfloat16)
    routing_map, probs = routing(rng, p["tokens"], p["experts"], p["top_k"])
    rows = p["tokens"] * p["top_k"]  # padded: C = T*K/E rows per expert, the same total
    padded = int(mode == "padded")
    with_probs = None if mode == "plain" else probs
    permuted, sorted_indices, _ = moe_token_permute_with_routing_map(
        token_data, routing_map, probs, num_out_tokens=rows, drop_and_pad=padded
    )
    grad_rows = rng.standard_normal(permuted.shape, np.float32).astype(ml_dtypes.bfloat16)
    grad_tokens = rng.standard_normal(token_data.shape, np.float32).astype(ml_dtypes.bfloat16)
    order = np.argsort(sorted_indices, kind="stable").astype(np.int32)
    if padded:
        out_index, token_id = order, sorted_indices[order]
    else:
        out_index, token_id = sorted_indices, (np.arange(rows) // p["top_k"]).astype(np.int32)
    label = f"{preset} {mode}"

    def outputs(*names: str) -> list[str] | None:  # without probs, leave the probs output out
        return None if with_probs is not None else list(names) + [""]

    return [
        Case(
            "MoeTokenPermuteWithRoutingMap",
            label,
            {"tokens": token_data, "routing_map": routing_map, "probs": with_probs},
            {"num_out_tokens": rows, "drop_and_pad": padded},
            outputs("permuted_tokens", "sorted_indices"),
        ),
        Case(
            "MoeTokenPermuteWithRoutingMapGrad",
            label,
            {
                "permuted_tokens_grad": grad_rows,
                "permuted_probs_grad": None if with_probs is None else rng.standard_normal(rows, np.float32),
                "sorted_indices": sorted_indices,
                "routing_map": routing_map,
            },
            {"drop_and_pad": padded},
            outputs("tokens_grad"),
        ),
        Case(
            "MoeTokenUnpermuteWithRoutingMap",
            label,
            {
                "permuted_tokens": permuted,
                "sorted_indices": sorted_indices,
                "routing_map": routing_map,
                "probs": with_probs,
            },
            {"padded_mode": padded},
            outputs("unpermuted_tokens", "out_index", "permute_token_id"),
        ),
        Case(
            "MoeTokenUnpermuteWithRoutingMapGrad",
            label,
            {
                "unpermuted_tokens_grad": grad_tokens,
                "out_index": out_index,
                "permute_token_id": token_id,
                "routing_map": routing_map,
                "permuted_tokens": None if with_probs is None else permuted,
                "probs": with_probs,
            },
            {"drop_and_pad": padded},
            outputs("permuted_tokens_grad"),
        ),
    ]


def first_touch_seconds(nbytes: int) -> float:
    return median_seconds(lambda: np.empty(max(nbytes, 1), np.uint8).fill(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), action="append")
    parser.add_argument("--mode", choices=MODES, action="append")
    parser.add_argument("--op", action="append", help="only these op types")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for preset in args.preset or list(PRESETS):
        for mode in args.mode or list(MODES):
            for case in cases(preset, mode):
                if args.op and case.op_type not in args.op:
                    continue
                row = measure(case, args.repeats)
                row["touch_s"] = first_touch_seconds(row["bytes_written"])
                rows.append(row)
                print(
                    f"{case.op_type} {case.preset}: kernel {row['kernel_x_floor']:.2f}x, "
                    f"session {row['session_x_floor']:.2f}x",
                    flush=True,
                )
    table = markdown_table(rows).splitlines()
    table[0] += " first touch ms | kernel x (floor + touch) |"
    table[1] += "---:|---:|"
    for i, row in enumerate(rows):
        fresh_floor = row["floor_s"] + row["touch_s"]
        table[i + 2] += f" {row['touch_s'] * 1e3:.1f} | {row['kernel_s'] / fresh_floor:.2f}x |"
    print("\n" + "\n".join(table))


if __name__ == "__main__":
    main()
