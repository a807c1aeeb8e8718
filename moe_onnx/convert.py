"""``moe-onnx convert IN OUT``: the converters on model files, external data kept external.

The input is never written (:mod:`moe_onnx.model_files`: no links back to it, output written
under temporary names and renamed into place).
"""

from __future__ import annotations

from . import model_files
from .converters import ConversionError, ConversionReport, InsertRerouting
from .errors import UserError


def convert_file(source: str, target: str, strict: bool = False) -> ConversionReport:
    """Convert ``source`` into ``target``; ``source`` (and its external data) stay untouched.
    ``strict``: refuse a batch-specific graph (:class:`~moe_onnx.converters.BatchSpecificGraph`).

    Initializers in external data are referenced, not loaded, while converting; if the source
    had any, ``target`` gets its own ``<target name>.data`` file. Raises :class:`UserError` for
    an input that is not a model, an output that would overwrite the input's files, and a
    graph the pass refuses (:class:`~moe_onnx.converters.ConversionError`).
    """
    model = model_files.load(source)
    data_name = model_files.output_data_name(source, model, target)
    rewrite = InsertRerouting(strict=strict)
    try:
        rewrite(model)
    except ConversionError as refused:  # nothing changed; the message names the nodes
        raise UserError(f"{type(refused).__name__}: {refused}") from refused
    model_files.save(model, target, data_name)
    return rewrite.report
