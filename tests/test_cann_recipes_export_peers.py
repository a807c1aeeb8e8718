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

from moe_onnx import cli

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
    for rank in range(world):
        with np.load(tmp_path / f"errors{rank}.npz") as saved:
            for name in saved.files:
                assert saved[name].item() <= EAGER_TOLERANCE, (rank, name, saved[name].item())
    for case in CASES:
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
