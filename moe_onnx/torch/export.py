"""One call from a torch module to an ONNX model with ``cann.moe`` nodes."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import warnings
from collections.abc import Iterator

import torch

from .translations import translation_table


def export(module: torch.nn.Module, args: tuple, path: str | os.PathLike, *, dynamic_shapes=None, **kwargs):
    """Export ``module(*args)`` with ``torch.onnx.export(dynamo=True)`` and our translations.

    Args:
        module: the module; ``moe_onnx.torch`` ops, ``torch.distributed`` collectives (traced
            as torch's functional collectives) and stable sorts become ``cann.moe`` / ONNX nodes.
        args: example inputs.
        path: where the model is written (``moe_onnx.InferenceSession`` and ``moe-onnx run``
            take it as it is).
        dynamic_shapes: as for ``torch.export``, e.g. ``{"x": {0: torch.export.Dim("T")}}``
            for a dynamic token count.
        kwargs: passed on to ``torch.onnx.export`` (``custom_translation_table`` entries are
            added to ours).
    Returns:
        The ``torch.onnx.ONNXProgram``.
    """
    table = translation_table()
    table.update(kwargs.pop("custom_translation_table", None) or {})
    kwargs.setdefault("verbose", False)
    with _quiet_exporter():
        program = torch.onnx.export(
            module, args, dynamo=True, dynamic_shapes=dynamic_shapes, custom_translation_table=table, **kwargs
        )
    assert program is not None  # dynamo=True always returns the program
    static = static_where_dynamic(program, module, args, dynamic_shapes)
    if static:
        raise StaticExportError(
            f"export: {', '.join(static)} asked to be dynamic but the exported model fixes it "
            "(an op or argument specialised the size: a Python int computed from it, a .tolist(), "
            "a size passed where a constant goes); the model was not written"
        )
    program.save(os.fspath(path))
    return program


#: torch's own notices that say nothing about the user's model: the exporter's registry says
#: once per torchvision op that torchvision is absent, and torch's pytree warns of its own
#: deprecated LeafSpec while exporting (torch 2.13)
_REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"
_PYTREE_NOTICE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Hold back those notices (only those) while exporting."""
    logger = logging.getLogger(_REGISTRY_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PYTREE_NOTICE, category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)


class StaticExportError(ValueError):
    """``torch.onnx.export`` returned a model whose input dims are fixed where ``dynamic_shapes``
    asked for dynamic ones (it can fall back to a static export in silence)."""


def _asked_dynamic(spec) -> list[int]:
    """The dims of one input's ``dynamic_shapes`` entry that are asked to be dynamic (a ``Dim``,
    ``Dim.AUTO`` / ``DYNAMIC``, or a name)."""
    if isinstance(spec, dict):
        return [int(d) for d, v in spec.items() if v is not None and v is not torch.export.Dim.STATIC]
    if isinstance(spec, (list, tuple)):
        return [d for d, v in enumerate(spec) if v is not None and v is not torch.export.Dim.STATIC]
    return []


def static_where_dynamic(program, module: torch.nn.Module, args: tuple, dynamic_shapes) -> list[str]:
    """``"input NAME dim D"`` for each dim ``dynamic_shapes`` asks to be dynamic that the exported
    model's graph input fixes. Inputs are matched by position when every argument is one
    tensor (nested arguments are not checked)."""
    if dynamic_shapes is None or not all(isinstance(a, torch.Tensor) for a in args):
        return []
    names = list(inspect.signature(module.forward).bind(*args).arguments)
    if isinstance(dynamic_shapes, dict):
        specs = [dynamic_shapes.get(name) for name in names]
    else:
        specs = list(dynamic_shapes) + [None] * (len(args) - len(dynamic_shapes))
    inputs = list(program.model.graph.inputs)
    if len(inputs) != len(args):
        return []
    found = []
    for name, spec, value in zip(names, specs, inputs):
        for dim in _asked_dynamic(spec):
            if value.shape is not None and dim < len(value.shape) and isinstance(value.shape[dim], int):
                found.append(f"input {name} dim {dim} (exported as {value.shape[dim]})")
    return found
