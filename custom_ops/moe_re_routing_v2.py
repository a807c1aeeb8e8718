"""MoeReRoutingV2 / MoeReRouting: rank-major rows -> expert-major rows after an AlltoAll.

Index convention (SPEC 1.1): the source is rank-major, the destination expert-major. With
``cnt = expert_token_num_per_rank [N, E]`` the block (r, e) of ``cnt[r, e]`` rows starts at

    src = sum(cnt[:r, :]) + sum(cnt[r, :e])      (rank r, then expert e)
    dst = sum(cnt[:, :e]) + sum(cnt[:r, e])      (expert e, then rank r)

and every permuted output takes ``out[dst + k] = in[src + k]``. Blocks are contiguous on both
sides, so the kernel copies whole blocks, not rows.
"""

from __future__ import annotations

import numpy as np

from . import buffers
from .dtypes import FLOAT8, INDEX
from .errors import MoeOpError
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .parallel import for_row_ranges, gather_rows
from .targets import Target, known_dim

TOKEN_DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8") + FLOAT8
SCALE_DTYPES = ("float32", "float8e8m0", "uint8")
#: real element types that uint8 tokens may carry (the NPU's packed formats)
PACKED_TOKEN_DTYPES = ("hifloat8", "float4_e2m1fn_x2", "float4_e1m2fn_x2")
#: below this many rows per block on average, one gather beats a loop of block copies
_MIN_ROWS_PER_BLOCK = 4


def rerouting_blocks(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of a rank-major -> expert-major reorder, listed in destination order.

    Args:
        counts: ``[N, E]`` int64, ``counts[r, e]`` rows from rank r for expert e.
    Returns:
        ``(src_start, dst_start, length)``, each ``[E*N]`` int64, block (e, r) at ``e*N + r``.
    """
    rank_major = (np.cumsum(counts.ravel()) - counts.ravel()).reshape(counts.shape)  # exclusive prefix sums
    length = counts.T.ravel()
    return rank_major.T.ravel(), np.cumsum(length) - length, length


def gather_index(src_start: np.ndarray, dst_start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``[A]`` int64 with ``index[dst] = src``: destination row -> source row."""
    total = int(length.sum())
    return np.arange(total, dtype=np.int64) + np.repeat(src_start - dst_start, length)


def move_rows(source: np.ndarray, src_start, dst_start, length, index) -> np.ndarray:
    """``out[dst + k] = source[src + k]`` for every block; ``index`` is the gather index."""
    nonempty = np.flatnonzero(length)
    if len(nonempty) * _MIN_ROWS_PER_BLOCK > len(source):  # tiny blocks: one gather is cheaper
        return gather_rows(source, index)
    out = buffers.empty(source.shape, source.dtype)

    def work(first: int, stop: int) -> None:  # numpy's block copies release the GIL
        for b in nonempty[first:stop]:
            s, d, n = src_start[b], dst_start[b], length[b]
            out[d : d + n] = source[s : s + n]

    for_row_ranges(work, len(nonempty), source.nbytes // max(len(nonempty), 1))
    return out


def _checked_counts(counts: np.ndarray, rows: int) -> np.ndarray:
    counts64 = counts.astype(np.int64, copy=False)
    negative = np.argwhere(counts64 < 0)
    if len(negative):
        r, e = negative[0]
        raise MoeOpError(f"expert_token_num_per_rank must be >= 0, got {counts64[r, e]} at [{r}, {e}]")
    too_many = np.argwhere(counts64 > rows)
    if len(too_many):  # checked before the sum, which could wrap around in int64
        r, e = too_many[0]
        raise MoeOpError(
            f"expert_token_num_per_rank[{r}, {e}] = {counts64[r, e]} exceeds A = tokens.shape[0] = {rows}, "
            "which the counts must sum to"
        )
    total = int(counts64.sum())
    if total != rows:
        raise MoeOpError(f"sum(expert_token_num_per_rank) must equal A = tokens.shape[0] = {rows}, got {total}")
    if rows >= 2**31:
        raise MoeOpError(f"A = {rows} rows do not fit the int32 permute_token_idx")
    return counts64


def moe_re_routing_v2(
    tokens,
    expert_token_num_per_rank,
    per_token_scales=None,
    expert_topk_weight=None,
    *,
    expert_token_num_type=1,
    idx_type=0,
    tokens_dtype=None,
):
    """Reorder rows received from an AlltoAll from rank order to expert order.

    Args:
        tokens: ``[A, H]`` any supported dtype; rows grouped by source rank, then local expert.
        expert_token_num_per_rank: ``[N, E]`` int32/int64; ``[r, e]`` rows from rank r for expert e.
        per_token_scales: optional ``[A]``/``[A, S]`` float32 or ``[A, d, 2]`` float8e8m0/uint8.
        expert_topk_weight: optional ``[A, 1]`` float32.
        expert_token_num_type: 1 = per-expert counts, 0 = their cumsum.
        idx_type: 0 = gather index (``idx[dst] = src``), 1 = scatter index (``idx[src] = dst``).
        tokens_dtype: real element type of uint8 tokens (data movement only: no effect).
    Returns:
        ``permute_tokens [A, H]``, ``permute_per_token_scales`` (scales' shape, or ``[A]``
        float32 zeros), ``permute_token_idx [A]`` int32, ``expert_token_num [E]`` (counts'
        dtype), ``permute_topk_weight [A, 1]`` float32 or None.
    """
    rows = tokens.shape[0]
    counts = _checked_counts(expert_token_num_per_rank, rows)
    src_start, dst_start, length = rerouting_blocks(counts)
    gather = gather_index(src_start, dst_start, length)

    def permute(x):
        return move_rows(x, src_start, dst_start, length, gather)

    permute_tokens = permute(tokens)
    if per_token_scales is None:
        permute_scales = np.zeros(rows, np.float32)
    else:
        permute_scales = permute(per_token_scales)
    if idx_type == 0:
        permute_token_idx = gather.astype(np.int32)
    else:
        permute_token_idx = np.empty(rows, np.int32)
        permute_token_idx[gather] = np.arange(rows, dtype=np.int32)
    per_expert = counts.sum(axis=0)
    if expert_token_num_type == 0:
        per_expert = np.cumsum(per_expert)
    expert_token_num = per_expert.astype(expert_token_num_per_rank.dtype)
    permute_weight = None if expert_topk_weight is None else permute(expert_topk_weight)
    return permute_tokens, permute_scales, permute_token_idx, expert_token_num, permute_weight


def moe_re_routing(
    tokens, expert_token_num_per_rank, per_token_scales=None, *, expert_token_num_type=1, idx_type=0, tokens_dtype=None
):
    """MoeReRouting: :func:`moe_re_routing_v2` without the top-k weight (first four outputs)."""
    return moe_re_routing_v2(
        tokens,
        expert_token_num_per_rank,
        per_token_scales,
        None,
        expert_token_num_type=expert_token_num_type,
        idx_type=idx_type,
        tokens_dtype=tokens_dtype,
    )[:4]


def _infer(sig: Signature) -> None:
    tokens, counts = sig.input("tokens"), sig.input("expert_token_num_per_rank")
    rows = sig.dim("tokens", 0)
    if sig.has("per_token_scales"):
        scales = sig.input("per_token_scales")
        sig.same(sig.dim("per_token_scales", 0), rows, "per_token_scales dim 0 must equal A = tokens dim 0")
        if scales.rank == 3:
            sig.require(
                scales.dtype in (None, "float8e8m0", "uint8"),
                f"3-D per_token_scales [A, d, 2] must be float8e8m0 or uint8, got {scales.dtype}",
            )
            sig.same(sig.dim("per_token_scales", 2), 2, "3-D per_token_scales must be [A, d, 2]")
        elif scales.rank is not None:
            sig.require(
                scales.dtype in (None, "float32"),
                f"{scales.rank}-D per_token_scales must be float32, got {scales.dtype}",
            )
        sig.output("permute_per_token_scales", scales.dtype, scales.shape)
    else:
        sig.output("permute_per_token_scales", "float32", (rows,))
    if "expert_topk_weight" in sig.op.input_names:
        has_weight = sig.has("expert_topk_weight")
        sig.require(
            sig.wants("permute_topk_weight", has_weight) == has_weight,
            "expert_topk_weight and permute_topk_weight must be given together "
            f"(input {'present' if has_weight else 'absent'}, output "
            f"{'absent' if has_weight else 'present'})",
        )
        if has_weight:
            sig.same(sig.dim("expert_topk_weight", 0), rows, "expert_topk_weight must be [A, 1]: dim 0")
            sig.same(sig.dim("expert_topk_weight", 1), 1, "expert_topk_weight must be [A, 1]: dim 1")
            sig.output("permute_topk_weight", "float32", sig.input("expert_topk_weight").shape)
    if sig.attr("tokens_dtype") is not None:
        sig.require(
            tokens.dtype in (None, "uint8"),
            f"tokens_dtype={sig.attr('tokens_dtype')!r} describes uint8 storage, but tokens are {tokens.dtype}",
        )
    sig.output("permute_tokens", tokens.dtype, tokens.shape)
    sig.output("permute_token_idx", "int32", (rows,))
    sig.output("expert_token_num", counts.dtype, (sig.dim("expert_token_num_per_rank", 1),))


#: the NPU's bound on H (ascend950)
MAX_HIDDEN = 16384


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    found = []
    if target.name != "ascend950":
        found.append("the NPU implements this op on ascend950 only")
    hidden = known_dim(sig, "tokens", 1)
    if hidden is not None and not 0 < hidden < MAX_HIDDEN:
        found.append(f"H = {hidden} must satisfy 0 < H < {MAX_HIDDEN}")
    if sig.attr("expert_token_num_type") != 1:
        found.append(f"expert_token_num_type = {sig.attr('expert_token_num_type')}: the NPU supports only 1 (count)")
    return found


#: 6 rows an AllToAll received from 2 ranks, each holding rows for 2 local experts
_EXAMPLE = Example(
    inputs={
        "tokens": np.arange(12, dtype=np.float32).reshape(6, 2),
        "expert_token_num_per_rank": np.array([[1, 2], [2, 1]], np.int32),
    },
)


def _definition(name: str, with_weight: bool) -> OpDef:
    inputs = [
        Input("tokens", TOKEN_DTYPES, "[A, H] rows in rank-major order (the AlltoAll output)", (2,)),
        Input(
            "expert_token_num_per_rank", INDEX, "[N, E]: [r, e] = rows received from rank r for local expert e", (2,)
        ),
        Input(
            "per_token_scales",
            SCALE_DTYPES,
            "[A] or [A, S] float32, or [A, d, 2] float8e8m0/uint8",
            (1, 2, 3),
            optional=True,
        ),
    ]
    outputs = [
        Output("permute_tokens", TOKEN_DTYPES, "[A, H] rows in expert-major order"),
        Output(
            "permute_per_token_scales",
            SCALE_DTYPES,
            "scales reordered like the rows; [A] float32 zeros when scales are absent",
        ),
        Output(
            "permute_token_idx", ("int32",), "[A]: idx_type 0 gather index (dst -> src), 1 scatter index (src -> dst)"
        ),
        Output("expert_token_num", INDEX, "[E] rows per expert (count) or their cumsum"),
    ]
    if with_weight:
        inputs.append(Input("expert_topk_weight", ("float32",), "[A, 1] top-k weight of each row", (2,), optional=True))
        outputs.append(
            Output(
                "permute_topk_weight",
                ("float32",),
                "[A, 1] weights reordered like the rows (iff expert_topk_weight)",
                optional=True,
            )
        )
    attrs = [
        Attr("expert_token_num_type", "int", 1, "1 = count, 0 = cumsum (an extension)", (0, 1)),
        Attr("idx_type", "int", 0, "0 = gather index, 1 = scatter index", (0, 1)),
        Attr("tokens_dtype", "string", None, "real element type of uint8 tokens", PACKED_TOKEN_DTYPES),
    ]
    doc = __doc__ if with_weight else "MoeReRoutingV2 without expert_topk_weight / permute_topk_weight."
    kernel = moe_re_routing_v2 if with_weight else moe_re_routing
    return OpDef(name, doc, inputs, outputs, attrs, _infer, kernel, npu_limits=_npu_limits, example=_EXAMPLE)


MOE_RE_ROUTING_V2 = _definition("MoeReRoutingV2", with_weight=True)
MOE_RE_ROUTING = _definition("MoeReRouting", with_weight=False)
DEFINITIONS = [MOE_RE_ROUTING_V2, MOE_RE_ROUTING]
