"""The one chunk-sort rule: recognise it by where its rows go (the movement map).

:class:`MovementMap` takes the movement region after an all-to-all (:mod:`.movement`), cuts it
out with its size expressions and evaluates it on probe rows. The region is a chunk sort when
every value the experts read holds the expert-major rows (MoeReRoutingV2's order) of a range
of local experts, on every probe. The probes come from the first of these that applies:

* **counts** — the size expressions read one tensor of counts ``[N, L]`` (or ``[N*L]``),
  computed in the graph (Megatron's, received by an AllGather; an AllToAll of counts): random
  counts, zeros and large ones included, and as many rows; the counts stay computed;
* **shapes** — they read only constants and the region's own shapes (capacity layouts:
  ``Reshape [N, L, -1, H]``, Split / Slice / Gather per expert): rows of several sizes;
  counts ``full([N, L], C)``, a constant if C is, else computed from the rows at run time;
* **constant counts** — constant split sizes of N*L blocks (a trace of one batch);
* **mirror world** — they read sizes computed elsewhere in the graph (the capacity from the
  input's token count): the graph is evaluated on synthetic batches (:mod:`.world`) and the
  region on the rows and sizes it computes there; counts computed from the rows.

N is the all-to-all's (its send counts' length, or ``group_size``); L is the counts' second
dim, or for a capacity layout the one L (> 1) for which the map holds on every probe. A map
that is the identity (N or L is 1) is not a chunk sort: nothing to reroute.

:class:`MovementRestore` does the same from the experts' outputs (values computed from the
pieces, each from one expert range) to the return all-to-all: walking up through movement ops
and scatters, evaluating on the same probes, accepting when the all-to-all sends the
expert-major rows in rank-major order (``Gather(rows, index)`` with MoeReRoutingV2's scatter
index). The experts are taken to compute row by row (one output row per input row, in order):
the map cannot see inside them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from .build import Builder
from .errors import AmbiguousMatch, Skip
from .facts import GraphFacts
from .graph_utils import int_attr, is_standard, upstream
from .movement import (
    MAX_PROBE_ELEMENTS,
    Cut,
    cut,
    data_downstream,
    expert_ranges,
    forward_region,
    lead_pattern,
    orders,
    return_region,
    row_ids,
    row_size,
    sources_of,
)
from .sorts import ChunkSort, Counts, Piece, Probe, Restore
from .world import World, WorldFailure, WorldUnavailable, mirror_received

_INDEX_TYPES = (ir.DataType.INT64, ir.DataType.INT32)
_IDENTITY = "the rows reach the experts in the order received (one rank or one local expert): nothing to reroute"


def ranks_of(all_to_all: ir.Node, facts: GraphFacts) -> int | None:
    """N: the length of the send counts, ``group_size``, or of the received counts."""
    if all_to_all.attributes.get("group_size") is not None:
        return int(all_to_all.attributes["group_size"].value)
    for value in (all_to_all.inputs[1] if len(all_to_all.inputs) > 1 else None, *all_to_all.outputs[1:2]):
        dims = facts.shape(value)
        if dims is not None and len(dims) == 1 and dims[0] is not None:
            return dims[0]
    return None


def received_dims(all_to_all: ir.Node, facts: GraphFacts) -> tuple[int | None, ...] | None:
    """The received rows' dims: inferred, or (an op with no schema here) the sent rows' dims,
    dim 0 kept only for an equal split (no send counts)."""
    dims = facts.shape(all_to_all.outputs[0])
    if dims is not None:
        return dims
    sent = facts.shape(all_to_all.inputs[0]) if all_to_all.inputs else None
    if sent is None or not sent:
        return None
    equal = len(all_to_all.inputs) < 2 or all_to_all.inputs[1] is None
    return (sent[0] if equal else None, *sent[1:])


#: the rows of the one long block every match is also probed on (fewer for wide rows): a
#: look-alike that clips or bounds the rows (``Min(counts, 100)``, ``Slice(rows, 0, 200)``)
#: agrees with MoeReRoutingV2 on the other probes, whose blocks hold at most 64 rows
LONG_BLOCK_ROWS = 4096


def long_block(row: int) -> int:
    """The rows of the long probe block for rows of ``row`` elements (> 64 unless rows are
    too wide for the probe bound)."""
    return int(max(2, min(LONG_BLOCK_ROWS, MAX_PROBE_ELEMENTS // max(1, 4 * row))))


def _count_probes(ranks: int, experts: int, row: int) -> list[np.ndarray]:
    """Counts to tell an expression of the counts from another: small random ones (the first
    with a zero block), all zeros, larger ones (past a clip or constant a look-alike may hold),
    one large block among zeros, and one long block (:func:`long_block`) among zeros; the rows
    of each stay under MAX_PROBE_ELEMENTS."""
    rng = np.random.default_rng(0)
    shape = (ranks, experts)
    large = int(max(2, min(64, MAX_PROBE_ELEMENTS // max(1, row * ranks * experts * 2))))
    probes = [rng.integers(1, 5, shape) for _ in range(3)]
    probes[0].flat[0] = 0
    probes += [np.zeros(shape, np.int64), rng.integers(large // 2 + 1, large + 1, shape), np.zeros(shape, np.int64)]
    probes[-1].flat[-1] = large
    probes.append(np.zeros(shape, np.int64))
    probes[-1].flat[0] = max(large + 1, long_block(row))
    return [p.astype(np.int64) for p in probes]


def _divisors(value: int) -> list[int]:
    return [d for d in range(2, value + 1) if value % d == 0]


#: ops that join the received rows with other rows (Concat; SequenceConstruct, read by a ConcatFromSequence)
_JOINS = ("Concat", "SequenceConstruct")


class MovementMap:
    """The chunk sort after an all-to-all, found by evaluating its movement region (module doc)."""

    name = "movement_map"

    def __init__(self) -> None:
        self.restore = MovementRestore()

    # ------------------------------------------------------------------ matching
    def match(self, received: ir.Value, facts: GraphFacts, world: World) -> ChunkSort | None:
        all_to_all = received.producer()
        assert all_to_all is not None  # received is an all-to-all's output
        region = forward_region(received)
        if not region.nodes:
            readers = sorted({f"{u.node.op_type} '{u.node.name}'" for u in received.uses()})
            joins = sorted({f"{u.node.op_type} '{u.node.name}'" for u in received.uses() if u.node.op_type in _JOINS})
            if joins:
                raise Skip(
                    f"its rows are joined with other rows by {', '.join(joins)} before any movement (rows "
                    "appended, such as the zero row a padded permutation picks for its padding): not a pure chunk sort"
                )
            raise Skip(f"its rows go straight to {', '.join(readers) or 'nothing'}: no movement op follows it")
        ranks = ranks_of(all_to_all, facts)
        dims = received_dims(all_to_all, facts)
        row = row_size(dims)
        if dims is None or row is None:
            raise Skip(f"the received rows '{received.name}' have no known rank or row size")
        region_cut = cut(region.boundaries, [received], region.inside, facts)
        recv_counts = all_to_all.outputs[1] if len(all_to_all.outputs) > 1 else None
        free = [v for v in region_cut.free if v is not recv_counts]
        attempts: list[str] = []
        sort = None
        if not free and recv_counts not in region_cut.free:
            if ranks is None:
                raise Skip("the number of ranks is not known (no send counts of a known length)")
            sort = self._by_shapes(received, region, region_cut, ranks, dims, row, attempts)
            if sort is None:
                sort = self._by_constant_counts(received, region, region_cut, ranks, dims, row, attempts)
        else:
            refuted: list[str] = []  # counts candidates whose probes ran and showed another order
            sort = self._by_counts(received, region, region_cut, ranks, dims, row, facts, world, attempts, refuted)
            # a candidate the region cannot even run with (a per-expert size tensor of N*L' ints that
            # is not the counts) says nothing of the sizes: the mirror world may still account for
            # them; one that runs and gives another order is a look-alike of the counts: not tried
            if sort is None and not refuted:
                if ranks is None:
                    raise Skip("the number of ranks is not known (no send counts of a known length)")
                sort = self._by_world(received, region, region_cut, ranks, dims, row, world, attempts)
        if sort is None:
            raise Skip("; ".join(attempts) if attempts else "its movement is not a chunk sort by local expert")
        return sort

    def _sort(self, received, region, counts, dims, row, pieces, probes, mode, region_cut: Cut) -> ChunkSort:
        all_to_all = received.producer()
        row_dims = tuple(dims[1:]) if len(dims) <= 2 else (row,)
        sort = ChunkSort(
            self,
            all_to_all,
            received,
            counts,
            list(region.nodes),
            [p.value for p in pieces],
            row_dims,
            view_rows=len(dims) > 2,
            pieces=pieces,
            probes=probes,
            mode=mode,
        )
        sort.layout.update(row=row, region=region, cut=region_cut)
        return sort

    def _by_shapes(self, received, region, region_cut: Cut, ranks, dims, row, attempts) -> ChunkSort | None:
        """Capacity layouts: the region reads nothing but constants and its own shapes."""
        unknown = [i for i, d in enumerate(dims) if d is None]
        runs = []
        tried = []
        # an unknown dim 0 is searched (N*k rows: blocks of every L up to 64 fit some k); other
        # unknown dims take a few sizes in step
        for k in range(1, 65) if 0 in unknown else range(1, 2):
            for extra in (1, 2, 3, 5) if [i for i in unknown if i > 0] else (1,):
                shape = tuple((ranks * k if i == 0 else extra) if d is None else d for i, d in enumerate(dims))
                if math.prod(shape) > MAX_PROBE_ELEMENTS or shape in tried:
                    continue
                tried.append(shape)
                try:
                    outputs = region_cut({received.name or "": row_ids(shape)})
                except Exception:  # this row count does not fit the layout (a Reshape refuses it)
                    continue
                runs.append((shape, outputs))
            if len(runs) >= 8:
                break
        if not runs:
            attempts.append(f"the movement region fails on every probe row count (shapes like {list(tried[:3])})")
            return None
        # one row count only (constant split sizes): a constant capacity, checked on batches later
        found = self._capacity_map(region, runs, ranks, row, 1 if len(dims) > 1 else 0, len(runs) > 1)
        if isinstance(found, str):
            attempts.append(found)
            return None
        experts, capacities, pieces, runs = found
        if len(set(capacities)) > 1:  # C varies with the rows: past the probed C too?
            long_run = self._long_capacity_run(region, region_cut, received, dims, ranks, row, found)
            if isinstance(long_run, str):
                attempts.append(long_run)
                return None
            runs, capacities = [*runs, long_run[::2]], [*capacities, long_run[1]]
        probes = [
            Probe(np.full((ranks, experts), c, np.int64), _shapes(region, outputs), lambda v: None, f"rows {list(s)}")
            for (s, outputs), c in zip(runs, capacities)
        ]
        if len(set(capacities)) == 1:
            counts = Counts(ranks, experts, constant=np.full((ranks, experts), capacities[0], np.int64))
        else:
            counts = Counts(ranks, experts, capacity=True, send_key=_send_key(received, dims))
        return self._sort(received, region, counts, dims, row, pieces, probes, "shapes", region_cut)

    @staticmethod
    def _long_capacity_run(region, region_cut: Cut, received, dims, ranks, row, found):
        """``(shape, C, outputs)``: the region on N*L*C rows for a C past the probed ones
        (:func:`long_block` rows per block, other unknown dims 1), holding the map ``found``
        (``_capacity_map``'s) there too; else why not."""
        experts, capacities, pieces, runs = found
        wanted = max(max(capacities) + 1, long_block(row * ranks * experts))
        # the first unknown dim takes the length (dim 0 of [?, C, M], or C of [E, ?, M] when the
        # export declares E), the other unknown dims 1: at least N*L*wanted rows, in N*L blocks
        first = next(i for i, d in enumerate(dims) if d is None)
        per_unit = math.prod(1 if d is None else d for d in dims) // row  # rows per index of that dim
        blocks = ranks * experts
        length = -(-blocks * wanted // per_unit)
        while length * per_unit % blocks:
            length += 1
        shape = tuple((length if i == first else 1) if d is None else d for i, d in enumerate(dims))
        capacity = length * per_unit // blocks
        try:
            outputs = region_cut({received.name or "": row_ids(shape)})
        except Exception as error:  # a bound below these rows: not MoeReRoutingV2 for every C
            again: list[Piece] | str = (
                f"the region fails there: {str(error).splitlines()[0][:160] if str(error) else repr(error)}"
            )
        else:
            counts = [np.full((ranks, experts), c, np.int64) for c in (*capacities, capacity)]
            row_rank = 1 if len(dims) > 1 else 0
            again = _pieces(region, [o for _, o in runs] + [outputs], counts, row, experts, row_rank)
        if not isinstance(again, str) and [(p.lo, p.hi, p.lead) for p in again] != [
            (p.lo, p.hi, p.lead) for p in pieces
        ]:
            again = "the experts' inputs hold other rows there"
        if isinstance(again, str):
            return (
                f"the region holds MoeReRoutingV2's order for C = {sorted(set(capacities))} rows per block but not "
                f"for a long probe of C = {capacity} (rows {list(shape)}): {again}"
            )
        return shape, capacity, outputs

    def _capacity_map(self, region, runs, ranks, row, row_rank, several: bool):
        """``(L, [C per run], pieces, runs)`` for the one L > 1 whose full(C) order the runs of
        N*L*C rows show (at least two of them, with different C, if ``several``), or why not."""
        rows_per_rank = []
        for shape, _ in runs:
            total = math.prod(shape) // row
            if total % ranks:
                return f"{total} probe rows do not split in {ranks} ranks"
            rows_per_rank.append(total // ranks)
        candidates = sorted({d for rows in rows_per_rank for d in _divisors(rows)})
        matches, why = [], set()
        for experts in candidates:
            kept = [(run, rows) for run, rows in zip(runs, rows_per_rank) if rows % experts == 0]
            if several and len({rows for _, rows in kept}) < 2:
                continue
            counts = [np.full((ranks, experts), rows // experts, np.int64) for _, rows in kept]
            pieces = _pieces(region, [outputs for (_, outputs), _ in kept], counts, row, experts, row_rank)
            if isinstance(pieces, str):
                why.add(pieces)
            else:
                matches.append((experts, [rows // experts for _, rows in kept], pieces, [run for run, _ in kept]))
        if not matches and why == {_IDENTITY}:
            return _IDENTITY
        if not matches:
            return (
                f"the rows the experts read are not in MoeReRoutingV2's order for full([{ranks}, L], C) "
                f"with any L > 1 (probe rows {[list(s) for s, _ in runs]})"
            )
        if len(matches) > 1:
            raise AmbiguousMatch(f"the movement region matches L = {[m[0] for m in matches]} local experts")
        return matches[0]

    def _by_constant_counts(self, received, region, region_cut: Cut, ranks, dims, row, attempts):
        """Split sizes traced as constants: a constant of N*L ints the counts are."""
        if len(dims) > 2:
            return None
        for name, array in region_cut.constants.items():
            values = np.asarray(array)
            if not np.issubdtype(values.dtype, np.integer) or values.size < 2 or values.size % ranks:
                continue
            if values.ndim > 2 or values.min() < 0:
                continue
            counts = values.astype(np.int64).reshape(ranks, values.size // ranks)
            shape = (int(counts.sum()), *(d for d in dims[1:]))
            if any(d is None for d in shape):
                continue
            try:
                outputs = region_cut({received.name or "": row_ids(shape)})
            except Exception:  # not these sizes
                continue
            pieces = _pieces(region, [outputs], [counts], row, counts.shape[1], 1 if len(dims) > 1 else 0)
            if isinstance(pieces, str):
                attempts.append(f"constant sizes '{name}' {values.ravel().tolist()}: {pieces}")
                continue
            probe = Probe(counts, _shapes(region, outputs), lambda v: None, f"constant counts {counts.tolist()}")
            counted = Counts(ranks, counts.shape[1], constant=counts)
            sort = self._sort(received, region, counted, dims, row, pieces, [probe], "constant counts", region_cut)
            readers = [
                f"{n.op_type} '{n.name}'"
                for n in region_cut.nodes
                if any(v is not None and v.name == name for v in n.inputs)
            ]
            sort.layout["constant_of"] = f"'{name}' of {', '.join(readers)}" if readers else f"'{name}'"
            return sort
        return None

    def _by_counts(
        self, received, region, region_cut: Cut, ranks, dims, row, facts: GraphFacts, world, attempts, refuted
    ):
        """Dropless: the size expressions read one tensor of counts; probe it (``refuted`` gets the
        candidates the region runs with but not in MoeReRoutingV2's order)."""
        if len(dims) > 2:
            return None
        all_to_all = received.producer()
        recv_counts = all_to_all.outputs[1] if len(all_to_all.outputs) > 1 else None
        tried = 0
        for candidate in self._candidates(region_cut, facts, ranks, world):
            value, experts, n, flat, layout = candidate
            sources = [received, value] + ([recv_counts] if recv_counts is not None else [])
            try:
                probe_cut = cut(region.boundaries, sources, region.inside, facts)
            except Skip:
                continue
            if probe_cut.free:
                continue
            tried += 1
            dtype = (_dtype(value, facts, world, ranks) or ir.DataType.INT64).numpy()
            runs: list[tuple[np.ndarray, list[np.ndarray]]] = []
            probes: list[Probe] = []
            for ranks_probed in (n,) if n is not None else (1, 2, 3, 5):
                for counts in _count_probes(ranks_probed, experts, row):
                    shape = (int(counts.sum()), *dims[1:])
                    feeds = {received.name or "": row_ids(shape)}
                    feeds[value.name or ""] = _as_value(counts, value, layout).astype(dtype)
                    if recv_counts is not None:
                        feeds[recv_counts.name or ""] = counts.sum(axis=1).astype(np.int64)
                    try:
                        outputs = probe_cut(feeds)
                    except Exception as error:  # the probe counts make the region fail: not these counts
                        if not counts.any():  # ...unless no rows at all (an op refusing empty inputs)
                            continue
                        failed = f"counts '{value.name}': the region fails on probe counts {counts.tolist()}: "
                        attempts.append(failed + (str(error).splitlines()[0][:160] if str(error) else repr(error)))
                        runs = []
                        break
                    runs.append((counts, outputs))
                if not runs:
                    break
            if not runs:
                continue
            pieces = _pieces(
                region, [o for _, o in runs], [c for c, _ in runs], row, experts, 1 if len(dims) > 1 else 0
            )
            if isinstance(pieces, str):
                attempts.append(f"counts '{value.name}': {pieces}")
                refuted.append(value.name or "")
                continue
            for counts, outputs in runs:
                fed = _as_value(counts, value, layout)
                probes.append(Probe(counts, _shapes(region, outputs), _counts_feed(value, recv_counts, counts, fed)))
            counted = Counts(n, experts, value=value, flat=flat)
            return self._sort(received, region, counted, dims, row, pieces, probes, "counts", probe_cut)
        if not tried:
            names = sorted(v.name or "?" for v in region_cut.free)
            attempts.append(f"its size expressions read {names}, not one tensor of counts [N, L]")
        return None

    @staticmethod
    def _candidates(region_cut: Cut, facts: GraphFacts, ranks: int | None, world: World) -> Iterator[tuple]:
        """``(value, L, N or None, reshaped, shape to feed)`` for every int tensor the size expressions are
        computed from that could hold counts ``[N, L]`` (any static shape of N*L elements, read
        rank-major, L > 1; ``[?, L]`` when N is not known), nearest to the sizes first. A dim
        shape inference leaves unknown (behind an op with no schema here) is read from the
        mirror world's first batch."""
        seen: set[int] = set()
        starts = [v for n in region_cut.nodes for v in n.inputs if v is not None]
        for value in (v for start in starts for v in upstream(start, through=is_standard, limit=200)):
            if id(value) in seen:
                continue
            seen.add(id(value))
            dims, dtype = facts.shape(value), _dtype(value, facts, world, ranks)
            if dtype not in _INDEX_TYPES or value.const_value is not None or value.is_initializer():
                continue
            if (dims is None or None in dims) and ranks:
                dims = _world_dims(value, world, ranks) or dims
            if dims is None:
                continue
            if len(dims) == 2 and dims[1] is not None and dims[1] > 1 and dims[0] in (ranks, None):
                yield value, dims[1], dims[0] if dims[0] is not None else ranks, False, None
            elif ranks and dims and all(d is not None for d in dims):
                total = math.prod(d for d in dims if d is not None)
                if total % ranks == 0 and total // ranks > 1:
                    yield value, total // ranks, ranks, True, tuple(d for d in dims if d is not None)

    def _by_world(self, received, region, region_cut: Cut, ranks, dims, row, world: World, attempts):
        """Sizes computed elsewhere in the graph: probe on the mirror world's batches."""
        all_to_all = received.producer()
        data = all_to_all.inputs[0]
        send_counts = all_to_all.inputs[1] if len(all_to_all.inputs) > 1 else None
        runs, feeds_by_run = [], []
        try:
            batches = world.batches()
            for batch in batches:
                wanted = [data, *([send_counts] if send_counts is not None else []), *region_cut.free]
                values = world.evaluate(batch, [v for v in wanted if v is not None], ranks)
                for rank in range(ranks):
                    rows = mirror_received(
                        values[data.name or ""],
                        values.get(send_counts.name or "") if send_counts else None,
                        ranks,
                        rank,
                    )
                    feeds = {received.name or "": row_ids(rows.shape)}
                    feeds.update({v.name or "": values[v.name or ""] for v in region_cut.free})
                    try:
                        outputs = region_cut(feeds)
                    except Exception:  # this rank index does not fit the graph's sizes
                        continue
                    runs.append((rows.shape, outputs))
                    feeds_by_run.append((batch, rank))
                    break
        except WorldUnavailable as why:
            attempts.append(f"its sizes are computed elsewhere in the graph, which cannot be evaluated here: {why}")
            return None
        except WorldFailure as why:
            attempts.append(f"its sizes are computed elsewhere in the graph, which fails on a synthetic batch: {why}")
            return None
        if len(runs) < 2:
            attempts.append("the movement region fails in the mirror world on the synthetic batches")
            return None
        kept = {id(outputs): i for i, (_, outputs) in enumerate(runs)}
        found = self._capacity_map(region, runs, ranks, row, 1 if len(dims) > 1 else 0, False)
        if isinstance(found, str):
            attempts.append(f"mirror world: {found}")
            return None
        experts, capacities, pieces, used = found
        feeds_by_run = [feeds_by_run[kept[id(outputs)]] for _, outputs in used]
        runs = used
        probes = []
        for (_, outputs), c, (batch, rank) in zip(runs, capacities, feeds_by_run):
            probes.append(
                Probe(
                    np.full((ranks, experts), c, np.int64),
                    _shapes(region, outputs),
                    _world_feed(world, batch, ranks, rank),
                    f"{batch.name}, rank {rank}",
                )
            )
        counts = Counts(ranks, experts, capacity=True, send_key=_send_key(received, dims))
        return self._sort(received, region, counts, dims, row, pieces, probes, "mirror world", region_cut)

    # ------------------------------------------------------------------ rewriting
    def replace(self, sort: ChunkSort, rows: ir.Value, expert_counts: ir.Value, build: Builder) -> None:
        """Each piece from the permuted rows: all of them, or Split by the experts' counts and
        the piece's experts concatenated; viewed with the piece's leading dims."""
        experts = sort.counts.experts
        split_outputs: list[ir.Value] | None = None
        for piece in sort.pieces:
            if (piece.lo, piece.hi) == (0, experts):
                rows_of_piece = rows
            else:
                if split_outputs is None:
                    split_outputs = self._split(sort, rows, expert_counts, build)
                parts = split_outputs[piece.lo : piece.hi]
                rows_of_piece = parts[0] if len(parts) == 1 else build.node("Concat", parts, {"axis": 0}).outputs[0]
            build.take_over(piece.value, _view(rows_of_piece, piece.lead, sort.row_dims or (), build))

    @staticmethod
    def _split(sort: ChunkSort, rows: ir.Value, expert_counts: ir.Value, build: Builder) -> list[ir.Value]:
        experts = sort.counts.experts
        if sort.counts.constant is not None:
            sizes = build.ints("expert_sizes", sort.counts.constant.sum(axis=0))
        else:
            sizes = build.node("Cast", [expert_counts], {"to": ir.DataType.INT64}, what="expert_sizes").outputs[0]
        if build.graph.opset_imports.get("", 21) < 13:
            if sort.counts.constant is None:
                raise ValueError("opset < 13: Split sizes must be an attribute, but the counts are computed")
            attrs = {"axis": 0, "split": sort.counts.constant.sum(axis=0).tolist()}
            return list(build.node("Split", [rows], attrs, what="experts", num_outputs=experts).outputs)
        return list(build.node("Split", [rows, sizes], {"axis": 0}, what="experts", num_outputs=experts).outputs)


class MovementRestore:
    """The inverse, from the experts' outputs to the return all-to-all (module doc)."""

    def find(self, sorts: list[ChunkSort], facts: GraphFacts, world: World) -> list[Restore]:
        tokens = sorts[0]
        pieces = [p for s in sorts for p in s.pieces]
        reach, ends = data_downstream([p.value for p in pieces])
        stop = {id(p.value) for p in pieces}
        found = []
        for all_to_all in ends:
            target = all_to_all.inputs[0]
            if target is None:
                continue
            restore = self._restore(tokens, pieces, reach, stop, target, facts)
            if restore is not None:
                found.append(restore)
        return found

    def _restore(self, tokens: ChunkSort, pieces, reach, stop, target: ir.Value, facts) -> Restore | None:
        try:
            nodes, leaves = return_region(target, stop)
        except Skip:
            return None
        experts = tokens.counts.experts
        data_leaves = []
        for leaf in leaves:
            sources = reach.get(id(leaf))
            if not sources:
                continue  # zeros, constants: computed by the cut
            ranges = sorted({(pieces[i].lo, pieces[i].hi) for i in sources}, key=lambda r: r[1] - r[0])
            narrow = ranges[0]
            if any(not (r[0] <= narrow[0] and narrow[1] <= r[1]) for r in ranges):
                return None  # mixes the rows of two expert ranges
            narrowest = [pieces[i] for i in sorted(sources) if (pieces[i].lo, pieces[i].hi) == narrow]
            piece = next((p for p in narrowest if any(p is t for t in tokens.pieces)), narrowest[0])  # tokens' shapes
            data_leaves.append((leaf, piece))
        if not data_leaves or not nodes:
            return None
        data_leaves.sort(key=lambda x: x[1].lo)
        edges = [(p.lo, p.hi) for _, p in data_leaves]
        if edges[0][0] != 0 or edges[-1][1] != experts or any(a[1] != b[0] for a, b in zip(edges, edges[1:])):
            return None  # the experts' outputs do not tile the experts once each, in order
        leaf_rows = []
        for leaf, _ in data_leaves:  # unknown (behind an op with no schema): the piece's rows
            size = row_size(facts.shape(leaf)) or (tokens.layout["row"] if tokens.row_dims else 1)
            leaf_rows.append(size)
        if len(set(leaf_rows)) != 1:
            return None
        size = leaf_rows[0]
        inside = {id(leaf) for leaf, _ in data_leaves} | {id(v) for n in nodes for v in n.outputs}
        given = [leaf for leaf, _ in data_leaves]
        if tokens.counts.value is not None:  # the probes' counts, where the sizes read them
            given.append(tokens.counts.value)
        given += [v for v in tokens.all_to_all.outputs[1:2] if v is not None]
        try:
            restore_cut = cut([target], given, inside, facts)
        except Skip:
            return None
        shapes = []
        for probe in tokens.probes:
            _, scatter, offsets = orders(probe.counts)
            feeds = {}
            for leaf, piece in data_leaves:
                shape = probe.shapes.get(id(piece.value))
                if shape is None:
                    return None
                lead = shape[:-1] if len(tokens.row_dims or ()) > 0 else shape
                dims = facts.shape(leaf) or shape  # unknown: the piece's rank
                leaf_shape = (*lead, size) if len(dims) == len(lead) + 1 else tuple(lead)
                positions = np.arange(offsets[piece.lo], offsets[piece.hi], dtype=np.int64)
                if math.prod(leaf_shape) != len(positions) * size:
                    return None
                ids = positions[:, None] * size + 1 + np.arange(size, dtype=np.int64)
                feeds[leaf.name or ""] = ids.reshape(leaf_shape)
            for value in [*restore_cut.sources[len(data_leaves) :], *restore_cut.free]:
                if not restore_cut.reads(value):
                    continue
                fed = probe.feed(value)
                if fed is None:
                    return None
                feeds[value.name or ""] = fed
            try:
                (out,) = restore_cut(feeds)
            except Exception:  # the restore does not fit these rows: not the inverse
                return None
            got = sources_of(out, size, len(scatter))
            if got is None or not np.array_equal(got, scatter):
                return None
            shapes.append(tuple(out.shape))
        row_rank = 1 if len(shapes[0]) > 1 and tokens.row_dims else 0
        out_lead = lead_pattern(shapes, row_rank)
        if out_lead is None:
            return None
        inputs = [leaf for leaf, _ in data_leaves]
        target_shape = [*out_lead, size] if row_rank else out_lead
        as_rows = [_is_rows(facts.shape(leaf), size) for leaf in inputs]
        return Restore(self, nodes, inputs, [target], {"shape": target_shape, "row": size, "as_rows": as_rows})

    def replace(self, restore: Restore, index: ir.Value, build: Builder) -> None:
        size = restore.layout["row"]
        rows = [
            v if as_rows else build.reshape(v, [-1, size], "expert_rows")
            for v, as_rows in zip(restore.inputs, restore.layout["as_rows"])
        ]
        stacked = rows[0] if len(rows) == 1 else build.node("Concat", rows, {"axis": 0}, what="expert_major").outputs[0]
        rank_major = build.node("Gather", [stacked, index], {"axis": 0}, what="restore").outputs[0]
        shape = restore.layout["shape"]
        if not (len(shape) == 2 and shape[1] == size) and shape != [-1]:  # [A, size]: the rows as they are
            rank_major = build.reshape(rank_major, shape, "rank_major")
        build.take_over(restore.outputs[0], rank_major)


# ---------------------------------------------------------------------- helpers
def _is_rows(dims: tuple[int | None, ...] | None, size: int) -> bool:
    """Whether a value of ``dims`` is ``[n, size]`` rows already."""
    return dims is not None and len(dims) == 2 and dims[1] == size


def _pieces(region, runs_outputs, counts_list, row, experts, row_rank) -> list[Piece] | str:
    """The pieces (boundary -> expert range, leading dims) if every run shows MoeReRoutingV2's
    order for its counts; else why not."""
    ranges: list[set[tuple[int, int]] | None] = [None] * len(region.boundaries)
    shapes: list[list[tuple[int, ...]]] = [[] for _ in region.boundaries]
    reorders = False
    for outputs, counts in zip(runs_outputs, counts_list):
        gather, _, _ = orders(counts)
        reorders = reorders or not np.array_equal(gather, np.arange(len(gather)))
        for i, (value, out) in enumerate(zip(region.boundaries, outputs)):
            source = sources_of(out, row, len(gather))
            if source is None:
                return f"'{value.name}' does not hold whole received rows"
            found = expert_ranges(source, counts)
            ranges[i] = found if ranges[i] is None else (ranges[i] & found)  # type: ignore[operator]
            if not ranges[i]:
                return f"'{value.name}' does not hold the expert-major rows of a range of local experts"
            shapes[i].append(tuple(out.shape))
    if not reorders:
        return _IDENTITY
    chosen = _assign(ranges, experts)  # type: ignore[arg-type]
    if isinstance(chosen, str):
        return chosen
    pieces = []
    for value, (lo, hi), seen in zip(region.boundaries, chosen, shapes):
        lead = lead_pattern(seen, row_rank) if seen else None
        if lead is None:
            return f"'{value.name}' has more than one dim that varies with the counts"
        pieces.append(Piece(value, lo, hi, lead))
    return pieces


def _assign(ranges: list[set[tuple[int, int]]], experts: int) -> list[tuple[int, int]] | str:
    """One expert range per expert input: the only one the probes allow, or (where an expert
    had no rows on every probe, so several fit) the assignment covering every expert with the
    narrowest disjoint ranges; why not if none covers them all."""
    options = [sorted(r, key=lambda x: (x[1] - x[0], x[0])) for r in ranges]
    if math.prod(len(o) for o in options) > 4096:
        return "the probes leave too many ways to tell which experts the inputs hold"
    best: tuple | None = None
    for choice in itertools.product(*options):
        covered = [e for lo, hi in choice for e in range(lo, hi)]
        if set(covered) != set(range(experts)):
            continue
        key = (len(covered) - experts, sum(hi - lo for lo, hi in choice))  # overlaps first, then width
        if best is None or key < best[0]:
            best = (key, list(choice))
    if best is None:
        seen = sorted({e for o in options for lo, hi in o for e in range(lo, hi)})
        return f"the experts' inputs hold the rows of experts {seen}, not of all {experts}"
    return best[1]


def _shapes(region, outputs) -> dict[int, tuple[int, ...]]:
    return {id(v): tuple(o.shape) for v, o in zip(region.boundaries, outputs)}


def _send_key(received: ir.Value, dims) -> tuple:
    """What makes two all-to-alls receive alike: the same send counts value (or constant) and
    rows along dim 0 of the same row shape."""
    all_to_all = received.producer()
    assert all_to_all is not None
    sends = all_to_all.inputs[1] if len(all_to_all.inputs) > 1 else None
    if sends is None:
        what: tuple = ("equal", int_attr(all_to_all, "group_size", 0), id(all_to_all.inputs[0]))
    elif sends.const_value is not None:
        what = ("constant", sends.const_value.numpy().tobytes())
    else:
        what = ("value", id(sends))
    return (*what, len(dims) > 2)


def _world_value(value: ir.Value, world: World, ranks: int) -> np.ndarray | None:
    try:
        found = world.evaluate(world.batches()[0], [value], ranks)[value.name or ""]
    except (WorldFailure, WorldUnavailable):
        return None
    return found if isinstance(found, np.ndarray) else None  # a sequence value holds no counts


def _world_dims(value: ir.Value, world: World, ranks: int) -> tuple[int, ...] | None:
    found = _world_value(value, world, ranks)
    return None if found is None else tuple(found.shape)


def _dtype(value: ir.Value, facts: GraphFacts, world: World, ranks: int | None) -> ir.DataType | None:
    dtype = facts.dtype(value)
    if dtype is None and ranks:
        found = _world_value(value, world, ranks)
        if found is not None and found.dtype in (np.int64, np.int32):
            return ir.DataType.INT64 if found.dtype == np.int64 else ir.DataType.INT32
    return dtype


def _as_value(counts: np.ndarray, value: ir.Value, shape: tuple[int, ...] | None) -> np.ndarray:
    """Probe counts ``[N, L]`` laid out as ``value`` holds them (rank-major, in ``shape``)."""
    return counts if shape is None else counts.reshape(shape)


def _counts_feed(value: ir.Value, recv_counts: ir.Value | None, counts: np.ndarray, fed: np.ndarray):
    def feed(wanted: ir.Value) -> np.ndarray | None:
        if wanted is value:
            dtype = (value.dtype or ir.DataType.INT64).numpy()
            return fed.astype(dtype)
        if recv_counts is not None and wanted is recv_counts:
            return counts.sum(axis=1).astype(np.int64)
        return None

    return feed


def _world_feed(world: World, batch, ranks: int, rank: int):
    def feed(wanted: ir.Value) -> np.ndarray | None:
        try:
            return world.evaluate(batch, [wanted], ranks, rank)[wanted.name or ""]
        except (WorldFailure, WorldUnavailable):
            return None

    return feed


def _view(rows: ir.Value, lead: list[int] | None, row_dims: tuple, build: Builder) -> ir.Value:
    """``rows [n, *row_dims]`` viewed with ``lead`` leading dims (no node if that is ``[-1]``)."""
    if lead is None or len(lead) == 1:  # [n, *row_dims]: the rows as they are
        return rows
    return build.reshape(rows, [*lead, *(d for d in row_dims if d is not None)], "expert_input")


__all__ = ["MovementMap", "MovementRestore", "ranks_of"]
