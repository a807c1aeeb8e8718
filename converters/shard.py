"""ShardExperts: one single-device MoE model -> N expert-parallel rank models.

Input: a model whose MoE layers are the ``cann.moe`` chain (the experts' rows sorted by
expert, one product per expert, combined by the routing index)::

    rows [A, H], row_idx, counts [E] = MoeInitRoutingV2 / V3 (x [T, H], expert_idx [T, K])
    ... GroupedMatmul (weight [E, ...]) / SwiGlu / row-wise ops, group_list from counts ...
    y [T, H] = MoeFinalizeRoutingV2 (experts' out [A, H], row_idx, ...)

Output, rank r of N (E experts, L = E / N local experts: global expert e lives on rank e // L,
local expert e % L); everything outside the experts stays as it is (data parallel: each rank
runs its own batch, non-expert weights replicated)::

    counts64 [E]   = the routing's counts as int64 (differenced first if they are a cumsum)
    per_rank [N, L] = counts64.reshape(N, L)            row d: rows this rank sends to rank d's experts
    send [N]        = per_rank.sum(1)
    recv_per_rank [N, L], _ = AllToAll(per_rank, ones[N])   [s, j]: rows rank s sends for local expert j
    received [R, H], recv [N] = AllToAll(rows, send)        rank-major: source rank s, then local expert j
    routed [R, H], _, to_expert_major [R], local_counts [L] = MoeReRoutingV2(received, recv_per_rank, idx_type=1)
        to_expert_major[src] = dst: received row src (rank-major) is routed row dst (expert-major)
    ... the experts with weight[r*L : (r+1)*L] and group_list = local_counts (group_list_type 1) ...
    rank_major [R, H] = Gather(expert_out, to_expert_major)   rank_major[src] = expert_out[dst(src)]
    returned [A, H], _ = AllToAll(rank_major, recv)           each row back where it was sent from,
                                                               so in the routing's own row order
    y = MoeFinalizeRoutingV2(returned, row_idx, ...)           unchanged

Since ``rows`` are sorted by expert, the rows for rank d's experts are one contiguous block
(experts d*L .. d*L+L-1), which is what AllToAll sends to rank d. The combine sees every row
exactly where the single-device model had it, so each rank's output is the single-device model's
output on that rank's batch (every expert row goes through the same per-row arithmetic).

Refused by name (:class:`NotShardable`, a :class:`ConversionError`): E % N != 0; drop/pad
routing (``drop_pad_mode`` 1); a routing without per-expert counts; an active expert range
short of [0, E); ops between the routing and the combine that are not row-wise; expert weights
that are not constants with E rows; a group_list not computed from the routing's counts; a
model that already holds collectives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from moe_onnx.custom_ops import DOMAIN, OPS

from .errors import ConversionError
from .graph_utils import constant, int_attr, op_node, output, remove_dead

ROUTINGS = ("MoeInitRoutingV2", "MoeInitRoutingV3")
FINALIZE = "MoeFinalizeRoutingV2"
COLLECTIVES = ("AllToAll", "AllGather")
#: standard ops whose output row i depends only on input row i (other inputs: constants with no rows)
ROW_WISE = frozenset(
    "Abs Add Cast Clip Div Erf Exp Gelu HardSigmoid HardSwish Identity LeakyRelu Log Max Min Mish Mul Neg Pow "
    "Reciprocal Relu Selu Sigmoid Softplus Sqrt Sub Tanh".split()
)
#: ops a weight may pass through between its initializer and GroupedMatmul (expert axis 0 kept)
WEIGHT_PATH = frozenset(("Cast", "Identity", "Transpose"))


class NotShardable(ConversionError):
    """The model cannot be split over the ranks asked for; the message names the node and the rule."""


@dataclass
class MoeLayer:
    """One MoE layer of a graph, as :func:`find_layers` found it.

    ``rows [A, H]``: the routing's rows sorted by expert; ``counts``: its per-expert counts
    (``cumsum``: their running sum); ``result``: the experts' output the combine reads;
    ``region``: the nodes from ``rows`` to ``result`` (graph order); ``expert_weights``: the
    initializers indexed by expert on axis 0 ([E, ...]); ``group_lists``: (GroupedMatmul,
    input index) of each group_list to replace by the local counts.
    """

    routing: ir.Node
    finalize: ir.Node
    experts: int
    rows: ir.Value
    counts: ir.Value
    cumsum: bool
    result: ir.Value
    region: list[ir.Node]
    expert_weights: list[ir.Value] = field(default_factory=list)
    weight_paths: list[ir.Node] = field(default_factory=list)
    group_lists: list[ir.Node] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.routing.op_type} '{self.routing.name}'"


def _refuse(layer_node: ir.Node, rule: str) -> NotShardable:
    return NotShardable(f"{layer_node.op_type} '{layer_node.name}': {rule}")


def _counts_output(routing: ir.Node, ranks: int) -> tuple[int, ir.Value, bool]:
    """``(E, counts value, is_cumsum)`` of a routing node, or :class:`NotShardable`."""
    op = routing.op_type
    experts = int_attr(routing, "expert_num", 0)
    if int_attr(routing, "drop_pad_mode", 0) != 0:
        raise _refuse(routing, "drop/pad routing (drop_pad_mode 1, rows [E, C, H]) is not sharded: dropless only")
    if op == "MoeInitRoutingV2":
        flag = int_attr(routing, "expert_tokens_count_or_cumsum_flag", 0)
        cumsum = flag == 1
    else:
        flag = int_attr(routing, "expert_tokens_num_flag", 0)
        kind = int_attr(routing, "expert_tokens_num_type", 0)
        if flag and kind == 2:
            raise _refuse(routing, "key/value counts (expert_tokens_num_type 2) are not sharded: count or cumsum only")
        if int_attr(routing, "quant_mode", -1) != -1:
            raise _refuse(routing, "quantised routing (quant_mode != -1) is not sharded")
        cumsum = kind == 0
        span = int_attr(routing, "active_expert_range", None)
        if span and list(span) != [0, experts]:
            raise _refuse(routing, f"active_expert_range {list(span)} is not [0, {experts}): every expert must route")
    counts = routing.outputs[2] if len(routing.outputs) > 2 else None
    if not flag or counts is None or not counts.name:
        raise _refuse(routing, "has no per-expert counts output: the experts' groups cannot be sent to their ranks")
    if experts <= 0:
        raise _refuse(routing, f"expert_num is {experts}: the number of experts must be known (> 0)")
    if experts % ranks:
        raise _refuse(
            routing, f"E = {experts} experts do not split evenly over {ranks} ranks (E % N = {experts % ranks})"
        )
    return experts, counts, cumsum


def _group_list_level(value: ir.Value | None, counts: ir.Value) -> int | None:
    """How many running sums ``value`` is of ``counts`` (0: the counts themselves), walking up
    through Cast / Identity / CumSum (plain); None when it is not computed from them that way."""
    level = 0
    while value is not None and value is not counts:
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "CumSum":
            if int_attr(node, "exclusive", 0) or int_attr(node, "reverse", 0):
                return None
            level += 1
        elif node.op_type not in ("Cast", "Identity"):
            return None
        value = node.inputs[0]
    return None if value is None else level


def _expert_constant(layer: MoeLayer, value: ir.Value | None, what: str, reader: ir.Node) -> None:
    """Record the initializer behind an expert-indexed input (through Cast / Identity /
    Transpose keeping axis 0), or :class:`NotShardable`."""
    path: list[ir.Node] = []
    while value is not None and value.producer() is not None:
        node = value.producer()
        assert node is not None
        perm = int_attr(node, "perm", None)
        if node.domain not in ("", "ai.onnx") or node.op_type not in WEIGHT_PATH or (perm and perm[0] != 0):
            raise _refuse(
                reader,
                f"its {what} comes from {node.op_type} '{node.name}': expert weights must be constants "
                f"[E, ...] (through Cast, Identity or a Transpose keeping axis 0)",
            )
        path.append(node)
        value = node.inputs[0]
    if value is None or not value.is_initializer() or value.is_graph_input() or value.const_value is None:
        raise _refuse(reader, f"its {what} is not a constant: the experts' weights must be in the model")
    shape = value.const_value.shape
    if len(shape) < 1 or shape[0] != layer.experts:
        raise _refuse(
            reader, f"its {what} '{value.name}' has shape {list(shape)}, not [E = {layer.experts}, ...] by expert"
        )
    if value not in layer.expert_weights:
        layer.expert_weights.append(value)
    layer.weight_paths.extend(n for n in path if n not in layer.weight_paths)


def _check_grouped_matmul(layer: MoeLayer, node: ir.Node) -> None:
    if int_attr(node, "group_type", None) != 0 or int_attr(node, "transpose_x", 0):
        raise _refuse(node, "only GroupedMatmul with group_type 0 (rows split by expert) and no transpose_x is sharded")
    if node.inputs[0] is None or node.inputs[0].producer() not in [*layer.region, layer.routing]:
        raise _refuse(node, "its x is not the routed rows")
    group_list = node.inputs[3] if len(node.inputs) > 3 else None
    level = _group_list_level(group_list, layer.counts) if group_list is not None else None
    want = 1 if int_attr(node, "group_list_type", 0) == 0 else 0  # cumsum: one running sum of the counts
    if level is None or level + layer.cumsum != want:
        raise _refuse(
            node, f"its group_list is not {layer.name}'s per-expert counts (or their cumsum, as group_list_type says)"
        )
    _expert_constant(layer, node.inputs[1], "weight", node)
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        _expert_constant(layer, node.inputs[2], "bias", node)
    layer.group_lists.append(node)


def _check_row_wise(layer: MoeLayer, node: ir.Node, inside: set[int]) -> None:
    """A row-wise node: inputs from the region, or constants with no row axis."""
    if node.op_type == "SwiGlu" and node.domain == DOMAIN:
        if int_attr(node, "dim", -1) not in (-1, 1):
            raise _refuse(node, "SwiGlu over the row axis (dim 0) is not row-wise")
        return
    if node.domain not in ("", "ai.onnx") or node.op_type not in ROW_WISE:
        raise _refuse(
            node,
            f"sits between {layer.name} and the combine '{layer.finalize.name}' but is not GroupedMatmul, SwiGlu or "
            "a row-wise elementwise op : the experts' rows cannot be moved under it",
        )
    for value in node.inputs:
        if value is None or id(value) in inside:
            continue
        array = constant(value)
        if array is None or (array.ndim >= 2 and array.shape[0] != 1):
            raise _refuse(node, f"reads '{value.name}', which is neither the experts' rows nor a constant with no rows")


def _region(routing: ir.Node, rows: ir.Value) -> tuple[ir.Node, ir.Value, list[ir.Node]]:
    """(finalize node, its expanded_x, the nodes between) by walking the readers of ``rows``."""
    inside_values = {id(rows)}
    nodes: list[ir.Node] = []
    finals: list[tuple[ir.Node, ir.Value]] = []
    pending = deque([rows])
    while pending:
        value = pending.popleft()
        if value.is_graph_output():
            raise _refuse(
                routing, f"the experts' rows '{value.name}' are a graph output: they must only reach the combine"
            )
        for use in value.uses():
            reader = use.node
            if reader.op_type == FINALIZE and reader.domain == DOMAIN and use.idx == 0:
                finals.append((reader, value))
                continue
            if reader.op_type == FINALIZE or (reader.domain == DOMAIN and reader.op_type in ROUTINGS):
                raise _refuse(reader, f"reads the experts' rows '{value.name}' as something other than the rows")
            if reader not in nodes:
                nodes.append(reader)
                for out in reader.outputs:
                    inside_values.add(id(out))
                    pending.append(out)
    if len({id(f) for f, _ in finals}) != 1:
        raise _refuse(
            routing, f"its rows reach {len(finals)} MoeFinalizeRoutingV2 input(s): exactly one combine expected"
        )
    finalize, result = finals[0]
    if result is rows:
        raise _refuse(routing, "its rows reach the combine without any expert")
    return finalize, result, nodes


def find_layers(graph: ir.Graph, ranks: int) -> list[MoeLayer]:
    """Every MoE layer of ``graph`` (top level), checked for sharding over ``ranks`` ranks."""
    layers: list[MoeLayer] = []
    for node in graph:
        if node.domain == DOMAIN and node.op_type in COLLECTIVES:
            raise _refuse(node, "the model already holds collectives: shard a single-device model")
    for node in graph:
        if node.domain != DOMAIN or node.op_type not in ROUTINGS:
            continue
        experts, counts, cumsum = _counts_output(node, ranks)
        rows = node.outputs[0]
        finalize, result, region = _region(node, rows)
        order = {id(n): i for i, n in enumerate(graph)}
        region.sort(key=lambda n: order[id(n)])
        layer = MoeLayer(node, finalize, experts, rows, counts, cumsum, result, region)
        inside = {id(rows)} | {id(v) for n in region for v in n.outputs}
        for member in region:
            if member.domain == DOMAIN and member.op_type == "GroupedMatmul":
                _check_grouped_matmul(layer, member)
            else:
                _check_row_wise(layer, member, inside)
        if not layer.group_lists:
            raise _refuse(node, "no GroupedMatmul between the routing and the combine: no experts to place")
        _check_weights_private(layer)
        layers.append(layer)
    if not layers:
        raise NotShardable(
            "no MoE layer found: the shard needs MoeInitRoutingV2/V3 -> GroupedMatmul ... -> MoeFinalizeRoutingV2 "
            "in the main graph"
        )
    return layers


def _check_weights_private(layer: MoeLayer) -> None:
    """Expert weights (and the nodes on their way) are read only by this layer's experts."""
    allowed = {id(n) for n in [*layer.region, *layer.weight_paths]}
    for value in [*layer.expert_weights, *(out for n in layer.weight_paths for out in n.outputs)]:
        for use in value.uses():
            if id(use.node) not in allowed:
                raise _refuse(
                    use.node, f"reads the expert weight '{value.name}' of {layer.name}: a rank holds only its experts'"
                )
        if value.is_graph_output():
            raise _refuse(layer.routing, f"the expert weight '{value.name}' is a graph output")


@dataclass
class LayerShard:
    """What one layer became: its name, experts per rank, and the expert weight bytes it holds
    in all (``expert_bytes``) and on one rank (``expert_bytes / N``)."""

    name: str
    experts: int
    local_experts: int
    expert_bytes: int


@dataclass
class ShardReport:
    ranks: int
    layers: list[LayerShard]

    def __str__(self) -> str:
        lines = [
            f"{layer.name}: {layer.experts} experts, {layer.local_experts} per rank; expert weights "
            f"{layer.expert_bytes} bytes -> {layer.expert_bytes // self.ranks} per rank"
            for layer in self.layers
        ]
        return "\n".join([f"sharded {len(self.layers)} MoE layer(s) over {self.ranks} ranks", *lines])


class ShardExperts:
    """``ShardExperts(ranks)(model) -> [rank 0's model, ...]``: see the module doc. The model
    given is not changed (each rank's model is a clone; unsliced tensors are shared)."""

    def __init__(self, ranks: int):
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        self.ranks = ranks
        self.report = ShardReport(ranks, [])

    def __call__(self, model: ir.Model) -> list[ir.Model]:
        layers = find_layers(model.graph, self.ranks)  # refuses before anything is made
        self.report = ShardReport(
            self.ranks,
            [
                LayerShard(
                    layer.name,
                    layer.experts,
                    layer.experts // self.ranks,
                    sum(v.const_value.nbytes for v in layer.expert_weights if v.const_value is not None),
                )
                for layer in layers
            ],
        )
        shards = []
        for rank in range(self.ranks):
            work = model.clone()
            for index, layer in enumerate(find_layers(work.graph, self.ranks)):
                try:
                    _shard_layer(work.graph, layer, rank, self.ranks, f"{layer.routing.name or 'moe'}/shard{index}")
                except Exception as error:  # a graph the checks let through but onnx-ir refuses
                    raise NotShardable(f"{layer.name}: rewriting failed: {type(error).__name__}: {error}") from error
            work.metadata_props["moe_onnx.shard"] = f"rank {rank} of {self.ranks}"
            shards.append(work)
        return shards


def _initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    graph.register_initializer(value)
    return value


def _node(nodes: list[ir.Node], op_type: str, inputs: list, name: str, outputs: int = 1, **attrs) -> list[ir.Value]:
    node = ir.node(op_type, inputs, attrs, num_outputs=outputs, name=name)
    for i, value in enumerate(node.outputs):
        value.name = f"{name}/out{i}" if outputs > 1 else f"{name}/out"
    nodes.append(node)
    return list(node.outputs)


def _shard_layer(graph: ir.Graph, layer: MoeLayer, rank: int, ranks: int, prefix: str) -> None:
    """Rewrite ``layer`` of ``graph`` into rank ``rank``'s part (see the module doc); the new
    nodes and values are named ``{prefix}/...``."""
    local = layer.experts // ranks
    before: list[ir.Node] = []
    (counts64,) = _node(before, "Cast", [layer.counts], f"{prefix}/counts_int64", to=ir.DataType.INT64)
    if layer.cumsum:  # counts[e] = cumsum[e] - cumsum[e - 1]
        zero = _initializer(graph, f"{prefix}/zero", np.zeros(1, np.int64))
        starts = _initializer(graph, f"{prefix}/slice_starts", np.zeros(1, np.int64))
        ends = _initializer(graph, f"{prefix}/slice_ends", np.array([-1], np.int64))
        (head,) = _node(before, "Slice", [counts64, starts, ends], f"{prefix}/cumsum_head")
        (previous,) = _node(before, "Concat", [zero, head], f"{prefix}/cumsum_previous", axis=0)
        (counts64,) = _node(before, "Sub", [counts64, previous], f"{prefix}/counts")
    nl = _initializer(graph, f"{prefix}/ranks_by_local", np.array([ranks, local], np.int64))
    (per_rank,) = _node(before, "Reshape", [counts64, nl], f"{prefix}/per_rank")  # [N, L]
    axis1 = _initializer(graph, f"{prefix}/axis1", np.array([1], np.int64))
    (send,) = _node(before, "ReduceSum", [per_rank, axis1], f"{prefix}/send_counts", keepdims=0)  # [N]
    ones = _initializer(graph, f"{prefix}/one_row_each", np.ones(ranks, np.int64))
    exchange_counts = op_node(OPS["AllToAll"], [per_rank, ones], {}, f"{prefix}/all_to_all_counts")
    dispatch = op_node(OPS["AllToAll"], [layer.rows, send], {}, f"{prefix}/all_to_all_rows")
    rerouting_op = OPS["MoeReRoutingV2"]
    rerouting = op_node(
        rerouting_op,
        [output(dispatch, OPS["AllToAll"], "recv_data"), output(exchange_counts, OPS["AllToAll"], "recv_data")],
        {"idx_type": 1},
        f"{prefix}/re_routing",
    )
    before += [exchange_counts, dispatch, rerouting]
    routed = output(rerouting, rerouting_op, "permute_tokens")
    to_expert_major = output(rerouting, rerouting_op, "permute_token_idx")  # [R]: rank-major src -> expert-major dst
    local_counts = output(rerouting, rerouting_op, "expert_token_num")  # [L] int64 counts

    for use in list(layer.rows.uses()):
        if use.node is not dispatch:
            use.node.replace_input_with(use.idx, routed)
    old_group_lists = [n.inputs[3] for n in layer.group_lists]
    for node in layer.group_lists:
        node.replace_input_with(3, local_counts)
        node.attributes["group_list_type"] = ir.AttrInt64("group_list_type", 1)
    first, stop = rank * local, (rank + 1) * local
    for value in layer.expert_weights:
        assert value.const_value is not None
        part = np.ascontiguousarray(value.const_value.numpy()[first:stop])
        value.const_value = ir.tensor(part, name=value.name)
        value.shape = ir.Shape(part.shape)
    for node in [*layer.weight_paths, *layer.region]:
        for out in node.outputs:
            out.shape = None  # dims that counted every expert or every row: inferred again
    graph.insert_after(layer.routing, before)

    after: list[ir.Node] = []
    (rank_major,) = _node(after, "Gather", [layer.result, to_expert_major], f"{prefix}/to_rank_major", axis=0)
    combine = op_node(
        OPS["AllToAll"], [rank_major, output(dispatch, OPS["AllToAll"], "recv_counts")], {}, f"{prefix}/all_to_all_back"
    )
    after.append(combine)
    graph.insert_before(layer.finalize, after)
    layer.finalize.replace_input_with(0, output(combine, OPS["AllToAll"], "recv_data"))
    producers = [v.producer() for v in old_group_lists if v is not None]
    remove_dead(graph, [node for node in producers if node is not None])
