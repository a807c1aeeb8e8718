"""Loop references of the routing-map family (SPEC 1.4-1.6) and the random cases the tests
draw; ``test_routing_map_reference`` checks the references against examples worked by hand.

The references are written from the SPEC formulas with Python loops and share no code with
the kernels. Products are rounded to float32 before the float32 sums, in the order the
SPEC lists the terms, as the kernels do: float32 results can then be compared bit for bit.
"""

from __future__ import annotations

import itertools
import math

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

FLOAT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


def make_routing(rng, n_tokens: int, n_experts: int, top_k: int | None, map_dtype=np.bool_):
    """A routing map: exactly ``top_k`` experts per token, or (None) any number of them."""
    if top_k is None:
        routing = rng.random((n_tokens, n_experts)) < rng.choice([0.2, 0.5, 0.9])
    else:
        routing = np.zeros((n_tokens, n_experts), bool)
        for t in range(n_tokens):
            routing[t, rng.permutation(n_experts)[:top_k]] = True
    return routing.astype(map_dtype)


def make_probs(rng, routing_map, dtype, normalized=False):
    probs = rng.random(routing_map.shape) + 0.1
    if normalized:  # probs over each token's experts sum to 1, zero elsewhere
        probs = np.where(routing_map.astype(bool), probs, 0)
        probs /= np.maximum(probs.sum(axis=1, keepdims=True), 1e-30)
    return probs.astype(dtype)


def f32(x):
    return np.asarray(x).astype(np.float32)


def permute_reference(tokens, routing_map, probs, num_out_tokens, drop_and_pad):
    """(permuted_tokens, sorted_indices, permuted_probs or None)."""
    routed = routing_map.astype(bool)
    n_tokens, n_experts = routed.shape
    if drop_and_pad:
        capacity = num_out_tokens // n_experts
        sorted_indices = []
        for e in range(n_experts):
            in_order = [t for t in range(n_tokens) if routed[t, e]] + [t for t in range(n_tokens) if not routed[t, e]]
            sorted_indices += in_order[:capacity]
        rows = [(t, d // capacity) for d, t in enumerate(sorted_indices)]
    else:
        top_k = num_out_tokens // n_tokens
        rows = [(t, e) for e in range(n_experts) for t in range(n_tokens) if routed[t, e]]
        sorted_indices = [0] * len(rows)
        for d, (t, e) in enumerate(rows):
            j = int(routed[t, :e].sum())  # e is t's j-th expert
            sorted_indices[t * top_k + j] = d
    permuted = np.array([tokens[t] for t, _ in rows], tokens.dtype).reshape(len(rows), tokens.shape[1])
    permuted_probs = None if probs is None else np.array([probs[t, e] for t, e in rows], probs.dtype)
    return permuted, np.array(sorted_indices, np.int32), permuted_probs


def permute_grad_reference(
    tokens_rows_grad, probs_rows_grad, sorted_indices, routing_map, n_tokens, n_experts, drop_and_pad
):
    """(tokens_grad, probs_grad or None): each row's gradient goes back to its token."""
    n_rows, hidden = tokens_rows_grad.shape
    sums = [np.zeros(hidden, np.float32) for _ in range(n_tokens)]
    probs_grad = None if probs_rows_grad is None else np.zeros((n_tokens, n_experts), probs_rows_grad.dtype)
    if drop_and_pad:
        capacity = n_rows // n_experts
        for d in range(n_rows):
            t = sorted_indices[d]
            if t < 0:
                continue
            sums[t] = sums[t] + f32(tokens_rows_grad[d])
            if probs_grad is not None:
                probs_grad[t, d // capacity] = probs_rows_grad[d]
    else:
        top_k = n_rows // n_tokens
        for p in range(n_rows):
            sums[p // top_k] = sums[p // top_k] + f32(tokens_rows_grad[sorted_indices[p]])
        if probs_grad is not None:
            routed = routing_map.astype(bool)
            d = 0
            for e in range(n_experts):
                for t in range(n_tokens):
                    if routed[t, e]:
                        probs_grad[t, e] = probs_rows_grad[d]
                        d += 1
    tokens_grad = np.array(sums, np.float32).reshape(n_tokens, hidden).astype(tokens_rows_grad.dtype)
    return tokens_grad, probs_grad


def row_probs_reference(probs, routing_map, sorted_indices, padded):
    """Prob of each permuted row: expert-major masked select, or probs[token of d, d // C]."""
    n_rows = len(sorted_indices)
    n_tokens, n_experts = routing_map.shape
    if padded:
        capacity = n_rows // n_experts
        return np.array([probs[t, d // capacity] if t >= 0 else 0 for d, t in enumerate(sorted_indices)], probs.dtype)
    routed = routing_map.astype(bool)
    pairs = [probs[t, e] for e in range(n_experts) for t in range(n_tokens) if routed[t, e]]
    return np.array(pairs + [0] * (n_rows - len(pairs)), probs.dtype)  # rows past the routed pairs: unused


def index_pairs_reference(sorted_indices, padded, top_k):
    if padded:
        order = sorted(range(len(sorted_indices)), key=lambda d: (sorted_indices[d], d))
        return np.array(order, np.int32), np.array([sorted_indices[d] for d in order], np.int32)
    # seed 000: an unused slot (-1) stays -1 in both, and is skipped
    out_index = [d if d >= 0 else -1 for d in sorted_indices]
    token_id = [p // top_k if d >= 0 else -1 for p, d in enumerate(sorted_indices)]
    return np.array(out_index, np.int32), np.array(token_id, np.int32)


def unpermute_reference(permuted, sorted_indices, routing_map, probs, padded, n_tokens):
    """(unpermuted, out_index, permute_token_id, permute_probs or None)."""
    n_rows, hidden = permuted.shape
    top_k = n_rows // n_tokens if n_tokens else 1
    out_index, token_id = index_pairs_reference(sorted_indices, padded, top_k)
    row_probs = None if probs is None else row_probs_reference(probs, routing_map, sorted_indices, padded)
    sums = [np.zeros(hidden, np.float32) for _ in range(n_tokens)]
    for d, t in zip(out_index, token_id):
        if t < 0:
            continue
        factor = np.float32(1) if row_probs is None else np.float32(row_probs[d])
        sums[t] = sums[t] + factor * f32(permuted[d])
    unpermuted = np.array(sums, np.float32).reshape(n_tokens, hidden).astype(permuted.dtype)
    return unpermuted, out_index, token_id, row_probs


def unpermute_grad_reference(grad, out_index, token_id, routing_map, permuted, probs, padded):
    """(permuted_tokens_grad, probs_grad or None); the dot runs in float64.

    SPEC 1.6 as amended: padded, row ``out_index[i]`` takes token ``token_id[i]`` (skipped when
    negative); not padded, it takes token ``i // K`` (``token_id`` is not read) and slot i is
    skipped when ``out_index[i] < 0``."""
    n_tokens, hidden = grad.shape
    n_rows = len(out_index)
    top_k = n_rows // n_tokens if n_tokens else 1
    g_perm = np.zeros((n_rows, hidden), np.float32)
    row_token = np.full(n_rows, -1)
    for i, (d, t) in enumerate(zip(out_index, token_id)):
        if not padded:
            t = i // top_k if d >= 0 else -1
        if t >= 0:
            g_perm[d] = f32(grad[t])
            row_token[d] = t
    if probs is None:
        return g_perm.astype(grad.dtype), None
    n_experts = routing_map.shape[1]
    row_probs = row_probs_reference(probs, routing_map, row_token, padded)
    probs_grad = np.zeros((n_tokens, n_experts), probs.dtype)
    dots = [float(np.dot(g_perm[d].astype(np.float64), f32(permuted[d]).astype(np.float64))) for d in range(n_rows)]
    if padded:
        capacity = n_rows // n_experts
        for d in range(n_rows):
            if row_token[d] >= 0:
                probs_grad[row_token[d], d // capacity] = dots[d]
    else:
        routed = routing_map.astype(bool)
        d = 0
        for e in range(n_experts):
            for t in range(n_tokens):
                if routed[t, e]:
                    probs_grad[t, e] = dots[d]
                    d += 1
    scaled = np.array([np.float32(row_probs[d]) * g_perm[d] for d in range(n_rows)], np.float32)
    return scaled.reshape(n_rows, hidden).astype(grad.dtype), probs_grad


def routing_with_unused_slots(rng, n_tokens: int, n_experts: int, top_k: int):
    """Not padded, tokens routed to 0..K experts (seed 000): ``(routing_map, sorted_indices)``
    with rows = the routed pairs in expert-major order and slot t*K + j -> row of t's j-th
    expert, -1 for its unused slots."""
    routing_map = np.zeros((n_tokens, n_experts), bool)
    for t in range(n_tokens):
        routing_map[t, rng.permutation(n_experts)[: rng.integers(0, top_k + 1)]] = True
    row_of = {}
    for e in range(n_experts):
        for t in range(n_tokens):
            if routing_map[t, e]:
                row_of[t, e] = len(row_of)
    sorted_indices = np.full(n_tokens * top_k, -1, np.int32)
    for t in range(n_tokens):
        for j, e in enumerate(np.flatnonzero(routing_map[t])):
            sorted_indices[t * top_k + j] = row_of[t, e]
    return routing_map, sorted_indices


@st.composite
def routing_cases(draw, padded=None):
    """(tokens, routing_map, probs or None, num_out_tokens, drop_and_pad)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    n_tokens, n_experts, hidden = draw(st.integers(1, 7)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    padded = draw(st.sampled_from([0, 1])) if padded is None else padded
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    map_dtype = draw(st.sampled_from([np.bool_, np.int8]))
    if padded:
        routing_map = make_routing(rng, n_tokens, n_experts, None, map_dtype)
        rows = n_experts * draw(st.integers(0, n_tokens))
    else:
        top_k = draw(st.integers(0, n_experts))
        routing_map = make_routing(rng, n_tokens, n_experts, top_k, map_dtype)
        rows = n_tokens * top_k
    tokens = rng.standard_normal((n_tokens, hidden)).astype(dtype)
    probs_kind = draw(st.sampled_from(["absent", "same", "float32"]))
    probs = None
    if probs_kind == "same" or (probs_kind == "float32" and dtype != ml_dtypes.bfloat16):
        probs = make_probs(rng, routing_map, dtype)
    elif probs_kind == "float32":
        probs = make_probs(rng, routing_map, np.float32)  # the mixed-precision case
    return tokens, routing_map, probs, rows, padded


def assert_same(got, want):
    """Same dtype, shape and values (bfloat16/float16 compared as float32; -0.0 == 0.0)."""
    if want is None:
        assert got is None
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    if got.dtype.kind == "f" or got.dtype == ml_dtypes.bfloat16:
        np.testing.assert_array_equal(f32(got), f32(want))
    else:
        np.testing.assert_array_equal(got, want)


# --- every dtype combination, for the session tests ---------------------------------------

COMBINATIONS = [
    (dtype, map_dtype, probs, padded)
    for dtype, map_dtype, probs, padded in itertools.product(
        FLOAT_DTYPES, [np.bool_, np.int8], ["absent", "same", "float32"], [0, 1]
    )
    if probs != "float32" or dtype == ml_dtypes.bfloat16
]


def combination(dtype, map_dtype, probs_kind, padded, seed=0):
    rng = np.random.default_rng(seed)
    n_tokens, n_experts, hidden, top_k = 6, 4, 5, 2
    routing_map = make_routing(rng, n_tokens, n_experts, None if padded else top_k, map_dtype)
    tokens = rng.standard_normal((n_tokens, hidden)).astype(dtype)
    probs = (
        None
        if probs_kind == "absent"
        else make_probs(rng, routing_map, np.float32 if probs_kind == "float32" else dtype)
    )
    rows = n_experts * 3 if padded else n_tokens * top_k
    return rng, tokens, routing_map, probs, rows


def ids(param):
    return np.dtype(param).name if isinstance(param, type) else str(param)


# --- linear maps -------------------------------------------------------------------------------


def jacobian(forward, x: np.ndarray) -> np.ndarray:
    """J[i, k] = d forward(x)[i] / d x[k] of a forward that is linear in x, by unit vectors."""
    columns = []
    for k in range(x.size):
        unit = np.zeros(x.size)
        unit[k] = 1
        columns.append(np.ravel(forward(unit.reshape(x.shape))))
    return np.stack(columns, axis=1)


# --- the dispatch family (SPEC 1.11, 1.12, 1.15, 1.16): loops over slots, from the formulas ----


def token_permute_reference(tokens, indices, num_out_tokens=0):
    """(permuted_tokens, sorted_indices) of SPEC 1.11: walk the experts in ascending order and,
    within one expert, the slots p = t*K + j in order; slot p gets the row it lands in."""
    top_k = 1 if indices.ndim == 1 else indices.shape[1]
    flat = [int(v) for v in indices.reshape(-1)]
    walk = [p for e in sorted(set(flat)) for p in range(len(flat)) if flat[p] == e]  # row d -> slot p
    n = num_out_tokens
    rows = len(flat) if n == 0 else min(n, len(flat)) if n > 0 else len(flat) + n
    sorted_indices = np.zeros(len(flat), np.int32)
    for d, p in enumerate(walk):
        sorted_indices[p] = d
    permuted = np.zeros((rows, tokens.shape[1]), tokens.dtype)
    for d in range(rows):
        permuted[d] = tokens[walk[d] // top_k]
    return permuted, sorted_indices


def token_permute_grad_reference(grad, sorted_indices, top_k):
    """SPEC 1.11 (d): token t sums the gradient rows of its K slots that are < M, in j order."""
    rows, hidden = grad.shape
    n_tokens = len(sorted_indices) // top_k
    out = np.zeros((n_tokens, hidden), np.float32)
    for t in range(n_tokens):
        for j in range(top_k):
            d = sorted_indices[t * top_k + j]
            if d < rows:
                out[t] = out[t] + f32(grad[d])
    return out.astype(grad.dtype)


def token_unpermute_reference(permuted, sorted_indices, probs=None):
    """SPEC 1.12: out[t] = sum_j probs[t, j] * permuted[sorted_indices[t*K + j]] in j order; a slot
    whose row is >= A, or whose prob is 0 (the NPU does not read it), adds nothing."""
    rows, hidden = permuted.shape
    top_k = 1 if probs is None else probs.shape[1]
    n_tokens = len(sorted_indices) // top_k
    out = np.zeros((n_tokens, hidden), np.float32)
    for t in range(n_tokens):
        for j in range(top_k):
            d = sorted_indices[t * top_k + j]
            weight = np.float32(1) if probs is None else np.float32(probs[t, j])
            if d < rows and weight != 0:
                out[t] = out[t] + f32(permuted[d]) * weight
    return out.astype(permuted.dtype)


def token_unpermute_grad_reference(grad, sorted_indices, rows, permuted=None, probs=None):
    """SPEC 1.12 (d): (permuted_tokens_grad [A, H], probs_grad [T, K] or None); row d sums the
    slots that read it (in slot order), the dots run in float64."""
    n_tokens, hidden = grad.shape
    top_k = 1 if probs is None else probs.shape[1]
    grad_rows = np.zeros((rows, hidden), np.float32)
    probs_grad = None if probs is None else np.zeros(probs.shape, np.float64)
    for p, d in enumerate(sorted_indices):
        t, j = divmod(p, top_k)
        if d >= rows:
            continue
        weight = np.float32(1) if probs is None else np.float32(probs[t, j])
        grad_rows[d] = grad_rows[d] + f32(grad[t]) * weight
        if probs_grad is not None:
            probs_grad[t, j] = np.dot(f32(grad[t]).astype(np.float64), f32(permuted[d]).astype(np.float64))
    return grad_rows.astype(grad.dtype), None if probs is None else probs_grad.astype(probs.dtype)


def init_routing_v1_reference(x, row_idx, expert_idx, active_num):
    """SPEC 1.15, as the doc's reference reads: experts ascending, ties by token-major position;
    row d carries q = row_idx at that position and copies token q % T."""
    n_tokens, top_k = expert_idx.shape
    flat, numbers = expert_idx.reshape(-1).tolist(), row_idx.reshape(-1).tolist()
    walk = [p for e in sorted(set(flat)) for p in range(len(flat)) if flat[p] == e]  # row d -> position p
    expanded_row_idx = np.zeros(len(flat), np.int32)
    for d, p in enumerate(walk):
        expanded_row_idx[numbers[p]] = d
    rows = min(active_num, n_tokens) * top_k
    expanded_x = np.zeros((rows, x.shape[1]), x.dtype)
    for d in range(rows):
        expanded_x[d] = x[numbers[walk[d]] % n_tokens]
    return expanded_x, expanded_row_idx, np.array([flat[p] for p in walk], np.int32)


def compute_expert_tokens_reference(sorted_experts, num_experts):
    """SPEC 1.16: per expert e the number of ids <= e (ids >= E are counted by none)."""
    return np.array([sum(1 for v in sorted_experts if v <= e) for e in range(num_experts)], np.int32)


def canonical_row_idx(n_tokens: int, top_k: int) -> np.ndarray:
    """``[T, K]`` int32 ``j*T + t``: MoeGatingTopKSoftmax's row_idx (column-major)."""
    return np.arange(n_tokens * top_k, dtype=np.int32).reshape(top_k, n_tokens).T.copy()


def init_routing_v3_reference(
    x,
    expert_idx,
    scale=None,
    *,
    expert_num,
    active_num=-1,
    expert_capacity=-1,
    drop_pad_mode=0,
    expert_tokens_num_type=0,
    expert_tokens_num_flag=0,
    active_expert_range=None,
    row_idx_type=0,
):
    """MoeInitRoutingV3 (SPEC-layer 1.17) with Python loops and ``sorted``: (expanded_x,
    expanded_row_idx, counts or None, expanded_scale). Rows no slot fills are zeros."""
    n_tokens, top_k = expert_idx.shape
    hidden = x.shape[1]
    slots = [(p // top_k, int(expert_idx.flat[p]), p) for p in range(n_tokens * top_k)]  # (token, expert, p)
    start, end = (0, expert_num) if not active_expert_range else active_expert_range
    in_range = [s for s in slots if start <= s[1] < end]
    if drop_pad_mode:
        rows = expert_num * expert_capacity
        row_token = [-1] * rows
        row_idx = [-1] * len(slots)
        for e in range(expert_num):
            mine = [s for s in slots if s[1] == e]  # token order = p order
            for r, (t, _, p) in enumerate(mine[:expert_capacity]):
                row_token[e * expert_capacity + r] = t
                row_idx[p] = e * expert_capacity + r
        expanded_shape = (expert_num, expert_capacity, hidden)
    else:

        def key(slot):
            t, e, p = slot
            return (0, e, p) if start <= e < end else (1, e, p) if e >= end else (2, 0, p)

        order = [p for _, _, p in sorted(slots, key=key)]
        rows = len(slots) if active_num <= 0 else min(active_num, len(slots))
        filled = min(rows, len(in_range))
        row_token = [order[d] // top_k if d < filled else -1 for d in range(rows)]
        if row_idx_type == 0:
            row_idx = [-1] * len(slots)
            for d, p in enumerate(order[: len(in_range)]):
                row_idx[p] = d
        else:
            row_idx = order
        expanded_shape = (rows, hidden)
    expanded_x = np.zeros((len(row_token), hidden), x.dtype)
    for d, t in enumerate(row_token):
        if t >= 0:
            expanded_x[d] = x[t]
    counts = None
    if expert_tokens_num_flag:
        per_expert = [sum(1 for s in in_range if s[1] == e) for e in range(start, end)]
        if expert_tokens_num_type == 1:
            counts = np.array(per_expert, np.int64)
        elif expert_tokens_num_type == 0:
            counts = np.array(list(itertools.accumulate(per_expert)), np.int64)
        else:
            pairs = [(start + j, c) for j, c in enumerate(per_expert) if c]
            counts = np.array(pairs + [(0, 0)] * (expert_num - len(pairs)), np.int64).reshape(expert_num, 2)
    expanded_scale = np.array([0.0 if t < 0 or scale is None else scale[t] for t in row_token], np.float32).reshape(
        len(row_token)
    )
    return expanded_x.reshape(expanded_shape), np.array(row_idx, np.int32), counts, expanded_scale


# --- gating (SPEC 1.13, 1.14) -------------------------------------------------------------------
# Written from the SPEC with Python loops over rows and sorted() for the rankings. The scores are
# the float32 nearest the exact value: float64 numpy, rounded once (as the kernels define them).


def gating_scores_reference(x, norm_type: int) -> np.ndarray:
    """``[R, E]`` float32: softmax (0), sigmoid (1) or sqrt(softplus) (2) of each row of ``x``."""
    wide = f32(x).astype(np.float64)
    with np.errstate(all="ignore"):
        if norm_type == 0:
            exps = np.exp(wide - wide.max(axis=-1, keepdims=True))
            return (exps / exps.sum(axis=-1, keepdims=True)).astype(np.float32)
        if norm_type == 1:
            return (1.0 / (1.0 + np.exp(-wide))).astype(np.float32)
        exact = np.sqrt(np.maximum(wide, 0.0) + np.log1p(np.exp(-np.abs(wide)))).astype(np.float32)
        # the NPU's Sqrt(Ln(Exp(x) + 1)) in float32: inf where the float32 exp overflows (SPEC-layer 1.14 (b))
        return np.where(np.isposinf(np.exp(f32(x))), np.float32(np.inf), exact)


def _rank_key(value) -> float:
    """A value as the rankings see it: NaN as -inf (-0.0 already equals 0.0 in Python)."""
    value = float(value)
    return -np.inf if value != value else value


def best_first(values, candidates, count: int) -> list[int]:
    """The ``count`` best of ``candidates`` by ``values``, descending; equal values: the lower index."""
    return sorted(candidates, key=lambda e: (-_rank_key(values[e]), e))[:count]


def gating_softmax_reference(x, finished, k):
    """(y, expert_idx, row_idx) of MoeGatingTopKSoftmax, shaped like x with last dim k."""
    lead, experts = x.shape[:-1], x.shape[-1]
    rows = int(np.prod(lead))
    probs = gating_scores_reference(x.reshape(rows, experts), 0)
    fast_template = experts < 8 or (experts <= 1024 and experts % 8 == 0 and k <= 8)
    if x.dtype == np.float16 and not fast_template:  # the NPU's float16 softmax and top-k (SPEC-layer 1.13 (b))
        probs = probs.astype(np.float16)
    expert_idx = np.array([best_first(probs[r], range(experts), k) for r in range(rows)], np.int32).reshape(rows, k)
    y = np.take_along_axis(probs, expert_idx.astype(np.int64), axis=1).astype(x.dtype)
    if finished is not None:
        for r in range(rows):
            if finished.reshape(rows)[r]:
                expert_idx[r] = experts
    row_idx = np.array([[j * rows + r for j in range(k)] for r in range(rows)], np.int32).reshape(rows, k)
    shape = lead + (k,)
    return y.reshape(shape), expert_idx.reshape(shape), row_idx.reshape(shape)


def gating_top_k_reference(
    x,
    bias=None,
    input_ids=None,
    tid2eid=None,
    *,
    k,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    renorm=0,
    norm_type=0,
    routed_scaling_factor=1.0,
    eps=1e-20,
    **_,
):
    """(y, expert_idx, out) of MoeGatingTopK."""
    tokens, experts = x.shape
    scores = gating_scores_reference(x, norm_type)
    values = scores if bias is None else scores + f32(bias)
    per = experts // group_count
    chosen = []
    for t in range(tokens):
        if input_ids is not None:
            chosen.append([int(e) for e in tid2eid[input_ids[t]]])
            continue
        kept = list(range(group_count))
        if group_count > 1:
            group_scores = []
            for g in range(group_count):
                ranked = best_first(values[t], range(g * per, (g + 1) * per), 2)
                top = [np.float32(_rank_key(values[t, e])) for e in ranked]
                score = top[0] if group_select_mode == 0 else np.float32(top[0] + top[1])
                group_scores.append(score)
            kept = best_first(group_scores, range(group_count), k_group)
        candidates = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen.append(best_first(values[t], candidates, k))
    expert_idx = np.array(chosen, np.int32).reshape(tokens, k)
    normalise = norm_type in (1, 2) or renorm == 1
    y = np.zeros((tokens, k), np.float32)
    for t in range(tokens):
        w = [float(scores[t, e]) for e in expert_idx[t]]
        total = math.fsum(w) + eps
        y[t] = [(v / total if normalise else v) * routed_scaling_factor for v in w]
    return y.astype(x.dtype), expert_idx, scores


def gating_backward_reference(x_norm, grad_y, expert_idx, routed_scaling_factor=1.0, eps=1e-20):
    """``[T, E]`` float64: the vector-Jacobian product of y = rsf * w / (sum(w) + eps), w = the
    chosen sigmoid scores, with respect to the logits (chain rule written term by term)."""
    tokens, experts = x_norm.shape
    grad = np.zeros((tokens, experts))
    for t in range(tokens):
        s = x_norm[t].astype(np.float64)
        w = [s[e] for e in expert_idx[t]]
        total = math.fsum(w) + eps
        for j in range(len(w)):
            # dy_j/dw_i = rsf * (delta_ij / total - w_j / total^2); dw_i/dx_e = s_e (1 - s_e) [e == idx_i]
            for i, e_i in enumerate(expert_idx[t]):
                d = routed_scaling_factor * ((i == j) / total - w[j] / total**2)
                grad[t, e_i] += float(grad_y[t, j]) * d * s[e_i] * (1 - s[e_i])
    return grad
