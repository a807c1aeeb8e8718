"""cann.moe::AllGather on N ranks: threads and MPI backends, shape inference, mismatch errors."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.ranks import RankFailure, run_threads


def gather_model(elem_type=TensorProto.FLOAT, shape=("T", 3)):
    node = helper.make_node("AllGather", ["x"], ["y"], domain=moe_onnx.DOMAIN, name="ag")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", elem_type, list(shape))],
        [helper.make_tensor_value_info("y", elem_type, None)],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_threads_stack_every_rank_in_rank_order(ranks):
    feeds = [{"x": np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r} for r in range(ranks)]
    results = run_threads([gather_model()] * ranks, feeds)
    want = np.stack([f["x"] for f in feeds])
    for (y,) in results:
        assert y.shape == (ranks, 2, 3) and np.array_equal(y, want)


def test_bfloat16_and_empty_tensors_cross_as_bits():
    bits = np.array([[0x7FC1, 0x8000, 0x3F80]], np.uint16)  # a NaN payload, -0.0, 1.0
    feeds = [{"x": (bits + r).view(ml_dtypes.bfloat16)} for r in range(2)]
    results = run_threads([gather_model(TensorProto.BFLOAT16)] * 2, feeds)
    assert np.array_equal(results[1][0].view(np.uint16), np.stack([bits, bits + 1]))
    empty = [{"x": np.zeros((0, 3), np.float32)} for _ in range(2)]
    assert run_threads([gather_model()] * 2, empty)[0][0].shape == (2, 0, 3)


def test_shape_mismatch_on_one_rank_is_the_same_error_on_every_rank():
    feeds = [{"x": np.ones((2, 3), np.float32)}, {"x": np.ones((4, 3), np.float32)}]
    with pytest.raises(RankFailure) as failure:
        run_threads([gather_model()] * 2, feeds, timeout=60)
    for r in (0, 1):
        error = failure.value.errors[r]
        assert isinstance(error, moe_onnx.MoeOpError) and error.node_name == "ag"
        assert "rank 0 has float32[2, 3], rank 1 has float32[4, 3]" in str(error)


def test_shape_inference_adds_the_rank_dim():
    inferred = onnx.shape_inference.infer_shapes(gather_model(TensorProto.INT64), strict_mode=True)
    (y,) = [vi for vi in inferred.graph.output if vi.name == "y"]
    dims = y.type.tensor_type.shape.dim
    assert y.type.tensor_type.elem_type == TensorProto.INT64
    assert len(dims) == 3 and not dims[0].HasField("dim_value") and dims[0].dim_param != "T"  # N: unknown
    assert [dims[1].dim_param, dims[2].dim_value] == ["T", 3]


def test_without_communicator_is_a_clear_error():
    with pytest.raises(moe_onnx.MoeOpError, match="no communicator"):
        moe_onnx.InferenceSession(gather_model()).run(None, {"x": np.ones((1, 3), np.float32)})


@pytest.mark.mpi
def test_mpi_ranks(tmp_path):
    onnx.save(gather_model(TensorProto.INT32, ("T",)), tmp_path / "ag.onnx")
    for r in range(2):
        np.savez(tmp_path / f"in{r}.npz", x=np.arange(4, dtype=np.int32) * (r + 1))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_onnx.commands.cli",
            "run",
            str(tmp_path / "ag.onnx"),
            "--ranks",
            "2",
            "--backend",
            "mpi",
        ]
        + ["--inputs", str(tmp_path / "in{r}.npz"), "--outputs", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    want = np.stack([np.arange(4, dtype=np.int32) * (r + 1) for r in range(2)])
    for r in range(2):
        assert np.array_equal(np.load(tmp_path / "out" / f"rank{r}.npz")["y"], want)
