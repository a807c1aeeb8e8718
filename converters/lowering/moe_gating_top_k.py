"""MoeGatingTopK in standard ONNX ops (SPEC 1.14), with the hash mode.

``s = Cast(score(Cast(x, double)), float)``; ``v = s + bias`` (float); NaN values as -inf.

    hash mode:   expert_idx = Gather(tid2eid, input_ids), both checked in range
    no groups:   expert_idx = TopK(v, k)                                (ties: the lower expert)
    groups:      score[t, g] = ReduceMax or the sum of TopK(2) of v[t, g, :]   ([T, G, E/G])
                 kept = TopK(score, k_group), sorted ascending (a second TopK, smallest first)
                 candidates = v[t, kept, :] flattened [T, k_group*E/G], in ascending expert order
                 c = TopK(candidates, k); expert = kept[c // (E/G)] * (E/G) + c % (E/G)

Choosing among the kept groups' experts only (rather than filling the others with -inf) is the
kernel's rule; TopK over the candidates keeps the lower-expert tie rule since they are listed
in expert order. ``y`` gathers ``s`` at the chosen experts, renormalised and scaled in double.
"""

from __future__ import annotations

from .builder import INT32, INT64, Body, Specialisation
from .gating import DOUBLE, SIGMOID, SQRT_SOFTPLUS, best, ranked, scores, shape_rules, take_along_rows, weights

LOWERS = ("MoeGatingTopK",)


def hashed_experts(b: Body) -> str:
    """``[T, k]`` int64 ``tid2eid[input_ids]``, ids checked in ``[0, V)`` and experts in ``[0, E)``."""
    ids = b.Cast("input_ids", to=INT64)
    ids = b.check_range(ids, 0, b.dim("tid2eid", 0), "input_ids must be in [0, V), the rows of tid2eid")
    chosen = b.Gather(b.Cast("tid2eid", to=INT64), ids, axis=0)
    return b.check_range(chosen, 0, b.dim("x", 1), "tid2eid entries must be experts in [0, E)")


def grouped_experts(b: Body, values: str, k: int, groups: int, k_group: int, top_two: bool) -> str:
    """``[T, k]`` int64: the best k experts of the ``k_group`` best groups (module docstring)."""
    per = b.Div(b.dim("x", 1), b.ints([groups]))
    tokens = b.dim("x", 0)
    grouped = b.Reshape(values, b.Concat(tokens, b.ints([groups]), per, axis=0))  # [T, G, E/G]
    if top_two:
        top, _ = b.TopK(grouped, b.ints([2]), axis=2, largest=1, sorted=1, outputs=2)
        group_score = ranked(b, b.ReduceSum(top, b.ints([2]), keepdims=0))  # inf + -inf: -inf
    else:
        group_score = b.ReduceMax(grouped, b.ints([2]), keepdims=0)
    kept = best(b, group_score, k_group)
    kept, _ = b.TopK(kept, b.ints([k_group]), axis=1, largest=0, sorted=1, outputs=2)  # ascending groups
    rows = b.Expand(b.Unsqueeze(kept, b.ints([2])), b.Concat(tokens, b.ints([k_group]), per, axis=0))
    candidates = b.GatherElements(grouped, rows, axis=1)  # [T, k_group, E/G]
    flat = b.Reshape(candidates, b.Concat(tokens, b.Mul(per, b.ints([k_group])), axis=0))
    chosen = best(b, flat, k)
    group = take_along_rows(b, kept, b.Div(chosen, per))
    return b.Add(b.Mul(group, per), b.Mod(chosen, per))


def body(b: Body, node: Specialisation) -> None:
    dtype = node.dtype("x")
    k, k_group, groups = node.attr("k"), node.attr("k_group"), node.attr("group_count")
    norm_type = node.attr("norm_type")
    gate = shape_rules(b, node)
    s = scores(b, gate(b.Cast("x", to=DOUBLE)), norm_type)
    if node.has("input_ids"):
        chosen = hashed_experts(b)
    else:
        values = s if not node.has("bias") else b.Add(s, b.widen("bias", dtype))
        values = ranked(b, values)
        if groups > 1 and k_group < groups:
            chosen = grouped_experts(b, values, k, groups, k_group, node.attr("group_select_mode") == 1)
        else:
            chosen = best(b, values, k)
    normalise = norm_type in (SIGMOID, SQRT_SOFTPLUS) or node.attr("renorm") == 1
    scale, eps = node.attr("routed_scaling_factor"), node.attr("eps")
    b.output("y", weights(b, s, chosen, normalise, scale, eps, dtype))
    b.output("expert_idx", b.Cast(chosen, to=INT32))
    b.output("out", s)
