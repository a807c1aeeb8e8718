"""Original vs converted EP MoE layer on 4 in-process ranks: node count and time per forward."""

from __future__ import annotations

import time

import numpy as np

from moe_onnx import InferenceSession
from moe_onnx.converters import insert_rerouting
from moe_onnx.models.ep_layer import PATTERNS, LayerConfig, build_rank_model, example_inputs, make_weights
from moe_onnx.ranks import ThreadWorld

CONFIG = LayerConfig(ranks=4, local_experts=4, top_k=2, hidden=2048, ffn=256, tokens_per_rank=1024, capacity=160)


def forward_seconds(models, xs, repeats: int = 5, executor: str = "split") -> float:
    """Median wall time of one forward of all ranks (sessions and threads made once)."""
    import threading

    world = ThreadWorld(len(models))
    sessions = [
        InferenceSession(m, context={"communicator": world.communicator(r)}, executor=executor)
        for r, m in enumerate(models)
    ]

    def once():
        threads = [threading.Thread(target=s.run, args=(None, {"x": x})) for s, x in zip(sessions, xs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    weights = make_weights(CONFIG, seed=0)
    xs = example_inputs(CONFIG)
    print(f"EP layer: {CONFIG}")
    print(
        "| pattern | nodes before | nodes after | forward ms before | forward ms after "
        "| pyop executor: before | after |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for pattern in PATTERNS:
        models = [build_rank_model(CONFIG, weights, r, pattern) for r in range(CONFIG.ranks)]
        converted = [insert_rerouting(m)[0] for m in models]
        times = [
            forward_seconds(m, xs, executor=executor) * 1e3
            for executor in ("split", "pyop")
            for m in (models, converted)
        ]
        print(
            f"| {pattern} | {len(models[0].graph.node)} | {len(converted[0].graph.node)} | "
            + " | ".join(f"{t:.1f}" for t in times)
            + " |"
        )


if __name__ == "__main__":
    main()
