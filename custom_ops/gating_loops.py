"""The numba loops behind :mod:`.gating`: order keys, group scores, the chosen entries of a row,
and the weights of the chosen experts. Imported on first use (numba is slow to import).

An *order key* is the int32 whose integer order is the float32 order of a selection value:
NaN is taken as -inf and -0.0 as +0.0 first, so integer equality is IEEE equality. Every key is
above ``INT32_MIN``, which marks an entry that must never be chosen (a dropped group).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .fused import BFLOAT16, FLOAT16
from .fused_loops import _float32_as_int32, _float64_as_int64, _int32_as_float32, _int64_as_float64, _widen_one
from .gating import SOFTPLUS_EXP_LIMIT

SOFTMAX, SIGMOID, SQRT_SOFTPLUS = 0, 1, 2
INT32_MIN = np.int32(-(2**31))
_NEG_INF_BITS = np.int32(-8388608)  # 0xFF800000, the bits of float32 -inf
_MAGNITUDE = np.int32(0x7FFFFFFF)
_INT64_MIN = np.int64(-(2**63))
_MAGNITUDE64 = np.int64(2**63 - 1)
_INF_BITS64 = np.int64(0x7FF0000000000000)


@njit(nogil=True, inline="always")
def _flip(bits):
    """float32 bits <-> order key (an involution): negative floats get their magnitude bits
    flipped, so a larger magnitude sorts lower."""
    return bits ^ ((bits >> np.int32(31)) & _MAGNITUDE)


@njit(nogil=True, inline="always")
def _order_key(value):
    """The order key of a float32 selection value (NaN as -inf, -0.0 as +0.0)."""
    b = _float32_as_int32(value)
    if (b & _MAGNITUDE) > np.int32(0x7F800000):
        b = _NEG_INF_BITS
    elif b == INT32_MIN:
        b = np.int32(0)
    return _flip(b)


@njit(nogil=True, cache=True)
def _top_k(keys, n, best_index):
    """``best_index[j]``: the entry of ``keys[:n]`` with the j-th largest key, equal keys
    lowest index first (the stable descending order), for every j of ``best_index``.

    A tournament free of data-dependent branches: each round takes the largest key and the
    first entry holding it, then sets that entry to ``INT32_MIN`` (below every key). Both are
    reductions, which vectorise (int32 throughout: a mixed-width select does not); measured
    against numpy's vectorised partition plus a pass collecting the chosen, ~300 against ~500 ns
    for a row of 256 keys and k = 8, and 25 against ~60 ns for 8 keys and k = 2.

    Args:
        keys: ``[>= n]`` int32, every key above ``INT32_MIN``; overwritten (the chosen ones).
        best_index: ``[k]`` int32, written, ``k <= n``.
    """
    for j in range(best_index.shape[0]):
        top = INT32_MIN
        for e in range(n):
            top = max(top, keys[e])
        first = np.int32(n)
        for e in range(n):
            first = min(first, np.int32(e) if keys[e] == top else np.int32(n))
        best_index[j] = first
        keys[first] = INT32_MIN


@njit(nogil=True, inline="always")
def _group_key(keys, first_expert, per, top_two):
    """The order key of a group's score: its largest key, or (``top_two``) the key of the
    float32 sum of its two largest values (a repeated largest counts twice; a NaN sum, inf +
    -inf, as -inf). Max reductions and a count, which vectorise."""
    top = INT32_MIN
    for e in range(first_expert, first_expert + per):
        top = max(top, keys[e])
    if not top_two:
        return top
    count = 0
    second = INT32_MIN
    for e in range(first_expert, first_expert + per):
        key = keys[e]
        count += key == top
        second = max(second, key if key < top else INT32_MIN)
    if count > 1:
        second = top
    total = np.float32(_int32_as_float32(np.int32(_flip(top))) + _int32_as_float32(np.int32(_flip(second))))
    if total != total:
        total = np.float32(-np.inf)
    return _flip(_float32_as_int32(total))


@njit(nogil=True, cache=True, error_model="numpy")
def exp_arguments(x, kind, norm_type, wide):
    """``wide[r]``: the float64 argument of the exp of each score of row r, for ``np.exp``.

    softmax ``x - max(x)`` (a NaN in the row makes the max NaN, numpy's rule, hence the whole
    row); sigmoid ``-x``; sqrt_softplus ``-|x|``. ``x``: ``[R, E]`` float32, or float16 /
    bfloat16 bits (carrier of ``kind``); widening is exact.
    """
    if kind == BFLOAT16:  # one loop body per element type (see fused_loops._swiglu)
        _exp_arguments(x, BFLOAT16, norm_type, wide)
    else:
        _exp_arguments(x, FLOAT16, norm_type, wide)


@njit(nogil=True, inline="always")
def _exp_arguments(x, kind, norm_type, wide):
    if norm_type != SOFTMAX:  # elementwise: one flat loop over the block, whatever E
        flat, target = x.reshape(x.size), wide.reshape(wide.size)
        for i in range(target.shape[0]):
            v = np.float64(_widen_one(flat, i, kind))
            target[i] = -v if norm_type == SIGMOID else -abs(v)
        return
    experts = wide.shape[1]
    for r in range(x.shape[0]):  # 2-D indexing throughout: a row view costs two atomic ops
        for e in range(experts):
            wide[r, e] = np.float64(_widen_one(x, (r, e), kind))
        # the max on the order keys of the float64 bits: an integer max vectorises, a float
        # one (NaN-aware) does not; which of +-0.0 is the max changes no x - max
        top = _INT64_MIN
        nan = False
        for e in range(experts):
            b = _float64_as_int64(wide[r, e])
            nan |= (b & _MAGNITUDE64) > _INF_BITS64
            top = max(top, b ^ ((b >> np.int64(63)) & _MAGNITUDE64))
        largest = np.nan if nan else _int64_as_float64(top ^ ((top >> np.int64(63)) & _MAGNITUDE64))
        for e in range(experts):
            wide[r, e] -= largest


@njit(nogil=True, cache=True, error_model="numpy")
def scores_and_choice(
    x,
    kind,
    wide,
    norm_type,
    offset,
    groups,
    k_group,
    top_two,
    hashed,
    normalise,
    scale,
    eps,
    scores,
    expert_idx,
    weights,
):
    """Per row r: the float32 scores, the k chosen experts and their weights (see .gating).

    Args:
        x: ``[R, E]`` the logits (carrier of ``kind``; read by sqrt_softplus only).
        wide: ``[R, E]`` float64: ``exp`` of :func:`exp_arguments` (sqrt_softplus: its log1p).
        norm_type: SOFTMAX / SIGMOID / SQRT_SOFTPLUS.
        offset: ``[E]`` float32 added to the scores for the selection, or None.
        groups, k_group, top_two: grouped selection when ``k_group < groups`` (see
            :func:`.gating.gate`).
        hashed: ``[R, k]`` int32 experts chosen already (hash mode: no selection), or None.
        normalise, scale, eps: ``w_j / (sum_i w_i + eps) * scale`` (or ``w_j * scale``),
            evaluated in float64 and rounded once.
        scores: ``[R, E]`` float32, written; expert_idx: ``[R, k]`` int32, written;
        weights: ``[R, k]`` float32, written.
    """
    top_k = expert_idx.shape[1]
    experts = wide.shape[1]
    # scratch allocated here, not passed in: LLVM then knows it aliases nothing, and vectorises
    keys, best_index = np.empty(experts, np.int32), np.empty(top_k, np.int32)
    group_keys, best_group = np.empty(groups, np.int32), np.empty(k_group, np.int32)
    grouped = groups > 1 and k_group < groups
    per = experts // groups
    kept_keys = np.empty(k_group * per if grouped else 0, np.int32)
    if norm_type == SIGMOID:  # elementwise: one flat loop over the block
        flat_scores, flat_exps = scores.reshape(scores.size), wide.reshape(wide.size)
        for i in range(flat_scores.shape[0]):
            flat_scores[i] = np.float32(1.0 / (flat_exps[i] + 1.0))
    for r in range(wide.shape[0]):
        if norm_type == SOFTMAX:
            total = 0.0
            for e in range(experts):
                total += wide[r, e]
            for e in range(experts):
                scores[r, e] = np.float32(wide[r, e] / total)
        elif norm_type == SQRT_SOFTPLUS:
            for e in range(experts):
                v = np.float64(_widen_one(x, (r, e), kind))
                positive = v if v > 0.0 else 0.0  # a NaN logit: wide[r, e] is that NaN already
                scores[r, e] = np.float32(np.sqrt(wide[r, e] + positive))
                if v > SOFTPLUS_EXP_LIMIT:  # the NPU's float32 Exp(x) is inf: Sqrt(Ln(inf + 1)) = inf
                    scores[r, e] = np.float32(np.inf)
        if hashed is not None:
            for j in range(top_k):
                best_index[j] = hashed[r, j]
        else:
            if offset is None:
                for e in range(experts):
                    keys[e] = _order_key(scores[r, e])
            else:
                for e in range(experts):
                    keys[e] = _order_key(np.float32(scores[r, e] + offset[e]))
            if grouped:
                for g in range(groups):
                    group_keys[g] = _group_key(keys, g * per, per, top_two)
                _top_k(group_keys, groups, best_group)
                for i in range(1, k_group):  # kept groups in group order (an insertion sort of a few)
                    g = best_group[i]
                    p = i
                    while p > 0 and best_group[p - 1] > g:
                        best_group[p] = best_group[p - 1]
                        p -= 1
                    best_group[p] = g
                for i in range(k_group):
                    for e in range(per):
                        kept_keys[i * per + e] = keys[best_group[i] * per + e]
                _top_k(kept_keys, k_group * per, best_index)
                for j in range(top_k):  # back to expert ids
                    best_index[j] = best_group[best_index[j] // per] * per + best_index[j] % per
            else:
                _top_k(keys, experts, best_index)
        total = 0.0
        if normalise:
            for j in range(top_k):
                total += np.float64(scores[r, best_index[j]])
            total += eps
        for j in range(top_k):
            expert_idx[r, j] = best_index[j]
            w = np.float64(scores[r, best_index[j]])
            if normalise:
                w = w / total
            weights[r, j] = np.float32(w * scale)


@njit(nogil=True, cache=True)
def sigmoid_backward(x_norm, grad_y, grad_kind, expert_idx, scale, eps, grad_x):
    """MoeGatingTopKBackward for rows ``[0, R)``, in float64, rounded once to float32.

    ``gs = scale*g; w' = x_norm[t, idx]; D = sum(w') + eps; beta = sum(gs * w'/D);
    gn[t, idx_j] += (gs_j - beta)/D`` (slots in order); ``grad_x = x_norm*(1 - x_norm)*gn``.

    Args:
        x_norm: ``[R, E]`` float32; grad_y: ``[R, K]`` (carrier of ``grad_kind``, widened
            exactly); expert_idx: ``[R, K]`` in [0, E).
        grad_x: ``[R, E]`` float32, written.
    """
    top_k = expert_idx.shape[1]
    selected_grad = np.zeros(x_norm.shape[1], np.float64)  # gn of one row; back to 0 after it
    for r in range(x_norm.shape[0]):
        total = eps
        for j in range(top_k):
            total += np.float64(x_norm[r, expert_idx[r, j]])
        beta = 0.0
        for j in range(top_k):
            g = np.float64(_widen_one(grad_y, (r, j), grad_kind))
            beta += scale * g * (np.float64(x_norm[r, expert_idx[r, j]]) / total)
        for j in range(top_k):
            g = np.float64(_widen_one(grad_y, (r, j), grad_kind))
            selected_grad[expert_idx[r, j]] += (scale * g - beta) / total
        for e in range(x_norm.shape[1]):
            s = np.float64(x_norm[r, e])
            grad_x[r, e] = np.float32(s * (1.0 - s) * selected_grad[e])
        for j in range(top_k):
            selected_grad[expert_idx[r, j]] = 0.0
