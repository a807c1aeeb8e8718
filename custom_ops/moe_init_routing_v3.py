"""MoeInitRoutingV3: MoeInitRoutingV2 with an active expert range, a dst->src index type, a
key/value histogram and scales moved with the rows (SPEC-layer 1.17).

torch_npu's ``npu_moe_init_routing_v2`` runs this op (op-plugin
``MoeInitRoutingV2KernelNpuOpApi.cpp`` calls aclnnMoeInitRoutingV3 but for one legacy fast
path); SPEC 1.2 (MoeInitRoutingV2) is its subset: the whole range, ``row_idx_type`` 0, no
quantisation.

Index convention. The source position of (token t, slot j) is ``p = t*K + j``. With the active
range ``[s, e)`` (``[]`` = ``[0, expert_num)``), a slot is *in range* when ``s <= id < e``
(a negative id never is); ``n_av`` slots are. The sort key puts the in-range slots first (by
expert, then p), then those with ids ``>= e``, then those with ids ``< s``::

    order = argsort(where(id < s, INT32_MAX, id), stable)     # order[d] = p: destination d <- source p
    A = T*K if active_num <= 0 else min(active_num, T*K);  n = min(A, n_av)
    expanded_x[d] = x[order[d] // K] for d < n; rows n .. A-1 are zeros (the NPU leaves them unwritten)
    row_idx_type 0: expanded_row_idx[p] = d where order[d] = p and d < n_av, else -1   (src -> dst)
    row_idx_type 1: expanded_row_idx[d] = order[d]                                      (dst -> src; the
                    NPU leaves d >= n_av unwritten, the golden writes order[d], always in range)
    expanded_scale[d] = scale[order[d] // K] for d < n, else 0 (0 everywhere without scale)

Drop/pad (``drop_pad_mode`` 1, whole range, row_idx_type 0 only) is MoeInitRoutingV2's:
expert e's r-th slot (sorted order) goes to row ``e*C + r`` of ``expanded_x [E, C, H]`` if
``r < C``, else it is dropped (-1); empty rows are zeros; ``expanded_scale [E*C]`` follows the
rows.

``expert_tokens_count_or_cumsum`` (present iff ``expert_tokens_num_flag``; int64) covers the
range only: ``[e - s]`` per-expert counts (type 1) or their inclusive cumsum (type 0), or the
key/value type 2, ``[expert_num, 2]``: ``(absolute expert id, count)`` of each expert of the
range with a nonzero count, ascending, then zero rows.

Quantisation is refused by number (only ``quant_mode`` -1 is computed); ``x_dtype`` names the
real element type of uint8 storage (hifloat8, float8, packed float4): the rows are moved as
bytes. Pure data movement: every output row is a bit-exact copy.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .errors import BAD_DTYPE, MoeOpError
from .moe_init_routing_v2 import INT32_MAX, moe_init_routing_v2, product
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature
from .targets import Target, known_dim

X_DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8", "float8e4m3fn", "float8e5m2")
#: real element types uint8 x may carry (``x_dtype``): moved as bytes
STORED_X_DTYPES = ("hifloat8", "float8e4m3fn", "float8e5m2", "float4_e2m1fn_x2", "float4_e1m2fn_x2")
#: op-plugin's quant_mode numbers (MoeInitRoutingV2KernelNpuOpApi.cpp): none is computed here
QUANT_MODES = {
    0: "int8 static quantisation",
    1: "int8 dynamic quantisation",
    2: "MXFP8 quantisation to float8e5m2",
    3: "MXFP8 quantisation to float8e4m3fn",
    4: "FP8 per-group quantisation to float8e5m2",
    5: "FP8 per-group quantisation to float8e4m3fn",
    6: "HiF8 cast",
    7: "HiF8 per-tensor quantisation",
    8: "HiF8 per-token quantisation",
    9: "MXFP4 quantisation",
    11: "FP8 per-block quantisation to float8e5m2",
    12: "FP8 per-block quantisation to float8e4m3fn",
    13: "INT4 dynamic quantisation",
    14: "FP8 per-group (amax) quantisation to float8e5m2",
    15: "FP8 per-group (amax) quantisation to float8e4m3fn",
    16: "MXFP8 (amax) quantisation to float8e5m2",
    17: "MXFP8 (amax) quantisation to float8e4m3fn",
}
#: aclnnMoeInitRoutingV3: expert_num bounds (key/value histograms: the smaller)
MAX_EXPERTS, MAX_EXPERTS_KEY_VALUE = 10240, 5120
KEY_VALUE = 2


def expert_range(active_expert_range, expert_num: int) -> tuple[int, int]:
    """``(s, e)`` of the active range; None or ``[]`` means ``[0, expert_num)``."""
    return (0, expert_num) if not active_expert_range else tuple(active_expert_range)


def expert_tokens(in_range_ids: np.ndarray, start: int, end: int, expert_num: int, kind: int) -> np.ndarray:
    """The per-expert counts of the range, int64: cumsum (0), count (1) or key/value (2)."""
    counts = np.bincount(in_range_ids - start, minlength=end - start).astype(np.int64)
    return expert_tokens_of(counts, start, expert_num, kind)


def expert_tokens_of(counts: np.ndarray, start: int, expert_num: int, kind: int) -> np.ndarray:
    """:func:`expert_tokens` from the rows of each expert of the range (``counts [e - s]`` int64)."""
    if kind == 1:
        return counts
    if kind == 0:
        return np.cumsum(counts)
    table = np.zeros((expert_num, 2), np.int64)
    nonzero = np.flatnonzero(counts)
    table[: len(nonzero), 0] = nonzero + start
    table[: len(nonzero), 1] = counts[nonzero]
    return table


def _check_ids(flat: np.ndarray, top_k: int, low: int, expert_num: int) -> None:
    bad = np.flatnonzero((flat < low) | (flat >= expert_num))
    if len(bad):
        t, j = divmod(int(bad[0]), top_k)
        allowed = f"[0, expert_num) = [0, {expert_num})" if low == 0 else f"below expert_num = {expert_num}"
        raise MoeOpError(f"expert_idx must be {allowed}, got {flat[bad[0]]} at [{t}, {j}]")


def moe_init_routing_v3(
    x,
    expert_idx,
    scale=None,
    offset=None,
    *,
    active_num=-1,
    expert_capacity=-1,
    expert_num=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=0,
    quant_mode=-1,
    active_expert_range=None,
    row_idx_type=0,
    x_dtype=None,
):
    """Expand ``x`` to one row per (token, in-range expert), rows grouped by expert.

    Args:
        x: ``[T, H]`` any dtype (moved as bytes); uint8 with ``x_dtype`` naming its real type.
        expert_idx: ``[T, K]`` int32, expert of slot j of token t (< expert_num; dropless, a
            negative id is out of any range).
        scale: optional ``[T]`` float32, one per token, moved with its rows.
        offset: must be absent (quantisation only; ``infer`` refuses it).
        active_num: -1 or 0 every slot's row, > 0 at most that many rows (dropless; < -1 refused).
        expert_capacity: C, rows per expert in drop/pad mode (``0 < C <= T``).
        expert_num: E > 0.
        drop_pad_mode: 0 dropless, 1 drop/pad.
        expert_tokens_num_type: 0 cumsum, 1 count, 2 key/value.
        expert_tokens_num_flag: 1 to return the per-expert counts.
        quant_mode: -1 (the only one computed).
        active_expert_range: ``[s, e]``, or None / ``[]`` for ``[0, E]``.
        row_idx_type: 0 source position -> row (-1 out of range), 1 row -> source position.
        x_dtype: None, or the real type of uint8 x (no effect on the bytes).
    Returns:
        ``expanded_x`` (``[A, H]`` dropless, ``[E, C, H]`` drop/pad; dtype of x),
        ``expanded_row_idx [T*K]`` int32, ``expert_tokens_count_or_cumsum`` int64 or None,
        ``expanded_scale`` ``[rows of expanded_x]`` float32.
    """
    tokens, top_k = expert_idx.shape
    flat = expert_idx.reshape(-1)
    start, end = expert_range(active_expert_range, expert_num)
    counts = None
    if drop_pad_mode == 1:  # infer: the whole range, row_idx_type 0
        _check_ids(flat, top_k, 0, expert_num)
        expanded_x, expanded_row_idx, _, _ = moe_init_routing_v2(
            x, expert_idx, expert_capacity=expert_capacity, expert_num=expert_num, drop_pad_mode=1
        )
        slots = expert_num * expert_capacity
        kept = np.flatnonzero(expanded_row_idx >= 0)
        row_token = np.full(slots, -1, np.intp)  # the token each row of expanded_x holds
        row_token[expanded_row_idx[kept]] = kept // top_k
        if expert_tokens_num_flag:
            counts = expert_tokens(flat.astype(np.int64), start, end, expert_num, expert_tokens_num_type)
    else:
        _check_ids(flat, top_k, np.iinfo(np.int64).min, expert_num)
        from . import routing_loops

        rows = flat.size if active_num <= 0 else min(active_num, flat.size)
        # the slots sorted stably by where(id < s, INT32_MAX, id): order[d] = p
        destination, expanded_row_idx, row_token, range_counts, filled = routing_loops.dropless_slots(
            flat, top_k, start, end, expert_num, rows, row_idx_type == 1
        )
        # source-major copy: token t feeds the rows of its slots t*K .. t*K+K-1 (skipped: -1)
        expanded_x = fused.copy_rows_to(x, destination, fused.fanout_starts(tokens, top_k), rows)
        expanded_x.view(np.uint8)[filled:] = 0  # (bytes: numpy fills an ml_dtypes array element by element)
        if expert_tokens_num_flag:
            counts = expert_tokens_of(range_counts, start, expert_num, expert_tokens_num_type)
    expanded_scale = np.zeros(len(row_token), np.float32)
    if scale is not None:
        has = row_token >= 0
        expanded_scale[has] = scale[row_token[has]]
    return expanded_x, expanded_row_idx, counts, expanded_scale


def _infer(sig: Signature) -> None:
    x, tokens, top_k = sig.input("x"), sig.dim("expert_idx", 0), sig.dim("expert_idx", 1)
    hidden = sig.dim("x", 1)
    active_num, capacity, experts = (sig.attr(a) for a in ("active_num", "expert_capacity", "expert_num"))
    drop_pad = sig.attr("drop_pad_mode") == 1
    kind, flag = sig.attr("expert_tokens_num_type"), sig.attr("expert_tokens_num_flag")
    row_idx_type = sig.attr("row_idx_type")

    quant_mode = sig.attr("quant_mode")
    if quant_mode != -1:
        what = QUANT_MODES.get(quant_mode)
        sig.fail(
            f"quant_mode={quant_mode} ({what}) is not supported: the CPU golden computes quant_mode=-1 only"
            if what
            else f"quant_mode={quant_mode} is not a quant_mode of MoeInitRoutingV3 (-1, 0-9, 11-17)",
            BAD_DTYPE,
        )
    sig.require(
        not sig.has("offset"),
        "input offset is only read by quantisation (quant_mode 0), which is not supported",
        BAD_DTYPE,
    )
    if sig.attr("x_dtype") is not None:
        sig.require(
            x.dtype in (None, "uint8"),
            f"x_dtype={sig.attr('x_dtype')!r} describes uint8 storage, but x is {x.dtype}",
            BAD_DTYPE,
        )
    sig.same(sig.dim("x", 0), tokens, "x [T, H] and expert_idx [T, K] must have the same T")
    idx_shape = sig.input("expert_idx").shape
    if isinstance(top_k, int) and idx_shape is not None:
        sig.require(top_k > 0, f"expert_idx [T, K] must have K > 0, got shape {list(idx_shape)}")
    else:
        sig.defer("at_most", (1, top_k), "expert_idx [T, K] must have K > 0")
    if sig.has("scale"):
        sig.same(sig.dim("scale", 0), tokens, "scale must be [T], one per token: dim 0 must equal T = x dim 0")
    sig.require(experts > 0, f"expert_num must be > 0, got {experts}")
    sig.allocates(experts * 16, f"the per-expert counts of expert_num = {experts} experts")
    given_range = sig.attr("active_expert_range") or []
    sig.require(len(given_range) in (0, 2), f"active_expert_range must be [] or [start, end], got {list(given_range)}")
    start, end = expert_range(given_range, experts)
    sig.require(
        0 <= start < end <= experts,
        f"active_expert_range [{start}, {end}] must satisfy 0 <= start < end <= expert_num = {experts}",
    )
    rows = product(tokens, top_k)
    if isinstance(rows, int):
        sig.require(rows <= INT32_MAX, f"T*K = {rows} rows do not fit the int32 expanded_row_idx")

    if drop_pad:
        sig.require(
            (start, end) == (0, experts),
            f"drop/pad mode needs the whole expert range [0, {experts}], got [{start}, {end}]",
        )
        sig.require(row_idx_type == 0, "drop/pad mode needs row_idx_type 0 (source position -> row)")
        sig.require(
            not flag or kind == 1,
            f"drop/pad mode counts tokens per expert: expert_tokens_num_type must be 1, got {kind}",
        )
        sig.require(capacity > 0, f"drop/pad mode needs expert_capacity > 0, got {capacity}")
        if isinstance(tokens, int):
            sig.require(capacity <= tokens, f"expert_capacity must be <= T = {tokens}, got {capacity}")
        else:
            sig.defer("at_most", (capacity, tokens), "expert_capacity must be <= T = expert_idx dim 0")
        sig.require(
            experts * capacity <= INT32_MAX, f"E*C = {experts * capacity} slots do not fit the int32 expanded_row_idx"
        )
        expanded_rows: Dim = experts * capacity
        sig.output("expanded_x", x.dtype, (experts, capacity, hidden))
    else:
        sig.require(
            active_num >= -1,
            f"active_num must be >= -1 in dropless mode, got {active_num} (-1 and 0: every slot)",
        )
        if active_num > 0:
            expanded_rows = min(active_num, rows) if isinstance(rows, int) else None
        else:
            expanded_rows = rows
        sig.output("expanded_x", x.dtype, (expanded_rows, hidden))
    sig.output("expanded_row_idx", "int32", (rows,))
    name = "expert_tokens_count_or_cumsum"
    sig.require(
        sig.wants(name, flag != 0) == (flag != 0),
        f"output {name} must be named if and only if expert_tokens_num_flag is nonzero "
        f"(flag {flag}, output {'absent' if flag else 'present'})",
    )
    if flag:
        sig.output(name, "int64", (experts, 2) if kind == KEY_VALUE else (end - start,))
    sig.output("expanded_scale", "float32", (expanded_rows,))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    """aclnnMoeInitRoutingV3's bounds on E; on ascend950 (aclnn V4 docs) active_num must be
    -1, 0 or T*K."""
    found = []
    experts, key_value = sig.attr("expert_num"), sig.attr("expert_tokens_num_type") == KEY_VALUE
    bound = MAX_EXPERTS_KEY_VALUE if key_value else MAX_EXPERTS
    if experts > bound:
        found.append(f"expert_num = {experts} exceeds {bound}{' (key/value counts)' if key_value else ''}")
    tokens, top_k = known_dim(sig, "expert_idx", 0), known_dim(sig, "expert_idx", 1)
    active_num = sig.attr("active_num")
    if target.name == "ascend950" and active_num not in (-1, 0):
        if tokens is not None and top_k is not None and active_num != tokens * top_k:
            found.append(f"active_num = {active_num} must be -1, 0 or T*K = {tokens * top_k} on ascend950")
    return found


#: torch_npu's npu_moe_init_routing_v2: rows grouped by expert and each expert's count
_EXAMPLE = Example(
    inputs={
        "x": np.array([[0.5, 1.0], [2.0, -1.0], [-0.5, 3.0]], np.float32),
        "expert_idx": np.array([[0, 2], [1, 0], [2, 3]], np.int32),
    },
    attrs={"expert_num": 4, "expert_tokens_num_type": 1, "expert_tokens_num_flag": 1, "active_expert_range": [0, 4]},
)


MOE_INIT_ROUTING_V3 = OpDef(
    "MoeInitRoutingV3",
    __doc__,
    inputs=[
        Input("x", X_DTYPES, "[T, H] token rows (moved as bytes)", (2,)),
        Input("expert_idx", ("int32",), "[T, K] chosen experts of each token", (2,)),
        Input("scale", ("float32",), "[T] one per token, moved with its rows", (1,), optional=True),
        Input("offset", ("float32",), "quantisation offset: refused (quant_mode -1 only)", optional=True),
    ],
    outputs=[
        Output("expanded_x", X_DTYPES, "[A, H] (dropless) or [E, C, H] (drop/pad) rows by expert"),
        Output(
            "expanded_row_idx",
            ("int32",),
            "[T*K]: row_idx_type 0 source position t*K+j -> row (-1 out of range or dropped); 1 row -> source",
        ),
        Output(
            "expert_tokens_count_or_cumsum",
            ("int64",),
            "[end - start] cumsum (type 0) or count (1), or [E, 2] key/value (2); iff expert_tokens_num_flag",
            optional=True,
        ),
        Output("expanded_scale", ("float32",), "[rows of expanded_x] the scale of each row's token (0 without)"),
    ],
    attrs=[
        Attr("active_num", "int", -1, "<= 0: a row per in-range slot (T*K rows); > 0: min(active_num, T*K) rows"),
        Attr("expert_capacity", "int", -1, "C, rows per expert in drop/pad mode (0 < C <= T)"),
        Attr("expert_num", "int", -1, "E (> 0)"),
        Attr("drop_pad_mode", "int", 0, "0 = dropless, 1 = drop/pad", (0, 1)),
        Attr("expert_tokens_num_type", "int", 0, "0 = cumsum, 1 = count, 2 = key/value", (0, 1, 2)),
        Attr("expert_tokens_num_flag", "int", 0, "1 = return expert_tokens_count_or_cumsum", (0, 1)),
        Attr("quant_mode", "int", -1, "-1 = no quantisation (the only mode computed)"),
        Attr(
            "active_expert_range",
            "ints",
            None,
            "[start, end) of the active experts; absent or [] = [0, expert_num) (ONNX has no empty default)",
        ),
        Attr("row_idx_type", "int", 0, "0 = source -> row (scatter), 1 = row -> source (gather)", (0, 1)),
        Attr("x_dtype", "string", None, "real element type of uint8 x (bytes moved as they are)", STORED_X_DTYPES),
    ],
    infer=_infer,
    kernel=moe_init_routing_v3,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_INIT_ROUTING_V3]
