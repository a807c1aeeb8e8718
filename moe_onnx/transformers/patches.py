"""Export-time rewrites of transformers code: the same values, computed with tensor ops only.

Each function here replaces one transformers function or method while
:func:`moe_onnx.transformers.export_causal_lm` exports (``whole.EXPORT_PATCHES`` says which
and restores the originals after). Where transformers loops in Python over queries or groups
of them, the rewrite computes every query at once over the whole ``[queries, keys]`` grid, as
the attention it masks already does; nothing loops or branches on data or on the sequence length.
"""

from __future__ import annotations

import math
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


# ---- DeepSeek-V4: the compressors without branches on the number of windows ----------------
# transformers branches on whether any window of `compress_rate` tokens is complete (a view
# with -1 cannot hold zero windows), on whether there are two (the overlap of the CSA series),
# on min(index_topk, windows) and on the attention's key count: every such shape test fixes the
# export to the example's length. Here zero windows are an empty tensor like any other count.
# Exported without a cache (export_causal_lm): the cache paths stay transformers'.


def _deepseek_v4() -> Any:
    import importlib

    return importlib.import_module("transformers.models.deepseek_v4.modeling_deepseek_v4")


def _no_cache(cache: Any) -> None:
    if cache is not None:
        raise NotImplementedError("moe_onnx's DeepSeek-V4 export rewrite computes the cache-less prefill only")


def deepseek_v4_apply_rotary_pos_emb(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> torch.Tensor:
    """modeling_deepseek_v4:apply_rotary_pos_emb with ``repeat_interleave(2)`` of cos / sin as a stack of
    each value beside itself (its export fixes a Reshape to the example's length)."""
    cos = torch.stack((cos, cos), dim=-1).flatten(-2).unsqueeze(unsqueeze_dim)
    sin = torch.stack((sin, sin), dim=-1).flatten(-2).unsqueeze(unsqueeze_dim)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = ((rope.float() * cos) + (_deepseek_v4().rotate_half(rope).float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _complete_windows(x: torch.Tensor, rate: int) -> torch.Tensor:
    """``[B, S, F]`` -> ``[B, S // rate, rate, F]``: the complete windows, none when ``S < rate``."""
    windows = x.shape[1] // rate
    return x[:, : windows * rate].reshape(x.shape[0], windows, rate, x.shape[-1])


def _overlapped(kv: torch.Tensor, gate: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSA layout ``[B, n, rate, 2 D]`` -> ``[B, n, 2 rate, D]``: window ``w`` holds window ``w - 1``'s
    first series then its own second one; before window 0, zero keys with ``-inf`` gates (weight 0)."""

    def previous(x: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.nn.functional.pad(x[..., :head_dim], (0, 0, 0, 0, 1, 0), value=fill)[:, :-1]

    return (
        torch.cat([previous(kv, 0.0), kv[..., head_dim:]], dim=2),
        torch.cat([previous(gate, float("-inf")), gate[..., head_dim:]], dim=2),
    )


def _compress(module: Any, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The softmax-gated sum over each window, normed and rotated at the window's first position."""
    compressed = module.kv_norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
    positions = torch.arange(compressed.shape[1], device=compressed.device) * module.compress_rate
    positions = positions.unsqueeze(0).expand(compressed.shape[0], -1)
    cos, sin = module.rotary_emb(compressed, position_ids=positions, layer_type=module.rope_layer_type)
    return _deepseek_v4().apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)


def _future_entries(position_ids: torch.Tensor, rate: int, entries: int) -> torch.Tensor:
    """``[B, S, T]``: entry ``w`` compresses tokens the query at ``t`` must not see: ``w >= (t + 1) // rate``."""
    threshold = (position_ids + 1) // rate
    return torch.arange(entries, device=position_ids.device) >= threshold.unsqueeze(-1)


def deepseek_v4_hca_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
    """DeepseekV4HCACompressor.forward without a cache: every complete window compressed (none is an empty
    tensor), and the causal bias over them always returned (empty when there are none; transformers returns
    None then, which adds the same nothing to the attention mask)."""
    _no_cache(cache)
    kv = _complete_windows(self.kv_proj(hidden_states), self.compress_rate)
    gate = _complete_windows(self.gate_proj(hidden_states), self.compress_rate) + self.position_bias
    compressed_kv = _compress(self, kv, gate).unsqueeze(1)
    batch, seq_len, _ = hidden_states.shape
    future = _future_entries(position_ids, self.compress_rate, compressed_kv.shape[2]).unsqueeze(1)
    block_bias = compressed_kv.new_zeros((batch, 1, seq_len, compressed_kv.shape[2])).masked_fill(future, float("-inf"))
    return compressed_kv, block_bias


def deepseek_v4_indexer_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
    """DeepseekV4Indexer.forward without a cache: ``index_topk`` indices per query, ``-1`` where
    transformers' ``min(index_topk, entries)`` has none or the entry is in the query's future.

    The scores are padded with ``index_topk`` entries of ``-inf`` so that ``topk`` takes a constant k;
    a padding index is past every query's threshold, so it comes out ``-1``, which the compressor
    drops as it drops transformers' own ``-1``.
    """
    _no_cache(cache)
    batch, seq_len, _ = hidden_states.shape
    kv = _complete_windows(self.kv_proj(hidden_states), self.compress_rate)
    gate = _complete_windows(self.gate_proj(hidden_states), self.compress_rate) + self.position_bias
    compressed_kv = _compress(self, *_overlapped(kv, gate, self.head_dim))
    cos_q, sin_q = self.rotary_emb(hidden_states, position_ids=position_ids, layer_type=self.rope_layer_type)
    q = self.q_b_proj(q_residual).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
    q = _deepseek_v4().apply_rotary_pos_emb(q, cos_q, sin_q).transpose(1, 2)
    index_scores = self.scorer(q, compressed_kv, hidden_states)  # [B, S, T]
    future = _future_entries(position_ids, self.compress_rate, compressed_kv.shape[1])
    index_scores = index_scores.masked_fill(future, float("-inf"))
    index_scores = torch.nn.functional.pad(index_scores, (0, self.index_topk), value=float("-inf"))
    top_k_indices = index_scores.topk(self.index_topk, dim=-1).indices
    threshold = ((position_ids + 1) // self.compress_rate).unsqueeze(-1)
    return torch.where(top_k_indices >= threshold, torch.full_like(top_k_indices, -1), top_k_indices)


def deepseek_v4_csa_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
    """DeepseekV4CSACompressor.forward without a cache: the overlapping windows at any count, then the
    indexer's picks as a bias over them (``-inf`` but where picked)."""
    _no_cache(cache)
    batch, seq_len, _ = hidden_states.shape
    kv = _complete_windows(self.kv_proj(hidden_states), self.compress_rate)
    gate = _complete_windows(self.gate_proj(hidden_states), self.compress_rate) + self.position_bias
    compressed_kv = _compress(self, *_overlapped(kv, gate, self.head_dim)).unsqueeze(1)
    top_k_indices = self.indexer(hidden_states, q_residual, position_ids, cache, layer_idx)  # [B, S, k]
    compressed_len = compressed_kv.shape[2]
    safe_indices = torch.where(top_k_indices >= 0, top_k_indices, torch.full_like(top_k_indices, compressed_len))
    block_bias = compressed_kv.new_full((batch, 1, seq_len, compressed_len + 1), float("-inf"))
    block_bias = block_bias.scatter(-1, safe_indices.unsqueeze(1), 0.0)
    return compressed_kv, block_bias[..., :compressed_len]


def deepseek_v4_attention_forward(
    self, hidden_states, position_embeddings, position_ids, attention_mask, cache=None, **kwargs
):
    """DeepseekV4Attention.forward without a cache, the compressor's bias always appended to the mask
    (transformers appends it when the compressed keys are more than none: a test on the length)."""
    _no_cache(cache)
    _no_cache(kwargs.pop("past_key_values", None))
    module = _deepseek_v4()
    hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    cos, sin = position_embeddings[self.rope_layer_type]
    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_norm(self.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2))
    q = module.apply_rotary_pos_emb(q, cos, sin)
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
    kv = module.apply_rotary_pos_emb(kv, cos, sin)
    if self.compressor is not None:  # a layer kind, not the sequence
        compressed_kv, block_bias = self.compressor(hidden_states, q_residual, position_ids, None, self.layer_idx)
        kv = torch.cat([kv, compressed_kv], dim=2)
        if isinstance(attention_mask, torch.Tensor):
            attention_mask = torch.cat([attention_mask, block_bias.to(attention_mask.dtype)], dim=-1)
    attention_interface = module.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, module.eager_attention_forward
    )
    attn_output, attn_weights = attention_interface(
        self,
        q,
        kv,
        kv,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=self.sliding_window,
        s_aux=self.sinks,
        **kwargs,
    )
    # undo the rope on the output's rope slice (K = V carried it), as transformers does
    attn_output = module.apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = attn_output.reshape(*hidden_states.shape[:-1], self.config.o_groups, -1)
    grouped = self.o_a_proj(grouped).flatten(2)
    return self.o_b_proj(grouped), attn_weights


# ---- Qwen4-Exp: the QSA indexer's per-query loop as one masked grid -------------------------


def _runs_from_first_visible(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's first visible key and visible-key count, ``[B, Q]`` (its keys being one run)."""
    return visible.int().argmax(-1), visible.sum(-1)


def qwen4_exp_select_tokens(self, hidden_states, q, raw_keys, full_cos, full_sin, attention_mask, **kwargs):
    """Qwen4ExpTextQSAIndexer._select_tokens for every query at once, for queries whose visible keys
    are one run (causal, left-padded or sliding masks: what ``export_causal_lm`` feeds, a causal mask).

    transformers cuts each query's visible keys into blocks of ``compress_ratio`` from its first one,
    keeps the ``block_topk`` blocks whose pooled, normed, rotated key scores highest, and the tail that
    fills no block. A block of a run is fixed by its first key ``a``: the block keys of every ``a`` are
    computed once, scored against every query, and each query reads its own ``a = s + j c`` back.
    Ties go to the earlier block; transformers' ``topk`` leaves the order of equal scores unspecified.
    """
    from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

    ratio, key_count = self.compress_ratio, attention_mask.shape[-1]
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    visible = visible[:, 0].expand(hidden_states.shape[0], -1, -1)  # [B, Q, K]
    starts, counts = _runs_from_first_visible(visible)
    padded = torch.nn.functional.pad(raw_keys, (0, 0, 0, ratio - 1))
    groups = torch.stack([padded[:, r : r + key_count] for r in range(ratio)], dim=2)  # [B, K, c, D]
    pooled = self.k_layernorm(groups.float().mean(dim=2).to(raw_keys.dtype))
    block_keys = apply_rotary_pos_emb(pooled.unsqueeze(2), cos=full_cos, sin=full_sin, unsqueeze_dim=2).squeeze(2)
    logits = torch.matmul(q.float(), block_keys.float().transpose(-1, -2).unsqueeze(1))  # [B, Q, H, K]
    scores_by_start = logits.relu().sum(dim=2) / math.sqrt(self.index_head_dim)  # [B, Q, first key of the block]

    block = torch.arange(key_count, device=visible.device)  # j; at most K blocks per query
    complete = block < (counts // ratio)[..., None]
    first_keys = (starts[..., None] + block * ratio).clamp(max=key_count - 1)
    scores = scores_by_start.gather(-1, first_keys).masked_fill(~complete, float("-inf"))
    chosen_blocks = top_k_mask_lowest_ties(scores, self.block_topk) & complete
    offset = block - starts[..., None]  # key's place in its query's run
    in_chosen = chosen_blocks.gather(-1, offset.clamp(min=0) // ratio)
    tail = offset >= (counts // ratio * ratio)[..., None]
    return (visible & (in_chosen | tail) & (offset >= 0)).unsqueeze(1)


# ---- Jamba: the Mamba scan as torch's scan operator (an ONNX Scan) ---------------------------


def jamba_selective_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """modeling_jamba:mamba_selective_scan's recurrent path, ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``,
    ``y_t = C_t h_t``, with its Python loop over the tokens as ``torch._higher_order_ops.scan`` (exported
    as an ONNX Scan: one state of ``[B, I, N]`` carried, memory linear in the length, as there)."""
    from torch._higher_order_ops.scan import scan

    input_dtype = hidden_states.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # [B, I, S, N]
    deltaB_u = dt[:, :, :, None] * B.transpose(1, 2)[:, None, :, :].float() * hidden_states[:, :, :, None].float()

    def step(state: torch.Tensor, token: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        decay, update, c = token  # [B, I, N], [B, I, N], [B, N]
        state = decay * state + update
        return state.clone(), torch.matmul(state.to(input_dtype), c.unsqueeze(-1))[:, :, 0]

    # transformers' state starts as zeros of the input dtype and is float32 from the first step on
    initial = deltaB_u.new_zeros(deltaB_u[:, :, 0].shape)
    last_state, scan_output = scan(step, initial, (discrete_A, deltaB_u, C), dim=2)  # C: [B, N, S]
    if D is not None:
        scan_output = scan_output + hidden_states * D[None, :, None]
    if z is not None:
        scan_output = scan_output * torch.nn.functional.silu(z)
    return (scan_output, last_state) if return_last_state else scan_output


# ---- the gated delta rule (Qwen3-Next and kin): the loop over chunks as a scan --------------


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """modeling_qwen3_next:torch_chunk_gated_delta_rule (the same in Qwen3.5-MoE, Lara-Mini, Qwen4-Exp)
    with its Python loop over the chunks as ``torch._higher_order_ops.scan`` (an ONNX Scan carrying the
    ``[B, H, Dk, Dv]`` recurrent state, memory linear in the length, as there); the rest as there,
    step for step, the triangular solve included (transformers' own branch for exporting)."""
    from torch._higher_order_ops.scan import scan
    from transformers.utils.import_utils import is_torchdynamo_exporting

    initial_dtype = query.dtype
    batch_size, sequence_length, num_k_heads, k_head_dim = key.shape
    num_v_heads, v_head_dim = value.shape[-2:]
    decay = g
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (query, key, value, beta, decay)
    ]
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6) for x in (query, key))
    query = query * query.shape[-1] ** -0.5
    pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
    query, key, value = (torch.nn.functional.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (torch.nn.functional.pad(x, (0, pad_size)) for x in (beta, decay))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise_decay = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(strictly_upper_mask, float("-inf"))
    pairwise_decay = pairwise_decay.exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    if not is_torchdynamo_exporting():
        new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
        k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    else:  # transformers' forward substitution over the chunk's rows (a constant count)
        ut_system = -ut_system.tril(-1)
        for i in range(1, chunk_size):
            row = ut_system[..., i, :i].clone()
            sub = ut_system[..., :i, :i].clone()
            ut_system[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
        ut_system = ut_system + torch.eye(chunk_size, dtype=ut_system.dtype, device=ut_system.device)
        new_values, k_cumdecay = ut_system @ v_beta, ut_system @ decayed_k_beta
    if initial_state is None:
        initial = new_values.new_zeros((batch_size, num_v_heads, k_head_dim, v_head_dim))
    else:
        initial = initial_state.to(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]

    def step(state: torch.Tensor, chunk: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        values, k_decayed, q, attn, k, chunk_decay_i = chunk
        v_new = values - k_decayed @ state
        out = q @ state + attn @ v_new
        return state * chunk_decay_i + k.transpose(-1, -2) @ v_new, out

    last_state, core_attn_out = scan(
        step, initial, (new_values, k_cumdecay, query, intra_chunk_attn, key, chunk_decay), dim=2
    )
    core_attn_out = core_attn_out.reshape(batch_size, num_v_heads, -1, v_head_dim)[:, :, :sequence_length]
    core_attn_out = core_attn_out.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format)
    return core_attn_out, (last_state if output_final_state else None)


# ---- Kimi delta attention (Kimi-Linear, Bailing-Hybrid): the loop over chunks as a scan ------


def kimi_delta_attention(l2norm: Any) -> Any:
    """modeling_kimi_linear:chunk_kimi_delta_attention (the same in Bailing-Hybrid), ``l2norm`` its
    module's, with its Python loop over the chunks as ``torch._higher_order_ops.scan`` (an ONNX Scan
    carrying the ``[B, H, Dk, Dv]`` state); the rest as there, step for step."""

    def chunk_kimi_delta_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        chunk_size: int = 64,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from torch._higher_order_ops.scan import scan

        pad = torch.nn.functional.pad
        initial_dtype = query.dtype
        query, key, value, beta, g = [
            x.transpose(1, 2).contiguous().to(torch.float32) for x in (query, key, value, beta, g)
        ]
        if use_qk_l2norm_in_kernel:
            query = l2norm(query, dim=-1, eps=1e-6)
            key = l2norm(key, dim=-1, eps=1e-6)
        batch_size, num_heads, sequence_length, k_head_dim = key.shape
        v_head_dim = value.shape[-1]
        scale = 1 / (query.shape[-1] ** 0.5)
        pad_size = (chunk_size - sequence_length % chunk_size) % chunk_size
        query = pad(query, (0, 0, 0, pad_size)) * scale
        key, value, g = (pad(x, (0, 0, 0, pad_size)) for x in (key, value, g))
        beta = pad(beta, (0, pad_size))
        v_beta = value * beta.unsqueeze(-1)
        k_beta = key * beta.unsqueeze(-1)
        query, key, value, g, k_beta, v_beta = [
            x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
            for x in (query, key, value, g, k_beta, v_beta)
        ]
        g = g.cumsum(dim=-2)
        ones = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device)
        mask, strict_mask = torch.triu(ones, diagonal=0), torch.triu(ones, diagonal=1)
        decay_mask = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict_mask[..., None], float("-inf"))
        decay_mask = decay_mask.exp().float()
        attn = -(k_beta.unsqueeze(-2) * key.unsqueeze(-3) * decay_mask).sum(dim=-1).masked_fill(mask, 0)
        for i in range(1, chunk_size):  # forward substitution over the chunk's rows (a constant count)
            row = attn[..., i, :i].clone()
            sub = attn[..., :i, :i].clone()
            attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
        attn = attn + torch.eye(chunk_size, dtype=attn.dtype, device=attn.device)
        value = attn @ v_beta
        k_cumdecay = attn @ (k_beta * g.exp())
        if initial_state is None:
            initial = value.new_zeros((batch_size, num_heads, k_head_dim, v_head_dim))
        else:
            initial = initial_state.to(value)

        def step(state: torch.Tensor, chunk: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
            q_i, k_i, v_i, g_i, decay_i, k_cumdecay_i = chunk
            attn_inter = (q_i * g_i.exp()) @ state
            attn_intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay_i).sum(dim=-1).masked_fill(strict_mask, 0)
            v_new = v_i - k_cumdecay_i @ state
            state = (
                state * g_i[:, :, -1].exp().unsqueeze(-1)
                + (k_i * (g_i[:, :, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
            )
            return state, attn_inter + attn_intra @ v_new

        last_state, core_attn_out = scan(step, initial, (query, key, value, g, decay_mask, k_cumdecay), dim=2)
        core_attn_out = core_attn_out.reshape(batch_size, num_heads, -1, v_head_dim)[:, :, :sequence_length]
        core_attn_out = core_attn_out.transpose(1, 2).contiguous().to(initial_dtype)
        return core_attn_out, (last_state if output_final_state else None)

    return chunk_kimi_delta_attention
