"""Patterns of the post-AlltoAll chunk sort, each beside the restore that undoes it.

After the token AllToAll the received rows are rank-major: chunk (r, e) holds
``counts[r, e]`` rows from rank r for local expert e. Exporters regroup them expert-major
before the experts and undo it before the return AllToAll. Each rule finds one exported
form of that pair; the rewrite (:mod:`converters.reroute`) is the same for all:

    expert_major = MoeReRoutingV2(received, counts, idx_type=1).permute_tokens
    rank_major   = Gather(expert_out, permute_token_idx)   # scatter index: src row -> dst row
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from moe_onnx.custom_ops.moe_re_routing_v2 import gather_index, rerouting_blocks

from .graph_utils import (
    backward_slice,
    constant,
    consumers,
    flattened_from,
    int_attr,
    produced_by,
    slice_model,
    static_columns,
)


@dataclass
class Restore:
    """The inverse chunk sort: ``rank_major`` is ``expert_out`` put back in rank order."""

    nodes: list[ir.Node]
    expert_out: ir.Value
    rank_major: ir.Value
    flatten: bool = False  # expert_out is [L, N, C, H]: flatten it to rows first


@dataclass
class Match:
    rule: str
    received: ir.Value  # [R, H] rank-major rows (the AllToAll output)
    counts: ir.Value | np.ndarray  # [N, L] rows from rank r for local expert e (constant if array)
    nodes: list[ir.Node]  # the forward chunk sort
    expert_major: ir.Value  # its result
    restore: Restore | None
    reshape_to: list[int] | None = None  # the shape expert_major has, when not [R, H]


class Skip(Exception):
    """A candidate that looked like a chunk sort but is not one (the message says why)."""


def expert_major_order(ranks: int, experts: int) -> list[int]:
    """Rank-major chunk ids (r*L + e) listed in expert-major order (e, then r)."""
    return [r * experts + e for e in range(experts) for r in range(ranks)]


def rank_major_order(ranks: int, experts: int) -> list[int]:
    """Expert-major chunk ids (e*N + r) listed in rank-major order (r, then e)."""
    return [e * ranks + r for r in range(ranks) for e in range(experts)]


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


def _factorisations(n_chunks: int, counts: ir.Value):
    known_experts = static_columns(counts)
    for experts in range(1, n_chunks + 1):
        if n_chunks % experts == 0 and known_experts in (None, experts):
            yield n_chunks // experts, experts


class SplitConcat:
    """(a) ``torch.split(rows, counts.flatten().tolist())`` + ``torch.cat`` in expert-major order:
    ``Split(received, Reshape(counts, [-1]))`` then ``Concat`` of the chunks at ``e*N + r``;
    restore: ``Split(y, Reshape(Transpose(counts), [-1]))`` then ``Concat`` in rank-major order."""

    name = "split_concat"

    def match(self, received: ir.Value) -> Match | None:
        splits = [n for n in consumers(received) if n.op_type == "Split" and n.inputs[0] is received]
        if not splits:
            return None
        if len(splits) > 1:
            raise Skip(f"ambiguous: the rows are split by {len(splits)} nodes: {[n.name for n in splits]}")
        split = splits[0]
        if int_attr(split, "axis", 0) != 0 or len(split.inputs) < 2:
            raise Skip(f"Split '{split.name}' is not by sizes along axis 0")
        counts = flattened_from(split.inputs[1])
        if counts is None:
            raise Skip(f"the sizes of Split '{split.name}' are not Reshape(counts, [-1])")
        concat = _concat_of_all_chunks(split)
        order = _chunk_order(split, concat)
        for ranks, experts in _factorisations(len(order), counts):
            if order == expert_major_order(ranks, experts):
                restore = self._restore(counts, ranks, experts)
                return Match(self.name, received, counts, [split, concat], concat.outputs[0], restore)
        raise Skip(f"Concat '{concat.name}' does not list the chunks in expert-major order")

    def _restore(self, counts: ir.Value, ranks: int, experts: int) -> Restore | None:
        found = []
        for transpose in consumers(counts):
            if transpose.op_type != "Transpose" or list(int_attr(transpose, "perm", [])) != [1, 0]:
                continue
            for reshape in consumers(transpose.outputs[0]):
                if reshape.op_type != "Reshape" or flattened_from(reshape.outputs[0]) is None:
                    continue
                for split in consumers(reshape.outputs[0]):
                    if split.op_type != "Split" or split.inputs[1] is not reshape.outputs[0]:
                        continue
                    concat = _concat_of_all_chunks(split)
                    order = _chunk_order(split, concat)
                    if order == rank_major_order(ranks, experts) and split.inputs[0] is not None:
                        found.append(Restore([split, concat], split.inputs[0], concat.outputs[0]))
        if len(found) > 1:
            names = [r.nodes[-1].name for r in found]
            raise Skip(f"ambiguous: {len(found)} restores of the same chunk sort: {names}")
        return found[0] if found else None


class GatherIndex:
    """(b) ``Gather(received, index)`` with ``index`` computed from the counts by standard ops;
    restore: ``ScatterND(zeros, Unsqueeze(index, 1), y)``.

    The index computation is recognised by what it computes, not by how: its backward slice
    must read only the counts and constants, and evaluating it on probe counts (zeros
    included) must give MoeReRoutingV2's gather index every time.
    """

    name = "gather_index"

    def match(self, received: ir.Value) -> Match | None:
        gathers = [n for n in consumers(received) if n.op_type == "Gather" and n.inputs[0] is received]
        if not gathers:
            return None
        if len(gathers) > 1:
            raise Skip(f"ambiguous: the rows are gathered by {len(gathers)} nodes: {[n.name for n in gathers]}")
        gather = gathers[0]
        if int_attr(gather, "axis", 0) != 0:
            raise Skip(f"Gather '{gather.name}' is not along axis 0")
        index = gather.inputs[1]
        counts = self._counts_source(index)
        assert index is not None  # the counts were found upstream of it
        self._probe(index, counts)
        return Match(self.name, received, counts, [gather], gather.outputs[0], self._restore(index))

    @staticmethod
    def _counts_source(index: ir.Value | None) -> ir.Value:
        """The one non-constant tensor the index is computed from."""
        sources: list[ir.Value] = []
        stack: list[ir.Value | None] = [index]
        seen: set[int] = set()
        while stack:
            value = stack.pop()
            if value is None or id(value) in seen:
                continue
            seen.add(id(value))
            if value.is_initializer() or value.const_value is not None:
                continue
            node = value.producer()
            if node is None or node.domain not in ("", "ai.onnx"):
                sources.append(value)
                continue
            stack.extend(node.inputs)
        if len(sources) != 1:
            raise Skip(f"the gather index depends on {[v.name for v in sources]}, not on one counts tensor")
        return sources[0]

    def _probe(self, index: ir.Value, counts: ir.Value) -> None:
        from onnx.reference import ReferenceEvaluator

        experts = static_columns(counts)
        if experts is None:
            raise Skip(f"the counts '{counts.name}' have no static [N, L] shape to probe with")
        found = backward_slice(index, counts)
        if found is None:
            raise Skip("the gather index is not computed by standard ops from the counts")
        graph = index.graph
        opset = graph.opset_imports.get("", 21) if graph is not None else 21
        evaluator = ReferenceEvaluator(slice_model(*found, counts, index, opset))
        counts_name = counts.name
        assert counts_name is not None  # onnx-ir names every node output and graph input of a graph
        rng = np.random.default_rng(0)
        for ranks in (1, 2, 3, 5):
            probe = rng.integers(0, 4, (ranks, experts)).astype(np.int64)
            probe[0, 0] = 0  # zero counts must work too
            want = gather_index(*rerouting_blocks(probe))
            results = evaluator.run(None, {counts_name: probe})
            assert isinstance(results, list)  # a dict only with intermediate=True
            (got,) = results
            if got.shape != want.shape or not np.array_equal(got, want):
                raise Skip(f"the gather index differs from the expert-major order on probe counts {probe.tolist()}")

    @staticmethod
    def _restore(index: ir.Value) -> Restore | None:
        found = []
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
                fill = constant_fill(zeros)
                if shape_of is None or shape_of.inputs[0] is not scatter.inputs[2] or fill != 0:
                    continue
                if scatter.inputs[2] is None:  # an invalid ScatterND: its updates are required
                    continue
                found.append(Restore([scatter], scatter.inputs[2], scatter.outputs[0]))
        if len(found) > 1:
            raise Skip(f"ambiguous: {len(found)} restores by the same index: {[r.nodes[0].name for r in found]}")
        return found[0] if found else None


class ReshapeTranspose:
    """(c) drop-and-pad: every (rank, expert) block holds exactly C rows, so the received
    ``[N*L*C, H]`` block is ``Reshape``d to ``[N, L, C, H]`` and ``Transpose``d (perm 1,0,2,3)
    to expert-major ``[L, N, C, H]``; restore: the same Transpose of ``[L, N, C, H]`` then a
    Reshape back to rows, feeding the return AllToAll. Counts are the constant ``full([N, L], C)``.
    """

    name = "drop_pad"

    def match(self, received: ir.Value) -> Match | None:
        reshapes = [n for n in consumers(received) if n.op_type == "Reshape" and n.inputs[0] is received]
        if not reshapes:
            return None
        if len(reshapes) > 1:
            raise Skip(f"ambiguous: the rows are reshaped by {len(reshapes)} nodes: {[n.name for n in reshapes]}")
        reshape = reshapes[0]
        shape = constant(reshape.inputs[1])
        if shape is None or shape.shape != (4,) or (shape[:3] <= 0).any():
            raise Skip(f"Reshape '{reshape.name}' is not to a constant [N, L, C, H]")
        users = consumers(reshape.outputs[0])
        if len(users) != 1 or not _is_swap_transpose(users[0]):
            raise Skip(f"the [N, L, C, H] view of Reshape '{reshape.name}' is not transposed to [L, N, C, H]")
        ranks, experts, capacity, hidden = (int(d) for d in shape)
        counts = np.full((ranks, experts), capacity, np.int64)
        transpose = users[0]
        graph = received.graph
        assert graph is not None  # received is the output of an AllToAll node of the graph
        return Match(
            self.name,
            received,
            counts,
            [reshape, transpose],
            transpose.outputs[0],
            self._restore(graph),
            [experts, ranks, capacity, hidden],
        )

    @staticmethod
    def _restore(graph: ir.Graph) -> Restore | None:
        from .graph_utils import is_all_to_all

        found = []
        for transpose in graph:
            if not _is_swap_transpose(transpose):
                continue
            users = consumers(transpose.outputs[0])
            if (
                len(users) == 1
                and users[0].op_type == "Reshape"
                and any(is_all_to_all(n) for n in consumers(users[0].outputs[0]))
                and transpose.inputs[0] is not None
            ):
                found.append(Restore([transpose, users[0]], transpose.inputs[0], users[0].outputs[0], flatten=True))
        if len(found) > 1:
            raise Skip(
                f"ambiguous: {len(found)} transposes back before an AllToAll: {[r.nodes[0].name for r in found]}"
            )
        return found[0] if found else None


def _is_swap_transpose(node: ir.Node) -> bool:
    return node.op_type == "Transpose" and list(int_attr(node, "perm", [])) == [1, 0, 2, 3]


def constant_fill(node: ir.Node | None) -> float | None:
    """The fill value of a ConstantOfShape node (0 when absent, per the ONNX spec)."""
    if node is None:
        return None
    attr = node.attributes.get("value")
    return 0.0 if attr is None else float(attr.value.numpy().ravel()[0])


RULES = (SplitConcat(), GatherIndex(), ReshapeTranspose())
