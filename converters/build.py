"""Making the replacement nodes: unique names, constants, and taking over the old values."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from moe_onnx.custom_ops import OpDef

from .graph_utils import op_node


class Builder:
    """Collects the new nodes of one replacement site and inserts them before an anchor node.

    Names are ``{prefix}/{what}``, made unique in the graph; ``added`` lists every node made.
    """

    def __init__(self, graph: ir.Graph, prefix: str):
        self.graph = graph
        self.prefix = prefix
        self.added: list[ir.Node] = []
        self._pending: list[ir.Node] = []
        self._names = {n.name for n in graph} | {v.name for v in graph.initializers.values()}
        self._names |= {v.name for n in graph for v in n.outputs} | {v.name for v in graph.inputs}

    def name(self, what: str) -> str:
        base = f"{self.prefix}/{what}"
        name, i = base, 1
        while name in self._names:
            name, i = f"{base}_{i}", i + 1
        self._names.add(name)
        return name

    def node(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attrs: dict | None = None,
        *,
        what: str = "",
        num_outputs: int = 1,
    ) -> ir.Node:
        """A standard-domain node; its outputs are named after it."""
        name = self.name(what or op_type.lower())
        node = ir.node(op_type, list(inputs), attrs or {}, num_outputs=num_outputs, name=name)
        for i, value in enumerate(node.outputs):
            value.name = name if num_outputs == 1 else self.name(f"{what or op_type.lower()}_{i}")
        self._pending.append(node)
        return node

    def op(
        self,
        op: OpDef,
        inputs: Sequence[ir.Value | None],
        attrs: dict,
        *,
        what: str,
        optional_outputs: Sequence[str] = (),
    ) -> ir.Node:
        """A node of one of our ops, built from its definition (``graph_utils.op_node``)."""
        node = op_node(op, list(inputs), attrs, self.name(what), optional_outputs)
        for value in node.outputs:
            self._names.add(value.name)
        self._pending.append(node)
        return node

    def ints(self, what: str, values: Sequence[int] | np.ndarray) -> ir.Value:
        """An int64 initializer."""
        array = np.asarray(values, np.int64)
        name = self.name(what)
        value = ir.val(name, ir.DataType.INT64, list(array.shape), const_value=ir.tensor(array, name=name))
        self.graph.register_initializer(value)
        return value

    def reshape(self, value: ir.Value, shape: Sequence[int], what: str = "reshape") -> ir.Value:
        return self.node("Reshape", [value, self.ints(f"{what}_shape", shape)], what=what).outputs[0]

    def insert_before(self, anchor: ir.Node) -> None:
        self.graph.insert_before(anchor, self._pending)
        self.added += self._pending
        self._pending = []

    def take_over(self, old: ir.Value, new: ir.Value) -> None:
        """Every use of ``old`` (graph outputs included) now reads ``new``, under ``old``'s name."""
        name = old.name
        if old.type is not None:
            new.type = old.type
        if old.shape is not None:
            new.shape = old.shape
        old.replace_all_uses_with(new, replace_graph_outputs=True)
        old.name = self.name("replaced")
        new.name = name
