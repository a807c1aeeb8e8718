"""One call from a torch module to an ONNX model with ``cann.moe`` nodes."""

from __future__ import annotations

import contextlib
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
