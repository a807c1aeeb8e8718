"""FuseMoe: each MoE block of a transformers-5 export becomes the cann.moe chain.

transformers' ``batched_mm`` experts (``transformers.integrations.moe``), exported by
``torch.onnx.export``, compute per (token, slot) row ``s = t*K + j``::

    W_s = Gather(W_up [E, ., .], ids[s]);  u = MatMul(W_s, x[t]) (+ Gather(b_up, ids)[s])
    a = gate(u)                                            row-wise (silu(g) * up, gpt-oss's clamp, ...)
    d = MatMul(Gather(W_down, ids[s]), a) (+ Gather(b_down, ids)[s])
    y[t] = ReduceSum_j(Reshape(d * weights[s], [T, K, H]), axis 1)

A block is found from its two expert-weight Gathers (3-D constants, gathered on axis 0 by the
same index), their MatMuls and the combine; what each value is (the token rows ``x [T, H]``,
``ids [T, K]``, ``weights [T, K]``, the weights' layout) is read from the graph, then the
block is rewritten on a clone as::

    MoeInitRoutingV2(x, Cast(ids, int32)) -> GroupedMatmul(W_up[, b_up]) -> SwiGlu
        -> GroupedMatmul(W_down[, b_down]) -> MoeFinalizeRoutingV2(scales = weights)

(the gate as SwiGlu where that gives the same values, else the graph's own gate nodes, which
are row-wise, reading the GroupedMatmul rows) and accepted only when the clone computes the
block's output as the graph does on the converter's synthetic batches (:mod:`.world`,
relative :data:`RTOL`). Anything else is left as it is, and the report says why per block.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from moe_onnx.custom_ops import OPS

from .graph_utils import constant, op_node, output, remove_dead, upstream
from .world import World, WorldFailure, WorldUnavailable

GATHERS = ("Gather", "GatherND")
#: ops that move or re-view values without computing (walked through to find x, ids, weights)
MOVES = ("Unsqueeze", "Squeeze", "Reshape", "Expand", "Cast", "Identity", "Flatten")
#: relative tolerance of the numerical check, by the block output's dtype
RTOL = {ir.DataType.FLOAT: 1e-5, ir.DataType.DOUBLE: 1e-5, ir.DataType.FLOAT16: 2e-2, ir.DataType.BFLOAT16: 5e-2}
#: synthetic batches the check runs (the World's first ones; the long one when inputs are symbolic)
CHECK_BATCHES = ("random 1", "skewed", "long", "short")


class NotFused(Exception):
    """Why one block stays as it is."""


@dataclass
class BlockReport:
    """One MoE block: ``fused`` (now the cann.moe chain) or ``skipped`` (``reasons`` says why)."""

    block: str  # the up projection's weight
    status: str = "skipped"
    experts: int | None = None
    gate: str | None = None  # "SwiGlu" or "the graph's own gate nodes"
    check: str | None = None  # what the numerical check compared
    removed: int = 0
    added: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        head = f"MoE block '{self.block}': {self.status}"
        if self.status == "fused":
            head += (
                f" ({self.experts} experts, gate: {self.gate}); removed {self.removed} node(s), added {len(self.added)}"
            )
        lines = [head]
        if self.check:
            lines.append(f"    checked: {self.check}")
        return lines + [f"    {reason}" for reason in self.reasons]


@dataclass
class FuseReport:
    blocks: list[BlockReport] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0

    @property
    def changed(self) -> bool:
        return any(b.status == "fused" for b in self.blocks)

    def __str__(self) -> str:
        fused = sum(b.status == "fused" for b in self.blocks)
        lines = [f"fused {fused} of {len(self.blocks)} MoE block(s); nodes {self.nodes_before} -> {self.nodes_after}"]
        for block in self.blocks:
            lines += block.lines()
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "blocks": [asdict(b) for b in self.blocks],
        }

    def save_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_dict(), file, indent=2)


@dataclass
class Block:
    """What one block reads and computes, as found in the graph (before the check)."""

    up: ir.Node  # MatMul of the gathered up (or gate_up) weights
    down: ir.Node
    up_weight: ir.Value  # [E, N, K] (transpose_weight 1) or [E, K, N] (0)
    down_weight: ir.Value
    transpose_weight: int
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


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _only_use(value: ir.Value, op_type: str | tuple[str, ...]) -> ir.Node | None:
    uses = list(value.uses())
    types = (op_type,) if isinstance(op_type, str) else op_type
    if len(uses) == 1 and uses[0].node.op_type in types and not value.is_graph_output():
        return uses[0].node
    return None


def _expert_weight(node: ir.Node) -> ir.Value | None:
    """The 3-D constant a Gather / GatherND picks experts from on axis 0, or None."""
    if node.op_type not in GATHERS or node.domain not in ("", "ai.onnx"):
        return None
    data = node.inputs[0]
    if data is None or constant(data) is None or _rank(data) != 3:
        return None
    if node.op_type == "Gather" and (node.attributes.get("axis") is not None and node.attributes["axis"].value != 0):
        return None
    if node.op_type == "GatherND" and (
        node.attributes.get("batch_dims") is not None and node.attributes["batch_dims"].value != 0
    ):
        return None
    return data


def _first(value: ir.Value, want) -> ir.Value | None:
    """The nearest value above ``value`` (not itself: an index or scale already re-viewed for the
    rows) through MOVES for which ``want`` holds."""
    return next((v for v in upstream(value, through=lambda n: n.op_type in MOVES) if v is not value and want(v)), None)


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


def _bias(value: ir.Value, index: ir.Value) -> tuple[ir.Value, ir.Value | None]:
    """``(rows, bias)``: rows + Gather(bias [E, N], index) when that Add follows, else (value, None)."""
    add = _only_use(value, "Add")
    if add is None:
        return _past_round_trips(value), None
    other = add.inputs[1] if add.inputs[0] is value else add.inputs[0]
    gather = other.producer() if other is not None else None
    if gather is None or gather.op_type not in GATHERS or gather.inputs[1] is not index:
        return value, None
    bias = gather.inputs[0]
    if bias is None or constant(bias) is None or _rank(bias) != 2:
        return value, None
    return _past_round_trips(add.outputs[0]), bias


def find_blocks(graph: ir.Graph) -> list[tuple[str, list[ir.Node]]]:
    """The expert-weight Gathers grouped by their index value: ``(name, gathers)`` per group."""
    groups: dict[int, list[Any]] = {}
    for node in graph:
        if _expert_weight(node) is not None:
            groups.setdefault(id(node.inputs[1]), []).append(node)
    return [(g[0].inputs[0].name or g[0].name or "?", g) for g in groups.values()]


def read_block(gathers: list[Any]) -> Block:
    """The block those Gathers belong to; NotFused says which part is not the batched_mm form."""
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
    weigh = _only_use(expert_rows, "Mul")
    if weigh is None:
        raise NotFused("the experts' rows are not weighted by one Mul (a post-expert norm?)")
    scale_rows = weigh.inputs[1] if weigh.inputs[0] is expert_rows else weigh.inputs[0]
    reshape = _only_use(weigh.outputs[0], "Reshape")
    total: Any = _only_use(reshape.outputs[0], "ReduceSum") if reshape is not None else None
    if total is None or total.inputs[1] is None or constant(total.inputs[1]) is None:
        raise NotFused("the weighted rows are not summed per token by Reshape + ReduceSum")
    axes: Any = constant(total.inputs[1])
    if [int(a) for a in np.atleast_1d(axes)] not in ([1], [-2]):
        raise NotFused("the weighted rows are not summed over the top-k axis")
    ids = _first(index, lambda v: _rank(v) == 2 and v.dtype in (ir.DataType.INT64, ir.DataType.INT32))
    scales = _first(scale_rows, lambda v: _rank(v) == 2)  # type: ignore[arg-type]
    if ids is None or scales is None:
        raise NotFused("the [T, K] expert ids or routing weights are not found above the gathers")
    weight_in = up.inputs[1 - sides[0]]
    rows = [v for v in upstream(weight_in, through=lambda n: n.op_type in MOVES) if _rank(v) == 2][:3]
    return Block(
        up=up,
        down=down,
        up_weight=up_gather.inputs[0],
        down_weight=down_gather.inputs[0],
        transpose_weight=1 if sides[0] == 0 else 0,  # W_s @ x: W stored [E, N, K]
        up_bias=up_bias,
        down_bias=down_bias,
        gate_in=gate_in,
        gate_out=gate_out,
        ids=ids,
        scales=scales,
        combined=total.outputs[0],
        rows=rows,
    )


class _Nodes:
    """New nodes of one block, named ``{prefix}/...``."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.nodes: list[ir.Node] = []

    def add(self, node: ir.Node) -> ir.Node:
        self.nodes.append(node)
        return node

    def cast(self, value: ir.Value, to: ir.DataType, what: str) -> ir.Value:
        if value.dtype == to:
            return value
        node = self.add(ir.node("Cast", [value], {"to": to}, name=f"{self.prefix}/cast_{what}"))
        node.outputs[0].name = f"{self.prefix}/{what}"
        node.outputs[0].dtype = to
        return node.outputs[0]

    def op(self, name: str, inputs: list, attrs: dict, optional_outputs=(), tag: str = "") -> ir.Node:
        """A node of ``OPS[name]`` named ``{prefix}/{name}{tag}`` (its outputs ``.../{output}``)."""
        return self.add(op_node(OPS[name], inputs, attrs, f"{self.prefix}/{name}{tag}", optional_outputs))


def _typed(node: ir.Node, *dtypes) -> ir.Value:
    """Give ``node``'s outputs their element types (what the op's inference says); its first output."""
    for value, dtype in zip(node.outputs, dtypes):
        value.dtype = dtype
    return node.outputs[0]


def rewrite(graph: ir.Graph, block: Block, x: ir.Value, swi_glu: bool, prefix: str) -> tuple[ir.Value, list[str]]:
    """Put the chain in place of ``block`` (in ``graph``, a clone); the new output value and
    the removed node names."""
    new = _Nodes(prefix)
    cut_off: list[ir.Node | None] = []
    dtype: Any = block.up_weight.dtype
    grouped = {"group_type": 0, "group_list_type": 1, "transpose_weight": block.transpose_weight}
    bias_type = ir.DataType.FLOAT16 if dtype == ir.DataType.FLOAT16 else ir.DataType.FLOAT
    init = new.op(
        "MoeInitRoutingV2",
        [new.cast(x, dtype, "x"), new.cast(block.ids, ir.DataType.INT32, "ids")],
        {"expert_num": block.experts, "expert_tokens_count_or_cumsum_flag": 2},
        ("expert_tokens_count_or_cumsum",),
    )
    _typed(init, dtype, ir.DataType.INT32, ir.DataType.INT32)
    counts = new.cast(
        output(init, OPS["MoeInitRoutingV2"], "expert_tokens_count_or_cumsum"), ir.DataType.INT64, "counts"
    )
    up_bias = None if block.up_bias is None else new.cast(block.up_bias, bias_type, "up_bias")
    rows = output(init, OPS["MoeInitRoutingV2"], "expanded_x")
    h = _typed(new.op("GroupedMatmul", [rows, block.up_weight, up_bias, counts], grouped, tag="_up"), dtype)
    if swi_glu:
        a = _typed(new.op("SwiGlu", [h], {"dim": -1}), dtype)
    else:  # the graph's gate is row-wise: it reads the expert-major rows as well
        cut_off.append(block.gate_in.producer())  # the old up projection, now read by nothing
        ir.convenience.replace_all_uses_with(block.gate_in, h)
        a = block.gate_out
    down_bias = None if block.down_bias is None else new.cast(block.down_bias, bias_type, "down_bias")
    down = new.op(
        "GroupedMatmul", [new.cast(a, dtype, "gate_out"), block.down_weight, down_bias, counts], grouped, tag="_down"
    )
    d = _typed(down, dtype)
    index = output(init, OPS["MoeInitRoutingV2"], "expanded_row_idx")
    scales = new.cast(block.scales, dtype, "scales")
    y = _typed(new.op("MoeFinalizeRoutingV2", [d, index, None, None, None, scales], {"drop_pad_mode": 2}), dtype)
    y = new.cast(y, block.combined.dtype, "y")  # type: ignore[arg-type]
    graph.extend(new.nodes)
    graph.opset_imports.setdefault("cann.moe", 1)
    old = block.combined.producer()
    ir.convenience.replace_all_uses_with(block.combined, y)
    for i, out in enumerate(graph.outputs):
        if out is block.combined:
            graph.outputs[i] = y
    removed = remove_dead(graph, [n for n in (old, *cut_off) if n is not None])
    graph.sort()
    return y, removed


def _mapped(clone: ir.Model, original: ir.Graph, value: ir.Value) -> ir.Value:
    """The clone's value of the same name."""
    names = {v.name: v for n in clone.graph for v in n.outputs}
    names.update({v.name: v for v in clone.graph.inputs})
    names.update(clone.graph.initializers)
    return names[value.name]


def check(before: World, after: World, want: ir.Value, got: ir.Value) -> str:
    """Compare the block output on the synthetic batches; raises NotFused on a difference."""
    rtol = RTOL.get(want.dtype, 1e-5)  # type: ignore[arg-type]
    batches = [b for b in before.batches() if b.name in CHECK_BATCHES]
    worst = 0.0
    for batch in batches:
        try:
            expected = before.evaluate(batch, [want], ranks=1)[want.name or ""].astype(np.float64)
            actual = after.evaluate(batch, [got], ranks=1)[got.name or ""].astype(np.float64)
        except (WorldFailure, WorldUnavailable) as error:
            raise NotFused(f"the check could not run on {batch.describe()}: {error}") from None
        if expected.shape != actual.shape:
            raise NotFused(
                f"{batch.describe()}: the chain gives {list(actual.shape)}, the block {list(expected.shape)}"
            )
        scale = float(np.abs(expected).max()) or 1.0
        difference = float(np.abs(actual - expected).max()) / scale
        worst = max(worst, difference)
        if not difference <= rtol:
            raise NotFused(
                f"{batch.describe()}: the chain differs from the block by {difference:.2e} (relative) > {rtol:g}"
            )
    return f"{len(batches)} synthetic batches, largest relative difference {worst:.1e} (<= {rtol:g})"


class FuseMoe:
    """The pass; ``report`` after the call. The model is changed only by fused blocks."""

    def __init__(self):
        self.report = FuseReport()

    def __call__(self, model: ir.Model) -> FuseReport:
        report = FuseReport(nodes_before=len(model.graph))
        self.report = report
        current = model.clone()
        for number, (name, _) in enumerate(find_blocks(current.graph)):
            entry = BlockReport(block=name)
            report.blocks.append(entry)
            gathers = dict(find_blocks(current.graph))[name]  # (in the latest clone)
            try:
                block = read_block(gathers)
                entry.experts = block.experts
                current = self._fuse(current, block, entry, f"fused_moe_{number}")
            except NotFused as why:
                entry.reasons.append(str(why))
        if report.changed:
            current.graph.opset_imports.setdefault("cann.moe", 1)
            model.graph = current.graph
        report.nodes_after = len(model.graph)
        return report

    def _fuse(self, current: ir.Model, block: Block, entry: BlockReport, prefix: str) -> ir.Model:
        before = World(current)
        tried = []
        for swi_glu in (True, False):
            for x in block.rows:
                clone = current.clone()
                fields: dict[str, Any] = {
                    k: _mapped(clone, current.graph, v) if isinstance(v, ir.Value) else v
                    for k, v in vars(block).items()
                    if k != "rows"
                }
                mapped = Block(**{**fields, "rows": []})
                try:
                    got, removed = rewrite(clone.graph, mapped, _mapped(clone, current.graph, x), swi_glu, prefix)
                    entry.check = check(before, World(clone), block.combined, got)
                except NotFused as why:
                    tried.append(f"{'SwiGlu' if swi_glu else 'own gate'} on rows '{x.name}': {why}")
                    continue
                except Exception as error:  # a reading that does not even build (shapes, dtypes) is not it
                    tried.append(
                        f"{'SwiGlu' if swi_glu else 'own gate'} on rows '{x.name}': "
                        f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
                    )
                    continue
                entry.status = "fused"
                entry.gate = "SwiGlu" if swi_glu else "the graph's own gate nodes"
                entry.removed = len(removed)
                entry.added = [n.name or "" for n in clone.graph if (n.name or "").startswith(prefix + "/")]
                return clone
        raise NotFused("no reading of the block computes what it does: " + "; ".join(tried))
