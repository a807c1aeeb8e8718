"""``moe-onnx convert IN OUT``: the converters on model files, external data kept external."""

from __future__ import annotations

import os

import onnx_ir as ir

from .converters import ConversionReport, InsertRerouting


def convert_file(source: str, target: str, strict: bool = False) -> ConversionReport:
    """Convert ``source`` into ``target``; ``source`` (and its external data) stay untouched.
    ``strict``: refuse a batch-specific graph (:class:`~moe_onnx.converters.BatchSpecificGraph`).

    Initializers in external data are referenced, not loaded, while converting; if the source
    had any, ``target`` gets its own ``<target name>.data`` file.
    """
    if os.path.abspath(source) == os.path.abspath(target):
        raise ValueError("the output must be a new file: the input model is never overwritten")
    model = ir.load(source)
    external = any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    rewrite = InsertRerouting(strict=strict)
    rewrite(model)
    ir.save(model, target, external_data=os.path.basename(target) + ".data" if external else None)
    return rewrite.report
