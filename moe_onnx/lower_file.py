"""``moe-onnx lower IN OUT [--inline]``: :func:`moe_onnx.converters.lower` on model files."""

from __future__ import annotations

import os

import onnx
import onnx_ir as ir

from .converters import lower
from .converters.lower import graphs


def lower_file(source: str, target: str, inline: bool = False) -> onnx.ModelProto:
    """Lower ``source`` into ``target``; ``source`` (and its external data) stay untouched.

    Initializers in external data are not loaded while lowering (the pass never reads
    them); if the source had any, ``target`` gets its own ``<target name>.data`` file,
    copied from the source's. Returns the lowered model as saved (external data not loaded).
    """
    if os.path.abspath(source) == os.path.abspath(target):
        raise ValueError("the output must be a new file: the input model is never overwritten")
    lowered = lower(onnx.load(source, load_external_data=False), inline=inline)
    external = any(
        tensor.data_location == onnx.TensorProto.EXTERNAL for g in graphs(lowered.graph) for tensor in g.initializer
    )
    if not external:
        onnx.save(lowered, target)
        return lowered
    model = ir.serde.deserialize_model(lowered)
    ir.external_data.set_base_dir(model.graph, os.path.dirname(os.path.abspath(source)))
    ir.save(model, target, external_data=os.path.basename(target) + ".data")
    return onnx.load(target, load_external_data=False)
