"""Shared pieces of the routing-map family: MoeTokenPermuteWithRoutingMap, MoeTokenUnpermute-
WithRoutingMap and their grads (SPEC 1.4-1.6).

Notation: T tokens, H hidden, E experts, K top-k, C capacity per expert, N permuted rows
(``T*K`` not padded, ``E*C`` padded). ``routing_map [T, E]`` marks the experts of each token.
Index conventions, all int32 on the ONNX side:

* ``row_token[d]``: token whose data sits in permuted row d. Not padded the rows are
  expert-major: ``row_token = nonzero(routing_map.T)[1]`` (expert 0's tokens in token order,
  then expert 1's, ...). Padded, expert e owns rows ``e*C .. e*C+C-1``.
* ``sorted_indices``: not padded, slot -> row: ``sorted_indices[t*K + j] = d``, the row of
  token t's j-th routed expert (ascending). Padded, row -> token: ``sorted_indices[d] = t``.
* ``(out_index, permute_token_id)``: pairs sorted by token: permuted row ``out_index[i]``
  belongs to token ``permute_token_id[i]``. A negative token marks an empty slot (skipped).

Kernels compute in float32 (float64 when handed float64, which only the bare functions
accept) and cast back with round-to-nearest-even, in the single-pass loops of :mod:`.fused`.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .errors import BAD_DTYPE, MoeOpError
from .opdef import Dim, Signature

TOKEN_DTYPES = ("float32", "float16", "bfloat16")
MAP_DTYPES = ("int8", "bool")
INDEX_DTYPES = ("int32",)
PADDING = (0, 1)


# --- static rules (inside infer) ------------------------------------------------------


def require_probs_dtype(sig: Signature, probs: str, tokens: str) -> None:
    """``probs`` has the dtype of ``tokens``, or is float32 when ``tokens`` is bfloat16."""
    p, t = sig.input(probs).dtype, sig.input(tokens).dtype
    if p is None or t is None:
        return
    sig.require(
        p == t or (t == "bfloat16" and p == "float32"),
        f"{probs} must have the dtype of {tokens} ({t}), or be float32 when {tokens} is bfloat16; got {p}",
        BAD_DTYPE,
    )


def require_same_dtype(sig: Signature, name: str, like: str) -> None:
    a, b = sig.input(name).dtype, sig.input(like).dtype
    if a is not None and b is not None:
        sig.require(a == b, f"{name} must have the dtype of {like} ({b}), got {a}", BAD_DTYPE)


def require_shape(sig: Signature, name: str, dims: tuple, what: str) -> None:
    """Input ``name`` (when given) has shape ``dims`` where both sides are known."""
    if not sig.has(name):
        return
    for axis, want in enumerate(dims):
        sig.same(sig.dim(name, axis), want, f"{name} must be {what}: dim {axis}")


def experts_capacity(sig: Signature, rows: Dim, n_experts: Dim, rows_name: str, experts_name: str = "E") -> int | None:
    """Padded: C = N / E must be whole."""
    return sig.quotient(rows, n_experts, f"padded: N = {rows_name} must be a multiple of {experts_name} (C = N / E)")


def slots_per_token(
    sig: Signature,
    rows: Dim,
    n_tokens: Dim,
    n_experts: Dim,
    rows_name: str,
    tokens_name: str = "T",
    limit_by_experts: bool = True,
) -> int | None:
    """Not padded: K = N / T must be whole and, where the op needs it, at most E."""
    top_k = sig.quotient(rows, n_tokens, f"not padded: N = {rows_name} must be a multiple of {tokens_name} (K = N / T)")
    if not limit_by_experts:
        return top_k
    if isinstance(top_k, int) and isinstance(n_experts, int):
        sig.require(top_k <= n_experts, f"not padded: K = N / T = {top_k} must not exceed E = {n_experts}")
    else:
        sig.defer("quotient_at_most", (rows, n_tokens, n_experts), "not padded: K = N / T must not exceed E")
    return top_k


def optional_output(sig: Signature, output: str, source: str) -> bool:
    """``output`` exists iff ``source`` is given; asking for it without ``source`` is an error."""
    has = sig.has(source)
    wanted = sig.wants(output, has)
    sig.require(has or not wanted, f"output {output} needs input {source}, which is absent")
    return has and wanted


def require_input(sig: Signature, name: str, why: str) -> None:
    """An optional input another input depends on (CANN: 561002, not 161001)."""
    sig.require(sig.has(name), f"input {name} is required {why}")


# --- value rules (inside kernels) -----------------------------------------------------


def routing_mask(routing_map: np.ndarray) -> np.ndarray:
    """``routing_map`` as bool; int8 must hold only 0 and 1."""
    if routing_map.dtype == np.bool_:
        return routing_map
    bad = np.argwhere(routing_map.view(np.uint8) > 1)
    if len(bad):
        t, e = bad[0]
        raise MoeOpError(f"int8 routing_map must hold only 0 and 1, got {routing_map[t, e]} at [{t}, {e}]")
    return routing_map.view(np.bool_)


def require_topk_rows(mask: np.ndarray, k: int) -> None:
    """Not padded, every token is routed to exactly K experts."""
    counts = np.count_nonzero(mask, axis=1)
    bad = np.flatnonzero(counts != k)
    if len(bad):
        raise MoeOpError(
            f"not padded, every routing_map row must hold exactly K = {k} ones; row {bad[0]} holds {counts[bad[0]]}"
        )


def routed_row_probs(probs: np.ndarray, mask: np.ndarray, top_k: int, used_rows: np.ndarray, n_rows: int) -> np.ndarray:
    """Not padded: ``[N]`` the prob of each permuted row.

    Row d is the d-th routed (token, expert) pair in expert-major order (SPEC 1.5), so rows
    ``0 .. nnz-1`` take ``probs.T[mask.T]`` and the rest 0. A token may be routed to fewer
    than K experts, its unused slots then being -1 (seed 000); a row a slot uses
    (``used_rows``) must be a routed one, or it would have no prob.
    """
    counts = np.count_nonzero(mask, axis=1)
    bad = np.flatnonzero(counts > top_k)
    if len(bad):
        raise MoeOpError(
            f"not padded, a routing_map row may hold at most K = {top_k} ones; row {bad[0]} holds {counts[bad[0]]}"
        )
    routed = int(counts.sum())
    beyond = np.flatnonzero(used_rows >= routed)
    if len(beyond):
        raise MoeOpError(
            f"not padded, a used slot names row {used_rows[beyond[0]]}, but routing_map routes only {routed} "
            f"(token, expert) pairs (rows 0..{routed - 1}): that row has no prob"
        )
    row_probs = np.zeros(n_rows, probs.dtype)
    row_probs[:routed] = probs.T[mask.T]
    return row_probs


def require_range(name: str, values: np.ndarray, high: int, *, negative_is_empty: bool = False) -> None:
    """``values`` lie in ``[0, high)``; with ``negative_is_empty`` any negative is allowed."""
    bad = values >= high if negative_is_empty else (values < 0) | (values >= high)
    where = np.flatnonzero(bad)
    if len(where):
        allowed = f"in [0, {high})"
        if negative_is_empty:
            allowed = "a negative (empty slot) or " + allowed
        raise MoeOpError(f"{name} values must be {allowed}, got {values[where[0]]} at position {where[0]}")


def require_unique(name: str, rows: np.ndarray, n_rows: int) -> None:
    """No permuted row may be claimed twice."""
    counts = np.bincount(rows, minlength=n_rows)
    twice = np.flatnonzero(counts > 1)
    if len(twice):
        raise MoeOpError(f"{name} must not repeat a row: row {twice[0]} appears {counts[twice[0]]} times")


# --- indices --------------------------------------------------------------------------


def padded_row_tokens(mask: np.ndarray, capacity: int) -> np.ndarray:
    """``[E*C]``: expert e's first C routed tokens, then its unrouted ones (token order)."""
    routed_first = ~mask.T  # stable argsort puts False (routed) before True
    return np.argsort(routed_first, axis=1, kind="stable")[:, :capacity].reshape(-1)


def index_pairs(sorted_indices: np.ndarray, padded: bool, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(out_index, permute_token_id)`` of SPEC 1.5, both ``[N]`` int32, sorted by token.

    Not padded: ``out_index = sorted_indices`` and ``permute_token_id[p] = p // K``; an
    unused slot (a negative index, seed 000) gets -1 in both, which the grad skips.
    Padded: ``permute_token_id, out_index = sort(sorted_indices)`` (values, positions; stable).
    """
    if padded:
        order = np.argsort(sorted_indices, kind="stable")
        return order.astype(np.int32), sorted_indices[order].astype(np.int32)
    used = sorted_indices >= 0
    slots = np.arange(len(sorted_indices), dtype=np.int32)
    return np.where(used, sorted_indices, -1).astype(np.int32), np.where(used, slots // max(k, 1), -1).astype(np.int32)


def padded_row_probs(probs: np.ndarray, row_token: np.ndarray, capacity: int) -> np.ndarray:
    """``[E*C]``: ``probs[row_token[d], d // C]``, 0 where ``row_token[d] < 0`` (empty slot)."""
    expert = np.arange(len(row_token)) // max(capacity, 1)
    picked = probs[np.maximum(row_token, 0), expert]
    picked[row_token < 0] = 0
    return picked


def scatter_token_expert(
    values: np.ndarray, token: np.ndarray, expert: np.ndarray, n_tokens: int, n_experts: int, dtype
) -> np.ndarray:
    """``[T, E]`` zeros with ``out[token[i], expert[i]] += values[i]`` (negative token: skip)."""
    valid = token >= 0
    flat = token[valid].astype(np.int64) * n_experts + expert[valid]
    summed = np.bincount(flat, weights=values[valid].astype(np.float64), minlength=n_tokens * n_experts)
    return summed.reshape(n_tokens, n_experts).astype(dtype)


# --- row movement and arithmetic ------------------------------------------------------


def scaled_gather(
    rows: np.ndarray, index: np.ndarray, scale: np.ndarray, dot_with: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``out[d] = scale[d] * rows[index[d]]`` and ``dots[d] = sum_h rows[index[d], h] * dot_with[d, h]``.

    A zero row (and dot) where ``index[d] < 0``. ``out`` has the dtype of ``rows``; ``dots``
    is float32 (float64 for float64 rows), summed pairwise in a fixed order (:mod:`.fused`).
    """
    return fused.scaled_rows_and_dots(rows, index, scale, dot_with)


def sum_rows_by_token(
    rows: np.ndarray, out_index: np.ndarray, token_id: np.ndarray, n_tokens: int, weights: np.ndarray | None = None
) -> np.ndarray:
    """``out[t] = sum over i with token_id[i] == t of w[out_index[i]] * rows[out_index[i]]``.

    Args:
        rows: ``[N, H]`` permuted rows.
        out_index, token_id: ``[N]`` pairs, the used ones (``token_id >= 0``) sorted by
            token (SPEC 1.5); ``token_id < 0`` = an unused slot, skipped.
        weights: optional ``[N]`` factor of each permuted row (1 when absent).
    Returns:
        ``[T, H]`` in the rows' dtype; tokens without rows are zeros. Sums run in float32
        (float64 for float64 rows) in ``i`` order: deterministic.
    """
    used = token_id >= 0
    if not used.all():
        out_index, token_id = out_index[used], token_id[used]
    # token t's terms are i = segment_start[t] .. segment_start[t + 1] - 1
    segment_start = np.searchsorted(token_id, np.arange(n_tokens + 1))
    term_weights = None if weights is None else weights[out_index]
    return fused.segment_sums(rows, out_index, segment_start, term_weights)
