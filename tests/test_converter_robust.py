"""GatherND as a chunk sort (torchtitan's ``rows[idx]``) converts; a rule that cannot evaluate
one all-to-all's region (a sequence value, a Loop: forms onnx.reference or numpy refuse) skips
that all-to-all with its reason; the others convert."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from moe_onnx.converters import MovementMap, insert_rerouting
from moe_onnx.models.ep_layer import LayerConfig, build_rank_model, example_inputs, make_weights
from moe_onnx.ranks import run_threads


def test_a_rule_that_fails_on_one_all_to_all_skips_only_it(monkeypatch):
    config = LayerConfig(ranks=2)
    model = build_rank_model(config, make_weights(config), 0, "split_concat")
    _, before = insert_rerouting(model)
    assert before.entries[1].status == "converted"
    match = MovementMap.match

    def failing(self, received, facts, world):
        if received.producer().name == "all_to_all_dispatch":
            raise ValueError("setting an array element with a sequence.")
        return match(self, received, facts, world)

    monkeypatch.setattr(MovementMap, "match", failing)
    converted, report = insert_rerouting(model)
    by_name = {entry.node: entry for entry in report.entries}
    skipped = by_name["all_to_all_dispatch"]
    assert skipped.status == "skipped"
    assert any("ValueError: setting an array element with a sequence" in r for r in skipped.reasons)
    assert converted is model  # nothing else to convert: the model given comes back unchanged


def _gather_nd_layer(rank: int, config, weights):
    """The "gather_index" layer with its chunk sort written as torchtitan's dynamo export writes
    ``rows[idx]``: ``GatherND(rows, Unsqueeze(idx, 1))`` in place of ``Gather(rows, idx)``."""
    model = build_rank_model(config, weights, rank, "gather_index")
    graph = model.graph
    dispatch = next(n for n in graph.node if n.name == "all_to_all_dispatch")
    gather = next(n for n in graph.node if n.op_type == "Gather" and n.input[0] == dispatch.output[0])
    position = list(graph.node).index(gather)
    axes = onnx.numpy_helper.from_array(np.array([1], np.int64), "gather_nd_axes")
    graph.initializer.append(axes)
    column = helper.make_node("Unsqueeze", [gather.input[1], "gather_nd_axes"], ["gather_nd_index"], name="nd_index")
    replacement = helper.make_node("GatherND", [gather.input[0], "gather_nd_index"], list(gather.output), name="nd")
    graph.node.remove(gather)
    graph.node.insert(position, replacement)
    graph.node.insert(position, column)
    return model


def test_gather_nd_chunk_sort_converts_bit_identically():
    config = LayerConfig(ranks=2)
    weights = make_weights(config)
    models = [_gather_nd_layer(r, config, weights) for r in range(config.ranks)]
    converted = []
    for model in models:
        out, report = insert_rerouting(model)
        dispatch = next(e for e in report.entries if e.node == "all_to_all_dispatch")
        assert dispatch.status == "converted", report
        assert not any(n.op_type == "GatherND" for n in out.graph.node)
        converted.append(out)
    feeds = [{"x": x} for x in example_inputs(config)]
    for before, after in zip(run_threads(models, feeds), run_threads(converted, feeds)):
        np.testing.assert_array_equal(before[0], after[0])


def _dispatch_only(model: onnx.ModelProto, pattern: str) -> onnx.ModelProto:
    """``model`` cut after its chunk sort: the expert-major rows the experts would read are the
    graph's only output (a dispatch-only graph)."""
    graph = model.graph
    dispatch = next(n for n in graph.node if n.name == "all_to_all_dispatch")
    if pattern == "split_concat":
        sorted_rows = next(n for n in graph.node if n.op_type == "Concat" and n.input[0].startswith("split")).output[0]
    else:
        sorted_rows = next(n for n in graph.node if n.op_type == "Gather" and n.input[0] == dispatch.output[0]).output[
            0
        ]
    producers = {out: node for node in graph.node for out in node.output}
    keep, pending = set(), [sorted_rows]
    while pending:
        node = producers.get(pending.pop())
        if node is not None and id(node) not in keep:
            keep.add(id(node))
            pending += list(node.input)
    nodes = [n for n in graph.node if id(n) in keep]
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(sorted_rows, onnx.TensorProto.FLOAT, None))
    return model


@pytest.mark.parametrize("pattern", ["split_concat", "gather_index"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_sorted_rows_as_the_graph_output_convert(pattern, ranks):
    """Generated dispatch-only graphs: the reordered rows are a graph output, and they convert
    to MoeReRoutingV2 giving the same bits."""
    config = LayerConfig(ranks=ranks, local_experts=2)
    weights = make_weights(config, seed=ranks)
    models = [_dispatch_only(build_rank_model(config, weights, r, pattern), pattern) for r in range(ranks)]
    converted = []
    for model in models:
        out, report = insert_rerouting(model)
        assert next(e for e in report.entries if e.node == "all_to_all_dispatch").status == "converted", report
        assert any(n.op_type == "MoeReRoutingV2" for n in out.graph.node)
        converted.append(out)
    feeds = [{"x": x} for x in example_inputs(config, seed=ranks)]
    for before, after in zip(run_threads(models, feeds), run_threads(converted, feeds)):
        np.testing.assert_array_equal(before[0], after[0])


# ---------------------------------------------------------------------- sequences, Loop and If near a region
def _insert_before(graph: onnx.GraphProto, anchor: onnx.NodeProto, nodes: list[onnx.NodeProto]) -> None:
    position = list(graph.node).index(anchor)
    for offset, node in enumerate(nodes):
        graph.node.insert(position + offset, node)


def _repeat_interleave_chunks(model: onnx.ModelProto, condition: str) -> onnx.ModelProto:
    """The "gather_index" layer with the chunk of every received row, ``repeat_interleave(arange(N*L),
    sizes)``, written as the legacy exporter writes it: SplitToSequence of the sizes, a Loop that
    inserts ``Expand(i, sizes[i])`` into a sequence (its body reads the sizes from the outer scope),
    ConcatFromSequence. ``condition``: the Loop's cond input left empty ("") or a constant true."""
    graph = model.graph
    mod = next(n for n in graph.node if n.op_type == "Mod")
    sizes = next(n for n in graph.node if n.op_type == "CumSum").input[0]
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(True), "ri_true"))
    body = helper.make_graph(
        [
            helper.make_node("SequenceAt", ["ri_sizes", "i"], ["rep"], name="ri_at"),
            helper.make_node("Unsqueeze", ["i", "ri_axis"], ["i1"], name="ri_i1"),
            helper.make_node("Unsqueeze", ["rep", "ri_axis"], ["rep1"], name="ri_rep1"),
            helper.make_node("Expand", ["i1", "rep1"], ["rows_of_chunk"], name="ri_expand"),
            helper.make_node("SequenceInsert", ["chunks_in", "rows_of_chunk"], ["chunks_out"], name="ri_insert"),
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="ri_cond"),
        ],
        "repeat_interleave_body",
        [
            helper.make_tensor_value_info("i", onnx.TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", onnx.TensorProto.BOOL, []),
            helper.make_tensor_sequence_value_info("chunks_in", onnx.TensorProto.INT64, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", onnx.TensorProto.BOOL, []),
            helper.make_tensor_sequence_value_info("chunks_out", onnx.TensorProto.INT64, None),
        ],
        [onnx.numpy_helper.from_array(np.array([0], np.int64), "ri_axis")],
    )
    cond = "ri_true" if condition == "true" else ""
    _insert_before(
        graph,
        mod,
        [
            helper.make_node("SplitToSequence", [sizes], ["ri_sizes"], name="ri_split", keepdims=0),
            helper.make_node("SequenceLength", ["ri_sizes"], ["ri_count"], name="ri_count"),
            helper.make_node("SequenceEmpty", [], ["ri_empty"], name="ri_empty", dtype=onnx.TensorProto.INT64),
            helper.make_node("Loop", ["ri_count", cond, "ri_empty"], ["ri_chunks"], name="ri_loop", body=body),
            helper.make_node("ConcatFromSequence", ["ri_chunks"], ["ri_chunk"], name="ri_concat", axis=0),
        ],
    )
    mod.input[0] = "ri_chunk"
    return _without_dead_nodes(model)


def _without_dead_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    keep, pending = set(), [o.name for o in graph.output]
    while pending:
        node = producers.get(pending.pop())
        if node is None or id(node) in keep:
            continue
        keep.add(id(node))
        pending += list(node.input)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                pending += [name for inner in attr.g.node for name in inner.input]
    nodes = [n for n in graph.node if id(n) in keep]
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _if_around_sizes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The "split_concat" layer with the Split sizes of its chunk sort chosen by an If whose
    branches read them from the outer scope (``sizes if sizes.min() >= 0 else sizes``)."""
    graph = model.graph
    dispatch = next(n for n in graph.node if n.name == "all_to_all_dispatch")
    split = next(n for n in graph.node if n.op_type == "Split" and n.input[0] == dispatch.output[0])
    sizes = split.input[1]
    branches = {
        name: helper.make_graph(
            [helper.make_node("Identity", [sizes], [f"{name}_sizes"], name=f"if_{name}")],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_sizes", onnx.TensorProto.INT64, None)],
        )
        for name in ("then", "else")
    }
    graph.initializer.append(onnx.numpy_helper.from_array(np.array(0, np.int64), "if_zero"))
    _insert_before(
        graph,
        split,
        [
            helper.make_node("ReduceMin", [sizes], ["if_min"], name="if_min", keepdims=0),
            helper.make_node("GreaterOrEqual", ["if_min", "if_zero"], ["if_cond"], name="if_cond"),
            helper.make_node(
                "If",
                ["if_cond"],
                ["if_sizes"],
                name="if_sizes",
                then_branch=branches["then"],
                else_branch=branches["else"],
            ),
        ],
    )
    split.input[1] = "if_sizes"
    return model


def _rows_through_a_sequence(model: onnx.ModelProto) -> onnx.ModelProto:
    """The "split_concat" layer with its chunk sort written on a sequence value: SplitToSequence of
    the received rows by the (ragged) counts, SequenceAt per chunk, Concat expert-major."""
    graph = model.graph
    dispatch = next(n for n in graph.node if n.name == "all_to_all_dispatch")
    split = next(n for n in graph.node if n.op_type == "Split" and n.input[0] == dispatch.output[0])
    nodes = [helper.make_node("SplitToSequence", list(split.input), ["seq_rows"], name="seq_split", axis=0)]
    for i, chunk in enumerate(split.output):
        graph.initializer.append(onnx.numpy_helper.from_array(np.array(i, np.int64), f"seq_at_{i}"))
        nodes.append(helper.make_node("SequenceAt", ["seq_rows", f"seq_at_{i}"], [chunk], name=f"seq_at_{i}"))
    _insert_before(graph, split, nodes)
    graph.node.remove(split)
    return model


def _converted_and_same_bits(models, config):
    converted, reports = [], []
    for model in models:
        onnx.checker.check_model(model, full_check=True)
        out, report = insert_rerouting(model)
        reports.append(report)
        converted.append(out)
    feeds = [{"x": x} for x in example_inputs(config, seed=3)]
    for before, after in zip(run_threads(models, feeds), run_threads(converted, feeds)):
        np.testing.assert_array_equal(before[0], after[0])
    return converted, reports


@pytest.mark.parametrize("condition", ["empty", "true"])
def test_legacy_repeat_interleave_loop_converts_bit_identically(condition):
    """Counts read through SplitToSequence + Loop + ConcatFromSequence (ragged chunks: the Loop's
    sequence holds one tensor per chunk, each its own length) are probed through the Loop."""
    config = LayerConfig(ranks=2)
    weights = make_weights(config)
    models = [
        _repeat_interleave_chunks(build_rank_model(config, weights, r, "gather_index"), condition) for r in range(2)
    ]
    converted, reports = _converted_and_same_bits(models, config)
    for out, report in zip(converted, reports):
        dispatch = next(e for e in report.entries if e.node == "all_to_all_dispatch")
        assert dispatch.status == "converted" and len(dispatch.restores) == 1, report
        assert not any(n.op_type == "Loop" for n in out.graph.node)  # the index it fed is gone


def test_if_around_the_split_sizes_converts_bit_identically():
    config = LayerConfig(ranks=2)
    weights = make_weights(config)
    models = [_if_around_sizes(build_rank_model(config, weights, r, "split_concat")) for r in range(2)]
    _, reports = _converted_and_same_bits(models, config)
    for report in reports:
        assert next(e for e in report.entries if e.node == "all_to_all_dispatch").status == "converted", report


def test_rows_sorted_on_a_sequence_value_are_skipped_with_the_reason():
    """A chunk sort on a sequence value is not a movement region: skipped, saying what reads the
    rows; the model runs as it was."""
    config = LayerConfig(ranks=2)
    weights = make_weights(config)
    models = [_rows_through_a_sequence(build_rank_model(config, weights, r, "split_concat")) for r in range(2)]
    converted, reports = _converted_and_same_bits(models, config)
    for model, out, report in zip(models, converted, reports):
        dispatch = next(e for e in report.entries if e.node == "all_to_all_dispatch")
        assert dispatch.status == "skipped" and "SplitToSequence 'seq_split'" in " ".join(dispatch.reasons), report
        assert out is model
        assert str(report) and report.to_dict()["all_to_all"]


def test_the_cli_reports_each_all_to_all_of_hostile_files(tmp_path, capsys):
    """``moe-onnx convert`` on files that used to end in a traceback or a bare error (a ragged
    sequence value, two restores of one chunk sort): exit 0, the file written, every all-to-all in
    the text and JSON report with its status and, where skipped, its reason."""
    from moe_onnx.commands.cli import main as cli_main
    from tests.test_converters import _twin_restore

    config = LayerConfig(ranks=2)
    weights = make_weights(config)
    twin = ir.serde.deserialize_model(build_rank_model(config, weights, 0, "split_concat"))
    _twin_restore(twin)
    files = {
        "sequence": _rows_through_a_sequence(build_rank_model(config, weights, 0, "split_concat")),
        "loop": _repeat_interleave_chunks(build_rank_model(config, weights, 0, "gather_index"), "empty"),
        "two_restores": ir.serde.serialize_model(twin),
    }
    for name, model in files.items():
        onnx.save(model, tmp_path / f"{name}.onnx")
        report_path = tmp_path / f"{name}.json"
        code = cli_main(
            ["convert", str(tmp_path / f"{name}.onnx"), str(tmp_path / f"{name}_out.onnx")]
            + [
                "--json",
                str(report_path),
            ]
        )
        printed = capsys.readouterr()
        assert code == 0 and "Traceback" not in printed.out + printed.err, name
        assert (tmp_path / f"{name}_out.onnx").is_file()
        entries = json.loads(report_path.read_text())["all_to_all"]
        layer = {"all_to_all_counts", "all_to_all_dispatch", "all_to_all_combine"}
        assert {e["node"] for e in entries} == layer | ({"twin"} if name == "two_restores" else set())
        for entry in entries:
            assert entry["status"] in ("converted", "skipped"), (name, entry)
            assert entry["status"] == "converted" or entry["reasons"], (name, entry)
            assert f"'{entry['node']}': {entry['status']}" in printed.out, (name, printed.out)
