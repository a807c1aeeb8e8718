"""What the gating ops share (SPEC 1.13, 1.14): the scores, the top-k selection, the weights.

**Scores.** ``softmax``, ``sigmoid`` and ``sqrt(softplus)`` of the logits are evaluated in
float64 and rounded once to float32: each score is the float32 nearest the exact value (but for
values within ~1e-15 of a rounding boundary). float32 ``exp`` implementations (numpy's,
onnxruntime's, the NPU's) are not correctly rounded and differ from one another by ulps; these
scores do not depend on which one a machine has, and a runtime evaluating the same formulas in
double gives the same bits (the lowered bodies do). The NPU computes in float32; its scores
differ from these by float32 rounding error. (The float64 exp costs about twice a float32
one: measured, 1.0-1.4 against 0.5-0.7 ms for 4096 x 256 logits.)

    softmax:       exp(x - max(x)) / sum(exp(x - max(x)))   (a NaN or +-inf in a row: NaN row)
    sigmoid:       1 / (1 + exp(-x))
    sqrt_softplus: sqrt(max(x, 0) + log1p(exp(-|x|))), inf for x > SOFTPLUS_EXP_LIMIT (88.72283)

The NPU computes sqrt_softplus as ``Sqrt(Ln(Exp(x) + 1))`` in float32, so a logit whose float32
exp overflows gives inf there (SPEC-layer 1.14 (b) amended): the golden gives the same inf.

**Selection.** Experts are ranked by a float32 selection value, descending; equal values go to
the lower expert index (the stable order, AscendC's Sort32 rule for equal scores). A NaN value
ranks as -inf and -0.0 equals +0.0. Grouped selection (MoeGatingTopK, ``group_count > 1``)
first ranks the groups by their score the same way (equal scores: the lower group) and then
chooses only among the experts of the ``k_group`` chosen groups.

**Weights.** ``w_j / (sum_i w_i + eps) * scale`` (or ``w_j * scale``) is evaluated in float64
and rounded once to float32, then to the output dtype.

**Cost.** Per row block (:func:`gate`): a numba pass writes the exp arguments in float64,
``np.exp`` evaluates them, a second numba pass makes the float32 scores and, row by row in
cache, the keys, the group scores, a branch-free top-k and the weights. The float64 exp alone
is the bound that keeps these ops far above the copy floor of reading the logits and writing
the outputs: measured at DeepSeek-V3 shape (4096 x 256 float32, one core), one ``np.exp``
pass over the logits costs 6.7-8.9x the floor of MoeGatingTopKSoftmax and 3.5-4.5x that of
MoeGatingTopK in float64 (2.6-3.5x and 1.2-2.1x in float32); the whole ops cost 23-45x and
14-34x (benchmarks/bench_gating.py prints the exp ratios). The selection (~300 ns a row for
256 experts and k = 8, ~0.5 us with the group scores) is most of the rest. Big calls are
split over threads by rows (:func:`.parallel.for_row_ranges`); each row is computed by one
thread alone, so the bits do not depend on the split or on the blocks.
"""

from __future__ import annotations

import functools

import numpy as np

from . import buffers
from .fused import carrier
from .parallel import for_row_ranges

SOFTMAX, SIGMOID, SQRT_SOFTPLUS = 0, 1, 2
#: the largest float32 x whose float32 exp is finite (bits 0x42B17217); sqrt_softplus is inf above it
SOFTPLUS_EXP_LIMIT = 88.72283172607421875
#: logits of one row block: its float64 work array (512 KiB) stays in one core's L2 cache
#: between the three passes over it
_BLOCK_ELEMENTS = 1 << 16
#: what for_row_ranges weighs per logit to decide on threads: a call splits over threads only
#: when it moves tens of MiB (4M logits). Below that, measured on the 2 shared cores at
#: DeepSeek-V3 and Qwen3 shapes (1M and 512K logits, 1-minute load ~1): two threads took
#: 1.1-2x as long as one (3.9 -> 4.3 ms, 2.8 -> 5.6 ms): the second core is rarely free, and a
#: thread waiting for it holds up the call.
_WORK_BYTES_PER_ELEMENT = 8


@functools.cache
def loops():
    from . import gating_loops

    return gating_loops


def gate(
    x: np.ndarray,
    norm_type: int,
    k: int,
    *,
    offset: np.ndarray | None = None,
    groups: int = 1,
    k_group: int = 1,
    top_two: bool = False,
    hashed: np.ndarray | None = None,
    normalise: bool = False,
    scale: float = 1.0,
    eps: float = 0.0,
    scores: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The scores, the k chosen experts of each row and their weights (the module's rules).

    Per block of rows: one numba pass writes the float64 exp arguments, ``np.exp`` (numpy's
    vectorised exp, as the lowered bodies' Exp in double) evaluates them in place, one numba
    pass turns them into float32 scores and, row by row in cache, keys, group scores, the
    top-k by insertion into k slots and the weights.

    Args:
        x: ``[R, E]`` float32/float16/bfloat16 logits.
        norm_type: SOFTMAX, SIGMOID or SQRT_SOFTPLUS.
        k: experts per row, ``1 <= k <= E`` (``<= k_group * E / groups`` when grouped).
        offset: ``[E]`` float32 added to the scores for the selection only, or None.
        groups, k_group, top_two: grouped selection (``k_group < groups``): keep the
            ``k_group`` groups of best score (their largest value, or with ``top_two`` the
            sum of their two largest) and choose only among their experts.
        hashed: ``[R, k]`` int32 experts chosen already (no selection), or None.
        normalise, scale, eps: the weights ``w_j / (sum_i w_i + eps) * scale``, or
            ``w_j * scale`` without normalise (``w_j`` the unbiased score).
        scores: ``[R, E]`` float32 to receive the scores, or None (not kept).
    Returns:
        ``expert_idx [R, k]`` int32 (row, slot -> expert, best first) and ``weights [R, k]``
        float32.
    """
    rows, experts = x.shape
    expert_idx = buffers.empty((rows, k), np.int32)
    weights = np.empty((rows, k), np.float32)
    logits, kind = carrier(np.ascontiguousarray(x))  # the loops read blocks as flat arrays
    block = max(1, _BLOCK_ELEMENTS // max(experts, 1))
    gl = loops()

    def work(first: int, stop: int) -> None:
        size = min(block, stop - first)
        wide = np.empty((size, experts), np.float64)
        kept = np.empty((size if scores is None else 0, experts), np.float32)  # scores not asked for
        for start in range(first, stop, block):
            end = min(start + block, stop)
            part, exps = logits[start:end], wide[: end - start]
            gl.exp_arguments(part, kind, norm_type, exps)
            with np.errstate(all="ignore"):  # exp overflow gives the formula's inf
                np.exp(exps, out=exps)
                if norm_type == SQRT_SOFTPLUS:
                    np.log1p(exps, out=exps)
            gl.scores_and_choice(
                part,
                kind,
                exps,
                norm_type,
                offset,
                groups,
                k_group,
                top_two,
                None if hashed is None else hashed[start:end],
                normalise,
                float(scale),
                float(eps),
                kept[: end - start] if scores is None else scores[start:end],
                expert_idx[start:end],
                weights[start:end],
            )

    for_row_ranges(work, rows, experts * _WORK_BYTES_PER_ELEMENT)
    return expert_idx, weights
