"""Pure data movement around the experts: which received rows each expert input holds.

Between an all-to-all's received rows and the first ops that compute with them (the experts'
MatMul, Einsum, ...), exporters write the chunk sort with movement ops only: :data:`MOVEMENT`
(and, between the experts' outputs and the return all-to-all, :data:`RESTORE_MOVEMENT`, which
adds the scatters). Their other inputs (shapes, split sizes, slice bounds, gather indices) are
*size expressions*. Nothing here reads a spelling: a region is cut out of the graph with its
size expressions (:func:`cut`) and evaluated (``onnx.reference``) on probe rows, tensors whose
elements are their own ids (:func:`row_ids`); what comes out says, for every value the experts
read, which received rows it holds and in which order (:func:`sources_of`), and that is
compared with MoeReRoutingV2's order (:func:`expert_ranges`).

Index directions: ``gather[k]`` (:func:`orders`) is the received row at expert-major position
``k`` (destination -> source); ``scatter[s]`` is the expert-major position of received row
``s`` (source -> destination, MoeReRoutingV2's ``idx_type=1`` index, which the restore gathers by).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from moe_onnx.custom_ops.moe_re_routing_v2 import gather_index, rerouting_blocks

from .errors import Skip
from .evaluators import reference_evaluator
from .facts import GraphFacts, _small_array
from .graph_utils import is_all_to_all, is_standard, reads

#: op type -> positions of its data inputs (None: all of them); its other inputs are sizes
MOVEMENT: dict[str, tuple[int, ...] | None] = {
    "Reshape": (0,),
    "Transpose": (0,),
    "Split": (0,),
    "Slice": (0,),
    "Gather": (0,),
    "GatherND": (0,),  # x[idx] as torchtitan's dynamo export writes it: GatherND(rows, idx[R, 1])
    "GatherElements": (0,),
    "Concat": None,
    "Squeeze": (0,),
    "Unsqueeze": (0,),
    "Flatten": (0,),
    "Identity": (0,),
}
#: a restore may also scatter rows into zeros (``ScatterND(zeros, index[:, None], y)``)
RESTORE_MOVEMENT: dict[str, tuple[int, ...] | None] = {**MOVEMENT, "ScatterND": (0, 2), "ScatterElements": (0, 2)}
#: ops that read only a value's shape
SIZE_OPS = ("Shape", "Size")
#: a region this large is not a chunk sort
MAX_REGION_NODES = 2000


def data_positions(node: ir.Node, ops: dict[str, tuple[int, ...] | None]) -> tuple[int, ...] | None:
    """Positions of ``node``'s data inputs if it is a standard movement op of ``ops``, else None."""
    if not is_standard(node) or node.op_type not in ops:
        return None
    positions = ops[node.op_type]
    return tuple(range(len(node.inputs))) if positions is None else positions


def row_size(dims: tuple[int | None, ...] | None) -> int | None:
    """Elements per row of a tensor of ``dims``: its last dim (1-D tensors: rows are scalars)."""
    if dims is None or len(dims) == 0:
        return None
    return 1 if len(dims) == 1 else dims[-1]


# ---------------------------------------------------------------------- regions
@dataclass
class Region:
    """Movement nodes downstream of ``source`` and the values non-movement ops read from them."""

    source: ir.Value
    nodes: list[ir.Node]  # graph order
    inside: set[int]  # ids of the source and of every value the region computes
    boundaries: list[ir.Value]  # values read by a non-movement op (or graph outputs), in graph order


def forward_region(received: ir.Value) -> Region:
    """The movement region after ``received``; raises :class:`Skip` if it mixes in other data."""
    inside: dict[int, ir.Value] = {id(received): received}
    nodes: dict[int, ir.Node] = {}
    boundaries: dict[int, ir.Value] = {}
    pending = [received]
    while pending:
        value = pending.pop()
        if value.is_graph_output():
            boundaries[id(value)] = value
        for use in value.uses():
            node = use.node
            if node.op_type in SIZE_OPS and is_standard(node):
                continue  # a size expression reads it
            positions = data_positions(node, MOVEMENT)
            if positions is None or use.idx not in positions:
                boundaries[id(value)] = value
                continue
            if id(node) in nodes:
                continue
            nodes[id(node)] = node
            if len(nodes) > MAX_REGION_NODES:
                raise Skip(f"more than {MAX_REGION_NODES} movement ops follow it")
            for out in node.outputs:
                inside[id(out)] = out
                pending.append(out)
    for node in nodes.values():
        positions = data_positions(node, MOVEMENT) or ()
        for i in positions:
            read = node.inputs[i] if i < len(node.inputs) else None
            if read is not None and id(read) not in inside:
                raise Skip(f"{node.op_type} '{node.name}' mixes the received rows with '{read.name}'")
    graph = received.graph
    ordered = [n for n in graph if id(n) in nodes] if graph is not None else list(nodes.values())
    position = {id(v): i for i, n in enumerate(ordered) for v in n.outputs}
    listed = sorted(boundaries.values(), key=lambda v: position.get(id(v), -1))
    return Region(received, ordered, set(inside), listed)


def data_downstream(values: Iterable[ir.Value]) -> tuple[dict[int, set[int]], list[ir.Node]]:
    """For every value computed from ``values`` through data edges (not through Shape / Size, not
    past an all-to-all): ``{id(value): {index of each given value it is computed from}}``; and the
    all-to-all nodes where that ends."""
    reach: dict[int, set[int]] = {}
    ends: dict[int, ir.Node] = {}
    for index, start in enumerate(values):
        pending = [start]
        seen: set[int] = set()
        while pending:
            value = pending.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            reach.setdefault(id(value), set()).add(index)
            for use in value.uses():
                node = use.node
                if node.op_type in SIZE_OPS and is_standard(node):
                    continue
                if is_all_to_all(node):
                    if use.idx == 0:
                        ends[id(node)] = node
                    continue
                pending.extend(node.outputs)
    graph = next((n.graph for n in ends.values() if n.graph is not None), None)
    ordered = [n for n in graph if id(n) in ends] if graph is not None else list(ends.values())
    return reach, ordered


def return_region(target: ir.Value, stop: set[int]) -> tuple[list[ir.Node], list[ir.Value]]:
    """The restore movement nodes that compute ``target``, walking up its data inputs, and the
    values where the walk ends (experts' outputs, ``stop`` values, constants)."""
    nodes: dict[int, ir.Node] = {}
    leaves: dict[int, ir.Value] = {}
    pending: list[ir.Value | None] = [target]
    while pending:
        value = pending.pop()
        if value is None:
            continue
        node = value.producer()
        positions = None if node is None or id(value) in stop else data_positions(node, RESTORE_MOVEMENT)
        if positions is None or node is None:
            leaves[id(value)] = value
            continue
        if id(node) in nodes:
            continue
        nodes[id(node)] = node
        if len(nodes) > MAX_REGION_NODES:
            raise Skip(f"more than {MAX_REGION_NODES} movement ops compute '{target.name}'")
        pending.extend(node.inputs[i] for i in positions if i < len(node.inputs))
    graph = target.graph
    ordered = [n for n in graph if id(n) in nodes] if graph is not None else list(nodes.values())
    return ordered, list(leaves.values())


# ---------------------------------------------------------------------- cuts and probes
@dataclass
class Cut:
    """``targets`` computed from ``sources`` (and ``free`` values) by standard ops and constants.

    ``free`` are the values the cut reads that nothing in it computes: graph inputs, outputs of
    other domains' ops (an AllGather's counts...), the shapes of values outside the region, large
    constants. Values the graph computes the same whatever the batch (``GraphFacts.static``) are
    folded into ``constants``.
    """

    targets: list[ir.Value]
    sources: list[ir.Value]
    nodes: list[ir.Node] = field(default_factory=list)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    free: list[ir.Value] = field(default_factory=list)
    _evaluator: object = None

    def reads(self, value: ir.Value) -> bool:
        """Whether a node of the cut (or a target) reads ``value``."""
        return any(value is v for n in self.nodes for v in reads(n)) or any(value is t for t in self.targets)

    def model(self, opset: int) -> onnx.ModelProto:
        from onnx import helper, numpy_helper

        inputs = [v for v in (*self.sources, *self.free) if self.reads(v)]
        graph = helper.make_graph(
            [ir.serde.serialize_node(n) for n in self.nodes],
            "probe",
            [helper.make_tensor_value_info(v.name or "", onnx.TensorProto.UNDEFINED, None) for v in inputs],
            [helper.make_tensor_value_info(v.name or "", onnx.TensorProto.UNDEFINED, None) for v in self.targets],
            [numpy_helper.from_array(np.asarray(a), k) for k, a in self.constants.items()],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])

    def __call__(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The targets on ``feeds`` (by source / free value name); raises what the ops raise."""
        if self._evaluator is None:
            graph = self.targets[0].graph
            opset = graph.opset_imports.get("", 21) if graph is not None else 21
            self._evaluator = reference_evaluator(self.model(opset))
        names = set(self._evaluator.input_names)  # type: ignore[attr-defined]
        results = self._evaluator.run(None, {k: v for k, v in feeds.items() if k in names})  # type: ignore[attr-defined]
        return [np.asarray(r) for r in results]


def cut(
    targets: list[ir.Value], sources: list[ir.Value], inside: set[int], facts: GraphFacts, limit: int = 4000
) -> Cut:
    """The cut computing ``targets`` from ``sources``. ``inside``: ids of the values computed from
    the sources (the region): the shape of any other value is a free value of the cut."""
    source_ids = {id(v) for v in sources}
    nodes: dict[int, ir.Node] = {}
    constants: dict[int, ir.Value] = {}
    free: dict[int, ir.Value] = {}
    pending: list[ir.Value | None] = list(targets)
    seen: set[int] = set()
    while pending:
        value = pending.pop()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if id(value) in source_ids:
            continue
        if value.is_initializer() or value.const_value is not None:
            (constants if _small_array(value) is not None else free)[id(value)] = value
            continue
        node = value.producer()
        if (
            node is None
            or not is_standard(node)
            or (node.op_type in SIZE_OPS and node.inputs and id(node.inputs[0]) not in inside)
        ):
            free[id(value)] = value
            continue
        if id(node) not in nodes:
            nodes[id(node)] = node
            if len(nodes) > limit:
                raise Skip(f"the size expressions of '{targets[0].name}' take more than {limit} nodes")
            pending.extend(reads(node))  # a Loop / If: its inputs and what its subgraphs read outside
    result = Cut(list(targets), list(sources))
    result.constants = {v.name or "": _small_array(v) for v in constants.values()}  # type: ignore[misc]
    _fold_static(result, nodes, free, source_ids, facts)
    return result


def _fold_static(result: Cut, nodes: dict[int, ir.Node], free: dict[int, ir.Value], sources: set[int], facts) -> None:
    """Fold the values computed from free values only that are the same on every probe of the
    unknown dims (``GraphFacts.static``), drop what only they needed."""
    by_output = {id(v): n for n in nodes.values() for v in n.outputs}
    depends: dict[int, bool] = {}  # value id -> computed from a source (not only from free values)

    def from_source(value: ir.Value | None) -> bool:
        if value is None:
            return False
        if id(value) in sources:
            return True
        if id(value) in depends:
            return depends[id(value)]
        node = by_output.get(id(value))
        depends[id(value)] = False
        depends[id(value)] = node is not None and any(from_source(v) for v in reads(node))
        return depends[id(value)]

    frontier: dict[int, ir.Value] = {}
    for node in nodes.values():
        if from_source(node.outputs[0]) or any(id(v) in {id(t) for t in result.targets} for v in node.outputs):
            for value in reads(node):
                if value is not None and not from_source(value) and id(value) not in sources:
                    frontier[id(value)] = value
    for target in result.targets:
        if not from_source(target):
            frontier[id(target)] = target
    folded: dict[int, np.ndarray] = {}
    for key, value in frontier.items():
        if value.const_value is not None or value.is_initializer():
            continue
        static = facts.static(value)
        if static is not None:
            folded[key] = static
    needed: dict[int, ir.Node] = {}
    used_free: dict[int, ir.Value] = {}
    pending: list[ir.Value | None] = list(result.targets)
    seen: set[int] = set()
    while pending:
        value = pending.pop()
        if value is None or id(value) in seen or id(value) in sources:
            continue
        seen.add(id(value))
        if id(value) in folded:
            result.constants[value.name or ""] = folded[id(value)]
            continue
        if id(value) in free:
            used_free[id(value)] = value
            continue
        producer = by_output.get(id(value))
        if producer is not None and id(producer) not in needed:
            needed[id(producer)] = producer
            pending.extend(reads(producer))
    graph = result.targets[0].graph
    result.nodes = [n for n in graph if id(n) in needed] if graph is not None else list(needed.values())
    names = {v.name for n in result.nodes for v in reads(n) if v is not None} | {v.name for v in result.targets}
    result.constants = {k: v for k, v in result.constants.items() if k in names}
    result.free = list(used_free.values())


# ---------------------------------------------------------------------- reading probes
#: probe rows are at most this many elements (int32 ids: 128 MiB; a static [E*C, H] of a real
#: layer fits, a graph whose rows would not gets a Skip, not an allocation)
MAX_PROBE_ELEMENTS = 1 << 25


def row_ids(shape: tuple[int, ...]) -> np.ndarray:
    """``shape`` filled with the element ids ``1, 2, ...`` (int32; 0 marks no row: padding, a
    scatter's zeros); :class:`Skip` past MAX_PROBE_ELEMENTS."""
    if math.prod(shape) > MAX_PROBE_ELEMENTS:
        raise Skip(f"probe rows {list(shape)} would take more than {MAX_PROBE_ELEMENTS} elements")
    return np.arange(1, math.prod(shape) + 1, dtype=np.int32).reshape(shape)


def sources_of(array: np.ndarray, size: int, rows: int | None = None) -> np.ndarray | None:
    """The source row of every row of ``array`` (element ids of rows of ``size`` elements), or
    None if some row is not one whole source row in order (or ``rows`` is exceeded)."""
    values = np.asarray(array)
    if size > 1 and (values.ndim == 0 or values.shape[-1] != size):
        return None
    if np.issubdtype(values.dtype, np.integer):
        flat = values.astype(np.int64, copy=False).reshape(-1, size)
    elif np.issubdtype(values.dtype, np.floating):  # a region op computed in float: ids stay exact below 2^24
        flat = np.rint(values).astype(np.int64).reshape(-1, size)
        if not np.array_equal(flat, values.reshape(-1, size)):
            return None
    else:
        return None
    if flat.size == 0:
        return np.zeros(0, np.int64)
    if flat.min() < 1:
        return None
    source = (flat[:, 0] - 1) // size
    if rows is not None and source.max() >= rows:
        return None
    expected = source[:, None] * size + 1 + np.arange(size)
    return source if np.array_equal(flat, expected) else None


def orders(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(gather, scatter, offsets)`` of MoeReRoutingV2 for ``counts [N, L]``: ``gather[k]`` the
    received row at expert-major position k, ``scatter[s]`` the position of received row s, and
    ``offsets[e]`` where expert e's rows start (``offsets[L]`` = A)."""
    counts = np.asarray(counts, np.int64)
    gather = gather_index(*rerouting_blocks(counts))
    scatter = np.empty_like(gather)
    scatter[gather] = np.arange(len(gather))
    totals = counts.sum(axis=0)
    return gather, scatter, np.concatenate([[0], np.cumsum(totals)])


def expert_ranges(source: np.ndarray, counts: np.ndarray) -> set[tuple[int, int]]:
    """Every expert range ``[lo, hi)`` (hi > lo) whose expert-major rows are exactly ``source``."""
    gather, _, offsets = orders(counts)
    experts = len(offsets) - 1
    found = set()
    for lo in range(experts):
        if len(source) and (offsets[lo] >= len(gather) or gather[offsets[lo]] != source[0]):
            continue
        for hi in range(lo + 1, experts + 1):
            length = offsets[hi] - offsets[lo]
            if length > len(source):
                break
            if length == len(source) and np.array_equal(gather[offsets[lo] : offsets[hi]], source):
                found.add((lo, hi))
    return found


def lead_pattern(shapes: list[tuple[int, ...]], row_rank: int) -> list[int] | None:
    """The leading dims (before the ``row_rank`` row dims) of a value seen at ``shapes``: a dim
    equal in every probe stays, one that varies is ``-1``; None if more than one varies (or a
    constant dim after the first is 0: Reshape would copy it from the rows)."""
    ranks = {len(s) for s in shapes}
    if len(ranks) != 1:
        return None
    lead = [s[: len(s) - row_rank] for s in shapes]
    pattern = [d[0] if len(set(d)) == 1 else -1 for d in zip(*lead)]
    if pattern.count(-1) > 1 or 0 in pattern[1:]:  # a leading 0 is copied from the rows' (0) count
        return None
    return pattern


__all__ = [
    "MOVEMENT",
    "RESTORE_MOVEMENT",
    "Cut",
    "Region",
    "cut",
    "data_downstream",
    "expert_ranges",
    "forward_region",
    "lead_pattern",
    "orders",
    "return_region",
    "row_ids",
    "row_size",
    "sources_of",
]
