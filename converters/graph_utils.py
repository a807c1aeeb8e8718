"""Small questions asked of an onnx-ir graph by the rewrite rules."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np
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


def is_standard(node: ir.Node) -> bool:
    """Is ``node`` an op of the standard ONNX domain?"""
    return node.domain in ("", "ai.onnx")


def upstream(
    value: ir.Value | None, through=lambda node: True, stop=lambda value: False, limit: int | None = None
) -> Iterator[ir.Value]:
    """``value`` and the values it is computed from, nearest first, each once; the walk goes
    up through producer nodes for which ``through(node)`` holds, not above values for which
    ``stop(value)`` holds, and ends after ``limit`` values."""
    seen: set[int] = set()
    pending: deque[ir.Value | None] = deque([value])
    while pending and (limit is None or len(seen) < limit):
        current = pending.popleft()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        node = current.producer()
        if node is not None and through(node) and not stop(current):
            pending.extend(node.inputs)


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs of ``node``'s attributes (a Loop's body, an If's branches)."""
    found: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            found.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            found.extend(attr.value)
    return found


def outer_reads(node: ir.Node) -> list[ir.Value]:
    """The values of enclosing graphs that ``node``'s subgraphs read by name (at any depth)."""
    defined: set[int] = set()
    reads: dict[int, ir.Value] = {}
    pending = subgraphs(node)
    while pending:
        graph = pending.pop()
        defined.update(id(v) for v in graph.inputs)
        defined.update(id(v) for v in graph.initializers.values())
        for inner in graph:
            defined.update(id(v) for v in inner.outputs)
            reads.update((id(v), v) for v in inner.inputs if v is not None)
            pending.extend(subgraphs(inner))
    return [v for key, v in reads.items() if key not in defined]


def reads(node: ir.Node) -> list[ir.Value | None]:
    """What ``node`` reads: its inputs, then what its subgraphs read from outside them."""
    return [*node.inputs, *outer_reads(node)] if subgraphs(node) else list(node.inputs)


def int_attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def op_node(
    op: OpDef, inputs: list[ir.Value | None], attrs: dict, name: str, optional_outputs: Iterable[str] = ()
) -> ir.Node:
    """A node of ``op`` named ``name``, its attributes checked by the op's definition, with every
    declared output up to the last one wanted (the required ones and ``optional_outputs``), each
    named ``{name}/{output name}``."""
    op.bind_attrs(attrs, name)  # refuses what the op would refuse
    wanted = set(optional_outputs)
    unknown = wanted - {o.name for o in op.outputs}
    if unknown:
        raise ValueError(f"{op.name} has no output {sorted(unknown)}")
    last = max(i for i, o in enumerate(op.outputs) if not o.optional or o.name in wanted)
    declared = [o.name for o in op.outputs[: last + 1]]
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


def run_together(graph: ir.Graph, nodes: list[ir.Node]) -> bool:
    """Reorder ``graph`` so that ``nodes`` (in graph order) run back to back, where the data
    flow allows; whether it does (else the graph is unchanged).

    The nodes between the first and the last of ``nodes`` that read nothing computed from
    them move before them, the others after them; each part keeps its order. That is a valid
    order unless one of ``nodes`` reads what another node computes from them (a node with
    subgraphs, whose reads are not all its inputs, also stops it)."""
    order = list(graph)
    members = {id(node) for node in nodes}
    positions = [i for i, node in enumerate(order) if id(node) in members]
    if not positions or len(positions) != len(members):
        return False
    first, last = positions[0], positions[-1]
    before: list[ir.Node] = []
    together: list[ir.Node] = []
    after: list[ir.Node] = []
    from_members: set[int] = set()  # values computed from the members
    from_after: set[int] = set()  # values computed by the nodes that must follow them
    for node in order[first : last + 1]:
        reads = {id(v) for v in node.inputs if v is not None}
        if id(node) in members:
            if reads & from_after:
                return False
            together.append(node)
        elif subgraphs(node):
            return False
        elif reads & from_members:
            after.append(node)
            from_after.update(id(v) for v in node.outputs)
        else:
            before.append(node)
            continue
        from_members.update(id(v) for v in node.outputs)
    reordered = order[:first] + before + together + after + order[last + 1 :]
    if reordered != order:
        graph.remove(order)
        graph.extend(reordered)
    return True


#: (narrower, wider) element types whose round trip through the wider one is exact
EXACT_WIDENINGS = {
    (ir.DataType.INT32, ir.DataType.INT64),
    (ir.DataType.FLOAT16, ir.DataType.FLOAT),
    (ir.DataType.BFLOAT16, ir.DataType.FLOAT),
    (ir.DataType.FLOAT, ir.DataType.DOUBLE),
}


def skip_round_trip_cast(graph: ir.Graph, node: ir.Node) -> bool:
    """Where ``node`` is ``Cast(Cast(v, wider), v's type)`` of an exact widening
    (:data:`EXACT_WIDENINGS`), its readers read ``v`` instead and the casts left unread are
    removed; whether it was. Exact for every value but a signalling NaN, which the float
    widenings quiet (its payload kept)."""
    if node.op_type != "Cast" or not is_standard(node) or node.graph is None or node.inputs[0] is None:
        return False
    inner = node.inputs[0].producer()
    if inner is None or inner.op_type != "Cast" or not is_standard(inner):
        return False
    source, out = inner.inputs[0], node.outputs[0]
    if source is None or (source.dtype, int_attr(inner, "to", 0)) not in EXACT_WIDENINGS:
        return False
    if int_attr(node, "to", 0) != source.dtype or out.is_graph_output():
        return False
    ir.convenience.replace_all_uses_with(out, source)
    remove_dead(graph, [node])
    return True
