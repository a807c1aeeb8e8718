"""MoeDistributeCombineV2: the combine of SPEC-mc2 1.23 (torch_npu ``npu_moe_distribute_combine_v2``).

The expert rank reads only ``n = ep_send_counts[-1]`` and the dispatch's triples: row ``d < n``
of ``expand_x`` goes to rank ``assist[3d]`` as ``Y[assist[3d+1], assist[3d+2]]`` (token, slot;
slot ``K + i`` for shared expert i), so the row order inside ``expand_x`` does not matter. On
the owner, for each active token, in float32 with every product and sum rounded once, in
this order: the routed slots ``f32(Y[t, j]) * w`` (zero experts add nothing, copy experts
``f32(ori_x[t]) * w``, constant experts ``(f32(ori_x[t]) * alpha_1[c] + f32(v[c]) * alpha_2[c])
* w``), then each shared expert's row (weight 1), then ``shared_expert_x[t]``; ``x[t] =
rne(acc)``; inactive tokens get 0.

Every owner checks the rows it got (a token and slot of its own, an expert the sender hosts,
none twice, none missing) and the ranks share their verdicts, so a bad ``assist_info`` is the
same error on every rank.
"""

from __future__ import annotations

import numpy as np

from . import mc2
from .dtypes import FLOATS
from .moe_distribute_combine import accumulate, combine_attrs, combine_inputs, combine_limits, infer_combine
from .opdef import Example, OpDef, Output, Signature
from .targets import Target

LABEL = "MoeDistributeCombineV2"


def moe_distribute_combine_v2(
    expand_x,
    expert_ids,
    assist_info_for_combine,
    ep_send_counts,
    expert_scales,
    tp_send_counts=None,
    x_active_mask=None,
    activation_scale=None,
    weight_scale=None,
    group_list=None,
    expand_scales=None,
    shared_expert_x=None,
    elastic_info=None,
    ori_x=None,
    const_expert_alpha_1=None,
    const_expert_alpha_2=None,
    const_expert_v=None,
    *,
    communicator=None,
    **attrs,
):
    """MoeDistributeCombineV2 on this rank's communicator.

    Args:
        expand_x: ``[>= n, H]`` the experts' rows; assist_info_for_combine: ``[>= 3n]`` the
        dispatch's (row d -> src rank, token, slot); ep_send_counts: ``[W*L']``, only the last
        entry (n) is read; expert_ids, expert_scales: ``[BS, K]``; x_active_mask: ``[BS]`` or
        ``[BS, K]``; shared_expert_x: ``[BS, H]`` or ``[a, b, H]``; ori_x ``[BS, H]``;
        const_expert_alpha_1/2 ``[N]``; const_expert_v ``[N, H]``.
    Returns:
        ``(x [BS, H],)`` of expand_x's dtype.
    """
    place = mc2.placement_of(attrs, True)
    rank, world = attrs["ep_rank_id"], place.world
    rows, top_k = expert_ids.shape
    slots, tokens, problem = mc2.active_slots(x_active_mask, expert_ids.shape)
    problem = mc2.local_group_problem(communicator, attrs) or problem
    problem = problem or mc2.id_problem(expert_ids, slots, place.experts + place.special, "the MoE and special experts")
    n = int(ep_send_counts[-1]) if len(ep_send_counts) else 0
    if problem is None and not 0 <= n <= len(expand_x):
        problem = f"ep_send_counts ends at n = {n} rows, outside the {len(expand_x)} rows of expand_x"
    if problem is None and 3 * n > len(assist_info_for_combine):
        problem = f"assist_info_for_combine holds {len(assist_info_for_combine)} entries, fewer than 3n = {3 * n}"
    triples = assist_info_for_combine[: 3 * n].astype(np.int64).reshape(-1, 3) if problem is None else None
    if triples is not None and ((triples[:, 0] < 0) | (triples[:, 0] >= world)).any():
        d = int(np.flatnonzero((triples[:, 0] < 0) | (triples[:, 0] >= world))[0])
        problem = f"assist_info_for_combine names rank {int(triples[d, 0])} for row {d}, outside [0, {world})"
    config = {name: attrs[name] for name in mc2.GROUP_ATTRS_V2}
    config["rows of expand_x"] = f"{expand_x.dtype}[*, {expand_x.shape[1]}]"
    shared = None
    if problem is None and triples is not None:
        shared = (config, rows, np.bincount(triples[:, 0], minlength=world).tolist())
    infos = mc2.agree(communicator, LABEL, problem, shared)
    mc2.require_same_group([info[0] for info in infos])
    mc2.require_group_rows(attrs["global_bs"], [info[1] for info in infos])
    assert triples is not None
    order = np.argsort(triples[:, 0], kind="stable")
    ends = np.searchsorted(triples[order, 0], np.arange(world + 1))
    send = mc2.pack([mc2.take_rows(expand_x, order), triples[order, 1:].astype(np.int32)])
    recv_counts = [info[2][rank] for info in infos]
    received = mc2.swap(communicator, send, np.diff(ends), recv_counts)
    layout = [(expand_x.dtype, expand_x.shape[1]), (np.dtype(np.int32), 2)]
    pool, keys = mc2.unpack(received, layout)
    per_source = np.split(keys, np.cumsum(recv_counts)[:-1])
    row_of, problem = _place_rows(per_source, expert_ids, slots, tokens, place, rank)
    mc2.fail_on_problems(communicator, communicator.allgather(problem, LABEL + " (the rows returned)"))
    extra = (
        attrs["zero_expert_num"],
        attrs["copy_expert_num"],
        attrs["const_expert_num"],
        ori_x,
        const_expert_alpha_1,
        const_expert_alpha_2,
        const_expert_v,
        shared_expert_x,
    )
    return (accumulate(pool, row_of, expert_ids, expert_scales, slots, tokens, place.experts, extra),)


def _place_rows(keys, expert_ids, slots, tokens, place: mc2.Placement, rank: int):
    """``(row_of [BS, K + shared experts], problem)``: (token, slot) -> row of the received
    rows, from each source's ``(token, slot)`` keys; a problem names the first bad row."""
    rows, top_k = expert_ids.shape
    row_of = np.full((rows, top_k + place.shared_experts), -1, np.int64)
    start = 0
    for m, key in enumerate(keys):
        t, slot = key[:, 0].astype(np.int64), key[:, 1].astype(np.int64)
        bad = (t < 0) | (t >= rows) | (slot < 0) | (slot >= row_of.shape[1])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            return (
                row_of,
                f"rank {m} returned a row for (token {t[i]}, slot {slot[i]}), "
                f"outside [0, {rows}) x [0, {row_of.shape[1]})",
            )
        routed = slot < top_k
        ids = expert_ids[t[routed], slot[routed]].astype(np.int64)
        ok_routed = slots[t[routed], slot[routed]] & (ids < place.experts) & (place.host(ids) == m)
        replica = rank % place.replicas + (slot[~routed] - top_k) * place.replicas if place.replicas else slot[~routed]
        ok_shared = tokens[t[~routed]] & (replica == m)
        bad = np.zeros(len(t), bool)
        bad[routed], bad[~routed] = ~ok_routed, ~ok_shared
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            return row_of, f"rank {m} returned a row for (token {t[i]}, slot {slot[i]}), which it does not serve"
        if (row_of[t, slot] >= 0).any() or len(np.unique(t * row_of.shape[1] + slot)) != len(t):
            return row_of, f"rank {m} returned one (token, slot) twice"
        row_of[t, slot] = start + np.arange(len(t))
        start += len(t)
    needed = np.zeros(row_of.shape, bool)
    needed[:, :top_k] = slots & (expert_ids < place.experts)
    needed[:, top_k:] = tokens[:, None]
    missing = needed & (row_of < 0)
    if missing.any():
        t, slot = (int(i) for i in np.argwhere(missing)[0])
        return row_of, f"no row came back for token {t}, slot {slot}"
    return row_of, None


def _infer(sig: Signature) -> None:
    infer_combine(sig, v2=True)


def _limits(sig: Signature, target: Target) -> list[str]:
    return combine_limits(sig, target, v2=True)


#: MoeDistributeDispatchV2's assist_info_for_combine in its example: (source rank, token, slot)
#: of each received row, the rest of the [A * 128] buffer zeros
_ASSIST = (np.array([0, 0, 0, 1, 1, 0] + [0] * 506, np.int32), np.array([0, 1, 0, 1, 0, 0] + [0] * 506, np.int32))
_EXAMPLE = Example(  # combining what MoeDistributeDispatchV2's example sends, as its experts returned it
    attrs=mc2.EXAMPLE_GROUP,
    ranks=tuple(
        {
            "expand_x": rows,
            "expert_ids": tokens["expert_ids"],
            "assist_info_for_combine": assist,
            "ep_send_counts": np.array([1, 2], np.int32),
            "expert_scales": weights,
        }
        for rows, tokens, assist, weights in zip(
            mc2.EXAMPLE_EXPERT_ROWS, mc2.EXAMPLE_TOKENS, _ASSIST, mc2.EXAMPLE_WEIGHTS
        )
    ),
    rank_attrs=mc2.EXAMPLE_RANK_ATTRS,
)

MOE_DISTRIBUTE_COMBINE_V2 = OpDef(
    "MoeDistributeCombineV2",
    __doc__,
    inputs=combine_inputs(v2=True),
    outputs=[Output("x", FLOATS, "[BS, H] the weighted sum of each token's rows, expand_x's dtype")],
    attrs=combine_attrs(v2=True),
    infer=_infer,
    kernel=moe_distribute_combine_v2,
    needs=("communicator",),
    example=_EXAMPLE,
    npu_limits=_limits,
)

DEFINITIONS = [MOE_DISTRIBUTE_COMBINE_V2]
