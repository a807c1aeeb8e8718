"""Small questions asked of an onnx-ir graph by the rewrite rules."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
import onnx_ir as ir

from moe_onnx.custom_ops import OpDef

#: (domain, op_type) of the all-to-all ops recognised by default; any op whose type reads
#: "alltoall" once lower-cased and stripped of "_" is recognised too (other exporters' names)
DEFAULT_ALL_TO_ALL = (("cann.moe", "AllToAll"), ("com.microsoft", "AllToAll"))


def is_all_to_all(node: ir.Node, known: Iterable[tuple[str, str]] = DEFAULT_ALL_TO_ALL) -> bool:
    return (node.domain, node.op_type) in set(known) or node.op_type.lower().replace("_", "") == "alltoall"


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant content (initializer or Constant node), else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def produced_by(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The producer of ``value`` if it is a standard-domain ``op_type`` node."""
    node = None if value is None else value.producer()
    return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def consumers(value: ir.Value) -> list[ir.Node]:
    return list(dict.fromkeys(use.node for use in value.uses()))


def int_attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def flattened_from(value: ir.Value | None) -> ir.Value | None:
    """``x`` when ``value = Reshape(x, [-1])``."""
    reshape = produced_by(value, "Reshape")
    if reshape is None:
        return None
    shape = constant(reshape.inputs[1])
    return reshape.inputs[0] if shape is not None and shape.tolist() == [-1] else None


def static_columns(value: ir.Value) -> int | None:
    """Dim 1 of a 2-D tensor: from its shape, else through an AllToAll (which keeps it) and a
    Reshape to a constant 2-D shape."""
    shape = value.shape
    if shape is not None and len(shape) == 2 and isinstance(shape[1], int):
        return shape[1]
    node = value.producer()
    if node is not None and is_all_to_all(node) and node.inputs and node.inputs[0] is not None:
        return static_columns(node.inputs[0])
    reshape = produced_by(value, "Reshape")
    target = constant(reshape.inputs[1]) if reshape is not None else None
    if target is not None and target.shape == (2,) and target[1] > 0:
        return int(target[1])
    return None


def backward_slice(target: ir.Value, source: ir.Value) -> tuple[list[ir.Node], list[ir.Value]] | None:
    """Nodes computing ``target`` from ``source`` and constants only (topological order),
    plus the constants they read; None if anything else feeds in."""
    nodes: dict[int, ir.Node] = {}
    constants: list[ir.Value] = []
    stack: list[ir.Value | None] = [target]
    while stack:
        value = stack.pop()
        if value is source or value is None:
            continue
        if value.is_initializer() or value.const_value is not None:
            constants.append(value)
            continue
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        stack.extend(node.inputs)
    ordered = [n for n in target.graph if id(n) in nodes] if target.graph is not None else list(nodes.values())
    return ordered, list(dict.fromkeys(constants))


def slice_model(
    nodes: list[ir.Node], constants: list[ir.Value], source: ir.Value, target: ir.Value, opset: int
) -> onnx.ModelProto:
    """A standalone ONNX model computing ``target`` from ``source`` (for probing)."""
    from onnx import helper, numpy_helper

    protos = [ir.serde.serialize_node(n) for n in nodes]
    # the small constants of an index computation, read even when stored externally
    initializers = []
    for v in constants:
        assert v.const_value is not None  # backward_slice takes initializers, which hold their tensor
        initializers.append(numpy_helper.from_array(v.const_value.numpy(), v.name))
    # onnx-ir names every node output and graph input of a graph as it joins it
    assert source.name is not None and target.name is not None
    source_type = helper.make_tensor_value_info(source.name, onnx.TensorProto.INT64, None)
    graph = helper.make_graph(
        protos,
        "probe",
        [source_type],
        [helper.make_tensor_value_info(target.name, onnx.TensorProto.UNDEFINED, None)],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def op_node(op: OpDef, inputs: list[ir.Value | None], attrs: dict, name: str) -> ir.Node:
    """A node of ``op`` named ``name``, its attributes checked by the op's definition, with
    every declared output that is not optional, named ``{name}/{output name}``."""
    op.bind_attrs(attrs, name)  # refuses what the op would refuse
    declared = [o.name for o in op.outputs if not o.optional]
    node = ir.node(op.name, inputs, attrs, domain=op.domain, num_outputs=len(declared), name=name)
    for value, output_name in zip(node.outputs, declared):
        value.name = f"{name}/{output_name}"
    return node


def output(node: ir.Node, op: OpDef, name: str) -> ir.Value:
    """The output of ``node`` (a node of ``op``) that ``op`` declares as ``name``."""
    return node.outputs[op.output_names.index(name)]


def remove_dead(graph: ir.Graph, start: Iterable[ir.Node]) -> list[str]:
    """Remove ``start`` nodes and every producer that becomes unused because of it.

    Only nodes upstream of ``start`` are touched: dead code the graph already had stays.
    Returns the removed node names.
    """
    removed: list[str] = []
    pending = list(start)
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if id(node) in seen or node.graph is None:
            continue
        if any(out.uses() or out.is_graph_output() for out in node.outputs):
            continue
        seen.add(id(node))
        inputs = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        removed.append(node.name or node.op_type)
        for value in inputs:
            producer = value.producer()
            if producer is not None:
                pending.append(producer)
            elif value.is_initializer() and not value.uses() and not value.is_graph_input():
                assert value.name is not None  # initializers are keyed by their names
                graph.initializers.pop(value.name, None)  # read only by what was removed
    return removed
