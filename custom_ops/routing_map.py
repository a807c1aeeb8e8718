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
accept) and cast back with round-to-nearest-even. Big arrays are processed in chunks of rows
so temporaries stay a few MiB.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from . import buffers
from .errors import BAD_DTYPE, MoeOpError
from .opdef import Dim, Signature

TOKEN_DTYPES = ("float32", "float16", "bfloat16")
MAP_DTYPES = ("int8", "bool")
INDEX_DTYPES = ("int32",)
PADDING = (0, 1)

#: size of a float32 temporary per chunk: a few chunks fit the L3 cache
_CHUNK_BYTES = 1 << 20
#: rows narrower than this keep numpy's default ufunc buffer (see row_sized_buffers)
_MIN_ROW_BUFFER = 1024


# --- static rules (inside infer) ------------------------------------------------------

def known(*dims: Dim) -> bool:
    return all(isinstance(d, int) for d in dims)


def require_probs_dtype(sig: Signature, probs: str, tokens: str) -> None:
    """``probs`` has the dtype of ``tokens``, or is float32 when ``tokens`` is bfloat16."""
    p, t = sig.input(probs).dtype, sig.input(tokens).dtype
    if p is None or t is None:
        return
    sig.require(p == t or (t == "bfloat16" and p == "float32"),
                f"{probs} must have the dtype of {tokens} ({t}), or be float32 when {tokens} "
                f"is bfloat16; got {p}", BAD_DTYPE)


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


def quotient(sig: Signature, rows: Dim, by: Dim, rule: str) -> Dim:
    """``rows / by``, required to be whole (``rows == 0`` when ``by == 0``); None if unknown."""
    if not known(rows, by):
        return None
    if by == 0:
        sig.require(rows == 0, f"{rule}: got {rows} rows for 0")
        return 0
    sig.require(rows % by == 0, f"{rule}: got {rows} rows for {by}")
    return rows // by


def experts_capacity(sig: Signature, rows: Dim, n_experts: Dim, rows_name: str, experts_name: str = "E") -> Dim:
    """Padded: C = N / E must be whole."""
    return quotient(sig, rows, n_experts, f"padded: N = {rows_name} must be a multiple of {experts_name} (C = N / E)")


def slots_per_token(sig: Signature, rows: Dim, n_tokens: Dim, n_experts: Dim, rows_name: str,
                    tokens_name: str = "T", limit_by_experts: bool = True) -> Dim:
    """Not padded: K = N / T must be whole and, where the op needs it, at most E."""
    top_k = quotient(sig, rows, n_tokens, f"not padded: N = {rows_name} must be a multiple of {tokens_name} (K = N / T)")
    if limit_by_experts and known(top_k, n_experts):
        sig.require(top_k <= n_experts, f"not padded: K = N / T = {top_k} must not exceed E = {n_experts}")
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

def routing_mask(op: str, routing_map: np.ndarray) -> np.ndarray:
    """``routing_map`` as bool; int8 must hold only 0 and 1."""
    if routing_map.dtype == np.bool_:
        return routing_map
    bad = np.argwhere(routing_map.view(np.uint8) > 1)
    if len(bad):
        t, e = bad[0]
        raise MoeOpError(op, f"int8 routing_map must hold only 0 and 1, got {routing_map[t, e]} "
                             f"at [{t}, {e}]")
    return routing_map.view(np.bool_)


def require_topk_rows(op: str, mask: np.ndarray, k: int) -> None:
    """Not padded, every token is routed to exactly K experts."""
    counts = np.count_nonzero(mask, axis=1)
    bad = np.flatnonzero(counts != k)
    if len(bad):
        raise MoeOpError(op, f"not padded, every routing_map row must hold exactly K = {k} ones; "
                             f"row {bad[0]} holds {counts[bad[0]]}")


def require_range(op: str, name: str, values: np.ndarray, high: int, *,
                  negative_is_empty: bool = False) -> None:
    """``values`` lie in ``[0, high)``; with ``negative_is_empty`` any negative is allowed."""
    bad = values >= high if negative_is_empty else (values < 0) | (values >= high)
    where = np.flatnonzero(bad)
    if len(where):
        allowed = f"in [0, {high})"
        if negative_is_empty:
            allowed = "a negative (empty slot) or " + allowed
        raise MoeOpError(op, f"{name} values must be {allowed}, got {values[where[0]]} "
                             f"at position {where[0]}")


def require_unique(op: str, name: str, rows: np.ndarray, n_rows: int) -> None:
    """No permuted row may be claimed twice."""
    counts = np.bincount(rows, minlength=n_rows)
    twice = np.flatnonzero(counts > 1)
    if len(twice):
        raise MoeOpError(op, f"{name} must not repeat a row: row {twice[0]} appears "
                             f"{counts[twice[0]]} times")


# --- indices --------------------------------------------------------------------------

def padded_row_tokens(mask: np.ndarray, capacity: int) -> np.ndarray:
    """``[E*C]``: expert e's first C routed tokens, then its unrouted ones (token order)."""
    routed_first = ~mask.T  # stable argsort puts False (routed) before True
    return np.argsort(routed_first, axis=1, kind="stable")[:, :capacity].reshape(-1)


def index_pairs(sorted_indices: np.ndarray, padded: bool, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``(out_index, permute_token_id)`` of SPEC 1.5, both ``[N]`` int32, sorted by token.

    Not padded: ``out_index = sorted_indices`` and ``permute_token_id[p] = p // K``.
    Padded: ``permute_token_id, out_index = sort(sorted_indices)`` (values, positions; stable).
    """
    if padded:
        order = np.argsort(sorted_indices, kind="stable")
        return order.astype(np.int32), sorted_indices[order].astype(np.int32)
    slots = np.arange(len(sorted_indices), dtype=np.int32)
    return sorted_indices.astype(np.int32), slots // max(k, 1)


def padded_row_probs(probs: np.ndarray, row_token: np.ndarray, capacity: int) -> np.ndarray:
    """``[E*C]``: ``probs[row_token[d], d // C]``, 0 where ``row_token[d] < 0`` (empty slot)."""
    expert = np.arange(len(row_token)) // max(capacity, 1)
    picked = probs[np.maximum(row_token, 0), expert]
    picked[row_token < 0] = 0
    return picked


def scatter_token_expert(values: np.ndarray, token: np.ndarray, expert: np.ndarray,
                         n_tokens: int, n_experts: int, dtype) -> np.ndarray:
    """``[T, E]`` zeros with ``out[token[i], expert[i]] += values[i]`` (negative token: skip)."""
    valid = token >= 0
    flat = token[valid].astype(np.int64) * n_experts + expert[valid]
    summed = np.bincount(flat, weights=values[valid].astype(np.float64), minlength=n_tokens * n_experts)
    return summed.reshape(n_tokens, n_experts).astype(dtype)


# --- row movement and arithmetic ------------------------------------------------------

def compute_dtype(*arrays: np.ndarray | None) -> np.dtype:
    """float32, or float64 when any input is float64 (bare-kernel gradient checks)."""
    wide = any(a is not None and a.dtype == np.float64 for a in arrays)
    return np.dtype(np.float64 if wide else np.float32)


def _rows_per_chunk(hidden: int) -> int:
    return max(1, _CHUNK_BYTES // max(4 * hidden, 1))


def _chunks(n: int, hidden: int):
    step = _rows_per_chunk(hidden)
    for start in range(0, n, step):
        yield start, min(start + step, n)


@contextmanager
def row_sized_buffers(hidden: int):
    """Within the block, ufuncs use a buffer of one row (``hidden`` elements) when numpy's
    default (8192) holds two or more rows.

    A ufunc on ``[rows, hidden]`` operands that broadcast (``block * w[:, None]``) or cast
    (bfloat16 -> float32) cannot run as one flat loop; with a buffer of two or more rows
    numpy 2 copies the operands through it, which doubles the cost of the multiply at
    hidden = 4096. A one-row buffer lets it run on the rows in place. Element-wise results
    do not depend on the buffer size; reductions are kept outside the block all the same.
    """
    size = np.getbufsize()
    if not _MIN_ROW_BUFFER <= hidden <= size // 2:  # e.g. 7168: no copies, a smaller buffer is slower
        yield
        return
    np.setbufsize(hidden - hidden % 16)  # numpy 1.x wants a multiple of 16
    try:
        yield
    finally:
        np.setbufsize(size)


def scale_rows(block: np.ndarray, factors: np.ndarray, factors_have_nan: bool) -> None:
    """``block[i] *= factors[i]`` in place: ``block [n, H]``, ``factors [n]``, same float dtype.

    With NaN-free factors a product's NaN can only come from the block element (or be
    inf * 0), so it has the same bits whichever loop numpy picks and the row-sized buffer
    is safe. Two NaN operands give the payload of one of them, and which one depends on
    numpy's loop: those keep the default buffer, and the bits they always had.
    """
    if factors_have_nan:
        block *= factors[:, None]
        return
    with row_sized_buffers(block.shape[1]):
        block *= factors[:, None]


def gather_rows(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``out[d] = rows[index[d]]`` (bit-exact), a zero row where ``index[d] < 0``."""
    out = buffers.empty((len(index),) + rows.shape[1:], rows.dtype)
    # mode="clip": indices are checked already, and mode="raise" with out= would buffer
    np.take(_nonempty(rows), index, axis=0, out=out, mode="clip")
    empty = index < 0
    if empty.any():
        out[empty] = 0
    return out


def _nonempty(rows: np.ndarray) -> np.ndarray:
    """``rows``, or one zero row when there are none (every index is then an empty slot)."""
    return rows if len(rows) else np.zeros((1,) + rows.shape[1:], rows.dtype)


def scaled_gather(rows: np.ndarray, index: np.ndarray, scale: np.ndarray, dot_with: np.ndarray,
                  dtype) -> tuple[np.ndarray, np.ndarray]:
    """``out[d] = scale[d] * rows[index[d]]`` and ``dots[d] = sum_h rows[index[d], h] * dot_with[d, h]``.

    A zero row (and dot) where ``index[d] < 0``. ``out`` has ``dtype``; ``dots`` is the
    compute dtype (float32, or float64 for float64 inputs).
    """
    n, hidden = len(index), rows.shape[1]
    cdt = compute_dtype(rows, scale, dot_with)
    out = buffers.empty((n, hidden), dtype)
    dots = np.zeros(n, cdt)
    scale = scale.astype(cdt)
    scale_has_nan = bool(np.isnan(scale).any())
    source = _nonempty(rows)
    for a, b in _chunks(n, hidden):
        idx = index[a:b]
        block = np.take(source, idx, axis=0, mode="clip").astype(cdt, copy=False)
        block[idx < 0] = 0
        dots[a:b] = np.vecdot(block, dot_with[a:b].astype(cdt, copy=False))
        scale_rows(block, scale[a:b], scale_has_nan)
        out[a:b] = block  # the cast back rounds to nearest even
    return out, dots


def sum_rows_by_token(rows: np.ndarray, out_index: np.ndarray, token_id: np.ndarray, n_tokens: int,
                      weights: np.ndarray | None = None, dtype=None) -> np.ndarray:
    """``out[t] = sum over i with token_id[i] == t of w[out_index[i]] * rows[out_index[i]]``.

    Args:
        rows: ``[N, H]`` permuted rows.
        out_index, token_id: ``[N]`` pairs sorted by token (SPEC 1.5); ``token_id < 0`` = skip.
        weights: optional ``[N]`` factor of each permuted row (1 when absent).
    Returns:
        ``[T, H]`` of ``dtype`` (default: the rows' dtype); tokens without rows are zeros.
        Sums run in float32 (float64 for float64 inputs) in ``i`` order: deterministic.
    """
    dtype = rows.dtype if dtype is None else dtype
    hidden = rows.shape[1]
    cdt = compute_dtype(rows, weights)
    first = int(np.searchsorted(token_id, 0))  # sorted: empty slots come first
    token_id, out_index = token_id[first:], out_index[first:]
    n = len(token_id)
    starts = np.flatnonzero(np.r_[True, token_id[1:] != token_id[:-1]]) if n else np.zeros(0, np.intp)
    lengths = np.diff(np.r_[starts, n])
    tokens = token_id[starts]
    out = (buffers.empty if len(tokens) == n_tokens else buffers.zeros)((n_tokens, hidden), dtype)
    w = None if weights is None else weights.astype(cdt)
    w_has_nan = w is not None and bool(np.isnan(w).any())
    step = _rows_per_chunk(hidden)
    seg = 0
    while seg < len(starts):
        # the next tokens whose rows, padded to the longest, fill about one chunk
        widest = np.maximum.accumulate(lengths[seg:seg + step])
        count = max(1, int(np.count_nonzero(widest * np.arange(1, len(widest) + 1) <= step)))
        end, width = seg + count, int(widest[count - 1])
        slots = _token_slots(out_index[starts[seg]:starts[seg] + lengths[seg:end].sum()],
                             lengths[seg:end], width)
        block = np.take(rows, slots, axis=0, mode="clip").astype(cdt, copy=False)
        if w is not None:
            scale_rows(block, w[slots], w_has_nan)
        empty = slots < 0
        if empty.any():
            block[empty] = 0  # x + 0 == x: padding does not change the sums
        summed = block.reshape(count, width, hidden).sum(axis=1)
        first_token, last_token = tokens[seg], tokens[end - 1]
        if last_token - first_token == count - 1:  # consecutive tokens: a slice
            out[first_token:last_token + 1] = summed
        else:
            out[tokens[seg:end]] = summed
        seg = end
    return out


def _token_slots(rows: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """``[len(lengths) * width]``: each token's rows in order, padded with -1 to ``width``."""
    if (lengths == width).all():  # every token has K rows: the common case
        return rows
    slots = np.full((len(lengths), width), -1, rows.dtype)
    rank = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    slots[np.repeat(np.arange(len(lengths)), lengths), rank] = rows
    return slots.reshape(-1)
