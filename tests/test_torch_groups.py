"""moe_onnx.torch on process groups smaller than the world (4 gloo ranks, tests/torch_groups_worker.py):
the cann.moe collectives with group_ranks equal torch.distributed's on the same group (values
and gradients); torch.distributed's collectives on EP / ETP sub-groups and vLLM-Ascend's MC2
path with group_ep naming a registered EP group export as cann.moe nodes carrying the group's
ranks, which `moe-onnx run --backend threads|mpi` runs to eager's outputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from moe_onnx.custom_ops.schemas import attribute_value
from tests.test_groups import moe_onnx_run
from tests.torch_groups_worker import worker
from tests.torch_ranks import start_ranks

WORLD = 4


@pytest.fixture(scope="module")
def ranks_and_files(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("groups")
    start_ranks(worker, WORLD, str(out_dir), directory=str(out_dir))
    return [dict(np.load(out_dir / f"rank{r}.npz")) for r in range(WORLD)], out_dir


def test_group_collectives_equal_torch_distributed_on_the_group(ranks_and_files):
    for rank, saved in enumerate(ranks_and_files[0]):
        assert bool(saved["a2a_equal"]) and bool(saved["gather_equal"]), rank
        assert bool(saved["a2a_grad_equal"]) and saved["gather_grad_error"] <= 1e-6, rank


def test_ranks_without_a_process_group_and_a_rank_outside_are_refused(ranks_and_files):
    for rank, saved in enumerate(ranks_and_files[0]):
        assert "no torch.distributed process group has the ranks" in str(saved["unmade_error"]), rank
        assert f"do not include this rank ({rank})" in str(saved["outside_error"]), rank


def group_ranks(model: onnx.ModelProto, op_type: str) -> list:
    """The group_ranks of each ``op_type`` node (None where absent: the whole world)."""
    found = []
    for node in model.graph.node:
        if node.domain == "cann.moe" and node.op_type == op_type:
            attrs = {a.name: attribute_value(a) for a in node.attribute}
            found.append(attrs.get("group_ranks"))
    return found


def run_exports(out_dir, tmp_path, stem, names, ranks_run, backend):
    for r, saved in enumerate(ranks_run):
        np.savez(tmp_path / f"in{r}.npz", **{name: saved[key] for name, key in names(r)})
    result = moe_onnx_run(out_dir / f"{stem}{{r}}.onnx", tmp_path / "in{r}.npz", backend, "--outputs", tmp_path / "out")
    assert result.returncode == 0, result.stdout + result.stderr
    return [list(np.load(tmp_path / "out" / f"rank{r}.npz").values()) for r in range(WORLD)]


@pytest.mark.parametrize("backend", ["threads", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_exported_exchange_carries_its_groups_and_runs_like_eager(ranks_and_files, tmp_path, backend):
    ranks_run, out_dir = ranks_and_files
    for rank in range(WORLD):
        model = onnx.load(out_dir / f"exchange{rank}.onnx")
        ep, etp = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        assert group_ranks(model, "AllToAll") == [ep, ep], rank  # ragged (Megatron), equal (DeepSpeed)
        # (the counts' gather inside the EP group is dead in the graph: AllToAll swaps counts itself)
        assert group_ranks(model, "AllGather") == [etp], rank
    names = [i.name for i in onnx.load(out_dir / "exchange0.onnx").graph.input]
    outputs = run_exports(
        out_dir, tmp_path, "exchange", lambda r: zip(names, ("torch_x", "torch_counts")), ranks_run, backend
    )
    for rank, got in enumerate(outputs):
        for name, value in zip(("received", "shared", "capacity"), got, strict=True):
            np.testing.assert_array_equal(value, ranks_run[rank][f"torch_{name}"], err_msg=f"rank {rank} {name}")


@pytest.mark.parametrize(("dtype", "tolerance"), [("f32", 2e-5), ("bf16", 4e-2)])
def test_vllm_mc2_path_on_an_expert_parallel_group_equals_a_dense_moe(ranks_and_files, dtype, tolerance):
    for rank, saved in enumerate(ranks_and_files[0]):
        got, want = saved[f"{dtype}_mc2"], saved[f"{dtype}_dense"]
        assert np.allclose(got, want, rtol=tolerance, atol=tolerance * np.abs(want).max()), (
            rank,
            np.abs(got - want).max(),
        )


@pytest.mark.parametrize("backend", ["threads", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_exported_mc2_layer_carries_its_ep_group_and_runs_like_eager(ranks_and_files, tmp_path, backend):
    ranks_run, out_dir = ranks_and_files
    for rank in range(WORLD):
        model = onnx.load(out_dir / f"mc2_{rank}.onnx")
        ep = [rank - rank % 2, rank - rank % 2 + 1]
        assert group_ranks(model, "MoeDistributeDispatchV2") == [ep], rank
        assert group_ranks(model, "MoeDistributeCombineV2") == [ep], rank
    names = [i.name for i in onnx.load(out_dir / "mc2_0.onnx").graph.input]
    keys = ("export_x", "export_w", "export_ids")
    outputs = run_exports(out_dir, tmp_path, "mc2_", lambda r: zip(names, keys), ranks_run, backend)
    for rank, (got,) in enumerate(outputs):
        np.testing.assert_array_equal(got, ranks_run[rank]["export_eager"], err_msg=f"rank {rank}")
