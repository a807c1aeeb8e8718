"""MoeReRoutingV2 / MoeReRouting in standard ONNX ops (SPEC 1.1).

With ``cnt = expert_token_num_per_rank [N, E]`` the rows arrive rank-major (rank r, then
expert e) and leave expert-major (expert e, then rank r). Listed in destination order, block
``b = e*N + r`` has ``cnt[r, e]`` rows and starts at

    src_start[b] = sum(cnt[:r, :]) + sum(cnt[r, :e])      (rank-major exclusive cumsum)
    dst_start[b] = sum(cnt[:, :e]) + sum(cnt[:r, e])      (expert-major exclusive cumsum)

Destination row d lies in the last block that starts at or before d (an empty block that
starts there too comes earlier), so with ``starts_at[i] = #{b : dst_start[b] == i}``,
``block[d] = cumsum(starts_at)[d] - 1`` and the gather index (destination -> source) is

    gather[d] = d + (src_start - dst_start)[block[d]]

No sort: O(A + N*E) index work, then one Gather per permuted tensor, a bit-exact row copy.
float8 rows are not taken by ``Gather``; they cross it as float16 (``Cast`` both ways with
``saturate=0``, opset 19): exact for every float8e4m3fn byte and every float8e5m2 byte except
NaN payloads, which onnxruntime's Cast makes 0x7F/0xFF. float8e8m0 scales cannot be lowered.
"""

from __future__ import annotations

from moe_onnx.custom_ops import dtypes

from .builder import INT32, INT64, Body, Specialisation

LOWERS = ("MoeReRoutingV2", "MoeReRouting")

_FLOAT8 = ("float8e4m3fn", "float8e5m2")


def gather_index(b: Body, counts: str, rows: str) -> str:
    """``[A]`` int64, ``gather[d] = s``: destination row d takes source row s.

    Args:
        counts: ``[N, E]`` int64, checked (>= 0, summing to A).
        rows: ``[1]`` int64, A.
    """
    rank_major = b.flat(counts)
    expert_major = b.flat(b.Transpose(counts, perm=[1, 0]))  # block e*N + r: its length
    src_start = b.flat(
        b.Transpose(b.Reshape(b.CumSum(rank_major, b.int64(0), exclusive=1), b.Shape(counts)), perm=[1, 0])
    )
    dst_start = b.CumSum(expert_major, b.int64(0), exclusive=1)
    ones = b.full(b.Shape(dst_start), 1, "int64")
    # trailing empty blocks start at A: one spare slot
    starts_at = b.ScatterElements(
        b.full(b.Add(rows, b.ints([1])), 0, "int64"), dst_start, ones, axis=0, reduction="add"
    )
    block = b.Sub(b.CumSum(b.Slice(starts_at, b.ints([0]), rows), b.int64(0)), b.ints([1]))
    return b.Add(b.arange(rows), b.Gather(b.Sub(src_start, dst_start), block, axis=0))


def move_rows(b: Body, x: str, dtype: str, index: str) -> str:
    """``x[index]`` along axis 0, bit-exact (float8 through float16, see the module doc)."""
    if dtype not in _FLOAT8:
        return b.Gather(x, index, axis=0)
    wide = b.Gather(b.cast(x, "float16"), index, axis=0)
    return b.Cast(wide, to=dtypes.onnx_type(dtype), saturate=0)


def body(b: Body, node: Specialisation) -> None:
    tokens_dtype = node.dtype("tokens")
    if tokens_dtype in _FLOAT8 and node.opset < 19:
        raise node.refuse(f"{tokens_dtype} tokens need opset >= 19 (Cast with saturate=0); the model has {node.opset}")
    if node.has("per_token_scales") and node.dtype("per_token_scales") == "float8e8m0":
        raise node.refuse(
            "float8e8m0 per_token_scales: no standard op moves float8e8m0 rows (Gather does not take them) "
            "and onnxruntime 1.32 has no Cast for float8e8m0; pass the scales as uint8 (the same bytes)"
        )
    rows = b.dim("tokens", 0)
    counts = b.Cast("expert_token_num_per_rank", to=INT64)
    negative = b.Less(counts, b.ints([0]))
    counts = b.check(counts, b.none_true(negative), "expert_token_num_per_rank must be >= 0")
    total = b.ReduceSum(b.flat(counts), keepdims=1)
    counts = b.check(counts, b.Equal(total, rows), "sum(expert_token_num_per_rank) must equal A = tokens.shape[0]")
    gather = gather_index(b, counts, rows)

    b.output("permute_tokens", move_rows(b, "tokens", tokens_dtype, gather))
    if node.has("per_token_scales"):
        b.output("permute_per_token_scales", move_rows(b, "per_token_scales", node.dtype("per_token_scales"), gather))
    else:
        b.output("permute_per_token_scales", b.full(rows, 0.0, "float32"))
    if node.attr("idx_type") == 0:
        b.output("permute_token_idx", b.Cast(gather, to=INT32))
    else:  # the inverse permutation: idx[gather[d]] = d
        destination = b.Cast(b.arange(rows), to=INT32)
        b.output("permute_token_idx", b.ScatterElements(b.full(rows, 0, "int32"), gather, destination, axis=0))
    per_expert = b.ReduceSum(counts, b.ints([0]), keepdims=0)
    if node.attr("expert_token_num_type") == 0:
        per_expert = b.CumSum(per_expert, b.int64(0))
    b.output("expert_token_num", b.cast(per_expert, node.dtype("expert_token_num_per_rank")))
    if "expert_topk_weight" in node.op.input_names and node.has("expert_topk_weight"):
        b.output("permute_topk_weight", b.Gather("expert_topk_weight", gather, axis=0))
