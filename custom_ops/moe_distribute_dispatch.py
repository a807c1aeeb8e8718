"""MoeDistributeDispatch (V1): send each token's top-k copies to the ranks of their experts
(SPEC-mc2 1.19, 1.20; torch_npu ``npu_moe_distribute_dispatch``).

On a MoE rank m the received rows are laid out **local expert, then source rank, then the
source's slot order** (1.19 d); ``ep_recv_count[e*W + r]`` is the end row of block (e, r).
``expand_idx`` is written **on the sender, src slot -> offset** of that slot's row inside its
(expert, src rank) block: ``expand_idx[p]`` = number of earlier active slots of this rank with
the same expert (-1 for inactive slots). A shared rank (``ep_rank_id < S``) keeps its own
tokens first and receives S rotated chunks of every MoE rank's tokens (1.20 b).

``quant_mode 2`` quantises every copy to int8 per row with the smooth scales of its
destination expert (1.20 d); ``dynamic_scales`` holds ``1/ds`` per row. Rows ``n..A-1`` of
every per-row output are 0 (the NPU leaves them unwritten).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import mc2
from .dtypes import FLOATS
from .errors import BAD_DTYPE, MoeOpError
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .targets import Target, known_dim

#: torch_npu's quant modes: 0 none, 1 static (refused by the tilings), 2 dynamic per token,
#: 3 / 4 per group / mx (no A2/A3 kernel)
REFUSED_QUANT = {1: "static quantisation (the tilings: 'cannot support static quant now')", 3: "per-group", 4: "mx"}
#: row bookkeeping carried beside the payload: (src rank, token, slot) and (1/ds, expand scale)
META = [(np.dtype(np.int32), 3), (np.dtype(np.float32), 2)]


@dataclass
class Sends:
    """What one source rank sends: per destination rank d, the tokens, slots (``j < K`` for
    a MoE copy, ``K + i`` for shared expert i), smooth-scale rows and expand scales."""

    tokens: list[np.ndarray]
    slots: list[np.ndarray]
    scale_rows: list[np.ndarray]
    expand_scales: list[np.ndarray]

    def counts(self) -> list[int]:
        return [len(t) for t in self.tokens]


def quantise(rows: np.ndarray, smooth: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic per-row int8 (1.20 d): ``v = f32(x) * smooth``, ``ds = 127 / max|v|``,
    ``q = rint(v * ds)`` (ties to even), ``1/ds`` per row; an all-zero row gives q = 0, scale 0.

    Args: rows ``[n, H]`` x's dtype; smooth ``[n, H]`` float32 or None.
    Returns: ``(q [n, H] int8, scale [n] float32)``."""
    v = mc2.widen(rows)
    if smooth is not None:
        v = v * smooth
    amax = np.abs(v).max(axis=1, initial=np.float32(0))
    zero = amax == 0
    ds = np.float32(127) / np.where(zero, np.float32(1), amax)
    q = np.rint(v * ds[:, None])
    q[zero] = 0
    return q.astype(np.int8), np.where(zero, np.float32(0), np.float32(1) / ds).astype(np.float32)


def _moe_order(expert_ids: np.ndarray, slots: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """The active MoE slots ``p`` (ids < E) in (expert, slot) order and their experts."""
    flat = expert_ids.reshape(-1)
    p = np.flatnonzero(slots.reshape(-1) & (flat < experts))
    order = np.argsort(flat[p], kind="stable")
    return p[order], flat[p][order].astype(np.int64)


def expand_idx_of(expert_ids: np.ndarray, slots: np.ndarray, experts: int) -> np.ndarray:
    """V1's ``expand_idx [BS*K]`` int32: active slot p -> its offset in its (expert, rank)
    block (earlier active slots with the same expert); -1 for inactive slots."""
    p, g = _moe_order(expert_ids, slots, experts)
    starts = np.concatenate(([0], np.cumsum(np.bincount(g, minlength=experts))))
    out = np.full(expert_ids.size, -1, np.int32)
    out[p] = np.arange(len(p)) - starts[g]
    return out


def plan_sends(
    expert_ids: np.ndarray,
    slots: np.ndarray,
    tokens: np.ndarray,
    expert_scales: np.ndarray | None,
    place: mc2.Placement,
    rank: int,
    v2: bool,
) -> tuple[Sends, np.ndarray]:
    """Rows this rank sends, grouped by destination rank; and its per-expert counts ``[E]``.

    MoE copies go to ``host(g)`` in (expert, slot) order; shared copies: V1, a MoE rank sends
    rotated chunks of its active tokens to the S shared ranks; V2, every rank sends all its
    active tokens to replica ``rank % R`` of each shared expert."""
    rows, top_k = expert_ids.shape
    world, shared_ranks = place.world, place.shared_ranks
    p, g = _moe_order(expert_ids, slots, place.experts)
    dest = place.host(g)
    ends = np.searchsorted(dest, np.arange(world + 1))
    weights = np.zeros(len(p), np.float32) if expert_scales is None else expert_scales.reshape(-1)[p]
    moe_row = g + (place.shared_experts if v2 else int(shared_ranks > 0))
    sends = Sends([], [], [], [])
    empty = np.zeros(0, np.int64)
    for d in range(world):
        part = slice(ends[d], ends[d + 1])
        sends.tokens.append(p[part] // top_k)
        sends.slots.append(p[part] % top_k)
        sends.scale_rows.append(moe_row[part])
        sends.expand_scales.append(weights[part])
    active = np.flatnonzero(tokens)
    shared = [empty] * world
    slot_of = [empty] * world
    if not v2 and shared_ranks and rank >= shared_ranks:
        for s in range(shared_ranks):
            lo, hi = mc2.shared_chunk(s, rank, len(active), shared_ranks)
            shared[s], slot_of[s] = active[lo:hi], np.full(hi - lo, top_k)
    elif v2 and place.shared_experts:
        for i in range(place.shared_experts):
            s = rank % place.replicas + i * place.replicas
            shared[s], slot_of[s] = active, np.full(len(active), top_k + i)
    for s in range(shared_ranks):
        sends.tokens[s], sends.slots[s] = shared[s], slot_of[s]
        sends.scale_rows[s] = slot_of[s] - top_k
        sends.expand_scales[s] = np.zeros(len(shared[s]), np.float32)
    return sends, np.bincount(g, minlength=place.experts)


def payload(
    x: np.ndarray, tokens: np.ndarray, scale_rows: np.ndarray, scales: np.ndarray | None, quant: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The rows ``x[tokens]`` as sent: raw, or int8 with ``1/ds`` (``scales[scale_rows]`` smooth)."""
    rows = mc2.take_rows(x, tokens)
    if not quant:
        return rows, np.zeros(len(tokens), np.float32)
    return quantise(rows, None if scales is None else scales[scale_rows])


def dispatch(x, expert_ids, scales, x_active_mask, expert_scales, attrs: dict, communicator, v2: bool):
    """The dispatch of both versions. Returns ``(expand_x, dynamic_scales, index output,
    expert_token_nums, ep_recv_count, tp_recv_count, expand_scales)``; the index output is
    V1's ``expand_idx`` or V2's ``assist_info_for_combine``."""
    place = mc2.placement_of(attrs, v2)
    rank, world, shared_ranks = attrs["ep_rank_id"], place.world, place.shared_ranks
    rows, top_k = expert_ids.shape
    quant = attrs["quant_mode"] == 2
    label = "MoeDistributeDispatchV2" if v2 else "MoeDistributeDispatch"
    slots, tokens, problem = mc2.active_slots(x_active_mask, expert_ids.shape)
    problem = mc2.local_group_problem(communicator, attrs) or problem
    what = "the MoE and special experts" if v2 else "the MoE experts"
    problem = problem or mc2.id_problem(expert_ids, slots, place.experts + place.special, what)
    if problem is None and quant and not np.isfinite(x[tokens].astype(np.float32)).all():
        problem = "x holds a non-finite value, which quant_mode 2 cannot quantise"
    config = {name: attrs[name] for name in (mc2.GROUP_ATTRS_V2 if v2 else mc2.GROUP_ATTRS)}
    config["rows of x"] = f"{x.dtype}[BS, {x.shape[1]}], quant_mode {attrs['quant_mode']}"
    sends, shared = None, None
    if problem is None:
        sends, per_expert = plan_sends(expert_ids, slots, tokens, expert_scales, place, rank, v2)
        shared = (config, rows, int(tokens.sum()), sends.counts(), per_expert.tolist())
    infos = mc2.agree(communicator, label, problem, shared)
    mc2.require_same_group([info[0] for info in infos])
    mc2.require_group_rows(attrs["global_bs"], [info[1] for info in infos])
    assert sends is not None  # agree() raised otherwise
    groups = attrs["global_bs"] or rows * world
    counts = np.array([info[3] for info in infos], np.int64)  # [source, dest]
    for m in range(world):
        n, capacity = int(counts[:, m].sum()), place.capacity(m, groups, top_k, v2)
        if not v2 and m < shared_ranks:
            n += infos[m][2]  # a V1 shared rank's own tokens
        if n > capacity:
            raise MoeOpError(f"rank {m} would receive {n} rows, more than its A = {capacity} (1.19 b)")
    send_tokens, send_slots = np.concatenate(sends.tokens), np.concatenate(sends.slots)
    sent, dyn = payload(x, send_tokens, np.concatenate(sends.scale_rows), scales, quant)
    triples = np.stack([np.full(len(sent), rank), send_tokens, send_slots], axis=1).astype(np.int32)
    floats = np.stack([dyn, np.concatenate(sends.expand_scales)], axis=1).astype(np.float32)
    received = mc2.swap(communicator, mc2.pack([sent, triples, floats]), counts[rank], counts[:, rank])
    layout = [(np.dtype(np.int8) if quant else x.dtype, x.shape[1])] + META
    if rank >= shared_ranks:
        per_source = np.array([info[4] for info in infos], np.int64)
        local = per_source[:, (rank - shared_ranks) * place.per_rank : (rank - shared_ranks + 1) * place.per_rank]
        order = mc2.regroup(local)  # [source, local expert] counts -> expert-major
        rows_in = received[order]
        recv_count = np.cumsum(local.T.reshape(-1))
        token_nums = local.sum(axis=0)
    else:
        sources = counts[:, rank].tolist()
        rows_in, recv_count = _shared_rows(x, scales, quant, tokens, received, sources, rank, shared_ranks, top_k, v2)
        token_nums = np.array([recv_count[-1]])
    capacity = place.capacity(rank, groups, top_k, v2)
    out = _outputs(rows_in, layout, capacity, x.shape[1])
    if attrs["expert_token_nums_type"] == 0:
        token_nums = np.cumsum(token_nums)
    n = len(rows_in)
    index = expand_idx_of(expert_ids, slots, place.experts) if not v2 else _assist(out.pop("triples"), n, capacity)
    tp_counts = np.full(attrs["tp_world_size"], n, np.int32)
    return (
        out["expand_x"],
        out["dynamic_scales"],
        index,
        token_nums.astype(np.int64),
        recv_count.astype(np.int32),
        tp_counts,
        out["expand_scales"],
    )


def _shared_rows(x, scales, quant, tokens, received, sources, rank, shared_ranks, top_k, v2):
    """A shared rank's rows and ``ep_recv_count [W]``: by source rank, then token (V1: its
    own active tokens first, under the synthetic split of ``GetCumSum``)."""
    rows_in = received
    if v2:
        return rows_in, np.cumsum(sources)
    own = np.flatnonzero(tokens)
    sent, dyn = payload(x, own, np.zeros(len(own), np.int64), scales, quant)
    triples = np.stack([np.full(len(own), rank), own, np.full(len(own), top_k)], axis=1).astype(np.int32)
    floats = np.stack([dyn, np.zeros(len(own), np.float32)], axis=1)
    rows_in = np.concatenate([mc2.pack([sent, triples, floats]), rows_in])
    split = mc2.own_split(rank, len(own), shared_ranks)
    return rows_in, np.cumsum(split + sources[shared_ranks:])


def _outputs(rows_in: np.ndarray, layout, capacity: int, hidden: int) -> dict[str, np.ndarray]:
    """The per-row outputs, ``A = capacity`` rows, rows past the received ones 0."""
    sent, triples, floats = mc2.unpack(rows_in, layout)
    n = len(rows_in)
    expand_x = np.zeros((capacity, hidden), sent.dtype)
    expand_x[:n] = sent
    dynamic_scales = np.zeros(capacity, np.float32)
    dynamic_scales[:n] = floats[:, 0]
    expand_scales = np.zeros(capacity, np.float32)
    expand_scales[:n] = floats[:, 1]
    return {"expand_x": expand_x, "dynamic_scales": dynamic_scales, "expand_scales": expand_scales, "triples": triples}


def _assist(triples: np.ndarray, n: int, capacity: int) -> np.ndarray:
    """V2's ``assist_info_for_combine [A*128]``: row d -> (src rank, token, slot) at 3d..3d+2."""
    out = np.zeros(capacity * 128, np.int32)
    out[: 3 * n] = triples.reshape(-1)
    return out


def moe_distribute_dispatch(
    x, expert_ids, scales=None, x_active_mask=None, expert_scales=None, *, communicator=None, **attrs
):
    """MoeDistributeDispatch on this rank's communicator.

    Args:
        x: ``[BS, H]`` tokens; expert_ids: ``[BS, K]`` int32; scales: ``[E (+1 with shared
        ranks), H]`` float32 smooth scales (quant_mode 2); x_active_mask: ``[BS]`` bool, a
        prefix of trues; expert_scales: ``[BS, K]`` float32 (copied to expand_scales).
    Returns:
        ``expand_x [A, H]``, ``dynamic_scales [A]``, ``expand_idx [BS*K]`` (src slot ->
        offset in its block), ``expert_token_nums [L']``, ``ep_recv_count [W*L']`` (end row of
        block (e, r) at ``e*W + r``), ``tp_recv_count [tp_world_size]``, ``expand_scales [A]``.
    """
    return dispatch(x, expert_ids, scales, x_active_mask, expert_scales, attrs, communicator, v2=False)


def infer_dispatch(sig: Signature, v2: bool) -> None:
    """Shape rules and outputs of both versions (1.20 a, c; 1.21 a, e)."""
    place = mc2.require_group(sig, v2)
    rank = sig.attr("ep_rank_id")
    rows, hidden = sig.dim("x", 0), sig.dim("x", 1)
    top_k = sig.dim("expert_ids", 1)
    sig.same(rows, sig.dim("expert_ids", 0), "x.shape[0] must equal expert_ids.shape[0] (BS)")
    sig.require(not isinstance(rows, int) or rows >= 1, f"BS must be >= 1, got {rows}")
    limit = place.experts + place.special
    if isinstance(top_k, int):
        sig.require(top_k >= 1, f"K must be >= 1, got {top_k}")
        sig.require(top_k <= limit, f"K = {top_k} must be <= {'E + Z + C + N' if v2 else 'E'} = {limit}")
    quant = sig.attr("quant_mode")
    if quant in REFUSED_QUANT:
        sig.fail(f"quant_mode = {quant} ({REFUSED_QUANT[quant]}) is not supported: only 0 and 2", BAD_DTYPE)
    sig.require(quant in (0, 2), f"quant_mode must be 0 (none) or 2 (dynamic per token), got {quant}")
    if sig.has("scales"):
        sig.require(quant == 2, "scales (smooth scales) are read only by quant_mode 2, got quant_mode 0")
        rows_wanted = place.experts + (place.shared_experts if v2 else int(place.shared_ranks > 0))
        sig.same(sig.dim("scales", 0), rows_wanted, "scales must have shared experts + E rows")
        sig.same(sig.dim("scales", 1), hidden, "scales.shape[1] must equal H")
    if sig.has("x_active_mask"):
        shape = sig.input("x_active_mask").shape or ()
        sig.same(sig.dim("x_active_mask", 0), rows, "x_active_mask.shape[0] must equal BS")
        if len(shape) == 2:
            sig.same(shape[1], top_k, "a 2-D x_active_mask must be [BS, K]")
    if sig.has("expert_scales"):
        sig.same(sig.dim("expert_scales", 0), rows, "expert_scales must be [BS, K]")
        sig.same(sig.dim("expert_scales", 1), top_k, "expert_scales must be [BS, K]")
    if v2:
        sig.require(not sig.has("elastic_info"), "elastic_info (dynamic shrinking of the EP group)", BAD_DTYPE)
    mc2.require_global_bs(sig, rows)
    groups = mc2.global_rows(sig.attr("global_bs"), rows, place.world)
    capacity = None if groups is None or not isinstance(top_k, int) else place.capacity(rank, groups, top_k, v2)
    local = 1 if rank < place.shared_ranks else place.per_rank
    sig.output("expand_x", "int8" if quant == 2 else sig.input("x").dtype, (capacity, hidden))
    sig.output("dynamic_scales", "float32", (capacity,))
    if v2:
        sig.output("assist_info_for_combine", "int32", (None if capacity is None else capacity * 128,))
    else:
        slots = rows * top_k if isinstance(rows, int) and isinstance(top_k, int) else None
        sig.output("expand_idx", "int32", (slots,))
    sig.output("expert_token_nums", "int64", (local,))
    sig.output("ep_recv_count", "int32", (place.world * local,))
    sig.output("tp_recv_count", "int32", (sig.attr("tp_world_size"),))
    sig.output("expand_scales", "float32", (capacity,))


def dispatch_limits(sig: Signature, target: Target, v2: bool) -> list[str]:
    """The tiling limits of SPEC-mc2 1.26 (c), for both versions."""
    a = sig.attrs
    world, experts, shared_ranks = a["ep_world_size"], a["moe_expert_num"], a["shared_expert_rank_num"]
    rows, hidden, top_k = known_dim(sig, "x", 0), known_dim(sig, "x", 1), known_dim(sig, "expert_ids", 1)
    mask_rank = len(sig.input("x_active_mask").shape or ()) if sig.has("x_active_mask") else 0
    found = []

    def limit(ok: bool, text: str) -> None:
        if not ok:
            found.append(text)

    if sig.input("x").dtype == "float32":
        found.append("x is float32, which the NPU kernels do not take (float16, bfloat16)")
    if target.name == "ascend910_93":
        if not v2:
            limit(hidden is None or hidden == 7168, f"H = {hidden} must be 7168")
            limit(top_k is None or top_k <= 8, f"K = {top_k} exceeds 8")
            limit(world in (8, 16, 32, 64, 128, 144, 256, 288), f"W = {world} is not one of 8..288 the tiling takes")
            limit(experts <= 512, f"E = {experts} exceeds 512")
            if mask_rank:
                found.append("x_active_mask is ignored by the A3 kernel (every token is combined)")
        else:
            limit(hidden is None or 1024 <= hidden <= 8192, f"H = {hidden} is outside [1024, 8192]")
            limit(top_k is None or top_k <= 16, f"K = {top_k} exceeds 16")
            limit(2 <= world <= 768, f"W = {world} is outside [2, 768]")
            limit(experts <= 1024, f"E = {experts} exceeds 1024")
            if a["comm_alg"] == "fullmesh_v2":
                limit(not mask_rank and mc2.special_count(a) == 0, "fullmesh_v2 takes no mask and no special experts")
            if mask_rank and rows is not None and a["global_bs"] > rows * world:
                found.append(f"a mask with global_bs = {a['global_bs']} > BS * W = {rows * world}")
        limit(rows is None or rows <= 512, f"BS = {rows} exceeds 512")
    elif target.name == "ascend910b":
        limit(world % 8 == 0 and world <= (384 if v2 else 256), f"W = {world} must be a multiple of 8 up to 256")
        limit(experts <= (1024 if v2 else 512), f"E = {experts} exceeds {1024 if v2 else 512}")
        layered = v2 and a["comm_alg"] == "hierarchy"
        limit(layered or experts // max(world, 1) <= 24, f"E / W = {experts // max(world, 1)} exceeds 24")
        limit(hidden is None or (hidden <= 7168 and hidden % 32 == 0), f"H = {hidden} must be <= 7168, 32-aligned")
        limit(rows is None or rows <= 256, f"BS = {rows} exceeds 256")
        limit(top_k is None or top_k <= 16, f"K = {top_k} exceeds 16")
        limit(shared_ranks == 0, "shared experts are not supported on A2")
        limit(mask_rank != 2, "a 2-D x_active_mask is not supported on A2")
    else:
        found.append(f"no MC2 kernel is recorded for {target.name}")
    return found


def _infer(sig: Signature) -> None:
    infer_dispatch(sig, v2=False)


def _limits(sig: Signature, target: Target) -> list[str]:
    return dispatch_limits(sig, target, v2=False)


def dispatch_inputs(v2: bool) -> list[Input]:
    mask_ranks = (1, 2) if v2 else (1,)
    inputs = [
        Input("x", FLOATS, "[BS, H] this rank's tokens", (2,)),
        Input("expert_ids", ("int32",), "[BS, K] top-k expert ids of each token", (2,)),
        Input("scales", ("float32",), "[shared experts + E, H] smooth scales (quant_mode 2)", (2,), optional=True),
        Input(
            "x_active_mask",
            ("bool",),
            "[BS] a prefix of trues" + (", or [BS, K] per slot" if v2 else ""),
            mask_ranks,
            optional=True,
        ),
        Input("expert_scales", ("float32",), "[BS, K] routing weights, copied to expand_scales", (2,), optional=True),
    ]
    if v2:
        inputs.append(Input("elastic_info", ("int32",), "refused: dynamic shrinking of the EP group", optional=True))
    return inputs


def dispatch_outputs(v2: bool) -> list[Output]:
    index = (
        Output("assist_info_for_combine", ("int32",), "[A*128] receiver row d -> (src rank, token, slot) at 3d")
        if v2
        else Output("expand_idx", ("int32",), "[BS*K] sender slot -> offset in its (expert, rank) block; -1 inactive")
    )
    return [
        Output("expand_x", FLOATS + ("int8",), "[A, H] received rows: local expert, source rank, source order"),
        Output("dynamic_scales", ("float32",), "[A] 1/ds per row (quant_mode 2), else 0"),
        index,
        Output("expert_token_nums", ("int64",), "[L'] rows per local expert (type 1) or their cumsum (type 0)"),
        Output("ep_recv_count", ("int32",), "[W*L'] end row of block (e, r) at e*W + r"),
        Output("tp_recv_count", ("int32",), "[tp_world_size] rows received (n)"),
        Output("expand_scales", ("float32",), "[A] expert_scales of each row's slot (0 for shared rows)"),
    ]


def dispatch_attrs(v2: bool) -> list[Attr]:
    attrs = mc2.group_attrs(v2) + [
        Attr("quant_mode", "int", 0, "0 none, 2 dynamic per-token int8; 1, 3, 4 refused"),
        Attr("expert_token_nums_type", "int", 1, "0: expert_token_nums is the cumsum, 1: the counts", (0, 1)),
    ]
    return attrs + (mc2.v2_attrs() if v2 else [])


_EXAMPLE = Example(attrs=mc2.EXAMPLE_GROUP, ranks=mc2.EXAMPLE_TOKENS, rank_attrs=mc2.EXAMPLE_RANK_ATTRS)

MOE_DISTRIBUTE_DISPATCH = OpDef(
    "MoeDistributeDispatch",
    __doc__,
    inputs=dispatch_inputs(v2=False),
    outputs=dispatch_outputs(v2=False),
    attrs=dispatch_attrs(v2=False),
    infer=_infer,
    kernel=moe_distribute_dispatch,
    needs=("communicator",),
    example=_EXAMPLE,
    npu_limits=_limits,
)

DEFINITIONS = [MOE_DISTRIBUTE_DISPATCH]
