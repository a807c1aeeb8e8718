"""The built-in example: a rank-major batch rerouted to expert order through onnxruntime."""

from __future__ import annotations

import numpy as np

from .builders import single_node_model
from .custom_ops import moe_re_routing_v2
from .session import InferenceSession


def rerouting_demo(ranks: int = 4, experts: int = 4, hidden: int = 8, seed: int = 0, echo=print) -> bool:
    """Reroute one AlltoAll output with MoeReRoutingV2 in a session; check it against numpy."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, (ranks, experts)).astype(np.int32)
    rows = int(counts.sum())
    # row value = 100 * source rank + local expert, so the reorder is visible
    owner = np.repeat(100 * np.repeat(np.arange(ranks), experts) + np.tile(np.arange(experts), ranks),
                      counts.ravel())
    tokens = np.repeat(owner[:, None], hidden, axis=1).astype(np.float32)
    weight = rng.random((rows, 1)).astype(np.float32)
    inputs = {"tokens": tokens, "expert_token_num_per_rank": counts, "per_token_scales": None,
              "expert_topk_weight": weight}
    session = InferenceSession(single_node_model("MoeReRoutingV2", inputs, node_name="rerouting"))
    got = session.run(None, {k: v for k, v in inputs.items() if v is not None})
    want = [w for w in moe_re_routing_v2(tokens, counts, None, weight) if w is not None]

    echo(f"expert_token_num_per_rank [{ranks} ranks x {experts} experts]:")
    for r, row in enumerate(counts):
        echo(f"  rank {r}: {row.tolist()}")
    echo(f"received (rank-major) rows as 100*rank+expert: {owner.tolist()}")
    echo(f"permute_tokens[:, 0] (expert-major):           {got[0][:, 0].astype(int).tolist()}")
    echo(f"permute_token_idx (gather, dst -> src):       {got[2].tolist()}")
    echo(f"expert_token_num:                             {got[3].tolist()}")
    same = all(np.array_equal(g, w) for g, w in zip(got, want))
    echo(f"onnxruntime session vs numpy kernel: {'bit-identical' if same else 'MISMATCH'} "
         f"({len(got)} outputs, {rows} rows)")
    return same
