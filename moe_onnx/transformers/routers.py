"""Routers as cann.moe gating ops, where a gating op computes exactly what the router does.

A router is the experts' sibling module that maps ``hidden_states`` to ``(router_logits,
top_k_weights [T, K], top_k_index [T, K])``. Which gating op it is is not read from its
class: each :class:`Candidate` computes one known routing from the router's parameters,
and the first whose outputs equal the router's own on probe inputs (the same experts, in
any slot order, and weights within :data:`RTOL`) replaces its forward. Routers no candidate
reproduces stay as they are.

* ``softmax(logits) -> top-k [-> / sum]`` (Mixtral, Qwen2/3-MoE, OLMoE, ...):
  MoeGatingTopKSoftmax on float32 logits, the renormalisation in torch (as the NPU's
  callers do);
* DeepSeek-V3's ``sigmoid -> + bias -> top-2-sum groups -> top-k -> / (sum + 1e-20) *
  scaling``: MoeGatingTopK (``norm_type`` 1, ``group_select_mode`` 1).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import moe_onnx.torch as _mt

mt: Any = _mt  # the op functions are set at import (globals().update): untyped for mypy

#: weights may differ by the gating ops' single rounding (float64 inside, rounded once)
RTOL = 1e-5
PROBE_TOKENS = 64


def _logits(router: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``[T, E]`` ``hidden @ weight.T (+ bias)`` in the router's own dtype."""
    bias = getattr(router, "bias", None)
    return F.linear(hidden.reshape(-1, router.weight.shape[1]), router.weight, bias)


def softmax_top_k(renorm: bool, weights_in_logits_dtype: bool) -> Callable:
    """The softmax router's forward: MoeGatingTopKSoftmax over float32 logits."""

    def forward(self, hidden_states):
        logits = _logits(self, hidden_states)
        weights, index, _ = mt.moe_gating_top_k_softmax(logits.float(), k=self.top_k)
        if renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if weights_in_logits_dtype:
            weights = weights.to(logits.dtype)
        return logits, weights, index.to(torch.int64)

    return forward


def grouped_sigmoid(self, hidden_states):
    """DeepSeek-V3's router: MoeGatingTopK over float32 logits."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim).float(), self.weight.float())
    weights, index, _ = mt.moe_gating_top_k(
        logits,
        self.e_score_correction_bias.float(),
        k=self.top_k,
        k_group=self.topk_group,
        group_count=self.num_group,
        group_select_mode=1,
        norm_type=1,
        routed_scaling_factor=float(self.routed_scaling_factor),
        eps=1e-20,
    )
    return logits, weights, index.to(torch.int64)


@dataclass(frozen=True)
class Candidate:
    name: str  # what the report says
    forward: Callable
    needs: tuple[str, ...] = ()  # router attributes the forward reads

    def applies(self, router: torch.nn.Module) -> bool:
        return all(hasattr(router, a) for a in ("weight", "top_k", *self.needs))


CANDIDATES = [
    Candidate("MoeGatingTopKSoftmax", softmax_top_k(False, False)),
    Candidate("MoeGatingTopKSoftmax + renormalisation", softmax_top_k(True, False)),
    Candidate("MoeGatingTopKSoftmax", softmax_top_k(False, True)),
    Candidate("MoeGatingTopKSoftmax + renormalisation", softmax_top_k(True, True)),
    Candidate(
        "MoeGatingTopK (grouped sigmoid)",
        grouped_sigmoid,
        ("hidden_dim", "e_score_correction_bias", "topk_group", "num_group", "routed_scaling_factor"),
    ),
]


def _sorted_by_expert(weights: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = index.argsort(dim=-1)
    return weights.gather(-1, order), index.gather(-1, order)


def _same_routing(want: tuple, got: tuple) -> bool:
    """The same experts per token (slot order free), weights within RTOL, same dtypes."""
    (_, w_want, i_want), (_, w_got, i_got) = want, got
    if w_want.dtype != w_got.dtype or i_want.dtype != i_got.dtype or w_want.shape != w_got.shape:
        return False
    w_want, i_want = _sorted_by_expert(w_want.float(), i_want)
    w_got, i_got = _sorted_by_expert(w_got.float(), i_got)
    return bool(torch.equal(i_want, i_got)) and bool(torch.allclose(w_got, w_want, rtol=RTOL, atol=0))


def probe(router: Any, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Probe inputs ``[T, H]``: random rows at two scales (flat and peaked routings)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = router.weight.shape[1]
    rows = torch.randn(PROBE_TOKENS, hidden, generator=generator)
    return [(rows * scale).to(dtype) for scale in (1.0, 8.0)]


def match(router: Any, dtype: torch.dtype) -> Candidate | None:
    """The first candidate whose routing equals the router's on every probe, or None."""
    inputs = probe(router, dtype)
    with torch.no_grad():
        try:
            wants = [router(x) for x in inputs]
        except (RuntimeError, ValueError, TypeError, AttributeError, IndexError):
            return None  # a router that needs more than the hidden states (e.g. token ids: hash routing)
        if not all(isinstance(w, tuple) and len(w) == 3 for w in wants):
            return None
        for candidate in CANDIDATES:
            if not candidate.applies(router):
                continue
            try:
                gots = [candidate.forward(router, x) for x in inputs]
            except (RuntimeError, ValueError, TypeError, AttributeError, IndexError):  # cannot run: not this one
                continue
            if all(_same_routing(w, g) for w, g in zip(wants, gots)):
                return candidate
    return None


def install(router: torch.nn.Module, candidate: Candidate) -> None:
    """The router's forward becomes the candidate's (this instance only)."""
    router.forward = types.MethodType(candidate.forward, router)
