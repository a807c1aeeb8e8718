"""lower() on whole models: functions and overloads, inlining, subgraphs, refusals, files and
the CLI, and the converted EP layer on 4 ranks with only AllToAll left to moe-onnx."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from moe_onnx.commands import cli
from moe_onnx.commands.lower_file import lower_file
from moe_onnx.converters import insert_rerouting
from moe_onnx.converters.lowering import COLLECTIVES, LOWERINGS, LoweringError
from moe_onnx.custom_ops import DOMAIN, OPS
from moe_onnx.errors import UserError
from moe_onnx.models.ep_layer import LayerConfig, example_inputs
from moe_onnx.ranks import run_threads

from .lower_support import LoweredRunner
from .support import assert_same_bits, node_model

EP_LAYER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "ep_layer_small")
RR_OUTPUTS = ["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num"]


@pytest.fixture(scope="module")
def runner():
    worker = LoweredRunner()
    yield worker
    worker.close()


def rerouting_inputs(seed=0):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, (2, 3)).astype(np.int32)
    return {
        "tokens": rng.standard_normal((int(counts.sum()), 4)).astype(np.float32),
        "expert_token_num_per_rank": counts,
    }


def two_reroutings(opset=21) -> onnx.ModelProto:
    """tokens -> MoeReRoutingV2 (gather index) and MoeReRoutingV2 (scatter index, cumsum) twice."""
    node = node_model("MoeReRoutingV2", rerouting_inputs(), {}, RR_OUTPUTS, opset=opset)
    graph = node.graph
    second = helper.make_node(
        "MoeReRoutingV2",
        ["tokens", "expert_token_num_per_rank"],
        ["b_tokens", "b_scales", "b_idx", "b_num"],
        domain=DOMAIN,
        name="second",
        idx_type=1,
        expert_token_num_type=0,
    )
    third = helper.make_node(
        "MoeReRoutingV2",
        ["b_tokens", "expert_token_num_per_rank"],
        ["c_tokens", "c_scales", "c_idx", "c_num"],
        domain=DOMAIN,
        name="third",
        idx_type=1,
        expert_token_num_type=0,
    )
    graph.node.extend([second, third])
    graph.output.extend(helper.make_tensor_value_info(n, TensorProto.INT32, None) for n in ("b_idx", "c_idx"))
    graph.output.append(helper.make_tensor_value_info("c_tokens", TensorProto.FLOAT, None))
    return onnx.shape_inference.infer_shapes(node, strict_mode=True)


def test_every_op_but_the_collectives_has_a_lowering():
    assert set(LOWERINGS) | set(COLLECTIVES) == set(OPS)
    assert set(COLLECTIVES) == {name for name, op in OPS.items() if "communicator" in op.needs}


def test_nodes_stay_and_one_function_per_specialisation():
    model = two_reroutings()
    before = model.SerializeToString()
    lowered = moe_onnx.lower(model)
    assert model.SerializeToString() == before, "the input model was modified"
    nodes = list(lowered.graph.node)
    assert [(n.domain, n.op_type, n.name) for n in nodes] == [
        (DOMAIN, "MoeReRoutingV2", n) for n in ("node", "second", "third")
    ]
    assert [list(n.attribute) for n in nodes] == [list(n.attribute) for n in model.graph.node]
    functions = {(f.domain, f.name, f.overload): f for f in lowered.functions}
    assert len(functions) == 2 and {n.overload for n in nodes} == {o for _, _, o in functions}
    assert (
        nodes[1].overload == nodes[2].overload == "expert_token_num_type=0,idx_type=1;float32,int32,-,-;2,2,-,-;11110"
    )
    assert nodes[0].overload == "expert_token_num_type=1,idx_type=0;float32,int32,-,-;2,2,-,-;11110"
    assert lowered.ir_version >= 10
    onnx.checker.check_model(lowered, full_check=True)
    assert moe_onnx.lower(lowered).SerializeToString() == lowered.SerializeToString(), "lowering twice changes it"


def test_functions_run_in_onnxruntime_and_inlined_everywhere(runner):
    model = two_reroutings()
    feeds = rerouting_inputs()
    want = moe_onnx.InferenceSession(model).run(None, feeds)
    functions, inlined = moe_onnx.lower(model), moe_onnx.lower(model, inline=True)
    assert not inlined.functions and all(n.domain != DOMAIN for n in inlined.graph.node)
    assert DOMAIN not in {o.domain for o in inlined.opset_import}
    assert all(n.name.startswith(("node/", "second/", "third/")) for n in inlined.graph.node)
    for model, runtimes in ((functions, ("onnxruntime",)), (inlined, ("onnxruntime", "reference"))):
        reply = runner.run(model, feeds)
        assert reply["checker"] is None, reply["checker"]
        for runtime in runtimes:
            for got, expected in zip(reply[runtime], want):
                assert_same_bits(got, expected, runtime)
    # onnx.reference (1.23) keys model-local functions by (domain, name): it runs the last
    # overload's body for every node, so with several specialisations of one op it is wrong
    # (docs/lowering.md); with one specialisation per op, it is right (tests/test_lower_ops.py)
    reference = runner.run(functions, feeds)["reference"]
    assert isinstance(reference, str) or any(
        got.tobytes() != expected.tobytes() for got, expected in zip(reference, want)
    ), "onnx.reference now resolves overloads: update docs/lowering.md and this test"


def test_lowered_model_still_runs_the_kernels_in_moe_onnx():
    model = two_reroutings()
    feeds = rerouting_inputs()
    want = moe_onnx.InferenceSession(model).run(None, feeds)
    for executor in ("split", "pyop"):
        got = moe_onnx.InferenceSession(moe_onnx.lower(model), executor=executor).run(None, feeds)
        for a, b in zip(got, want):
            assert_same_bits(a, b, executor)


def test_node_inside_a_subgraph_is_lowered(runner):
    inner = node_model("MoeReRoutingV2", rerouting_inputs(), {"idx_type": 1}, RR_OUTPUTS)
    branch = helper.make_graph(list(inner.graph.node), "then", [], [inner.graph.output[0]])
    other = helper.make_graph(
        [helper.make_node("Identity", ["tokens"], ["same"])],
        "else",
        [],
        [helper.make_tensor_value_info("same", TensorProto.FLOAT, None)],
    )
    graph = helper.make_graph(
        [helper.make_node("If", ["flag"], ["out"], then_branch=branch, else_branch=other)],
        "g",
        list(inner.graph.input) + [helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["A", "H"])],
    )
    model = helper.make_model(graph, opset_imports=list(inner.opset_import))
    feeds = dict(rerouting_inputs(), flag=np.array(True))
    want = moe_onnx.OPS["MoeReRoutingV2"](*rerouting_inputs().values(), idx_type=1)[0]
    for inline in (False, True):
        reply = runner.run(moe_onnx.lower(model, inline=inline), feeds)
        assert reply["checker"] is None, reply["checker"]
        assert_same_bits(reply["onnxruntime"][0], want, f"inline={inline}")


def test_refusals():
    inputs = rerouting_inputs()
    with pytest.raises(ValueError, match="opset, which must be >= 18"):
        moe_onnx.lower(node_model("MoeReRoutingV2", inputs, {}, RR_OUTPUTS, opset=17))
    e8m0 = dict(inputs, per_token_scales=np.ones((len(inputs["tokens"]), 2, 2), ml_dtypes.float8_e8m0fnu))
    with pytest.raises(LoweringError, match="float8e8m0 per_token_scales") as err:
        moe_onnx.lower(node_model("MoeReRoutingV2", e8m0, {}, RR_OUTPUTS))
    assert isinstance(err.value, moe_onnx.MoeOpError) and err.value.node_name == "node"
    bad = node_model("MoeReRoutingV2", inputs, {}, RR_OUTPUTS)
    bad.graph.node[0].attribute.append(helper.make_attribute("idx_type", 5))
    with pytest.raises(moe_onnx.MoeOpError, match="idx_type"):  # a node its op refuses is not lowered
        moe_onnx.lower(bad)


def test_unknown_input_type_is_refused():
    model = node_model("MoeReRoutingV2", rerouting_inputs(), {}, RR_OUTPUTS)
    node = model.graph.node[0]
    node.input[0] = "from_elsewhere"  # produced by an op no schema types
    model.graph.node.insert(0, helper.make_node("Mystery", ["tokens"], ["from_elsewhere"], domain="example.custom"))
    model.opset_import.append(helper.make_opsetid("example.custom", 1))
    with pytest.raises(LoweringError, match="element type of input 'tokens' .* is unknown"):
        moe_onnx.lower(model)


def test_unknown_input_rank_is_refused():
    """The body checks its op's shape rules per dim: an input without a shape cannot have them."""
    model = node_model("MoeReRoutingV2", rerouting_inputs(), {}, RR_OUTPUTS)
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(LoweringError, match="rank of input 'tokens' .* is unknown"):
        moe_onnx.lower(model)


def converted_ep_layer(directory) -> list[str]:
    paths = []
    for r in range(4):
        converted, report = insert_rerouting(onnx.load(os.path.join(EP_LAYER, f"rank{r}.onnx")))
        assert report.changed
        paths.append(os.path.join(directory, f"converted{r}.onnx"))
        onnx.save(converted, paths[-1])
    return paths


def test_converted_ep_layer_lowered_runs_on_4_ranks_with_only_all_to_all_left(tmp_path):
    config = LayerConfig()
    feeds = [{"x": x} for x in example_inputs(config, seed=5)]
    converted = converted_ep_layer(tmp_path)
    lowered = []
    for r, path in enumerate(converted):
        target = str(tmp_path / f"lowered{r}.onnx")
        assert cli.main(["lower", path, target, "--inline"]) == 0
        lowered.append(onnx.load(target))
        left = {n.op_type for n in lowered[-1].graph.node if n.domain == DOMAIN}
        assert left == {"AllToAll"}, left
    before = run_threads([onnx.load(p) for p in converted], feeds)
    after = run_threads(lowered, feeds)
    for (a,), (b,) in zip(before, after):
        assert_same_bits(b, a, "lowered EP layer")


def test_lower_file_keeps_external_data_external_and_the_input_untouched(tmp_path):
    model = node_model("MoeReRoutingV2", rerouting_inputs(), {}, RR_OUTPUTS)
    # feed the counts from a big initializer, stored as external data
    counts = rerouting_inputs()["expert_token_num_per_rank"]
    weight = numpy_helper.from_array(np.arange(4096, dtype=np.float32), "weight")
    model.graph.initializer.extend([numpy_helper.from_array(counts, "expert_token_num_per_rank"), weight])
    del model.graph.input[1]
    model.graph.output.append(helper.make_tensor_value_info("weight_copy", TensorProto.FLOAT, [4096]))
    model.graph.node.append(helper.make_node("Identity", ["weight"], ["weight_copy"]))
    source_dir, target_dir = tmp_path / "in", tmp_path / "out"
    source_dir.mkdir()
    target_dir.mkdir()
    source = str(source_dir / "model.onnx")
    onnx.save(model, source, save_as_external_data=True, location="weights.bin", size_threshold=0)
    files_before = {p: (source_dir / p).read_bytes() for p in os.listdir(source_dir)}
    target = str(target_dir / "lowered.onnx")
    lower_file(source, target)
    assert {p: (source_dir / p).read_bytes() for p in os.listdir(source_dir)} == files_before
    saved = onnx.load(target, load_external_data=False)
    stored = {t.name: t.data_location for t in saved.graph.initializer}
    assert stored["weight"] == TensorProto.EXTERNAL  # (onnx-ir keeps tensors under 256 bytes inline)
    assert os.path.exists(target_dir / "lowered.onnx.data")
    feeds = {"tokens": rerouting_inputs()["tokens"]}
    got = ort.InferenceSession(target).run(None, feeds)
    want = moe_onnx.OPS["MoeReRoutingV2"](feeds["tokens"], counts)
    assert_same_bits(got[0], want[0], "permute_tokens")
    assert_same_bits(got[-1], np.arange(4096, dtype=np.float32), "weight")
    with pytest.raises(UserError, match="never overwritten"):
        lower_file(source, source)
