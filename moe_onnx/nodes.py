"""Questions both executors ask of a graph: which nodes are ours, every value's type, and
each of our nodes bound to its operator definition with its static rules checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx

from .custom_ops import ALL_OPS, DOMAIN, OpDef, Signature, TensorInfo
from .custom_ops.schemas import attribute_value
from .custom_ops.tensor_info import UNKNOWN


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
    attrs = {a.name: attribute_value(a) for a in node.attribute}
    given = [value or None for value in node.input]  # extra inputs too: signature refuses them
    outputs = [node.output[i] if i < len(node.output) and node.output[i] else None for i in range(len(op.outputs))]
    infos = [None if value is None else types.get(value, UNKNOWN) for value in given]
    wanted = frozenset(decl.name for decl, value in zip(op.outputs, outputs) if value)
    sig = op.signature(infos, attrs, wanted, name)
    inputs = given + [None] * (len(op.inputs) - len(given))
    return BoundNode(op, name, attrs, inputs, outputs, wanted, sig)


def ours(node: onnx.NodeProto) -> bool:
    """Is this node implemented by this library (rather than by onnxruntime)?"""
    return (node.domain, node.op_type) in ALL_OPS or node.domain == DOMAIN


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


def value_types(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    """Element type and shape of every value the graph names (after shape inference).

    Ops implemented here but unknown to ``onnx.defs`` (``com.microsoft::AllToAll``) type
    their own outputs; those types are fed back so inference can continue past them.
    """
    scratch = onnx.ModelProto()
    scratch.CopyFrom(model)
    foreign = [
        n for n in scratch.graph.node if (n.domain, n.op_type) in ALL_OPS and not onnx.defs.has(n.op_type, n.domain)
    ]
    while True:
        graph = onnx.shape_inference.infer_shapes(scratch, strict_mode=False).graph
        types = {
            vi.name: TensorInfo.from_type_proto(vi.type)
            for vi in list(graph.input) + list(graph.value_info) + list(graph.output)
        }
        for init in graph.initializer:
            types[init.name] = TensorInfo.from_initializer(init)
        typed_more = False
        for node in foreign:
            op = ALL_OPS[(node.domain, node.op_type)]
            infos = [types.get(name) if name else None for name in node.input]
            try:
                sig = op.signature(infos, {a.name: attribute_value(a) for a in node.attribute})
            except Exception:  # noqa: BLE001 - rewrite() reports it with the node's name
                continue
            for name, decl in zip(node.output, op.outputs):
                info = sig.outputs.get(decl.name)
                if name and info is not None and info.dtype and types.get(name, UNKNOWN).dtype is None:
                    scratch.graph.value_info.append(info.value_info(name))
                    typed_more = True
        if not typed_more:
            return types
