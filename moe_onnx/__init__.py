"""moe-onnx: CANN's MoE routing operators as ONNX custom ops that run in onnxruntime.

``import moe_onnx`` registers every ``cann.moe`` schema with ``onnx.defs`` (through the op
library, :mod:`moe_onnx.custom_ops`). The onnxruntime side — sessions, the
onnxruntime-extensions glue — loads on first use of a name that needs it (PEP 562), so the
op library and the converters import without onnxruntime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .custom_ops import DOMAIN, OPS, OPSET_VERSION, MoeOpError

#: the package's version, its one source (pyproject.toml reads it from here)
__version__ = "0.1.0"

# public name -> the module that defines it, imported when the name is first used
_LAZY = {
    "InferenceSession": ".runtime.session",
    "prepare_for_ort": ".runtime.prepare",
    "session_options": ".runtime.pyops",
    "single_node_model": ".builders",
    "lower": ".converters",
}

if TYPE_CHECKING:
    from .builders import single_node_model
    from .converters import lower
    from .runtime.prepare import prepare_for_ort
    from .runtime.pyops import session_options
    from .runtime.session import InferenceSession


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    else:  # a submodule, e.g. moe_onnx.ranks, as if it had been imported
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as missing:
            if missing.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "DOMAIN",
    "OPS",
    "OPSET_VERSION",
    "InferenceSession",
    "lower",
    "MoeOpError",
    "prepare_for_ort",
    "session_options",
    "single_node_model",
]
