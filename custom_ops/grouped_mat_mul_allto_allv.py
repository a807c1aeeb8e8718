"""GroupedMatMulAlltoAllv: one product per local expert, then the all-to-all-v back to the
tokens' ranks (SPEC-mc2 1.25; torch_npu ``npu_gmm_alltoallv``, FC2 of MindSpeed's mc2
dispatcher): the exact inverse movement of :mod:`.allto_allv_grouped_mat_mul`.

``send_counts[i*E_l + le]`` rows of local expert ``le`` go back to rank i;
``recv_counts[i*E_l + le]`` rows come from rank i's local expert ``le`` (MindSpeed passes the
forward's lists swapped). ``gmm_x`` rows are **expert-major** (local expert, then destination
rank: the forward's ``permute_out`` layout); ``gmm_x[rows of le] @ W[le]`` (``W[le].T`` with
``trans_gmm_weight``, float32 accumulation rounded once) is regrouped rank-major and sent;
``y`` rows are by source rank, then its local expert: ascending global expert ``i*E_l + le``
(the forward's ``gmm_x`` layout). ``mm_y = mm_x @ mm_weight`` is independent.
"""

from __future__ import annotations

import numpy as np

from . import mc2
from .allto_allv_grouped_mat_mul import _EXAMPLE as FORWARD_EXAMPLE
from .allto_allv_grouped_mat_mul import (
    agree_on_counts,
    exchange_rows,
    gmm_attrs,
    gmm_inputs,
    gmm_limits,
    plain_product,
    require_gmm_inputs,
)
from .dtypes import FLOATS
from .grouped_matmul import grouped_matmul
from .opdef import Example, OpDef, Output, Signature

LABEL = "GroupedMatMulAlltoAllv"


def grouped_mat_mul_allto_allv(
    gmm_x,
    gmm_weight,
    send_counts_tensor=None,
    recv_counts_tensor=None,
    mm_x=None,
    mm_weight=None,
    *,
    group,
    ep_world_size,
    send_counts,
    recv_counts,
    trans_gmm_weight=0,
    trans_mm_weight=0,
    communicator=None,
):
    """GroupedMatMulAlltoAllv on this rank's communicator.

    Args:
        gmm_x: ``[A, H1]`` expert-major rows; gmm_weight ``[E_l, H1, N1]`` (``[E_l, N1, H1]``);
        mm_x ``[BS, H2]``, mm_weight ``[H2, N2]`` (``[N2, H2]``): optional.
    Returns:
        ``y [BSK, N1]`` (by source rank, then local expert; ``BSK = sum(recv_counts)``),
        ``mm_y [BS, N2]`` or None.
    """
    experts = gmm_weight.shape[0]
    problem = mc2.counts_problem(ep_world_size, experts, send_counts, recv_counts, len(gmm_x), "gmm_x.shape[0]")
    outer = gmm_weight.shape[1 if trans_gmm_weight else 2]
    config = {"group": group, "ep_world_size": ep_world_size, "E_l": experts, "rows": f"{gmm_x.dtype}[*, {outer}]"}
    send_grid, recv_grid = agree_on_counts(communicator, LABEL, config, send_counts, recv_counts, problem)
    (products,) = grouped_matmul(
        gmm_x,
        gmm_weight,
        None,
        send_grid.sum(axis=0),
        group_type=0,
        group_list_type=1,
        transpose_weight=trans_gmm_weight,
    )
    rank_major = products[mc2.regroup(send_grid.T)]  # (le, i) -> (i, le)
    y = exchange_rows(rank_major, send_grid, recv_grid, communicator)
    return y, plain_product(mm_x, mm_weight, trans_mm_weight)


def _infer(sig: Signature) -> None:
    _, _, outer = require_gmm_inputs(sig)
    sig.output("y", sig.input("gmm_x").dtype, (sum(sig.attr("recv_counts")), outer))


#: the inverse of AlltoAllvGroupedMatMul's example (the same ranks, weights and counts): each
#: rank's expert rows, expert-major (rank 0's expert doubles, rank 1's swaps the columns), go
#: back where they came from
_EXAMPLE = Example(
    attrs={"group": "ep", "ep_world_size": 2},
    ranks=tuple(
        {**rank, "gmm_x": rows}
        for rank, rows in zip(
            FORWARD_EXAMPLE.ranks,
            (
                np.array([[1.0, 2.0], [7.0, 8.0], [9.0, 10.0]], np.float32),
                np.array([[3.0, 4.0], [5.0, 6.0], [11.0, 12.0]], np.float32),
            ),
        )
    ),
    rank_attrs=FORWARD_EXAMPLE.rank_attrs,
)


GROUPED_MAT_MUL_ALLTO_ALLV = OpDef(
    "GroupedMatMulAlltoAllv",
    __doc__,
    inputs=gmm_inputs("[A, H1] rows expert-major: local expert, then destination rank"),
    outputs=[
        Output("y", FLOATS, "[BSK, N1] the products back home: by source rank, then its local expert"),
        Output("mm_y", FLOATS, "[BS, N2] mm_x @ mm_weight", optional=True),
    ],
    attrs=gmm_attrs(permute_flag=False),
    infer=_infer,
    kernel=grouped_mat_mul_allto_allv,
    needs=("communicator",),
    example=_EXAMPLE,
    npu_limits=gmm_limits,
)

DEFINITIONS = [GROUPED_MAT_MUL_ALLTO_ALLV]
