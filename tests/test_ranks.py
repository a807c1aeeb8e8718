"""AllToAll and the EP MoE layer on N ranks: threads and MPI backends, uneven routing, failure."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.models import EP_LAYER_SMALL
from moe_onnx.models.ep_layer import (
    PATTERNS,
    LayerConfig,
    build_rank_model,
    dense_reference,
    example_inputs,
    make_weights,
)
from moe_onnx.ranks import RankFailure, run_threads

TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def layer(ranks, pattern="split_concat", **overrides):
    config = LayerConfig(ranks=ranks, **overrides)
    weights = make_weights(config, seed=ranks)
    return config, weights, [build_rank_model(config, weights, r, pattern) for r in range(ranks)]


def check_against_dense(config, weights, xs, ys, pattern="split_concat"):
    capacity = config.capacity if pattern == "drop_pad" else None
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(y, dense_reference(config, weights, x, capacity), **TOLERANCE)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_threads_match_dense_reference(ranks, pattern):
    config, weights, models = layer(ranks, pattern)
    xs = example_inputs(config, seed=ranks)
    results = run_threads(models, [{"x": x} for x in xs])
    check_against_dense(config, weights, xs, [r[0] for r in results], pattern)


def test_drop_pad_drops_past_capacity():
    """Capacity 1 really drops slots: the output differs from the dropless layer."""
    config, weights, models = layer(2, "drop_pad", capacity=1)
    xs = example_inputs(config)
    ys = [r[0] for r in run_threads(models, [{"x": x} for x in xs])]
    check_against_dense(config, weights, xs, ys, "drop_pad")
    assert not np.allclose(ys[0], dense_reference(config, weights, xs[0]), **TOLERANCE)


def cli(*args, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "moe_onnx.commands.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def write_rank_files(tmp_path, models, xs):
    for r, (model, x) in enumerate(zip(models, xs)):
        onnx.save(model, tmp_path / f"rank{r}.onnx")
        np.savez(tmp_path / f"in{r}.npz", x=x)


@pytest.mark.mpi
# 4 ranks by default; 1 and 2 (2 s each, mostly mpirun's start) with -m slow
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 4])
def test_mpi_matches_dense_reference(tmp_path, ranks):
    config, weights, models = layer(ranks)
    xs = example_inputs(config, seed=ranks)
    write_rank_files(tmp_path, models, xs)
    result = cli(
        "run",
        str(tmp_path),
        "--ranks",
        str(ranks),
        "--backend",
        "mpi",
        "--inputs",
        str(tmp_path / "in{r}.npz"),
        "--outputs",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ys = [np.load(tmp_path / "out" / f"rank{r}.npz")["y"] for r in range(ranks)]
    check_against_dense(config, weights, xs, ys)


def crafted_router(config, weights, hot_experts):
    """Weights whose router sends every token (positive x) to ``hot_experts``."""
    router = np.zeros_like(weights.router)
    for rank_of_preference, e in enumerate(hot_experts):
        router[:, e] = 10.0 * (len(hot_experts) - rank_of_preference)
    return type(weights)(router, weights.gate, weights.up, weights.down)


def uneven_case(name):
    if name == "all_to_one_expert":
        config = LayerConfig(ranks=4, top_k=1)
        tokens = [8, 8, 8, 8]
        hot = [5]
    elif name == "rank_sends_nothing":
        config = LayerConfig(ranks=4)
        tokens = [6, 0, 5, 7]  # rank 1 has no tokens: it sends and gets back nothing
        hot = None
    else:  # "expert_receives_nothing": two hot experts, every other expert idle
        config = LayerConfig(ranks=2, local_experts=3)
        tokens = [9, 4]
        hot = [0, 4]
    weights = make_weights(config, seed=11)
    if hot is not None:
        weights = crafted_router(config, weights, hot)
    rng = np.random.default_rng(5)
    xs = [np.abs(rng.standard_normal((t, config.hidden))).astype(np.float32) for t in tokens]
    models = [build_rank_model(config, weights, r) for r in range(config.ranks)]
    return config, weights, models, xs


@pytest.mark.parametrize("case", ["all_to_one_expert", "rank_sends_nothing", "expert_receives_nothing"])
def test_uneven_routing_threads(case):
    config, weights, models, xs = uneven_case(case)
    results = run_threads(models, [{"x": x} for x in xs])
    check_against_dense(config, weights, xs, [r[0] for r in results])


@pytest.mark.mpi
def test_uneven_routing_mpi(tmp_path):
    config, weights, models, xs = uneven_case("rank_sends_nothing")
    write_rank_files(tmp_path, models, xs)
    result = cli(
        "run",
        str(tmp_path / "rank{r}.onnx"),
        "--ranks",
        "4",
        "--backend",
        "mpi",
        "--inputs",
        str(tmp_path / "in{r}.npz"),
        "--outputs",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    check_against_dense(config, weights, xs, [np.load(tmp_path / "out" / f"rank{r}.npz")["y"] for r in range(4)])


# --- failure is clean ------------------------------------------------------------------


def test_bad_input_on_one_rank_stops_every_rank_threads():
    config, _, models = layer(4)
    xs = example_inputs(config)
    xs[2] = xs[2][:, :5]  # wrong hidden size on rank 2 only: refused as fed
    with pytest.raises(RankFailure) as failure:
        run_threads(models, [{"x": x} for x in xs], timeout=60)
    errors = failure.value.errors
    assert sorted(errors) == [0, 1, 2, 3]
    assert "input 'x' must have shape ['T', 16], got [8, 5]" in str(errors[2])
    for r in (0, 1, 3):
        assert "rank 2 failed" in str(errors[r])


def test_bad_counts_on_one_rank_reach_every_rank_as_moe_op_error():
    """An AllToAll whose send_counts do not sum to the rows: all ranks raise the same rule."""
    node = helper.make_node(
        "AllToAll", ["data", "send_counts"], ["recv", "recv_counts"], domain=moe_onnx.DOMAIN, name="a2a"
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, ["S", 3]),
            helper.make_tensor_value_info("send_counts", TensorProto.INT64, [2]),
        ],
        [
            helper.make_tensor_value_info("recv", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("recv_counts", TensorProto.INT64, [2]),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    data = np.ones((4, 3), np.float32)
    feeds = [{"data": data, "send_counts": np.array([2, 2])}, {"data": data, "send_counts": np.array([1, 2])}]
    with pytest.raises(RankFailure) as failure:
        run_threads([model, model], feeds, timeout=60)
    for r in (0, 1):
        error = failure.value.errors[r]
        assert isinstance(error, moe_onnx.MoeOpError) and error.node_name == "a2a"
        assert "rank 1: sum(send_counts) = 3 must equal data rows S = 4" in str(error)


@pytest.mark.mpi
def test_bad_input_on_one_rank_stops_every_rank_mpi(tmp_path):
    config, _, models = layer(4)
    xs = example_inputs(config)
    xs[1] = xs[1][:, :5]
    write_rank_files(tmp_path, models, xs)
    marker = str(tmp_path / "rank{r}.onnx")
    result = cli(
        "run",
        marker,
        "--ranks",
        "4",
        "--backend",
        "mpi",
        "--inputs",
        str(tmp_path / "in{r}.npz"),
        "--timeout",
        "60",
        timeout=180,
    )
    assert result.returncode == 2, result.stderr  # a refusal, whichever rank's MPI_Abort came first
    # once per job: the cause, and the ranks it stopped
    assert result.stderr.strip().splitlines() == [
        "rank 1: error: FeedError: input 'x' must have shape ['T', 16], got [8, 5] [CANN 561002] "
        "(ranks 0, 2, 3 stopped because of it)"
    ], result.stderr
    leftover = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "orphan rank processes"


# --- the ops themselves ----------------------------------------------------------------


def test_com_microsoft_all_to_all_equal_splits():
    node = helper.make_node("AllToAll", ["x"], ["y"], domain="com.microsoft", group_size=4)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT64, [8, 2])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [8, 2])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    feeds = [{"x": np.arange(16, dtype=np.int64).reshape(8, 2) + 100 * r} for r in range(4)]
    results = run_threads([model] * 4, feeds)
    for r, (y,) in enumerate(results):
        want = np.concatenate([feeds[s]["x"][2 * r : 2 * r + 2] for s in range(4)])
        assert np.array_equal(y, want)


def test_all_to_all_shape_inference():
    node = helper.make_node("AllToAll", ["data", "send_counts"], ["recv", "recv_counts"], domain=moe_onnx.DOMAIN)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("data", TensorProto.BFLOAT16, ["S", "H"]),
            helper.make_tensor_value_info("send_counts", TensorProto.INT64, ["N"]),
        ],
        [],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    inferred = {
        vi.name: vi.type.tensor_type
        for vi in onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.value_info
    }
    assert inferred["recv"].elem_type == TensorProto.BFLOAT16
    assert [d.dim_param for d in inferred["recv"].shape.dim][1] == "H"
    assert [d.dim_param for d in inferred["recv_counts"].shape.dim] == ["N"]


def test_all_to_all_without_communicator_is_a_clear_error():
    node = helper.make_node("AllToAll", ["data", "send_counts"], ["recv", "recv_counts"], domain=moe_onnx.DOMAIN)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("send_counts", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("recv", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    with pytest.raises(moe_onnx.MoeOpError, match="no communicator"):
        moe_onnx.InferenceSession(model).run(None, {"data": np.ones(2, np.float32), "send_counts": np.array([2])})


def test_shipped_models_are_the_builder_output():
    config = LayerConfig()
    weights = make_weights(config, seed=0)
    for r in range(config.ranks):
        shipped = onnx.load(os.path.join(EP_LAYER_SMALL, f"rank{r}.onnx"))
        assert shipped.SerializeToString() == build_rank_model(config, weights, r).SerializeToString()


def test_demo_command():
    result = cli("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vs single-process dense layer: match" in result.stdout
    assert "bit-identical" in result.stdout


def test_models_with_external_data_run_from_their_path(tmp_path):
    """Weights in external data are read by onnxruntime from the files (no 2 GB limit)."""
    config, weights, models = layer(2, hidden=512, ffn=1024)  # 2 MiB expert weights: left external
    assert weights.gate[0].nbytes >= 1 << 21
    (tmp_path / "weights").mkdir()
    for r, model in enumerate(models):
        model = onnx.ModelProto.FromString(model.SerializeToString())  # onnx.save externalises in place
        onnx.save(
            model,
            tmp_path / f"rank{r}.onnx",
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"weights/rank{r}.bin",
            size_threshold=0,
        )
    assert (tmp_path / "weights" / "rank0.bin").exists()
    xs = example_inputs(config)
    from_files = run_threads([str(tmp_path / f"rank{r}.onnx") for r in range(2)], [{"x": x} for x in xs])
    in_memory = run_threads(models, [{"x": x} for x in xs])
    for (a,), (b,) in zip(from_files, in_memory):
        assert np.array_equal(a, b)
    assert not list(tmp_path.glob(".moe_onnx_*")), "the transient prepared model was left behind"
    proto = onnx.load(tmp_path / "rank0.onnx", load_external_data=False)
    with pytest.raises(ValueError, match="give InferenceSession its path"):
        moe_onnx.InferenceSession(proto)
