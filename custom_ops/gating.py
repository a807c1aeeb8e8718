"""What the gating ops share (SPEC 1.13, 1.14): the scores, the top-k selection, the weights.

**Scores.** ``softmax``, ``sigmoid`` and ``sqrt(softplus)`` of the logits are evaluated in
float64 and rounded once to float32: each score is the float32 nearest the exact value (but for
values within ~1e-15 of a rounding boundary). float32 ``exp`` implementations (numpy's,
onnxruntime's, the NPU's) are not correctly rounded and differ from one another by ulps; these
scores do not depend on which one a machine has, and a runtime evaluating the same formulas in
double gives the same bits (the lowered bodies do). The NPU computes in float32; its scores
differ from these by float32 rounding error. (The float64 evaluation costs about twice a
float32 one: measured, 0.157 against 0.068 ms for a 512 x 256 sigmoid block.)

    softmax:       exp(x - max(x)) / sum(exp(x - max(x)))   (a NaN or +-inf in a row: NaN row)
    sigmoid:       1 / (1 + exp(-x))
    sqrt_softplus: sqrt(max(x, 0) + log1p(exp(-|x|)))

**Selection.** Experts are ranked by a float32 selection value, descending; equal values go to
the lower expert index (the stable order, AscendC's Sort32 rule for equal scores). A NaN value
ranks as -inf and -0.0 equals +0.0. Grouped selection (MoeGatingTopK, ``group_count > 1``)
first ranks the groups by their score the same way (equal scores: the lower group) and then
chooses only among the experts of the ``k_group`` chosen groups.

**Weights.** ``w_j / (sum_i w_i + eps) * scale`` (or ``w_j * scale``) is evaluated in float64
and rounded once to float32, then to the output dtype.

Big calls are split over threads by rows (:func:`.parallel.for_row_ranges`); each row is
computed by one thread alone, so the bits do not depend on the split.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import ml_dtypes
import numpy as np

from .parallel import for_row_ranges

SOFTMAX, SIGMOID, SQRT_SOFTPLUS = 0, 1, 2
#: elements of one row block: its float64 scratch (1 MiB) about fills one core's L2 cache
_BLOCK_ELEMENTS = 1 << 17
#: bytes read and written per logit (what for_row_ranges weighs to decide on threads): a call
#: splits over threads only when it moves tens of MiB. Below that, measured on 2 cores at
#: DeepSeek-V3 shape (1M logits), two threads took 3-4x longer than one: each block is a dozen
#: short numpy / numba calls, and the threads queue for the GIL between them.
_WORK_BYTES_PER_ELEMENT = 8


@functools.cache
def loops():
    from . import gating_loops

    return gating_loops


def _widen(x: np.ndarray, out: np.ndarray, negate: bool = False) -> None:
    """``out[:] = x`` (or ``-x``) as float64, exact; bfloat16 through its bits (ml_dtypes' cast
    is slower)."""
    if x.dtype == ml_dtypes.bfloat16:
        x = np.left_shift(x.view(np.uint16), 16, dtype=np.uint32).view(np.float32)
    if negate:
        np.negative(x, out=out)
    else:
        out[:] = x


def scores_into(x: np.ndarray, norm_type: int, out: np.ndarray, work: np.ndarray) -> None:
    """``out = f32(score(x))`` row by row (the module docstring's formulas, in float64).

    Args:
        x: ``[R, E]`` float32/float16/bfloat16 logits.
        out: ``[R, E]`` float32, written.
        work: ``[R, E]`` float64 scratch.
    """
    with np.errstate(all="ignore"):  # inf - inf and exp overflow give the formula's NaN / inf
        if norm_type == SOFTMAX:
            _widen(x, work)
            loops().subtract_row_max(work)
            np.exp(work, out=work)
            loops().divide_by_row_sum(work, out)
        elif norm_type == SIGMOID:
            _widen(x, work, negate=True)
            np.exp(work, out=work)
            work += 1.0
            np.divide(1.0, work, out=out)
        else:
            _widen(x, work)
            positive = np.maximum(work, 0.0)
            np.abs(work, out=work)
            np.negative(work, out=work)
            np.exp(work, out=work)
            np.log1p(work, out=work)
            work += positive
            np.sqrt(work, out=out)


def kth_largest(keys: np.ndarray, k: int) -> np.ndarray:
    """``[R]`` int32: the k-th largest key of each row (numpy's vectorised partition)."""
    n = keys.shape[1]
    return np.ascontiguousarray(np.partition(keys, n - k, axis=1)[:, n - k])


def select(
    values: np.ndarray, k: int, groups: int = 1, k_group: int = 1, top_two: bool = False, keys=None
) -> np.ndarray:
    """``[R, k]`` int32: the chosen experts of each row, best first (the module's rule).

    Args:
        values: ``[R, E]`` float32 selection values.
        groups, k_group, top_two: grouped selection (``groups > 1``): keep the ``k_group``
            groups of best score (their largest value, or with ``top_two`` the sum of their two
            largest) and choose only among their experts.
        keys: ``[R, E]`` int32 scratch (the order keys), or None.
    """
    gl = loops()
    rows, experts = values.shape
    keys = np.empty((rows, experts), np.int32) if keys is None else keys
    gl.order_keys(values, keys)
    if groups > 1 and k_group < groups:
        group_keys = np.empty((rows, groups), np.int32)
        gl.group_scores(keys, groups, top_two, group_keys)
        gl.drop_unchosen_groups(keys, group_keys, kth_largest(group_keys, k_group), k_group, experts // groups)
    chosen = np.empty((rows, k), np.int32)
    scratch = np.empty((3, k), np.int32)
    gl.chosen_in_order(keys, kth_largest(keys, k), k, chosen, scratch[0], scratch[1], scratch[2])
    return chosen


def weights(scores: np.ndarray, chosen: np.ndarray, normalise: bool, scale: float, eps: float) -> np.ndarray:
    """``[R, k]`` float32 weights of the chosen experts (the module's rule)."""
    out = np.empty(chosen.shape, np.float32)
    loops().chosen_weights(scores, chosen, normalise, float(scale), float(eps), out)
    return out


class Scratch:
    """Work arrays for row blocks of up to ``rows`` rows of ``experts`` values, reused from
    block to block (fresh ones would be paged in again for every block)."""

    def __init__(self, rows: int, experts: int):
        self.wide = np.empty((rows, experts), np.float64)
        self.values = np.empty((rows, experts), np.float32)
        self.keys = np.empty((rows, experts), np.int32)

    def of(self, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The (float64, float32, int32) work arrays of a block of ``rows`` rows."""
        return self.wide[:rows], self.values[:rows], self.keys[:rows]


def by_row_blocks(rows: int, experts: int, work: Callable[[int, int, Scratch], None]) -> None:
    """Call ``work(first, stop, scratch)`` over row blocks of about ``_BLOCK_ELEMENTS``
    elements, the blocks shared out among threads when the call is big enough."""
    block = max(1, _BLOCK_ELEMENTS // max(experts, 1))

    def blocks(first: int, stop: int) -> None:
        scratch = Scratch(min(block, stop - first), experts)
        for start in range(first, stop, block):
            work(start, min(start + block, stop), scratch)

    for_row_ranges(blocks, rows, experts * _WORK_BYTES_PER_ELEMENT)
