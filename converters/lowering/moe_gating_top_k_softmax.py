"""MoeGatingTopKSoftmax in standard ONNX ops (SPEC 1.13).

The leading dims flatten to ``n`` rows; ``P = Cast(softmax(Cast(x, double)), float)``;
``expert_idx = TopK(P with NaN as -inf, k)`` (ties to the lower expert); ``y = Cast(P[expert_idx])``;
finished rows get expert E (``Where``); float16 logits outside the NPU's fast template are ranked
by ``Cast(P, float16)`` (a ``Where`` on E at run time); ``row_idx[r, j] = j*n + r`` is ``Range(0, n*k)`` read as
``[k, n]`` and transposed. Every output is reshaped to ``x.shape[:-1] + [k]``.
"""

from __future__ import annotations

from .builder import FLOAT, INT32, INT64, Body, Specialisation
from .gating import DOUBLE, FLOAT16, SOFTMAX, best, ranked, scores, shape_rules, take_along_rows

LOWERS = ("MoeGatingTopKSoftmax",)


def _float16_path(b: Body, probs: str, chosen: str, experts: str, k: int) -> tuple[str, str]:
    """The probabilities and the choice of float16 logits: outside the NPU's fast template
    (``ranks_in_float32``, decided at run time from E) ranked by the float16 probabilities, ties
    to the lower expert (SPEC-layer 1.13 (b) amended)."""
    half = b.Cast(b.Cast(probs, to=FLOAT16), to=FLOAT)
    by_half = best(b, ranked(b, half), k)
    if k <= 8:
        aligned = b.And(b.LessOrEqual(experts, b.ints([1024])), b.Equal(b.Mod(experts, b.ints([8])), b.ints([0])))
        fast = b.Or(b.Less(experts, b.ints([8])), aligned)
    else:
        fast = b.Less(experts, b.ints([8]))
    return b.Where(fast, probs, half), b.Where(fast, chosen, by_half)


def body(b: Body, node: Specialisation) -> None:
    rank = node.input_ranks[0]
    if rank is None:
        raise node.refuse("x must have a known rank")
    k = node.attr("k")
    gate = shape_rules(b, node)
    lead = gate(b.Shape("x", end=rank - 1))
    experts = b.dim("x", rank - 1)
    rows = b.ReduceProd(lead, keepdims=1)  # n = B*S for 3-D inputs
    flat = b.Reshape("x", b.Concat(rows, experts, axis=0))
    probs = scores(b, b.Cast(flat, to=DOUBLE), SOFTMAX)
    chosen = best(b, ranked(b, probs), k)
    if node.dtype("x") == "float16":
        probs, chosen = _float16_path(b, probs, chosen, experts, k)
    out_shape = b.Concat(lead, b.ints([k]), axis=0)
    b.output("y", b.Reshape(b.narrow(take_along_rows(b, probs, chosen), node.dtype("x")), out_shape))
    if node.has("finished"):
        finished = b.Unsqueeze(b.Reshape("finished", rows), b.ints([1]))
        chosen = b.Where(finished, b.Cast(experts, to=INT64), chosen)
    b.output("expert_idx", b.Reshape(b.Cast(chosen, to=INT32), out_shape))
    slots = b.Range(b.int64(0), b.Squeeze(b.Mul(rows, b.ints([k])), b.ints([0])), b.int64(1))
    column_major = b.Transpose(b.Reshape(slots, b.Concat(b.ints([k]), rows, axis=0)), perm=[1, 0])
    b.output("row_idx", b.Reshape(b.Cast(column_major, to=INT32), out_shape))
