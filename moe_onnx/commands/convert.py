"""``moe-onnx convert IN OUT`` and ``moe-onnx fuse IN OUT``: the converters on model files, external data kept external.

IN is a model file, a folder of ``rank{r}.onnx`` or a path with ``{r}``; OUT is then a file,
a folder (made if missing) or a path with ``{r}`` (:func:`moe_onnx.ranks.rank_files.output_pairs`).
Every model is converted before any is written, so a refused rank leaves OUT as it was. The
input is never written (:mod:`moe_onnx.commands.model_files`: no links back to it, output written
under temporary names and renamed into place).
"""

from __future__ import annotations

from ..converters import ConversionError, ConversionReport, InsertRerouting
from ..converters.fuse_moe import FuseMoe, FuseReport
from ..errors import UserError
from . import model_files

#: what ``moe-onnx convert`` says of a model without an all-to-all (what convert needs, what else to do)
NO_ALL_TO_ALL = (
    "no all-to-all node, so nothing to convert (written unchanged): convert rewrites the chunk sort after "
    "an expert-parallel AllToAll (docs/converters.md); a single-device model runs as it is "
    "(moe-onnx run IN), or in stock onnxruntime after moe-onnx lower IN OUT"
)


def convert_model(source: str, target: str, strict: bool = False) -> tuple[model_files.Pending, ConversionReport]:
    """``source`` converted, ready to be written to ``target``, and the pass's report.
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
        raise UserError(f"{source}: {type(refused).__name__}: {refused}") from refused
    pending = model_files.Pending(model, target, data_name)
    if not rewrite.report.entries:
        pending.note = NO_ALL_TO_ALL
    return pending, rewrite.report


def convert_file(source: str, target: str, strict: bool = False) -> ConversionReport:
    """Convert ``source`` into ``target`` (see :func:`convert_model`); ``source`` (and its
    external data) stay untouched."""
    pending, report = convert_model(source, target, strict)
    pending.save()
    return report


def fuse_model(source: str, target: str) -> tuple[model_files.Pending, FuseReport]:
    """``source`` with its MoE blocks fused (:func:`moe_onnx.converters.fuse_moe`), ready to be
    written to ``target`` (external data as :func:`convert_model` keeps it), and the report."""
    model = model_files.load(source)
    data_name = model_files.output_data_name(source, model, target)
    fuse = FuseMoe()
    fuse(model)
    return model_files.Pending(model, target, data_name), fuse.report
