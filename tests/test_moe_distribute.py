"""cann.moe::MoeDistributeDispatch(V2) / MoeDistributeCombine(V2) on thread ranks (SPEC-mc2
1.19-1.23): every output against tests/mc2_reference.py (written from the spec), dispatch then
combine with identity experts, quantisation, masks, shared and special experts, and hostile
inputs refused by name on every rank without a hang."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import moe_onnx
from moe_onnx.builders import single_node_model
from moe_onnx.ranks import RankFailure, run_threads
from tests import mc2_reference as ref

DISPATCH_OUTPUTS = {
    False: ["expand_x", "dynamic_scales", "expand_idx", "expert_token_nums", "ep_recv_count", "tp_recv_count"],
    True: ["expand_x", "dynamic_scales", "assist_info_for_combine", "expert_token_nums", "ep_recv_count"],
}


def run_ranks(op_type, inputs, attrs, timeout=60.0):
    """Run one node per rank on threads: ``inputs[r]``, ``attrs[r]``; returns outputs by name."""
    models = [
        single_node_model(op_type, i, a, node_name=f"{op_type}_r{r}") for r, (i, a) in enumerate(zip(inputs, attrs))
    ]
    feeds = [{k: v for k, v in i.items() if v is not None} for i in inputs]
    results = run_threads(models, feeds, timeout=timeout)
    names = [o.name for o in models[0].graph.output]
    return [dict(zip(names, outputs)) for outputs in results]


def group_attrs(group: ref.Group, rank, **extra):
    attrs = dict(
        group_ep="ep",
        ep_world_size=group.W,
        ep_rank_id=rank,
        moe_expert_num=group.E,
        shared_expert_rank_num=group.S,
        global_bs=group.global_bs,
    )
    if group.v2:
        attrs["shared_expert_num"] = group.sn if group.S else 1
        if group.Z or group.C or group.N:
            attrs.update(zero_expert_num=group.Z, copy_expert_num=group.C, const_expert_num=group.N)
    return {**attrs, **extra}


def routing(rng, group, rows, top_k, special=0):
    """Distinct expert ids per token over ``[0, E + special)``."""
    return np.stack([rng.permutation(group.E + special)[:top_k] for _ in range(rows)]).astype(np.int32)


def make_x(rng, rows, hidden, dtype):
    return rng.standard_normal((rows, hidden)).astype(np.float32).astype(dtype)


def dispatch_and_check(group, xs, ids, masks=None, weights=None, quant=False, scales=None, token_type=1):
    op = "MoeDistributeDispatchV2" if group.v2 else "MoeDistributeDispatch"
    inputs = [
        {
            "x": xs[r],
            "expert_ids": ids[r],
            "scales": scales,
            "x_active_mask": None if masks is None else masks[r],
            "expert_scales": None if weights is None else weights[r],
        }
        for r in range(group.W)
    ]
    attrs = [
        group_attrs(group, r, quant_mode=2 if quant else 0, expert_token_nums_type=token_type) for r in range(group.W)
    ]
    got = run_ranks(op, inputs, attrs)
    want = ref.dispatch(group, xs, ids, masks, weights, quant, scales, token_type)
    for r in range(group.W):
        for name in DISPATCH_OUTPUTS[group.v2] + (["expand_scales"] if weights is not None else []):
            if name == "tp_recv_count":
                assert got[r][name].shape == (0,)
                continue
            a, b = got[r][name], want[r][name]
            assert a.dtype == b.dtype and a.shape == b.shape, (r, name, a.shape, b.shape)
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (r, name)
    return got, want


def combine(group, expand_xs, ids, got, weights, masks=None, **extra_inputs):
    op = "MoeDistributeCombineV2" if group.v2 else "MoeDistributeCombine"
    index = "assist_info_for_combine" if group.v2 else "expand_idx"
    inputs = [
        {
            "expand_x": expand_xs[r],
            "expert_ids": ids[r],
            index: got[r][index],
            "ep_send_counts": got[r]["ep_recv_count"],
            "expert_scales": weights[r],
            "x_active_mask": None if masks is None else masks[r],
            **{k: v[r] for k, v in extra_inputs.items()},
        }
        for r in range(group.W)
    ]
    return [out["x"] for out in run_ranks(op, inputs, [group_attrs(group, r) for r in range(group.W)])]


def weighted_sum(x, ids, weights, masks, experts, shared_rows=0):
    """Identity experts: ``sum_j w_j * x`` (+ x once per shared expert), f32 in slot order."""
    out = np.zeros(x.shape, x.dtype)
    for t in range(len(x)):
        if not ref.token_active(masks, t):
            continue
        acc = np.zeros(x.shape[1], np.float32)
        for j in range(ids.shape[1]):
            if ref.active(masks, t, j) and ids[t, j] < experts:
                acc = (acc + x[t].astype(np.float32) * weights[t, j]).astype(np.float32)
        for _ in range(shared_rows):
            acc = (acc + x[t].astype(np.float32)).astype(np.float32)
        out[t] = acc.astype(x.dtype)
    return out


CASES = [  # (v2, W, S, shared experts, E, K, rows)
    (False, 2, 0, 1, 4, 2, 5),
    (False, 4, 0, 1, 8, 3, 4),
    (False, 4, 1, 1, 6, 2, 5),
    (False, 4, 2, 1, 4, 3, 3),
    (True, 2, 0, 1, 4, 2, 5),
    (True, 4, 0, 1, 8, 4, 3),
    (True, 4, 1, 1, 3, 2, 4),
    (True, 4, 2, 2, 4, 2, 3),
]


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
@pytest.mark.parametrize(("v2", "world", "shared_ranks", "shared_num", "experts", "top_k", "rows"), CASES)
def test_layout_and_identity_round_trip(dtype, v2, world, shared_ranks, shared_num, experts, top_k, rows):
    rng = np.random.default_rng(world * 10 + shared_ranks + 100 * v2)
    group = ref.Group(world, experts, shared_ranks, shared_num, v2)
    xs = [make_x(rng, rows, 16, dtype) for _ in range(world)]
    ids = [routing(rng, group, rows, top_k) for _ in range(world)]
    weights = [rng.random((rows, top_k), np.float32) for _ in range(world)]
    got, want = dispatch_and_check(group, xs, ids, weights=weights, token_type=int(v2))
    expand_xs = [g["expand_x"] for g in got]  # identity experts
    x = combine(group, expand_xs, ids, got, weights)
    reference = ref.combine(group, expand_xs, ids, want, weights)
    shared = group.sn if v2 else int(shared_ranks > 0)
    for r in range(world):
        assert np.array_equal(x[r].view(np.uint8), reference[r].view(np.uint8))
        assert np.array_equal(
            x[r].view(np.uint8), weighted_sum(xs[r], ids[r], weights[r], None, experts, shared).view(np.uint8)
        )


@pytest.mark.parametrize("v2", [False, True])
def test_masked_tokens_and_a_rank_that_sends_nothing(v2):
    """A 1-D prefix mask (rank 1 masks every token: it sends nothing and gets zeros back)."""
    rng = np.random.default_rng(7)
    group = ref.Group(4, 8, 0, 1, v2)
    rows, top_k = 6, 2
    xs = [make_x(rng, rows, 8, np.float16) for _ in range(4)]
    ids = [routing(rng, group, rows, top_k) for _ in range(4)]
    masks = [np.arange(rows) < n for n in (4, 0, 6, 1)]
    weights = [rng.random((rows, top_k), np.float32) for _ in range(4)]
    got, want = dispatch_and_check(group, xs, ids, masks=masks, weights=weights)
    x = combine(group, [g["expand_x"] for g in got], ids, got, weights, masks=masks)
    for r in range(4):
        assert np.array_equal(x[r], weighted_sum(xs[r], ids[r], weights[r], masks[r], group.E))
    assert not x[1].any()


def test_v2_slot_mask_and_special_experts():
    """2-D mask, zero / copy / constant experts (not sent, computed by the combine), shared_expert_x."""
    rng = np.random.default_rng(3)
    group = ref.Group(2, 4, 0, 1, True, special=(1, 1, 2))
    rows, top_k, hidden = 5, 3, 8
    xs = [make_x(rng, rows, hidden, ml_dtypes.bfloat16) for _ in range(2)]
    ids = [routing(rng, group, rows, top_k, special=4) for _ in range(2)]
    masks = [rng.random((rows, top_k)) < 0.7 for _ in range(2)]
    masks[0][2] = False  # a token with no active slot: 0 out
    weights = [rng.random((rows, top_k), np.float32) for _ in range(2)]
    got, want = dispatch_and_check(group, xs, ids, masks=masks, weights=weights)
    expand_xs = [(g["expand_x"].astype(np.float32) * 2).astype(ml_dtypes.bfloat16) for g in got]
    const = (
        rng.random(2).astype(np.float32),
        rng.random(2).astype(np.float32),
        make_x(rng, 2, hidden, ml_dtypes.bfloat16),
    )
    shared_x = [make_x(rng, rows, hidden, ml_dtypes.bfloat16) for _ in range(2)]
    x = combine(
        group,
        expand_xs,
        ids,
        got,
        weights,
        masks=masks,
        shared_expert_x=shared_x,
        ori_x=xs,
        const_expert_alpha_1=[const[0]] * 2,
        const_expert_alpha_2=[const[1]] * 2,
        const_expert_v=[const[2]] * 2,
    )
    reference = ref.combine(group, expand_xs, ids, want, weights, masks, shared_x, xs, const)
    for r in range(2):
        assert np.array_equal(x[r].view(np.uint16), reference[r].view(np.uint16))
    assert not x[0][2].view(np.uint16).any()


@pytest.mark.parametrize("v2", [False, True])
def test_quant_mode_2_with_smooth_scales(v2):
    rng = np.random.default_rng(11)
    group = ref.Group(4, 6, 1, 1, v2)
    rows, top_k = 4, 2
    xs = [make_x(rng, rows, 32, np.float16) for _ in range(4)]
    xs[2][1] = 0  # an all-zero row: q = 0, scale 0
    ids = [routing(rng, group, rows, top_k) for _ in range(4)]
    scales = rng.random((group.E + 1, 32)).astype(np.float32) + 0.5
    got, _ = dispatch_and_check(group, xs, ids, quant=True, scales=scales)
    assert got[1]["expand_x"].dtype == np.int8 and np.abs(got[1]["expand_x"]).max() == 127


def test_uneven_batches_need_global_bs():
    rng = np.random.default_rng(5)
    group = ref.Group(2, 4, 0, 1, False, global_bs=8)
    ids = [routing(rng, group, rows, 2) for rows in (3, 4)]
    xs = [make_x(rng, rows, 8, np.float32) for rows in (3, 4)]
    got, _ = dispatch_and_check(group, xs, ids)
    assert got[0]["expand_x"].shape == (8 * 2, 8)
    with pytest.raises(RankFailure) as failure:
        dispatch_and_check(ref.Group(2, 4, 0, 1, False), xs, ids)
    assert_every_rank(failure, "MoeDistributeDispatch", "global_bs = 0")


def assert_every_rank(failure, op_type, fragment, ranks=None):
    errors = failure.value.errors
    for r in ranks or sorted(errors):
        error = errors[r]
        assert isinstance(error, moe_onnx.MoeOpError), (r, error)
        assert error.op_type == op_type and fragment in str(error), (r, str(error))
    assert len(errors) == (len(ranks) if ranks else len(errors))


def hostile_dispatch(v2=False, world=2, **change):
    rng = np.random.default_rng(1)
    group = ref.Group(world, 4, 0, 1, v2)
    ids = [routing(rng, group, 3, 2) for _ in range(world)]
    xs = [make_x(rng, 3, 8, np.float32) for _ in range(world)]
    inputs = [{"x": xs[r], "expert_ids": ids[r]} for r in range(world)]
    attrs = [group_attrs(group, r) for r in range(world)]
    for (r, key), value in change.get("inputs", {}).items():
        inputs[r][key] = value
    for (r, key), value in change.get("attrs", {}).items():
        attrs[r][key] = value
    op = "MoeDistributeDispatchV2" if v2 else "MoeDistributeDispatch"
    with pytest.raises(RankFailure) as failure:
        run_ranks(op, inputs, attrs, timeout=20)
    return failure


@pytest.mark.parametrize("v2", [False, True])
def test_out_of_range_id_on_one_rank_is_refused_on_every_rank(v2):
    bad = np.array([[0, 1], [4, 2], [3, 0]], np.int32)
    failure = hostile_dispatch(v2, inputs={(1, "expert_ids"): bad})
    op = "MoeDistributeDispatchV2" if v2 else "MoeDistributeDispatch"
    assert_every_rank(failure, op, "rank 1: expert_ids[1, 0] = 4 is outside [0, 4)", ranks=[0, 1])


def test_repeated_expert_and_broken_mask_are_refused():
    failure = hostile_dispatch(inputs={(0, "expert_ids"): np.array([[1, 1], [0, 2], [3, 0]], np.int32)})
    assert_every_rank(failure, "MoeDistributeDispatch", "names one expert twice", ranks=[0, 1])
    failure = hostile_dispatch(inputs={(1, "x_active_mask"): np.array([True, False, True])})
    assert_every_rank(failure, "MoeDistributeDispatch", "prefix of trues", ranks=[0, 1])


def test_world_size_mismatches_are_refused_on_every_rank():
    failure = hostile_dispatch(attrs={(0, "ep_world_size"): 4, (1, "ep_world_size"): 4})
    assert_every_rank(failure, "MoeDistributeDispatch", "the communicator has 2 ranks", ranks=[0, 1])
    failure = hostile_dispatch(world=4, attrs={(3, "moe_expert_num"): 8})
    assert_every_rank(failure, "MoeDistributeDispatch", "same moe_expert_num", ranks=[0, 1, 2, 3])
    failure = hostile_dispatch(attrs={(1, "ep_rank_id"): 0})
    assert_every_rank(failure, "MoeDistributeDispatch", "ep_rank_id = 0 but this is rank 1", ranks=[0, 1])


@pytest.mark.parametrize("v2", [False, True])
def test_combine_counts_that_do_not_add_up_are_refused_on_every_rank(v2):
    rng = np.random.default_rng(2)
    group = ref.Group(2, 4, 0, 1, v2)
    ids = [routing(rng, group, 3, 2) for _ in range(2)]
    xs = [make_x(rng, 3, 8, np.float32) for _ in range(2)]
    weights = [rng.random((3, 2), np.float32) for _ in range(2)]
    got, _ = dispatch_and_check(group, xs, ids)
    op = "MoeDistributeCombineV2" if v2 else "MoeDistributeCombine"
    # rank 1 returns one row fewer than its peers' slots name
    got[1]["ep_recv_count"] = np.maximum(got[1]["ep_recv_count"] - 1, 0).astype(np.int32)
    with pytest.raises(RankFailure) as failure:
        combine(group, [g["expand_x"] for g in got], ids, got, weights)
    assert_every_rank(failure, op, "rank" if v2 else "do not match the dispatch", ranks=[0, 1])
    if v2:  # the owners find a missing row after the exchange and share it
        assert "no row came back" in str(failure.value.errors[0])
    # a combine whose world disagrees with its dispatch's
    got2, _ = dispatch_and_check(group, xs, ids)
    index = "assist_info_for_combine" if v2 else "expand_idx"
    inputs = [
        {
            "expand_x": got2[r]["expand_x"],
            "expert_ids": ids[r],
            index: got2[r][index],
            "ep_send_counts": got2[r]["ep_recv_count"],
            "expert_scales": weights[r],
        }
        for r in range(2)
    ]
    attrs = [group_attrs(group, r) for r in range(2)]
    attrs[0]["group_ep"] = "other"
    with pytest.raises(RankFailure) as failure:
        run_ranks(op, inputs, attrs, timeout=20)
    assert_every_rank(failure, op, "same group_ep", ranks=[0, 1])


def test_v1_expand_idx_outside_its_block():
    rng = np.random.default_rng(4)
    group = ref.Group(2, 4, 0, 1, False)
    ids = [routing(rng, group, 3, 2) for _ in range(2)]
    xs = [make_x(rng, 3, 8, np.float32) for _ in range(2)]
    weights = [rng.random((3, 2), np.float32) for _ in range(2)]
    got, _ = dispatch_and_check(group, xs, ids)
    got[0]["expand_idx"] = got[0]["expand_idx"] + 5
    with pytest.raises(RankFailure) as failure:
        combine(group, [g["expand_x"] for g in got], ids, got, weights)
    assert_every_rank(failure, "MoeDistributeCombine", "rank 0: expand_idx[0]", ranks=[0, 1])


def test_v2_assist_info_naming_a_foreign_slot():
    rng = np.random.default_rng(6)
    group = ref.Group(2, 4, 0, 1, True)
    ids = [routing(rng, group, 3, 2) for _ in range(2)]
    xs = [make_x(rng, 3, 8, np.float32) for _ in range(2)]
    weights = [rng.random((3, 2), np.float32) for _ in range(2)]
    got, _ = dispatch_and_check(group, xs, ids)
    assist = got[1]["assist_info_for_combine"].copy()
    assist[1] = 7  # row 0's token: outside the owner's 3 tokens
    got[1]["assist_info_for_combine"] = assist
    with pytest.raises(RankFailure) as failure:
        combine(group, [g["expand_x"] for g in got], ids, got, weights)
    assert_every_rank(failure, "MoeDistributeCombineV2", "(token 7", ranks=[0, 1])


@pytest.mark.parametrize(
    ("attrs", "code", "fragment"),
    [
        ({"quant_mode": 1}, 161002, "quant_mode = 1"),
        ({"quant_mode": 3}, 161002, "quant_mode = 3"),
        ({"tp_world_size": 2}, 161002, "tp_world_size = 2"),
        ({"moe_expert_num": 5}, 561002, "divide evenly"),
        ({"shared_expert_rank_num": 1, "shared_expert_num": 2}, 561002, "only value V1 supports"),
        ({"tp_rank_id": 1}, 561002, "tp_rank_id"),
        ({"global_bs": 3}, 561002, "multiple of W"),
    ],
)
def test_static_refusals_name_the_rule(attrs, code, fragment):
    x, ids = np.zeros((3, 8), np.float16), np.zeros((3, 2), np.int32)
    base = dict(group_ep="ep", ep_world_size=2, ep_rank_id=0, moe_expert_num=4)
    with pytest.raises(moe_onnx.MoeOpError) as error:
        moe_onnx.OPS["MoeDistributeDispatch"](x, ids, **{**base, **attrs})
    assert error.value.code == code and fragment in str(error.value) and "MoeDistributeDispatch" in str(error.value)


def test_refused_combine_inputs_and_scales_without_quant():
    base = dict(group_ep="ep", ep_world_size=2, ep_rank_id=0, moe_expert_num=4)
    x, ids = np.zeros((3, 8), np.float16), np.zeros((3, 2), np.int32)
    with pytest.raises(moe_onnx.MoeOpError, match="read only by quant_mode 2"):
        moe_onnx.OPS["MoeDistributeDispatch"](x, ids, np.ones((4, 8), np.float32), **base)
    combine_op = moe_onnx.OPS["MoeDistributeCombine"]
    args = (x, ids, np.zeros(6, np.int32), np.zeros(4, np.int32), np.zeros((3, 2), np.float32))
    with pytest.raises(moe_onnx.MoeOpError, match="activation_scale") as error:
        combine_op(*args, None, None, np.ones(3, np.float32), **base)
    assert error.value.code == 161002
    with pytest.raises(moe_onnx.MoeOpError, match="comm_quant_mode = 2"):
        combine_op(*args, **base, comm_quant_mode=2)
    with pytest.raises(moe_onnx.MoeOpError, match="elastic_info"):
        moe_onnx.OPS["MoeDistributeDispatchV2"](x, ids, None, None, None, np.zeros(4, np.int32), **base)


def test_a_rank_that_never_joins_stops_its_peers():
    """Rank 1's model has no dispatch: rank 0 learns it at the collective, within the deadline."""
    from tests.support import all_to_all_model  # noqa: F401 - the plain model kind used elsewhere

    rng = np.random.default_rng(8)
    group = ref.Group(2, 4, 0, 1, False)
    ids = routing(rng, group, 3, 2)
    model = single_node_model(
        "MoeDistributeDispatch", {"x": make_x(rng, 3, 8, np.float32), "expert_ids": ids}, group_attrs(group, 0)
    )
    other = single_node_model("AllGather", {"x": np.zeros(2, np.float32)})
    feeds = [{"x": make_x(rng, 3, 8, np.float32), "expert_ids": ids}, {"x": np.zeros(2, np.float32)}]
    with pytest.raises(RankFailure) as failure:
        run_threads([model, other], feeds, timeout=20)
    assert "reached MoeDistributeDispatch" in str(failure.value.errors[0])


def test_target_check_knows_the_tiling_limits():
    """SPEC-mc2 1.26 (c) through each OpDef's npu_limits (what `moe-onnx check --target` runs)."""
    from moe_onnx.custom_ops.targets import check
    from moe_onnx.custom_ops.tensor_info import TensorInfo

    attrs = dict(group_ep="ep", ep_world_size=8, ep_rank_id=0, moe_expert_num=64)
    fits = {"x": TensorInfo("bfloat16", (16, 7168)), "expert_ids": TensorInfo("int32", (16, 8))}
    assert check("MoeDistributeDispatch", fits, attrs, "ascend910_93") == []
    wide = {"x": TensorInfo("bfloat16", (16, 4096)), "expert_ids": TensorInfo("int32", (16, 9))}
    found = check("MoeDistributeDispatch", wide, {**attrs, "ep_world_size": 4}, "ascend910_93")
    assert any("H = 4096 must be 7168" in f for f in found) and any("K = 9 exceeds 8" in f for f in found)
    assert any("W = 4" in f for f in found)
    assert check("MoeDistributeDispatchV2", wide, {**attrs, "ep_world_size": 4}, "ascend910_93") == []
    shared = check(
        "MoeDistributeDispatchV2", fits, {**attrs, "shared_expert_rank_num": 1, "moe_expert_num": 7}, "ascend910b"
    )
    assert any("shared experts are not supported on A2" in f for f in shared)
    combine = {
        "expand_x": TensorInfo("float32", (None, 7168)),
        "expert_ids": TensorInfo("int32", (16, 8)),
        "expand_idx": TensorInfo("int32", (128,)),
        "ep_send_counts": TensorInfo("int32", (64,)),
        "expert_scales": TensorInfo("float32", (16, 8)),
    }
    assert any("float32" in f for f in check("MoeDistributeCombine", combine, attrs, "ascend910_93"))
    gmm = {"gmm_x": TensorInfo("float16", (64, 1024)), "gmm_weight": TensorInfo("float16", (2, 1024, 512))}
    gmm_attrs = dict(group="ep", ep_world_size=2, send_counts=[16] * 4, recv_counts=[16] * 4)
    found = check("AlltoAllvGroupedMatMul", gmm, gmm_attrs, "ascend910_93")
    assert any("W = 2" in f for f in found) and any("[2 MB, 100 MB]" in f for f in found)
    assert "Atlas A3" in check("GroupedMatMulAlltoAllv", gmm, gmm_attrs, "ascend910b")[0]


@pytest.mark.mpi
def test_dispatch_and_combine_on_mpi_ranks_equal_threads(tmp_path):
    """The V2 pair as one model per rank under `moe-onnx run --backend mpi`: threads' bits."""
    import subprocess
    import sys

    import onnx
    from onnx import helper

    rng = np.random.default_rng(9)
    group = ref.Group(2, 4, 0, 1, True)
    feeds = []
    for r in range(2):
        model = single_node_model(
            "MoeDistributeDispatchV2",
            {"x": make_x(rng, 3, 8, np.float32), "expert_ids": routing(rng, group, 3, 2)},
            group_attrs(group, r),
        )
        graph = model.graph
        dispatch = graph.node[0]
        combine = helper.make_node(
            "MoeDistributeCombineV2",
            [dispatch.output[0], "expert_ids", dispatch.output[2], dispatch.output[4], "w"],
            ["y"],
            domain="cann.moe",
            name="combine",
            **group_attrs(group, r),
        )
        graph.node.append(combine)
        graph.input.append(helper.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [3, 2]))
        del graph.output[:]
        graph.output.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None))
        onnx.save(model, tmp_path / f"rank{r}.onnx")
        feed = {
            "x": make_x(rng, 3, 8, np.float32),
            "expert_ids": routing(rng, group, 3, 2),
            "w": rng.random((3, 2), np.float32),
        }
        np.savez(tmp_path / f"in{r}.npz", **feed)
        feeds.append(feed)
    want = run_threads([onnx.load(tmp_path / f"rank{r}.onnx") for r in range(2)], feeds)
    result = subprocess.run(
        [sys.executable, "-m", "moe_onnx.commands.cli", "run", str(tmp_path / "rank{r}.onnx"), "--ranks", "2"]
        + ["--backend", "mpi", "--inputs", str(tmp_path / "in{r}.npz"), "--outputs", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for r in range(2):
        assert np.array_equal(np.load(tmp_path / "out" / f"rank{r}.npz")["y"], want[r][0])
        expected = weighted_sum(feeds[r]["x"], feeds[r]["expert_ids"], feeds[r]["w"], None, group.E)
        assert np.array_equal(want[r][0], expected)
