"""Export-time rewrites of transformers code: the same values, computed with tensor ops only.

Each function here replaces one transformers function or method while
:func:`moe_onnx.transformers.export_causal_lm` exports (``whole.EXPORT_PATCHES`` says which
and restores the originals after). Where transformers loops in Python over queries or groups
of them, the rewrite computes every query at once over the whole ``[queries, keys]`` grid, as
the attention it masks already does; nothing loops or branches on data or on the sequence length.
"""

from __future__ import annotations

from typing import Any

import torch

# ---- DeepSeek-V2: complex rotary as real (cos, sin) pairs -----------------------------------


def real_rotary(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """DeepseekV2RotaryEmbedding.forward with ``polar(1, f) * scaling`` as ``[..., D/2, 2]`` (cos, sin)."""
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack((torch.cos(freqs), torch.sin(freqs)), dim=-1) * self.attention_scaling


def real_apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """deepseek_v2's apply_rotary_emb: (a + ib)(c + id) = (ac - bd) + i(ad + bc), on real pairs."""
    cos, sin = freqs.unsqueeze(1).unbind(-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


# ---- shared: top-k masks of fixed k over rows of any length ---------------------------------


def top_k_mask_lowest_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the ``k`` highest finite scores of each row, ties to the lowest indices.

    Kolibri1_1Indexer.top_k_mask's rule, for rows that may be shorter than ``k``: the row is
    padded with ``k`` entries of ``-inf`` (never kept) so that ``topk`` takes a constant ``k``
    whatever the length; a row with fewer than ``k`` finite scores keeps all of them, as
    ``min(k, row length)`` does there.
    """
    padded = torch.nn.functional.pad(scores, (0, k), value=float("-inf"))
    kth_score = padded.topk(k, dim=-1).values[..., -1:]
    above = scores > kth_score
    tied = (scores == kth_score) & (kth_score > float("-inf"))
    free_slots = k - above.sum(-1, keepdim=True)
    tie_rank = tied.cumsum(-1, dtype=torch.int32)  # 1-based position of each tie within its row
    return above | (tied & (tie_rank <= free_slots))


# ---- Kolibri 1.1: the indexer's query groups as one masked grid -----------------------------


def _kolibri_rows(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's first visible key and the number of keys from it to its last visible one
    (Kolibri1_1Indexer.query_groups' ``starts`` and ``lengths``), ``[B, Q]``."""
    starts = visible.int().argmax(-1)
    ends = visible.shape[-1] - visible.flip(-1).int().argmax(-1)
    return starts, (ends - starts) * visible.any(-1)


def _kolibri_scores(indexer: Any, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Kolibri1_1Indexer.score of every batch row at once: ``[B, H, Q, D]`` x ``[B, K, D]`` -> ``[B, Q, K]``,
    the heads' ReLU logits summed in head order (as its loop does), times the head weight."""
    scores = queries.new_zeros(queries.shape[0], queries.shape[2], keys.shape[1])
    for head in range(queries.shape[1]):  # a fixed number of heads, not data
        scores = scores + (queries[:, head] @ keys.transpose(-1, -2)).relu()
    return scores * indexer.head_weight


def kolibri_select_pool(self, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Kolibri1_1Indexer.select_pool for every query at once.

    transformers groups queries by their first visible key ``s`` and averages the blocks of
    ``compression`` keys starting at ``s, s + c, ...``. A block's summary depends only on its
    first key ``a``, so the summaries of blocks starting at every key are computed once, scored
    against every query, and each query reads its own blocks ``a = s + m c`` back (a gather).
    """
    from transformers.models.kolibri1_1.modeling_kolibri1_1 import nvfp4_fake_quantize

    compression, key_count = self.compression, visible.shape[-1]
    starts, lengths = _kolibri_rows(visible)
    unseen = ~visible.any(1)  # keys no query sees count as zeros in their block's average
    document_keys = keys[:, 0].masked_fill(unseen[..., None], 0.0).float()
    padded = torch.nn.functional.pad(document_keys, (0, 0, 0, compression - 1))
    # [B, K, c, D] summed over c: the same reduction as transformers' blocks.sum(1)
    blocks = torch.stack([padded[:, r : r + key_count] for r in range(compression)], dim=2)
    summaries = nvfp4_fake_quantize(blocks.sum(2) / compression)
    routing_queries = nvfp4_fake_quantize(queries[:, : self.num_heads]).float()
    scores_by_start = _kolibri_scores(self, routing_queries, summaries)  # [B, Q, first key of the block]

    block = torch.arange(key_count, device=visible.device)  # m; at most K blocks per query
    first_keys = (starts[..., None] + block * compression).clamp(max=key_count - 1)
    scores = scores_by_start.gather(-1, first_keys)
    # a query's incomplete newest block competes with a zero score, later blocks are not visible
    scores = torch.where(block < lengths[..., None] // compression, scores, 0.0)
    scores = scores.masked_fill(block >= (lengths[..., None] + compression - 1) // compression, float("-inf"))
    chosen_blocks = top_k_mask_lowest_ties(scores, self.pool_size // compression)
    offset = block - starts[..., None]  # key j's position from the query's first visible key
    chosen = chosen_blocks.gather(-1, (offset.clamp(min=0) // compression)) & (offset >= 0)
    long_rows = (lengths > self.pool_size)[..., None]
    return visible & (chosen | ~long_rows)  # where(long_rows, chosen & visible, visible): no boolean Where in ORT


def kolibri_select_tokens(
    self, queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, pool: torch.Tensor
) -> torch.Tensor:
    """Kolibri1_1Indexer.select_tokens for every query at once: sinks and local tokens counted
    from each query's first visible key, the top ``index_topk`` of the rest of its pool."""
    from transformers.models.kolibri1_1.modeling_kolibri1_1 import nvfp4_fake_quantize

    budget = self.topk + self.num_local_tokens + self.num_sink_tokens
    starts, lengths = _kolibri_rows(visible)
    lengths = lengths[..., None]
    routing_keys = nvfp4_fake_quantize(keys[:, 0]).float()
    routing_queries = nvfp4_fake_quantize(queries[:, : self.num_heads]).float()
    scores = _kolibri_scores(self, routing_queries, routing_keys)
    positions = torch.arange(visible.shape[-1], device=visible.device) - starts[..., None]
    sinks = (positions >= 0) & (positions < self.num_sink_tokens)
    local = (positions >= lengths - self.num_local_tokens) & (positions < lengths)
    candidates = pool & ~sinks & (positions >= 0) & (positions < lengths - self.num_local_tokens)
    chosen = top_k_mask_lowest_ties(scores.masked_fill(~candidates, float("-inf")), self.topk)
    # where(long rows, (chosen | sinks | local) & visible, visible): onnxruntime has no boolean Where
    return visible & (chosen | sinks | local | (lengths <= budget))


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x.to(torch.float8_e4m3fn).float()`` for float32 ``x`` in [2^-9, 448], without the 8-bit type
    (which the exporter's conversion does not take): the nearest E4M3 value, ties to even.

    E4M3 holds 3 fraction bits: ``x`` of binary exponent ``e`` is a multiple of ``2^(e - 3)``,
    below the smallest normal (2^-6) of ``2^-9``. ``log2`` gives ``e`` to within one; the two
    comparisons with exact powers of two settle it.
    """
    exponent = torch.floor(torch.log2(x))
    exponent = exponent - (torch.exp2(exponent) > x).float() + (torch.exp2(exponent + 1) <= x).float()
    step = torch.exp2(exponent.clamp(min=-6.0) - 3)
    return torch.round(x / step) * step  # x / step is exact (a power of two); round: ties to even


def nvfp4_fake_quantize(hidden_states: torch.Tensor) -> torch.Tensor:
    """modeling_kolibri1_1:nvfp4_fake_quantize (round to NVFP4 and back: E2M1 values, one E4M3 scale
    per 16 values) with the E4M3 cast as :func:`round_to_e4m3` and ``copysign`` as a select."""
    blocks = hidden_states.float().unflatten(-1, (-1, 16))
    scale = round_to_e4m3((blocks.abs().amax(-1, keepdim=True) / 6).clamp(min=2.0**-9).clamp(max=448.0))
    scaled = blocks / scale
    magnitude = scaled.abs().clamp(max=6.0)
    step = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    rounded = torch.round(magnitude / step) * step
    # copysign: a negative value rounded to zero stays -0.0, as there
    signed = torch.where(scaled.signbit(), -rounded, rounded)
    return (signed * scale).flatten(-2).to(hidden_states.dtype)
