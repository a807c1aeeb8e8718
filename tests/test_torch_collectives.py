"""moe_onnx.torch.all_to_all / all_gather on gloo ranks: bit-equal to the cann.moe nodes on
moe_onnx's threads, differentiable like torch.distributed's own, one bad rank fails every
rank; torch.distributed's collectives export to cann.moe nodes that run like eager."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import moe_onnx
from moe_onnx.ranks import run_threads
from moe_onnx.torch.arrays import to_numpy
from tests.support import assert_same_bits, node_model
from tests.torch_collectives_worker import a2a_inputs, worker
from tests.torch_ranks import start_ranks

WORLD = 2


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("collectives")
    start_ranks(worker, WORLD, str(out_dir), directory=str(out_dir))
    return [dict(np.load(out_dir / f"rank{r}.npz")) for r in range(WORLD)], out_dir


def test_all_to_all_equals_the_node_on_threads_bit_for_bit(ranks_run):
    saved, _ = ranks_run
    feeds = []
    for rank in range(WORLD):
        data, counts = a2a_inputs(rank, WORLD)
        feeds.append({"data": to_numpy(data), "send_counts": counts.numpy()})
    model = node_model("AllToAll", feeds[0], symbolic=True)  # ranks send different row counts
    for rank, (recv, recv_counts) in enumerate(run_threads([model] * WORLD, feeds)):
        assert_same_bits(saved[rank]["a2a_recv_bits"], recv.view(np.uint16), f"rank {rank} recv_data (bfloat16 bits)")
        assert_same_bits(saved[rank]["a2a_recv_counts"], recv_counts, f"rank {rank} recv_counts")


def test_all_gather_equals_the_node_on_threads(ranks_run):
    saved, _ = ranks_run
    feeds = [{"x": np.arange(6, dtype=np.int32).reshape(2, 3) * (r + 1)} for r in range(WORLD)]
    for rank, (y,) in enumerate(run_threads([node_model("AllGather", feeds[0])] * WORLD, feeds)):
        assert_same_bits(saved[rank]["gathered"], y, f"rank {rank}")


def test_gradients_match_torch_distributed(ranks_run):
    saved, _ = ranks_run
    for rank in range(WORLD):
        assert saved[rank]["all_gather_grad_error"] <= 1e-6
        assert bool(saved[rank]["all_to_all_grad_equal"])


def test_bad_input_on_one_rank_is_the_same_error_on_every_rank(ranks_run):
    saved, _ = ranks_run
    for rank in range(WORLD):
        message = str(saved[rank]["bad_input_error"])
        assert "AllToAll" in message and "rank 1: sum(send_counts)" in message, message


def test_torch_distributed_collectives_export_to_cann_moe_and_run_like_eager(ranks_run):
    saved, out_dir = ranks_run
    models = [str(out_dir / f"torch{r}.onnx") for r in range(WORLD)]
    ops = [(n.domain, n.op_type) for n in onnx.load(models[0]).graph.node if n.domain]
    assert ops.count(("cann.moe", "AllToAll")) == 2 and ops.count(("cann.moe", "AllGather")) == 1
    feeds = [{"x": saved[r]["torch_x"], "counts": saved[r]["torch_counts"]} for r in range(WORLD)]
    for rank, outputs in enumerate(run_threads(models, feeds)):
        for name, got in zip(("ragged", "equal", "gathered"), outputs):
            np.testing.assert_array_equal(got, saved[rank][f"torch_{name}"], err_msg=f"rank {rank} {name}")


def test_eager_collectives_need_a_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(moe_onnx.MoeOpError, match="torch.distributed is not initialized"):
        moe_onnx.torch.all_gather(torch.ones(2))
