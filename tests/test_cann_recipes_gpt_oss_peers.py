"""Done-when of issue 22: cann-recipes-infer's gpt-oss MLP (``GptOssMLP.forward``: gating
softmax top-k -> v1 init routing -> expert-token cumsum -> grouped matmul with float32 bias ->
clamped SwiGLU -> grouped matmul -> finalize routing with expert ids) runs unchanged after
``install_stand_ins()`` (tests/cann_recipes_gpt_oss.py: only its non-MoE imports stubbed),
float32 and bfloat16, against the dense pure-torch MoE of tests/gpt_oss_mlp.py; on one rank
(moe_tp_size 1) and on 2 gloo ranks (moe_tp_size 2: the recipe's all-reduce of the sliced
experts). On one rank the MLP itself also exports with a dynamic token count and runs like eager.

Marked ``peers``: deselected by default; the recipe's file is copied at test time from
``$CANN_RECIPES_INFER`` (a checkout) or ``$CANN_RECIPES_INFER_GIT`` (a bare clone; default the
workplace's mirror). Without it the test fails saying so (it is never skipped).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.peers

#: relative error (max |got - want| / max |want|) against the dense float32 reference
TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}
EXPORT_TOLERANCE = 1e-5


@pytest.mark.parametrize("world", [1, 2], ids=["tp1", "tp2"])
def test_recipes_gpt_oss_mlp_matches_the_dense_moe(tmp_path, world):
    from tests.cann_recipes import SourceMissing, copy_sources
    from tests.cann_recipes_gpt_oss import FILES, worker
    from tests.gpt_oss_mlp import MlpConfig
    from tests.torch_ranks import start_ranks

    source_dir = tmp_path / "recipes"
    try:
        copy_sources(source_dir, FILES)
    except SourceMissing as err:
        pytest.fail(f"the peers test needs cann-recipes-infer's gpt-oss model file: {err}")
    config = MlpConfig()
    start_ranks(worker, world, config, str(source_dir), str(tmp_path), directory=str(tmp_path))
    for rank in range(world):
        with np.load(tmp_path / f"results{rank}.npz") as saved:
            results = {name: saved[name].item() for name in saved.files}
        for dtype, tolerance in TOLERANCE.items():
            assert results[f"bias_float32_{dtype}"] == 1.0
            for count in config.batches:
                assert results[f"dtype_ok_{dtype}_{count}"] == 1.0
                assert results[f"error_{dtype}_{count}"] <= tolerance, (rank, dtype, count, results)
        print(f"moe_tp_size {world}, rank {rank}:", {k: v for k, v in results.items() if k.startswith("error")})
    if world == 1:
        assert results["dynamic"] == 1.0, "token count exported as a constant"
        ops = (tmp_path / "gpt_oss_ops.txt").read_text().split()
        assert ops == [
            "MoeGatingTopKSoftmax",
            "MoeInitRouting",
            "MoeComputeExpertTokens",
            "GroupedMatmul",
            "GroupedMatmul",
            "MoeFinalizeRoutingV2",
        ], ops
        for count in config.batches:
            assert results[f"export_{count}"] <= EXPORT_TOLERANCE, (count, results)
