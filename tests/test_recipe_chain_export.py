"""Follow-up of issue 20 (found by issue 21): cann-recipes-infer's expert-parallel prefill call
pattern (tests/moe_chain.py ``ascend_double_routing``: ``npu_moe_init_routing_v2(...,
active_num=topk_ids.shape[0] * topk_ids.shape[1])``, host-side all-to-all splits, re-routing,
two grouped matmuls, SwiGLU, finalize routing) exports on 2 gloo ranks with a dynamic token
count, and ``moe-onnx run --ranks 2`` gives eager's outputs at the example token count and two
others. Before the fix the export stopped at "attribute active_num = 3*s48 is symbolic"."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from moe_onnx.commands import cli
from tests.moe_chain import Config
from tests.recipe_chain_export import worker
from tests.torch_ranks import start_ranks

CONFIG = Config(ranks=2)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("recipe_export")
    start_ranks(worker, CONFIG.ranks, CONFIG, str(out_dir), directory=str(out_dir))
    return out_dir


def test_the_export_is_dynamic_and_routes_every_slot(exported):
    model = onnx.load(exported / "rank0.onnx")
    assert all(i.type.tensor_type.shape.dim[0].dim_param for i in model.graph.input), "T exported as a constant"
    (routing,) = [n for n in model.graph.node if n.op_type == "MoeInitRoutingV3"]
    assert {a.name: onnx.helper.get_attribute_value(a) for a in routing.attribute}["active_num"] == -1
    ops = [n.op_type for n in model.graph.node if n.domain == "cann.moe"]
    assert ops.count("AllToAll") == 3 and ops.count("GroupedMatmul") == 2, ops
    assert ops[-1] == "MoeFinalizeRoutingV2", ops


def test_moe_onnx_run_gives_eager_outputs_at_three_token_counts(exported):
    (output,) = onnx.load(exported / "rank0.onnx", load_external_data=False).graph.output
    for tokens in CONFIG.batches:
        result_dir = exported / f"run_T{tokens}"
        inputs = str(exported / f"in{{r}}_T{tokens}.npz")
        code = cli.main(["run", str(exported), "--ranks", "2", "--inputs", inputs, "--outputs", str(result_dir)])
        assert code == 0
        for rank in range(CONFIG.ranks):
            with np.load(result_dir / f"rank{rank}.npz") as got:
                eager = np.load(exported / f"eager{rank}_T{tokens}.npy")
                assert got[output.name].shape == eager.shape == (tokens + rank, CONFIG.hidden)
                np.testing.assert_array_equal(got[output.name], eager)
