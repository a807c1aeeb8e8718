"""AllGather: every rank's tensor, stacked along a new leading dim in rank order (SPEC 1.6b).

``y[r] = x on rank r``, so ``y`` is ``[N, *x.shape]``; every rank must give the same shape and
dtype. With ``group_ranks`` it gathers over those ranks only (``custom_ops/groups.py``): N is the
group's size, r the group's r-th rank (megatron-core's expert-tensor-parallel gather).
Megatron-style layers use it to share per-expert token counts before the AllToAll.

The kernel knows nothing of MPI or threads: it runs on the injected communicator's two
methods (``allgather`` of small objects, ``alltoallv`` of byte rows, see
:class:`.all_to_all.Communicator`). Every rank first shares the shape and dtype it holds, so
a mismatch is the same error on every rank instead of a hang or a garbled exchange.
"""

from __future__ import annotations

import numpy as np

from .all_to_all import ANY_DTYPE, Communicator
from .errors import BAD_CONSTRAINT, NO_COMMUNICATOR, MoeOpError
from .opdef import GROUP_RANKS_ATTR, Example, Input, OpDef, Output, Signature


def _layout(x: np.ndarray) -> str:
    return f"{x.dtype}{list(x.shape)}"


def all_gather(x, *, communicator: Communicator | None = None):
    """Gather ``x`` from every rank.

    Args:
        x: any shape and dtype, the same on every rank.
    Returns:
        ``(y,)`` with ``y [N, *x.shape]``, ``y[r]`` = rank r's ``x`` (N = the communicator's
        size: the world's, or the group's with ``group_ranks``, r its rank in the group).
    """
    if communicator is None:
        raise MoeOpError(NO_COMMUNICATOR)
    layouts = communicator.allgather(_layout(x), "AllGather")
    for rank, layout in enumerate(layouts):
        if layout != layouts[0]:
            raise MoeOpError(
                f"every rank must give x of one shape and dtype: rank 0 has {layouts[0]}, rank {rank} has {layout}",
                BAD_CONSTRAINT,
            )
    size = communicator.size
    row = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    send = np.ascontiguousarray(np.broadcast_to(row, (size, row.size)))  # one copy of x for each rank
    ones = np.ones(size, np.int64)
    recv = communicator.alltoallv(send, ones, ones)  # row s = rank s's bytes
    return (np.ascontiguousarray(recv).view(x.dtype).reshape((size,) + x.shape),)


def _infer(sig: Signature) -> None:
    x = sig.input("x")
    sig.output("y", x.dtype, None if x.shape is None else (None,) + x.shape)


#: 2 ranks, each holding a [2] vector
_EXAMPLE = Example(
    ranks=({"x": np.array([1, 2], np.int32)}, {"x": np.array([3, 4], np.int32)}),
)


ALL_GATHER = OpDef(
    "AllGather",
    __doc__,
    inputs=[Input("x", ANY_DTYPE, "any shape; the same shape and dtype on every rank")],
    outputs=[Output("y", ANY_DTYPE, "[N, *x.shape]: y[r] is rank r's x (N: the world's or the group's size)")],
    attrs=[GROUP_RANKS_ATTR],
    infer=_infer,
    kernel=all_gather,
    needs=("communicator",),
    example=_EXAMPLE,
)

DEFINITIONS = [ALL_GATHER]
