"""Capacity layouts: every (rank, local expert) block holds exactly C rows, so counts = full([N, L], C).

The received rows are viewed as ``[N, L, C, *row]`` (a Reshape to a static shape: a constant,
or computed from ``Shape()`` of known dims; C may be the ``-1``, then taken from the received
``[E, C, M]`` blocks), and then

* :class:`ReshapeTranspose` — transposed to ``[L, N, C, *row]`` (Megatron drop-and-pad), maybe
  flattened back to rows ``[L*N*C, *row]`` (``Reshape`` or ``Flatten``);
* :class:`ExpertSlices` — cut per local expert along axis 1 (GShard: fairscale, DeepSpeed):
  ``Split(axis=1)``, ``Slice`` pairs on axis 1 (bounds may be computed from ``Shape()``), or
  ``Gather(axis=1)``; expert l reads ``[N, 1, C, *row]``.

Their restores: the inverse transpose flattened to rows, and the ``Concat(axis=1)`` of the
experts' outputs.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from .build import Builder
from .errors import Skip
from .facts import Dims, GraphFacts
from .graph_utils import consumers, int_attr, sole_reader
from .sorts import ChunkSort, Counts, Restore, downstream


def _known(dims: Dims | None) -> tuple[int, ...] | None:
    if dims is None or any(d is None for d in dims):
        return None
    return tuple(d for d in dims if d is not None)


def _reshaped(dims: Dims | None, target: np.ndarray, allowzero: int) -> Dims | None:
    """The output dims of ``Reshape(x [dims], target)`` (None where not static)."""
    out: list[int | None] = []
    for i, t in enumerate(int(t) for t in target):
        if t == 0 and not allowzero:
            out.append(dims[i] if dims is not None and i < len(dims) else None)
        else:
            out.append(None if t == -1 else t)
    if -1 in target.tolist():
        total = _known(dims)
        others = _known(tuple(d for d in out if d is not None))
        if total is not None and others is not None and math.prod(others) > 0:
            out[target.tolist().index(-1)] = math.prod(total) // math.prod(others)
    return tuple(out)


def _output_dims(node: ir.Node, facts: GraphFacts, dims: Dims | None = None) -> Dims | None:
    """What a Reshape or Flatten gives, from its static target / axis and its input's ``dims``
    (by default what ``facts`` know of them)."""
    dims = dims if dims is not None else facts.shape(node.inputs[0])
    if node.op_type == "Flatten":
        known = _known(dims)
        axis = int_attr(node, "axis", 1)
        if known is None:
            return None
        axis = axis if axis >= 0 else axis + len(known)
        return (math.prod(known[:axis]), math.prod(known[axis:]))
    target = facts.static(node.inputs[1]) if len(node.inputs) > 1 else None
    if target is None:
        return facts.shape(node.outputs[0])
    return _reshaped(dims, target, int_attr(node, "allowzero", 0))


def _dims(value: ir.Value | None, facts: GraphFacts) -> Dims | None:
    """``facts.shape(value)``, or for a Reshape / Flatten output what its static target gives
    (shape inference stops at ops it has no schema for, such as ``com.microsoft::AllToAll``)."""
    dims = facts.shape(value)
    node = value.producer() if value is not None else None
    if (dims is None or None in dims) and node is not None and node.op_type in ("Reshape", "Flatten"):
        computed = _output_dims(node, facts)
        if computed is not None and (dims is None or len(dims) == len(computed)):
            return computed if dims is None else tuple(c if c is not None else d for c, d in zip(computed, dims))
    return dims


def _is_swap(node: ir.Node, rank: int) -> bool:
    return node.op_type == "Transpose" and list(int_attr(node, "perm", [])) == [1, 0, *range(2, rank)]


def _flattened_rows(value: ir.Value, dims: Dims, rows: tuple[int, ...], facts: GraphFacts) -> ir.Node | None:
    """The single Reshape / Flatten of ``value [dims]`` to ``rows`` dims, if that is its only use
    (besides Shape nodes computing its target, as the legacy exporter writes ``x.reshape(-1)``)."""
    users = [u for u in consumers(value) if u.op_type != "Shape"]
    if len(users) != 1 or users[0].op_type not in ("Reshape", "Flatten") or users[0].inputs[0] is not value:
        return None
    return users[0] if _output_dims(users[0], facts, dims) == rows else None


class BlockView:
    """``Reshape(received, [N, L, C, *row])`` with N, L, C and the row dims static."""

    def __init__(self, received: ir.Value, facts: GraphFacts):
        self.node: ir.Node | None = None
        reshape = sole_reader(received, "Reshape")
        if reshape is None:
            return
        dims = _output_dims(reshape, facts)
        target = facts.shape(reshape.inputs[1]) if len(reshape.inputs) > 1 else None
        if (dims is not None and len(dims) < 3) or (target is not None and target[0] is not None and target[0] < 3):
            return  # a view to rows or a vector: not a block layout
        if dims is None:
            raise Skip(f"Reshape '{reshape.name}' is not to a static [N, L, C, ...] shape")
        ranks, experts, capacity, *row = dims
        received_dims = facts.shape(received)
        if capacity is None and received_dims is not None and len(received_dims) == 2 + len(row):
            capacity = received_dims[1]  # [E, C, *row] blocks, one per (rank, local expert)
        if ranks is None or experts is None or capacity is None or any(d is None for d in row):
            raise Skip(f"Reshape '{reshape.name}' to {list(dims)}: N, L, C or the row dims are not static")
        self.node = reshape
        self.view = reshape.outputs[0]
        self.ranks, self.experts, self.capacity = ranks, experts, capacity
        self.row: tuple[int, ...] = tuple(d for d in row if d is not None)
        # the rows the rerouting reads: the received tensor itself when it is [A, *row]
        self.view_rows = received_dims is None or tuple(received_dims[1:]) != self.row

    def sort(self, rule, received: ir.Value, nodes: list[ir.Node], outputs: list[ir.Value], **layout) -> ChunkSort:
        all_to_all = received.producer()
        assert all_to_all is not None and self.node is not None
        counts = Counts(self.ranks, self.experts, constant=np.full((self.ranks, self.experts), self.capacity, np.int64))
        layout.update(ranks=self.ranks, experts=self.experts, capacity=self.capacity, row=self.row)
        return ChunkSort(rule, all_to_all, received, counts, nodes, outputs, self.row, self.view_rows, layout)


class ReshapeTranspose:
    """(drop-and-pad) ``Reshape(rows, [N, L, C, *row])`` -> ``Transpose(1, 0, 2, ...)`` to
    ``[L, N, C, *row]``, maybe flattened to rows ``[L*N*C, *row]`` by a Reshape / Flatten.
    Replacement: the permuted rows (viewed as ``[L, N, C, *row]`` if not flattened)."""

    name = "drop_pad"

    def __init__(self) -> None:
        self.restore = TransposeRestore()

    def match(self, received: ir.Value, facts: GraphFacts) -> ChunkSort | None:
        view = BlockView(received, facts)
        if view.node is None:
            return None
        users = consumers(view.view)
        rank = 3 + len(view.row)
        if not any(u.op_type == "Transpose" for u in users):
            return None  # not this layout (ExpertSlices may match)
        if len(users) != 1 or not _is_swap(users[0], rank):
            raise Skip(f"the [N, L, C, ...] view of Reshape '{view.node.name}' is not only transposed to [L, N, C]")
        transpose = users[0]
        rows = (view.ranks * view.experts * view.capacity, *view.row)
        expert_major = (view.experts, view.ranks, view.capacity, *view.row)
        flatten = _flattened_rows(transpose.outputs[0], expert_major, rows, facts)
        if flatten is not None:
            return view.sort(self, received, [view.node, transpose, flatten], [flatten.outputs[0]], shape=None)
        shape = [view.experts, view.ranks, view.capacity, *view.row]
        return view.sort(self, received, [view.node, transpose], [transpose.outputs[0]], shape=shape)

    def replace(self, sort: ChunkSort, rows: ir.Value, build: Builder) -> None:
        shape = sort.layout["shape"]
        build.take_over(sort.outputs[0], rows if shape is None else build.reshape(rows, shape, "expert_major"))


class TransposeRestore:
    """``Transpose(1, 0, 2, ...)`` of an expert-major ``[L, N, C, *row]`` tensor (often a Reshape of
    the experts' rows), maybe flattened to rows ``[N*L*C, *row]``. Replacement:
    ``Gather(expert-major rows, index)`` (viewed as ``[N, L, C, *row]`` if not flattened)."""

    def find(self, sort: ChunkSort, facts: GraphFacts) -> list[Restore]:
        ranks, experts, capacity = sort.layout["ranks"], sort.layout["experts"], sort.layout["capacity"]
        found = []
        for transpose in downstream(sort.outputs):
            dims = _known(_dims(transpose.inputs[0], facts)) if transpose.op_type == "Transpose" else None
            if dims is None or dims[:3] != (experts, ranks, capacity) or not _is_swap(transpose, len(dims)):
                continue
            row = dims[3:]
            rows = (ranks * experts * capacity, *row)
            source = transpose.inputs[0]
            assert source is not None  # its shape is known
            nodes, as_rows = [transpose], False
            reshape = source.producer()
            if (
                reshape is not None
                and reshape.op_type == "Reshape"
                and len(consumers(reshape.outputs[0])) == 1
                and _known(facts.shape(reshape.inputs[0])) == rows
            ):
                source, nodes, as_rows = reshape.inputs[0], [reshape, transpose], True  # the experts' rows
            flatten = _flattened_rows(transpose.outputs[0], (ranks, experts, capacity, *row), rows, facts)
            if flatten is not None:
                nodes.append(flatten)
            output = (flatten or transpose).outputs[0]
            assert source is not None
            shape = None if flatten else [ranks, experts, capacity, *row]
            layout = {"rows": None if as_rows else list(rows), "shape": shape}
            found.append(Restore(self, nodes, [source], [output], layout))
        return found

    def replace(self, restore: Restore, index: ir.Value, build: Builder) -> None:
        rows = restore.inputs[0]
        if restore.layout["rows"] is not None:  # [L, N, C, *row] -> [L*N*C, *row]
            rows = build.reshape(rows, restore.layout["rows"], "expert_rows")
        rank_major = build.node("Gather", [rows, index], {"axis": 0}, what="restore").outputs[0]
        if restore.layout["shape"] is not None:
            rank_major = build.reshape(rank_major, restore.layout["shape"], "rank_major")
        build.take_over(restore.outputs[0], rank_major)


class ExpertSlices:
    """(GShard) ``Reshape(rows, [N, L, C, *row])`` cut per local expert along axis 1:
    ``Split(axis=1)`` into L, ``Slice(axes=[1])`` pairs ``[l, l+1)``, or ``Gather(axis=1, l)``.
    Expert l reads rows (r, l, c) for every r, c: block l of the expert-major rows.
    Replacement: the permuted rows viewed as ``[L*N, 1, C, *row]`` (``[L*N, C, *row]`` for a
    scalar Gather) and split in L along axis 0."""

    name = "gshard"

    def __init__(self) -> None:
        self.restore = ExpertConcatRestore()

    def match(self, received: ir.Value, facts: GraphFacts) -> ChunkSort | None:
        view = BlockView(received, facts)
        if view.node is None:
            return None
        readers = [u for u in consumers(view.view) if u.op_type != "Shape"]  # Shape: slice bounds (legacy)
        if not readers or any(u.op_type == "Transpose" for u in readers):
            return None
        pieces: list[tuple[ir.Value, int]] = []
        kinds = set()
        for reader in readers:
            cut = self._cut(reader, view, facts)
            if cut is None:
                raise Skip(
                    f"the [N, L, C, ...] view of Reshape '{view.node.name}' is read by {reader.op_type} "
                    f"'{reader.name}', not by a cut per local expert along axis 1"
                )
            kind, found = cut
            kinds.add(kind)
            pieces += found
        if len(kinds) > 1:
            raise Skip(f"the experts of Reshape '{view.node.name}' read both [N, 1, C, ...] and [N, C, ...] slices")
        return view.sort(
            self,
            received,
            [view.node, *readers],
            [value for value, _ in pieces],
            pieces=pieces,
            keepdim=kinds == {"keepdim"},
        )

    @staticmethod
    def _cut(node: ir.Node, view: BlockView, facts: GraphFacts) -> tuple[str, list[tuple[ir.Value, int]]] | None:
        """``(kind, [(piece, local expert)])`` if ``node`` cuts the view along axis 1, else None."""
        rank = 3 + len(view.row)
        experts = view.experts
        axis = int_attr(node, "axis", 0)
        axis = axis + rank if axis < 0 else axis
        if node.op_type == "Split" and axis == 1 and len(node.outputs) == experts:
            sizes = facts.static(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
            split = int_attr(node, "split")
            if (sizes is None and split is None) or (sizes if sizes is not None else np.array(split)).tolist() == [
                1
            ] * experts:
                return "keepdim", [(v, i) for i, v in enumerate(node.outputs)]
            return None
        if node.op_type == "Gather" and axis == 1:
            index = facts.static(node.inputs[1])
            if index is None or index.size != 1 or index.ndim > 1 or not -experts <= int(index.ravel()[0]) < experts:
                return None
            expert = int(index.ravel()[0]) % experts
            return ("keepdim" if index.ndim == 1 else "scalar"), [(node.outputs[0], expert)]
        if node.op_type == "Slice" and len(node.inputs) >= 3:
            bounds = [facts.static(v) if v is not None else None for v in node.inputs[1:]]
            starts, ends = bounds[0], bounds[1]
            axes = bounds[2] if len(bounds) > 2 else np.arange(rank)
            steps = bounds[3] if len(bounds) > 3 else None
            if starts is None or ends is None or axes is None or starts.size != 1 or axes.size != 1:
                return None
            if int(axes.ravel()[0]) % rank != 1 or (steps is not None and steps.ravel().tolist() != [1]):
                return None
            start = int(starts.ravel()[0]) % experts if -experts <= int(starts.ravel()[0]) < experts else None
            end = min(int(ends.ravel()[0]), experts) if int(ends.ravel()[0]) >= 0 else int(ends.ravel()[0]) + experts
            if start is None or end != start + 1:
                return None
            return "keepdim", [(node.outputs[0], start)]
        return None

    def replace(self, sort: ChunkSort, rows: ir.Value, build: Builder) -> None:
        ranks, experts, capacity, row = (sort.layout[k] for k in ("ranks", "experts", "capacity", "row"))
        shape = [experts * ranks, 1, capacity, *row] if sort.layout["keepdim"] else [experts * ranks, capacity, *row]
        blocks = build.reshape(rows, shape, "expert_blocks")
        graph_opset = build.graph.opset_imports.get("", 21)
        if graph_opset >= 13:
            split = build.node(
                "Split", [blocks, build.ints("expert_sizes", [ranks] * experts)], {"axis": 0}, num_outputs=experts
            )
        else:
            split = build.node("Split", [blocks], {"axis": 0, "split": [ranks] * experts}, num_outputs=experts)
        for piece, expert in sort.layout["pieces"]:
            build.take_over(piece, split.outputs[expert])


class ExpertConcatRestore:
    """``Concat(axis=1)`` of the L experts' outputs ``[N, 1, C, *row]`` (input l computed from
    piece l only), giving rank-major ``[N, L, C, *row]``. Replacement: the outputs stacked
    expert-major (``Concat(axis=0)``), as rows, ``Gather`` by the index, viewed as ``[N, L, C, *row]``."""

    def find(self, sort: ChunkSort, facts: GraphFacts) -> list[Restore]:
        if not sort.layout["keepdim"]:
            return []
        ranks, experts, capacity = sort.layout["ranks"], sort.layout["experts"], sort.layout["capacity"]
        pieces = sort.layout["pieces"]
        reached: dict[int, set[int]] = {}  # local expert -> ids of the values computed from its piece
        for piece, expert in pieces:
            values = {id(piece)} | {id(v) for n in downstream([piece]) for v in n.outputs}
            reached[expert] = reached.get(expert, set()) | values
        found = []
        for concat in downstream([piece for piece, _ in pieces]):
            if concat.op_type != "Concat" or len(concat.inputs) != experts:
                continue
            dims = [facts.shape(v) for v in concat.inputs]
            rank = len(dims[0]) if dims[0] is not None else None
            axis = int_attr(concat, "axis", 0)
            if rank is None or (axis + rank if axis < 0 else axis) != 1:
                continue
            if any({e for e, values in reached.items() if id(v) in values} != {i} for i, v in enumerate(concat.inputs)):
                continue
            if any(d is None or len(d) != rank or d[0] not in (ranks, None) or d[1] not in (1, None) for d in dims):
                continue
            row = dims[0][3:] if dims[0] is not None else ()
            shape = [ranks, experts, capacity, *(r if r is not None else -1 for r in row)]
            if shape.count(-1) > 1:
                continue
            inputs = [v for v in concat.inputs if v is not None]
            found.append(Restore(self, [concat], inputs, [concat.outputs[0]], {"shape": shape}))
        return found

    def replace(self, restore: Restore, index: ir.Value, build: Builder) -> None:
        ranks, experts, capacity = restore.layout["shape"][:3]
        stacked = build.node("Concat", restore.inputs, {"axis": 0}, what="expert_major").outputs[0]
        rows = build.reshape(stacked, [experts * ranks * capacity, -1], "expert_rows")
        rank_major = build.node("Gather", [rows, index], {"axis": 0}, what="restore").outputs[0]
        build.take_over(restore.outputs[0], build.reshape(rank_major, restore.layout["shape"], "rank_major"))
