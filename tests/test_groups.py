"""Collectives on a group smaller than the world (``group_ranks``): AllToAll, AllGather and the
MC2 ops on 4 thread ranks split into groups (contiguous and interleaved), each group's outputs
against a reference written for that group alone; the MPI launcher gives the same bits; groups
that do not split the world, and static mistakes, refused by name on every rank."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.builders import single_node_model
from moe_onnx.ranks import CollectiveMismatch, PeerStopped, RankFailure, ThreadRanks, run_threads
from moe_onnx.ranks.communicators import ThreadWorld
from tests import mc2_reference as ref
from tests.test_alltoallv_gmm import count_lists, reference_permute
from tests.test_moe_distribute import group_attrs, make_x, routing, weighted_sum

WORLD = 4
SPLITS = {"halves": ([0, 1], [2, 3]), "interleaved": ([0, 2], [1, 3])}


def group_of(split, rank: int) -> list[int]:
    return next(g for g in split if rank in g)


def run_nodes(op_type, inputs, attrs, timeout=60.0, executor="split"):
    """One node per rank on thread ranks; each rank's outputs by name."""
    models = [single_node_model(op_type, i, a, symbolic=True, node_name="n") for i, a in zip(inputs, attrs)]
    feeds = [{k: v for k, v in i.items() if v is not None} for i in inputs]
    results = ThreadRanks(models, timeout, executor).run(feeds)
    names = [o.name for o in models[0].graph.output]
    return [dict(zip(names, outputs)) for outputs in results]


def a2a_inputs(rng, rank, size):
    counts = rng.integers(0, 4, size)
    if rank == 1:
        counts[:] = 0  # a rank that sends nothing
    data = rng.standard_normal((int(counts.sum()), 3)).astype(np.float32) + 100 * rank
    return {"data": data, "send_counts": counts.astype(np.int64)}


def reference_all_to_all(inputs, group):
    """Rank ``group[i]`` receives, in group order, the rows each member addressed to index i."""
    out = {}
    for i, rank in enumerate(group):
        rows, counts = [], []
        for member in group:
            sent = inputs[member]["send_counts"]
            start = int(sent[:i].sum())
            rows.append(inputs[member]["data"][start : start + sent[i]])
            counts.append(sent[i])
        out[rank] = (np.concatenate(rows), np.array(counts, np.int64))
    return out


@pytest.mark.parametrize("executor", ["split", "pyop", "lowered"])
@pytest.mark.parametrize("split", SPLITS)
def test_all_to_all_runs_inside_each_group(split, executor):
    groups = SPLITS[split]
    rng = np.random.default_rng(len(split))
    inputs = [a2a_inputs(rng, r, 2) for r in range(WORLD)]
    got = run_nodes("AllToAll", inputs, [{"group_ranks": group_of(groups, r)} for r in range(WORLD)], executor=executor)
    for group in groups:
        for rank, (rows, counts) in reference_all_to_all(inputs, group).items():
            np.testing.assert_array_equal(got[rank]["recv_data"], rows, err_msg=f"rank {rank}")
            np.testing.assert_array_equal(got[rank]["recv_counts"], counts, err_msg=f"rank {rank}")


def test_all_gather_over_groups_of_one_two_and_the_world():
    """Groups of unequal sizes split the world: [0, 3], [1], [2]."""
    groups = ([0, 3], [1], [2])
    xs = [np.arange(4, dtype=np.int32).reshape(2, 2) + 10 * r for r in range(WORLD)]
    got = run_nodes("AllGather", [{"x": x} for x in xs], [{"group_ranks": group_of(groups, r)} for r in range(WORLD)])
    for rank in range(WORLD):
        want = np.stack([xs[m] for m in group_of(groups, rank)])
        np.testing.assert_array_equal(got[rank]["y"], want, err_msg=f"rank {rank}")
    whole = run_nodes("AllGather", [{"x": x} for x in xs], [{"group_ranks": [0, 1, 2, 3]}] * WORLD)
    for rank in range(WORLD):
        np.testing.assert_array_equal(whole[rank]["y"], np.stack(xs))


def etp_models(counts_shape):
    """megatron-core's ETP pattern per rank: the expert-parallel AllToAll on the EP group
    ([0, 2] / [1, 3]), then an AllGather of what arrived over the expert-tensor-parallel
    group ([0, 1] / [2, 3]), then a world AllGather of the row counts (no attribute)."""
    models = []
    for rank in range(WORLD):
        nodes = [
            helper.make_node(
                "AllToAll", ["data", "send_counts"], ["recv", "recv_counts"], domain="cann.moe",
                group_ranks=group_of(SPLITS["interleaved"], rank),
            ),
            helper.make_node(
                "AllGather", ["recv"], ["gathered"], domain="cann.moe", group_ranks=group_of(SPLITS["halves"], rank)
            ),
            helper.make_node("AllGather", ["recv_counts"], ["all_counts"], domain="cann.moe"),
        ]  # fmt: skip
        graph = helper.make_graph(
            nodes,
            "etp",
            [
                helper.make_tensor_value_info("data", TensorProto.FLOAT, ["S", 3]),
                helper.make_tensor_value_info("send_counts", TensorProto.INT64, counts_shape),
            ],
            [
                helper.make_tensor_value_info("gathered", TensorProto.FLOAT, None),
                helper.make_tensor_value_info("all_counts", TensorProto.INT64, None),
            ],
        )
        models.append(
            helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann.moe", 1)])
        )
    return models


def etp_feeds():
    rng = np.random.default_rng(7)
    feeds = []
    for _ in range(WORLD):
        counts = np.full(2, 2, np.int64)  # equal rows, so the ETP members gather one shape
        feeds.append({"data": rng.standard_normal((4, 3)).astype(np.float32), "send_counts": counts})
    return feeds


def etp_reference(feeds):
    ep = reference_all_to_all(feeds, [0, 2]) | reference_all_to_all(feeds, [1, 3])
    out = []
    for rank in range(WORLD):
        gathered = np.stack([ep[m][0] for m in group_of(SPLITS["halves"], rank)])
        out.append((gathered, np.stack([ep[m][1] for m in range(WORLD)])))
    return out


def test_expert_tensor_parallel_gather_after_the_expert_parallel_all_to_all():
    feeds = etp_feeds()
    got = run_threads(etp_models([2]), feeds)
    for rank, (gathered, counts) in enumerate(etp_reference(feeds)):
        np.testing.assert_array_equal(got[rank][0], gathered, err_msg=f"rank {rank}")
        np.testing.assert_array_equal(got[rank][1], counts, err_msg=f"rank {rank}")


def moe_onnx_run(models, inputs, backend, *options) -> subprocess.CompletedProcess:
    """``moe-onnx run`` of 4 rank files (``{r}`` paths) on ``backend``."""
    command = ["run", str(models), "--ranks", str(WORLD), "--backend", backend, "--inputs", str(inputs)]
    return subprocess.run(
        [sys.executable, "-m", "moe_onnx.commands.cli", *command, *map(str, options)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.mpi
def test_mpi_ranks_split_into_the_same_groups(tmp_path):
    feeds = etp_feeds()
    for rank, (model, feed) in enumerate(zip(etp_models([2]), feeds)):
        onnx.save(model, tmp_path / f"rank{rank}.onnx")
        np.savez(tmp_path / f"in{rank}.npz", **feed)
    result = moe_onnx_run(tmp_path / "rank{r}.onnx", tmp_path / "in{r}.npz", "mpi", "--outputs", tmp_path / "out")
    assert result.returncode == 0, result.stdout + result.stderr
    for rank, (gathered, counts) in enumerate(etp_reference(feeds)):
        saved = np.load(tmp_path / "out" / f"rank{rank}.npz")
        np.testing.assert_array_equal(saved["gathered"], gathered, err_msg=f"rank {rank}")
        np.testing.assert_array_equal(saved["all_counts"], counts, err_msg=f"rank {rank}")


@pytest.mark.mpi
def test_mpi_ranks_that_disagree_on_their_groups_are_refused(tmp_path):
    models = etp_models([2])
    models[1].graph.node[0].attribute[0].ints[:] = [1, 2]  # rank 1's EP group: [1, 2], not [1, 3]
    for rank, (model, feed) in enumerate(zip(models, etp_feeds())):
        onnx.save(model, tmp_path / f"rank{rank}.onnx")
        np.savez(tmp_path / f"in{rank}.npz", **feed)
    result = moe_onnx_run(tmp_path / "rank{r}.onnx", tmp_path / "in{r}.npz", "mpi", "--timeout", "60")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "the ranks disagree on their groups: rank 1 runs on [1, 2], but rank 2 (a member of it)" in result.stderr


# --- refusals ------------------------------------------------------------------------------


def refused_on_every_rank(attrs, fragment, error=moe_onnx.MoeOpError, inputs=None):
    rng = np.random.default_rng(0)
    inputs = inputs or [a2a_inputs(rng, r, 2) for r in range(WORLD)]
    with pytest.raises(RankFailure) as failure:
        run_nodes("AllToAll", inputs, attrs, timeout=30)
    assert sorted(failure.value.errors) == list(range(WORLD))
    for rank, err in failure.value.errors.items():
        assert isinstance(err, error) and fragment in str(err), (rank, err)


@pytest.mark.parametrize(
    ("groups", "fragment"),
    [
        (([0, 1], [1, 2], [2, 3], [2, 3]), "rank 0 runs on [0, 1], but rank 1 (a member of it) on [1, 2]"),
        (([0, 1], [0, 1], [2, 4], [2, 4]), "rank 2's group_ranks [2, 4] name rank 4, but the world has 4 ranks"),
        (([0, 1], [0, 1], [0, 1], [2, 3]), "rank 2's group_ranks [0, 1] do not include rank 2"),
        (([0, 1], [0, 1], [2, 3], None), "rank 2 runs on [2, 3], but rank 3 (a member of it) on the whole world"),
    ],
)
def test_groups_that_do_not_split_the_world_are_refused_on_every_rank(groups, fragment):
    attrs = [{} if g is None else {"group_ranks": g} for g in groups]
    if None in groups:  # the whole world's AllToAll takes [4] counts
        rng = np.random.default_rng(1)
        inputs = [a2a_inputs(rng, r, 2) for r in range(3)] + [a2a_inputs(rng, 3, 4)]
        attrs[3] = {"group_ranks": [0, 1, 2, 3]}  # the world, named
        refused_on_every_rank(attrs, fragment.replace("the whole world", "[0, 1, 2, 3]"), inputs=inputs)
    else:
        refused_on_every_rank(attrs, fragment)


def test_a_group_collective_beside_a_world_one_is_a_collective_mismatch():
    rng = np.random.default_rng(2)
    inputs = [a2a_inputs(rng, r, 2) for r in range(3)] + [a2a_inputs(rng, 3, 4)]
    attrs = [{"group_ranks": [0, 1]}, {"group_ranks": [0, 1]}, {"group_ranks": [2, 3]}, {}]
    with pytest.raises(RankFailure) as failure:
        run_nodes("AllToAll", inputs, attrs, timeout=30)
    assert sorted(failure.value.errors) == list(range(WORLD))
    for err in failure.value.errors.values():
        assert isinstance(err, CollectiveMismatch), err
        assert "ranks 0, 1, 2 reached AllToAll on a group; rank 3 reached AllToAll" in str(err)


@pytest.mark.parametrize(
    ("op_type", "inputs", "attrs", "fragment"),
    [
        ("AllGather", {"x": np.ones(2, np.float32)}, {"group_ranks": [1, 0]}, "must be strictly increasing"),
        ("AllGather", {"x": np.ones(2, np.float32)}, {"group_ranks": []}, "must name at least one rank"),
        ("AllGather", {"x": np.ones(2, np.float32)}, {"group_ranks": [-1, 0]}, "must be >= 0"),
        (
            "AllToAll",
            {"data": np.ones((2, 1), np.float32), "send_counts": np.ones(2, np.int64)},
            {"group_ranks": [0, 1, 2]},
            "send_counts must be [N], N = the size of group_ranks [0, 1, 2]",
        ),
        (
            "MoeDistributeDispatch",
            {"x": np.ones((2, 4), np.float32), "expert_ids": np.zeros((2, 1), np.int32)},
            {"group_ep": "ep", "ep_world_size": 2, "ep_rank_id": 0, "moe_expert_num": 2, "group_ranks": [0, 1, 2]},
            "ep_world_size = 2 must equal the size of group_ranks [0, 1, 2] (3 ranks)",
        ),
    ],
)
def test_static_group_mistakes_are_refused_when_the_session_is_made(op_type, inputs, attrs, fragment):
    model = single_node_model(op_type, inputs, {k: v for k, v in attrs.items() if k != "group_ranks"})
    ranks = helper.make_attribute("group_ranks", attrs["group_ranks"], attr_type=onnx.AttributeProto.INTS)
    model.graph.node[0].attribute.append(ranks)
    with pytest.raises(moe_onnx.MoeOpError, match=re.escape(fragment)):
        moe_onnx.InferenceSession(model, context={"communicator": None})


def test_a_failed_rank_stops_the_ranks_waiting_in_a_group():
    world = ThreadWorld(2, timeout=30)
    group = world.group((0, 1))
    world.abort("rank 3 failed: something")
    with pytest.raises(PeerStopped, match="rank 0 stopped: rank 3 failed"):
        group.sync(0)
    late = world.group((0,))  # made after the failure: stopped from the start
    with pytest.raises(PeerStopped):
        late.sync(0)


# --- the MC2 ops on groups -----------------------------------------------------------------


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("split", SPLITS)
def test_dispatch_and_combine_run_inside_each_expert_parallel_group(split, v2):
    """DeepSpeed-style ep_size 2 in a world of 4: two EP groups, each its own MC2 world of 2,
    against the reference of that group alone; identity experts give sum_k w_k x exactly."""
    groups = SPLITS[split]
    rng = np.random.default_rng(3 + v2)
    ep = ref.Group(2, 4, 0, 1, v2)
    xs = [make_x(rng, 3, 8, np.float32) for _ in range(WORLD)]
    ids = [routing(rng, ep, 3, 2) for _ in range(WORLD)]
    weights = [rng.random((3, 2), np.float32) for _ in range(WORLD)]
    attrs = []
    for rank in range(WORLD):
        group = group_of(groups, rank)
        attrs.append(group_attrs(ep, group.index(rank), group_ranks=group, group_ep=f"ep{group[0]}"))
    dispatch = "MoeDistributeDispatchV2" if v2 else "MoeDistributeDispatch"
    got = run_nodes(
        dispatch, [{"x": xs[r], "expert_ids": ids[r], "expert_scales": weights[r]} for r in range(WORLD)], attrs
    )
    index = "assist_info_for_combine" if v2 else "expand_idx"
    for group in groups:
        want = ref.dispatch(ep, [xs[m] for m in group], [ids[m] for m in group], None, [weights[m] for m in group])
        for i, rank in enumerate(group):
            for name in ("expand_x", index, "expert_token_nums", "ep_recv_count"):
                assert np.array_equal(got[rank][name], want[i][name]), (rank, name)
    combine = "MoeDistributeCombineV2" if v2 else "MoeDistributeCombine"
    inputs = [
        {
            "expand_x": got[r]["expand_x"],  # identity experts
            "expert_ids": ids[r],
            index: got[r][index],
            "ep_send_counts": got[r]["ep_recv_count"],
            "expert_scales": weights[r],
        }
        for r in range(WORLD)
    ]
    back = run_nodes(combine, inputs, attrs)
    for rank in range(WORLD):
        want = weighted_sum(xs[rank], ids[rank], weights[rank], None, ep.E)
        assert np.array_equal(back[rank]["x"].view(np.uint8), want.view(np.uint8)), rank


def test_dispatch_with_ep_rank_id_of_the_world_is_refused_on_the_group():
    """ep_rank_id is the rank in the EP group (vLLM-Ascend passes the group's rank)."""
    rng = np.random.default_rng(5)
    ep = ref.Group(2, 4, 0, 1, False)
    inputs = [{"x": make_x(rng, 2, 8, np.float32), "expert_ids": routing(rng, ep, 2, 1)} for _ in range(WORLD)]
    attrs = [group_attrs(ep, r % 2, group_ranks=group_of(SPLITS["halves"], r)) for r in range(WORLD)]
    attrs[3]["ep_rank_id"] = 0  # rank 3 is rank 1 of [2, 3]
    with pytest.raises(RankFailure) as failure:
        run_nodes("MoeDistributeDispatch", inputs, attrs, timeout=30)
    for rank in (2, 3):
        assert "ep_rank_id = 0 but this is rank 1 of the communicator" in str(failure.value.errors[rank])
    for rank in (0, 1):  # their group ran; they stop at the end of the run, told why
        assert isinstance(failure.value.errors[rank], PeerStopped), failure.value.errors[rank]


def test_alltoallv_grouped_matmuls_run_inside_each_group():
    groups = SPLITS["interleaved"]
    rng = np.random.default_rng(6)
    experts, hidden, out = 2, 8, 5
    lists = {group[0]: count_lists(rng, 2, experts) for group in groups}
    xs, attrs = [], []
    for rank in range(WORLD):
        group = group_of(groups, rank)
        sends, recvs = lists[group[0]]
        i = group.index(rank)
        xs.append(rng.standard_normal((sum(sends[i]), hidden)).astype(np.float32))
        attrs.append(
            dict(group="ep", ep_world_size=2, send_counts=sends[i], recv_counts=recvs[i], group_ranks=group)
            | {"permute_out_flag": 1}
        )
    w = rng.standard_normal((experts, hidden, out)).astype(np.float32)
    got = run_nodes("AlltoAllvGroupedMatMul", [{"gmm_x": x, "gmm_weight": w} for x in xs], attrs)
    for group in groups:
        sends, _ = lists[group[0]]
        for i, rank in enumerate(group):
            permute = reference_permute([xs[m] for m in group], sends, i, 2, experts)
            assert np.array_equal(got[rank]["permute_out"], permute), rank
    eye = np.stack([np.eye(hidden, dtype=np.float32)] * experts)
    back_attrs = [
        {**a, "send_counts": a["recv_counts"], "recv_counts": a["send_counts"]}
        for a in ({k: v for k, v in a.items() if k != "permute_out_flag"} for a in attrs)
    ]
    back = run_nodes(
        "GroupedMatMulAlltoAllv", [{"gmm_x": g["permute_out"], "gmm_weight": eye} for g in got], back_attrs
    )
    for rank in range(WORLD):
        assert np.array_equal(back[rank]["y"], xs[rank]), rank


def test_the_converters_mirror_world_runs_a_group_collective():
    """The mirror world (every rank holds one batch) stands in for a group as for the world:
    a group of 2 in a world of 4 receives 2 copies of what this rank sends to its place."""
    from moe_onnx.converters.world import MirrorCommunicator

    data, counts = np.arange(6, dtype=np.float32).reshape(3, 2), np.array([1, 2], np.int64)
    model = single_node_model("AllToAll", {"data": data, "send_counts": counts}, {"group_ranks": [2, 3]})
    session = moe_onnx.InferenceSession(model, context={"communicator": MirrorCommunicator(3, 4)})
    received, recv_counts = session.run(None, {"data": data, "send_counts": counts})
    np.testing.assert_array_equal(received, np.concatenate([data[1:], data[1:]]))  # rank 3 is the group's rank 1
    np.testing.assert_array_equal(recv_counts, [2, 2])


def test_a_group_names_world_ranks_when_a_member_does_not_arrive():
    """Group [2, 3] of a world of 4: rank 2 waits alone; the message names ranks 2 and 3 (not
    the group's 0 and 1)."""
    group = ThreadWorld(4, timeout=0.2).group((2, 3))
    with pytest.raises(RuntimeError, match="rank 2 stopped: rank 3 did not reach AllToAll within 0.2 s"):
        group.sync(0, "AllToAll")
