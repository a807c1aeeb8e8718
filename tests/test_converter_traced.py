"""Constants a trace of one batch leaves where the graph computes its routing are reported
batch-specific at every all-to-all, converted or not: uneven constant send counts, a constant
order of the rows (a Gather by a traced sort), a constant selection from rows the routing
ordered (the slots a traced capacity keeps). The graphs here are the example layer with those
values replaced by what they were on one batch; on another batch they compute other values than
the layer (or fail), which is what the warning says."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from moe_onnx.converters import BatchSpecificGraph, insert_rerouting
from moe_onnx.models.ep_layer import PATTERNS, LayerConfig, build_rank_model, example_inputs, make_weights
from moe_onnx.ranks import RankFailure, run_threads
from tests.test_converter_robust import _rows_through_a_sequence

CONFIG = LayerConfig(ranks=2)
TRACED = ("the send counts", "takes rows by the constant index")


def _traced(models: list[onnx.ModelProto], pick) -> list[onnx.ModelProto]:
    """Each model with the values ``pick(graph)`` names replaced by initializers holding what they
    were on the example batch (their producers removed, or the output renamed away)."""
    names = [pick(m.graph) for m in models]
    probes = []
    for model, wanted in zip(models, names):
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        probe.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in wanted)
        probes.append(probe)
    outputs = run_threads(probes, [{"x": x} for x in example_inputs(CONFIG)])
    result = []
    for model, wanted, values in zip(models, names, outputs):
        traced = onnx.ModelProto()
        traced.CopyFrom(model)
        for name, value in zip(wanted, values[1:]):
            producer = next(n for n in traced.graph.node if name in n.output)
            if len(producer.output) == 1:
                traced.graph.node.remove(producer)
            else:
                producer.output[list(producer.output).index(name)] = f"{name}_untraced"
            traced.graph.initializer.append(numpy_helper.from_array(value, name))
        result.append(traced)
    return result


def _dispatch_send_counts_and_sort(graph: onnx.GraphProto) -> list[str]:
    """The dispatch's send counts and the stable sort of the slots by expert (TopK's indices)."""
    dispatch = next(n for n in graph.node if n.name == "all_to_all_dispatch")
    sort = [n for n in graph.node if n.op_type == "TopK"][1]  # the first is the router's
    return [dispatch.input[1], sort.output[1]]


def _capacity_slots(graph: onnx.GraphProto) -> list[str]:
    """The index picking, from the rows sorted by expert, the slots each expert's capacity keeps."""
    dispatch = next(n for n in graph.node if n.name == "all_to_all_dispatch")
    gather = next(n for n in graph.node if n.output[0] == dispatch.input[0])
    return [gather.input[1]]


def _models(pattern: str):
    weights = make_weights(CONFIG)
    return [build_rank_model(CONFIG, weights, r, pattern) for r in range(CONFIG.ranks)]


def _wrong_elsewhere(original, traced) -> None:
    """On another batch the traced graph fails or computes other values than the layer."""
    feeds = [{"x": x} for x in example_inputs(CONFIG, seed=9)]
    want = run_threads(original, feeds)
    try:
        got = run_threads(traced, feeds)
    except RankFailure:
        return
    assert max(float(np.abs(w[0] - g[0]).max()) for w, g in zip(want, got)) > 1e-2


def _warnings(report, node: str) -> list[str]:
    return next(e for e in report.entries if e.node == node).warnings


def test_traced_send_counts_and_sort_are_batch_specific():
    original = _models("split_concat")
    traced = _traced(original, _dispatch_send_counts_and_sort)
    for model in traced:
        converted, report = insert_rerouting(model)
        dispatch = next(e for e in report.entries if e.node == "all_to_all_dispatch")
        assert dispatch.status == "converted", report
        text = " ".join(dispatch.warnings)
        assert "the send counts" in text and "are the constant [" in text and "TopK" in text, report
        assert "(not ascending)" in text, report
        assert report.to_dict()["batch_specific"] == ["all_to_all_dispatch"]
        assert "WARNING: batch-specific graph" in str(report)
        with pytest.raises(BatchSpecificGraph):
            insert_rerouting(model, strict=True)
    _wrong_elsewhere(original, traced)


def test_traced_capacity_slots_are_batch_specific():
    original = _models("drop_pad")
    traced = _traced(original, _capacity_slots)
    for model in traced:
        _, report = insert_rerouting(model)
        text = " ".join(_warnings(report, "all_to_all_dispatch"))
        assert "takes rows by the constant index" in text, report
        assert "(not ascending)" in text or "(not one contiguous range, of rows ordered by the routing)" in text
    _wrong_elsewhere(original, traced)


def test_an_all_to_all_left_as_it_is_is_warned_too():
    """The same traced constants before a chunk sort the converter does not take (rows sorted on a
    sequence value): skipped, and warned."""
    traced = [_rows_through_a_sequence(m) for m in _traced(_models("split_concat"), _dispatch_send_counts_and_sort)]
    for model in traced:
        out, report = insert_rerouting(model)
        dispatch = next(e for e in report.entries if e.node == "all_to_all_dispatch")
        assert dispatch.status == "skipped" and out is model, report
        assert any(w.startswith("batch-specific: the send counts") for w in dispatch.warnings), report
        assert report.batch_specific


@pytest.mark.parametrize("pattern", PATTERNS)
def test_computed_counts_and_orders_are_not_warned(pattern):
    """The layer as built (send counts, sorts and slots computed) has none of these warnings."""
    for model in _models(pattern):
        _, report = insert_rerouting(model)
        warnings = [w for e in report.entries for w in e.warnings]
        assert not [w for w in warnings if any(t in w for t in TRACED)], warnings
