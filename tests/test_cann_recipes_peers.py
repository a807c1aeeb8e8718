"""cann-recipes-infer's Qwen3-MoE and DeepSeek-R1 ``moe_infer_double_routing`` run unchanged on
2 and 4 gloo ranks after ``install_stand_ins()`` (only their non-MoE imports stubbed:
tests/cann_recipes.py), float32 and bfloat16, against a dense pure-torch MoE.

Marked ``peers``: deselected by default; the recipes' files are copied at test time from
``$CANN_RECIPES_INFER`` (a checkout) or ``$CANN_RECIPES_INFER_GIT`` (a bare clone; default the
workplace's mirror). Without them the test fails saying so (it is never skipped).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.peers

TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_recipes_double_routing_matches_the_dense_moe(tmp_path, world):
    from tests.cann_recipes import SourceMissing, copy_sources, worker
    from tests.moe_chain import Config
    from tests.torch_ranks import start_ranks

    source_dir = tmp_path / "recipes"
    try:
        copy_sources(source_dir)
    except SourceMissing as err:
        pytest.fail(f"the peers test needs cann-recipes-infer's files: {err}")
    config = Config(ranks=world)
    start_ranks(worker, world, config, str(source_dir), str(tmp_path), directory=str(tmp_path))
    for rank in range(world):
        with np.load(tmp_path / f"errors{rank}.npz") as saved:
            errors = {name: saved[name].item() for name in saved.files}
        for tokens in config.batches:
            for dtype, tolerance in TOLERANCE.items():
                assert errors[f"dtype_ok_{dtype}_{tokens}"] == 1.0
                for model in ("qwen3", "deepseek"):
                    assert errors[f"{model}_{dtype}_{tokens}"] <= tolerance, (rank, model, dtype, tokens, errors)
    worst = {
        key: max(v for k, v in errors.items() if k.startswith(key))
        for key in ("qwen3_f", "qwen3_b", "deepseek_f", "deepseek_b")
    }
    print(f"{world} ranks, worst relative errors (rank {world - 1}): {worst}")
    print("Qwen3MoeSparseMoeBlock.moe_infer_double_routing:", (tmp_path / "export0.txt").read_text())
