"""Random but equivalent spellings of one expert-parallel layer's chunk sort and restore.

Per rank: the rows to send ``rows [S, H]`` (grouped by destination rank, then local expert),
maybe their probs ``probs [S]``, and (dropless) the rank's rows per global expert
``local_counts [E]``. An AllToAll sends them; the received rows are regrouped by local expert
(the **dispatch**, spelled as :class:`Form` says), each local expert computes ``x * w_e + b_e``
(times its probs), the outputs are regrouped back rank-major (the **restore**) and sent back.
Every spelling of one (N, L, layout) computes the same output, bit for bit: the experts are
elementwise, so no spelling changes an accumulation.

Layouts: ``dropless`` (counts ``[N, L]`` exchanged by an AllToAll of ``local_counts``, any
values) and ``capacity`` (C rows per (rank, expert), counts ``full([N, L], C)``).

Dispatch spellings (``Form.dispatch``):

* dropless: ``split_concat`` (Split by the counts + Concat expert-major), ``gather`` (Gather by
  an index computed from the counts with a stable TopK), ``slices`` (a Slice per block, bounds
  from a CumSum of the counts, then a Concat per expert);
* capacity: ``transpose`` (Reshape [N, L, C, H] + Transpose + rows), ``split_axis1`` (Split on
  axis 1), ``slice_axis1`` (Slice pairs on axis 1), ``gather_axis1`` (scalar Gathers on axis 1),
  ``split_lc`` (Reshape [N, L*C, H] + Split on axis 1).

``Form.experts``: the experts read one Split of the expert-major rows (``split``), or their
pieces directly (``pieces``). ``Form.noise``: extra movement that changes nothing (Identity,
Unsqueeze + Squeeze, Reshape to the same shape, Flatten). ``Form.sizes``: Reshape targets as
constants (``constant``) or computed from ``Shape()`` (``shape``, as the legacy exporter writes
them); ``Form.symbolic``: the row count S a symbolic dim (C then ``-1`` in the Reshapes).

``Form.sorted_out``: the expert inputs (tokens and probs) are graph outputs as well (``also``),
or the only outputs (``only``: a dispatch-only graph, no experts, restore or return AllToAll).

Restores (``Form.restore``): dropless ``split_concat`` (Split by counts.T + Concat rank-major),
``scatter`` (ScatterND by the index), ``slices``; capacity ``concat_axis1`` (Concat of [N, 1, C, H]
outputs on axis 1) or ``transpose`` (stacked [L, N, C, H], transposed back).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import moe_onnx

DISPATCH = {
    "dropless": ("split_concat", "gather", "slices"),
    "capacity": ("transpose", "split_axis1", "slice_axis1", "gather_axis1", "split_lc"),
}
RESTORE = {"dropless": ("split_concat", "scatter", "slices"), "capacity": ("concat_axis1", "transpose")}
NOISE = ("identity", "unsqueeze_squeeze", "reshape_same", "flatten")
SORTED_OUT = ("none", "also", "only")


@dataclass(frozen=True)
class Form:
    layout: str
    ranks: int
    experts: int  # L, local experts per rank
    dispatch: str
    restore: str
    experts_read: str = "split"  # "split" | "pieces"
    probs: bool = False
    noise: tuple[str, ...] = ()
    sizes: str = "constant"  # "constant" | "shape"
    symbolic: bool = False
    capacity: int = 3
    hidden: int = 4
    sorted_out: str = "none"  # "none" | "also": the expert inputs are graph outputs too | "only": dispatch only

    def simplest(self) -> Form:
        """The same layer spelled the simplest way."""
        first = {"dropless": ("split_concat", "split_concat"), "capacity": ("transpose", "transpose")}[self.layout]
        return replace(self, dispatch=first[0], restore=first[1], experts_read="split", noise=(), sizes="constant")

    def describe(self) -> str:
        noise = "+".join(self.noise) or "-"
        return (
            f"{self.layout} N={self.ranks} L={self.experts} dispatch={self.dispatch} restore={self.restore} "
            f"experts={self.experts_read} probs={self.probs} noise={noise} sizes={self.sizes} symbolic={self.symbolic} "
            f"sorted_out={self.sorted_out}"
        )


def random_form(rng: np.random.Generator) -> Form:
    layout = str(rng.choice(["dropless", "capacity"]))
    dispatch = str(rng.choice(DISPATCH[layout]))
    restore = str(rng.choice(RESTORE[layout]))
    if restore == "scatter" and dispatch != "gather":
        restore = "split_concat"  # the scatter restore reuses the dispatch's index
    noise = tuple(str(n) for n in rng.choice(NOISE, size=int(rng.integers(0, 3)), replace=False))
    return Form(
        layout=layout,
        ranks=int(rng.integers(2, 4)),
        experts=int(rng.integers(2, 4)),
        dispatch=dispatch,
        restore=restore,
        experts_read=str(rng.choice(["split", "pieces"])),
        probs=bool(rng.integers(0, 2)),
        noise=noise,
        sizes=str(rng.choice(["constant", "shape"])),
        symbolic=bool(rng.integers(0, 2)),
        capacity=int(rng.integers(1, 4)),
        sorted_out=str(rng.choice(SORTED_OUT)),  # drawn last: the other fields of a seed stay as they were
    )


class _Graph:
    """A small onnx.helper graph builder: unique names, int64 constants."""

    def __init__(self, prefix: str):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.prefix = prefix
        self.count = 0

    def name(self, what: str) -> str:
        self.count += 1
        return f"{self.prefix}{what}_{self.count}"

    def const(self, value, dtype=np.int64) -> str:
        name = self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int = 1, domain: str = "", **attrs) -> list[str]:
        names = [self.name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=names[0], domain=domain, **attrs))
        return names

    def one(self, op_type: str, inputs: list[str], **attrs) -> str:
        return self.op(op_type, inputs, **attrs)[0]


def _noise(g: _Graph, value: str, rank: int, form: Form, row_dims: list[int]) -> str:
    """Movement that changes nothing, on a value of ``rank`` dims whose trailing dims are ``row_dims``."""
    for kind in form.noise:
        if kind == "identity":
            value = g.one("Identity", [value])
        elif kind == "unsqueeze_squeeze":
            value = g.one("Squeeze", [g.one("Unsqueeze", [value, g.const([0])]), g.const([0])])
        elif kind == "reshape_same":
            value = g.one("Reshape", [value, g.one("Shape", [value])])
        elif kind == "flatten" and rank == 2:
            value = g.one("Flatten", [value], axis=1)
    return value


def _shape(g: _Graph, dims: list[int], like: str, form: Form, row: list[int]) -> str:
    """A Reshape target: a constant, or (``sizes == "shape"``) its row dim read from ``Shape(like)``."""
    if form.sizes == "constant" or not row:
        return g.const(dims)
    last = g.one("Gather", [g.one("Shape", [like]), g.const([-1])], axis=0)
    return g.one("Concat", [g.const(dims[:-1]), last], axis=0)


# ---------------------------------------------------------------------- dropless
def _dropless_index(g: _Graph, flat: str, experts: int) -> str:
    """MoeReRoutingV2's gather index from the flat rank-major counts: a stable sort of the rows
    by local expert (key expert * A + row, ascending TopK)."""
    ends = g.one("CumSum", [flat, g.const(0)])
    total = g.one("ReduceSum", [flat], keepdims=1)
    rows = g.one("Range", [g.const(0), g.one("Squeeze", [total, g.const([0])]), g.const(1)])
    chunk = g.one(
        "ReduceSum",
        [
            g.one(
                "Cast",
                [
                    g.one(
                        "LessOrEqual",
                        [g.one("Unsqueeze", [ends, g.const([0])]), g.one("Unsqueeze", [rows, g.const([1])])],
                    )
                ],
                to=TensorProto.INT64,
            ),
            g.const([1]),
        ],
        keepdims=0,
    )
    expert = g.one("Mod", [chunk, g.const(experts)])
    key = g.one("Add", [g.one("Mul", [expert, total]), rows])
    return g.op("TopK", [key, total], outputs=2, largest=0, sorted=1)[1]


def _dropless(g: _Graph, form: Form, received: str, counts: str, flat: str, rank1: bool) -> tuple[list[str], dict]:
    """Expert inputs (one per local expert, [n_e, *row]) from the received rows."""
    n, experts = form.ranks, form.experts
    blocks = n * experts
    order = [r * experts + e for e in range(experts) for r in range(n)]
    per_expert = g.one("ReduceSum", [counts, g.const([0])], keepdims=0)
    received = _noise(g, received, 1 if rank1 else 2, form, [])
    info: dict = {}
    if form.dispatch in ("split_concat", "slices"):
        if form.dispatch == "split_concat":
            chunks = g.op("Split", [received, flat], outputs=blocks, axis=0)
        else:
            ends = g.one("CumSum", [flat, g.const(0)])
            starts = g.one("Sub", [ends, flat])
            chunks = []
            for b in range(blocks):
                start = g.one("Slice", [starts, g.const([b]), g.const([b + 1])])
                end = g.one("Slice", [ends, g.const([b]), g.const([b + 1])])
                chunks.append(g.one("Slice", [received, start, end, g.const([0])]))
        if form.experts_read == "pieces":
            return [g.one("Concat", [chunks[r * experts + e] for r in range(n)], axis=0) for e in range(experts)], info
        whole = g.one("Concat", [chunks[i] for i in order], axis=0)
    else:
        index = _dropless_index(g, flat, experts)
        info["index"] = index
        whole = g.one("Gather", [received, index], axis=0)
    whole = _noise(g, whole, 1 if rank1 else 2, form, [])
    return g.op("Split", [whole, per_expert], outputs=experts, axis=0), info


def _dropless_restore(g: _Graph, form: Form, outs: list[str], counts: str, flat: str, info: dict) -> str:
    n, experts = form.ranks, form.experts
    whole = g.one("Concat", outs, axis=0)
    if form.restore == "scatter":
        index = info["index"]
        zeros = g.one(
            "ConstantOfShape", [g.one("Shape", [whole])], value=numpy_helper.from_array(np.zeros(1, np.float32))
        )
        return g.one("ScatterND", [zeros, g.one("Unsqueeze", [index, g.const([1])]), whole])
    by_expert = g.one(
        "Reshape", [g.one("Transpose", [counts], perm=[1, 0]), g.const([-1])]
    )  # counts.T: sizes of (e, r)
    if form.restore == "split_concat":
        chunks = g.op("Split", [whole, by_expert], outputs=n * experts, axis=0)
    else:
        ends = g.one("CumSum", [by_expert, g.const(0)])
        starts = g.one("Sub", [ends, by_expert])
        chunks = []
        for b in range(n * experts):
            start = g.one("Slice", [starts, g.const([b]), g.const([b + 1])])
            end = g.one("Slice", [ends, g.const([b]), g.const([b + 1])])
            chunks.append(g.one("Slice", [whole, start, end, g.const([0])]))
    return g.one("Concat", [chunks[e * n + r] for r in range(n) for e in range(experts)], axis=0)


# ---------------------------------------------------------------------- capacity
def _capacity(g: _Graph, form: Form, received: str, rank1: bool) -> list[str]:
    """Expert inputs [N, 1, C, *row] (or [N*C, *row], [N, C, *row]) from the received rows."""
    n, experts = form.ranks, form.experts
    c = -1 if form.symbolic else form.capacity
    row = [] if rank1 else [form.hidden]
    received = _noise(g, received, 1 if rank1 else 2, form, row)
    if form.dispatch == "split_lc":
        view = g.one(
            "Reshape",
            [received, _shape(g, [n, experts * form.capacity, *row] if c > 0 else [n, -1, *row], received, form, row)],
        )
        if c > 0:
            return g.op("Split", [view, g.const([form.capacity] * experts)], outputs=experts, axis=1)
        return g.op("Split", [view], outputs=experts, axis=1, num_outputs=experts)
    view = g.one("Reshape", [received, _shape(g, [n, experts, c, *row], received, form, row)])
    if form.dispatch == "transpose":
        perm = [1, 0, 2] + ([3] if row else [])
        swapped = g.one("Transpose", [view], perm=perm)
        rows = g.one("Reshape", [swapped, g.const([-1, *row])])
        rows = _noise(g, rows, 1 if rank1 else 2, form, row)
        return g.op("Split", [rows], outputs=experts, axis=0, num_outputs=experts)
    if form.dispatch == "split_axis1":
        return g.op("Split", [view, g.const([1] * experts)], outputs=experts, axis=1)
    if form.dispatch == "slice_axis1":
        return [g.one("Slice", [view, g.const([e]), g.const([e + 1]), g.const([1])]) for e in range(experts)]
    return [g.one("Gather", [view, g.const(e)], axis=1) for e in range(experts)]  # gather_axis1: [N, C, *row]


def _capacity_restore(g: _Graph, form: Form, outs: list[str], rank1: bool) -> str:
    n = form.ranks
    c = -1 if form.symbolic else form.capacity
    row = [] if rank1 else [form.hidden]
    blocks = [g.one("Reshape", [y, g.const([n, 1, c, *row])]) for y in outs]  # whatever the expert read
    if form.restore == "concat_axis1":
        rank_major = g.one("Concat", blocks, axis=1)
    else:
        stacked = g.one("Concat", [g.one("Reshape", [b, g.const([1, n, c, *row])]) for b in blocks], axis=0)
        rank_major = g.one("Transpose", [stacked], perm=[1, 0, 2] + ([3] if row else []))
    return g.one("Reshape", [rank_major, g.const([-1, *row])])


# ---------------------------------------------------------------------- the layer
def build(form: Form, rank: int) -> onnx.ModelProto:
    """Rank ``rank``'s graph: inputs ``rows`` (+ ``probs``, + ``local_counts`` dropless), output ``out``."""
    g = _Graph("n")
    n, experts, hidden = form.ranks, form.experts, form.hidden
    rows_dim = "S" if form.symbolic else (n * experts * form.capacity if form.layout == "capacity" else None)
    inputs = [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [rows_dim or "S", hidden])]
    if form.probs:
        inputs.append(helper.make_tensor_value_info("probs", TensorProto.FLOAT, [rows_dim or "S"]))
    if form.layout == "dropless":
        inputs.append(helper.make_tensor_value_info("local_counts", TensorProto.INT64, [n * experts]))
        send = g.one("ReduceSum", [g.one("Reshape", ["local_counts", g.const([n, experts])]), g.const([1])], keepdims=0)
        flat = g.op("AllToAll", ["local_counts", g.const([experts] * n)], outputs=2, domain=moe_onnx.DOMAIN)[0]
        counts = g.one("Reshape", [flat, g.const([n, experts])])
        back = g.one("ReduceSum", [counts, g.const([1])], keepdims=0)
    else:
        if form.symbolic:
            per_rank = g.one("Div", [g.one("Shape", ["rows"], start=0, end=1), g.const([n])])
            send = g.one("Expand", [per_rank, g.const([n])])
        else:
            send = g.const([experts * form.capacity] * n)
        back = send
    received = g.op("AllToAll", ["rows", send], outputs=2, domain=moe_onnx.DOMAIN)[0]
    if form.layout == "dropless":
        pieces, info = _dropless(g, form, received, counts, flat, rank1=False)
    else:
        pieces, info = _capacity(g, form, received, rank1=False), {}
    if form.probs:
        received_probs = g.op("AllToAll", ["probs", send], outputs=2, domain=moe_onnx.DOMAIN)[0]
        if form.layout == "dropless":
            probs_pieces, _ = _dropless(g, form, received_probs, counts, flat, rank1=True)
        else:
            probs_pieces = _capacity(g, form, received_probs, rank1=True)
    sorted_outputs = [*pieces, *(probs_pieces if form.probs else [])] if form.sorted_out != "none" else []
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in sorted_outputs]
    if form.sorted_out == "only":  # a dispatch-only graph: the expert-major rows are what it gives
        graph = helper.make_graph(g.nodes, "forms", inputs, outputs, g.inits)
        return _typed_outputs(helper.make_model(graph, opset_imports=OPSETS))
    outs = []
    weights = np.random.default_rng(1000 + rank).standard_normal((experts, 2, hidden)).astype(np.float32)
    for e, piece in enumerate(pieces):
        y = g.one(
            "Add", [g.one("Mul", [piece, g.const(weights[e, 0], np.float32)]), g.const(weights[e, 1], np.float32)]
        )
        if form.probs:
            y = g.one("Mul", [y, g.one("Unsqueeze", [probs_pieces[e], g.const([-1])])])
        outs.append(y)
    if form.layout == "dropless":
        rank_major = _dropless_restore(g, form, outs, counts, flat, info)
    else:
        rank_major = _capacity_restore(g, form, outs, rank1=False)
    returned = g.op("AllToAll", [rank_major, back], outputs=2, domain=moe_onnx.DOMAIN)[0]
    g.nodes.append(helper.make_node("Identity", [returned], ["out"], name="out"))
    graph = helper.make_graph(
        g.nodes,
        "forms",
        inputs,
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [rows_dim or "S", hidden]), *outputs],
        g.inits,
    )
    return _typed_outputs(helper.make_model(graph, opset_imports=OPSETS))


OPSETS = [helper.make_opsetid("", 18), helper.make_opsetid(moe_onnx.DOMAIN, 1)]


def _typed_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph outputs declared without a shape get the one shape inference gives them."""
    graph = onnx.shape_inference.infer_shapes(model).graph
    inferred = {v.name: v for v in (*graph.value_info, *graph.output) if v.type.tensor_type.HasField("shape")}
    for output in model.graph.output:
        if not output.type.tensor_type.HasField("shape") and output.name in inferred:
            output.type.CopyFrom(inferred[output.name].type)
    return model


def feeds(form: Form, seed: int) -> list[dict[str, np.ndarray]]:
    """Every rank's inputs (dropless: random counts, zeros included)."""
    rng = np.random.default_rng(seed)
    n, experts = form.ranks, form.experts
    result = []
    for _ in range(n):
        if form.layout == "dropless":
            local = rng.integers(0, 4, n * experts)
            local[rng.integers(0, n * experts)] = 0
            rows = int(local.sum())
        else:
            rows = n * experts * form.capacity
        feed = {"rows": rng.standard_normal((rows, form.hidden)).astype(np.float32)}
        if form.probs:
            feed["probs"] = rng.random(rows).astype(np.float32)
        if form.layout == "dropless":
            feed["local_counts"] = local.astype(np.int64)
        result.append(feed)
    return result
