"""Questions both executors ask of a graph: which nodes are ours, every value's type, and
each of our nodes bound to its operator definition with its static rules checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx

from ..custom_ops import ALL_OPS, DOMAIN, MoeOpError, OpDef, Signature, TensorInfo
from ..custom_ops.schemas import attribute_value, check_attribute_types
from ..custom_ops.tensor_info import UNKNOWN


@dataclass(frozen=True)
class BoundNode:
    """One of our nodes against its ``OpDef``: names per declared input/output (None = absent)."""

    op: OpDef
    name: str
    attrs: dict[str, Any]
    inputs: list[str | None]
    outputs: list[str | None]
    wanted: frozenset[str]  # declared names of the outputs the node names
    sig: Signature  # the node's inferred outputs


def bind_node(node: onnx.NodeProto, index: int, types: dict[str, TensorInfo]) -> BoundNode:
    """Resolve ``node`` (the ``index``-th of its graph) and check its static rules now, so a
    bad node fails at session creation, naming the node."""
    op = ALL_OPS.get((node.domain, node.op_type))
    if op is None:
        raise ValueError(
            f"unknown operator {node.domain}::{node.op_type} (node '{node.name}'); "
            f"known: {sorted(name for domain, name in ALL_OPS if domain == DOMAIN)}"
        )
    name = node.name or f"{node.op_type}_{index}"
    check_attribute_types(op, node.attribute, name)
    if len(node.output) > len(op.outputs):
        raise MoeOpError(
            f"has {len(node.output)} outputs; the op declares {len(op.outputs)} ({', '.join(op.output_names)})",
            op_type=op.name,
            node_name=name,
        )
    attrs = {a.name: attribute_value(a) for a in node.attribute}
    given = [value or None for value in node.input]  # extra inputs too: signature refuses them
    outputs = [node.output[i] if i < len(node.output) and node.output[i] else None for i in range(len(op.outputs))]
    infos = [None if value is None else types.get(value, UNKNOWN) for value in given]
    wanted = frozenset(decl.name for decl, value in zip(op.outputs, outputs) if value)
    sig = op.signature(infos, attrs, wanted, name)
    for decl, value in zip(op.outputs, outputs):
        _check_declared_type(op, name, decl.name, value, sig, types)
    inputs = given + [None] * (len(op.inputs) - len(given))
    return BoundNode(op, name, attrs, inputs, outputs, wanted, sig)


def _check_declared_type(op: OpDef, node_name: str, output: str, value: str | None, sig, types) -> None:
    """A type the graph declares for one of our outputs must be the one the op gives (a
    graph output declared DOUBLE for a bfloat16 result would come back mislabelled)."""
    promised = sig.outputs.get(output)
    declared = types.get(value) if value else None
    if promised is None or declared is None or declared.dtype is None or promised.dtype is None:
        return
    if declared.dtype != promised.dtype or (declared.rank is not None and declared.rank != promised.rank):
        where = f"{promised.dtype}" + ("" if promised.shape is None else f" of rank {len(promised.shape)}")
        raise MoeOpError(
            f"the graph declares '{value}' (output {output}) as {declared.dtype}"
            + ("" if declared.rank is None else f" of rank {declared.rank}")
            + f", but the op gives {where}",
            op_type=op.name,
            node_name=node_name,
        )


def ours(node: onnx.NodeProto) -> bool:
    """Is this node implemented by this library (rather than by onnxruntime)?"""
    return (node.domain, node.op_type) in ALL_OPS or node.domain == DOMAIN


def check_names(graph: onnx.GraphProto) -> None:
    """Every value is defined once (graph input, initializer or node output) and every graph
    output is named once: with a name defined twice a value would silently replace another.
    (An initializer may share a graph input's name: it is the input's default.)"""
    defined = {vi.name: "a graph input" for vi in graph.input}
    initializers = [(init.name, "an initializer") for init in graph.initializer if init.name not in defined]
    produced = [
        (name, f"an output of node '{node.name or node.op_type}'") for node in graph.node for name in node.output
    ]
    for name, source in initializers + produced:
        if name in defined:
            raise ValueError(f"'{name}' is defined twice in the graph: as {defined[name]} and as {source}")
        if name:
            defined[name] = source
    outputs = [vi.name for vi in graph.output]
    twice = sorted({name for name in outputs if outputs.count(name) > 1})
    if twice:
        raise ValueError(f"graph output(s) {twice} are listed more than once")


def reject_subgraph_ops(graph: onnx.GraphProto) -> None:
    """Refuse our nodes inside control-flow subgraphs, at any depth."""
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                for inner in sub.node:
                    if ours(inner):
                        raise ValueError(
                            f"cann.moe node '{inner.name or inner.op_type}' sits inside "
                            f"the subgraph of '{node.name or node.op_type}'; control-flow "
                            "subgraphs are not supported"
                        )
                reject_subgraph_ops(sub)
