"""The built-in example: a rank-major batch rerouted to expert order through onnxruntime."""

from __future__ import annotations

import numpy as np

from ..builders import single_node_model
from ..custom_ops.moe_re_routing_v2 import moe_re_routing_v2  # the bare numpy kernel
from ..interrupts import deferred
from ..runtime.session import InferenceSession


def rerouting_demo(ranks: int = 4, experts: int = 4, hidden: int = 8, seed: int = 0, echo=print) -> bool:
    """Reroute one AlltoAll output with MoeReRoutingV2 in a session; check it against numpy."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, (ranks, experts)).astype(np.int32)
    rows = int(counts.sum())
    # row value = 100 * source rank + local expert, so the reorder is visible
    owner = np.repeat(100 * np.repeat(np.arange(ranks), experts) + np.tile(np.arange(experts), ranks), counts.ravel())
    tokens = np.repeat(owner[:, None], hidden, axis=1).astype(np.float32)
    weight = rng.random((rows, 1)).astype(np.float32)
    inputs = {
        "tokens": tokens,
        "expert_token_num_per_rank": counts,
        "per_token_scales": None,
        "expert_topk_weight": weight,
    }
    model = single_node_model("MoeReRoutingV2", inputs, node_name="rerouting")
    feeds = {k: v for k, v in inputs.items() if v is not None}
    got = InferenceSession(model).run(None, feeds)
    with deferred():  # Ctrl-C waits for the PyOp call: raised inside its hook, it would abort
        through_pyop = InferenceSession(model, executor="pyop").run(None, feeds)
    want = [w for w in moe_re_routing_v2(tokens, counts, None, weight) if w is not None]

    echo(f"expert_token_num_per_rank [{ranks} ranks x {experts} experts]:")
    for r, row in enumerate(counts):
        echo(f"  rank {r}: {row.tolist()}")
    echo(f"received (rank-major) rows as 100*rank+expert: {owner.tolist()}")
    echo(f"permute_tokens[:, 0] (expert-major):           {got[0][:, 0].astype(int).tolist()}")
    echo(f"permute_token_idx (gather, dst -> src):       {got[2].tolist()}")
    echo(f"expert_token_num:                             {got[3].tolist()}")
    same = all(np.array_equal(g, w) and np.array_equal(p, w) for g, p, w in zip(got, through_pyop, want))
    echo(
        f"session (split and pyop executors) vs numpy kernel: {'bit-identical' if same else 'MISMATCH'} "
        f"({len(got)} outputs, {rows} rows)"
    )
    return same


def ep_layer_demo(echo=print) -> bool:
    """The shipped 4-rank EP MoE layer on 4 in-process ranks vs the dense numpy layer."""
    from ..models import EP_LAYER_SMALL
    from ..models.ep_layer import LayerConfig, dense_reference, example_inputs, make_weights
    from ..ranks.communicators import run_threads

    config = LayerConfig()
    weights = make_weights(config, seed=0)  # the weights the shipped models were written with
    xs = example_inputs(config)
    paths = [f"{EP_LAYER_SMALL}/rank{r}.onnx" for r in range(config.ranks)]
    echo(
        f"EP MoE layer: {config.ranks} ranks x {config.local_experts} local experts, top-{config.top_k}, "
        f"H={config.hidden}, FFN={config.ffn}, {config.tokens_per_rank} tokens per rank"
    )
    results = run_threads(paths, [{"x": x} for x in xs])
    ok = True
    for r, (x, (y,)) in enumerate(zip(xs, results)):
        error = float(np.abs(y - dense_reference(config, weights, x)).max())
        ok &= error < 1e-4
        echo(f"  rank {r}: y {list(y.shape)}  max |y - dense| = {error:.2e}")
    echo(f"4 ranks (threads backend) vs single-process dense layer: {'match' if ok else 'MISMATCH'}")
    return ok
