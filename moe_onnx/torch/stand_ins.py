"""Stand-in modules under the Ascend import names, so code written for Ascend imports unchanged.

:func:`install_stand_ins` puts modules named like the real ones into ``sys.modules``: after
it, ``import torch_npu`` gives a module holding :data:`moe_onnx.torch.npu.NAMES` (and
torch_npu's byte-storage dtype constants, ``torch_npu.hifloat8`` ...), ``import
cann_ops_transformer`` and ``cann_ops_transformer.ops`` the seeds' API
(:data:`moe_onnx.torch.ops_transformer.NAMES`), and ``import torchair`` /
``torchair.configs.compiler_config`` TorchAir's graph-mode entry points
(:mod:`moe_onnx.torch.graph_mode`: ``torch.compile`` with inductor). It provides operators
only (no ``torch.npu`` device, streams or ``.npu()``): the code must run on CPU tensors.
It is never called implicitly, and it refuses when a real module of one of those names is
importable, so a machine with real Ascend packages is never silently switched to
the CPU golden.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import graph_mode, npu, ops_transformer
from .npu.common import NPU_DTYPES


def _torch_npu() -> dict[str, Any]:
    return {**npu.NAMES, **NPU_DTYPES, "Format": npu.Format}


#: module name -> the names it holds (modules listed after their parent package)
STAND_INS: dict[str, Callable[[], dict[str, Any]]] = {
    "torch_npu": _torch_npu,
    "cann_ops_transformer": lambda: dict(ops_transformer.NAMES),
    "cann_ops_transformer.ops": lambda: dict(ops_transformer.NAMES),
    "torchair": lambda: dict(graph_mode.NAMES),
    "torchair.configs": dict,
    "torchair.configs.compiler_config": lambda: dict(graph_mode.CONFIG_NAMES),
}

_MARK = "__moe_onnx_stand_in__"


class RealModuleError(ImportError):
    """A real module of a stand-in's name is importable (or already imported)."""


def _real_module(name: str) -> str | None:
    """Where a real module ``name`` comes from, or None if there is none (or it is ours)."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return None if getattr(loaded, _MARK, False) else repr(loaded)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent that is not a package, or a broken spec
        return None
    return None if spec is None else str(spec.origin or spec.name)


def install_stand_ins() -> dict[str, ModuleType]:
    """Register the stand-ins in ``sys.modules`` and return them by name.

    Raises :class:`RealModuleError` (naming the module and where it lives) when a real
    ``torch_npu``, ``cann_ops_transformer`` or ``torchair`` (any stand-in's name) is importable;
    nothing is registered then.
    Calling it again returns the modules already registered.
    """
    # top-level names only: looking up a child (cann_ops_transformer.ops) would import a real parent
    tops = [name for name in STAND_INS if "." not in name]
    real = {name: where for name in tops if (where := _real_module(name)) is not None}
    if real:
        found = "; ".join(f"{name} at {where}" for name, where in real.items())
        raise RealModuleError(
            f"install_stand_ins: a real module is importable ({found}); the CPU stand-ins are only "
            "for machines without the Ascend packages (import moe_onnx.torch.npu directly instead)"
        )
    modules: dict[str, ModuleType] = {}
    for name, names in STAND_INS.items():
        module = sys.modules.get(name)
        if module is None:
            module = ModuleType(name, f"moe_onnx's CPU stand-in for {name} (moe_onnx.torch.install_stand_ins)")
            setattr(module, _MARK, True)
            module.__dict__.update(names())
            parent, _, child = name.rpartition(".")
            # importlib.util.find_spec(name) reads a loaded module's __spec__ and raises on None
            # (transformers' is_torch_npu_available does); no loader, no origin: nothing on disk
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=not parent)
            if parent:
                setattr(modules[parent], child, module)
            else:
                module.__path__ = []  # a package: its stand-in submodules import through sys.modules
            sys.modules[name] = module
        modules[name] = module
    return modules
