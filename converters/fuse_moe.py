"""FuseMoe: each MoE block of a transformers-5 export becomes the cann.moe chain.

:mod:`.moe_blocks` reads each block (transformers' ``batched_mm`` or ``grouped_mm`` form): the
token rows ``x [T, H]``, ``ids [T, K]``, ``weights [T, K]``, the experts' weights and their
layout, biases, the gate's input and output rows and the combined output. The block is then
rewritten on a clone as::

    MoeInitRoutingV3(x, Cast(ids, int32)) -> GroupedMatmul(W_up[, b_up]) -> SwiGlu
        -> GroupedMatmul(W_down[, b_down]) -> MoeFinalizeRoutingV2(scales = weights)

(the gate as SwiGlu where that gives the same values, else the graph's own gate nodes, which
are row-wise, reading the GroupedMatmul rows) and accepted only when the clone computes the
block's output as the graph does on the converter's synthetic batches (:mod:`.world`,
relative :data:`RTOL`). Anything else is left as it is, and the report says why per block.
A fused block's router then becomes a gating op where :func:`rewrite_router` reads one
(``TopK(Softmax(logits), k)`` and ``Softmax(TopK(logits, k))``: MoeGatingTopKSoftmax; DeepSeek-V3's
grouped sigmoid with bias and routed scaling: MoeGatingTopK), again only where the check proves
the block's output unchanged. Last, each fused block's cann.moe nodes are put back to back in
the node order (:func:`.graph_utils.run_together`; the gating too where nothing between it and
the dispatch needs it first), with no int32 -> int64 -> int32 Cast of the ids between them, so
that ``moe_onnx.InferenceSession`` runs them as one step (``moe_onnx.runtime.chains``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

from moe_onnx.custom_ops import OPS

from .graph_utils import constant, int_attr, op_node, output, remove_dead, run_together, skip_round_trip_cast, upstream
from .moe_blocks import Block, Candidate, NotFused, find_candidates
from .world import World, WorldFailure, WorldUnavailable

#: relative tolerance of the numerical check, by the block output's dtype
RTOL = {ir.DataType.FLOAT: 1e-5, ir.DataType.DOUBLE: 1e-5, ir.DataType.FLOAT16: 2e-2, ir.DataType.BFLOAT16: 5e-2}
#: the dispatch: MoeInitRoutingV3's per-expert counts are int64, GroupedMatmul's group_list type,
#: so no Cast stands between the chain's nodes (the executor runs them as one step)
DISPATCH = "MoeInitRoutingV3"
#: synthetic batches the check runs (the World's first ones; the long one when inputs are symbolic)
CHECK_BATCHES = ("random 1", "skewed", "long", "short")


@dataclass
class BlockReport:
    """One MoE block: ``fused`` (now the cann.moe chain) or ``skipped`` (``reasons`` says why)."""

    block: str  # the up projection's weight
    form: str = ""  # "batched_mm" or "grouped_mm" (transformers' experts implementation it reads as)
    status: str = "skipped"
    experts: int | None = None
    gate: str | None = None  # "SwiGlu" or "the graph's own gate nodes"
    router: str | None = None  # "MoeGatingTopKSoftmax", or why the router stays as exported
    check: str | None = None  # what the numerical check compared
    removed: int = 0
    added: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        head = f"MoE block '{self.block}' ({self.form}): {self.status}"
        if self.status == "fused":
            head += (
                f" ({self.experts} experts, gate: {self.gate}); removed {self.removed} node(s), added {len(self.added)}"
            )
        lines = [head]
        if self.check:
            lines.append(f"    checked: {self.check}")
        if self.router:
            lines.append(f"    router: {self.router}")
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

    def per_token(self, value: ir.Value, what: str) -> ir.Value:
        """``value`` as ``[T, K]``: a top-1 block's ``[T]`` ids or weights (Zaya's grouped_mm
        export) get their slot axis back (Unsqueeze axis 1); a 2-D value is itself."""
        if value.shape is None or len(value.shape) != 1:
            return value
        one = ir.tensor(np.array([1], np.int64))
        axes = self.add(ir.node("Constant", [], {"value": one}, name=f"{self.prefix}/{what}_axis"))
        node = self.add(ir.node("Unsqueeze", [value, axes.outputs[0]], name=f"{self.prefix}/{what}_per_token"))
        node.outputs[0].name = f"{self.prefix}/{what}_per_token"
        if value.dtype is not None:
            node.outputs[0].dtype = value.dtype
        return node.outputs[0]

    def op(self, name: str, inputs: list, attrs: dict, optional_outputs=(), tag: str = "") -> ir.Node:
        """A node of ``OPS[name]`` named ``{prefix}/{name}{tag}`` (its outputs ``.../{output}``)."""
        return self.add(op_node(OPS[name], inputs, attrs, f"{self.prefix}/{name}{tag}", optional_outputs))


def _typed(node: ir.Node, *dtypes) -> ir.Value:
    """Give ``node``'s outputs their element types (what the op's inference says); its first output."""
    for value, dtype in zip(node.outputs, dtypes):
        value.dtype = dtype
    return node.outputs[0]


def rewrite(
    graph: ir.Graph, block: Block, x: ir.Value, swi_glu: bool, prefix: str, transposed: dict | None = None
) -> tuple[ir.Value, list[str]]:
    """Put the chain in place of ``block`` (in ``graph``, a clone); the new output value and
    the removed node names. ``transposed``: :func:`weight_rows`' copies, kept across calls."""
    new = _Nodes(prefix)
    cut_off: list[ir.Node | None] = []
    dtype: Any = block.up_weight.dtype
    grouped = {"group_type": 0, "group_list_type": 1}
    bias_type = ir.DataType.FLOAT16 if dtype == ir.DataType.FLOAT16 else ir.DataType.FLOAT
    init = new.op(
        DISPATCH,
        [new.cast(x, dtype, "x"), new.cast(new.per_token(block.ids, "ids"), ir.DataType.INT32, "ids")],
        {"expert_num": block.experts, "expert_tokens_num_type": 1, "expert_tokens_num_flag": 1},
    )
    _typed(init, dtype, ir.DataType.INT32, ir.DataType.INT64, ir.DataType.FLOAT)
    counts = output(init, OPS[DISPATCH], "expert_tokens_count_or_cumsum")  # int64, what GroupedMatmul reads
    up_bias = None if block.up_bias is None else new.cast(block.up_bias, bias_type, "up_bias")
    rows = output(init, OPS[DISPATCH], "expanded_x")
    up_weight, up_transpose = weight_rows(graph, block.up_weight, block.up_transpose, f"{prefix}/up_weight", transposed)
    h = _typed(
        new.op(
            "GroupedMatmul",
            [rows, up_weight, up_bias, counts],
            {**grouped, "transpose_weight": up_transpose},
            tag="_up",
        ),
        dtype,
    )
    if swi_glu:
        a = _typed(new.op("SwiGlu", [h], {"dim": -1}), dtype)
    else:  # the graph's gate is row-wise: it reads the expert-major rows as well
        cut_off.append(block.gate_in.producer())  # the old up projection, now read by nothing
        ir.convenience.replace_all_uses_with(block.gate_in, h)
        a = block.gate_out
    down_bias = None if block.down_bias is None else new.cast(block.down_bias, bias_type, "down_bias")
    down_weight, down_transpose = weight_rows(
        graph, block.down_weight, block.down_transpose, f"{prefix}/down_weight", transposed
    )
    down = new.op(
        "GroupedMatmul",
        [new.cast(a, dtype, "gate_out"), down_weight, down_bias, counts],
        {**grouped, "transpose_weight": down_transpose},
        tag="_down",
    )
    d = _typed(down, dtype)
    index = output(init, OPS[DISPATCH], "expanded_row_idx")
    scales = new.cast(new.per_token(block.scales, "scales"), dtype, "scales")
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


def weight_rows(
    graph: ir.Graph, weight: ir.Value, transposed: int, name: str, copies: dict | None = None
) -> tuple[ir.Value, int]:
    """``(weight, transpose_weight)`` for a GroupedMatmul: the experts' weight stored ``[E, N, K]``
    (transpose_weight 1, transformers' own layout), whose rows the decode kernels stream as
    they are stored (``GroupedMatmul``'s lane dots, the executor's chain step). An ``[E, K, N]``
    initializer (transformers' exporter folds the Transpose of the ``[E, N, K]`` parameter
    into one) is stored transposed back, once, as a new initializer ``name``; a weight stored
    so already, or computed by the graph, is kept as it is. ``copies`` (source tensor id ->
    ``(source, copy)``) keeps the copies for later calls: the pass tries several readings of a
    block, each on a clone that shares the initializers' tensors."""
    stored = weight.const_value if weight.is_initializer() else None
    if transposed or stored is None or len(stored.shape) != 3:
        return weight, transposed
    copies = {} if copies is None else copies
    source, rows = copies.get(id(stored), (None, None))
    if source is not stored or rows is None:
        rows = ir.tensor(np.ascontiguousarray(np.swapaxes(stored.numpy(), 1, 2)), name=name)
        copies[id(stored)] = (stored, rows)
    while name in graph.initializers:  # a model fused before
        name += "_"
    shape = ir.Shape(rows.numpy().shape)  # (the array ir.tensor wraps: no copy)
    value = ir.Value(name=name, shape=shape, type=ir.TensorType(rows.dtype), const_value=rows)
    graph.register_initializer(value)
    return value, 1


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


def _again(graph: ir.Graph, found: Candidate) -> Candidate:
    """The candidate of the same form and name in ``graph`` (a later clone)."""
    return next(c for c in find_candidates(graph) if (c.form, c.name) == (found.form, found.name))


class FuseMoe:
    """The pass; ``report`` after the call. The model is changed only by fused blocks."""

    def __init__(self):
        self.report = FuseReport()

    def __call__(self, model: ir.Model) -> FuseReport:
        report = FuseReport(nodes_before=len(model.graph))
        self.report = report
        current = model.clone()
        if any(v.shape is None for n in current.graph for v in n.outputs):  # the legacy exporter writes no shapes
            ShapeInferencePass(strict_mode=False)(current)  # the readers ask values' ranks
        for number, found in enumerate(find_candidates(current.graph)):
            entry = BlockReport(block=found.name, form=found.form)
            report.blocks.append(entry)
            try:
                block = _again(current.graph, found).read()  # (in the latest clone)
                entry.experts = block.experts
                current = self._fuse(current, block, entry, f"fused_moe_{number}")
            except NotFused as why:
                entry.reasons.append(str(why))
                continue
            together(current.graph, f"fused_moe_{number}")
            entry.added = [n.name or "" for n in current.graph if (n.name or "").startswith(f"fused_moe_{number}/")]
        if report.changed:
            current.graph.opset_imports.setdefault("cann.moe", 1)
            model.graph = current.graph
        report.nodes_after = len(model.graph)
        return report

    def _fuse(self, current: ir.Model, block: Block, entry: BlockReport, prefix: str) -> ir.Model:
        before = World(current)
        tried = []
        transposed: dict = {}  # weight_rows' copies, shared by this block's readings
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
                    got, removed = rewrite(
                        clone.graph, mapped, _mapped(clone, current.graph, x), swi_glu, prefix, transposed
                    )
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
                return self._router(clone, block, before, got, entry, prefix)
        raise NotFused("no reading of the block computes what it does: " + "; ".join(tried))

    def _router(
        self, current: ir.Model, block: Block, before: World, got: ir.Value, entry: BlockReport, prefix: str
    ) -> ir.Model:
        """``current`` (the block fused, its output ``got``) with the block's router as a cann.moe
        gating op where :func:`rewrite_router` reads one and the check proves the block's output
        equal to the original's (``block.combined`` in ``before``); else ``current``, and the
        report says why."""
        clone = current.clone()
        try:
            ids, scales = _by_name(clone, block.ids.name or ""), _by_name(clone, block.scales.name or "")
            name = rewrite_router(clone.graph, ids, scales, prefix)
            proof = check(before, World(clone), block.combined, _by_name(clone, got.name or ""))
            entry.router = f"{name} ({proof})"
            return clone
        except NotFused as why:
            entry.router = f"left as exported: {why}"
        except Exception as error:  # a reading that does not build
            entry.router = f"left as exported: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return current


def together(graph: ir.Graph, prefix: str) -> None:
    """The cann.moe nodes named ``{prefix}/...`` (one fused block) back to back in the node
    order, the gating with them where the data flow allows (a renormalisation of its
    probabilities that the combine reads runs between them: then from the dispatch on), after
    skipping the round trip of the ids through int64 between the gating and the dispatch.
    Only the order changes (and the skipped casts, exact): the values do not."""
    for node in [n for n in graph if (n.name or "").startswith(prefix + "/") and n.op_type == "Cast"]:
        skip_round_trip_cast(graph, node)
    ours = [n for n in graph if (n.name or "").startswith(prefix + "/") and n.domain == "cann.moe"]
    if not run_together(graph, ours) and ours and ours[0].op_type.startswith("MoeGating"):
        run_together(graph, ours[1:])


def _by_name(model: ir.Model, name: str) -> ir.Value:
    names = {v.name: v for n in model.graph for v in n.outputs}
    names.update({v.name: v for v in model.graph.inputs})
    return names[name]


#: ops a router's selection value is computed through from its scores (bias, group mask, casts)
SELECTION_OPS = ("Add", "Where", "Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze", "Expand", "Not")
#: how far up (values) the router's parts are searched from the TopK
ROUTER_DEPTH = 64


def _replace(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    ir.convenience.replace_all_uses_with(old, new)
    for i, out in enumerate(graph.outputs):
        if out is old:
            graph.outputs[i] = new


def _last_axis(node: ir.Node, value: ir.Value | None, default: int = -1) -> bool:
    rank = len(value.shape) if value is not None and value.shape is not None else None
    return int_attr(node, "axis", default) in (-1, (rank or 0) - 1)


def _scalar(value: ir.Value | None) -> float | None:
    found = constant(value) if value is not None else None
    return float(found.ravel()[0]) if found is not None and found.size == 1 else None


def rewrite_router(graph: ir.Graph, ids: ir.Value, scales: ir.Value, prefix: str) -> str:
    """Replace the router whose TopK gives ``ids [T, K]`` (and whose weights are ``scales
    [T, K]``) by a gating op; what the report calls it. Three readings, by what the graph
    computes from the TopK back to the router logits:

    * ``TopK(Softmax(logits), k)``: MoeGatingTopKSoftmax(logits, k) (renormalisation, if any,
      left as the graph's nodes reading the op's probabilities);
    * ``Softmax(TopK(logits, k).values)`` (gpt-oss): MoeGatingTopKSoftmax, then ``y / sum(y)``
      (the same values: the softmax of the k largest logits);
    * ``TopK(Sigmoid(logits) [+ bias] [group mask], k)`` with weights ``GatherElements(sigmoid,
      ids) / sum * scale`` (DeepSeek-V3): MoeGatingTopK (norm_type 1, the groups read from the
      group scores' Reshape and TopKs).

    Which reading applies is read here; that it computes the same is the caller's check.
    NotFused says which part is not a gating op's router."""
    topk = ids.producer()
    if topk is None or topk.op_type != "TopK" or len(topk.outputs) < 2 or topk.outputs[1] is not ids:
        raise NotFused("the expert ids are not a TopK's indices")
    selection: Any = topk.inputs[0]
    if int_attr(topk, "largest", 1) != 1 or not _last_axis(topk, selection):
        raise NotFused("the TopK does not take the largest scores over the experts")
    k = constant(topk.inputs[1]) if len(topk.inputs) > 1 else None
    if k is None or k.size != 1:
        raise NotFused("the TopK's k is not a constant")
    top = int(k.ravel()[0])
    new = _Nodes(prefix)
    source = selection.producer()
    after = [u.node for u in topk.outputs[0].uses() if u.node.op_type == "Softmax"]
    if source is not None and source.op_type == "Softmax" and _last_axis(source, selection):
        name = "MoeGatingTopKSoftmax"
        probs, experts = _softmax_gating(new, source.inputs[0], top, ids)
        probs = new.cast(probs, topk.outputs[0].dtype, "router_probs")  # type: ignore[arg-type]
        replaced = [(topk.outputs[0], probs), (ids, experts)]
    elif len(after) == 1 and _last_axis(after[0], topk.outputs[0]):
        name = "MoeGatingTopKSoftmax + renormalisation (top-k logits, then softmax)"
        probs, experts = _softmax_gating(new, selection, top, ids)
        axes = new.add(ir.node("Constant", [], {"value": ir.tensor(np.array([-1], np.int64))}, name=f"{prefix}/axes"))
        total = new.add(ir.node("ReduceSum", [probs, axes.outputs[0]], {"keepdims": 1}, name=f"{prefix}/router_sum"))
        share = new.add(ir.node("Div", [probs, total.outputs[0]], name=f"{prefix}/router_renorm"))
        share.outputs[0].dtype = probs.dtype  # type: ignore[assignment]
        probs = new.cast(share.outputs[0], after[0].outputs[0].dtype, "router_probs")  # type: ignore[arg-type]
        replaced = [(after[0].outputs[0], probs), (ids, experts)]
    else:
        name, weights, experts = _grouped_sigmoid(new, topk, top, ids, scales)
        replaced = [(scales, weights), (ids, experts)]
    graph.extend(new.nodes)
    dead = [old.producer() for old, _ in replaced]
    for old, value in replaced:
        _replace(graph, old, value)
    remove_dead(graph, [n for n in (topk, *dead) if n is not None])
    graph.sort()
    return name


def _softmax_gating(new: _Nodes, logits: ir.Value, k: int, ids: ir.Value) -> tuple[ir.Value, ir.Value]:
    """MoeGatingTopKSoftmax(logits, k): ``(probs [T, k] in the logits' dtype, ids in ids' dtype)``."""
    gating = new.op("MoeGatingTopKSoftmax", [logits], {"k": k})
    _typed(gating, logits.dtype, ir.DataType.INT32, ir.DataType.INT32)
    return gating.outputs[0], new.cast(gating.outputs[1], ids.dtype, "router_ids")  # type: ignore[arg-type]


def _groups(selection: ir.Value, topk: ir.Node) -> tuple[int, int, int]:
    """``(group_count, k_group, group_select_mode)`` of the group mask above ``selection``:
    the group scores ``[T, G, E/G]`` (TopK 2 then ReduceSum: mode 1; ReduceMax: mode 0) and the
    TopK of the k_group best groups ``[T, G]``; ``(1, 1, 0)`` where there is no mask."""
    nodes = [v.producer() for v in upstream(selection, limit=ROUTER_DEPTH)]
    tops = [n for n in nodes if n is not None and n.op_type == "TopK" and n is not topk]
    count = k_group = None
    mode = 0
    for node in tops:
        rank = len(node.inputs[0].shape) if node.inputs[0] is not None and node.inputs[0].shape is not None else None
        k = constant(node.inputs[1]) if len(node.inputs) > 1 else None
        if rank == 3 and k is not None and int(k.ravel()[0]) == 2:
            dims: Any = node.inputs[0].shape  # type: ignore[union-attr]
            count, mode = dims[1], 1
        elif rank == 2 and k is not None:
            k_group = int(k.ravel()[0])
    for other in nodes:
        if count is None and other is not None and other.op_type == "ReduceMax" and other.inputs[0] is not None:
            dims = other.inputs[0].shape
            if dims is not None and len(dims) == 3:
                count, mode = dims[1], 0
    if count is None and k_group is None:
        return 1, 1, 0
    if not isinstance(count, int) or k_group is None:
        raise NotFused("the router masks groups of experts, but their count or the groups kept are not read")
    return count, k_group, mode


def _grouped_sigmoid(
    new: _Nodes, topk: ir.Node, k: int, ids: ir.Value, scales: ir.Value
) -> tuple[str, ir.Value, ir.Value]:
    """MoeGatingTopK for a sigmoid router: ``(report name, weights as scales, ids)``."""
    selection: Any = topk.inputs[0]
    walk = [v.producer() for v in upstream(selection, through=lambda n: n.op_type in SELECTION_OPS, limit=ROUTER_DEPTH)]
    sigmoid = next((n for n in walk if n is not None and n.op_type in ("Sigmoid", "Softmax")), None)
    if sigmoid is not None and sigmoid.op_type == "Softmax" and not _last_axis(sigmoid, sigmoid.inputs[0]):
        sigmoid = None
    if sigmoid is None:
        raise NotFused(
            "the TopK reads neither a softmax over the experts, nor logits whose top k a softmax normalises, "
            "nor a sigmoid of the logits"
        )
    probs = sigmoid.outputs[0]
    bias = None
    for node in walk:
        if node is not None and node.op_type == "Add" and probs in node.inputs:
            other = node.inputs[1] if node.inputs[0] is probs else node.inputs[0]
            found = constant(other) if other is not None else None
            if found is not None and found.size == found.shape[-1] == (probs.shape or [0])[-1]:
                bias = other  # [E] or [1, E]
    factor, normalised, value = 1.0, False, scales
    while (node := value.producer()) is not None:  # the weights, from the block up to the gathered scores
        scale = _scalar(node.inputs[1]) if node.op_type == "Mul" and len(node.inputs) == 2 else None
        if node.op_type == "Mul" and scale is None and len(node.inputs) == 2:
            scale = _scalar(node.inputs[0])
            value_in = node.inputs[1]
        else:
            value_in = node.inputs[0]
        if scale is not None:
            factor *= scale
        elif node.op_type == "Div" and not normalised:
            normalised = True
        elif node.op_type not in ("Cast", "Identity", "Reshape"):
            break
        value = value_in  # type: ignore[assignment]
    gather = value.producer()
    if gather is None or gather.op_type != "GatherElements" or gather.inputs[1] is not ids:
        raise NotFused("the routing weights are not the chosen experts' sigmoid scores (GatherElements by the ids)")
    if gather.inputs[0] is not probs:
        raise NotFused("the routing weights are gathered from other scores than the TopK's sigmoid")
    softmax = sigmoid.op_type == "Softmax"
    if not normalised and not softmax:
        raise NotFused("sigmoid weights not renormalised: MoeGatingTopK renormalises sigmoid scores always")
    count, k_group, mode = _groups(selection, topk)
    logits = new.cast(sigmoid.inputs[0], ir.DataType.FLOAT, "router_logits")  # type: ignore[arg-type]
    offset = None
    if bias is not None:
        flat = new.add(
            ir.node("Constant", [], {"value": ir.tensor(np.array([-1], np.int64))}, name=f"{new.prefix}/flat")
        )
        reshape = new.add(ir.node("Reshape", [bias, flat.outputs[0]], name=f"{new.prefix}/router_bias_1d"))
        reshape.outputs[0].dtype = bias.dtype  # type: ignore[assignment]
        offset = new.cast(reshape.outputs[0], ir.DataType.FLOAT, "router_bias")
    attrs = {
        "k": k,
        "k_group": k_group,
        "group_count": count,
        "group_select_mode": mode,
        "norm_type": 0 if softmax else 1,
        "renorm": int(softmax and normalised),
        "routed_scaling_factor": factor,
        "eps": 1e-20,
    }
    gating = new.op("MoeGatingTopK", [logits, offset], attrs)
    _typed(gating, ir.DataType.FLOAT, ir.DataType.INT32, ir.DataType.FLOAT)
    weights = new.cast(gating.outputs[0], scales.dtype, "router_weights")  # type: ignore[arg-type]
    experts = new.cast(gating.outputs[1], ids.dtype, "router_ids")  # type: ignore[arg-type]
    groups = f", {count} groups keep {k_group}" if count > 1 else ""
    kind = ("softmax, renormalised" if normalised else "softmax") if softmax else "sigmoid"
    return f"MoeGatingTopK ({kind}{', bias' if bias is not None else ''}{groups}, scale {factor:g})", weights, experts
