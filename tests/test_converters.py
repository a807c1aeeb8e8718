"""insert_rerouting: bit-identical outputs, safety (idempotent, all-or-nothing), external data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.converters import InsertRerouting, insert_rerouting
from moe_onnx.models.ep_layer import PATTERNS, LayerConfig, build_rank_model, example_inputs, make_weights
from moe_onnx.ranks import run_threads


def layer_models(ranks, pattern, **overrides):
    config = LayerConfig(ranks=ranks, **overrides)
    weights = make_weights(config, seed=3)
    return config, [build_rank_model(config, weights, r, pattern) for r in range(ranks)]


def op_types(model):
    return [(n.domain, n.op_type) for n in model.graph.node]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_converted_layer_is_bit_identical(ranks, pattern):
    config, models = layer_models(ranks, pattern)
    converted = []
    for model in models:
        new, report = insert_rerouting(model)
        (entry,) = [e for e in report.entries if e.status == "converted"]
        assert entry.rule == "movement_map" and len(entry.restores) == 1 and "Gather" in entry.restores[0], str(report)
        assert op_types(new).count((moe_onnx.DOMAIN, "MoeReRoutingV2")) == 1
        # drop_pad's capacity is a constant of the graph while its token count T is symbolic:
        # the converter cannot tell a configured capacity from one frozen by the exporter, and says so
        assert bool(entry.warnings) == (pattern == "drop_pad"), entry.warnings
        converted.append(new)
    xs = example_inputs(config, seed=ranks)
    before = run_threads(models, [{"x": x} for x in xs])
    after = run_threads(converted, [{"x": x} for x in xs])
    for (a,), (b,) in zip(before, after):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_one_rank_is_an_identity_and_is_left_alone(pattern):
    """N = 1: rank-major is expert-major, there is nothing to reroute."""
    _, (model,) = layer_models(1, pattern)
    new, report = insert_rerouting(model)
    assert new is model and not report.changed
    assert any("nothing to reroute" in line for line in report.skipped), str(report)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_converted_model_passes_checker_and_shape_inference(pattern):
    _, models = layer_models(2, pattern)
    converted, _ = insert_rerouting(models[1])
    onnx.checker.check_model(converted, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(converted, strict_mode=True)
    types = {vi.name: vi.type.tensor_type for vi in inferred.graph.value_info}
    rerouting = next(n for n in converted.graph.node if n.op_type == "MoeReRoutingV2")
    assert types[rerouting.output[2]].elem_type == TensorProto.INT32
    if pattern != "drop_pad":  # onnx.defs has no schema for com.microsoft::AllToAll's output type
        assert types[rerouting.output[0]].elem_type == TensorProto.FLOAT


def test_split_concat_removes_the_chunk_sort_and_restore():
    _, models = layer_models(2, "split_concat")
    converted, report = insert_rerouting(models[0])
    kinds = op_types(converted)
    # the sort (Split + Concat), the experts' split by rows per expert and the restore (Concat +
    # Split + Concat) are gone; the experts now split MoeReRoutingV2's rows by its expert_token_num,
    # and their outputs are concatenated once, for the restore's Gather
    assert kinds.count(("", "Split")) == 1 and kinds.count(("", "Concat")) == 1
    split = next(n for n in converted.graph.node if n.op_type == "Split")
    cast = next(n for n in converted.graph.node if n.output[0] == split.input[1])
    rerouting = next(n for n in converted.graph.node if n.op_type == "MoeReRoutingV2")
    assert split.input[0] == rerouting.output[0] and cast.input[0] == rerouting.output[3]
    assert len(report.replaced) == 10 and len(report.added) == 5


def test_second_run_changes_nothing():
    _, models = layer_models(2, "gather_index")
    once, _ = insert_rerouting(models[0])
    twice, report = insert_rerouting(once)
    assert twice is once and not report.changed
    assert any("already converted" in s for s in report.skipped)


def test_model_without_match_is_returned_unchanged():
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph)
    before = model.SerializeToString()
    same, report = insert_rerouting(model)
    assert same is model and model.SerializeToString() == before and not report.changed


def test_input_model_is_not_modified():
    _, models = layer_models(2, "split_concat")
    before = models[0].SerializeToString()
    insert_rerouting(models[0])
    assert models[0].SerializeToString() == before


def _twin_restore(model: ir.Model, prefix: str = "") -> None:
    """A second inverse of the dispatch's chunk sort (the restore's Split + Concat again), sent by
    its own all-to-all to a new graph output: two restores of one chunk sort."""
    combine = next(n for n in model.graph if n.name == f"{prefix}all_to_all_combine")
    restore_concat = combine.inputs[0].producer()
    restore_split = restore_concat.inputs[0].producer()
    order = [list(restore_split.outputs).index(v) for v in restore_concat.inputs]
    twin_split = ir.node(
        "Split", list(restore_split.inputs), {"axis": 0}, num_outputs=len(restore_split.outputs), name="twin_split"
    )
    twin_concat = ir.node("Concat", [twin_split.outputs[i] for i in order], {"axis": 0}, name="twin_concat")
    twin_send = ir.node(
        "AllToAll", [twin_concat.outputs[0], combine.inputs[1]], domain=moe_onnx.DOMAIN, num_outputs=2, name="twin"
    )
    twin_send.outputs[0].name = "twin"
    model.graph.extend([twin_split, twin_concat, twin_send])
    model.graph.outputs.append(twin_send.outputs[0])


def test_ambiguous_match_is_skipped_with_the_reason_and_nothing_changes():
    """Two restores of one chunk sort, each sent by an all-to-all: that all-to-all is skipped, its
    reason names both (text and JSON); nothing changes."""
    _, models = layer_models(2, "split_concat")
    model = ir.serde.deserialize_model(models[0])
    _twin_restore(model)
    before = ir.serde.serialize_model(model).SerializeToString()
    rewrite = InsertRerouting()
    rewrite(model)
    report = rewrite.report
    assert not report.changed
    dispatch = next(e for e in report.entries if e.node == "all_to_all_dispatch")
    assert dispatch.status == "skipped"
    reason = " ".join(dispatch.reasons)
    assert "ambiguous" in reason and "2 restores" in reason and "twin_concat" in reason, reason
    assert "ambiguous" in str(report) and "twin_concat" in str(report)
    (as_json,) = [e for e in report.to_dict()["all_to_all"] if e["node"] == "all_to_all_dispatch"]
    assert as_json["status"] == "skipped" and any("2 restores" in r for r in as_json["reasons"])
    assert ir.serde.serialize_model(model).SerializeToString() == before


def _two_layers(first: onnx.ModelProto, second: onnx.ModelProto) -> onnx.ModelProto:
    """``second``'s layer (names prefixed ``l2/``) applied to ``first``'s output."""
    for model in (first, second):
        del model.metadata_props[:]  # which pattern built it: they differ
    return onnx.compose.merge_models(first, second, io_map=[("y", "x")], prefix2="l2/")


def test_an_ambiguous_layer_leaves_the_other_layers_to_convert():
    """Two MoE layers in one graph; the first has two restores: it is skipped with its reason, the
    second converts, and the model computes the same bits."""
    config, first = layer_models(2, "split_concat")
    _, second = layer_models(2, "gather_index")
    models = []
    for r in range(2):
        merged = ir.serde.deserialize_model(_two_layers(first[r], second[r]))
        _twin_restore(merged)
        models.append(ir.serde.serialize_model(merged))
    converted = []
    for model in models:
        out, report = insert_rerouting(model)
        by_node = {e.node: e for e in report.entries}
        assert by_node["all_to_all_dispatch"].status == "skipped", report
        assert "2 restores" in " ".join(by_node["all_to_all_dispatch"].reasons), report
        assert by_node["l2/all_to_all_dispatch"].status == "converted", report
        assert sum(n.op_type == "MoeReRoutingV2" for n in out.graph.node) == 1
        converted.append(out)
    feeds = [{"x": x} for x in example_inputs(config, seed=5)]
    for before, after in zip(run_threads(models, feeds), run_threads(converted, feeds)):
        for a, b in zip(before, after):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_a_second_inverse_that_no_all_to_all_sends_is_left_as_it_is():
    """The restore is what the return all-to-all sends; another inverse (here a graph output)
    keeps reading the experts' outputs, which the rewrite leaves as they were."""
    config, models = layer_models(2, "split_concat")
    twins = []
    for model in models:
        graph = model.graph
        combine = next(n for n in graph.node if n.name == "all_to_all_combine")
        restore_concat = next(n for n in graph.node if n.output[0] == combine.input[0])
        graph.output.append(helper.make_tensor_value_info(restore_concat.output[0], TensorProto.FLOAT, None))
        twins.append(insert_rerouting(model))
    for _, report in twins:
        (entry,) = [e for e in report.entries if e.status == "converted"]
        assert len(entry.restores) == 1
    xs = example_inputs(config, seed=5)
    before = run_threads(models, [{"x": x} for x in xs])
    after = run_threads([c for c, _ in twins], [{"x": x} for x in xs])
    for outs_a, outs_b in zip(before, after):
        for a, b in zip(outs_a, outs_b):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_gather_with_a_different_index_is_skipped_with_a_reason():
    """A Gather after the AllToAll that is not the expert-major order is not rewritten."""
    _, models = layer_models(2, "gather_index")
    model = ir.serde.deserialize_model(models[0])
    mod = next(n for n in model.graph if n.op_type == "Mod")
    mod.inputs[1].const_value = ir.tensor(np.array(3, np.int64))  # chunk id mod 3: another order
    result, report = insert_rerouting(model)
    assert not report.changed
    dispatch = next(line for line in report.skipped if "all_to_all_dispatch" in line)
    assert "does not hold the expert-major rows of a range of local experts" in dispatch, report.skipped


def test_other_domains_all_to_all_by_name():
    """An all-to-all from another exporter (op type 'all_to_all') is recognised by name."""
    _, models = layer_models(2, "split_concat")
    model = onnx.ModelProto()
    model.CopyFrom(models[0])
    for node in model.graph.node:
        if node.op_type == "AllToAll":
            node.domain, node.op_type = "custom.dist", "all_to_all"
    model.opset_import.append(helper.make_opsetid("custom.dist", 1))
    _, report = insert_rerouting(model)
    assert len(report.matched) == 1


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "moe_onnx.commands.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_keeps_external_data_external_and_input_untouched(tmp_path):
    config, models = layer_models(2, "gather_index", hidden=32, ffn=64)
    for r, model in enumerate(models):
        onnx.save(
            model,
            tmp_path / f"in{r}.onnx",
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"in{r}.onnx.data",
            size_threshold=0,
        )
    originals = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    for r in range(2):
        result = cli("convert", str(tmp_path / f"in{r}.onnx"), str(tmp_path / f"out{r}.onnx"))
        assert result.returncode == 0, result.stderr
        assert "matched 1 chunk sort" in result.stdout and "1 converted" in result.stdout
        assert "2 skipped" in result.stdout
    assert {p: (tmp_path / p).read_bytes() for p in originals} == originals
    converted = onnx.load(tmp_path / "out0.onnx", load_external_data=False)
    external = [t for t in converted.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert external and all(
        e.value == "out0.onnx.data" for t in external for e in t.external_data if e.key == "location"
    )
    xs = example_inputs(config, seed=1)
    before = run_threads([str(tmp_path / f"in{r}.onnx") for r in range(2)], [{"x": x} for x in xs])
    after = run_threads([str(tmp_path / f"out{r}.onnx") for r in range(2)], [{"x": x} for x in xs])
    for (a,), (b,) in zip(before, after):
        assert np.array_equal(a, b)


def test_external_weights_are_not_read_to_convert(tmp_path):
    """Convert with the external data file gone: only references are touched."""
    _, models = layer_models(2, "split_concat", hidden=32, ffn=64)
    onnx.save(
        models[0],
        tmp_path / "m.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="m.onnx.data",
        size_threshold=1024,
    )  # weights external, small constants inline
    model = ir.load(tmp_path / "m.onnx")
    shutil.move(tmp_path / "m.onnx.data", tmp_path / "elsewhere.data")
    rewrite = InsertRerouting()
    rewrite(model)
    assert rewrite.report.changed
    weights = [v.const_value for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)]
    assert weights and all(not os.path.exists(w.path) for w in weights)


def test_cli_refuses_to_overwrite_input(tmp_path):
    _, models = layer_models(1, "split_concat")
    onnx.save(models[0], tmp_path / "m.onnx")
    result = cli("convert", str(tmp_path / "m.onnx"), str(tmp_path / "m.onnx"))
    assert result.returncode != 0 and "never overwritten" in result.stderr
