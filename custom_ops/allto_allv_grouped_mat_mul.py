"""AlltoAllvGroupedMatMul: the all-to-all-v of routed rows, then one product per local expert
(SPEC-mc2 1.24; torch_npu ``npu_alltoallv_gmm``, FC1 of MindSpeed's mc2 dispatcher).

``E_l = gmm_weight.shape[0]`` experts per rank, global expert ``i*E_l + le`` on rank i. Both
count lists are rank-major: ``send_counts[i*E_l + le]`` rows go from this rank to local expert
``le`` of rank i; ``recv_counts[i*E_l + le]`` rows come from rank i for this rank's ``le``.
``gmm_x`` rows are grouped by ``(i, le)`` in ascending ``i*E_l + le`` (a permute's order);
``permute_out`` is **expert-major** (local expert, then source rank, then the source's
order); ``gmm_y[rows of le] = permute_out[rows of le] @ W[le]`` (``W[le].T`` with
``trans_gmm_weight``), float32 accumulation rounded once; the groups follow what this rank
receives (the kernel; SPEC-mc2 1.24 contradiction). ``mm_y = mm_x @ mm_weight`` is an
independent product. Every rank checks its lists against its peers' with one AllGather.
"""

from __future__ import annotations

import numpy as np

from . import mc2
from .dtypes import FLOATS
from .errors import BAD_DTYPE
from .grouped_matmul import grouped_matmul
from .opdef import GROUP_RANKS_ATTR, Attr, Example, Input, OpDef, Output, Signature
from .targets import Target, known_dim

LABEL = "AlltoAllvGroupedMatMul"


def exchange_rows(data: np.ndarray, send_grid: np.ndarray, recv_grid: np.ndarray, communicator) -> np.ndarray:
    """Rows of ``data`` (grouped by destination rank, ``send_grid[d].sum()`` each) to their
    ranks; returns the rows received, by source rank (``recv_grid[s].sum()`` each)."""
    width = data.dtype.itemsize * data.shape[1]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(len(data), width)
    received = mc2.swap(communicator, raw, send_grid.sum(axis=1), recv_grid.sum(axis=1))
    return received.view(data.dtype).reshape(len(received), data.shape[1])


def agree_on_counts(communicator, label, config, send_counts, recv_counts, problem):
    """Share the lists (and this rank's verdict); check them against each other everywhere.
    Returns ``(send_grid, recv_grid)`` ``[W, E_l]``."""
    if problem is None and communicator is not None and config["ep_world_size"] != communicator.size:
        problem = f"ep_world_size = {config['ep_world_size']} but the communicator has {communicator.size} ranks"
    infos = mc2.agree(communicator, label, problem, (config, list(send_counts), list(recv_counts)))
    mc2.require_same_group([info[0] for info in infos])
    mc2.require_counts_match([info[1] for info in infos], [info[2] for info in infos], config["E_l"])
    world, experts = config["ep_world_size"], config["E_l"]
    return (
        np.array(send_counts, np.int64).reshape(world, experts),
        np.array(recv_counts, np.int64).reshape(world, experts),
    )


def plain_product(mm_x, mm_weight, trans_mm_weight: int):
    """``mm_x @ mm_weight`` (``.T`` when transposed): float32 accumulation rounded once."""
    if mm_x is None:
        return None
    return grouped_matmul(mm_x, mm_weight, group_type=-1, transpose_weight=trans_mm_weight)[0]


def allto_allv_grouped_mat_mul(
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
    permute_out_flag=0,
    communicator=None,
):
    """AlltoAllvGroupedMatMul on this rank's communicator.

    Args:
        gmm_x: ``[BSK, H1]`` rows by ``(i, le)``; gmm_weight: ``[E_l, H1, N1]`` (``[E_l, N1,
        H1]`` transposed); mm_x ``[BS, H2]``, mm_weight ``[H2, N2]`` (``[N2, H2]``): optional.
    Returns:
        ``gmm_y [A, N1]``, ``mm_y [BS, N2]`` or None, ``permute_out [A, H1]`` (expert-major)
        or None; ``A = sum(recv_counts)``.
    """
    experts = gmm_weight.shape[0]
    problem = mc2.counts_problem(ep_world_size, experts, send_counts, recv_counts, len(gmm_x), "gmm_x.shape[0]")
    config = {"group": group, "ep_world_size": ep_world_size, "E_l": experts, "rows": f"{gmm_x.dtype}[*, H1]"}
    send_grid, recv_grid = agree_on_counts(communicator, LABEL, config, send_counts, recv_counts, problem)
    received = exchange_rows(gmm_x, send_grid, recv_grid, communicator)
    permute_out = received[mc2.regroup(recv_grid)]
    (gmm_y,) = grouped_matmul(
        permute_out,
        gmm_weight,
        None,
        recv_grid.sum(axis=0),
        group_type=0,
        group_list_type=1,
        transpose_weight=trans_gmm_weight,
    )
    return gmm_y, plain_product(mm_x, mm_weight, trans_mm_weight), permute_out if permute_out_flag else None


def require_gmm_inputs(sig: Signature):
    """The static rules both all-to-all-v grouped matmuls share (1.24 c); ``(E_l, H1, N1)``."""
    for name in ("send_counts_tensor", "recv_counts_tensor"):
        sig.require(
            not sig.has(name),
            f"{name} (counts given as a tensor: not supported in this version, as on the NPU)",
            BAD_DTYPE,
        )
    world = sig.attr("ep_world_size")
    sig.require(world >= 1, f"ep_world_size must be >= 1, got {world}")
    mc2.require_group_size(sig)
    sig.require(1 <= len(sig.attr("group")) < 128, "group must have length in [1, 128)")
    trans = sig.attr("trans_gmm_weight")
    experts, inner, outer = (sig.dim("gmm_weight", axis) for axis in ((0, 2, 1) if trans else (0, 1, 2)))
    sig.same(sig.dim("gmm_x", 1), inner, "gmm_x.shape[1] must equal the weight's input dim H1")
    dtype = sig.input("gmm_x").dtype
    for name in ("gmm_weight", "mm_x", "mm_weight"):
        other = sig.input(name).dtype
        if sig.has(name) and dtype is not None and other is not None:
            sig.require(other == dtype, f"{name} must have gmm_x's dtype {dtype}, got {other}")
    sig.require(sig.has("mm_x") == sig.has("mm_weight"), "mm_x and mm_weight come together (both or neither)")
    for name in ("send_counts", "recv_counts"):  # (a negative count would make a negative dim)
        sig.require(all(c >= 0 for c in sig.attr(name)), f"{name} must be >= 0")
    # the lists' other rules (lengths, sum) are the kernel's: checked on every rank at once,
    # so a bad list on one rank is the same error everywhere instead of one rank's early refusal
    if sig.has("mm_x"):
        sig.output("mm_y", dtype, (sig.dim("mm_x", 0), _mm_out(sig)))
    return experts, inner, outer


def _mm_out(sig: Signature):
    trans = sig.attr("trans_mm_weight")
    inner, outer = (
        (sig.dim("mm_weight", 1), sig.dim("mm_weight", 0))
        if trans
        else (sig.dim("mm_weight", 0), sig.dim("mm_weight", 1))
    )
    sig.same(sig.dim("mm_x", 1), inner, "mm_x.shape[1] must equal mm_weight's input dim H2")
    return outer


def _infer(sig: Signature) -> None:
    experts, inner, outer = require_gmm_inputs(sig)
    rows = sum(sig.attr("recv_counts"))
    dtype = sig.input("gmm_x").dtype
    sig.output("gmm_y", dtype, (rows, outer))
    if sig.attr("permute_out_flag"):
        sig.output("permute_out", dtype, (rows, inner))


def gmm_limits(sig: Signature, target: Target) -> list[str]:
    """SPEC-mc2 1.24 (c)'s target limits (Atlas A3 only), for both ops."""
    if target.name != "ascend910_93":
        return [f"the all-to-all-v grouped matmuls run on ascend910_93 (Atlas A3) only, not {target.name}"]
    world, trans = sig.attr("ep_world_size"), sig.attr("trans_gmm_weight")
    experts = known_dim(sig, "gmm_weight", 0)
    rows, width = known_dim(sig, "gmm_x", 0), known_dim(sig, "gmm_x", 1)
    outer = known_dim(sig, "gmm_weight", 1 if trans else 2)
    found = []
    if world not in (8, 16, 32, 64, 128):
        found.append(f"W = {world} is not one of 8, 16, 32, 64 (128 in the torch doc)")
    if experts is not None and (experts > 32 or world * experts > 256):
        found.append(f"E_l = {experts} with W = {world}: E_l <= 32 and W * E_l <= 256")
    if rows is not None and not 0 < rows < 52428800:
        found.append(f"gmm_x rows = {rows} outside (0, 52428800)")
    for name, dim in (("H1", width), ("N1", outer)):
        if dim is not None and not 0 < dim < 65536:
            found.append(f"{name} = {dim} outside (0, 65536)")
    if sig.has("mm_x"):
        h2, bs = known_dim(sig, "mm_x", 1), known_dim(sig, "mm_x", 0)
        if h2 is not None and not 0 < h2 <= 12288:
            found.append(f"H2 = {h2} outside (0, 12288]")
        if bs and rows is not None and not 2 <= rows // bs <= 8:
            found.append(f"K = BSK / BS = {rows // bs} outside [2, 8] with mm_x")
    if experts is not None and width is not None:
        for name in ("send_counts", "recv_counts"):
            grid = (
                np.array(sig.attr(name), np.int64).reshape(world, experts)
                if len(sig.attr(name)) == world * experts
                else None
            )
            if grid is None:
                continue
            per_peer = grid.sum(axis=1) * width * 2
            if ((per_peer < 2 << 20) | (per_peer > 100 << 20)).any():
                found.append(f"{name}: bytes per peer rank {per_peer.min()}..{per_peer.max()} outside [2 MB, 100 MB]")
    return found


def gmm_attrs(permute_flag: bool) -> list[Attr]:
    attrs = [
        Attr("group", "string", None, "name of the EP communicator (torch: hcom)", required=True),
        Attr("ep_world_size", "int", None, "W: ranks of the group", required=True),
        Attr("send_counts", "ints", None, "[W*E_l] rows to (rank i, local expert le) at i*E_l + le", required=True),
        Attr("recv_counts", "ints", None, "[W*E_l] rows from (rank i, local expert le) at i*E_l + le", required=True),
        Attr("trans_gmm_weight", "int", 0, "1: gmm_weight stored [E_l, N1, H1]", (0, 1)),
        Attr("trans_mm_weight", "int", 0, "1: mm_weight stored [N2, H2]", (0, 1)),
        GROUP_RANKS_ATTR,
    ]
    if permute_flag:
        attrs.append(Attr("permute_out_flag", "int", 0, "1: also return permute_out", (0, 1)))
    return attrs


def gmm_inputs(rows_doc: str) -> list[Input]:
    return [
        Input("gmm_x", FLOATS, rows_doc, (2,)),
        Input("gmm_weight", FLOATS, "[E_l, H1, N1] ([E_l, N1, H1] with trans_gmm_weight)", (3,)),
        Input("send_counts_tensor", ("int64", "int32"), "refused: counts as a tensor", None, optional=True),
        Input("recv_counts_tensor", ("int64", "int32"), "refused: counts as a tensor", None, optional=True),
        Input("mm_x", FLOATS, "[BS, H2] an independent product's rows", (2,), optional=True),
        Input("mm_weight", FLOATS, "[H2, N2] ([N2, H2] with trans_mm_weight)", (2,), optional=True),
    ]


#: 2 ranks, one local expert each (E_l = 1), H1 = N1 = 2: rank 0 sends 1 row to itself and 2
#: to rank 1, rank 1 sends 2 rows to rank 0 and 1 to itself; expert 0 doubles, expert 1 swaps
#: the columns; the independent product mm_x @ mm_weight beside it
_EXAMPLE = Example(
    attrs={"group": "ep", "ep_world_size": 2, "permute_out_flag": 1},
    ranks=(
        {
            "gmm_x": np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32),
            "gmm_weight": np.array([[[2.0, 0.0], [0.0, 2.0]]], np.float32),
            "mm_x": np.array([[1.0, 1.0]], np.float32),
            "mm_weight": np.array([[1.0], [2.0]], np.float32),
        },
        {
            "gmm_x": np.array([[7.0, 8.0], [9.0, 10.0], [11.0, 12.0]], np.float32),
            "gmm_weight": np.array([[[0.0, 1.0], [1.0, 0.0]]], np.float32),
            "mm_x": np.array([[2.0, 2.0]], np.float32),
            "mm_weight": np.array([[1.0], [2.0]], np.float32),
        },
    ),
    rank_attrs=({"send_counts": [1, 2], "recv_counts": [1, 2]}, {"send_counts": [2, 1], "recv_counts": [2, 1]}),
)

ALLTO_ALLV_GROUPED_MAT_MUL = OpDef(
    "AlltoAllvGroupedMatMul",
    __doc__,
    inputs=gmm_inputs("[BSK, H1] rows grouped by (rank i, local expert le), ascending i*E_l + le"),
    outputs=[
        Output("gmm_y", FLOATS, "[A, N1] each local expert's product, expert-major rows"),
        Output("mm_y", FLOATS, "[BS, N2] mm_x @ mm_weight", optional=True),
        Output("permute_out", FLOATS, "[A, H1] the received rows, expert-major (with permute_out_flag)", optional=True),
    ],
    attrs=gmm_attrs(permute_flag=True),
    infer=_infer,
    kernel=allto_allv_grouped_mat_mul,
    needs=("communicator",),
    example=_EXAMPLE,
    npu_limits=gmm_limits,
)

DEFINITIONS = [ALLTO_ALLV_GROUPED_MAT_MUL]
