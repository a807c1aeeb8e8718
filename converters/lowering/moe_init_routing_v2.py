"""MoeInitRoutingV2 in standard ONNX ops (SPEC 1.2).

Source position ``p = t*K + j`` (token-major); sorting the flattened expert ids stably gives
``order[d] = p`` (destination d in expert order <- source position p). ONNX has no stable
sort, but ``TopK`` (ascending, sorted) of the unique int64 key ``expert*(T*K) + p`` returns
exactly the stable order, ties broken by position as in the kernel.

    dropless / active:  expanded_x[d] = x[order[d] // K] for d < A (A = T*K or min(active_num, T*K))
                        expanded_row_idx[order[d]] = d
    drop/pad:           rank[d] = d - first row of expert(d); kept if rank < C
                        expanded_row_idx[order[d]] = expert*C + rank, or -1 when dropped
                        expanded_x [E, C, H]: slot expert*C + rank takes x[order[d] // K];
                        empty slots read a zero row appended to x
    counts:             histogram of the expert ids (ScatterElements with reduction="add")
"""

from __future__ import annotations

from .builder import INT32, INT64, Body, Specialisation

LOWERS = ("MoeInitRoutingV2",)


def stable_order(b: Body, keys: str, n: str) -> str:
    """``[n]`` int64 ``order[d] = p``: the stable ascending argsort of ``keys [n]`` (int64 holding
    int32 values, so ``key * n + p`` cannot overflow)."""
    unique = b.Add(b.Mul(keys, n), b.arange(n))
    _, order = b.TopK(unique, n, axis=0, largest=0, sorted=1, outputs=2)
    return order


def histogram(b: Body, ids: str, bins: int) -> str:
    """``[bins]`` int64 counts of ``ids`` (int64, checked to lie in ``[0, bins)``)."""
    ones = b.full(b.Shape(ids), 1, "int64")
    return b.ScatterElements(b.full(b.ints([bins]), 0, "int64"), ids, ones, axis=0, reduction="add")


def body(b: Body, node: Specialisation) -> None:
    active_num, capacity = node.attr("active_num"), node.attr("expert_capacity")
    experts, drop_pad = node.attr("expert_num"), node.attr("drop_pad_mode") == 1
    tokens, top_k = b.dim("expert_idx", 0), b.dim("expert_idx", 1)
    ids = b.flat(b.Cast("expert_idx", to=INT64))  # [T*K], position p = t*K + j
    if experts > 0:
        ids = b.check_range(ids, 0, experts, f"expert_idx must be in [0, expert_num) = [0, {experts})")
    n = b.Shape(ids)
    order = stable_order(b, ids, n)
    source_token = b.Div(order, b.safe_divisor(top_k))
    positions = b.arange(n)
    counts = histogram(b, ids, experts) if experts > 0 else None

    if not drop_pad:
        kept = source_token if active_num == 0 else b.Slice(source_token, b.ints([0]), b.ints([active_num]))
        b.output("expanded_x", b.Gather("x", kept, axis=0))
        destination = positions
    else:
        sorted_ids = b.Gather(ids, order, axis=0)
        first_row = b.CumSum(counts, b.int64(0), exclusive=1)
        rank = b.Sub(positions, b.Gather(first_row, sorted_ids, axis=0))
        kept = b.Less(rank, b.ints([capacity]))
        slot = b.Add(b.Mul(sorted_ids, b.ints([capacity])), rank)
        destination = b.Where(kept, slot, b.ints([-1]))
        slots = experts * capacity
        # dropped entries write a spare slot; unfilled slots read row T, the zero row
        slot_token = b.ScatterElements(
            b.Expand(tokens, b.ints([slots + 1])), b.Where(kept, slot, b.ints([slots])), source_token, axis=0
        )
        slot_token = b.Slice(slot_token, b.ints([0]), b.ints([slots]))
        rows = b.Gather(b.zero_row_below("x", node.dtype("x")), slot_token, axis=0)
        b.output("expanded_x", b.Reshape(rows, b.Concat(b.ints([experts, capacity]), b.dim("x", 1), axis=0)))

    row_idx = b.ScatterElements(b.full(n, 0, "int32"), order, b.Cast(destination, to=INT32), axis=0)
    b.output("expanded_row_idx", row_idx)
    flag = node.attr("expert_tokens_count_or_cumsum_flag")
    if flag:
        per_expert = b.CumSum(counts, b.int64(0)) if flag == 1 else counts
        b.output("expert_tokens_count_or_cumsum", b.Cast(per_expert, to=INT32))
    if node.attr("expert_tokens_before_capacity_flag"):
        b.output("expert_tokens_before_capacity", b.Cast(counts, to=INT32))
