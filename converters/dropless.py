"""Dropless chunk sorts: the block sizes are the received counts, computed from the data.

* :class:`SplitConcat` — ``torch.split(rows, sizes)`` + ``torch.cat`` in expert-major order
  (Megatron's ``sort_chunks_by_idxs``); the sizes may be any expression of the counts;
* :class:`GatherIndex` — ``rows[index]`` with the index computed from the counts.

Both are recognised by what their sizes / index compute: the expression is cut out of the graph
and evaluated (``onnx.reference``) on probe counts, zeros included.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from moe_onnx.custom_ops.moe_re_routing_v2 import gather_index, rerouting_blocks

from .build import Builder
from .errors import BatchSpecific, Skip
from .facts import Expression, GraphFacts
from .graph_utils import constant, consumers, int_attr, is_standard, produced_by, sole_reader, upstream
from .sorts import ChunkSort, Counts, Restore, downstream, expert_major_order, factorisations, rank_major_order

_INDEX_TYPES = (ir.DataType.INT64, ir.DataType.INT32)


def _probes(shape: tuple[int, ...], dtype: ir.DataType) -> Iterator[np.ndarray]:
    """Counts of ``shape`` to tell an expression of the counts from another: small random
    ones (the first with a zero block), all zeros, large ones (past any clip or constant a
    look-alike may hold, e.g. ``Min(counts, 8)``) and one large block among zeros."""
    rng = np.random.default_rng(0)
    probes = [rng.integers(0, 5, shape) for _ in range(3)]
    probes += [np.zeros(shape, np.int64), rng.integers(1000, 4096, shape), np.zeros(shape, np.int64)]
    probes[0].flat[0] = 0
    probes[-1].flat[-1] = 1 << 16
    for probe in probes:
        yield probe.astype(dtype.numpy())


def _row_dims(received: ir.Value, facts: GraphFacts) -> tuple[int | None, ...] | None:
    dims = facts.shape(received)
    return None if dims is None else dims[1:]


def _concat_of_all_chunks(split: ir.Node) -> ir.Node:
    """The single Concat (axis 0) that consumes every output of ``split`` exactly once."""
    users = {id(n): n for out in split.outputs for n in consumers(out)}
    if len(users) != 1:
        raise Skip(f"the chunks of Split '{split.name}' are used by {len(users)} nodes, not one Concat")
    concat = next(iter(users.values()))
    if concat.op_type != "Concat" or int_attr(concat, "axis") != 0:
        raise Skip(f"the chunks of Split '{split.name}' feed {concat.op_type} '{concat.name}', not Concat(axis=0)")
    if sorted(id(v) for v in concat.inputs) != sorted(id(v) for v in split.outputs):
        raise Skip(f"Concat '{concat.name}' does not take every chunk of Split '{split.name}' once")
    return concat


def _chunk_order(split: ir.Node, concat: ir.Node) -> list[int]:
    """Which chunk of ``split`` each input of ``concat`` is, in Concat order."""
    position = {id(v): i for i, v in enumerate(split.outputs)}
    return [position[id(v)] for v in concat.inputs]


def _candidates(sizes: ir.Value, limit: int = 300) -> Iterator[ir.Value]:
    """Values upstream of ``sizes`` through standard ops, nearest first."""
    return upstream(sizes, through=is_standard, limit=limit)


def _computes(expression: Expression, source_shape: tuple[int, ...], dtype: ir.DataType, want) -> bool:
    """``expression(probe) == want(probe)`` on every probe."""
    for probe in _probes(source_shape, dtype):
        try:
            got = expression(probe)
        except Exception:  # the probe made the expression fail: it is not this computation
            return False
        expected = want(probe.astype(np.int64))
        if got.shape != expected.shape or not np.array_equal(got.astype(np.int64), expected):
            return False
    return True


class SplitConcat:
    """``Split(rows, sizes)`` + ``Concat`` of the chunks in expert-major order (chunk r*L + e at e*N + r).

    ``sizes`` is any expression of counts ``[N, L]`` that equals ``counts.ravel()`` (Megatron
    dynamo: a ``Concat`` of N*L scalar chains ``Reshape(Gather(Reshape(Squeeze(Slice(...)))))``
    of counts reached through an AllGather). Replacement: the Concat's output is the permuted
    rows. Constant sizes are converted only if the AllToAll's send counts are static too;
    otherwise they were traced from one batch (:class:`BatchSpecific`).
    """

    name = "split_concat"

    def __init__(self) -> None:
        self.restore = SplitConcatRestore()

    def match(self, received: ir.Value, facts: GraphFacts) -> ChunkSort | None:
        split = sole_reader(received, "Split")
        if split is None:
            return None
        if int_attr(split, "axis", 0) != 0 or len(split.inputs) < 2 or split.inputs[1] is None:
            raise Skip(f"Split '{split.name}' is not by sizes along axis 0")
        sizes = split.inputs[1]
        all_to_all = received.producer()
        assert all_to_all is not None  # received is an all-to-all's output
        fixed = facts.static(sizes)
        send_counts = all_to_all.inputs[1] if len(all_to_all.inputs) > 1 else None
        if fixed is not None and send_counts is not None and facts.static(send_counts) is None:
            users = {n.name: n for out in split.outputs for n in consumers(out)}
            raise BatchSpecific(
                f"Split '{split.name}' (then {', '.join(repr(u) for u in users)}) splits the received rows by "
                f"constant sizes {fixed.tolist()} while the send counts '{send_counts.name}' are computed: the "
                "sizes were traced from one batch and the graph only holds for that batch"
            )
        concat = _concat_of_all_chunks(split)
        order = _chunk_order(split, concat)
        shapes = [(n, e) for n, e in factorisations(len(order)) if order == expert_major_order(n, e)]
        if not shapes:
            raise Skip(f"Concat '{concat.name}' does not list the chunks of Split '{split.name}' in expert-major order")
        counts = self._counts(sizes, fixed, shapes, facts)
        return ChunkSort(
            self, all_to_all, received, counts, [split, concat], [concat.outputs[0]], _row_dims(received, facts)
        )

    @staticmethod
    def _counts(sizes: ir.Value, fixed: np.ndarray | None, shapes: list[tuple[int, int]], facts: GraphFacts) -> Counts:
        """Counts ``[N, L]`` whose ``ravel()`` the sizes are: a constant, the nearest ``[N, L]``
        tensor they are computed from (probed), or the sizes themselves (``flat``)."""
        if fixed is not None:
            ranks, experts = shapes[0]
            return Counts(ranks, experts, constant=fixed.astype(np.int64).reshape(ranks, experts))
        blocks = shapes[0][0] * shapes[0][1]
        for value in _candidates(sizes):
            dims, dtype = facts.shape(value), facts.dtype(value)
            if dims is None or len(dims) != 2 or dims[1] is None or dtype not in _INDEX_TYPES:
                continue
            experts = dims[1]
            ranks = blocks // experts if experts else 0
            if (ranks, experts) not in shapes or dims[0] not in (ranks, None):
                continue  # N may be dynamic in the graph (counts received by an AllToAll): N*L = blocks fixes it
            expression = Expression.between(sizes, [value], facts)
            if expression is not None and _computes(expression, (ranks, experts), dtype, np.ravel):
                return Counts(ranks, experts, value=value)
        ranks, experts = shapes[0]
        return Counts(ranks, experts, value=sizes, flat=True)

    def replace(self, sort: ChunkSort, rows: ir.Value, build: Builder) -> None:
        build.take_over(sort.outputs[0], rows)


class SplitConcatRestore:
    """``Split(y, sizes)`` + ``Concat`` in rank-major order, ``sizes`` equal to ``counts.T.ravel()``
    (probed). Replacement: ``Gather(y, index)``."""

    def find(self, sort: ChunkSort, facts: GraphFacts) -> list[Restore]:
        ranks, experts = sort.counts.ranks, sort.counts.experts
        assert ranks is not None  # split_concat counts always have a static N
        found = []
        for split in downstream(sort.outputs):
            if (
                split.op_type != "Split"
                or len(split.outputs) != ranks * experts
                or int_attr(split, "axis", 0) != 0
                or len(split.inputs) < 2
                or split.inputs[0] is None
                or split.inputs[1] is None
            ):
                continue
            try:
                concat = _concat_of_all_chunks(split)
            except Skip:
                continue
            if _chunk_order(split, concat) != rank_major_order(ranks, experts):
                continue
            if self._transposed(split.inputs[1], sort.counts, facts):
                found.append(Restore(self, [split, concat], [split.inputs[0]], [concat.outputs[0]]))
        return found

    @staticmethod
    def _transposed(sizes: ir.Value, counts: Counts, facts: GraphFacts) -> bool:
        """Whether ``sizes == counts.T.ravel()`` (expert-major block sizes)."""
        ranks, experts = counts.ranks, counts.experts
        assert ranks is not None  # split_concat counts always have a static N
        if counts.constant is not None:
            fixed = facts.static(sizes)
            return fixed is not None and np.array_equal(fixed.ravel(), counts.constant.T.ravel())
        assert counts.value is not None
        expression = Expression.between(sizes, [counts.value], facts)
        dtype = facts.dtype(counts.value) or ir.DataType.INT64
        if expression is None or dtype not in _INDEX_TYPES:
            return False
        shape = (ranks * experts,) if counts.flat else (ranks, experts)
        return _computes(expression, shape, dtype, lambda c: c.reshape(ranks, experts).T.ravel())

    def replace(self, restore: Restore, index: ir.Value, build: Builder) -> None:
        gathered = build.node("Gather", [restore.inputs[0], index], {"axis": 0}, what="restore")
        build.take_over(restore.outputs[0], gathered.outputs[0])


class GatherIndex:
    """``Gather(rows, index)`` with ``index`` computed from counts ``[N, L]`` by standard ops.

    Its backward slice must read only one non-constant tensor (the counts) and, evaluated on
    probe counts, give MoeReRoutingV2's gather index (destination row -> source row) every time.
    Replacement: the Gather's output is the permuted rows.
    """

    name = "gather_index"

    def __init__(self) -> None:
        self.restore = ScatterRestore()

    def match(self, received: ir.Value, facts: GraphFacts) -> ChunkSort | None:
        gather = sole_reader(received, "Gather")
        if gather is None:
            return None
        if int_attr(gather, "axis", 0) != 0 or len(gather.inputs) < 2 or gather.inputs[1] is None:
            raise Skip(f"Gather '{gather.name}' is not along axis 0")
        index = gather.inputs[1]
        counts = self._counts_source(index)
        dims, dtype = facts.shape(counts), facts.dtype(counts) or ir.DataType.INT64
        if dims is None or len(dims) != 2 or dims[1] is None or dtype not in _INDEX_TYPES:
            raise Skip(f"the counts '{counts.name}' have no static [N, L] shape to probe with")
        expression = Expression.between(index, [counts], facts)
        if expression is None:
            raise Skip("the gather index is not computed by standard ops from the counts")
        experts = dims[1]
        ranks_probed = (dims[0],) if dims[0] is not None else (1, 2, 3, 5)
        for ranks in ranks_probed:
            if not _computes(expression, (ranks, experts), dtype, lambda c: gather_index(*rerouting_blocks(c))):
                raise Skip(f"the gather index differs from the expert-major order on probe counts [{ranks}, {experts}]")
        all_to_all = received.producer()
        assert all_to_all is not None
        sort = ChunkSort(
            self,
            all_to_all,
            received,
            Counts(dims[0], experts, value=counts),
            [gather],
            [gather.outputs[0]],
            _row_dims(received, facts),
        )
        sort.layout["index"] = index
        return sort

    @staticmethod
    def _counts_source(index: ir.Value) -> ir.Value:
        """The one non-constant tensor the index is computed from."""

        def is_constant(value: ir.Value) -> bool:
            return value.is_initializer() or value.const_value is not None

        def source(value: ir.Value) -> bool:  # computed by no standard op: where the index starts
            node = value.producer()
            return not is_constant(value) and (node is None or not is_standard(node))

        sources = [v for v in upstream(index, through=is_standard, stop=is_constant) if source(v)]
        if len(sources) != 1:
            raise Skip(f"the gather index depends on {[v.name for v in sources]}, not on one counts tensor")
        return sources[0]

    def replace(self, sort: ChunkSort, rows: ir.Value, build: Builder) -> None:
        build.take_over(sort.outputs[0], rows)


class ScatterRestore:
    """``ScatterND(zeros(Shape(y)), Unsqueeze(index, 1), y)`` by the forward's gather index.
    Replacement: ``Gather(y, index)``."""

    def find(self, sort: ChunkSort, facts: GraphFacts) -> list[Restore]:
        index = sort.layout.get("index")
        found: list[Restore] = []
        if index is None:
            return found
        for unsqueeze in consumers(index):
            if unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.inputs) < 2:
                continue
            axes = constant(unsqueeze.inputs[1])
            if axes is None or axes.tolist() not in ([1], [-1]):
                continue
            for scatter in consumers(unsqueeze.outputs[0]):
                if scatter.op_type != "ScatterND" or scatter.inputs[1] is not unsqueeze.outputs[0]:
                    continue
                zeros = produced_by(scatter.inputs[0], "ConstantOfShape")
                shape_of = zeros and produced_by(zeros.inputs[0], "Shape")
                updates = scatter.inputs[2] if len(scatter.inputs) > 2 else None
                if shape_of is None or updates is None or shape_of.inputs[0] is not updates:
                    continue
                if _fill(zeros) != 0:
                    continue
                found.append(Restore(self, [scatter], [updates], [scatter.outputs[0]]))
        return found

    def replace(self, restore: Restore, index: ir.Value, build: Builder) -> None:
        gathered = build.node("Gather", [restore.inputs[0], index], {"axis": 0}, what="restore")
        build.take_over(restore.outputs[0], gathered.outputs[0])


def _fill(node: ir.Node | None) -> float | None:
    """The fill value of a ConstantOfShape node (0 when absent, per the ONNX spec)."""
    if node is None:
        return None
    attr = node.attributes.get("value")
    return 0.0 if attr is None else float(attr.value.numpy().ravel()[0])
