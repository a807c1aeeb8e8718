"""A sharded MoE layer on N thread ranks against the single-device model (a benchmark, not a test).

``python -m moe_onnx.benchmarks.bench_shard [--ranks 2 4] [--tokens 256] [--repeats 5]``

One layer of :mod:`moe_onnx.models.moe_model` (float32), every rank with its own batch of
``--tokens`` tokens. Per rank: the median wall time of a forward (the single-device model on
that rank's batch, then the rank in an N-rank run of the shards as threads of this process),
the rank's weight bytes, and the bytes its AllToAlls move to other ranks (rows out and back,
counted from the routing: a row for an expert on another rank crosses twice).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from moe_onnx import InferenceSession
from moe_onnx.converters import shard_experts
from moe_onnx.models.moe_model import MoeModelConfig, build_moe_model, layer_weights
from moe_onnx.ranks import ThreadRanks


def routed_experts(config: MoeModelConfig, x: np.ndarray) -> np.ndarray:
    """[T, K] experts of layer 0 (softmax top-k of x @ router, ties to the lower id)."""
    logits = x.astype(np.float64) @ layer_weights(config, 0)["router"].astype(np.float64)
    return np.argsort(-logits, axis=1, kind="stable")[:, : config.top_k]


def moved_bytes(config: MoeModelConfig, x: np.ndarray, rank: int, ranks: int) -> int:
    """Bytes rank ``rank`` sends to other ranks in the layer's row AllToAlls (out and back)."""
    local = config.experts // ranks
    remote = int((routed_experts(config, x) // local != rank).sum())
    return 2 * remote * config.hidden * 4


def weight_bytes(model) -> int:
    import onnx

    return sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)


def median_time(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench(config: MoeModelConfig, ranks: int, tokens: int, repeats: int) -> list[dict]:
    model = build_moe_model(config)
    shards, _ = shard_experts(model, ranks)
    rng = np.random.default_rng(ranks)
    xs = [rng.standard_normal((tokens, config.hidden)).astype(np.float32) for _ in range(ranks)]
    single = InferenceSession(model)
    world = ThreadRanks(shards, timeout=600)
    per_rank: list[list[float]] = [[] for _ in range(ranks)]
    started = [0.0]

    def done(rank: int, outputs) -> None:
        per_rank[rank].append(time.perf_counter() - started[0])

    world.run([{"x": x} for x in xs])  # warm-up
    for _ in range(repeats):
        started[0] = time.perf_counter()
        world.run([{"x": x} for x in xs], on_done=done)
    rows = []
    for rank, x in enumerate(xs):
        rows.append(
            {
                "ranks": ranks,
                "rank": rank,
                "tokens": tokens,
                "single_s": median_time(lambda x=x: single.run(None, {"x": x}), repeats),
                "sharded_s": float(np.median(per_rank[rank])),
                "alltoall_bytes": moved_bytes(config, x, rank, ranks),
                "weight_bytes": weight_bytes(shards[rank]),
                "single_weight_bytes": weight_bytes(model),
            }
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args(argv)
    config = MoeModelConfig(layers=1, experts=a.experts, top_k=a.top_k, hidden=a.hidden, ffn=a.ffn, shared_experts=True)
    print(f"layer: E={a.experts} H={a.hidden} F={a.ffn} top-{a.top_k}, shared expert, float32, {a.tokens} tokens/rank")
    print("| ranks | rank | single device (ms) | sharded rank (ms) | AllToAll bytes out+back | weights (MB) |")
    print("|---|---|---|---|---|---|")
    for ranks in a.ranks:
        for row in bench(config, ranks, a.tokens, a.repeats):
            print(
                f"| {row['ranks']} | {row['rank']} | {row['single_s'] * 1e3:.2f} | {row['sharded_s'] * 1e3:.2f} | "
                f"{row['alltoall_bytes']} | {row['weight_bytes'] / 1e6:.2f} of {row['single_weight_bytes'] / 1e6:.2f} |"
            )


if __name__ == "__main__":
    main()
