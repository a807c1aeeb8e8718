"""MoeTokenPermuteWithRoutingMap in standard ONNX ops (SPEC 1.4).

Not padded: ``pairs = nonzero(routing_map.T)`` lists the routed (expert, token) pairs
expert-major, row d of the output; ``permuted_tokens = tokens[token of d]`` (Gather),
``permuted_probs = probs[pairs]`` (GatherND), and ``sorted_indices`` (slot t*K + j -> row) is
computed without a sort (:func:`.routing_map.slot_rows`).

``num_out_tokens = -K`` (not padded): N = T*K, computed from the tokens' dim.

Padded: expert e keeps its first C routed tokens and fills up with unrouted ones, both in
token order: ``TopK`` (ascending) along each row of the unique key
``(not routing_map.T) * T + token`` picks exactly that stable order.
"""

from __future__ import annotations

from .builder import INT32, INT64, Body, Specialisation
from .routing_map import check_rows_multiple, check_topk_rows, expert_major_pairs, routing_mask, slot_rows

LOWERS = ("MoeTokenPermuteWithRoutingMap",)


def body(b: Body, node: Specialisation) -> None:
    tokens = b.dim("tokens", 0)
    num_out_tokens = node.attr("num_out_tokens")
    rows = b.ints([num_out_tokens]) if num_out_tokens >= 0 else b.Mul(tokens, b.ints([-num_out_tokens]))
    mask = routing_mask(b, node)  # (its shape, and probs', are checked by the dim rules)
    if node.attr("drop_and_pad"):
        experts = b.dim(mask, 1)
        mask, capacity = check_rows_multiple(
            b, mask, rows, experts, "padded: num_out_tokens must be a multiple of E", mask=True
        )
        unrouted_last = b.Add(b.Mul(b.Cast(b.Not(b.Transpose(mask, perm=[1, 0])), to=INT64), tokens), b.arange(tokens))
        _, picked = b.TopK(unrouted_last, capacity, axis=1, largest=0, sorted=1, outputs=2)  # [E, C] tokens
        row_token = b.flat(picked)
        if node.wants("permuted_probs"):
            b.output("permuted_probs", b.flat(b.GatherElements(b.Transpose("probs", perm=[1, 0]), picked, axis=1)))
        b.output("sorted_indices", b.Cast(row_token, to=INT32))
    else:
        mask = check_topk_rows(b, mask, rows, tokens)
        pairs = expert_major_pairs(b, mask)
        row_token = b.Gather(pairs, b.int64(0), axis=1)
        if node.wants("permuted_probs"):
            b.output("permuted_probs", b.GatherND("probs", pairs))
        b.output("sorted_indices", b.Cast(slot_rows(b, mask), to=INT32))
    b.output("permuted_tokens", b.Gather("tokens", row_token, axis=0))
