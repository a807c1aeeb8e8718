"""MoeInitRoutingV2: copy each token once per chosen expert, grouped by expert (SPEC 1.2).

Index convention. The source position of (token t, slot j) is ``p = t*K + j`` (token-major).
Sorting the flattened expert ids stably gives ``sorted_to_source[d] = p``: the d-th entry in
expert order came from source position p (ties keep token-major order). The op's index
output goes the other way, source -> destination (a scatter index):

    expanded_row_idx[p] = destination row of source position p

* dropless / active (``drop_pad_mode`` 0): the destination is the sorted position d. Active
  mode (``active_num`` > 0) keeps only the first ``A = min(active_num, T*K)`` rows of
  ``expanded_x`` but ``expanded_row_idx`` stays full length, so entries ``>= A`` name rows
  that were not produced.
* drop/pad (``drop_pad_mode`` 1): the r-th entry of expert e (in sorted order) goes to slot
  ``e*C + r`` of ``expanded_x [E, C, H]`` if ``r < C`` and is dropped (-1) otherwise; unused
  slots are zeros.

Optional outputs: ``expert_tokens_count_or_cumsum`` is present if and only if
``expert_tokens_count_or_cumsum_flag`` is nonzero, ``expert_tokens_before_capacity`` if and
only if ``expert_tokens_before_capacity_flag`` is 1; a node must name exactly those. Both are
the histogram of all ``T*K`` expert ids (cumsum for flag 1) in every mode; the NPU fills the
first only in dropless mode and the second only in drop/pad mode.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .dtypes import FLOATS
from .errors import MoeOpError
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature
from .parallel import gather_rows

INT32_MAX = 2**31 - 1


def _check_expert_ids(expert_idx: np.ndarray, expert_num: int) -> None:
    bad = np.flatnonzero((expert_idx < 0) | (expert_idx >= expert_num))
    if len(bad):
        t, j = divmod(int(bad[0]), expert_idx.shape[1])
        raise MoeOpError(
            f"expert_idx must be in [0, expert_num) = [0, {expert_num}), got {expert_idx[t, j]} at [{t}, {j}]",
        )


def moe_init_routing_v2(
    x,
    expert_idx,
    *,
    active_num=0,
    expert_capacity=0,
    expert_num=0,
    drop_pad_mode=0,
    expert_tokens_count_or_cumsum_flag=0,
    expert_tokens_before_capacity_flag=0,
):
    """Expand ``x`` to one row per (token, chosen expert), rows grouped by expert.

    Args:
        x: ``[T, H]`` float32/float16/bfloat16 (any dtype: this is data movement).
        expert_idx: ``[T, K]`` int32, expert of slot j of token t.
        active_num: 0, or > 0 to keep only the first ``min(active_num, T*K)`` rows (dropless).
        expert_capacity: C, rows per expert in drop/pad mode (``0 < C <= T``).
        expert_num: E; when > 0 every expert id must be in ``[0, E)``.
        drop_pad_mode: 0 dropless/active, 1 drop/pad.
        expert_tokens_count_or_cumsum_flag: 0 none, 1 cumsum, 2 count.
        expert_tokens_before_capacity_flag: 1 to return the per-expert counts.
    Returns:
        ``expanded_x`` (``[A, H]`` dropless/active, ``[E, C, H]`` drop/pad; dtype of x),
        ``expanded_row_idx [T*K]`` int32 (source position -> destination row, -1 = dropped),
        ``expert_tokens_count_or_cumsum [E]`` int32 or None,
        ``expert_tokens_before_capacity [E]`` int32 or None.
    """
    top_k = expert_idx.shape[1]
    flat = expert_idx.reshape(-1)
    if expert_num > 0:
        _check_expert_ids(expert_idx, expert_num)
    sorted_to_source = np.argsort(flat, kind="stable")
    sorted_positions = np.arange(flat.size, dtype=np.int64)  # d, the destination in dropless mode
    counts = np.bincount(flat, minlength=expert_num) if expert_num > 0 else None

    if drop_pad_mode == 0:
        rows = flat.size if active_num == 0 else min(active_num, flat.size)
        destination = sorted_positions
        source_to_sorted = np.empty(flat.size, np.int64)  # a permutation: each row named once
        source_to_sorted[sorted_to_source] = sorted_positions
        expanded_x = fused.copy_rows_to(x, source_to_sorted, fused.fanout_starts(*expert_idx.shape), rows)
    else:
        assert counts is not None  # infer requires expert_num > 0 in drop/pad mode
        capacity = expert_capacity
        sorted_ids = flat[sorted_to_source].astype(np.int64)
        rank_in_expert = sorted_positions - (np.cumsum(counts) - counts)[sorted_ids]
        kept = rank_in_expert < capacity
        destination = np.where(kept, sorted_ids * capacity + rank_in_expert, -1)
        slot_source = np.full(expert_num * capacity, -1, np.intp)
        slot_source[destination[kept]] = sorted_to_source[kept] // top_k
        expanded_x = gather_rows(x, slot_source).reshape(expert_num, capacity, x.shape[1])

    expanded_row_idx = np.empty(flat.size, np.int32)
    expanded_row_idx[sorted_to_source] = destination
    count_or_cumsum = before_capacity = None
    if expert_tokens_count_or_cumsum_flag:
        assert counts is not None  # infer requires expert_num > 0 for either flag
        per_expert = np.cumsum(counts) if expert_tokens_count_or_cumsum_flag == 1 else counts
        count_or_cumsum = per_expert.astype(np.int32)
    if expert_tokens_before_capacity_flag:
        assert counts is not None
        before_capacity = counts.astype(np.int32)
    return expanded_x, expanded_row_idx, count_or_cumsum, before_capacity


def product(a: Dim, b: Dim) -> Dim:
    """``a * b`` of two dims; a symbolic dim survives multiplication by 1."""
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return a if b == 1 else b if a == 1 else None


def _infer(sig: Signature) -> None:
    x, tokens, top_k = sig.input("x"), sig.dim("expert_idx", 0), sig.dim("expert_idx", 1)
    hidden = sig.dim("x", 1)
    active_num, capacity, experts = (sig.attr(a) for a in ("active_num", "expert_capacity", "expert_num"))
    drop_pad = sig.attr("drop_pad_mode") == 1
    count_flag = sig.attr("expert_tokens_count_or_cumsum_flag")
    before_flag = sig.attr("expert_tokens_before_capacity_flag")

    sig.same(sig.dim("x", 0), tokens, "x [T, H] and expert_idx [T, K] must have the same T")
    idx_shape = sig.input("expert_idx").shape
    if isinstance(top_k, int) and idx_shape is not None:  # a known K implies a known shape
        sig.require(top_k > 0, f"expert_idx [T, K] must have K > 0, got shape {list(idx_shape)}")
    else:
        sig.defer("at_most", (1, top_k), "expert_idx [T, K] must have K > 0")
    sig.require(active_num >= 0, f"active_num must be >= 0, got {active_num}")
    sig.require(experts >= 0, f"expert_num must be >= 0, got {experts}")
    sig.allocates(experts * 8, f"the per-expert counts of expert_num = {experts} experts")
    rows = product(tokens, top_k)
    if isinstance(rows, int):
        sig.require(rows <= INT32_MAX, f"T*K = {rows} rows do not fit the int32 expanded_row_idx")
    for name, flag in (("expert_tokens_count_or_cumsum", count_flag), ("expert_tokens_before_capacity", before_flag)):
        sig.require(
            sig.wants(name, flag != 0) == (flag != 0),
            f"output {name} must be named if and only if {name}_flag is nonzero "
            f"(flag {flag}, output {'absent' if flag else 'present'})",
        )
        if flag:
            sig.require(experts > 0, f"{name}_flag={flag} needs expert_num > 0, got {experts}")
            sig.output(name, "int32", (experts,))

    if drop_pad:
        sig.require(experts > 0, f"drop/pad mode needs expert_num > 0, got {experts}")
        sig.require(capacity > 0, f"drop/pad mode needs expert_capacity > 0, got {capacity}")
        if isinstance(tokens, int):
            sig.require(capacity <= tokens, f"expert_capacity must be <= T = {tokens}, got {capacity}")
        else:
            sig.defer("at_most", (capacity, tokens), "expert_capacity must be <= T = expert_idx dim 0")
        sig.require(
            experts * capacity <= INT32_MAX, f"E*C = {experts * capacity} slots do not fit the int32 expanded_row_idx"
        )
        sig.output("expanded_x", x.dtype, (experts, capacity, hidden))
    elif active_num > 0:
        sig.output("expanded_x", x.dtype, (min(active_num, rows) if isinstance(rows, int) else None, hidden))
    else:
        sig.output("expanded_x", x.dtype, (rows, hidden))
    sig.output("expanded_row_idx", "int32", (rows,))


#: 3 tokens, each to 2 of 4 experts: 6 rows grouped by expert, and the count of each expert
_EXAMPLE = Example(
    inputs={
        "x": np.array([[0.5, 1.0], [2.0, -1.0], [-0.5, 3.0]], np.float32),
        "expert_idx": np.array([[0, 2], [1, 0], [2, 3]], np.int32),
    },
    attrs={"active_num": 6, "expert_num": 4, "expert_tokens_count_or_cumsum_flag": 2},
)


MOE_INIT_ROUTING_V2 = OpDef(
    "MoeInitRoutingV2",
    __doc__,
    inputs=[
        Input("x", FLOATS, "[T, H] token features", (2,)),
        Input("expert_idx", ("int32",), "[T, K] chosen experts of each token", (2,)),
    ],
    outputs=[
        Output("expanded_x", FLOATS, "[A, H] (dropless/active) or [E, C, H] (drop/pad) rows by expert"),
        Output("expanded_row_idx", ("int32",), "[T*K]: source position t*K+j -> destination row (-1 dropped)"),
        Output(
            "expert_tokens_count_or_cumsum",
            ("int32",),
            "[E] tokens per expert (flag 2) or their cumsum (flag 1); iff the flag is nonzero",
            optional=True,
        ),
        Output(
            "expert_tokens_before_capacity",
            ("int32",),
            "[E] tokens per expert before capacity; iff its flag is 1",
            optional=True,
        ),
    ],
    attrs=[
        Attr(
            "active_num",
            "int",
            0,
            "0 = not active; > 0 keeps the first min(active_num, T*K) rows (dropless mode only, as on the NPU)",
        ),
        Attr("expert_capacity", "int", 0, "C, rows per expert in drop/pad mode (0 < C <= T)"),
        Attr("expert_num", "int", 0, "E; 0 = unknown (dropless without counts only)"),
        Attr("drop_pad_mode", "int", 0, "0 = dropless/active, 1 = drop/pad", (0, 1)),
        Attr("expert_tokens_count_or_cumsum_flag", "int", 0, "0 = none, 1 = cumsum, 2 = count", (0, 1, 2)),
        Attr("expert_tokens_before_capacity_flag", "int", 0, "1 = return per-expert counts", (0, 1)),
    ],
    infer=_infer,
    kernel=moe_init_routing_v2,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_INIT_ROUTING_V2]
