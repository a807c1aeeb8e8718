"""Forms the corpus does not hold: GShard cuts by Gather(axis=1), [A, 1] weights and float16 probs
folded into one MoeReRoutingV2 (built here or edited from a saved export; tiny, on thread ranks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from moe_onnx.converters import insert_rerouting
from moe_onnx.ranks import run_threads
from tests.support import assert_same_bits

EXPORTS = Path(__file__).parent / "data" / "exports"


def converted_entry(report):
    (entry,) = [e for e in report.entries if e.status == "converted"]
    return entry


def run_both(models, feeds):
    converted, reports = zip(*(insert_rerouting(m) for m in models))
    before = run_threads(models, feeds, timeout=60)
    after = run_threads(list(converted), feeds, timeout=60)
    for a, b in zip(before, after):
        for x, y in zip(a, b):
            assert_same_bits(x, y)
    return list(converted), list(reports), after


def gathered_fairscale(scalar: bool) -> list[onnx.ModelProto]:
    """fairscale's Split(axis=1) per local expert rewritten as Gather(axis=1) (+ Unsqueeze if scalar)."""
    models = []
    for r in range(2):
        model = onnx.load(EXPORTS / "fairscale_top2_dynamo_n2" / f"rank{r}.onnx")
        nodes = []
        for node in model.graph.node:
            if node.op_type != "Split":
                nodes.append(node)
                continue
            for expert, out in enumerate(node.output):
                index = numpy_helper.from_array(np.array(expert if scalar else [expert], np.int64), f"expert{expert}")
                model.graph.initializer.append(index)
                if scalar:
                    nodes.append(helper.make_node("Gather", [node.input[0], index.name], [out + "_3d"], axis=1))
                    axes = numpy_helper.from_array(np.array([1], np.int64), f"axis{expert}")
                    model.graph.initializer.append(axes)
                    nodes.append(helper.make_node("Unsqueeze", [out + "_3d", axes.name], [out]))
                else:
                    nodes.append(helper.make_node("Gather", [node.input[0], index.name], [out], axis=1))
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        models.append(model)
    return models


@pytest.mark.parametrize("scalar", [False, True])
def test_gshard_cut_by_gather_on_axis_1(scalar):
    models = gathered_fairscale(scalar)
    feeds = [dict(np.load(EXPORTS / "fairscale_top2_dynamo_n2" / f"rank{r}_inputs.npz")) for r in range(2)]
    converted, reports, outputs = run_both(models, feeds)
    for report in reports:
        entry = converted_entry(report)
        # the received blocks' count is not static (shape inference stops at AllToAll): C = rows / (N*L)
        assert entry.rule == "movement_map" and entry.counts.startswith("computed: full([2, 2], rows / 4)")
        # a scalar Gather's [N, C, M] cut is unsqueezed before the expert: a movement op, so the
        # expert reads [N, 1, C, M] either way and the Concat(axis=1) of the outputs is the restore
        assert len(entry.restores) == 1
    for r, (out,) in enumerate(outputs):
        want = np.load(EXPORTS / "fairscale_top2_dynamo_n2" / f"rank{r}_torch_out.npz")["output"]
        assert np.abs(out - want).max() <= 1e-5


N, L, C, H = 2, 2, 3, 4


def capacity_layer(rank: int) -> onnx.ModelProto:
    """Drop-and-pad rows [N*L*C, H] float32, probs [N*L*C] float16, weights [N*L*C, 1] float32:
    each through its own AllToAll and the same reshape/transpose chunk sort; the expert combines
    them; the inverse transpose and the AllToAll back."""
    rows = N * L * C
    consts = {
        "counts": np.full(N, L * C, np.int64),
        "block4": np.array([N, L, C, H], np.int64),
        "block3": np.array([N, L, C], np.int64),
        "block_w": np.array([N, L, C, 1], np.int64),
        "rows_h": np.array([rows, H], np.int64),
        "rows_1": np.array([rows, 1], np.int64),
        "flat": np.array([-1], np.int64),
        "expert_major": np.array([L, N, C, H], np.int64),
        "w": np.random.default_rng(rank).standard_normal((H, H)).astype(np.float32),
    }
    nodes = [
        helper.make_node("AllToAll", ["x", "counts"], ["xr", "xc"], domain=moe_onnx.DOMAIN),
        helper.make_node("AllToAll", ["p", "counts"], ["pr", "pc"], domain=moe_onnx.DOMAIN),
        helper.make_node("AllToAll", ["v", "counts"], ["vr", "vc"], domain=moe_onnx.DOMAIN),
        helper.make_node("Reshape", ["xr", "block4"], ["x4"]),
        helper.make_node("Transpose", ["x4"], ["xt"], perm=[1, 0, 2, 3]),
        helper.make_node("Reshape", ["xt", "rows_h"], ["xe"]),
        helper.make_node("Reshape", ["pr", "block3"], ["p3"]),
        helper.make_node("Transpose", ["p3"], ["pt"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["pt", "flat"], ["pe"]),
        helper.make_node("Reshape", ["vr", "block_w"], ["v4"]),
        helper.make_node("Transpose", ["v4"], ["vt"], perm=[1, 0, 2, 3]),
        helper.make_node("Reshape", ["vt", "rows_1"], ["ve"]),
        helper.make_node("Cast", ["pe"], ["pf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["pf", "rows_1_axis"], ["pu"]),
        helper.make_node("MatMul", ["xe", "w"], ["h"]),
        helper.make_node("Mul", ["h", "pu"], ["hp"]),
        helper.make_node("Mul", ["hp", "ve"], ["out"]),
        helper.make_node("Reshape", ["out", "expert_major"], ["o4"]),
        helper.make_node("Transpose", ["o4"], ["ot"], perm=[1, 0, 2, 3]),
        helper.make_node("Reshape", ["ot", "rows_h"], ["back"]),
        helper.make_node("AllToAll", ["back", "counts"], ["y", "yc"], domain=moe_onnx.DOMAIN),
    ]
    initializers = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    initializers.append(numpy_helper.from_array(np.array([1], np.int64), "rows_1_axis"))
    graph = helper.make_graph(
        nodes,
        "capacity_layer",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, H]),
            helper.make_tensor_value_info("p", TensorProto.FLOAT16, [rows]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, [rows, 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, H])],
        initializers,
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_probs_and_weights_ride_in_the_tokens_rerouting():
    """float16 probs [A] -> per_token_scales (cast to float32 and back, exactly); [A, 1] float32
    weights -> expert_topk_weight; one MoeReRoutingV2 and one restore for the three AllToAlls."""
    models = [capacity_layer(r) for r in range(N)]
    rng = np.random.default_rng(7)
    feeds = [
        {
            "x": rng.standard_normal((N * L * C, H)).astype(np.float32),
            "p": rng.random(N * L * C).astype(np.float16),
            "v": rng.random((N * L * C, 1)).astype(np.float32),
        }
        for _ in range(N)
    ]
    converted, reports, _ = run_both(models, feeds)
    for model, report in zip(converted, reports):
        entry = converted_entry(report)
        assert [e.status for e in report.entries] == ["converted", "folded", "folded", "skipped"]
        assert [f.split(" as ")[1] for f in entry.folded] == ["per_token_scales", "expert_topk_weight"]
        assert len(entry.restores) == 1
        (rerouting,) = [n for n in model.graph.node if n.op_type == "MoeReRoutingV2"]
        assert len(rerouting.input) == 4 and len(rerouting.output) == 5
        assert [n.op_type for n in model.graph.node].count("Transpose") == 0
        onnx.checker.check_model(model, full_check=True)
        onnx.shape_inference.infer_shapes(model, strict_mode=True)


def test_sizes_computed_from_the_counts_are_told_apart_from_the_counts():
    """Split sizes Min(counts, 8) equal the counts on small probes; large probes tell them
    apart, so the rewrite reroutes by the clipped sizes and the graph computes what it did."""
    ranks, experts, hidden, capacity = 2, 2, 4, 8
    chunks = [f"chunk{i}" for i in range(ranks * experts)]
    nodes = [
        helper.make_node("AllToAll", ["data", "send_counts"], ["recv", "recv_counts"], domain="cann.moe", name="a2a"),
        helper.make_node("Constant", [], ["cap"], value=numpy_helper.from_array(np.array(capacity, np.int64), "cap")),
        helper.make_node("Constant", [], ["flat"], value=numpy_helper.from_array(np.array([-1], np.int64), "flat")),
        helper.make_node("Reshape", ["counts", "flat"], ["flat_counts"]),
        helper.make_node("Min", ["flat_counts", "cap"], ["sizes"]),
        helper.make_node("Split", ["recv", "sizes"], chunks, axis=0, name="split"),
        helper.make_node("Concat", [chunks[0], chunks[2], chunks[1], chunks[3]], ["sorted"], axis=0, name="concat"),
        helper.make_node("Relu", ["sorted"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "clipped",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, ["S", hidden]),
            helper.make_tensor_value_info("send_counts", TensorProto.INT64, [ranks]),
            helper.make_tensor_value_info("counts", TensorProto.INT64, [ranks, experts]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["A", hidden])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann.moe", 1)])
    converted, report = insert_rerouting(model)
    entry = converted_entry(report)
    assert entry.counts == "computed: Reshape('sizes', [2, 2])", str(report)  # not 'counts': they differ past 8
    counts = np.array([[10, 1], [2, 3]], np.int64)  # one block past the clip: 14 rows, 7 from each rank
    feeds = [
        {"data": np.arange(14 * hidden, dtype=np.float32).reshape(14, hidden) + 100 * r}
        | {"send_counts": np.array([7, 7], np.int64), "counts": counts}
        for r in range(ranks)
    ]
    before, after = run_threads([model] * ranks, feeds), run_threads([converted] * ranks, feeds)
    for (a,), (b,) in zip(before, after):
        assert_same_bits(b, a)


def _look_alike(ranks: int, experts: int, hidden: int, bound: int, layout: str) -> onnx.ModelProto:
    """A region that is MoeReRoutingV2's order only while the blocks stay short: ``dropless``
    slices block b of the received rows up to ``starts[b] + Min(counts[b], bound)`` (rows past
    ``bound`` per block dropped); ``capacity`` takes ``Slice(rows, 0, bound)`` before its
    ``Reshape [N, L, -1, H]`` + Transpose. Each expert's rows are a graph output."""
    flat = ranks * experts
    consts = {
        "zero": np.array(0, np.int64),
        "bound": np.full(flat, bound, np.int64),
        "first": np.array([0], np.int64),
        "end": np.array([bound], np.int64),
        "view": np.array([ranks, experts, -1, hidden], np.int64),
        "counts_shape": np.array([ranks, experts], np.int64),
        "axis1": np.array([1], np.int64),
        **{f"b{b}": np.array([b], np.int64) for b in range(flat + 1)},
    }
    inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, ["S", hidden])]
    outputs = [f"y{e}" for e in range(experts)]
    if layout == "dropless":
        inputs.append(helper.make_tensor_value_info("local_counts", TensorProto.INT64, [flat]))
        nodes = [
            helper.make_node("Reshape", ["local_counts", "counts_shape"], ["local_2d"]),
            helper.make_node("ReduceSum", ["local_2d", "axis1"], ["send"], keepdims=0),
            helper.make_node("AllToAll", ["local_counts", "blocks_of_l"], ["counts", "_c"], domain=moe_onnx.DOMAIN),
            helper.make_node("AllToAll", ["data", "send"], ["recv", "_r"], domain=moe_onnx.DOMAIN, name="a2a"),
            helper.make_node("CumSum", ["counts", "zero"], ["ends"]),
            helper.make_node("Sub", ["ends", "counts"], ["starts"]),
            helper.make_node("Min", ["counts", "bound"], ["kept"]),
            helper.make_node("Add", ["starts", "kept"], ["stops"]),
        ]
        consts["blocks_of_l"] = np.full(ranks, experts, np.int64)
        for b in range(flat):
            nodes += [
                helper.make_node("Slice", ["starts", f"b{b}", f"b{b + 1}"], [f"s{b}"]),
                helper.make_node("Slice", ["stops", f"b{b}", f"b{b + 1}"], [f"e{b}"]),
                helper.make_node("Slice", ["recv", f"s{b}", f"e{b}", "first"], [f"chunk{b}"]),
            ]
        for e in range(experts):
            nodes.append(
                helper.make_node("Concat", [f"chunk{r * experts + e}" for r in range(ranks)], [f"x{e}"], axis=0)
            )
    elif layout == "blocks":  # GShard's [E, C, M] blocks, E declared, C symbolic; clipped on C
        inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, [flat, "C", hidden])]
        consts["send"] = np.full(ranks, experts, np.int64)
        nodes = [
            helper.make_node("AllToAll", ["data", "send"], ["recv", "_r"], domain=moe_onnx.DOMAIN, name="a2a"),
            helper.make_node("Slice", ["recv", "first", "end", "axis1"], ["kept"]),
            helper.make_node("Reshape", ["kept", "view"], ["blocks"]),
            helper.make_node("Transpose", ["blocks"], ["expert_major"], perm=[1, 0, 2, 3]),
            helper.make_node("Split", ["expert_major"], [f"x{e}" for e in range(experts)], axis=0, num_outputs=experts),
        ]
    else:
        nodes = [  # equal parts of the rows to every rank
            helper.make_node("Shape", ["data"], ["rows"], start=0, end=1),
            helper.make_node("Div", ["rows", "n"], ["per_rank"]),
            helper.make_node("Expand", ["per_rank", "n"], ["send"]),
            helper.make_node("AllToAll", ["data", "send"], ["recv", "_r"], domain=moe_onnx.DOMAIN, name="a2a"),
            helper.make_node("Slice", ["recv", "first", "end", "first"], ["kept"]),
            helper.make_node("Reshape", ["kept", "view"], ["blocks"]),
            helper.make_node("Transpose", ["blocks"], ["expert_major"], perm=[1, 0, 2, 3]),
            helper.make_node("Split", ["expert_major"], [f"x{e}" for e in range(experts)], axis=0, num_outputs=experts),
        ]
        consts["n"] = np.array([ranks], np.int64)
    shape = ["rows", hidden] if layout == "dropless" else [1, ranks, "capacity", hidden]
    for e in range(experts):
        consts[f"w{e}"] = np.full(hidden, e + 2.0, np.float32)
        nodes.append(helper.make_node("Mul", [f"x{e}", f"w{e}"], [outputs[e]]))
    graph = helper.make_graph(
        nodes,
        f"look_alike_{layout}",
        inputs,
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, shape) for y in outputs],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
        value_info=[helper.make_tensor_value_info("recv", TensorProto.FLOAT, [flat, "C", hidden])]
        if layout == "blocks"
        else [],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )


@pytest.mark.parametrize("layout", ["dropless", "capacity", "blocks"])
def test_a_bound_past_the_short_probes_is_not_a_chunk_sort(layout):
    """Regions that drop the rows past a bound of 100 (dropless: Min(counts, 100) per block) or
    200 (capacity: Slice(rows, 0, 200); blocks: the received ``[E, C, M]``, E declared, sliced
    to C <= 200) agree with MoeReRoutingV2 on probes of at most 64 rows per block, and used to be
    converted: the rewrite then kept rows the original drops (151 rows for 101 on a block of
    150). The long probe block tells them apart; without the bound the same layer still
    converts."""
    ranks, experts, hidden = 2, 2, 4
    bounded = _look_alike(ranks, experts, hidden, 100 if layout == "dropless" else 200, layout)
    onnx.checker.check_model(bounded, full_check=True)
    _, report = insert_rerouting(bounded)
    assert not report.changed, str(report)
    (entry,) = [e for e in report.entries if e.node == "a2a"]
    assert entry.status == "skipped" and "expert-major rows" in " ".join(entry.reasons), str(report)
    if layout == "blocks":  # the long probe stretched C, the dim left unknown
        assert "long probe of C = 4096 (rows [4, 4096, 4])" in " ".join(entry.reasons), str(report)
    unbounded = _look_alike(ranks, experts, hidden, 1 << 40, layout)  # a bound no batch reaches
    _, report = insert_rerouting(unbounded)
    assert converted_entry(report).node == "a2a", str(report)


def _largest_count_capacity(ranks, experts, hidden=4, seed=0):
    """DeepSpeed's ``drop_tokens=False`` capacity in small: C = the largest expert count of the
    batch (``ReduceMax`` of the per-expert counts ``[E]``); the send buffer ``[E, C, H]`` as rows,
    sent C*L rows per rank; received rows ``Reshape [N, L, C, H]`` + Transpose to the experts. The
    per-expert counts ``[E]`` (E = N*L ints) look like flat counts ``[N, L]`` but are not: with
    probe counts the Reshape fails."""
    e = ranks * experts
    rng = np.random.default_rng(seed)
    c = {
        "w_gate": rng.standard_normal((hidden, e)).astype(np.float32),
        "depth": np.array(e, np.int64),
        "onehot_values": np.array([0, 1], np.int64),
        "ax0": np.array([0], np.int64),
        "ax1": np.array([1], np.int64),
        "tile": np.array([e, 1, 1], np.int64),
        "zero": np.array([0], np.int64),
        "nl": np.array([ranks, experts], np.int64),
        "h": np.array([hidden], np.int64),
        "send": np.full(ranks, experts, np.int64),
        **{f"w{i}": np.full(hidden, i + 2.0, np.float32) for i in range(experts)},
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w_gate"], ["logits"]),
        helper.make_node("ArgMax", ["logits"], ["expert"], axis=1, keepdims=0),
        helper.make_node("OneHot", ["expert", "depth", "onehot_values"], ["mask"], axis=-1),
        helper.make_node("ReduceSum", ["mask", "ax0"], ["per_expert"], keepdims=0),  # [E]
        helper.make_node("ReduceMax", ["per_expert"], ["capacity"], keepdims=1),  # [1]
        helper.make_node("Unsqueeze", ["x", "ax0"], ["x1"]),
        helper.make_node("Tile", ["x1", "tile"], ["tiled"]),  # [E, T, H]
        helper.make_node("Slice", ["tiled", "zero", "capacity", "ax1"], ["buffer"]),  # [E, C, H]
        helper.make_node("Reshape", ["buffer", "rows_h"], ["buffer_rows"]),  # [E*C, H]
        helper.make_node("Mul", ["capacity", "l"], ["per_rank"]),
        helper.make_node("Expand", ["per_rank", "n"], ["send_rows"]),
        helper.make_node("AllToAll", ["buffer_rows", "send_rows"], ["recv", "_r"], domain=moe_onnx.DOMAIN, name="a2a"),
        helper.make_node("Concat", ["nl", "capacity", "h"], ["view"], axis=0),
        helper.make_node("Reshape", ["recv", "view"], ["grid"]),
        helper.make_node("Transpose", ["grid"], ["expert_major"], perm=[1, 0, 2, 3]),
        helper.make_node("Split", ["expert_major"], [f"xe{i}" for i in range(experts)], axis=0, num_outputs=experts),
    ]
    for i in range(experts):
        nodes.append(helper.make_node("Mul", [f"xe{i}", f"w{i}"], [f"y{i}"]))
    nodes += [
        helper.make_node("Concat", [f"y{i}" for i in range(experts)], ["ys"], axis=0),  # [L, N, C, H]
        helper.make_node("Transpose", ["ys"], ["rank_major"], perm=[1, 0, 2, 3]),
        helper.make_node("Concat", ["send_e", "h"], ["back_view"], axis=0),
        helper.make_node("Reshape", ["rank_major", "back_view"], ["back"]),
        helper.make_node("AllToAll", ["back", "send_rows"], ["out", "_o"], domain=moe_onnx.DOMAIN, name="a2a_back"),
    ]
    c["send_e"] = np.array([-1], np.int64)
    c["rows_h"] = np.array([-1, hidden], np.int64)
    c["l"] = np.array([experts], np.int64)
    c["n"] = np.array([ranks], np.int64)
    graph = helper.make_graph(
        nodes,
        "nodrop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", hidden])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["R", hidden])],
        [numpy_helper.from_array(v, k) for k, v in c.items()],
        value_info=[helper.make_tensor_value_info("buffer", TensorProto.FLOAT, [e, "C", hidden])],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )


def test_a_size_tensor_that_is_not_the_counts_leaves_the_mirror_world_to_find_them():
    """Probing the per-expert counts as ``[N, L]`` fails (the region cannot run with them); that
    used to stop the search, and the mirror world, which computes C as the graph does, was not
    tried. Converted now, the same bits on batches of two token counts (every rank holding the
    same batch, so they agree on C)."""
    models = [_largest_count_capacity(2, 2) for _ in range(2)]
    converted = []
    for model in models:
        onnx.checker.check_model(model, full_check=True)
        new, report = insert_rerouting(model)
        entry = converted_entry(report)
        assert entry.node == "a2a" and entry.movement.startswith("probed on mirror world"), str(report)
        assert entry.counts.startswith("computed: full([2, 2], rows / 4)") and len(entry.restores) == 1, str(report)
        converted.append(new)
    for tokens in (16, 24):
        x = np.random.default_rng(tokens).standard_normal((tokens, 4)).astype(np.float32)
        before = run_threads(models, [{"x": x}] * 2)
        after = run_threads(converted, [{"x": x}] * 2)
        for (a,), (b,) in zip(before, after):
            assert_same_bits(b, a)
