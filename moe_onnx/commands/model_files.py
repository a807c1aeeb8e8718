"""Model files for the commands that write one model from another (``convert``, ``lower``).

The input is never written: the output (and its data file) may not be the input or one of
its external-data files, whatever links lead there, and the output is written under
temporary names in its folder and renamed into place, so an interrupted write (SIGINT or
SIGTERM) leaves no partial output and no orphan data file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from ..errors import UserError
from ..interrupts import held, terminate_interrupts
from ..ranks.rank_files import check_output_file


def load(source: str) -> ir.Model:
    """``source`` with its external data referenced, not read; :class:`UserError` for a file
    that is missing, empty or not an ONNX model."""
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
    check_external_locations(
        source,
        (
            (value.name or "", os.fspath(value.const_value.location))
            for graph in model.graphs()
            for value in graph.initializers.values()
            if isinstance(value.const_value, ir.ExternalTensor)
        ),
    )
    return model


def external_locations(model: onnx.ModelProto) -> Iterator[tuple[str, str]]:
    """(tensor name, location) of every tensor of ``model`` kept in external data, subgraphs'
    and attributes' tensors included."""

    def in_graph(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
        yield from graph.initializer
        for node in graph.node:
            for attribute in node.attribute:
                yield from ([attribute.t] if attribute.HasField("t") else attribute.tensors)
                for subgraph in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                    yield from in_graph(subgraph)

    for tensor in in_graph(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((entry.value for entry in tensor.external_data if entry.key == "location"), "")
            yield tensor.name, location


def check_external_locations(source: str, locations: Iterable[tuple[str, str]]) -> None:
    """Refuse a model whose external data lies outside its folder (ONNX allows it only inside;
    onnx and onnx-ir refuse it later, with a traceback) or is missing (:class:`UserError`)."""
    folder = os.path.dirname(os.path.abspath(source))
    for name, location in locations:
        path = os.path.normpath(os.path.join(folder, location))
        if not location or os.path.isabs(location) or os.path.commonpath([folder, path]) != folder:
            raise UserError(
                f"{source}: tensor '{name}' keeps its data at {location!r}, outside the model's folder "
                f"{folder}: refused (ONNX reads external data only from inside the model's folder)"
            )
        if not os.path.isfile(path):
            raise UserError(f"{source}: tensor '{name}' keeps its data in {path}, which does not exist")


def output_data_name(source: str, model: ir.Model, target: str) -> str | None:
    """The name of ``target``'s data file (``<target name>.data``, None if ``model`` keeps no
    initializer outside the file), after refusing a ``target`` or data file that is one of
    ``source``'s files (:class:`UserError`)."""
    external = {
        value.const_value.path
        for graph in model.graphs()  # subgraphs' initializers too
        for value in graph.initializers.values()
        if isinstance(value.const_value, ir.ExternalTensor)
    }
    source_files = [source, *sorted(external)]
    folder = os.path.dirname(os.path.abspath(target))
    check_output_file(target, "OUT")  # a missing folder is made when the model is written
    _refuse_overwriting(source_files, target, "OUT")
    _refuse_replacing_a_non_model(target)
    if not external:
        return None
    data_name = os.path.basename(target) + ".data"
    _refuse_overwriting(source_files, os.path.join(folder, data_name), "OUT's data file")
    return data_name


@dataclass
class Pending:
    """A model made from an input, to be written to ``target`` (with ``data_name``, its
    external data file, if any) by :meth:`save`."""

    model: ir.Model
    target: str
    data_name: str | None
    #: a line for the user about what was written (e.g. a model passed through unchanged)
    note: str = ""

    def save(self) -> None:
        save(self.model, self.target, self.data_name)


def save(model: ir.Model, target: str, data_name: str | None) -> None:
    """Write into a hidden folder beside ``target``, then rename the data file and the model
    into place (data first: a model never refers to missing data). Renaming replaces a link
    at ``target`` rather than writing through it."""
    folder = os.path.dirname(os.path.abspath(target))
    os.makedirs(folder, exist_ok=True)
    with terminate_interrupts():
        try:
            staging = tempfile.mkdtemp(prefix=".moe_onnx_write_", dir=folder)
        except OSError as failed:
            raise UserError(f"OUT {target}: cannot write in {folder}: {failed.strerror}") from failed
        try:
            staged = os.path.join(staging, os.path.basename(target))
            ir.save(model, staged, external_data=data_name)
            with held():
                if data_name is not None:
                    os.replace(os.path.join(staging, data_name), os.path.join(folder, data_name))
                os.replace(staged, target)
        except OSError as failed:  # the staging folder's name means nothing to the user
            raise UserError(f"OUT {target}: could not be written: {failed.strerror or failed}") from failed
        finally:
            with held():
                shutil.rmtree(staging, ignore_errors=True)


def _refuse_replacing_a_non_model(path: str) -> None:
    """An existing file at OUT is replaced only when it is an ONNX model (an earlier output):
    a file of notes or a typo for another file is refused before any work."""
    if not os.path.isfile(path):
        return
    try:
        existing = onnx.load(path, load_external_data=False)
        is_model = bool(existing.opset_import) and existing.HasField("graph")
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and friends: not a model
        is_model = False
    if not is_model:
        raise UserError(
            f"OUT {path} exists and is not an ONNX model: refused, it would be replaced "
            "(remove it, or name another file or a folder)"
        )


def _same_file(a: str, b: str) -> bool:
    """Whether two paths lead to one file (symbolic links, hard links, linked folders)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def _refuse_overwriting(source_files: list[str], path: str, what: str) -> None:
    """``path`` may be new, a file or a link (replaced, not written through); not one of
    ``source_files`` and not a folder or a device (a rename would replace it)."""
    if os.path.lexists(path) and not (os.path.islink(path) or os.path.isfile(path)):
        raise UserError(f"{what} {path} exists and is not a file")
    for source_file in source_files:
        if _same_file(source_file, path):
            kind = "the input model" if source_file == source_files[0] else "the input's external data"
            raise UserError(f"{what} {path} is {kind} {source_file}: the input is never overwritten")
