"""Inline lowering of GroupedMatmul against a constant float32 weight: one initializer and one
Gemm per expert (converters/expert_weights.py), checked against a numpy reference written
from SPEC-layer 1.9, in stock onnxruntime and onnx.reference (a process without moe_onnx)."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from moe_onnx.commands.lower_file import lower_file

from .lower_support import RUNTIMES, LoweredRunner
from .support import node_model


@pytest.fixture(scope="module")
def runner():
    worker = LoweredRunner()
    yield worker
    worker.close()


def reference(x, weight, bias, group_list, list_type: int, transposed: bool) -> np.ndarray:
    """``y[off[e]:off[e+1]] = x[off[e]:off[e+1]] @ W[e] (+ bias[e])``, zeros past ``off[E]``,
    in float64 (W[e] stored [N, K] when ``transposed``)."""
    ends = np.cumsum(group_list) if list_type == 1 else group_list
    starts = np.concatenate([[0], ends[:-1]])
    matrices = np.swapaxes(weight, 1, 2) if transposed else weight
    y = np.zeros((x.shape[0], matrices.shape[2]))
    for e, (first, stop) in enumerate(zip(starts, ends)):
        y[first:stop] = x[first:stop].astype(np.float64) @ matrices[e]
        if bias is not None:
            y[first:stop] += bias[e]
    return y


def constant(model: onnx.ModelProto, *arrays: tuple[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with the graph inputs named in ``arrays`` turned into initializers."""
    names = {name for name, _ in arrays}
    inputs = [value for value in model.graph.input if value.name not in names]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.graph.initializer.extend(numpy_helper.from_array(array, name) for name, array in arrays)
    return model


def node_counts(model: onnx.ModelProto) -> Counter[str]:
    return Counter(node.op_type for node in model.graph.node)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    experts=st.integers(1, 5),
    rows=st.integers(0, 12),
    inner=st.integers(1, 6),
    columns=st.integers(1, 7),
    list_type=st.sampled_from([0, 1]),
    transposed=st.booleans(),
    with_bias=st.booleans(),
    constant_bias=st.booleans(),
)
def test_a_constant_weight_is_one_gemm_per_expert_and_gives_the_products(
    runner, seed, experts, rows, inner, columns, list_type, transposed, with_bias, constant_bias
):
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(int(rng.integers(0, rows + 1)), np.ones(experts) / experts)  # rows past off[E] too
    group_list = (counts if list_type else np.cumsum(counts)).astype(np.int64)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    weight = rng.standard_normal((experts, columns, inner) if transposed else (experts, inner, columns)).astype(
        np.float32
    )
    bias = rng.standard_normal((experts, columns)).astype(np.float32) if with_bias else None
    attrs = {"group_type": 0, "group_list_type": list_type, "transpose_weight": int(transposed)}
    inputs = {"x": x, "weight": weight, "bias": bias, "group_list": group_list}
    fixed = [("weight", weight)] + ([("bias", bias)] if with_bias and constant_bias else [])
    model = constant(node_model("GroupedMatmul", inputs, attrs), *fixed)
    lowered = moe_onnx.lower(model, inline=True)

    ops = node_counts(lowered)
    assert ops.get("Gemm") == experts and "Loop" not in ops, ops
    initializers = {t.name: t for t in lowered.graph.initializer}
    assert "weight" not in initializers  # nothing reads the whole weight any more
    for e in range(experts):
        part = initializers[f"weight/expert{e}"]
        np.testing.assert_array_equal(numpy_helper.to_array(part), weight[e])

    feeds = {k: v for k, v in inputs.items() if v is not None and k not in dict(fixed)}
    reply = runner.run(lowered, feeds)
    assert reply["checker"] is None, reply["checker"]
    want = reference(x, weight, bias, group_list, list_type, transposed)
    bound = reference(
        np.abs(x), np.abs(weight), None if bias is None else np.abs(bias), group_list, list_type, transposed
    )
    for runtime in RUNTIMES:
        (got,) = reply[runtime]
        assert got.dtype == np.float32 and got.shape == want.shape, (runtime, got.dtype, got.shape)
        assert (np.abs(got - want) <= 1e-6 * bound + 1e-30).all(), (runtime, np.abs(got - want).max())


def test_group_list_checks_still_hold(runner):
    weight = np.ones((2, 3, 4), np.float32)
    x = np.ones((5, 3), np.float32)
    model = constant(
        node_model(
            "GroupedMatmul",
            {"x": x, "weight": weight, "group_list": np.array([2, 2], np.int64)},
            {"group_type": 0, "group_list_type": 1},
        ),
        ("weight", weight),
    )
    lowered = moe_onnx.lower(model, inline=True)
    assert node_counts(lowered).get("Gemm") == 2
    for group_list, rule in (([3, -1], "group_list (counts) must be in [0"), ([4, 2], "the groups must cover at most")):
        reply = runner.run(lowered, {"x": x, "group_list": np.array(group_list, np.int64)}, check=False)
        assert isinstance(reply["onnxruntime"], str) and f"GroupedMatmul check: {rule}" in reply["onnxruntime"], reply
        assert isinstance(reply["reference"], str), reply["reference"]


def two_products_model(weight: np.ndarray, extra_reader: bool) -> onnx.ModelProto:
    """Two GroupedMatmul nodes over the same constant weight ([E, K, K]); with ``extra_reader``
    a standard node reads the weight too."""
    experts, k, _ = weight.shape
    gmm = dict(domain="cann.moe", group_type=0, group_list_type=1)
    nodes = [
        helper.make_node("GroupedMatmul", ["x", "w", "", "counts"], ["h"], name="first", **gmm),
        helper.make_node("GroupedMatmul", ["h", "w", "", "counts"], ["y"], name="second", **gmm),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", k])]
    if extra_reader:
        nodes.append(helper.make_node("ReduceSum", ["w"], ["w_sum"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("w_sum", TensorProto.FLOAT, []))
    graph = helper.make_graph(
        nodes,
        "two",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k]),
            helper.make_tensor_value_info("counts", TensorProto.INT64, [experts]),
        ],
        outputs,
        [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann.moe", 1)])


@pytest.mark.parametrize("extra_reader", [False, True], ids=["only-grouped-matmuls", "read-elsewhere-too"])
def test_a_shared_weight_is_split_once_and_kept_while_read_whole(extra_reader):
    rng = np.random.default_rng(3)
    weight = rng.standard_normal((3, 4, 4)).astype(np.float32)
    lowered = moe_onnx.lower(two_products_model(weight, extra_reader), inline=True)
    names = [t.name for t in lowered.graph.initializer]
    assert sorted(n for n in names if n.startswith("w/")) == ["w/expert0", "w/expert1", "w/expert2"]
    assert ("w" in names) == extra_reader
    assert node_counts(lowered)["Gemm"] == 6
    x = rng.standard_normal((7, 4)).astype(np.float32)
    counts = np.array([2, 0, 4], np.int64)
    got = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "counts": counts}
    )
    hidden = reference(x, weight, None, counts, 1, False)
    want = reference(hidden.astype(np.float32), weight, None, counts, 1, False)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    if extra_reader:
        np.testing.assert_allclose(got[1], weight.astype(np.float64).sum(), rtol=1e-5)


def test_weights_that_are_not_constant_float32_keep_the_loop():
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((2, 3, 4)).astype(np.float32)
    inputs = {"x": np.ones((3, 3), np.float32), "weight": weight, "group_list": np.array([1, 2], np.int64)}
    attrs = {"group_type": 0, "group_list_type": 1}
    fed = node_model("GroupedMatmul", inputs, attrs)  # a graph input: may change per run
    overridable = constant(node_model("GroupedMatmul", inputs, attrs), ("weight", weight))
    overridable.graph.input.append(helper.make_tensor_value_info("weight", TensorProto.FLOAT, [2, 3, 4]))
    halves = {**inputs, "x": inputs["x"].astype(np.float16), "weight": weight.astype(np.float16)}
    float16 = constant(node_model("GroupedMatmul", halves, attrs), ("weight", halves["weight"]))
    for model in (fed, overridable, float16):
        inlined = moe_onnx.lower(model, inline=True)
        assert "Loop" in node_counts(inlined) and "Gemm" not in node_counts(inlined)
    in_functions = moe_onnx.lower(constant(node_model("GroupedMatmul", inputs, attrs), ("weight", weight)))
    assert [t.name for t in in_functions.graph.initializer] == ["weight"]  # the node stays, so does its weight


def test_external_weights_stay_in_their_file_one_reference_per_expert(tmp_path):
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((4, 16, 8)).astype(np.float32)  # transposed: [E, N, K]
    x = rng.standard_normal((9, 8)).astype(np.float32)
    counts = np.array([3, 0, 4, 1], np.int64)
    attrs = {"group_type": 0, "group_list_type": 1, "transpose_weight": 1}
    model = constant(
        node_model("GroupedMatmul", {"x": x, "weight": weight, "group_list": counts}, attrs), ("weight", weight)
    )
    source, target = str(tmp_path / "model.onnx"), str(tmp_path / "out" / "lowered.onnx")
    onnx.save(model, source, save_as_external_data=True, location="weights.bin", size_threshold=0)
    in_memory = moe_onnx.lower(onnx.load(source, load_external_data=False), inline=True)
    parts = {t.name: t for t in in_memory.graph.initializer if t.name.startswith("weight/")}
    assert len(parts) == 4
    for e in range(4):  # the reference points at expert e's bytes in the source's file
        entries = {entry.key: entry.value for entry in parts[f"weight/expert{e}"].external_data}
        assert parts[f"weight/expert{e}"].data_location == TensorProto.EXTERNAL
        assert entries["location"] == "weights.bin" and int(entries["length"]) == 16 * 8 * 4
        assert int(entries["offset"]) % (16 * 8 * 4) == 0 and int(entries["offset"]) // (16 * 8 * 4) == e
    os.makedirs(os.path.dirname(target))
    lower_file(source, target, inline=True)
    saved = onnx.load(target, load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in saved.graph.initializer if t.name.startswith("weight/"))
    got = ort.InferenceSession(target, providers=["CPUExecutionProvider"]).run(None, {"x": x, "group_list": counts})
    np.testing.assert_allclose(got[0], reference(x, weight, None, counts, 1, True), rtol=1e-5, atol=1e-5)
