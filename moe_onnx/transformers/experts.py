"""The ``"cann"`` experts implementation: transformers' experts forward as the cann.moe chain.

transformers 5 decorates each family's experts class with ``@use_experts_implementation``
(``transformers.integrations.moe``); its ``forward(hidden_states [T, H], top_k_index [T, K],
top_k_weights [T, K]) -> [T, H]`` then dispatches to the function registered under
``config._experts_implementation``. :func:`cann_experts_forward` is that function::

    MoeInitRoutingV3(x, ids)            -> rows [T*K, H] by expert, src->dst row index, counts [E] int64
    GroupedMatmul(rows, gate_up[, b])   -> [T*K, 2I]   (or up_proj [T*K, I] without a gate)
    SwiGlu  (silu(gate) * up, halves)   -> [T*K, I]    other gates / activations: the family's torch code
    GroupedMatmul(h, down[, b])         -> [T*K, H]    (+ the family's post-expert norm, if any)
    MoeFinalizeRoutingV2(out, index, scales=top_k_weights) -> [T, H]

The weights are used in place: transformers stores ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` (``transpose_weight=1``) or, for ``is_transposed`` families
(gpt-oss), ``[E, H, 2I]`` / ``[E, I, H]`` (``transpose_weight=0``).
"""

from __future__ import annotations

from typing import Any

import torch

# transformers' own SiLU class, and torch's (ACT2FN["swish"])
from transformers.activations import SiLUActivation
from transformers.integrations.moe import _default_apply_gate

import moe_onnx.torch as _mt

mt: Any = _mt  # the op functions are set at import (globals().update): untyped for mypy


class ExpertsRefused(RuntimeError):
    """An experts module the ``"cann"`` implementation cannot compute exactly."""


def uses_swi_glu(experts: Any) -> bool:
    """True when the gate is transformers' default ``act_fn(gate) * up`` over the two halves of
    ``[gate | up]`` with SiLU as ``act_fn`` (what SwiGlu computes); the default gate splits by
    halves whatever ``is_concatenated`` says, so an interleaved family brings its own gate."""
    default_gate = getattr(type(experts), "_apply_gate", None) is _default_apply_gate
    return default_gate and isinstance(getattr(experts, "act_fn", None), (SiLUActivation, torch.nn.SiLU))


def _bias(experts: Any, name: str, x: torch.Tensor) -> torch.Tensor | None:
    """``[E, N]`` bias of a projection, or None; GroupedMatmul adds it in float32 (float16
    with float16 rows), so only a bfloat16 bias is widened (a copy of E*N values)."""
    if not experts.has_bias:
        return None
    bias = getattr(experts, name)
    return bias if bias.dtype == (torch.float16 if x.dtype == torch.float16 else torch.float32) else bias.float()


def _check(experts: Any) -> None:
    if getattr(experts, "_is_expert_parallel", False):
        raise ExpertsRefused(
            f"{type(experts).__name__}: the 'cann' experts implementation does not take transformers' expert "
            "parallelism (sentinel expert ids); shard the exported model instead (moe-onnx shard)"
        )


def cann_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``[T, H]``: ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t])``.

    Args:
        self: a ``@use_experts_implementation`` experts module (its flags ``has_gate``,
            ``has_bias``, ``is_transposed``, ``has_post_expert_norm``).
        hidden_states: ``[T, H]`` token rows.
        top_k_index: ``[T, K]`` (token, slot) -> expert id in ``[0, E)``.
        top_k_weights: ``[T, K]`` the weight of each (token, slot).
    Returns:
        ``[T, H]`` in ``hidden_states``' dtype.
    """
    _check(self)
    up_weight = self.gate_up_proj if self.has_gate else self.up_proj
    x = hidden_states.to(up_weight.dtype)
    transpose = 0 if self.is_transposed else 1  # [E, N, K] stored: GroupedMatmul swaps the last two axes
    # V3 (dropless, int64 counts: GroupedMatmul's group_list as it is, no Cast), the dispatch the
    # fuse writes too, so an export runs as the session's one-step chain (autograd: V2's grad op)
    rows, src_to_dst, group_list, _ = mt.moe_init_routing_v3(
        x, top_k_index.to(torch.int32), expert_num=self.num_experts, expert_tokens_num_type=1, expert_tokens_num_flag=1
    )
    h = mt.grouped_matmul(
        rows,
        up_weight,
        _bias(self, "gate_up_proj_bias" if self.has_gate else "up_proj_bias", x),
        group_list,
        group_type=0,
        group_list_type=1,
        transpose_weight=transpose,
    )
    if not self.has_gate:
        h = self.act_fn(h)
    elif uses_swi_glu(self):
        h = mt.swi_glu(h)
    else:
        h = self._apply_gate(h)
    out = mt.grouped_matmul(
        h.to(x.dtype),
        self.down_proj,
        _bias(self, "down_proj_bias", x),
        group_list,
        group_type=0,
        group_list_type=1,
        transpose_weight=transpose,
    )
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    y = mt.moe_finalize_routing_v2(out, src_to_dst, scales=top_k_weights.to(out.dtype), drop_pad_mode=2)
    return y.to(hidden_states.dtype)
