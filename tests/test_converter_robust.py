"""GatherND as a chunk sort (torchtitan's ``rows[idx]``) converts; a rule that cannot evaluate
one all-to-all's region (a sequence value, a Loop: forms onnx.reference or numpy refuse) skips
that all-to-all with its reason; the others convert."""

from __future__ import annotations

import numpy as np
import onnx
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
