"""transformers 5's MoE families on the ``cann.moe`` ops (the optional extra ``[transformers]``).

Importing this module registers the experts implementation ``"cann"`` with transformers'
experts interface (``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``), so that
``model.set_experts_implementation("cann")`` (or ``experts_implementation="cann"`` at
``from_pretrained`` / ``from_config``) computes every ``@use_experts_implementation``
experts module with MoeInitRoutingV3 -> GroupedMatmul -> SwiGlu -> GroupedMatmul ->
MoeFinalizeRoutingV2 (:mod:`.experts`). :func:`use_cann` does that, replaces each router a
gating op computes exactly (:mod:`.routers`), refuses by name the families whose experts do
not use the interface, and reports per block; :func:`export_causal_lm` writes the whole
causal LM as one ONNX model with a dynamic batch and sequence length. docs/transformers.md.
"""

from __future__ import annotations

try:
    import transformers as _transformers  # noqa: F401  (say how to get it)
except ModuleNotFoundError as _missing:
    if _missing.name != "transformers":
        raise
    raise ModuleNotFoundError(
        "moe_onnx.transformers needs transformers: pip install 'moe-onnx[transformers]'", name="transformers"
    ) from None

import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import moe_onnx.torch as mt

from . import routers, whole
from .experts import ExpertsRefused, cann_experts_forward

IMPLEMENTATION = "cann"
ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, cann_experts_forward)

#: MoE families of the pinned transformers whose experts bypass the experts interface
#: (model_type prefix -> why); any other model without an interface experts module is refused too
REFUSED = {
    "llama4": "Llama4's experts (Llama4TextExperts) run every token through every expert as dense batched "
    "matmuls, not through transformers' experts interface",
    "dbrx": "DBRX's experts (DbrxExperts) loop over experts in their own code, not through transformers' experts "
    "interface",
    "jetmoe": "JetMoE's mixture of attention and MLP experts (JetMoeMoE / JetMoeMoA) does not use transformers' "
    "experts interface",
    "switch_transformers": "Switch Transformers' top-1 encoder-decoder experts (a ModuleDict of dense MLPs) do not "
    "use transformers' experts interface",
    "nllb_moe": "NLLB-MoE's encoder-decoder experts (a ModuleDict of dense MLPs) do not use transformers' experts "
    "interface",
    "doge": "Doge's cross-domain MoE (embedding-based experts) does not use transformers' experts interface",
}


class ModelRefused(ValueError):
    """A model whose experts the ``"cann"`` implementation does not compute."""


class ExportRefused(ModelRefused):
    """A model :func:`export_causal_lm` cannot export whole: its non-MoE code computes with
    Python control flow on the sequence (:data:`whole.UNEXPORTABLE`); its MoE blocks export."""


@dataclass(frozen=True)
class BlockReport:
    """One MoE block after :func:`use_cann`: where its experts are and what its router became."""

    experts: str  # the experts module's name in the model
    router: str  # its sibling router's name ("" when none was found)
    gating: str  # the gating op now computing the router, or why it stayed torch

    def line(self) -> str:
        return f"{self.experts}: experts -> cann.moe chain; {self.router or 'router'}: {self.gating}"


def is_interface_experts(module: torch.nn.Module) -> bool:
    """Built by a ``@use_experts_implementation`` class (its ``__init__`` sets these flags)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "is_concatenated", "_is_expert_parallel"))


def _refusal(model: torch.nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
    for prefix, why in REFUSED.items():
        if model_type.startswith(prefix):
            return f"{type(model).__name__} ({model_type}): {why}; the 'cann' experts implementation cannot take it"
    return (
        f"{type(model).__name__} ({model_type or 'no model_type'}) has no experts module that uses transformers' "
        "experts interface (@use_experts_implementation): nothing for the 'cann' implementation to compute"
    )


def _router_of(parent: torch.nn.Module, experts: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The experts' sibling that routes to them: a ``top_k`` and a ``[E, H]`` weight."""
    for name, child in parent.named_children():
        weight = getattr(child, "weight", None)
        if child is experts or not hasattr(child, "top_k") or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() == 2 and weight.shape[0] == experts.num_experts:
            return name, child
    return None


def use_cann(model: Any, *, gating: bool = True) -> list[BlockReport]:
    """Switch ``model`` (a transformers ``PreTrainedModel``) to the cann.moe ops, in place.

    Sets the experts implementation ``"cann"`` (submodels included) and, with ``gating``,
    replaces each router that a gating op reproduces on probe inputs (:func:`routers.match`).
    Raises :class:`ModelRefused` naming the family when no experts module of the model uses
    the interface. Returns one :class:`BlockReport` per experts module.
    """
    model.set_experts_implementation(IMPLEMENTATION)
    names = {id(m): n for n, m in model.named_modules()}
    reports = []
    for parent_name, parent in model.named_modules():
        for child_name, experts in parent.named_children():
            if not is_interface_experts(experts):
                continue
            where = f"{parent_name}.{child_name}" if parent_name else child_name
            if experts.config._experts_implementation != IMPLEMENTATION:
                raise ModelRefused(
                    f"{where}: its config kept experts_implementation "
                    f"{experts.config._experts_implementation!r} after set_experts_implementation"
                )
            found = _router_of(parent, experts)
            if found is None:
                reports.append(BlockReport(where, "", "no router module beside the experts (left as it is)"))
                continue
            _, router = found
            dtype = (experts.gate_up_proj if experts.has_gate else experts.up_proj).dtype
            candidate = routers.match(router, dtype) if gating else None
            if candidate is not None:
                routers.install(router, candidate)
                verdict = candidate.name
            elif gating:
                verdict = "torch (no cann.moe gating op computes this router exactly)"
            else:
                verdict = "torch (gating not asked for)"
            router_where = names[id(router)]
            reports.append(BlockReport(where, router_where, verdict))
    if not reports:
        raise ModelRefused(_refusal(model))
    return reports


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def export_causal_lm(model: torch.nn.Module, path: str | os.PathLike, *, example: torch.Tensor | None = None, **kwargs):
    """Export ``input_ids [B, S] -> logits [B, S, V]`` with :func:`moe_onnx.torch.export`,
    ``B`` and ``S`` dynamic (no KV cache: every call is a prefill).

    Args:
        model: a causal LM (call :func:`use_cann` first for the cann.moe chain).
        path: where the ONNX model is written.
        example: example ``input_ids`` (default ``[2, 7]`` zeros; longer where the family's export
            rewrite needs it, :func:`whole.example_length`).
        kwargs: passed on to :func:`moe_onnx.torch.export`.
    Returns:
        The ``torch.onnx.ONNXProgram``.
    Raises:
        ExportRefused: the model's family holds a construct no dynamic-length export computes
            (:data:`whole.UNEXPORTABLE`), before anything is traced.

    Constructs the exporter cannot take but real arithmetic computes alike are rewritten while
    exporting (:data:`whole.EXPORT_PATCHES`: loops over chunks or tokens as scans, indexers as masked
    grids, DeepSeek-V2's complex rotary as real arithmetic; docs/transformers.md).
    """
    found = whole.unexportable(model)
    if found is not None:
        family, why = found
        raise ExportRefused(
            f"{type(model).__name__} ({family}): {why.module_class} {why.construct} ({why.where}); torch.export fixes "
            "that to the example's sequence length, so no export holds for every length. Its MoE blocks export "
            "alone (moe_onnx.torch.export of the sparse block)"
        )
    if example is None:
        example = torch.zeros(2, whole.example_length(model), dtype=torch.int64)
    dims = {0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim("sequence", min=1, max=65536)}
    with torch.no_grad(), whole.export_patches(model):
        return mt.export(_Logits(model).eval(), (example,), path, dynamic_shapes={"input_ids": dims}, **kwargs)


__all__ = [
    "IMPLEMENTATION",
    "REFUSED",
    "BlockReport",
    "ExportRefused",
    "ExpertsRefused",
    "ModelRefused",
    "cann_experts_forward",
    "export_causal_lm",
    "is_interface_experts",
    "use_cann",
]
