"""``moe-onnx convert IN OUT``: the converters on model files, external data kept external.

The input is never written: OUT (and its data file) may not be IN or one of IN's files,
whatever links lead there, and the output is written under temporary names in OUT's folder
and renamed into place, so an interrupted conversion (SIGINT or SIGTERM) leaves no partial
OUT and no orphan data file.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import onnx_ir as ir

from .converters import ConversionError, ConversionReport, InsertRerouting
from .errors import UserError
from .interrupts import held, terminate_interrupts


def convert_file(source: str, target: str, strict: bool = False) -> ConversionReport:
    """Convert ``source`` into ``target``; ``source`` (and its external data) stay untouched.
    ``strict``: refuse a batch-specific graph (:class:`~moe_onnx.converters.BatchSpecificGraph`).

    Initializers in external data are referenced, not loaded, while converting; if the source
    had any, ``target`` gets its own ``<target name>.data`` file. Raises :class:`UserError` for
    an input that is not a model, an output that would overwrite the input's files, and a
    graph the pass refuses (:class:`~moe_onnx.converters.ConversionError`).
    """
    model = _load(source)
    source_files = [source] + sorted(
        {v.const_value.path for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)}
    )
    data_name = os.path.basename(target) + ".data" if len(source_files) > 1 else None
    _refuse_overwriting(source_files, target, "OUT")
    if data_name is not None:
        _refuse_overwriting(source_files, os.path.join(os.path.dirname(target), data_name), "OUT's data file")
    rewrite = InsertRerouting(strict=strict)
    try:
        rewrite(model)
    except ConversionError as refused:  # nothing changed; the message names the nodes
        raise UserError(f"{type(refused).__name__}: {refused}") from refused
    _save(model, target, data_name)
    return rewrite.report


def _load(source: str) -> ir.Model:
    if not os.path.isfile(source):
        raise UserError(f"input {source} does not exist or is not a file")
    if os.path.getsize(source) == 0:
        raise UserError(f"input {source} is empty")
    try:
        model = ir.load(source)
    except Exception as exc:  # protobuf's DecodeError names no file
        raise UserError(f"input {source} is not an ONNX model: {type(exc).__name__}: {exc}") from exc
    if not model.opset_imports:
        raise UserError(f"input {source} is not an ONNX model: it imports no opset")
    return model


def _same_file(a: str, b: str) -> bool:
    """Whether two paths lead to one file (symbolic links, hard links, linked folders)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def _refuse_overwriting(source_files: list[str], path: str, what: str) -> None:
    for source_file in source_files:
        if _same_file(source_file, path):
            kind = "the input model" if source_file == source_files[0] else "the input's external data"
            raise UserError(f"{what} {path} is {kind} {source_file}: the input is never overwritten")


def _save(model: ir.Model, target: str, data_name: str | None) -> None:
    """Write into a hidden folder beside ``target``, then rename the data file and the model
    into place (data first: a model never refers to missing data). Renaming replaces a link
    at ``target`` rather than writing through it."""
    folder = os.path.dirname(os.path.abspath(target))
    with terminate_interrupts():
        staging = tempfile.mkdtemp(prefix=".moe_onnx_convert_", dir=folder)
        try:
            staged = os.path.join(staging, os.path.basename(target))
            ir.save(model, staged, external_data=data_name)
            with held():
                if data_name is not None:
                    os.replace(os.path.join(staging, data_name), os.path.join(folder, data_name))
                os.replace(staged, target)
        finally:
            with held():
                shutil.rmtree(staging, ignore_errors=True)
