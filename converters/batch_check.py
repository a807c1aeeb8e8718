"""Is a chunk sort's constant traced from one batch? Warnings, per all-to-all.

A rewrite with constant counts (a capacity ``full([N, L], C)``, constant split sizes) is only
as right as those constants. Exporters freeze sizes the layer computes from its batch
(``int(capacity)``, ``.tolist()`` of the counts): such a graph runs, silently wrong or failing,
on another batch. Two checks, reported whether the rewrite is made or not:

* **symbolic token count** — the counts are constants but an input the all-to-all's rows are
  computed from has a symbolic dim: a capacity computed from the token count cannot be a
  constant (DeepSpeed's frozen at ``min_capacity`` by ``torch.export``);
* **synthetic batches** — the original graph is evaluated on the synthetic batches of
  :mod:`.world` (random, skewed; longer and shorter where a dim is symbolic), in the mirror
  world where every rank holds the batch, so every rank sends this rank what this rank sends
  rank r (r tried from 0 to N-1). The counts must agree with what the graph computes there:
  every rank's rows (the all-to-all's send counts) must be what the counts take from it, and
  the region must still be MoeReRoutingV2's order for them. The graph failing on a batch (a
  ``Split`` whose sizes no longer add up, a scatter index past the capacity) is reported too.

A graph the mirror world cannot evaluate (an op with no kernel here, too many weights) gets a
note that the check was not made, not a warning.

Every all-to-all, converted or not (:func:`traced_constants`), is also checked for the constants
a trace leaves where the routing is computed (a routing op, :data:`ROUTING_OPS`, reads values
computed from a graph input, and the rows sent are computed from it): send counts that are an
uneven constant (a capacity layout sends equal blocks; uneven counts can only be one batch's
routing), and a permutation of the rows (a Gather by an index) that is a constant, on either
side of the all-to-all, not in ascending order (a pattern a layout configures, such as
``repeat`` or ``arange``, is ascending; a sort by expert of one batch's routing is not).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .facts import GraphFacts
from .graph_utils import is_standard, upstream
from .movement import MOVEMENT, data_positions, expert_ranges, forward_region, row_ids, sources_of
from .sorts import ChunkSort
from .world import World, WorldFailure, WorldUnavailable, mirror_received


def symbolic_inputs(sort: ChunkSort) -> list[str]:
    """Graph inputs with a symbolic dim that the sent rows are computed from (``name [dims]``)."""
    data = sort.all_to_all.inputs[0]
    found = []
    for value in upstream(data, limit=20000):
        if value.producer() is None and not value.is_initializer() and value.const_value is None:
            dims = [] if value.shape is None else list(value.shape.dims)
            if value.shape is None or any(not isinstance(d, int) for d in dims):
                found.append(f"'{value.name}' {[d if isinstance(d, int) else str(d) for d in dims]}")
    return found


#: ops whose result is a routing decision: which expert (or rank) a row goes to
ROUTING_OPS = ("TopK", "ArgMax", "ArgMin", "NonZero")
#: movement ops that permute rows by an index input (position 1)
_GATHERS = ("Gather", "GatherND", "GatherElements")
#: how far up from the sent rows the routing is looked for
_UPSTREAM_LIMIT = 20000


def traced_constants(all_to_all: ir.Node, facts: GraphFacts) -> list[str]:
    """Warnings (``batch-specific: ...``) for the constants of one all-to-all that a trace of one
    batch leaves while the graph computes its routing (module doc); [] if there is none."""
    data = all_to_all.inputs[0] if all_to_all.inputs else None
    if data is None:
        return []
    router = _computed_routing(data, all_to_all.graph)
    if router is None:
        return []
    routed = f"the graph computes its routing ({router}, from its input)"
    warnings = []
    sends = all_to_all.inputs[1] if len(all_to_all.inputs) > 1 else None
    counts = facts.static(sends) if sends is not None else None
    if sends is not None and counts is not None and counts.size > 1 and len(np.unique(counts)) > 1:
        warnings.append(
            f"batch-specific: the send counts '{sends.name}' are the constant {counts.ravel().tolist()} while "
            f"{routed}: uneven constant counts are one batch's routing, and on another batch the graph sends the "
            "rows of that batch's counts, not of its own"
        )
    for gather, index, why in _constant_permutations(data, all_to_all, facts):
        shown = index.ravel()[:8].tolist()
        more = ", ..." if index.size > 8 else ""
        warnings.append(
            f"batch-specific: {gather.op_type} '{gather.name}' takes rows by the constant index "
            f"'{gather.inputs[1].name}' {str(shown)[:-1]}{more}] ({why}) while {routed}: the order or the "
            "selection of one batch's routing, which other batches do not follow"
        )
    return warnings


def _computed_routing(data: ir.Value, graph: ir.Graph | None) -> str | None:
    """``"TopK 'name'"``: a routing op computed from a graph input, the sent rows' own first (the
    rows of a traced dispatch need not be computed from it any more); None if there is none."""
    nearest = [v.producer() for v in upstream(data, limit=_UPSTREAM_LIMIT)]
    for node in [*nearest, *(graph or [])]:
        if node is None or node.op_type not in ROUTING_OPS or not is_standard(node) or not node.inputs:
            continue
        if any(_is_graph_input(v) for v in upstream(node.inputs[0], limit=_UPSTREAM_LIMIT)):
            return f"{node.op_type} '{node.name}'"
    return None


def _is_graph_input(value: ir.Value) -> bool:
    return value.producer() is None and value.is_graph_input() and not value.is_initializer()


def _constant_permutations(data: ir.Value, all_to_all: ir.Node, facts: GraphFacts):
    """``(gather node, index, why)`` for every row gather by a constant index among the movement
    ops that compute the sent rows and those that read the received rows, where the index is not
    ascending, or picks other than one contiguous range of rows that are themselves in an order
    the routing computed (the slots kept from a buffer sorted by expert)."""
    nodes: list[ir.Node] = []
    pending: list[ir.Value | None] = [data]
    seen: set[int] = set()
    while pending:  # up from the sent rows, through the data inputs of movement ops
        value = pending.pop()
        node = value.producer() if value is not None else None
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        positions = data_positions(node, MOVEMENT)
        if positions is None:
            continue
        nodes.append(node)
        pending.extend(node.inputs[i] for i in positions if i < len(node.inputs))
    try:
        nodes += forward_region(all_to_all.outputs[0]).nodes
    except Exception:  # a region that is not one (too large, mixing in other rows): nothing to read there
        pass
    for node in nodes:
        if node.op_type not in _GATHERS or not is_standard(node) or len(node.inputs) < 2:
            continue
        index = facts.static(node.inputs[1])
        if index is None or index.size < 2 or not np.issubdtype(index.dtype, np.integer):
            continue
        steps = np.diff(index.astype(np.int64).ravel())
        if np.any(steps < 0):
            yield node, index, "not ascending"
        elif np.any(steps != 1) and node.inputs[0] is not None and _computed_routing(node.inputs[0], None):
            yield node, index, "not one contiguous range, of rows ordered by the routing"


def check(sort: ChunkSort, world: World) -> tuple[list[str], list[str]]:
    """``(warnings, notes)`` for one matched chunk sort."""
    if sort.counts.value is not None:  # computed by the graph: nothing constant to check
        return [], []
    try:
        problem = _rows_per_expert(sort, world)
        if problem is None and sort.counts.is_constant:
            problem = _synthetic_batches(sort, world)
    except WorldUnavailable as why:
        return [], [f"batch check not made: {why}"]
    return ([f"batch-specific: {problem}"] if problem is not None else []), []


def _rows_per_expert(sort: ChunkSort, world: World) -> str | None:
    """Does the graph run on every synthetic batch, and, where the token count is symbolic,
    does the capacity change with it (a frozen capacity stays the same constant)?"""
    ranks, experts = sort.counts.ranks, sort.counts.experts
    assert ranks is not None  # capacity and constant counts have a static N
    all_to_all = sort.all_to_all
    data, sends = all_to_all.inputs[0], (all_to_all.inputs[1] if len(all_to_all.inputs) > 1 else None)
    assert data is not None  # the received rows are its output
    row = sort.layout["row"]
    seen: dict[int, list[str]] = {}
    for batch in world.batches():
        try:
            values = world.evaluate(batch, [v for v in (data, sends) if v is not None], ranks)
            received = mirror_received(
                values[data.name or ""], values.get(sends.name or "") if sends else None, ranks, 0
            )
        except WorldFailure as failure:
            return f"the original graph fails on {batch.describe()} at {failure.node}: {failure.message}"
        if not batch.name.startswith("skewed"):
            capacity = received.size // max(row, 1) // (ranks * experts)
            seen.setdefault(capacity, []).append(batch.describe())
    symbolic = symbolic_inputs(sort)
    constant = sort.counts.constant
    uniform = sort.counts.capacity or (constant is not None and len(np.unique(constant)) == 1)
    if symbolic and uniform and len(seen) == 1:
        (capacity,) = seen
        return (
            f"the capacity is the constant {capacity} rows per expert on every batch ({'; '.join(seen[capacity])}) "
            f"while the token count of {', '.join(symbolic)} is symbolic: if the layer computes its capacity from "
            "the token count (DeepSpeed, Megatron), the exporter froze the traced one and the graph holds only "
            "for that token count"
        )
    return None


def _synthetic_batches(sort: ChunkSort, world: World) -> str | None:
    """The first disagreement found on the synthetic batches, or None."""
    counts = sort.counts.constant
    assert counts is not None
    all_to_all = sort.all_to_all
    data = all_to_all.inputs[0]
    sends = all_to_all.inputs[1] if len(all_to_all.inputs) > 1 else None
    region_cut = sort.layout["cut"]
    row = sort.layout["row"]
    ranks = counts.shape[0]
    wanted = [v for v in (data, sends, *region_cut.free) if v is not None]
    for batch in world.batches():
        try:
            values = world.evaluate(batch, wanted, ranks)
        except WorldFailure as failure:
            return (
                f"the original graph fails on {batch.describe()} at {failure.node}: {failure.message} "
                f"(the rewrite relies on the counts {sort.counts.describe()})"
            )
        problems = []
        for rank in range(ranks):
            problem = _one_rank(sort, values, data, sends, region_cut, row, ranks, rank)
            if problem is None:
                break
            problems.append(problem)
        else:
            assert data is not None
            return (
                f"on {batch.describe()}, in a world where every rank holds that batch, for every rank index r: "
                f"{problems[0]} (shown for r = 0)"
            )
    return None


def _one_rank(sort: ChunkSort, values, data, sends, region_cut, row, ranks: int, rank: int) -> str | None:
    counts = sort.counts.constant
    assert counts is not None
    try:
        received = mirror_received(
            values[data.name or ""], values.get(sends.name or "") if sends else None, ranks, rank
        )
    except WorldFailure as failure:
        return failure.message
    rows_per_rank = received.size // max(row, 1) // ranks
    taken = counts.sum(axis=1)
    if np.any(taken != rows_per_rank):
        where = f" (the sizes {sort.layout['constant_of']})" if "constant_of" in sort.layout else ""
        return (
            f"every rank sends this rank {rows_per_rank} rows, but the counts {sort.counts.describe()}{where} take "
            f"{taken.tolist()} rows from ranks 0..{ranks - 1}"
        )
    feeds = {sort.received.name or "": row_ids(received.shape)}
    feeds.update({v.name or "": values[v.name or ""] for v in region_cut.free})
    try:
        outputs = region_cut(feeds)
    except Exception as error:
        return f"the movement region fails: {str(error).splitlines()[0][:200] if str(error) else type(error).__name__}"
    boundaries = sort.layout["region"].boundaries
    by_value = {id(v): out for v, out in zip(boundaries, outputs)}
    for piece in sort.pieces:
        source = sources_of(by_value[id(piece.value)], row, int(counts.sum()))
        if source is None or (piece.lo, piece.hi) not in expert_ranges(source, counts):
            return f"'{piece.value.name}' no longer holds the rows of experts {piece.lo}..{piece.hi - 1}"
    return None


__all__ = ["ROUTING_OPS", "check", "symbolic_inputs", "traced_constants"]
