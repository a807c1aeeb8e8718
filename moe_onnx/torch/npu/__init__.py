"""torch_npu's names for our operators, so Ascend code runs on a CPU unchanged.

``from moe_onnx.torch.npu import npu_moe_re_routing`` works as it is; after
:func:`moe_onnx.torch.install_stand_ins`, so does ``import torch_npu`` (the module built from
:data:`NAMES`).

Each alias keeps torch_npu's signature (op-plugin's ``op_plugin/config/op_plugin_functions.yaml``)
and return order and calls our torch op. Arguments the ONNX op has no counterpart for
(quantisation, FRACTAL_NZ, key-value histograms, ...) are refused with a ``MoeOpError`` that
names them (:func:`.common.refuse`), never ignored. One module per family of operators, each
listing its names in ``__all__``; a new family is a module and an entry in :data:`FAMILIES`.
Every name is served through :func:`.common.checked`: its arguments are checked against the
signature its docstring opens with, before it runs (SPEC-layer 1.18 amended).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .common import checked

#: the modules holding torch_npu's names, one per family of operators
FAMILIES = ("routing", "gating", "dispatch", "combine", "layout", "mc2")

#: torch_npu name -> our function with torch_npu's signature
NAMES: dict[str, Callable] = {
    name: checked(name, getattr(module, name))
    for module in (importlib.import_module(f".{family}", __name__) for family in FAMILIES)
    for name in module.__all__
}

globals().update(NAMES)

from .layout import Format  # noqa: E402 - torch_npu.Format, beside the names

__all__ = sorted(NAMES) + ["FAMILIES", "Format", "NAMES"]
