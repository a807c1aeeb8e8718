"""What the MC2 dispatch / combine ops share (SPEC-mc2 1.19): expert placement, the group's
static attributes, the cross-rank agreement and the packed-row exchange.

Placement (``expert_shard_type 0``): ranks ``0..S-1`` hold shared experts, MoE expert ``g``
lives on rank ``S + g // L`` as local expert ``g % L`` (``L = E / (W - S)``).

Every exchange follows AllToAll's discipline (:mod:`.all_to_all`): each rank first shares,
through ``allgather``, its verdict on its own input and what its peers must know (counts,
attributes, row layout), so a bad input anywhere is the same :class:`MoeOpError` on every
rank and no rank waits in an exchange its peers never reach. Rows cross as packed byte
rows: the payload (a token, or its int8 quantisation) beside its bookkeeping columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .all_to_all import Communicator, rank_list
from .errors import BAD_CONSTRAINT, BAD_DTYPE, MoeOpError
from .groups import GROUP_RANKS
from .opdef import GROUP_RANKS_ATTR, Attr, Signature

#: attributes every rank must give the same value (SPEC-mc2 1.19 a), besides the row layout
GROUP_ATTRS = (
    "group_ep",
    "ep_world_size",
    "moe_expert_num",
    "expert_shard_type",
    "shared_expert_num",
    "shared_expert_rank_num",
    "global_bs",
)
#: V2 adds these
GROUP_ATTRS_V2 = GROUP_ATTRS + ("comm_alg", "zero_expert_num", "copy_expert_num", "const_expert_num")
#: V2's accepted communication algorithms: one golden for all (SPEC-mc2 1.21 d)
COMM_ALGS = ("", "fullmesh_v1", "fullmesh_v2", "fullmesh", "hierarchy")


def group_attrs(v2: bool) -> list[Attr]:
    """The EP/TP group attributes of every op of the family (GE op-def names and defaults)."""
    attrs = [
        Attr("group_ep", "string", None, "name of the EP communicator (length in [1, 128))", required=True),
        Attr("ep_world_size", "int", None, "W: ranks of the EP group (the communicator's size)", required=True),
        Attr("ep_rank_id", "int", None, "this rank in the EP group (the communicator's rank)", required=True),
        Attr("moe_expert_num", "int", None, "E: MoE experts over the W - S MoE ranks", required=True),
        Attr("group_tp", "string", "", "TP communicator; not read when tp_world_size <= 1"),
        Attr("tp_world_size", "int", 0, "0 or 1 (no TP); 2 (TP) is refused in this version"),
        Attr("tp_rank_id", "int", 0, "0 without TP"),
        Attr("expert_shard_type", "int", 0, "0: shared ranks first, MoE experts in rank order", (0,)),
        Attr(
            "shared_expert_num",
            "int",
            1,
            "shared experts (V1: 1; V2: 0..4, 0 meaning none when shared_expert_rank_num is 0)",
        ),
        Attr("shared_expert_rank_num", "int", 0, "S: ranks 0..S-1 hold the shared experts"),
        Attr("global_bs", "int", 0, "G: the group's token capacity, 0 (= BS * W) or max BS * W; sizes outputs"),
        GROUP_RANKS_ATTR,
    ]
    return attrs


def v2_attrs() -> list[Attr]:
    return [
        Attr("comm_alg", "string", "", "communication algorithm; one golden for all", COMM_ALGS),
        Attr("zero_expert_num", "int", 0, "Z: ids [E, E+Z) are zero experts (not sent)"),
        Attr("copy_expert_num", "int", 0, "C: ids [E+Z, E+Z+C) are copy experts (not sent)"),
        Attr("const_expert_num", "int", 0, "N: ids [E+Z+C, E+Z+C+N) are constant experts (not sent)"),
    ]


@dataclass(frozen=True)
class Placement:
    """Where experts live. ``shared_experts`` is V2's normalised ``shared_expert_num'`` (V1:
    1 when ``S > 0``, else 0); ``special`` = ``Z + C + N`` (V2's experts computed by the
    combine, never sent)."""

    world: int  # W
    shared_ranks: int  # S
    experts: int  # E
    shared_experts: int
    special: int = 0

    @property
    def per_rank(self) -> int:
        """L: MoE experts per MoE rank."""
        return self.experts // (self.world - self.shared_ranks)

    @property
    def replicas(self) -> int:
        """R: ranks per shared expert (V2); 0 without shared experts."""
        return self.shared_ranks // self.shared_experts if self.shared_experts else 0

    def host(self, expert: np.ndarray) -> np.ndarray:
        """MoE expert id -> the EP rank that holds it."""
        return self.shared_ranks + expert // self.per_rank

    def capacity(self, rank: int, global_rows: int, top_k: int, v2: bool) -> int:
        """A: rows of ``expand_x`` on ``rank`` for a group capacity ``G = global_rows`` (1.19 b)."""
        if rank >= self.shared_ranks:
            return global_rows * min(self.per_rank, top_k)
        if not v2:
            return global_rows // self.shared_ranks
        return (global_rows // self.world) * -(-self.world // self.replicas)


def shared_experts_of(sig_or_attrs, v2: bool) -> int:
    """``shared_expert_num'``: 0 without shared ranks (the default ``shared_expert_num=1,
    S=0`` means none), else the attribute (V1: it must be 1)."""
    attrs = sig_or_attrs.attrs if isinstance(sig_or_attrs, Signature) else sig_or_attrs
    return 0 if attrs["shared_expert_rank_num"] == 0 else attrs["shared_expert_num"]


def special_count(attrs: dict) -> int:
    return attrs.get("zero_expert_num", 0) + attrs.get("copy_expert_num", 0) + attrs.get("const_expert_num", 0)


def placement_of(attrs: dict, v2: bool) -> Placement:
    return Placement(
        attrs["ep_world_size"],
        attrs["shared_expert_rank_num"],
        attrs["moe_expert_num"],
        shared_experts_of(attrs, v2),
        special_count(attrs) if v2 else 0,
    )


def require_group(sig: Signature, v2: bool) -> Placement:
    """The static rules on the group attributes (SPEC-mc2 1.20 c, 1.21 e); the placement."""
    a = sig.attrs
    world, shared_ranks, experts = a["ep_world_size"], a["shared_expert_rank_num"], a["moe_expert_num"]
    sig.require(1 <= len(a["group_ep"]) < 128, f"group_ep must have length in [1, 128), got {len(a['group_ep'])}")
    sig.require(world >= 1, f"ep_world_size must be >= 1, got {world}")
    sig.require(0 <= a["ep_rank_id"] < world, f"ep_rank_id = {a['ep_rank_id']} must be in [0, {world})")
    require_group_size(sig)
    sig.require(experts > 0, f"moe_expert_num must be > 0, got {experts}")
    sig.require(0 <= shared_ranks < world, f"shared_expert_rank_num = {shared_ranks} must be in [0, {world})")
    sig.require(
        experts % (world - shared_ranks) == 0,
        f"moe_expert_num = {experts} must divide evenly over the W - S = {world - shared_ranks} MoE ranks",
    )
    sig.require(a["tp_world_size"] in (0, 1, 2), f"tp_world_size must be 0, 1 or 2, got {a['tp_world_size']}")
    sig.require(
        a["tp_world_size"] != 2,
        "tp_world_size = 2 (tensor parallelism inside the EP exchange) is not supported in this version "
        "(SPEC-mc2 1.19 h; the newest CANN no longer supports it either)",
        BAD_DTYPE,
    )
    sig.require(a["tp_rank_id"] == 0, f"tp_rank_id must be 0 without TP, got {a['tp_rank_id']}")
    count = a["shared_expert_num"]
    if not v2:
        if shared_ranks > 0:
            sig.require(world % shared_ranks == 0, f"W = {world} must be a multiple of S = {shared_ranks}")
            sig.require(count == 1, f"shared_expert_num must be 1 (the only value V1 supports), got {count}")
    else:
        sig.require(0 <= count <= 4, f"shared_expert_num must be in [0, 4], got {count}")
        if shared_ranks == 0:
            sig.require(count in (0, 1), f"shared_expert_num must be 0 or 1 without shared ranks, got {count}")
        else:
            sig.require(count > 0, "shared_expert_num must be > 0 when shared_expert_rank_num > 0")
            sig.require(
                shared_ranks % count == 0,
                f"shared_expert_rank_num = {shared_ranks} must be a multiple of shared_expert_num = {count}",
            )
        for name in ("zero_expert_num", "copy_expert_num", "const_expert_num"):
            sig.require(a[name] >= 0, f"{name} must be >= 0, got {a[name]}")
        sig.require(experts + special_count(a) < 2**31, "E + Z + C + N must be < 2^31")
    return placement_of(a, v2)


def require_group_size(sig: Signature) -> None:
    """``ep_world_size`` is the size of the group the op runs on (``group_ranks``, when given)."""
    ranks = sig.attr(GROUP_RANKS)
    if ranks is not None:
        world = sig.attr("ep_world_size")
        sig.require(
            world == len(ranks),
            f"ep_world_size = {world} must equal the size of group_ranks {ranks} ({len(ranks)} ranks)",
        )


def require_global_bs(sig: Signature, rows) -> None:
    """1.19 (b)'s rules this rank can tell alone (``rows`` = its BS, possibly symbolic)."""
    world, global_bs = sig.attr("ep_world_size"), sig.attr("global_bs")
    if global_bs:
        sig.require(global_bs % world == 0, f"global_bs = {global_bs} must be a multiple of W = {world}")
        if isinstance(rows, int):
            sig.require(global_bs >= world * rows, f"global_bs = {global_bs} must be >= W * BS = {world * rows}")


def global_rows(global_bs: int, rows, world: int):
    """G: ``global_bs`` when given, else ``BS * W`` (None while BS is symbolic)."""
    if global_bs:
        return global_bs
    return rows * world if isinstance(rows, int) else None


def take_rows(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``array[index]`` for a 2-D array, gathered as bytes (ml_dtypes' bfloat16 has no fast
    fancy-indexing path: its rows would be copied element by element)."""
    array = np.ascontiguousarray(array)
    raw = array.view(np.uint8).reshape(len(array), array.dtype.itemsize * array.shape[1])
    return raw[index].view(array.dtype).reshape(len(index), array.shape[1])


def widen(array: np.ndarray) -> np.ndarray:
    """Exact float32 of float16 / bfloat16 / float32 values (bfloat16 by its bits: its
    upper half of a float32)."""
    if array.dtype.itemsize == 2 and array.dtype != np.float16:
        return (array.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


# --- the agreement --------------------------------------------------------------------------


def agree(communicator: Communicator | None, label: str, problem: str | None, shared: object) -> list:
    """Every rank's ``shared`` (rank order), once every rank found its own input sound.

    Raises the same :class:`MoeOpError` on every rank when any rank reports a problem."""
    if communicator is None:
        raise MoeOpError("no communicator: run the model with moe_onnx.ranks (threads or mpi) or moe_onnx.torch")
    reports = communicator.allgather((problem, None if problem else shared), label)
    fail_on_problems(communicator, [rank_problem for rank_problem, _ in reports])
    return [rank_shared for _, rank_shared in reports]


def fail_on_problems(communicator: Communicator, problems: Sequence[str | None]) -> None:
    """Raise the first rank's problem (the same on every rank), naming the rank."""
    for rank, problem in enumerate(problems):
        if problem is not None:
            where = "" if rank == communicator.rank else f" (reported by rank {rank})"
            raise MoeOpError(f"rank {rank}: {problem}{where}", BAD_CONSTRAINT)


def local_group_problem(communicator: Communicator | None, attrs: dict) -> str | None:
    """The rank's own attributes against the communicator it runs on."""
    if communicator is None:
        return None  # agree() names the missing communicator
    if attrs["ep_world_size"] != communicator.size:
        return f"ep_world_size = {attrs['ep_world_size']} but the communicator has {communicator.size} ranks"
    if attrs["ep_rank_id"] != communicator.rank:
        return f"ep_rank_id = {attrs['ep_rank_id']} but this is rank {communicator.rank} of the communicator"
    return None


def require_same(values: Sequence[object], what: str) -> None:
    """Every rank's ``values[r]`` must be equal (an error naming who holds what otherwise)."""
    held: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        held.setdefault(repr(value), []).append(rank)
    if len(held) > 1:
        found = "; ".join(f"{rank_list(ranks)}: {value}" for value, ranks in held.items())
        raise MoeOpError(f"every rank must give the same {what}, got {found}", BAD_CONSTRAINT)


def require_same_group(configs: Sequence[dict]) -> None:
    """The group attributes and row layout, equal on every rank (SPEC-mc2 1.19 a)."""
    for name in configs[0]:
        require_same([config[name] for config in configs], name)


def require_group_rows(global_bs: int, rows: Sequence[int]) -> None:
    """``global_bs == 0`` requires one BS on every rank (1.19 b)."""
    if not global_bs:
        require_same(rows, "BS (x.shape[0]) when global_bs = 0 (else set global_bs = max BS * W)")


# --- rows as bytes ---------------------------------------------------------------------------


def pack(columns: Sequence[np.ndarray]) -> np.ndarray:
    """Columns ``[n, ...]`` of any dtypes -> ``uint8 [n, total bytes]``, side by side."""
    rows = len(columns[0])
    widths = [c.dtype.itemsize * int(np.prod(c.shape[1:], dtype=np.int64)) for c in columns]
    out = np.empty((rows, sum(widths)), np.uint8)
    start = 0
    for column, width in zip(columns, widths):
        out[:, start : start + width] = np.ascontiguousarray(column).view(np.uint8).reshape(rows, width)
        start += width
    return out


def unpack(rows: np.ndarray, layout: Sequence[tuple[np.dtype, int]]) -> list[np.ndarray]:
    """``uint8 [n, total bytes]`` -> the columns ``[n, width]`` of ``layout`` ((dtype, width) each):
    views where the byte offsets allow, else copies."""
    out, start = [], 0
    for dtype, width in layout:
        nbytes = np.dtype(dtype).itemsize * width
        part = rows[:, start : start + nbytes]
        if len(rows) == 0 or start % np.dtype(dtype).itemsize or rows.strides[0] % np.dtype(dtype).itemsize:
            part = np.ascontiguousarray(part)
        out.append(part.view(dtype).reshape(len(rows), width))
        start += nbytes
    return out


def swap(communicator: Communicator, send: np.ndarray, send_counts, recv_counts) -> np.ndarray:
    """Rows of ``send`` (uint8, one width on every rank; ``send_counts[d]`` rows for rank d,
    in rank order) to their ranks; returns the rows received, by source rank."""
    return np.asarray(
        communicator.alltoallv(send, np.asarray(send_counts, np.int64), np.asarray(recv_counts, np.int64))
    )


def regroup(counts: np.ndarray) -> np.ndarray:
    """Row order turning rows laid out by ``(p, q)`` (p-major, ``counts[p, q]`` rows each) into
    ``(q, p)`` order (q-major); the indices into the p-major rows. The receive side of every
    op here: source rank, then local expert -> local expert, then source rank."""
    starts = (np.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)
    return np.concatenate(
        [
            np.arange(starts[p, q], starts[p, q] + counts[p, q])
            for q in range(counts.shape[1])
            for p in range(len(counts))
        ]
        + [np.zeros(0, np.int64)]
    ).astype(np.int64)


# --- the all-to-all-v count lists (SPEC-mc2 1.24 b, c) ------------------------------------


def counts_problem(world: int, experts: int, send_counts, recv_counts, rows: int, rows_name: str) -> str | None:
    """The lists of one rank: ``W*E_l`` non-negative counts each, ``sum(send_counts) == rows``."""
    for name, counts in (("send_counts", send_counts), ("recv_counts", recv_counts)):
        if len(counts) != world * experts:
            return f"{name} must hold W * E_l = {world} * {experts} counts, got {len(counts)}"
        if any(c < 0 for c in counts):
            return f"{name} must be >= 0, got {_short_list(counts)}"
    if sum(send_counts) != rows:
        return f"sum(send_counts) = {sum(send_counts)} must equal {rows_name} = {rows}"
    return None


def require_counts_match(sends: Sequence[Sequence[int]], recvs: Sequence[Sequence[int]], experts: int) -> None:
    """``recv_counts_m[i*E_l + le] == send_counts_i[m*E_l + le]`` for every pair of ranks (the
    device trusts the host's lists; the golden checks them, the same error on every rank)."""
    world = len(sends)
    for m in range(world):
        for i in range(world):
            got = list(recvs[m][i * experts : (i + 1) * experts])
            sent = list(sends[i][m * experts : (m + 1) * experts])
            if got != sent:
                raise MoeOpError(
                    f"rank {m}'s recv_counts from rank {i} are {got}, but rank {i} sends it {sent} "
                    "(recv_counts[i*E_l + le] must equal rank i's send_counts[m*E_l + le])"
                )


def _short_list(values: Sequence[int], limit: int = 16) -> str:
    shown = list(values[:limit])
    return str(shown) if len(values) <= limit else f"{shown[:-1]} ... ({len(values)} counts)"


# --- masks ------------------------------------------------------------------------------------


def active_slots(mask: np.ndarray | None, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, str | None]:
    """``(slots [BS, K] bool, tokens [BS] bool, problem)`` of ``x_active_mask`` (1.21 c): a 1-D
    mask must be a prefix of trues; a 2-D one marks slots, a token taking part if any slot does."""
    rows, top_k = shape
    if mask is None:
        return np.ones(shape, bool), np.ones(rows, bool), None
    if mask.ndim == 1:
        active = int(mask.sum())
        if not mask[:active].all():
            first = int(np.flatnonzero(~mask)[0])
            return (
                np.zeros(shape, bool),
                np.zeros(rows, bool),
                f"x_active_mask must be a prefix of trues (token {first} is false, a later one true)",
            )
        return np.repeat(mask[:, None], top_k, axis=1), mask.copy(), None
    return mask.copy(), np.asarray(mask.any(axis=1)), None


def id_problem(ids: np.ndarray, slots: np.ndarray, limit: int, what: str) -> str | None:
    """Active slots must hold ids in ``[0, limit)``, distinct within a token (1.19 c)."""
    bad = slots & ((ids < 0) | (ids >= limit))
    if bad.any():
        t, j = (int(i) for i in np.argwhere(bad)[0])
        return f"expert_ids[{t}, {j}] = {int(ids[t, j])} is outside [0, {limit}) ({what})"
    masked = np.where(slots, ids.astype(np.int64), -1 - np.arange(ids.shape[1]))  # inactive slots never collide
    ordered = np.sort(masked, axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
    if repeated.any():
        t = int(np.flatnonzero(repeated)[0])
        return f"token {t} names one expert twice among its active slots: expert_ids[{t}] = {ids[t].tolist()}"
    return None


def shared_chunk(shared_rank: int, rank: int, rows: int, shared_ranks: int) -> tuple[int, int]:
    """V1: the tokens ``[lo, hi)`` MoE rank ``rank`` (with ``rows`` active tokens) sends to
    shared rank ``shared_rank``: S contiguous chunks rotated by ``rank`` (1.20 b)."""
    base = rank * rows // shared_ranks
    lo = (shared_rank + rank) * rows // shared_ranks - base
    hi = (shared_rank + rank + 1) * rows // shared_ranks - base
    return lo, hi


def own_split(shared_rank: int, rows: int, shared_ranks: int) -> list[int]:
    """V1: a shared rank's synthetic split of its own ``rows`` tokens into S counts (``GetCumSum``)."""
    return [
        (i + 1 + shared_rank) * rows // shared_ranks - (i + shared_rank) * rows // shared_ranks
        for i in range(shared_ranks)
    ]


#: the reference pages' examples (docs/operators/): 2 ranks of 2 tokens, H = 2, one expert per
#: rank (E = 2, K = 1); rank 0's tokens go to experts 0 and 1, rank 1's to experts 1 and 0
EXAMPLE_GROUP = {"group_ep": "ep", "ep_world_size": 2, "moe_expert_num": 2}
EXAMPLE_RANK_ATTRS = ({"ep_rank_id": 0}, {"ep_rank_id": 1})
EXAMPLE_TOKENS = (
    {"x": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "expert_ids": np.array([[0], [1]], np.int32)},
    {"x": np.array([[5.0, 6.0], [7.0, 8.0]], np.float32), "expert_ids": np.array([[1], [0]], np.int32)},
)
#: what the experts returned for the rows each rank received (the dispatch's expand_x times 10;
#: rows past the 2 received are the capacity's unused rows)
EXAMPLE_EXPERT_ROWS = (
    np.array([[10.0, 20.0], [70.0, 80.0], [0.0, 0.0], [0.0, 0.0]], np.float32),
    np.array([[30.0, 40.0], [50.0, 60.0], [0.0, 0.0], [0.0, 0.0]], np.float32),
)
EXAMPLE_WEIGHTS = (np.array([[0.5], [2.0]], np.float32), np.array([[1.0], [0.25]], np.float32))
