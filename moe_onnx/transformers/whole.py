"""What :func:`moe_onnx.transformers.export_causal_lm` needs beyond ``moe_onnx.torch.export``.

* :data:`UNEXPORTABLE`: families whose non-MoE layers compute with Python control flow on the
  sequence (loops over its chunks or tokens, ``.tolist()`` of values, branches on its length):
  ``torch.export`` unrolls or specialises them for the example length, so no one export holds
  for every sequence length. They are refused up front (:class:`ExportRefused`), by the module
  that holds the construct; their MoE blocks alone export (docs/transformers.md).
* :func:`export_patches`: rewrites applied only while exporting, for transformers constructs the
  exporter cannot take but real arithmetic computes the same (DeepSeek-V2's complex rotary).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Unexportable:
    """A construct of a family's non-MoE code that no dynamic-length export computes."""

    module_class: str  # the class name whose presence in the model marks the construct
    where: str  # transformers module:function (or Class.method) holding it
    construct: str  # what it does with the sequence


_DELTA_RULE = "loops in Python over the sequence's chunks (the chunk count is the padded length / chunk size)"
_KIMI_DELTA = "pads the sequence to whole chunks and loops in Python over them"

#: model_type -> the construct its linear attention / indexer / scan holds
UNEXPORTABLE: dict[str, Unexportable] = {
    "qwen3_next": Unexportable(
        "Qwen3NextGatedDeltaNet",
        "transformers.models.qwen3_next.modeling_qwen3_next:torch_chunk_gated_delta_rule",
        _DELTA_RULE,
    ),
    "qwen3_5_moe": Unexportable(
        "Qwen3_5MoeGatedDeltaNet",
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe:torch_chunk_gated_delta_rule",
        _DELTA_RULE,
    ),
    "lara_mini": Unexportable(
        "LaraMiniGatedDeltaNet",
        "transformers.models.lara_mini.modeling_lara_mini:torch_chunk_gated_delta_rule",
        _DELTA_RULE,
    ),
    "kimi_linear": Unexportable(
        "KimiLinearDeltaAttention",
        "transformers.models.kimi_linear.modeling_kimi_linear:chunk_kimi_delta_attention",
        _KIMI_DELTA,
    ),
    "bailing_hybrid": Unexportable(
        "BailingHybridDeltaAttention",
        "transformers.models.bailing_hybrid.modeling_bailing_hybrid:chunk_kimi_delta_attention",
        _KIMI_DELTA,
    ),
    "jamba": Unexportable(
        "JambaMambaMixer",
        "transformers.models.jamba.modeling_jamba:JambaMambaMixer.slow_forward",
        "scans the sequence token by token in a Python loop (for index in range(seq_len))",
    ),
    "kolibri1_1": Unexportable(
        "Kolibri1_1Indexer",
        "transformers.models.kolibri1_1.modeling_kolibri1_1:Kolibri1_1Indexer.query_groups",
        "loops over the values of the visible-key starts (starts.unique().tolist())",
    ),
    "qwen4_exp": Unexportable(
        "Qwen4ExpTextQSAIndexer",
        "transformers.models.qwen4_exp.modeling_qwen4_exp:Qwen4ExpTextQSAIndexer.forward",
        "loops in Python over every query (for query_idx in range(seq_length)) selecting keys by torch.nonzero",
    ),
    "deepseek_v4": Unexportable(
        "DeepseekV4HCACompressor",
        "transformers.models.deepseek_v4.modeling_deepseek_v4:DeepseekV4HCACompressor.forward",
        "branches in Python on the sequence length (a full compression window or not, seq_len == 1): the export "
        "keeps the example length's branch and fails in onnxruntime at other lengths",
    ),
}


def unexportable(model: torch.nn.Module) -> tuple[str, Unexportable] | None:
    """The family and construct that stops ``model`` exporting whole, or None.

    Found by the module holding the construct (a model of such a family built without it,
    its layers all full attention say, is not refused).
    """
    classes = {type(m).__name__ for m in model.modules()}
    for family, found in UNEXPORTABLE.items():
        if found.module_class in classes:
            return family, found
    return None


def _real_rotary(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """DeepseekV2RotaryEmbedding.forward with ``polar(1, f) * scaling`` as ``[..., D/2, 2]`` (cos, sin)."""
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack((torch.cos(freqs), torch.sin(freqs)), dim=-1) * self.attention_scaling


def _real_apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """deepseek_v2's apply_rotary_emb: (a + ib)(c + id) = (ac - bd) + i(ad + bc), on real pairs."""
    cos, sin = freqs.unsqueeze(1).unbind(-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


@contextlib.contextmanager
def _deepseek_v2_real_rotary() -> Iterator[None]:
    from transformers.modeling_rope_utils import dynamic_rope_update

    module: Any = importlib.import_module("transformers.models.deepseek_v2.modeling_deepseek_v2")
    rotary = module.DeepseekV2RotaryEmbedding
    saved = rotary.forward, module.apply_rotary_emb
    rotary.forward = dynamic_rope_update(_real_rotary)
    module.apply_rotary_emb = _real_apply_rotary_emb
    try:
        yield
    finally:
        rotary.forward, module.apply_rotary_emb = saved


#: model_type -> (what the patch does, the context manager applying it while exporting)
EXPORT_PATCHES = {
    "deepseek_v2": (
        "complex rotary (torch.polar, view_as_complex in modeling_deepseek_v2:apply_rotary_emb) as real cos/sin "
        "arithmetic",
        _deepseek_v2_real_rotary,
    ),
}


@contextlib.contextmanager
def export_patches(model: torch.nn.Module) -> Iterator[list[str]]:
    """Apply the :data:`EXPORT_PATCHES` of ``model``'s family for the duration; yields what was patched."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    with contextlib.ExitStack() as stack:
        applied = []
        if model_type in EXPORT_PATCHES:
            what, patch = EXPORT_PATCHES[model_type]
            stack.enter_context(patch())
            applied.append(what)
        yield applied
