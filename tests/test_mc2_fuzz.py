"""Seeded malformed calls of the MC2 collectives on thread ranks (tests/malformed.py leaves
out the ops that need a communicator): values broken on one rank (expert ids out of range,
repeated, huge; masks that are not prefixes; counts and index outputs shifted; attributes
that differ between ranks). Every call either succeeds on every rank or is refused with a
MoeOpError (its peers stopped with it, none left waiting), within the deadline."""

from __future__ import annotations

import numpy as np
import pytest

import moe_onnx
from moe_onnx.ranks import PeerStopped, RankFailure
from tests import mc2_reference as ref
from tests.test_moe_distribute import combine, group_attrs, make_x, routing, run_ranks

CASES = 24


def broken(rng, value: np.ndarray) -> np.ndarray:
    """``value`` with one entry changed to something hostile."""
    out = value.copy()
    flat = out.reshape(-1)
    if flat.size == 0:
        return out
    i = int(rng.integers(flat.size))
    if out.dtype == np.bool_:
        flat[i] = not flat[i]
    else:
        flat[i] = rng.choice([-1, flat[i] + 1, flat[i] - 1, 2**31 - 1, -(2**31), 0])
    return out


def outcome(function, *args, **kwargs) -> tuple[str, object]:
    """``("ok", result)`` or ``("refused", None)`` when every failed rank was refused by a
    MoeOpError or stopped by its peer's (no other exception, no rank left waiting)."""
    try:
        return "ok", function(*args, **kwargs)
    except RankFailure as failure:
        errors = list(failure.errors.values())
        for error in errors:
            assert isinstance(error, (moe_onnx.MoeOpError, PeerStopped)), repr(error)
        assert any(isinstance(e, moe_onnx.MoeOpError) for e in errors)
        return "refused", None


@pytest.mark.parametrize("v2", [False, True])
def test_malformed_dispatch_and_combine_are_refused_cleanly(v2):
    tally = {"ok": 0, "refused": 0}
    op = "MoeDistributeDispatchV2" if v2 else "MoeDistributeDispatch"
    for seed in range(CASES):
        rng = np.random.default_rng(seed)
        world = int(rng.choice([2, 4]))
        group = ref.Group(world, 2 * world, 0, 1, v2)
        rows, top_k = int(rng.integers(1, 5)), 2
        xs = [make_x(rng, rows, 8, np.float16) for _ in range(world)]
        ids = [routing(rng, group, rows, top_k) for _ in range(world)]
        masks = [np.arange(rows) < int(rng.integers(0, rows + 1)) for _ in range(world)]
        weights = [rng.random((rows, top_k), np.float32) for _ in range(world)]
        victim, what = int(rng.integers(world)), int(rng.integers(5))
        attrs = [group_attrs(group, r) for r in range(world)]
        if what == 0:
            ids[victim] = broken(rng, ids[victim])
        elif what == 1:
            masks[victim] = broken(rng, masks[victim])
        elif what == 2:
            attrs[victim]["moe_expert_num"] = int(rng.choice([world, 4 * world]))
        elif what == 3:
            attrs[victim]["ep_world_size"] = int(rng.choice([1, 2, 4, 8]))
            attrs[victim]["ep_rank_id"] = min(victim, attrs[victim]["ep_world_size"] - 1)
        inputs = [
            {"x": xs[r], "expert_ids": ids[r], "x_active_mask": masks[r], "expert_scales": weights[r]}
            for r in range(world)
        ]
        result, got = outcome(run_ranks, op, inputs, attrs, timeout=20)
        tally[result] += 1
        if got is None or what != 4:
            continue
        assert isinstance(got, list)  # then break what the combine reads on one rank
        index = "assist_info_for_combine" if v2 else "expand_idx"
        key = str(rng.choice([index, "ep_recv_count"]))
        got[victim][key] = broken(rng, got[victim][key])
        expand_xs = [g["expand_x"] for g in got]
        tally[outcome(combine, group, expand_xs, ids, got, weights, masks=masks)[0]] += 1
    assert tally["ok"] >= 3 and tally["refused"] >= 10, tally
