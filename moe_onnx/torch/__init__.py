"""PyTorch frontend: the ``cann.moe`` operators as torch ops that run, train and export.

``import moe_onnx.torch`` defines, for every ``cann.moe`` operator X, a torch custom op
``torch.ops.cann_moe.<snake_case(X)>`` and the function ``moe_onnx.torch.<snake_case(X)>``
(ONNX inputs positional, ONNX attributes keyword-only, outputs in ONNX order). They run the
op library's kernels on CPU tensors, differentiate through the matching ``cann.moe`` gradient
ops, trace under ``torch.export``/``torch.compile``, and export to ``cann.moe`` nodes with
:func:`translation_table` / :func:`export` (the dynamo exporter) or, after
:func:`register_legacy_symbolics`, with the legacy TorchScript exporter. Only this subpackage
imports torch.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (the frontend needs it; say how to get it)
except ModuleNotFoundError as _missing:
    if _missing.name != "torch":
        raise
    raise ModuleNotFoundError(
        "moe_onnx.torch needs PyTorch: pip install 'moe-onnx[torch]' (torch 2.13.0 CPU and onnxscript; add "
        "--extra-index-url https://download.pytorch.org/whl/cpu where pip would take a CUDA build)",
        name="torch",
    ) from None

from . import (
    autograd,  # noqa: F401  (registers the backward formulas)
    npu,
)
from .export import export
from .legacy import register_legacy_symbolics
from .ops import FUNCTIONS, OVERLOADS
from .stand_ins import install_stand_ins
from .translations import translation_table

globals().update({f.__name__: f for f in FUNCTIONS.values()})
globals().update(npu.NAMES)  # torch_npu's names (moe_onnx.torch.npu)

__all__ = (
    sorted(f.__name__ for f in FUNCTIONS.values())
    + sorted(npu.NAMES)
    + [
        "FUNCTIONS",
        "OVERLOADS",
        "export",
        "install_stand_ins",
        "npu",
        "register_legacy_symbolics",
        "translation_table",
    ]
)
