"""torch_npu's MC2 names on gloo ranks (SPEC-mc2 1.20-1.23): vLLM-Ascend's call pattern equals a
dense torch MoE, the V1 outputs equal the cann.moe nodes on moe_onnx's threads bit for bit and
the reference of tests/mc2_reference.py, one bad rank fails every rank, refusals by name."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from moe_onnx.builders import single_node_model
from moe_onnx.ranks import run_threads
from tests import mc2_reference as ref
from tests.torch_mc2_worker import worker
from tests.torch_ranks import start_ranks

WORLD = 4


@pytest.fixture(scope="module")
def ranks_and_files(tmp_path_factory):
    """Every rank's saved values, and the folder holding its exported layer."""
    out_dir = tmp_path_factory.mktemp("mc2")
    start_ranks(worker, WORLD, str(out_dir), directory=str(out_dir))
    return [dict(np.load(out_dir / f"rank{r}.npz")) for r in range(WORLD)], out_dir


@pytest.fixture(scope="module")
def ranks_run(ranks_and_files):
    return ranks_and_files[0]


@pytest.mark.parametrize(("name", "tolerance"), [("f32", 2e-5), ("bf16", 4e-2), ("masked", 2e-5), ("named", 2e-5)])
def test_vllm_mc2_path_equals_a_dense_moe(ranks_run, name, tolerance):
    for saved in ranks_run:
        got, want = (
            saved[f"{name}_mc2"],
            saved[f"{'masked' if name == 'masked' else name.replace('named', 'f32')}_dense"],
        )
        assert np.allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max()), np.abs(got - want).max()


def test_masked_tokens_come_back_zero(ranks_run):
    for rank, saved in enumerate(ranks_run):
        assert not saved["masked_mc2"][ref_rows := slice(5 - 1 - rank, None)].any(), ref_rows


def test_v1_shared_expert_outputs_equal_the_nodes_and_the_reference(ranks_run):
    experts = 6  # E // (W - 1) * (W - 1) for E = 8, W = 4
    group = ref.Group(WORLD, experts, 1, 1, False)
    xs = [s["v1_x"] for s in ranks_run]
    ids = [s["v1_ids"] for s in ranks_run]
    weights = [s["v1_weights"] for s in ranks_run]
    want = ref.dispatch(group, xs, ids, expert_scales=weights)
    attrs = dict(group_ep="ep", ep_world_size=WORLD, moe_expert_num=experts, shared_expert_rank_num=1)
    models = [
        single_node_model(
            "MoeDistributeDispatch",
            {"x": xs[r], "expert_ids": ids[r], "expert_scales": weights[r]},
            {**attrs, "ep_rank_id": r},
        )
        for r in range(WORLD)
    ]
    feeds = [{"x": xs[r], "expert_ids": ids[r], "expert_scales": weights[r]} for r in range(WORLD)]
    threads = run_threads(models, feeds)
    names = ["expand_x", "dynamic_scales", "expand_idx", "expert_token_nums", "ep_recv_count"]
    for r, saved in enumerate(ranks_run):
        for i, name in enumerate(names):
            assert np.array_equal(saved[f"v1_out{i}"], threads[r][i]), (r, name)
            assert np.array_equal(saved[f"v1_out{i}"][: len(want[r][name])], want[r][name]), (r, name)
        # op-plugin's ep_recv_counts: W*L' + 2*G*K*(W/8) with expert_scales (zero tail; W/8 = 0 here)
        assert len(saved["v1_out4"]) == len(want[r]["ep_recv_count"])
        assert np.array_equal(saved["v1_out6"], want[r]["expand_scales"])
        x, i, w = xs[r], ids[r], weights[r]
        expected = np.zeros_like(x)
        for t in range(len(x)):
            acc = np.zeros(x.shape[1], np.float32)
            for j in range(i.shape[1]):
                acc = (acc + x[t] * w[t, j]).astype(np.float32)
            expected[t] = acc + x[t]  # the shared expert's row, weight 1
        assert np.array_equal(saved["v1_back"], expected), r


def test_a_bad_id_on_one_rank_is_the_same_error_on_every_rank(ranks_run):
    for rank, saved in enumerate(ranks_run):
        error = str(saved["bad_input_error"])
        assert error.startswith(
            "MoeDistributeDispatchV2: torch_npu.npu_moe_distribute_dispatch_v2: "
            "rank 1: expert_ids[0, 0] = 8 is outside [0, 8)"
        ), error
        assert ("(reported by rank 1)" in error) == (rank != 1), error


def test_shared_expert_x_is_refused_by_name_on_v1(ranks_run):
    for saved in ranks_run:
        refusal = str(saved["refusal"])
        assert "torch_npu.npu_moe_distribute_combine: shared_expert_x" in refusal and "161002" in refusal


@pytest.mark.parametrize("name", ["y", "dx", "dw1", "dw2"])
def test_mindspeed_alltoallv_gmm_step_equals_megatron_style_torch(ranks_run, name):
    """FC1 by npu_alltoallv_gmm, FC2 by npu_gmm_alltoallv: values and gradients of x and both
    weights against pure torch (all_to_all_single, index permutes, per-expert matmuls)."""
    for saved in ranks_run:
        assert saved[f"gmm_{name}_error"] <= 2e-5, saved[f"gmm_{name}_error"]


def test_exported_layer_runs_under_moe_onnx_run_like_eager(ranks_and_files, tmp_path):
    """Each rank's export holds the cann.moe MC2 nodes with T dynamic; `moe-onnx run --backend
    threads` on the four files gives eager's outputs."""
    ranks_run, out_dir = ranks_and_files
    model = onnx.load(out_dir / "layer0.onnx")
    ops = [n.op_type for n in model.graph.node if n.domain == "cann.moe"]
    assert ops.count("MoeDistributeDispatchV2") == 1 and ops.count("MoeDistributeCombineV2") == 1, ops
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # T stays symbolic
    names = [i.name for i in model.graph.input]
    for r, saved in enumerate(ranks_run):
        feeds = dict(zip(names, (saved["export_x"], saved["export_w"], saved["export_ids"])))
        np.savez(tmp_path / f"in{r}.npz", **feeds)
    result = subprocess.run(
        [sys.executable, "-m", "moe_onnx.commands.cli", "run", str(out_dir / "layer{r}.onnx"), "--ranks", str(WORLD)]
        + ["--backend", "threads", "--inputs", str(tmp_path / "in{r}.npz"), "--outputs", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for r, saved in enumerate(ranks_run):
        (got,) = np.load(tmp_path / "out" / f"rank{r}.npz").values()
        np.testing.assert_array_equal(got, saved["export_eager"], err_msg=f"rank {r}")


def test_every_mc2_output_is_a_resizable_torch_allocation(ranks_run):
    """The MC2 names run only on ranks, so test_torch_outputs leaves them to this worker: every
    output of each of the six names (called, and recorded, on every rank) has resizable storage."""
    for saved in ranks_run:
        assert saved["resizable"].tolist() == [True] * 6, saved["resizable"]
