"""What :func:`moe_onnx.transformers.export_causal_lm` needs beyond ``moe_onnx.torch.export``.

* :data:`EXPORT_PATCHES` / :func:`export_patches`: rewrites applied only while exporting, for
  transformers constructs that compute with Python control flow on the sequence (loops over its
  tokens, chunks or query groups, ``.tolist()`` of values, branches on its length: ``torch.export``
  would unroll or specialise them for the example length) or that the exporter cannot convert;
  each computes the same values with tensor ops (``patches.py``), transformers' code restored after.
* :data:`UNEXPORTABLE`: constructs no rewrite covers, refused up front (:class:`ExportRefused`) by
  the module that holds them; their MoE blocks alone export (docs/transformers.md). None at present.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import patches


@dataclass(frozen=True)
class Unexportable:
    """A construct of a family's non-MoE code that no dynamic-length export computes."""

    module_class: str  # the class name whose presence in the model marks the construct
    where: str  # transformers module:function (or Class.method) holding it
    construct: str  # what it does with the sequence


#: model_type -> the construct its linear attention / indexer / scan holds. None in transformers 5.25.0:
#: the nine families once here (delta rules, Mamba, indexers, compressors) export through EXPORT_PATCHES
UNEXPORTABLE: dict[str, Unexportable] = {}


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


@dataclass(frozen=True)
class ExportPatch:
    """Rewrites of one family's transformers module, applied only while exporting."""

    what: str  # what is rewritten, and as what
    module: str  # the transformers module holding the originals
    replacements: Callable[[], dict[str, Any]]  # "name" or "Class.name" in module -> its rewrite
    #: the example sequence length the export traces at, from the model's config, where 7 would make a
    #: size the rewrite computes on 0 or 1 (which torch.export fixes as constants)
    example_length: Callable[[Any], int] | None = None


def _deepseek_v2_rewrites() -> dict[str, Any]:
    from transformers.modeling_rope_utils import dynamic_rope_update

    return {
        "DeepseekV2RotaryEmbedding.forward": dynamic_rope_update(patches.real_rotary),
        "apply_rotary_emb": patches.real_apply_rotary_emb,
    }


_GATED_DELTA_SCAN = (
    "the gated delta rule's Python loop over the sequence's chunks (torch_chunk_gated_delta_rule) as torch's "
    "scan operator, exported as an ONNX Scan"
)


def _kimi_rewrites(family: str) -> dict[str, Any]:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return {"chunk_kimi_delta_attention": patches.kimi_delta_attention(module.l2norm)}


#: traced at two chunks and more (torch_chunk_gated_delta_rule's chunk_size default, 64, its callers' too):
#: at one, torch.export fixes the chunk count
_TWO_CHUNKS = 2 * 64 + 3

#: model_type -> the rewrites export_causal_lm applies while exporting that family
EXPORT_PATCHES = {
    "deepseek_v2": ExportPatch(
        "complex rotary (torch.polar, view_as_complex in modeling_deepseek_v2:apply_rotary_emb) as real cos/sin "
        "arithmetic",
        "transformers.models.deepseek_v2.modeling_deepseek_v2",
        _deepseek_v2_rewrites,
    ),
    "kolibri1_1": ExportPatch(
        "the indexer's loop over query groups (Kolibri1_1Indexer.query_groups, starts.unique().tolist()) as one "
        "masked [queries, keys] grid in select_pool and select_tokens; nvfp4_fake_quantize's float8 cast as "
        "E4M3 rounding in float32",
        "transformers.models.kolibri1_1.modeling_kolibri1_1",
        lambda: {
            "Kolibri1_1Indexer.select_pool": patches.kolibri_select_pool,
            "Kolibri1_1Indexer.select_tokens": patches.kolibri_select_tokens,
            "nvfp4_fake_quantize": patches.nvfp4_fake_quantize,
        },
    ),
    "deepseek_v4": ExportPatch(
        "the compressors' branches on the window count (DeepseekV4HCACompressor / CSACompressor / Indexer.forward: "
        "a complete window or not, two or not, min(index_topk, windows)) and the attention's on its key count, as "
        "tensor ops over any number of windows (none an empty tensor); repeat_interleave(2) of the rotary as a stack",
        "transformers.models.deepseek_v4.modeling_deepseek_v4",
        lambda: {
            "apply_rotary_pos_emb": patches.deepseek_v4_apply_rotary_pos_emb,
            "DeepseekV4HCACompressor.forward": patches.deepseek_v4_hca_forward,
            "DeepseekV4CSACompressor.forward": patches.deepseek_v4_csa_forward,
            "DeepseekV4Indexer.forward": patches.deepseek_v4_indexer_forward,
            "DeepseekV4Attention.forward": patches.deepseek_v4_attention_forward,
        },
        lambda config: 2 * max(config.compress_rates.values()) + 3,  # two windows or more in every compressor
    ),
    "qwen4_exp": ExportPatch(
        "the QSA indexer's loop over every query (Qwen4ExpTextQSAIndexer._select_tokens, torch.nonzero per query) "
        "as one masked [queries, keys] grid, for queries whose visible keys are one run (the causal mask); ties "
        "to the earlier block",
        "transformers.models.qwen4_exp.modeling_qwen4_exp",
        lambda: {
            "Qwen4ExpTextQSAIndexer._select_tokens": patches.qwen4_exp_select_tokens,
            "torch_chunk_gated_delta_rule": patches.chunk_gated_delta_rule,
        },
        lambda config: _TWO_CHUNKS,
    ),
    **{
        family: ExportPatch(
            _GATED_DELTA_SCAN,
            f"transformers.models.{family}.modeling_{family}",
            lambda: {"torch_chunk_gated_delta_rule": patches.chunk_gated_delta_rule},
            lambda config: _TWO_CHUNKS,
        )
        for family in ("qwen3_next", "qwen3_5_moe", "lara_mini")
    },
    **{
        family: ExportPatch(
            "Kimi delta attention's Python loop over the sequence's chunks (chunk_kimi_delta_attention) as torch's "
            "scan operator, exported as an ONNX Scan",
            f"transformers.models.{family}.modeling_{family}",
            functools.partial(_kimi_rewrites, family),
            lambda config: _TWO_CHUNKS,
        )
        for family in ("kimi_linear", "bailing_hybrid")
    },
    "jamba": ExportPatch(
        "the Mamba scan's Python loop over the tokens (modeling_jamba:mamba_selective_scan) as torch's scan "
        "operator, exported as an ONNX Scan",
        "transformers.models.jamba.modeling_jamba",
        lambda: {"mamba_selective_scan": patches.jamba_selective_scan},
    ),
}


def patched_attributes(model_type: str) -> list[tuple[Any, str]]:
    """The (owner, attribute name) pairs :data:`EXPORT_PATCHES` rewrites for ``model_type``."""
    found = EXPORT_PATCHES.get(model_type)
    if found is None:
        return []
    module = importlib.import_module(found.module)
    pairs = []
    for dotted in found.replacements():
        *owner, name = dotted.split(".")
        pairs.append((getattr(module, owner[0]) if owner else module, name))
    return pairs


def family_patch(model: torch.nn.Module) -> ExportPatch | None:
    """The :data:`EXPORT_PATCHES` entry whose transformers module defines some module of ``model``
    (by module, not ``config.model_type``: a multimodal family's text model says ``<family>_text``)."""
    defined_in = {type(m).__module__ for m in model.modules()}
    return next((patch for patch in EXPORT_PATCHES.values() if patch.module in defined_in), None)


def example_length(model: torch.nn.Module) -> int:
    """The sequence length ``export_causal_lm`` traces ``model`` at: 7, or its family's rewrite's own."""
    found = family_patch(model)
    if found is None or found.example_length is None:
        return 7
    return found.example_length(model.config.get_text_config())  # type: ignore[union-attr,operator]


@contextlib.contextmanager
def _applied(patch: ExportPatch) -> Iterator[None]:
    """``patch``'s rewrites in place for the duration; the originals restored after, whatever happens."""
    replacements = patch.replacements()
    module = importlib.import_module(patch.module)
    saved = []
    try:
        for dotted, rewrite in replacements.items():
            *owner, name = dotted.split(".")
            target = getattr(module, owner[0]) if owner else module
            saved.append((target, name, target.__dict__[name]))
            setattr(target, name, rewrite)
        yield
    finally:
        for target, name, original in reversed(saved):
            setattr(target, name, original)


@contextlib.contextmanager
def export_patches(model: torch.nn.Module) -> Iterator[list[str]]:
    """Apply the :data:`EXPORT_PATCHES` of ``model``'s family for the duration; yields what was patched."""
    found = family_patch(model)
    if found is None:
        yield []
        return
    with _applied(found):
        yield [found.what]
