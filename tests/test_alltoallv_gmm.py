"""cann.moe::AlltoAllvGroupedMatMul / GroupedMatMulAlltoAllv on thread ranks (SPEC-mc2 1.24,
1.25): permute_out against a reference written from the spec, the products against float64,
the identity round trip exact, inconsistent count lists refused on every rank."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import moe_onnx
from moe_onnx.builders import single_node_model
from moe_onnx.ranks import RankFailure, run_threads


def run_ranks(op_type, inputs, attrs, timeout=60.0):
    models = [single_node_model(op_type, i, a, node_name=f"n{r}") for r, (i, a) in enumerate(zip(inputs, attrs))]
    results = run_threads(models, [{k: v for k, v in i.items() if v is not None} for i in inputs], timeout=timeout)
    names = [o.name for o in models[0].graph.output]
    return [dict(zip(names, outputs)) for outputs in results]


def count_lists(rng, world, experts):
    """C[src, dst, le] rows; rank r's send list C[r].ravel(), recv list C[:, r].ravel()."""
    grid = rng.integers(0, 4, (world, world, experts))
    grid[0, :, :] = 0  # rank 0 sends nothing at all
    return [grid[r].ravel().tolist() for r in range(world)], [grid[:, r].ravel().tolist() for r in range(world)]


def reference_permute(xs, sends, m, world, experts):
    """1.24 (b): rows of local expert le of rank m, by source rank i, in i's order."""
    rows = []
    for le in range(experts):
        for i in range(world):
            start = sum(sends[i][: m * experts + le])
            rows.extend(xs[i][start : start + sends[i][m * experts + le]])
    return np.array(rows, xs[0].dtype).reshape(-1, xs[0].shape[1])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("trans", [0, 1])
def test_forward_layout_products_and_identity_round_trip(world, dtype, trans):
    rng = np.random.default_rng(world + trans)
    experts, hidden, out = 2, 8, 6
    sends, recvs = count_lists(rng, world, experts)
    xs = [rng.standard_normal((sum(s), hidden)).astype(dtype) for s in sends]
    w = rng.standard_normal((experts, hidden, out)).astype(dtype)
    stored = np.ascontiguousarray(np.swapaxes(w, 1, 2)) if trans else w
    mm_x = [rng.standard_normal((3, 5)).astype(dtype) for _ in range(world)]
    mm_w = rng.standard_normal((5, 4)).astype(dtype)
    base = dict(group="ep", ep_world_size=world, trans_gmm_weight=trans, permute_out_flag=1)
    inputs = [{"gmm_x": xs[r], "gmm_weight": stored, "mm_x": mm_x[r], "mm_weight": mm_w} for r in range(world)]
    attrs = [{**base, "send_counts": sends[r], "recv_counts": recvs[r]} for r in range(world)]
    got = run_ranks("AlltoAllvGroupedMatMul", inputs, attrs)
    tolerance = 1e-5 if dtype == np.float32 else 1e-2
    for m in range(world):
        permute = reference_permute(xs, sends, m, world, experts)
        assert np.array_equal(got[m]["permute_out"].view(np.uint8), permute.view(np.uint8))
        counts = np.array(recvs[m]).reshape(world, experts).sum(0)
        want, start = [], 0
        for le in range(experts):
            want.append(permute[start : start + counts[le]].astype(np.float64) @ w[le].astype(np.float64))
            start += counts[le]
        want = np.concatenate(want) if want else np.zeros((0, out))
        assert np.allclose(got[m]["gmm_y"].astype(np.float64), want, rtol=tolerance, atol=tolerance * 10)
        mm = mm_x[m].astype(np.float64) @ mm_w.astype(np.float64)
        assert np.allclose(got[m]["mm_y"].astype(np.float64), mm, rtol=tolerance, atol=tolerance * 10)
    # the inverse, with identity experts: every row comes home unchanged, in its place
    eye = np.stack([np.eye(hidden, dtype=np.float32)] * experts).astype(dtype)
    back = run_ranks(
        "GroupedMatMulAlltoAllv",
        [{"gmm_x": got[r]["permute_out"], "gmm_weight": eye} for r in range(world)],
        [dict(group="ep", ep_world_size=world, send_counts=recvs[r], recv_counts=sends[r]) for r in range(world)],
    )
    for r in range(world):
        assert np.array_equal(back[r]["y"].view(np.uint8), xs[r].view(np.uint8))


def test_inconsistent_lists_are_refused_on_every_rank():
    rng = np.random.default_rng(0)
    sends, recvs = count_lists(rng, 2, 2)
    recvs[1] = list(recvs[1])
    recvs[1][2] += 1  # rank 1 expects a row rank 1 never sends itself
    sends[1] = list(sends[1])
    sends[1][0] += 1  # keep rank 1's rows and sends adding up: one more row to rank 0
    xs = [np.ones((sum(s), 4), np.float32) for s in sends]
    w = np.ones((2, 4, 3), np.float32)
    with pytest.raises(RankFailure) as failure:
        run_ranks(
            "AlltoAllvGroupedMatMul",
            [{"gmm_x": x, "gmm_weight": w} for x in xs],
            [dict(group="ep", ep_world_size=2, send_counts=sends[r], recv_counts=recvs[r]) for r in range(2)],
            timeout=20,
        )
    for r in (0, 1):
        error = failure.value.errors[r]
        assert isinstance(error, moe_onnx.MoeOpError) and error.op_type == "AlltoAllvGroupedMatMul"
        assert "recv_counts from rank" in str(error)


def test_counts_that_do_not_add_up_and_a_wrong_world_are_refused_on_every_rank():
    x = np.ones((3, 4), np.float32)
    w = np.ones((1, 4, 3), np.float32)
    inputs = [{"gmm_x": x, "gmm_weight": w}] * 2
    bad_sum = [dict(group="ep", ep_world_size=2, send_counts=[1, 1], recv_counts=[1, 1])] * 2
    with pytest.raises(RankFailure) as failure:
        run_ranks("AlltoAllvGroupedMatMul", inputs, bad_sum, timeout=20)
    assert all("sum(send_counts) = 2 must equal gmm_x.shape[0] = 3" in str(e) for e in failure.value.errors.values())
    wrong = [dict(group="ep", ep_world_size=3, send_counts=[1, 1, 1], recv_counts=[1, 1, 1])] * 2
    with pytest.raises(RankFailure) as failure:
        run_ranks("GroupedMatMulAlltoAllv", inputs, wrong, timeout=20)
    assert sorted(failure.value.errors) == [0, 1]
    assert all("the communicator has 2 ranks" in str(e) for e in failure.value.errors.values())


def test_count_tensors_are_refused_by_name():
    x, w = np.ones((2, 4), np.float32), np.ones((1, 4, 3), np.float32)
    with pytest.raises(moe_onnx.MoeOpError, match="send_counts_tensor") as error:
        moe_onnx.OPS["AlltoAllvGroupedMatMul"](
            x, w, np.array([1, 1]), group="ep", ep_world_size=2, send_counts=[1, 1], recv_counts=[1, 1]
        )
    assert error.value.code == 161002
