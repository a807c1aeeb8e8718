"""converters.graph_utils' reordering and cast helpers on small hand-built onnx-ir graphs."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from moe_onnx.converters.graph_utils import run_together, skip_round_trip_cast


def _value(name: str, dtype=ir.DataType.FLOAT) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape([2, 3]))


def _node(op: str, inputs, name: str, **attrs) -> ir.Node:
    node = ir.node(op, inputs, attrs, name=name)
    node.outputs[0].name = name
    return node


def _run(graph: ir.Graph, feeds: dict) -> list[np.ndarray]:
    model = ir.Model(graph, ir_version=10)
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _graph_abc():
    """a = Relu(x); side = Neg(y) (reads neither a nor b); after = Sigmoid(a) (reads a);
    b = Abs(a); out = Add(b, side), after also an output. Order: a, side, after, b, out."""
    x, y = _value("x"), _value("y")
    a = _node("Relu", [x], "a")
    side = _node("Neg", [y], "side")
    after = _node("Sigmoid", [a.outputs[0]], "after")
    b = _node("Abs", [a.outputs[0]], "b")
    out = _node("Add", [b.outputs[0], side.outputs[0]], "out")
    graph = ir.Graph([x, y], [out.outputs[0], after.outputs[0]], nodes=[a, side, after, b, out], opset_imports={"": 20})
    return graph, a, b, side, after


def test_run_together_moves_independent_nodes_before_and_readers_after():
    graph, a, b, side, after = _graph_abc()
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 3, "y": np.ones((2, 3), np.float32)}
    want = _run(graph, feeds)
    assert run_together(graph, [a, b])
    assert [n.name for n in graph] == ["side", "a", "b", "after", "out"]
    for got, expected in zip(_run(graph, feeds), want):
        assert np.array_equal(got, expected)


def test_run_together_refuses_when_a_member_reads_a_node_that_must_follow():
    graph, a, _, _, after = _graph_abc()
    # c reads `after`, which reads a: c cannot join a without `after` between them
    c = _node("Exp", [after.outputs[0]], "c")
    graph.append(c)
    before = [n.name for n in graph]
    assert not run_together(graph, [a, c])
    assert [n.name for n in graph] == before


def test_run_together_refuses_nodes_not_in_the_graph():
    graph, a, *_ = _graph_abc()
    stray = _node("Relu", [a.outputs[0]], "stray")
    assert not run_together(graph, [a, stray])


def test_a_widening_round_trip_cast_is_skipped_and_a_narrowing_one_kept():
    ids = ir.Value(name="ids", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([4]))
    wide = _node("Cast", [ids], "wide", to=ir.DataType.INT64)
    back = _node("Cast", [wide.outputs[0]], "back", to=ir.DataType.INT32)
    used = _node("Neg", [back.outputs[0]], "used")
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4]))
    narrow = _node("Cast", [x], "narrow", to=ir.DataType.FLOAT16)
    again = _node("Cast", [narrow.outputs[0]], "again", to=ir.DataType.FLOAT)  # not exact: kept
    graph = ir.Graph(
        [ids, x], [used.outputs[0], again.outputs[0]], nodes=[wide, back, used, narrow, again], opset_imports={"": 20}
    )
    feeds = {"ids": np.array([1, -2, 3, 2**31 - 1], np.int32), "x": np.array([0.1, 1e5, -3.3, 7], np.float32)}
    want = _run(graph, feeds)
    assert skip_round_trip_cast(graph, back)
    assert not skip_round_trip_cast(graph, again)
    assert [n.name for n in graph] == ["used", "narrow", "again"]
    assert used.inputs[0] is ids
    for got, expected in zip(_run(graph, feeds), want):
        assert np.array_equal(got, expected)


def test_a_round_trip_that_is_a_graph_output_stays_and_a_shared_widening_survives():
    ids = ir.Value(name="ids", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([4]))
    wide = _node("Cast", [ids], "wide", to=ir.DataType.INT64)
    back = _node("Cast", [wide.outputs[0]], "back", to=ir.DataType.INT32)  # a graph output: kept
    again = _node("Cast", [wide.outputs[0]], "again", to=ir.DataType.INT32)
    used = _node("Neg", [again.outputs[0]], "used")
    graph = ir.Graph(
        [ids],
        [back.outputs[0], used.outputs[0], wide.outputs[0]],
        nodes=[wide, back, again, used],
        opset_imports={"": 20},
    )
    feeds = {"ids": np.array([1, -2, 3, 2**31 - 1], np.int32)}
    want = _run(graph, feeds)
    assert not skip_round_trip_cast(graph, back)
    assert skip_round_trip_cast(graph, again)
    assert [n.name for n in graph] == ["wide", "back", "used"]  # wide is still read (an output)
    for got, expected in zip(_run(graph, feeds), want):
        assert np.array_equal(got, expected)


def test_run_together_refuses_a_node_with_a_subgraph_between():
    """A node with a subgraph may read any outer value: it is not moved, nor is anything."""
    graph, a, b, side, _ = _graph_abc()

    def branch_body(name: str) -> ir.Graph:
        constant = ir.node("Constant", [], {"value": ir.tensor(np.zeros((2, 3), np.float32))}, name=name)
        return ir.Graph([], [constant.outputs[0]], nodes=[constant])

    cond = ir.Value(name="cond", type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    branch = ir.node(
        "If", [cond], {"then_branch": branch_body("then"), "else_branch": branch_body("else")}, name="branch"
    )
    graph.insert_after(side, branch)
    before = [n.name for n in graph]
    assert not run_together(graph, [a, b])
    assert [n.name for n in graph] == before
