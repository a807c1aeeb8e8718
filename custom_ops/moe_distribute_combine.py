"""MoeDistributeCombine (V1): send the experts' rows back to their tokens' owners and sum them,
weighted (SPEC-mc2 1.22; torch_npu ``npu_moe_distribute_combine``).

The inverse of :mod:`.moe_distribute_dispatch`. On an expert rank, ``ep_send_counts`` (the
dispatch's ``ep_recv_count``: end row of block (e, r) at ``e*W + r``) splits rows ``[0, n)``
of ``expand_x``; block (e, r) goes back to rank r. On the owner, slot p with expert g reads
row ``expand_idx[p]`` of the block (local expert of g, this rank) its host returned. Then, for
every active token, in this order and in float32 with each product and sum rounded once:
``acc = sum_j f32(Y[t, j]) * expert_scales[t, j]``, plus the shared expert's row (weight 1),
then ``x[t] = rne(acc)``. Inactive tokens (past a 1-D mask's trues) get 0.

A shared rank (V1: one shared expert on S ranks) returns the rotated chunk of each MoE rank's
tokens to it and keeps its own tokens' rows (rows ``0..BS-1``, token order).
"""

from __future__ import annotations

import numpy as np

from . import mc2
from .dtypes import FLOATS
from .errors import BAD_DTYPE, MoeOpError
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .targets import Target

#: the combine's attributes past the group's: reserved for quantised paths, refused unless 0
RESERVED_ATTRS = {
    "out_dtype": "an output dtype other than expand_x's",
    "comm_quant_mode": "int8 quantisation of the exchange (its rounding is not specified by the source)",
    "group_list_type": "the A2 layered dequantisation's group list",
}
#: inputs of the A2 layered dequantisation path, refused when given
RESERVED_INPUTS = ("activation_scale", "weight_scale", "group_list")


def accumulate(
    pool: np.ndarray,
    row_of: np.ndarray,
    expert_ids: np.ndarray,
    expert_scales: np.ndarray,
    slots: np.ndarray,
    tokens: np.ndarray,
    experts: int,
    extra=None,
) -> np.ndarray:
    """The weighted sum of 1.22 (b) / 1.23 (b), token by token in slot order.

    Args:
        pool: ``[M, H]`` the rows returned to this rank (and its own, on a V1 shared rank).
        row_of: ``[BS, K + shared experts]`` int64, (token, slot) -> row of ``pool``, -1 for none.
        expert_ids, expert_scales: ``[BS, K]``; slots ``[BS, K]`` / tokens ``[BS]`` bool: active.
        extra: V2's ``(zero, copy, const, ori_x, alpha_1, alpha_2, const_v, shared_expert_x)``.
    Returns:
        ``x [BS, H]`` of pool's dtype; 0 for inactive tokens.
    """
    rows, top_k = expert_ids.shape
    acc = np.zeros((rows, pool.shape[1]), np.float32)
    weights = expert_scales.astype(np.float32)
    for j in range(top_k):
        ids = expert_ids[:, j]
        moe = slots[:, j] & (ids < experts)
        if moe.all():  # the common case, in place (the same two roundings: product, then sum)
            acc += mc2.widen(mc2.take_rows(pool, row_of[:, j])) * weights[:, j, None]
        else:
            acc[moe] = acc[moe] + mc2.widen(mc2.take_rows(pool, row_of[moe, j])) * weights[moe, j, None]
        if extra is None:
            continue
        zero, copy, const, ori_x, alpha_1, alpha_2, const_v, _ = extra
        copied = slots[:, j] & (ids >= experts + zero) & (ids < experts + zero + copy)
        if copied.any():
            acc[copied] = acc[copied] + mc2.widen(ori_x[copied]) * weights[copied, j, None]
        constant = slots[:, j] & (ids >= experts + zero + copy) & (ids < experts + zero + copy + const)
        if constant.any():
            c = ids[constant] - (experts + zero + copy)
            u = mc2.widen(ori_x[constant]) * mc2.widen(alpha_1[c, None])
            u = u + mc2.widen(const_v[c]) * mc2.widen(alpha_2[c, None])
            acc[constant] = acc[constant] + u * weights[constant, j, None]
    for i in range(row_of.shape[1] - top_k):
        acc[tokens] = acc[tokens] + mc2.widen(mc2.take_rows(pool, row_of[tokens, top_k + i]))
    if extra is not None and extra[-1] is not None:
        acc[tokens] = acc[tokens] + mc2.widen(extra[-1].reshape(rows, -1)[tokens])
    acc[~tokens] = 0
    return acc.astype(pool.dtype)


def _counts_problem(ends: np.ndarray, rows: int) -> str | None:
    """``ep_send_counts`` must be non-decreasing end rows within ``expand_x``."""
    counts = np.diff(ends, prepend=0)
    if (counts < 0).any():
        return f"ep_send_counts must be non-decreasing end rows from >= 0, got {ends.tolist()}"
    if len(ends) and ends[-1] > rows:
        return f"ep_send_counts ends at n = {int(ends[-1])} rows, but expand_x has {rows}"
    return None


def moe_distribute_combine(
    expand_x,
    expert_ids,
    expand_idx,
    ep_send_counts,
    expert_scales,
    tp_send_counts=None,
    x_active_mask=None,
    activation_scale=None,
    weight_scale=None,
    group_list=None,
    expand_scales=None,
    *,
    communicator=None,
    **attrs,
):
    """MoeDistributeCombine on this rank's communicator.

    Args:
        expand_x: ``[>= n, H]`` the experts' rows in the dispatch's layout; expert_ids,
        expert_scales: ``[BS, K]``; expand_idx: ``[BS*K]`` the dispatch's (src slot -> offset in
        its block); ep_send_counts: ``[W*L']`` the dispatch's ep_recv_count; x_active_mask:
        ``[BS]`` the dispatch's; tp_send_counts, expand_scales: accepted, not read.
    Returns:
        ``(x [BS, H],)`` of expand_x's dtype.
    """
    place = mc2.placement_of(attrs, False)
    rank, world, shared_ranks, per_rank = attrs["ep_rank_id"], place.world, place.shared_ranks, place.per_rank
    rows, top_k = expert_ids.shape
    slots, tokens, problem = mc2.active_slots(x_active_mask, expert_ids.shape)
    problem = mc2.local_group_problem(communicator, attrs) or problem
    problem = problem or mc2.id_problem(expert_ids, slots, place.experts, "the MoE experts")
    ends = ep_send_counts.astype(np.int64)
    problem = problem or _counts_problem(ends, len(expand_x))
    counts = np.diff(ends, prepend=0)
    active = int(tokens.sum())
    moe_slots = slots.reshape(-1)
    named = expert_ids.reshape(-1)[moe_slots].astype(np.int64)
    per_expert = np.bincount(named[(named >= 0) & (named < place.experts)], minlength=place.experts)
    if problem is None:
        index = expand_idx.astype(np.int64)[moe_slots]
        bound = per_expert[expert_ids.reshape(-1)[moe_slots]]
        bad = np.flatnonzero((index < 0) | (index >= bound))
        if len(bad):
            p = int(np.flatnonzero(moe_slots)[bad[0]])
            problem = f"expand_idx[{p}] = {int(expand_idx[p])} is outside its block's {int(bound[bad[0]])} rows"
    if problem is None and rank < shared_ranks and int(counts[:shared_ranks].sum()) != active:
        problem = f"ep_send_counts give {int(counts[:shared_ranks].sum())} own rows to this shared rank, not {active}"
    blocks = _host_blocks(counts, rank, place) if problem is None else None
    config = {name: attrs[name] for name in mc2.GROUP_ATTRS}
    config["rows of expand_x"] = f"{expand_x.dtype}[*, {expand_x.shape[1]}]"
    shared = None
    if blocks is not None:
        shared = (config, rows, active, [len(b) for b in blocks], counts.tolist(), per_expert.tolist())
    infos = mc2.agree(communicator, "MoeDistributeCombine", problem, shared)
    mc2.require_same_group([info[0] for info in infos])
    mc2.require_group_rows(attrs["global_bs"], [info[1] for info in infos])
    _require_consistent(infos, place)
    assert blocks is not None
    width = expand_x.dtype.itemsize * expand_x.shape[1]
    picked = np.concatenate(blocks)
    send = mc2.take_rows(expand_x, picked).view(np.uint8).reshape(len(picked), width)
    recv_counts = [info[3][rank] for info in infos]
    received = mc2.swap(communicator, send, [len(b) for b in blocks], recv_counts)
    pool = received.view(expand_x.dtype).reshape(len(received), expand_x.shape[1])
    if rank < shared_ranks:  # a shared rank's own rows stay
        pool = np.concatenate([pool, expand_x[:active]])
    starts = np.concatenate(([0], np.cumsum(recv_counts)))
    row_of = np.full((rows, top_k + int(shared_ranks > 0)), -1, np.int64)
    for m in range(shared_ranks, world):  # MoE rows from host m, its blocks in local-expert order
        block_rows = np.array(infos[m][4], np.int64).reshape(per_rank, world)[:, rank]
        block_starts = starts[m] + np.cumsum(block_rows) - block_rows
        mine = slots & (place.host(expert_ids.astype(np.int64)) == m)
        local = expert_ids[mine] % per_rank
        row_of[:, :top_k][mine] = block_starts[local] + expand_idx.reshape(rows, top_k)[mine]
    if shared_ranks and rank >= shared_ranks:
        for s in range(shared_ranks):
            lo, hi = mc2.shared_chunk(s, rank, active, shared_ranks)
            row_of[lo:hi, top_k] = starts[s] + np.arange(hi - lo)
    elif shared_ranks:
        row_of[:active, top_k] = starts[-1] + np.arange(active)
    return (accumulate(pool, row_of, expert_ids, expert_scales, slots, tokens, place.experts),)


def _host_blocks(counts: np.ndarray, rank: int, place: mc2.Placement) -> list[np.ndarray]:
    """Rows of ``expand_x`` this rank returns to each rank d: a MoE rank block (e, d) for
    every local expert e; a shared rank the chunk of MoE rank d (its own rows stay)."""
    world, shared_ranks = place.world, place.shared_ranks
    starts = np.cumsum(counts) - counts
    if rank >= shared_ranks:
        grid = counts.reshape(place.per_rank, world)
        grid_starts = starts.reshape(place.per_rank, world)
        return [
            np.concatenate(
                [np.arange(grid_starts[e, d], grid_starts[e, d] + grid[e, d]) for e in range(place.per_rank)]
            ).astype(np.int64)
            for d in range(world)
        ]
    empty = np.zeros(0, np.int64)
    return [empty if d < shared_ranks else np.arange(starts[d], starts[d] + counts[d]) for d in range(world)]


def _require_consistent(infos: list, place: mc2.Placement) -> None:
    """The hosts' blocks against their owners' active slots (1.22 c), the same check on every rank."""
    world, shared_ranks, per_rank = place.world, place.shared_ranks, place.per_rank
    for m in range(shared_ranks, world):
        grid = np.array(infos[m][4], np.int64).reshape(per_rank, world)
        for r in range(world):
            wanted = np.array(infos[r][5][(m - shared_ranks) * per_rank : (m - shared_ranks + 1) * per_rank])
            if not np.array_equal(grid[:, r], wanted):
                raise MoeOpError(
                    f"rank {m} returns {grid[:, r].tolist()} rows of its local experts to rank {r}, whose active "
                    f"slots name them {wanted.tolist()} times (ep_send_counts and expert_ids do not match the dispatch)"
                )
    for s in range(shared_ranks):
        for r in range(shared_ranks, world):
            lo, hi = mc2.shared_chunk(s, r, infos[r][2], shared_ranks)
            if infos[s][3][r] != hi - lo:
                raise MoeOpError(
                    f"shared rank {s} returns {infos[s][3][r]} rows to rank {r}, whose tokens {lo}..{hi - 1} "
                    f"({hi - lo} rows) it holds"
                )


def infer_combine(sig: Signature, v2: bool) -> None:
    """Shape rules and the output of both versions (1.22 a, c; 1.23 a, c)."""
    place = mc2.require_group(sig, v2)
    for name, why in RESERVED_ATTRS.items():
        if name in sig.attrs:
            sig.require(sig.attr(name) == 0, f"{name} = {sig.attr(name)} ({why})", BAD_DTYPE)
    for name in RESERVED_INPUTS:
        sig.require(not sig.has(name), f"{name} (the A2 layered dequantisation path)", BAD_DTYPE)
    rows, top_k, hidden = sig.dim("expert_ids", 0), sig.dim("expert_ids", 1), sig.dim("expand_x", 1)
    sig.same(sig.dim("expert_scales", 0), rows, "expert_scales must be [BS, K] like expert_ids")
    sig.same(sig.dim("expert_scales", 1), top_k, "expert_scales must be [BS, K] like expert_ids")
    rank = sig.attr("ep_rank_id")
    local = 1 if rank < place.shared_ranks else place.per_rank
    sig.same(sig.dim("ep_send_counts", 0), place.world * local, "ep_send_counts must be [W * L']")
    if not v2:
        slots = rows * top_k if isinstance(rows, int) and isinstance(top_k, int) else None
        if slots is not None:
            sig.same(sig.dim("expand_idx", 0), slots, "expand_idx must be [BS * K]")
    if sig.has("x_active_mask"):
        sig.same(sig.dim("x_active_mask", 0), rows, "x_active_mask.shape[0] must equal BS")
        shape = sig.input("x_active_mask").shape or ()
        if len(shape) == 2:
            sig.same(shape[1], top_k, "a 2-D x_active_mask must be [BS, K]")
    mc2.require_global_bs(sig, rows)
    if sig.has("expand_scales"):
        groups = mc2.global_rows(sig.attr("global_bs"), rows, place.world)
        if groups is not None and isinstance(top_k, int):
            capacity = place.capacity(rank, groups, top_k, v2)
            sig.same(sig.dim("expand_scales", 0), capacity, "expand_scales must be [A], the dispatch's")
    if v2:
        _infer_v2_inputs(sig, place, rows, hidden)
    sig.output("x", sig.input("expand_x").dtype, (rows, hidden))


def _infer_v2_inputs(sig: Signature, place: mc2.Placement, rows, hidden) -> None:
    sig.require(not sig.has("elastic_info"), "elastic_info (dynamic shrinking of the EP group)", BAD_DTYPE)
    dtype = sig.input("expand_x").dtype
    for name in ("shared_expert_x", "ori_x", "const_expert_v"):
        if sig.has(name) and dtype is not None and sig.input(name).dtype is not None:
            sig.require(sig.input(name).dtype == dtype, f"{name} must have expand_x's dtype {dtype}")
    if sig.has("shared_expert_x"):
        sig.require(place.shared_ranks == 0, "shared_expert_x is legal only with shared_expert_rank_num = 0")
        shape = sig.input("shared_expert_x").shape or ()
        sig.same(shape[-1] if shape else None, hidden, "shared_expert_x must end in H")
        if len(shape) == 2:
            sig.same(shape[0], rows, "shared_expert_x must be [BS, H] or [a, b, H] with a*b = BS")
        elif isinstance(shape[0], int) and isinstance(shape[1], int) and isinstance(rows, int):
            sig.require(shape[0] * shape[1] == rows, "shared_expert_x must be [BS, H] or [a, b, H] with a*b = BS")
    attrs = sig.attrs
    if attrs["copy_expert_num"] or attrs["const_expert_num"]:
        sig.require(sig.has("ori_x"), "copy and constant experts need ori_x")
    if sig.has("ori_x"):
        sig.same(sig.dim("ori_x", 0), rows, "ori_x must be [BS, H]")
        sig.same(sig.dim("ori_x", 1), hidden, "ori_x must be [BS, H]")
    const = attrs["const_expert_num"]
    if const:
        for name in ("const_expert_alpha_1", "const_expert_alpha_2", "const_expert_v"):
            sig.require(sig.has(name), f"constant experts need {name}")
        for name in ("const_expert_alpha_1", "const_expert_alpha_2"):
            sig.same(sig.dim(name, 0), const, f"{name} must be [N] (one scalar per constant expert)")
        sig.same(sig.dim("const_expert_v", 0), const, "const_expert_v must be [N, H]")
        sig.same(sig.dim("const_expert_v", 1), hidden, "const_expert_v must be [N, H]")


def combine_limits(sig: Signature, target: Target, v2: bool) -> list[str]:
    """The dispatch's limits (1.26 c: 'the same as its dispatch'), on the combine's inputs."""
    from .moe_distribute_dispatch import dispatch_limits

    view = _DispatchView(sig)
    return dispatch_limits(view, target, v2)  # type: ignore[arg-type]


class _DispatchView:
    """A combine's signature read as its dispatch's: ``x`` is ``[BS, H]`` from expert_ids and
    expand_x, the attributes are shared."""

    def __init__(self, sig: Signature):
        self.attrs = dict(sig.attrs, comm_alg=sig.attrs.get("comm_alg", ""))
        self._sig = sig

    def has(self, name: str) -> bool:
        return name == "x" or self._sig.has(name)

    def input(self, name: str):
        from .tensor_info import TensorInfo

        if name == "x":
            return TensorInfo(self._sig.input("expand_x").dtype, (self._sig.dim("expert_ids", 0), self.dim("x", 1)))
        return self._sig.input(name)

    def dim(self, name: str, axis: int):
        if name == "x":
            return self._sig.dim("expert_ids", 0) if axis == 0 else self._sig.dim("expand_x", 1)
        return self._sig.dim(name, axis)


def combine_inputs(v2: bool) -> list[Input]:
    index = (
        Input("assist_info_for_combine", ("int32",), "[A*128] the dispatch's: row d -> (src rank, token, slot)", (1,))
        if v2
        else Input("expand_idx", ("int32",), "[BS*K] the dispatch's: src slot -> offset in its block", (1,))
    )
    inputs = [
        Input("expand_x", FLOATS, "[>= n, H] the experts' rows in the dispatch's layout", (2,)),
        Input("expert_ids", ("int32",), "[BS, K] the dispatch's expert ids", (2,)),
        index,
        Input("ep_send_counts", ("int32",), "[W*L'] the dispatch's ep_recv_count (end rows of blocks)", (1,)),
        Input("expert_scales", ("float32",), "[BS, K] weights of the routed rows", (2,)),
        Input("tp_send_counts", ("int32",), "the dispatch's tp_recv_count; not read without TP", (1,), optional=True),
        Input(
            "x_active_mask",
            ("bool",),
            "the dispatch's mask: [BS]" + (" or [BS, K]" if v2 else ""),
            (1, 2) if v2 else (1,),
            optional=True,
        ),
        Input("activation_scale", ("float32",), "refused (A2 layered dequantisation)", None, optional=True),
        Input("weight_scale", ("float32",), "refused (A2 layered dequantisation)", None, optional=True),
        Input("group_list", ("int64",), "refused (A2 layered dequantisation)", None, optional=True),
        Input("expand_scales", ("float32",), "[A] the dispatch's; shape-checked, not read", (1,), optional=True),
    ]
    if v2:
        inputs += [
            Input(
                "shared_expert_x",
                FLOATS,
                "[BS, H] or [a, b, H]: a shared expert's output, added unweighted",
                (2, 3),
                optional=True,
            ),
            Input("elastic_info", ("int32",), "refused: dynamic shrinking of the EP group", None, optional=True),
            Input("ori_x", FLOATS, "[BS, H] the dispatch's x (copy and constant experts)", (2,), optional=True),
            Input("const_expert_alpha_1", FLOATS, "[N] constant experts' alpha 1", (1,), optional=True),
            Input("const_expert_alpha_2", FLOATS, "[N] constant experts' alpha 2", (1,), optional=True),
            Input("const_expert_v", FLOATS, "[N, H] constant experts' vectors", (2,), optional=True),
        ]
    return inputs


def combine_attrs(v2: bool) -> list[Attr]:
    attrs = mc2.group_attrs(v2)
    if not v2:
        attrs += [
            Attr("out_dtype", "int", 0, "reserved: 0 (the dtype of expand_x)"),
            Attr("comm_quant_mode", "int", 0, "0; 2 (int8 exchange) is refused"),
            Attr("group_list_type", "int", 0, "reserved: 0"),
        ]
    else:
        attrs += [Attr("comm_quant_mode", "int", 0, "0; 2 (int8 exchange) is refused")] + mc2.v2_attrs()
    return attrs


def _infer(sig: Signature) -> None:
    infer_combine(sig, v2=False)


def _limits(sig: Signature, target: Target) -> list[str]:
    return combine_limits(sig, target, v2=False)


_EXAMPLE = Example(  # combining what MoeDistributeDispatch's example sends, as its experts returned it
    attrs=mc2.EXAMPLE_GROUP,
    ranks=tuple(
        {
            "expand_x": rows,
            "expert_ids": tokens["expert_ids"],
            "expand_idx": np.array([0, 0], np.int32),
            "ep_send_counts": np.array([1, 2], np.int32),
            "expert_scales": weights,
        }
        for rows, tokens, weights in zip(mc2.EXAMPLE_EXPERT_ROWS, mc2.EXAMPLE_TOKENS, mc2.EXAMPLE_WEIGHTS)
    ),
    rank_attrs=mc2.EXAMPLE_RANK_ATTRS,
)

MOE_DISTRIBUTE_COMBINE = OpDef(
    "MoeDistributeCombine",
    __doc__,
    inputs=combine_inputs(v2=False),
    outputs=[Output("x", FLOATS, "[BS, H] sum of the weighted rows (and the shared row), expand_x's dtype")],
    attrs=combine_attrs(v2=False),
    infer=_infer,
    kernel=moe_distribute_combine,
    needs=("communicator",),
    example=_EXAMPLE,
    npu_limits=_limits,
)

DEFINITIONS = [MOE_DISTRIBUTE_COMBINE]
