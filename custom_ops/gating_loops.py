"""The numba loops behind :mod:`.gating`: order keys, group scores, the chosen entries of a row,
and the weights of the chosen experts. Imported on first use (numba is slow to import).

An *order key* is the int32 whose integer order is the float32 order of a selection value:
NaN is taken as -inf and -0.0 as +0.0 first, so integer equality is IEEE equality. Every key is
above ``INT32_MIN``, which marks an entry that must never be chosen (a dropped group).
"""

from __future__ import annotations

import numpy as np
from numba import njit

INT32_MIN = np.int32(-(2**31))
_NEG_INF_BITS = np.int32(-8388608)  # 0xFF800000, the bits of float32 -inf
_MAGNITUDE = np.int32(0x7FFFFFFF)


@njit(nogil=True, inline="always")
def _flip(bits):
    """float32 bits <-> order key (an involution): negative floats get their magnitude bits
    flipped, so a larger magnitude sorts lower."""
    return bits ^ ((bits >> np.int32(31)) & _MAGNITUDE)


@njit(nogil=True, cache=True)
def order_keys(values, keys):
    """``keys[r, e]``: the order key of float32 ``values[r, e]`` (NaN as -inf, -0.0 as +0.0)."""
    bits = values.view(np.int32)
    for r in range(values.shape[0]):
        for e in range(values.shape[1]):
            b = bits[r, e]
            if (b & _MAGNITUDE) > np.int32(0x7F800000):
                b = _NEG_INF_BITS
            elif b == INT32_MIN:
                b = np.int32(0)
            keys[r, e] = _flip(b)


@njit(nogil=True, cache=True)
def subtract_row_max(work):
    """``work[r] -= max(work[r])``, float64 in place; a NaN in a row makes the max NaN (numpy's
    rule), hence the whole row. A loop here: numpy's reductions cost ~100 ns a row."""
    for r in range(work.shape[0]):
        top = -np.inf
        nan = False
        for e in range(work.shape[1]):
            v = work[r, e]
            nan |= v != v
            top = max(top, v)
        if nan:
            top = np.nan
        for e in range(work.shape[1]):
            work[r, e] -= top


@njit(nogil=True, cache=True)
def divide_by_row_sum(work, out):
    """``out[r] = f32(work[r] / sum(work[r]))``, the sum in float64 in index order."""
    for r in range(work.shape[0]):
        total = 0.0
        for e in range(work.shape[1]):
            total += work[r, e]
        for e in range(work.shape[1]):
            out[r, e] = np.float32(work[r, e] / total)


@njit(nogil=True, cache=True)
def group_scores(keys, groups, top_two, scores):
    """``scores[r, g]``: the order key of group g's score, the largest key of the group
    (``top_two`` False) or the float32 sum of its two largest (True, a NaN sum taken as -inf).

    Args:
        keys: ``[R, E]`` int32 order keys; group g is experts ``g*E/G .. (g+1)*E/G - 1``.
        scores: ``[R, G]`` int32, written.
    """
    per = keys.shape[1] // groups
    cell = np.empty(2, np.int32)  # keys back to floats and a sum back to bits, without allocating
    floats = cell.view(np.float32)
    for r in range(keys.shape[0]):
        for g in range(groups):
            first = INT32_MIN
            second = INT32_MIN
            for e in range(g * per, (g + 1) * per):
                x = keys[r, e]
                second = max(second, min(first, x))
                first = max(first, x)
            if top_two:
                cell[0] = _flip(first)
                cell[1] = _flip(second)
                total = np.float32(floats[0] + floats[1])
                if total != total:  # inf + -inf
                    total = np.float32(-np.inf)
                floats[0] = total
                scores[r, g] = _flip(cell[0])
            else:
                scores[r, g] = first


@njit(nogil=True, cache=True)
def drop_unchosen_groups(keys, group_keys, threshold, k_group, per):
    """Set the keys of every expert outside the ``k_group`` chosen groups to ``INT32_MIN``,
    below every key: such an expert is never chosen.

    The chosen groups of row r are those whose key is above ``threshold[r]`` (the k_group-th
    largest group key), then those equal to it, lowest group first, until there are k_group.
    """
    for r in range(keys.shape[0]):
        tau = threshold[r]
        above = 0
        for g in range(group_keys.shape[1]):
            if group_keys[r, g] > tau:
                above += 1
        equal_wanted = k_group - above
        for g in range(group_keys.shape[1]):
            s = group_keys[r, g]
            if s > tau:
                continue
            if s == tau and equal_wanted > 0:
                equal_wanted -= 1
                continue
            for e in range(g * per, (g + 1) * per):
                keys[r, e] = INT32_MIN


@njit(nogil=True, cache=True)
def chosen_in_order(keys, threshold, k, chosen, above_index, above_keys, equal_index):
    """``chosen[r]``: the k entries of row r with the largest keys, largest first, equal keys
    lowest index first (the stable descending order).

    ``threshold[r]`` is the k-th largest key of the row, so fewer than k entries lie above it
    and at least k at or above it. One pass in index order keeps those above it and the first
    k equal to it; the k chosen (all those above, then the lowest equal ones) are sorted by an
    insertion sort that keeps index order among equal keys.

    Args:
        keys: ``[R, N]`` int32; threshold: ``[R]`` int32.
        chosen: ``[R, k]`` int32, written; above_index, above_keys, equal_index: ``[k]`` scratch.
    """
    for r in range(keys.shape[0]):
        tau = threshold[r]
        above = 0
        equal = 0
        for e in range(keys.shape[1]):
            s = keys[r, e]
            if s > tau:
                above_index[above] = e
                above_keys[above] = s
                above += 1
            elif s == tau and equal < k:
                equal_index[equal] = e
                equal += 1
        for j in range(k - above):  # the equal ones rank below every key above them
            chosen[r, above + j] = equal_index[j]
        for i in range(above):
            s = above_keys[i]
            p = i
            while p > 0 and above_keys[p - 1] < s:  # strictly: an equal key stays ahead
                above_keys[p] = above_keys[p - 1]
                chosen[r, p] = chosen[r, p - 1]
                p -= 1
            above_keys[p] = s
            chosen[r, p] = above_index[i]


@njit(nogil=True, cache=True)
def chosen_weights(scores, chosen, normalise, scale, eps, weights):
    """``weights[r, j] = f32(w_j / (sum_i w_i + eps) * scale)`` (or ``f32(w_j * scale)``
    without ``normalise``), ``w_j = scores[r, chosen[r, j]]``, evaluated in float64 and rounded
    once: the float32 nearest the exact value, whatever the order of the sum."""
    for r in range(chosen.shape[0]):
        total = 0.0
        if normalise:
            for j in range(chosen.shape[1]):
                total += np.float64(scores[r, chosen[r, j]])
            total += eps
        for j in range(chosen.shape[1]):
            w = np.float64(scores[r, chosen[r, j]])
            if normalise:
                w = w / total
            weights[r, j] = np.float32(w * scale)


@njit(nogil=True, cache=True)
def sigmoid_backward(x_norm, grad_y, expert_idx, scale, eps, grad_x, selected_grad):
    """MoeGatingTopKBackward for rows ``[0, R)``, in float64, rounded once to float32.

    ``gs = scale*g; w' = x_norm[t, idx]; D = sum(w') + eps; beta = sum(gs * w'/D);
    gn[t, idx_j] += (gs_j - beta)/D`` (slots in order); ``grad_x = x_norm*(1 - x_norm)*gn``.

    Args:
        x_norm: ``[R, E]`` float32; grad_y: ``[R, K]`` float64; expert_idx: ``[R, K]`` in [0, E).
        grad_x: ``[R, E]`` float32, written; selected_grad: ``[E]`` float64 scratch.
    """
    top_k = expert_idx.shape[1]
    for r in range(x_norm.shape[0]):
        total = eps
        for j in range(top_k):
            total += np.float64(x_norm[r, expert_idx[r, j]])
        beta = 0.0
        for j in range(top_k):
            beta += scale * grad_y[r, j] * (np.float64(x_norm[r, expert_idx[r, j]]) / total)
        selected_grad[:] = 0.0
        for j in range(top_k):
            selected_grad[expert_idx[r, j]] += (scale * grad_y[r, j] - beta) / total
        for e in range(x_norm.shape[1]):
            s = np.float64(x_norm[r, e])
            grad_x[r, e] = np.float32(s * (1.0 - s) * selected_grad[e])
