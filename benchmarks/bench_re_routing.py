"""MoeReRoutingV2 at the seed's shape: 16 ranks x 16 experts, A = 16384, H = 7168, int8."""

from __future__ import annotations

import numpy as np

from benchmarks.harness import Case


def cases() -> list[Case]:
    rng = np.random.default_rng(0)
    counts = rng.multinomial(16384, np.full(256, 1 / 256)).reshape(16, 16).astype(np.int32)
    tokens = rng.integers(-10, 20, (16384, 7168), dtype=np.int8)
    scales = rng.standard_normal(16384).astype(np.float32)
    weight = rng.standard_normal((16384, 1)).astype(np.float32)
    inputs = {"tokens": tokens, "expert_token_num_per_rank": counts, "per_token_scales": scales,
              "expert_topk_weight": weight}
    return [Case("MoeReRoutingV2", "seed-16x16-int8", inputs)]


if __name__ == "__main__":
    from benchmarks.harness import markdown_table, measure

    print(markdown_table([measure(case) for case in cases()]))
