"""``moe-onnx lower IN OUT [--inline]``: :func:`moe_onnx.converters.lower` on model files.

IN and OUT as for ``moe-onnx convert`` (a file, a folder of ``rank{r}.onnx`` or a ``{r}``
path; every model is lowered before any is written). The input is never written
(:mod:`moe_onnx.commands.model_files`: no links back to it, output written under temporary names and
renamed into place).
"""

from __future__ import annotations

import os

import onnx
import onnx_ir as ir

from ..converters import lower
from ..converters.lower import default_opset, has_lowerable
from ..errors import UserError
from . import model_files

#: what ``moe-onnx lower`` says of a model it writes unchanged
NOTHING_TO_LOWER = "no cann.moe op to lower (collectives stay as they are): written unchanged"


def lower_model(source: str, target: str, inline: bool = False) -> model_files.Pending:
    """``source`` lowered, ready to be written to ``target``.

    Initializers in external data are not loaded while lowering (the pass never reads
    them); if the source had any, ``target`` gets its own ``<target name>.data`` file,
    copied from the source's. A model with no op to lower is passed through unchanged (with
    a note). Raises :class:`UserError` for an input that is not a model or imports an
    opset below what the bodies need, and for an output that would overwrite the
    input's files.
    """
    model = model_files.load(source)
    data_name = model_files.output_data_name(source, model, target)
    proto = ir.serde.serialize_model(model)  # external tensors stay references
    if not has_lowerable(proto):  # any opset will do: the model is written as it is
        return model_files.Pending(model, target, data_name, NOTHING_TO_LOWER)
    try:
        default_opset(proto)
    except ValueError as refused:
        raise UserError(f"input {source}: {refused}") from refused
    lowered = ir.serde.deserialize_model(lower(proto, inline=inline))
    ir.external_data.set_base_dir(lowered.graph, os.path.dirname(os.path.abspath(source)))
    return model_files.Pending(lowered, target, data_name)


def lower_file(source: str, target: str, inline: bool = False) -> onnx.ModelProto:
    """Lower ``source`` into ``target`` (see :func:`lower_model`); ``source`` (and its
    external data) stay untouched. Returns the lowered model as saved (external data not
    loaded)."""
    lower_model(source, target, inline).save()
    return onnx.load(target, load_external_data=False)


def lowered_functions(path: str) -> list[str]:
    """``name [overload]`` of each cann.moe function of the model at ``path``."""
    model = onnx.load(path, load_external_data=False)
    return [f"{f.name} [{f.overload}]" for f in model.functions if f.domain == "cann.moe"]
