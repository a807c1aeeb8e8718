"""The MC2 dispatch + combine (SPEC-mc2 1.20-1.23) on N thread ranks, against the plain path
they fuse: an AllToAll of the routed rows each way (with MoeReRoutingV2's reorder on the expert
side counted as free), at decode shapes.

    python -m moe_onnx.benchmarks.bench_mc2 [deepseek-v3-decode|qwen3-decode ...]

Reports, per rank and step, the median seconds of dispatch + combine (V1 and V2) and of an
AllToAll pair moving the same rows, and the bytes each hands to the communicator's row
exchange (counted by a wrapping communicator; the agreement's small allgathers are left out).
Threads share one process, so the times measure the kernels' own work, not a network.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import ml_dtypes
import numpy as np

from moe_onnx.custom_ops import OPS
from moe_onnx.custom_ops.all_to_all import all_to_all
from moe_onnx.ranks import ThreadWorld

PRESETS = {  # W ranks, BS tokens per rank, H, E, K
    "deepseek-v3-decode": (4, 64, 7168, 32, 8),
    "qwen3-decode": (4, 64, 4096, 16, 8),
}


class CountingCommunicator:
    """A communicator that counts the bytes its ``alltoallv`` sends."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.sent = inner, inner.rank, inner.size, 0

    def allgather(self, value, label):
        return self.inner.allgather(value, label)

    def alltoallv(self, send, send_counts, recv_counts):
        self.sent += send.nbytes
        return self.inner.alltoallv(send, send_counts, recv_counts)


def _on_ranks(world: int, step) -> list:
    """``step(rank, communicator)`` on every rank at once; each rank's result."""
    threads_world = ThreadWorld(world, timeout=300)
    results: list = [None] * world

    def main(rank):
        results[rank] = step(rank, CountingCommunicator(threads_world.communicator(rank)))

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _inputs(world, rows, hidden, experts, top_k):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((rows, hidden), np.float32).astype(ml_dtypes.bfloat16) for _ in range(world)]
    ids = [np.argsort(rng.random((rows, experts)), axis=1)[:, :top_k].astype(np.int32) for _ in range(world)]
    weights = [rng.random((rows, top_k)).astype(np.float32) for _ in range(world)]
    return xs, ids, weights


def run(preset: str, repeats: int = 5) -> list[dict]:
    world, rows, hidden, experts, top_k = PRESETS[preset]
    xs, ids, weights = _inputs(world, rows, hidden, experts, top_k)
    attrs: dict[str, Any] = dict(group_ep="ep", ep_world_size=world, moe_expert_num=experts)

    def mc2_step(v2):
        dispatch = OPS["MoeDistributeDispatchV2" if v2 else "MoeDistributeDispatch"]
        combine = OPS["MoeDistributeCombineV2" if v2 else "MoeDistributeCombine"]

        def step(rank, communicator):
            context = {"communicator": communicator}
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                out = dispatch(xs[rank], ids[rank], context=context, ep_rank_id=rank, **attrs)
                combine(out[0], ids[rank], out[2], out[4], weights[rank], context=context, ep_rank_id=rank, **attrs)
                times.append(time.perf_counter() - start)
            return float(np.median(times)), communicator.sent // repeats

        return step

    def plain_step(rank, communicator):
        """The rows of the same routing, sent as one AllToAll each way (rank-major)."""
        per_rank = experts // world
        flat = ids[rank].reshape(-1)
        order = np.argsort(flat, kind="stable")
        rows_out = xs[rank][order // top_k]
        counts = np.bincount(flat // per_rank, minlength=world).astype(np.int64)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            received, recv_counts = all_to_all(rows_out, counts, communicator=communicator)
            all_to_all(received, recv_counts, communicator=communicator)
            times.append(time.perf_counter() - start)
        return float(np.median(times)), communicator.sent // repeats

    rows_out = []
    for name, step in (("MC2 V1", mc2_step(False)), ("MC2 V2", mc2_step(True)), ("AllToAll pair", plain_step)):
        results = _on_ranks(world, step)
        rows_out.append(
            {"path": name, "preset": preset, "ms": results[0][0] * 1e3, "bytes": int(np.mean([r[1] for r in results]))}
        )
    return rows_out


def table(rows: list[dict]) -> str:
    head = "| path | preset | ms per step (rank 0) | bytes exchanged per rank |\n|---|---|---:|---:|\n"
    return head + "\n".join(f"| {r['path']} | {r['preset']} | {r['ms']:.2f} | {r['bytes']} |" for r in rows)


def main(argv: list[str]) -> int:
    rows = [row for preset in (argv or list(PRESETS)) for row in run(preset)]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
