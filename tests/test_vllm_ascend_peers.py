"""vLLM-Ascend's unquantised fused-MoE path (v0.11.0: ``select_experts`` and the AllGather and
AllToAll(V) comm methods' ``fused_experts``; v0.9.1: ``fused_experts`` and
``fused_experts_with_all2all``) run unchanged on 2 gloo ranks after ``install_stand_ins()``
(only vLLM's engine stubbed: tests/vllm_ascend.py), float32 and bfloat16, against a dense
pure-torch MoE.

Marked ``peers``: deselected by default; vLLM-Ascend's files are copied at test time from
``$VLLM_ASCEND_<TAG>`` (a checkout) or the release tag of ``$VLLM_ASCEND_GIT`` (a bare clone;
default the workplace's mirror). Without them the test fails saying so (it is never skipped).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.peers

TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}
WORLD = 2


@pytest.mark.parametrize("tag", ["v0.11.0", "v0.9.1"])
def test_vllm_ascend_fused_moe_matches_the_dense_moe(tmp_path, tag):
    from tests.cann_recipes import SourceMissing
    from tests.moe_chain import Config
    from tests.torch_ranks import start_ranks
    from tests.vllm_ascend import CASES, copy_release, worker

    source_dir = tmp_path / "vllm_ascend"
    try:
        copy_release(source_dir, tag)
    except SourceMissing as err:
        pytest.fail(f"the peers test needs vLLM-Ascend's files: {err}")
    config = Config(ranks=WORLD)
    start_ranks(worker, WORLD, config, str(source_dir), tag, str(tmp_path), directory=str(tmp_path))
    for rank in range(WORLD):
        failures = (tmp_path / f"failures{rank}.txt").read_text()
        assert not failures, failures
        with np.load(tmp_path / f"errors{rank}.npz") as saved:
            errors = {name: saved[name].item() for name in saved.files}
        for case in CASES[tag]:
            for dtype, tolerance in TOLERANCE.items():
                for tokens in config.batches:
                    assert errors[f"{case}_{dtype}_{tokens}"] <= tolerance, (rank, case, dtype, tokens, errors)
        print(
            f"rank {rank}: worst relative errors",
            {
                k: max(v for n, v in errors.items() if n.startswith(k))
                for k in (f"{c}_{d}" for c in CASES[tag] for d in TOLERANCE)
            },
        )


def _mc2_errors(tmp_path, tag: str, world: int, cases: list, batches: tuple[int, ...], ep_groups=None) -> list[dict]:
    """Run vLLM-Ascend ``tag``'s MC2 path on ``world`` gloo ranks (tests/vllm_ascend.py
    ``mc2_worker``; expert parallelism over the world, or over each of ``ep_groups``); each
    rank's errors, after asserting that no rank raised and that each run called torch_npu's
    MC2 names as its case says (:func:`_assert_call_pattern`) on its group's name."""
    from tests.cann_recipes import SourceMissing
    from tests.moe_chain import Config
    from tests.torch_ranks import start_ranks
    from tests.vllm_ascend import copy_release, mc2_worker

    source_dir = tmp_path / "vllm_ascend"
    try:
        copy_release(source_dir, tag)
    except SourceMissing as err:
        pytest.fail(f"the peers test needs vLLM-Ascend's files: {err}")
    groups = ep_groups or [list(range(world))]
    config = Config(ranks=len(groups[0]), batches=batches)
    args = (config, str(source_dir), tag, str(tmp_path), cases, ep_groups)
    start_ranks(mc2_worker, world, *args, directory=str(tmp_path))
    out = []
    for rank in range(world):
        failures = (tmp_path / f"failures{rank}.txt").read_text()
        assert not failures, failures
        with np.load(tmp_path / f"errors{rank}.npz") as saved:
            out.append({name: saved[name].item() for name in saved.files})
        calls = json.loads((tmp_path / f"calls{rank}.json").read_text())
        assert len(calls) == len(cases) * len(TOLERANCE) * len(batches), sorted(calls)
        members = next(g for g in groups if rank in g)
        for key, made in calls.items():
            _assert_call_pattern(tag, key, made, members.index(rank), len(members))
            assert {call[-1] for call in made} == {"hccl_" + "_".join(map(str, members))}, (key, made)
    return out


def _assert_call_pattern(tag: str, key: str, made: list, rank: int, world: int) -> None:
    """One dispatch then one combine, with the keywords the release's dispatcher passes on the
    case's platform: V2 names iff torch_npu has them; A3 (or v0.9.1's torchair graph mode):
    ``group_tp`` / ``tp_world_size`` / ``tp_rank_id`` (and the combine's ``tp_send_counts``); A3
    with V2: ``x_active_mask``, which masks a token on a rank whose batch was padded (every
    rank but the last: rank r has ``tokens + r``); hierarchical: the dispatch's
    ``expert_scales``; ``global_bs`` 0 (v0.11.0), the padded batch x W (v0.9.1) or the
    scheduler's ``max_num_seqs`` x W (v0.13.0, which passes no mask any more). ``key`` is
    ``{case}_{routed|shared}_{dtype}_{tokens}`` (tests/vllm_ascend.py MC2_CASES)."""
    from tests.vllm_ascend import MAX_NUM_SEQS, MC2_CASES, AscendSocVersion

    cases = MC2_CASES[tag]
    name = max((name for name in cases if key.startswith(name + "_")), key=len)
    case, tokens = cases[name], int(key.rsplit("_", 1)[1])
    suffix = "_v2" if case.v2 else ""
    (dispatch, dispatch_args, dispatch_masks, dispatch_bs, _), (combine, combine_args, combine_masks, combine_bs, _) = (
        made
    )
    assert (dispatch, combine) == (f"npu_moe_distribute_dispatch{suffix}", f"npu_moe_distribute_combine{suffix}"), key
    a3 = case.soc == AscendSocVersion.A3
    tp = a3 or case.torchair
    masked = a3 and case.v2 and tag != "v0.13.0"
    for args in (dispatch_args, combine_args):
        assert {"group_ep", "ep_world_size", "ep_rank_id", "moe_expert_num", "global_bs"} <= set(args), (key, args)
        assert ({"group_tp", "tp_world_size", "tp_rank_id"} <= set(args)) == tp, (key, args)
        assert ("x_active_mask" in args) == masked, (key, args)
    assert ("tp_send_counts" in combine_args) == tp, (key, combine_args)
    assert ("expert_scales" in dispatch_args) == case.hierarchical, (key, dispatch_args)
    padded = rank < world - 1
    assert dispatch_masks == combine_masks == (masked and padded), (key, dispatch_masks, combine_masks)
    global_bs = {"v0.11.0": 0, "v0.9.1": (tokens + world - 1) * world, "v0.13.0": MAX_NUM_SEQS * world}[tag]
    assert dispatch_bs == combine_bs == global_bs, (key, dispatch_bs, combine_bs, global_bs)


def _assert_within(errors: list[dict], cases: list, batches: tuple[int, ...]) -> None:
    for rank, found in enumerate(errors):
        for case, shared in cases:
            for dtype, tolerance in TOLERANCE.items():
                for tokens in batches:
                    key = f"{case}_{'shared' if shared else 'routed'}_{dtype}_{tokens}"
                    assert found[key] <= tolerance, (rank, key, found[key])
        seconds = found.pop("seconds")
        worst = {dtype: max(v for k, v in found.items() if f"_{dtype}_" in k) for dtype in TOLERANCE}
        print(f"rank {rank}: {seconds:.1f} s, worst relative errors {worst}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("tag", ["v0.11.0", "v0.13.0", "v0.9.1"])
def test_vllm_ascend_mc2_dispatcher_matches_the_dense_moe(tmp_path, tag, world):
    """The release's MC2 path unchanged on 2 and 4 gloo ranks (v0.11.0: TokenDispatcherWithMC2
    through MC2CommImpl's prepare / finalize and AscendUnquantizedFusedMoEMethod.apply;
    v0.13.0: MC2CommImpl's prepare / fused_experts / finalize, the routing the test's;
    v0.9.1: AscendUnquantizedFusedMoEMethod.apply -> fused_experts_with_mc2): every platform
    case (A2 / A3, V1 / V2 names, expert_scales, torchair's arguments, the padded tokens
    masked by x_active_mask), with and without shared experts (v0.13.0's dispatcher takes
    none), float32 and bfloat16, three batch sizes (rank r has ``tokens + r``), against the
    dense MoE."""
    from tests.vllm_ascend import MC2_CASES

    shared_experts = (False,) if tag == "v0.13.0" else (False, True)
    cases = [(case, shared) for case in MC2_CASES[tag] for shared in shared_experts]
    batches = (9, 4, 13)
    _assert_within(_mc2_errors(tmp_path, tag, world, cases, batches), cases, batches)


def test_vllm_ascend_mc2_dispatcher_on_expert_parallel_sub_groups(tmp_path):
    """v0.11.0's MC2 path on 4 gloo ranks as two data-parallel replicas, each an expert-parallel
    group of 2 ([0, 1] and [2, 3], their own tokens): the dispatcher's ``get_hccl_comm_name``
    names its sub-group, the MC2 ops run there (carried as ``group_ranks``), each replica
    equals the dense MoE of its own tokens."""
    cases = [("a3_v2_masked", True), ("a2_v1_expert_scales", False)]
    batches = (9, 4)
    errors = _mc2_errors(tmp_path, "v0.11.0", 4, cases, batches, ep_groups=[[0, 1], [2, 3]])
    _assert_within(errors, cases, batches)
