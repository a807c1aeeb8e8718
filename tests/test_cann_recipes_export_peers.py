"""Issue 20's follow-up, on the real code: after ``active_num = T*K`` exports as -1,
``moe_onnx.torch.export`` traces cann-recipes-infer's Qwen3-MoE and DeepSeek-R1 MoE blocks
themselves with a dynamic token count (tests/cann_recipes_export.py: ``moe_infer_double_routing``
and the whole ``forward`` with the gate, DeepSeek's with its shared expert), one model per gloo
rank, and ``moe-onnx run`` gives eager's outputs at the example token count and two others.
Eagerly, each entry point matches the dense pure-torch MoE (float32).

Marked ``peers``: deselected by default; the recipes' files are copied at test time from
``$CANN_RECIPES_INFER`` (a checkout) or ``$CANN_RECIPES_INFER_GIT`` (a bare clone; default the
workplace's mirror). Without them the test fails saying so (it is never skipped).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from moe_onnx.commands import cli

pytestmark = pytest.mark.peers

EAGER_TOLERANCE = 2e-5  # relative, against the dense float32 reference
#: the exported graph's torch ops (the gates' matmul, sigmoid, top-k) run in onnxruntime
EXPORT_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_recipes_blocks_export_with_a_dynamic_token_count_and_run_like_eager(tmp_path, world):
    from tests.cann_recipes import SourceMissing, copy_sources
    from tests.cann_recipes_export import CASES, worker
    from tests.moe_chain import Config
    from tests.torch_ranks import start_ranks

    source_dir = tmp_path / "recipes"
    try:
        copy_sources(source_dir)
    except SourceMissing as err:
        pytest.fail(f"the peers test needs cann-recipes-infer's files: {err}")
    config = Config(ranks=world)
    start_ranks(worker, world, config, str(source_dir), str(tmp_path), directory=str(tmp_path))
    check_cases(tmp_path, config, CASES)


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_deepseek_block_with_the_fused_grouped_gate_exports_and_runs_like_eager(tmp_path, world):
    """DeepseekV3MoE with 256 experts and DeepSeek-V3's gate settings takes the fused
    ``npu_moe_gating_top_k`` (grouped noaux_tc selection): against a torch grouped top-k."""
    from tests.cann_recipes import SourceMissing, copy_sources
    from tests.cann_recipes_export import FUSED_CONFIG_TOP_K, worker
    from tests.moe_chain import Config
    from tests.torch_ranks import start_ranks

    source_dir = tmp_path / "recipes"
    try:
        copy_sources(source_dir)
    except SourceMissing as err:
        pytest.fail(f"the peers test needs cann-recipes-infer's files: {err}")
    config = Config(ranks=world, local_experts=256 // world, top_k=FUSED_CONFIG_TOP_K)
    cases = ("deepseek_fused_gate",)
    start_ranks(worker, world, config, str(source_dir), str(tmp_path), cases, directory=str(tmp_path))
    ops = check_cases(tmp_path, config, cases)
    assert ops[0] == "MoeGatingTopK", ops


def check_cases(tmp_path, config, cases) -> list[str]:
    """Eager errors within EAGER_TOLERANCE; each case exported on every rank with a dynamic T
    and -1 for the every-slot active_num; moe-onnx run equal to eager at every token count.
    Returns the cann.moe nodes of the last case's rank-0 model."""
    world = config.ranks
    for rank in range(world):
        with np.load(tmp_path / f"errors{rank}_{'_'.join(cases)}.npz") as saved:
            for name in saved.files:
                assert saved[name].item() <= EAGER_TOLERANCE, (rank, name, saved[name].item())
    for case in cases:
        folder = tmp_path / case
        for rank in range(world):
            assert (folder / f"export{rank}.txt").read_text() == "exported", (case, rank)
        model = onnx.load(folder / "rank0.onnx")
        assert all(i.type.tensor_type.shape.dim[0].dim_param for i in model.graph.input), (case, "T is a constant")
        (routing,) = [n for n in model.graph.node if n.op_type == "MoeInitRoutingV3"]
        assert {a.name: onnx.helper.get_attribute_value(a) for a in routing.attribute}["active_num"] == -1
        ops = [n.op_type for n in model.graph.node if n.domain == "cann.moe"]
        if case.endswith("block") and case.startswith("qwen3"):
            assert ops[0] == "MoeGatingTopKSoftmax", ops
        (output,) = model.graph.output
        for tokens in config.batches:
            result_dir = folder / f"run_T{tokens}"
            inputs = str(folder / f"in{{r}}_T{tokens}.npz")
            args = ["run", str(folder), "--ranks", str(world), "--inputs", inputs, "--outputs", str(result_dir)]
            assert cli.main(args) == 0
            for rank in range(world):
                with np.load(result_dir / f"rank{rank}.npz") as got:
                    eager = np.load(folder / f"eager{rank}_T{tokens}.npy")
                    assert got[output.name].shape == eager.shape == (tokens + rank, config.hidden)
                    np.testing.assert_allclose(got[output.name], eager, **EXPORT_TOLERANCE, err_msg=f"{case} {rank}")
        print(f"{world} ranks, {case}: exported with a dynamic T, cann.moe nodes {ops}")
    return ops
