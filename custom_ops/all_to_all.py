"""AllToAll: the ragged exchange that precedes MoeReRoutingV2 (and onnxruntime's equal-split one).

Rank-major convention: ``data`` rows are grouped by destination rank (``send_counts[d]`` rows
for rank d, in rank order); ``recv_data`` rows are grouped by source rank
(``recv_counts[s]`` rows from rank s). The kernel knows nothing of MPI or threads: the
runtime injects a communicator (see :class:`Communicator`).

With ``group_ranks`` the exchange runs among those ranks only (``custom_ops/groups.py``): N is
the group's size and rank s the group's s-th rank.

Every rank first shares whether its own input is valid, so a bad input on one rank stops all
ranks with the same error instead of leaving the others waiting in the exchange. Counts are
summed as Python integers: int64 counts whose sum wraps around are refused, not trusted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from .errors import BAD_CONSTRAINT, NO_COMMUNICATOR, MoeOpError
from .groups import GROUP_RANKS
from .opdef import GROUP_RANKS_ATTR, Attr, Example, Input, OpDef, Output, Signature

ANY_DTYPE = (
    "float32",
    "float16",
    "bfloat16",
    "float8e4m3fn",
    "float8e5m2",
    "float64",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "int64",
    "bool",
)


class CollectiveMismatch(RuntimeError):
    """Ranks met in one collective while doing different things: their models' collectives
    do not line up (e.g. a rank's model has no AllToAll where its peers' have one)."""


def rank_list(ranks: Iterable[int]) -> str:
    """``rank 2`` or ``ranks 0, 1, 3``."""
    ordered = sorted(ranks)
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


def check_labels(labels: Sequence[str], collective: int, members: Sequence[int] | None = None) -> None:
    """Raise :class:`CollectiveMismatch` unless every rank's label of collective number
    ``collective`` (counted from 1 on each rank) is the same; ``members[i]``: the world rank
    the message names for ``labels[i]`` (a group's communicator), else ``i``."""
    reached: dict[str, list[int]] = {}
    for rank, label in enumerate(labels):
        reached.setdefault(label, []).append(rank if members is None else members[rank])
    if len(reached) > 1:
        what = "; ".join(f"{rank_list(ranks)} reached {label}" for label, ranks in reached.items())
        raise CollectiveMismatch(
            f"the ranks' collectives do not match at collective {collective}: {what} "
            "(every rank's model must run the same collectives in the same order)"
        )


class Communicator(Protocol):
    """What the AllToAll kernels need of a communication backend."""

    rank: int
    size: int

    def allgather(self, value: object, label: str) -> list:
        """Every rank's ``value``, in rank order (small Python objects).

        ``label`` says what this collective is on the calling rank (e.g. ``"AllToAll"``). If
        the ranks' labels differ (their models' collectives do not line up), the communicator
        raises on every rank, naming what each rank reached.
        """

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        """Exchange rows of a 2-D uint8 array: ``send_counts[d]`` rows go to rank d, and
        ``recv_counts[s]`` rows arrive from rank s, stacked in source-rank order."""


def _exchange(
    data: np.ndarray, send_counts: np.ndarray, problem: str | None, communicator: Communicator, label: str
) -> tuple[np.ndarray, np.ndarray]:
    """Agree on validity, swap counts, swap rows. Returns ``(recv_data, recv_counts)``."""
    if communicator is None:
        raise MoeOpError(NO_COMMUNICATOR)
    reports = communicator.allgather((problem, send_counts.tolist() if problem is None else None), label)
    for rank, (rank_problem, _) in enumerate(reports):
        if rank_problem is not None:
            where = "" if rank == communicator.rank else f" (reported by rank {rank})"
            raise MoeOpError(f"rank {rank}: {rank_problem}{where}", BAD_CONSTRAINT)
    recv_counts = np.array([counts[communicator.rank] for _, counts in reports], np.int64)
    row_bytes = data.dtype.itemsize * int(np.prod(data.shape[1:], dtype=np.int64))
    send = np.ascontiguousarray(data).view(np.uint8).reshape(len(data), row_bytes)
    recv = communicator.alltoallv(send, send_counts.astype(np.int64), recv_counts)
    recv_data = recv.view(data.dtype).reshape((int(recv_counts.sum()),) + data.shape[1:])
    return recv_data, recv_counts


def all_to_all(data, send_counts, *, communicator=None):
    """Ragged AllToAll.

    Args:
        data: ``[S, ...]`` any dtype; rows grouped by destination rank.
        send_counts: ``[N]`` int64, rows for each destination rank (N = the size of the
            communicator: the world's, or the group's with ``group_ranks``).
    Returns:
        ``recv_data [R, ...]`` grouped by source rank, and ``recv_counts [N]`` int64.
    """
    problem = None
    size = None if communicator is None else communicator.size
    counts = send_counts.tolist()  # Python ints: their sum cannot wrap around
    if size is not None and send_counts.shape != (size,):
        problem = f"send_counts must be [N] = [{size}] (the group's size), got {list(send_counts.shape)}"
    elif any(c < 0 for c in counts):
        problem = f"send_counts must be >= 0, got {counts}"
    elif sum(counts) != len(data):
        problem = f"sum(send_counts) = {sum(counts)} must equal data rows S = {len(data)} (send_counts = {counts})"
    return _exchange(data, send_counts, problem, communicator, "AllToAll")


def all_to_all_equal(data, *, group_size, communicator=None):
    """onnxruntime's ``com.microsoft::AllToAll``: S/N rows to each of N = ``group_size`` ranks."""
    problem = None
    if communicator is not None and group_size != communicator.size:
        problem = f"group_size = {group_size} must equal the world size {communicator.size}"
    elif len(data) % group_size:
        problem = f"data rows S = {len(data)} must divide evenly by group_size = {group_size}"
    send_counts = np.full(group_size, len(data) // group_size, np.int64)
    recv_data, _ = _exchange(data, send_counts, problem, communicator, "AllToAll (com.microsoft)")
    return (recv_data,)


def _infer(sig: Signature) -> None:
    data = sig.input("data")
    sig.require(data.shape is None or len(data.shape) >= 1, "data must have rank >= 1 (rows to send), got a scalar")
    rest = None if data.shape is None else data.shape[1:]
    ranks = sig.attr(GROUP_RANKS)
    counts = sig.input("send_counts").shape
    if ranks is not None and counts is not None:
        sig.same(counts[0], len(ranks), f"send_counts must be [N], N = the size of group_ranks {ranks}")
    sig.output("recv_data", data.dtype, None if rest is None else (None,) + rest)
    sig.output("recv_counts", "int64", sig.input("send_counts").shape)


def _infer_equal(sig: Signature) -> None:
    sig.require(sig.attr("group_size") > 0, f"group_size must be > 0, got {sig.attr('group_size')}")
    data = sig.input("input")
    sig.require(data.shape is None or len(data.shape) >= 1, "input must have rank >= 1 (rows to send), got a scalar")
    sig.output("output", data.dtype, data.shape)


#: 2 ranks: rank 0 sends 1 row to itself and 2 to rank 1, rank 1 sends 2 rows to rank 0 and 1 to itself
_EXAMPLE = Example(
    ranks=(
        {"data": np.array([[0.0], [1.0], [2.0]], np.float32), "send_counts": np.array([1, 2], np.int64)},
        {"data": np.array([[10.0], [11.0], [12.0]], np.float32), "send_counts": np.array([2, 1], np.int64)},
    ),
)


ALL_TO_ALL = OpDef(
    "AllToAll",
    __doc__,
    inputs=[
        Input("data", ANY_DTYPE, "[S, ...] rows grouped by destination rank"),
        Input("send_counts", ("int64",), "[N] rows for each destination rank", (1,)),
    ],
    outputs=[
        Output("recv_data", ANY_DTYPE, "[R, ...] rows grouped by source rank"),
        Output("recv_counts", ("int64",), "[N] rows received from each source rank"),
    ],
    attrs=[GROUP_RANKS_ATTR],
    infer=_infer,
    kernel=all_to_all,
    needs=("communicator",),
    example=_EXAMPLE,
)

MS_ALL_TO_ALL = OpDef(
    "AllToAll",
    "onnxruntime's com.microsoft::AllToAll: equal splits over group_size ranks.",
    inputs=[Input("input", ANY_DTYPE, "[S, ...] S/N rows for each rank, in rank order")],
    outputs=[Output("output", ANY_DTYPE, "[S, ...] S/N rows from each rank, in rank order")],
    attrs=[Attr("group_size", "int", None, "number of ranks", required=True)],
    infer=_infer_equal,
    kernel=all_to_all_equal,
    domain="com.microsoft",
    needs=("communicator",),
)

DEFINITIONS = [ALL_TO_ALL, MS_ALL_TO_ALL]
