"""Reading the MoE blocks of a transformers-5 export: what each block reads and computes.

transformers' experts (``transformers.integrations.moe``) reach ONNX in two forms; both compute,
per (token, slot) row ``s = t*K + j`` of ``x [T, H]``, ``ids [T, K]``, ``weights [T, K]``::

    u = x[t] @ W_up[ids[s]] (+ b_up[ids[s]]);  a = gate(u)   (row-wise: silu(g) * up, gpt-oss's clamp, ...)
    d = a @ W_down[ids[s]] (+ b_down[ids[s]]);  y[t] = sum_j d[t*K + j] * weights[t, j]

* ``batched_mm`` (``torch.onnx.export``, dynamo): each row's expert weights gathered
  (``Gather(W [E, ., .], ids)``, one batched MatMul per projection), ``Reshape`` to ``[T, K, H]``
  and ``ReduceSum`` over the slots. Found from its two expert-weight gathers sharing one index.
* ``grouped_mm`` (transformers' own exporter, ``transformers.exporters.OnnxExporter``, whose
  translation table unrolls ``grouped_mm``): the rows sorted by expert (``TopK`` ascending over
  the flat ids: ``perm``; ``x[perm // K]``), then per projection one ``MatMul`` per expert on
  ``Gather(rows, Range(start_e, end_e))`` with ``Squeeze(Split(W)[e])`` (``W`` the 3-D constant or
  its ``Transpose(0, 2, 1)``), ``Concat`` of the E parts; the weighted rows put back in slot order
  (``Gather(rows, inverse perm)``), ``Reshape`` + ``ReduceSum``. Found from its ``Concat`` of
  per-expert products; the up and down products of one block are paired by data flow.

Either reader gives a :class:`Block`; what is not read here (the expert boundaries, the sort's
order, which row is which) is proven by the numerical check in :mod:`.fuse_moe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from .graph_utils import constant, int_attr, upstream

GATHERS = ("Gather", "GatherND")
#: ops that move or re-view values without computing (walked through to find x, ids, weights)
MOVES = ("Unsqueeze", "Squeeze", "Reshape", "Expand", "Cast", "Identity", "Flatten", "Tile")
#: how far up (values) the down product's rows are searched for the up product's output
GATE_DEPTH = 200
#: ops a gate between the two products does not contain (the walk up from the down product's
#: rows stops at them: an up product's rows are gathered token rows, not a gate's output)
NOT_GATE = (*GATHERS, "MatMul", "Gemm", "Concat", "TopK")
#: how far up (values) the sorted rows' index is searched for the sort (TopK)
SORT_DEPTH = 64


class NotFused(Exception):
    """Why one block stays as it is."""


@dataclass
class Block:
    """What one block reads and computes, as found in the graph (before the check)."""

    form: str  # "batched_mm" or "grouped_mm"
    up_weight: ir.Value  # [E, N, K] (transpose 1) or [E, K, N] (0)
    down_weight: ir.Value
    up_transpose: int  # GroupedMatmul's transpose_weight for each projection
    down_transpose: int
    up_bias: ir.Value | None
    down_bias: ir.Value | None
    gate_in: ir.Value  # the up projection's rows [S, N] (bias included)
    gate_out: ir.Value  # the down projection's input rows [S, I]
    ids: ir.Value  # [T, K] expert of each (token, slot)
    scales: ir.Value  # [T, K] weight of each (token, slot)
    combined: ir.Value  # [T, H] the block's output
    rows: list[ir.Value]  # candidates for x [T, H], nearest first

    @property
    def experts(self) -> int:
        dims: Any = self.up_weight.shape
        return int(dims[0])


@dataclass
class Candidate:
    """A block to read: its form, its name (the up projection's weight) and where it was found
    (the batched form's expert-weight gathers, the grouped form's product Concats)."""

    form: str  # "batched_mm", "grouped_mm", or "eager" (recognised, never fused)
    name: str
    anchors: list[ir.Node]

    def read(self) -> Block:
        return read_grouped(self.anchors) if self.form == "grouped_mm" else read_batched(self.anchors)


def find_candidates(graph: ir.Graph) -> list[Candidate]:
    """Every block of either form; a name found again (one weight read by several blocks) is
    numbered, so that each candidate's (form, name) is found again in a clone."""
    found = find_batched(graph) + find_grouped(graph)
    seen: dict[tuple[str, str], int] = {}
    for candidate in found:
        key = (candidate.form, candidate.name)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            candidate.name = f"{candidate.name} ({seen[key]})"
    return found


# ---------------------------------------------------------------- shared readings
def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _is_constant(value: ir.Value | None) -> bool:
    """An initializer or a Constant node's output (its content is not read)."""
    return value is not None and ir.convenience.get_const_tensor(value) is not None


def _only_use(value: ir.Value, op_type: str | tuple[str, ...]) -> ir.Node | None:
    uses = list(value.uses())
    types = (op_type,) if isinstance(op_type, str) else op_type
    if len(uses) == 1 and uses[0].node.op_type in types and not value.is_graph_output():
        return uses[0].node
    return None


def _first(value: ir.Value, want, through=MOVES) -> ir.Value | None:
    """The nearest value above ``value`` (not itself: an index or scale already re-viewed for the
    rows) through ``through`` ops for which ``want`` holds."""
    return next(
        (v for v in upstream(value, through=lambda n: n.op_type in through) if v is not value and want(v)), None
    )


def _past_round_trips(value: ir.Value) -> ir.Value:
    """``value`` after any Unsqueeze -> Squeeze pairs that give it back (an in-place ``add_``
    exported by functionalisation)."""
    while (unsqueeze := _only_use(value, "Unsqueeze")) is not None:
        squeeze = _only_use(unsqueeze.outputs[0], "Squeeze")
        same = squeeze is not None and unsqueeze.inputs[1] is not None and squeeze.inputs[1] is not None
        axes: list[Any] = [constant(n.inputs[1]) for n in (unsqueeze, squeeze)] if same else []  # type: ignore[union-attr]
        if not same or not np.array_equal(axes[0], axes[1]):
            break
        value = squeeze.outputs[0]  # type: ignore[union-attr]
    return value


def _bias(value: ir.Value, index: ir.Value | None) -> tuple[ir.Value, ir.Value | None]:
    """``(rows, bias)``: rows + Gather(bias [E, N], index) when that Add follows (``index``
    None: any index; the check proves it is the rows' experts), else (value, None)."""
    add = _only_use(value, "Add")
    if add is None:
        return _past_round_trips(value), None
    other = add.inputs[1] if add.inputs[0] is value else add.inputs[0]
    gather = other.producer() if other is not None else None
    if gather is None or gather.op_type not in GATHERS or (index is not None and gather.inputs[1] is not index):
        return value, None
    bias = gather.inputs[0]
    if bias is None or not _is_constant(bias) or _rank(bias) != 2:
        return value, None
    return _past_round_trips(add.outputs[0]), bias


def _summed_per_token(weighted: ir.Value) -> ir.Value:
    """The [T, H] sum over the slots of ``weighted`` rows (Reshape to [T, K, H] + ReduceSum)."""
    reshape = _only_use(weighted, "Reshape")
    total: Any = _only_use(reshape.outputs[0], "ReduceSum") if reshape is not None else None
    if total is None or len(total.inputs) < 2 or total.inputs[1] is None or constant(total.inputs[1]) is None:
        raise NotFused("the weighted rows are not summed per token by Reshape + ReduceSum")
    axes: Any = constant(total.inputs[1])
    if [int(a) for a in np.atleast_1d(axes)] not in ([1], [-2]):
        raise NotFused("the weighted rows are not summed over the top-k axis")
    return total.outputs[0]


def _weighted(expert_rows: ir.Value) -> tuple[ir.Node, ir.Value]:
    """The Mul weighting the experts' rows and its other operand (the rows' scales)."""
    weigh = _only_use(expert_rows, "Mul")
    if weigh is None:
        raise NotFused("the experts' rows are not weighted by one Mul (a post-expert norm?)")
    return weigh, (weigh.inputs[1] if weigh.inputs[0] is expert_rows else weigh.inputs[0])  # type: ignore[return-value]


def _is_ids(value: ir.Value) -> bool:
    return _rank(value) == 2 and value.dtype in (ir.DataType.INT64, ir.DataType.INT32)


def _gathered(value: ir.Value) -> bool:
    """Whether a gather computes ``value`` (weights put in the rows' sorted order, not per token)."""
    node = value.producer()
    return node is not None and node.op_type in GATHERS


def _top_1(value: ir.Value, want) -> ir.Value | None:
    """``value`` itself when it is ``[T, 1]`` and ``want`` holds: top-1 routing, whose export
    may view the ``[., T, 1]`` TopK ids and weights (or masked copies of them) straight as the
    rows' ``[T, 1]`` index and scales, so no other ``[T, K]`` value lies above them (Zaya). The
    check proves T is the token rows' count."""
    shape = value.shape
    if want(value) and shape is not None and len(shape) == 2 and shape[1] == 1:
        return value
    return None


def _token_rows(value: ir.Value) -> list[ir.Value]:
    """Candidates for x [T, H]: the 2-D values ``value`` is re-viewed from, nearest first."""
    return [v for v in upstream(value, through=lambda n: n.op_type in MOVES) if _rank(v) == 2][:3]


# ---------------------------------------------------------------- batched_mm
def _expert_weight(node: ir.Node) -> ir.Value | None:
    """The 3-D constant a Gather / GatherND picks experts from on axis 0, or None."""
    if node.op_type not in GATHERS or node.domain not in ("", "ai.onnx"):
        return None
    data = node.inputs[0]
    if data is None or not _is_constant(data) or _rank(data) != 3:
        return None
    if node.op_type == "Gather" and int_attr(node, "axis", 0) != 0:
        return None
    if node.op_type == "GatherND" and int_attr(node, "batch_dims", 0) != 0:
        return None
    return data


def find_batched(graph: ir.Graph) -> list[Candidate]:
    """The expert-weight Gathers grouped by their index value, one candidate per group."""
    groups: dict[int, list[Any]] = {}
    for node in graph:
        if _expert_weight(node) is not None:
            groups.setdefault(id(node.inputs[1]), []).append(node)
    return [
        Candidate("eager" if _rank(g[0].inputs[1]) == 0 else "batched_mm", g[0].inputs[0].name or g[0].name or "?", g)
        for g in groups.values()
    ]


def read_batched(gathers: list[Any]) -> Block:
    """The block those Gathers belong to; NotFused says which part is not the batched_mm form
    (transformers' eager loop, gathering one expert at a time, is named as such)."""
    if _rank(gathers[0].inputs[1]) == 0:
        raise NotFused(
            "one expert's weights gathered by a single index: transformers' eager experts loop, unrolled by the "
            "exporter over the experts its sample input hit (other inputs would need others); export batched_mm"
        )
    if len(gathers) != 2:
        raise NotFused(f"{len(gathers)} expert-weight gathers share one index (the batched_mm form has 2)")
    matmuls: list[Any] = [_only_use(g.outputs[0], "MatMul") for g in gathers]
    if None in matmuls:
        raise NotFused("an expert-weight gather is not read by exactly one MatMul")
    sides = [m.inputs.index(g.outputs[0]) for m, g in zip(matmuls, gathers)]
    if sides[0] != sides[1]:
        raise NotFused("the two projections' weights are laid out differently")
    first, second = matmuls
    if any(v is first.outputs[0] for v in upstream(second.inputs[1 - sides[1]])):
        up, down, up_gather, down_gather = first, second, gathers[0], gathers[1]
    elif any(v is second.outputs[0] for v in upstream(first.inputs[1 - sides[0]])):
        up, down, up_gather, down_gather = second, first, gathers[1], gathers[0]
    else:
        raise NotFused("neither projection reads the other's output")
    index: Any = up_gather.inputs[1]
    squeeze = _only_use(up.outputs[0], "Squeeze")
    if squeeze is None:
        raise NotFused("the up projection's product is not squeezed to rows")
    gate_in, up_bias = _bias(squeeze.outputs[0], index)
    unsqueeze = down.inputs[1 - sides[0]].producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        raise NotFused("the down projection's rows are not unsqueezed rows")
    gate_out = unsqueeze.inputs[0]
    squeeze = _only_use(down.outputs[0], "Squeeze")
    if squeeze is None:
        raise NotFused("the down projection's product is not squeezed to rows")
    expert_rows, down_bias = _bias(squeeze.outputs[0], index)
    weigh, scale_rows = _weighted(expert_rows)
    combined = _summed_per_token(weigh.outputs[0])
    ids, scales = _first(index, _is_ids), _first(scale_rows, lambda v: _rank(v) == 2)
    if ids is None and scales is None:  # top-1: the rows' own [T, 1] index and scales (Zaya)
        ids, scales = _top_1(index, _is_ids), _top_1(scale_rows, lambda v: _rank(v) == 2)
    if ids is None or scales is None:
        raise NotFused("the [T, K] expert ids or routing weights are not found above the gathers")
    transpose = 1 if sides[0] == 0 else 0  # W_s @ x: W stored [E, N, K]
    return Block(
        form="batched_mm",
        up_weight=up_gather.inputs[0],
        down_weight=down_gather.inputs[0],
        up_transpose=transpose,
        down_transpose=transpose,
        up_bias=up_bias,
        down_bias=down_bias,
        gate_in=gate_in,
        gate_out=gate_out,
        ids=ids,
        scales=scales,
        combined=combined,
        rows=_token_rows(up.inputs[1 - sides[0]]),
    )


# ---------------------------------------------------------------- grouped_mm
@dataclass
class Product:
    """One grouped product: ``Concat_e(Gather(rows, range_e) @ W[e])`` over the E experts."""

    concat: ir.Node
    rows: ir.Value  # [S, K] expert-major rows every part gathers from
    weight: ir.Value  # [E, ., .] constant
    transpose: int  # 0: W [E, K, N]; 1: the graph transposes W [E, N, K] first

    @property
    def output(self) -> ir.Value:
        return self.concat.outputs[0]


def _expert_slice(value: ir.Value | None) -> tuple[ir.Value, int, int] | None:
    """``(W, e, transpose)`` when ``value`` is ``Squeeze(Split(W')[e], 0)`` with ``W'`` a 3-D
    constant ``W`` (transpose 0) or ``Transpose(W, (0, 2, 1))`` (transpose 1), else None."""
    squeeze = value.producer() if value is not None else None
    if squeeze is None or squeeze.op_type != "Squeeze" or not squeeze.inputs or squeeze.inputs[0] is None:
        return None
    axes = constant(squeeze.inputs[1]) if len(squeeze.inputs) > 1 else int_attr(squeeze, "axes")
    if axes is None or [int(a) for a in np.atleast_1d(axes)] != [0]:
        return None
    piece = squeeze.inputs[0]
    split = piece.producer()
    if split is None or split.op_type != "Split" or int_attr(split, "axis", 0) != 0:
        return None
    whole, transpose = split.inputs[0], 0
    if whole is not None and not _is_constant(whole):
        node = whole.producer()
        perm = int_attr(node, "perm") if node is not None and node.op_type == "Transpose" else None
        whole, transpose = (node.inputs[0], 1) if perm is not None and list(perm) == [0, 2, 1] else (None, 0)  # type: ignore[union-attr]
    if whole is None or not _is_constant(whole) or _rank(whole) != 3:
        return None
    dims: Any = whole.shape
    if len(split.outputs) != dims[0]:  # one piece per expert
        return None
    return whole, list(split.outputs).index(piece), transpose


def _looks_grouped(node: ir.Node) -> bool:
    """A Concat whose first input is a MatMul by one expert's slice of a 3-D weight."""
    if node.op_type != "Concat" or not node.inputs or node.inputs[0] is None:
        return False
    matmul = node.inputs[0].producer()
    return matmul is not None and matmul.op_type == "MatMul" and _expert_slice(matmul.inputs[1]) is not None


def read_product(concat: ir.Node) -> Product:
    """The grouped product ``concat`` computes; NotFused says which part does not read as one."""
    if int_attr(concat, "axis", 0) not in (0, -2):
        raise NotFused(f"'{concat.name}' concatenates the expert products on axis {int_attr(concat, 'axis')}")
    weight = rows = transpose = None
    for expert, part in enumerate(concat.inputs):
        matmul = part.producer() if part is not None else None
        found = _expert_slice(matmul.inputs[1]) if matmul is not None and matmul.op_type == "MatMul" else None
        if found is None or matmul is None:
            raise NotFused(f"part {expert} of '{concat.name}' is not a MatMul by one expert's weight slice")
        if found[1] != expert or (weight is not None and found[0] is not weight):
            raise NotFused(f"part {expert} of '{concat.name}' multiplies by slice {found[1]} of '{found[0].name}'")
        gather = matmul.inputs[0].producer() if matmul.inputs[0] is not None else None
        if gather is None or gather.op_type != "Gather" or int_attr(gather, "axis", 0) != 0:
            raise NotFused(f"part {expert} of '{concat.name}' does not multiply a Gather of rows")
        if rows is not None and gather.inputs[0] is not rows:
            raise NotFused(f"the parts of '{concat.name}' gather from different rows")
        weight, rows, transpose = found[0], gather.inputs[0], found[2]
    dims: Any = weight.shape if weight is not None else None
    if dims is None or len(concat.inputs) != dims[0]:
        raise NotFused(f"'{concat.name}' has {len(concat.inputs)} parts for {dims and dims[0]} experts")
    return Product(concat, rows, weight, int(transpose or 0))  # type: ignore[arg-type]


def find_grouped(graph: ir.Graph) -> list[Candidate]:
    """Each up product (one no other product feeds) with the products its output feeds."""
    products = [n for n in graph if _looks_grouped(n)]

    def feeds(first: ir.Node, second: ir.Node) -> bool:  # first's output is among second's rows' sources
        matmul: Any = second.inputs[0].producer()  # type: ignore[union-attr]
        gather = matmul.inputs[0].producer() if matmul.inputs[0] is not None else None
        if gather is None or gather.op_type not in GATHERS:
            return False
        rows = gather.inputs[0]
        walk = upstream(rows, through=lambda n: n.op_type not in NOT_GATE, limit=GATE_DEPTH)
        return any(v is first.outputs[0] for v in walk)

    fed = {id(d) for d in products for u in products if u is not d and feeds(u, d)}
    candidates = []
    for up in products:
        if id(up) in fed:
            continue
        downs = [d for d in products if d is not up and feeds(up, d)]
        weight: Any = _expert_slice(up.inputs[0].producer().inputs[1])  # type: ignore[union-attr]
        candidates.append(Candidate("grouped_mm", weight[0].name or up.name or "?", [up, *downs]))
    return candidates


def _sort(index: ir.Value) -> ir.Node | None:
    """The TopK (ascending) the rows' order comes from: the sort of the flat expert ids."""
    for value in upstream(index, limit=SORT_DEPTH):
        node = value.producer()
        if node is not None and node.op_type == "TopK" and int_attr(node, "largest", 1) == 0:
            return node
    return None


def read_grouped(products: list[ir.Node]) -> Block:
    """The block of an up product and the down product it feeds; NotFused says what differs."""
    if len(products) != 2:
        raise NotFused(f"{len(products)} grouped products in one block (the grouped_mm form has an up and a down one)")
    up, down = read_product(products[0]), read_product(products[1])
    if up.weight.shape[0] != down.weight.shape[0]:  # type: ignore[index]
        raise NotFused("the two projections have different numbers of experts")
    gate_in, up_bias = _bias(up.output, None)
    expert_rows, down_bias = _bias(down.output, None)
    weigh, scale_rows = _weighted(expert_rows)
    restore = _only_use(weigh.outputs[0], GATHERS)
    if restore is None or restore.inputs[0] is not weigh.outputs[0]:
        raise NotFused("the weighted rows are not put back in (token, slot) order by one gather")
    combined = _summed_per_token(restore.outputs[0])
    gather_rows = up.rows.producer()
    if gather_rows is None or gather_rows.op_type not in GATHERS or gather_rows.inputs[0] is None:
        raise NotFused("the up product's rows are not gathered token rows")
    sort = _sort(gather_rows.inputs[1])  # type: ignore[arg-type]
    if sort is None or sort.inputs[0] is None:
        raise NotFused("the rows' order does not come from an ascending TopK of the expert ids")
    ids = sort.inputs[0] if _is_ids(sort.inputs[0]) else _first(sort.inputs[0], _is_ids)
    floats = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
    scales = _first(scale_rows, lambda v: _rank(v) == 2 and v.dtype in floats, through=(*MOVES, *GATHERS))
    if ids is None and scales is None and _rank(sort.inputs[0]) == 1:  # top-1: [T] ids and weights (Zaya)
        ids = sort.inputs[0]
        per_token = lambda v: _rank(v) == 1 and v.dtype in floats and not _gathered(v)  # noqa: E731
        scales = _first(scale_rows, per_token, (*MOVES, *GATHERS))
    if ids is None or scales is None:
        raise NotFused("the [T, K] expert ids or routing weights are not found above the sort")
    return Block(
        form="grouped_mm",
        up_weight=up.weight,
        down_weight=down.weight,
        up_transpose=up.transpose,
        down_transpose=down.transpose,
        up_bias=up_bias,
        down_bias=down_bias,
        gate_in=gate_in,
        gate_out=down.rows,
        ids=ids,
        scales=scales,
        combined=combined,
        rows=_token_rows(gather_rows.inputs[0]),
    )
